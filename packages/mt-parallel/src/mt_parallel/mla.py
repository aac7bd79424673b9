"""Multi-head latent attention (MLA, DeepSeek-V2/V3) on tensor-parallel projections.

Shape suffixes: B batch, S tokens in the TP region (``T_seq/cp``), D model width, H query heads
(this TP rank's), N = ``qk_nope_head_dim``, R = ``qk_rope_head_dim``, E = N + R, V =
``v_head_dim``, Q = ``q_lora_rank``, C = ``kv_lora_rank``, P = R/2, L = (Q +) C + R the
latents' width, s the tokens of ``n`` (S/tp under sequence parallel, else S), T the tokens
whose keys are expanded (``T_seq`` under all-gather context parallelism, else S; under ring
attention a block of ``T_seq/cp`` at a time), X = C + R.

Math (``n`` the block's normalised input)::

    q_BSHE        = q_b(RMSNorm_q(q_a(n)))           or q_proj(n) when q_lora_rank is None
    q_nope, q_rot = split(q, [N, R])
    c_BSC, k_rot  = split(kv_a(n), [C, R])           k_rot: ONE rotary key shared by all heads
    k_nope, v     = split(kv_b(RMSNorm_kv(c)), [N, V]) per head
    q_rot, k_rot  = RoPE(q_rot), RoPE(k_rot)         YaRN frequencies, tables · attention_factor
    o             = softmax(σ · [q_nope, q_rot]·[k_nope, k_rot]ᵀ + causal) · v
    y             = o_proj(o)                        σ = softmax_scale_factor / sqrt(E)

σ's YaRN correction (``YarnConfig.softmax_scale_factor``, ``m(s, mscale_all_dim)²``) is folded
into q, so the core is the plain causal attention of :class:`~mt_parallel.CoreAttention`
(``scaled_dot_product_attention``'s own ``1/sqrt(E)``, document masking, context parallel as
below). RoPE uses the rotate-half layout; DeepSeek's checkpoints use
interleaved pairs, which the Hugging Face converter permutes into this layout (the dot products
are unchanged because q and k are permuted alike).

Tensor parallelism (Megatron's MLA): ``q_b``/``q_proj`` and ``kv_b`` are column parallel (heads
split), ``o_proj`` row parallel; the compressed projections ``q_a``, ``kv_a`` and their RMSNorms
are replicated (:class:`ReplicatedLinear`). The latents ``[RMSNorm_q(q_a(n)), RMSNorm_kv(c),
k_rot]`` (width Q + C + R) are the one input the column-parallel ``q_b``/``kv_b`` and the shared
rotary key read, and are prepared together like a column-parallel input: without sequence
parallel every TP rank computes them for all tokens and ``copy_to_group`` sums their gradient
over TP (each rank back-propagates only its own heads), so the replicated weights' gradients
stay identical across ranks.

Sequence parallel (Megatron-LM's MLA layout; Megatron gathers the normed q and kv latents in
its SP up-projections and the rotary key on its own, here one all-gather of their
concatenation): ``n`` is this rank's s = S/tp tokens. ``q_a``, ``kv_a`` and the latent RMSNorms
run on them, and the latents are all-gathered along the sequence (backward: reduce-scatter,
which sums the heads' contributions), so Q + C + R
values per token cross the TP group instead of D; ``q_b``/``kv_b`` then run on all S tokens
without a gather of their own, the core attention is unchanged and ``o_proj`` reduce-scatters
back to the shard. The norms run before the gather, on S/tp tokens rather than S. The replicated
weights now see only their rank's tokens, so their gradients are summed over TP as the SP
norms' are (``copy_to_group`` on the weight). Without ``q_lora_rank``, ``q_proj`` all-gathers
``n`` itself, as any SP column-parallel layer does.

Context parallelism (all-gather, ``cp_attention=all_gather``; Megatron-Core's "all-gather of
the compressed KV"): each cp rank holds the load-balanced chunks of
:mod:`mt_parallel.context_parallel` and all-gathers ``[RMSNorm_kv(c), RoPE(k_rot)]`` (X = C + R
values per token) with :func:`~mt_parallel.context_parallel.gather_sequence` (all-gather over
cp, chunks put in global order; backward: reduce-scatter, which sums every rank's share of a
token's gradient onto the rank that holds it), then runs ``kv_b`` on all ``T_seq`` tokens and
hands the core the whole sequence's K/V (``kv_gathered=True``: the core gathers nothing but the
document ids). Invariant: ``k_rot`` is rotated *before* the gather, by the rank's own tokens'
global positions (``positions_S``), so every gathered key carries its own rotation and none is
rotated again; q is rotated by the same tables. The gather runs after the TP preparation of
the latents (``copy_to_group``, or the SP gather along the sequence), so every TP rank of a cp
group gathers the same latent and expands its own heads; its gradient is summed over cp, then
over TP as above. Values handed to the cp all-gather per token, and to the reduce-scatter of
their gradient: before, the expanded ``k`` and ``v``, ``H·(E + V)`` per TP rank (DeepSeek-V3,
128 heads, E = 192, V = 128: 40,960/tp); now C + R at every tp (DeepSeek-V3: 512 + 64 = 576).
What it costs: ``kv_b`` (forward and both backward GEMMs) runs on ``T_seq`` tokens on every cp
rank instead of ``T_seq/cp``, ``2·T_seq·C·H·(N + V)`` forward FLOPs per rank; its weight
gradient on a rank is that rank's queries' share, summed over dp×cp by data parallelism like
every weight gradient. The whole sequence's expanded K/V exist on every rank as before (the
core keeps them for its backward); under selective recompute of the core its checkpoint now
holds them as its inputs, where it held the rank's own before. FP8: ``kv_b``'s input is the
whole sequence's latent, the same on every cp rank, so its current-scaling amax is the one
process's; its output gradient is the rank's share, quantized with the rank's scale before the
cp sum.

Context parallelism (ring, ``cp_attention=ring``): the ring passes the same latent
``[RMSNorm_kv(c) ; RoPE(k_rot)]`` (X = C + R per token, rotated by the rank's own positions as
above, after the TP preparation) instead of the expanded K/V, through
:func:`~mt_parallel.ring_attention.expanded_ring_attention`: at each of the ``cp`` steps a rank
expands the block it holds with ``kv_b`` (its own heads; :class:`_LatentExpansion`),
concatenates the shared rotary key, and runs the ring's block attention on it; document masks
and the load-balanced chunks are the ring's own. Backward: the ring receives each block again,
expands it again with its graph, and takes the block's ``dK, dV`` back through ``kv_b`` to a
latent gradient (``[dc ; Σ_heads dk_rot]``), which travels home around the ring as the expanded
``dK, dV`` did; ``kv_b``'s weight gradient is summed over the steps and handed to autograd as
the ring's input gradient (TP: each rank's slice; its cp sum is data parallelism's, as above).
The trade per ring step and rank: p2p bytes fall by ``H·(E + V)/(C + R)`` per block
(DeepSeek-V3: 40,960/tp over 576, 71× at tp=1; the gradient message alike), and ``kv_b`` runs
on one block of ``T_seq/cp`` tokens, so over the ring its forward GEMM covers ``T_seq`` tokens
per rank (cp× the local work, as under all-gather CP), and the backward covers them again with
the forward GEMM repeated before dgrad and wgrad (the ring keeps no expanded block: kept, they
would be the whole sequence's K/V). ``kv_b`` thus costs ``4·2·T_seq·C·H·(N + V)`` FLOPs per
rank and training step, a third more than under all-gather CP, for one expanded block in memory
at a time instead of the whole sequence's. FP8: each block is quantized with its own
current-scaling amax (one process and all-gather CP use the whole sequence's), so ring FP8 is
about one E4M3 rounding away from the one process's. Delayed scaling quantizes every block
with the step's one scale, from the history of ``kv_b``'s input amax, which must then be the
whole sequence's on every cp rank (one process's, and equal across cp, or a key would be
quantized differently by the ranks that attend to it). A rank expands only the early chunk of
the blocks of ranks before it, so its own record can miss their late chunks; after the ring
forward the layer MAX-reduces the recorded input amax over cp (one all-reduce of one value per
layer and micro-batch, delayed scaling only): every token is in some rank's own, wholly
expanded block, so the MAX is the whole sequence's. The weight's amax is the same on every
rank; the output gradient's is each rank's own, for the partial ``dK, dV`` of its queries that
only it quantizes (as under all-gather CP).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F

import mt_comm
from mt_fp8 import TensorRole, fp8_linear
from mt_fp8.ops import apply_rotary
from mt_parallel.attention import CoreAttention
from mt_parallel.context_parallel import gather_sequence
from mt_parallel.layers import (
    SEQUENCE_DIM,
    ColumnParallelLinear,
    RowParallelLinear,
    _ParallelLinear,
    scaled_init_std,
)
from mt_parallel.mappings import all_gather_grad_rs, copy_to_group, group_size
from mt_parallel.norm import RMSNorm
from mt_parallel.yarn import YarnConfig, yarn_cos_sin, yarn_frequencies


class ReplicatedLinear(_ParallelLinear):
    """``y = x Wᵀ (+ b)`` with the same full weight on every TP rank (MLA's compressions).

    A tensor-parallel layer with nothing to shard: it is initialised like the others (the same
    full matrix at every TP degree) and can run in FP8; its input is used as it is. Under
    sequence parallel the input is this rank's tokens, so the weight's gradient is summed over
    TP (``copy_to_group`` on the weight, as the SP norms do), FP8 current scaling reduces the
    input's and output gradient's amax over TP, and the FP8 weight is quantized at each call
    (the weight cache keys on the parameter itself, not the ``copy_to_group`` view).
    """

    tp_shard_dims: ClassVar[dict[str, int]] = {}

    def __init__(self, in_features: int, out_features: int, init_std: float) -> None:
        super().__init__(in_features, out_features, False, None, False, init_std, None, None)

    def _gemm_bias(self) -> torch.Tensor | None:
        return self.bias if self.has_bias else None

    def enable_fp8(self, recipe: Any = None, **fp8_kwargs: Any) -> None:
        if self.sequence_parallel:
            fp8_kwargs.setdefault("amax_reduction_roles", ("input", "grad_output"))
        super().enable_fp8(recipe, **fp8_kwargs)

    def forward(self, x_BSK: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return self.gemm(x_BSK)
        weight = copy_to_group(self.weight, self.tp_group)  # built without a bias
        plan = None if self._fp8 is None else self._fp8.linear_plan(x_BSK, None)
        return F.linear(x_BSK, weight) if plan is None else fp8_linear(x_BSK, weight, None, plan)


class MultiLatentAttention(torch.nn.Module):
    """MLA (module docstring): ``forward(n_BsD, positions_S, document_ids_BS) -> y_BsD``.

    ``latent_norm_eps`` is the epsilon of the two latent RMSNorms (DeepSeek: 1e-6).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        rope_theta: float = 10000.0,
        yarn: YarnConfig | None = None,
        latent_norm_eps: float = 1e-6,
        dropout: float = 0.0,
        num_layers: int = 1,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        sizes = {
            "dim": dim, "num_heads": num_heads, "kv_lora_rank": kv_lora_rank,
            "qk_nope_head_dim": qk_nope_head_dim, "qk_rope_head_dim": qk_rope_head_dim,
            "v_head_dim": v_head_dim, "q_lora_rank": 1 if q_lora_rank is None else q_lora_rank,
        }  # fmt: skip
        for name, value in sizes.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MLA {name}={value!r} must be a positive integer")
        if qk_rope_head_dim % 2:
            raise ValueError(f"MLA qk_rope_head_dim={qk_rope_head_dim} must be even for RoPE")
        self.num_heads, self.q_lora_rank, self.kv_lora_rank = num_heads, q_lora_rank, kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.yarn = yarn or YarnConfig()
        qk_dim = qk_nope_head_dim + qk_rope_head_dim
        self.q_proj: ColumnParallelLinear | None = None
        self.q_a_proj: ReplicatedLinear | None = None
        self.q_a_norm: RMSNorm | None = None
        self.q_b_proj: ColumnParallelLinear | None = None
        if q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(dim, num_heads * qk_dim, False, init_std=init_std)
        else:
            self.q_a_proj = ReplicatedLinear(dim, q_lora_rank, init_std)
            self.q_a_norm = RMSNorm(q_lora_rank, latent_norm_eps)
            self.q_b_proj = ColumnParallelLinear(
                q_lora_rank, num_heads * qk_dim, False, init_std=init_std
            )
        self.kv_a_proj = ReplicatedLinear(dim, kv_lora_rank + qk_rope_head_dim, init_std)
        self.kv_a_norm = RMSNorm(kv_lora_rank, latent_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(
            kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), False, init_std=init_std
        )
        self.o_proj = RowParallelLinear(
            num_heads * v_head_dim, dim, False, init_std=scaled_init_std(init_std, num_layers)
        )
        self.core = CoreAttention(dropout)
        self.tp_group: Any = None
        self.sequence_parallel = False
        freqs_P = yarn_frequencies(qk_rope_head_dim, rope_theta, self.yarn)
        self.register_buffer("inv_freq_P", freqs_P, persistent=False)

    def check_tp(self, tp: int) -> None:
        """Raise unless ``tp`` divides the heads."""
        if self.num_heads % tp:
            raise ValueError(
                f"tensor parallel size tp={tp} does not divide MLA num_heads={self.num_heads}"
            )

    def set_tensor_parallel(self, tp_group: Any, sequence_parallel: bool) -> None:
        """Under SP the latents are all-gathered along the sequence (module docstring)."""
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel

    def rope_tables(
        self, positions_S: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos_SP``, ``sin_SP`` of the YaRN frequencies, times the tables' attention factor."""
        return yarn_cos_sin(positions_S, self.inv_freq_P, self.yarn, dtype)

    def forward(
        self,
        n_BsD: torch.Tensor,
        positions_S: torch.Tensor | None = None,
        document_ids_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        N, R, C, V = self.nope_dim, self.rope_dim, self.kv_lora_rank, self.v_dim
        c_BsC, k_rot_BsR = self.kv_a_proj(n_BsD).split([C, R], dim=-1)
        latents = [self.kv_a_norm(c_BsC), k_rot_BsR]
        if self.q_a_proj is not None:
            assert self.q_a_norm is not None
            latents.insert(0, self.q_a_norm(self.q_a_proj(n_BsD)))
        latent_BsL = torch.cat(latents, dim=-1)
        if self.sequence_parallel:
            latent_BSL = all_gather_grad_rs(latent_BsL, SEQUENCE_DIM, self.tp_group)
        else:
            latent_BSL = copy_to_group(latent_BsL, self.tp_group)
        B, S, _ = latent_BSL.shape
        c_BSC, k_rot_BSR = latent_BSL[..., -C - R :].split([C, R], dim=-1)
        # The GEMMs (FP8 kernels included) read contiguous inputs; the latents are narrow.
        if self.q_proj is not None:
            q = self.q_proj(n_BsD)
        else:
            assert self.q_b_proj is not None
            q = self.q_b_proj.forward_prepared(latent_BSL[..., : -C - R].contiguous())
        q_BSHE = q.view(B, S, -1, N + R)
        if positions_S is None:
            if group_size(self.core.cp_group) > 1:
                raise ValueError("context-parallel attention needs the tokens' global positions")
            positions_S = torch.arange(S, device=n_BsD.device)
        table_dtype = torch.float64 if q_BSHE.dtype == torch.float64 else torch.float32
        cos_SP, sin_SP = self.rope_tables(positions_S, table_dtype)
        q_nope_BSHN, q_rot_BSHR = q_BSHE.split([N, R], dim=-1)
        q_rot_BSHR, k_rot_BS1R = apply_rotary(
            q_rot_BSHR.contiguous(), k_rot_BSR.reshape(B, S, 1, R).contiguous(), cos_SP, sin_SP
        )
        heads = q_BSHE.shape[2]
        q_BHSE = (
            torch.cat([q_nope_BSHN, q_rot_BSHR], dim=-1) * self.yarn.softmax_scale_factor
        ).transpose(1, 2)
        k_rot_BSR = k_rot_BS1R.view(B, S, R)
        if self.core.rings_kv():
            # Ring CP: the rank's [c ; RoPE(k_rot)] travel and each rank expands every block
            # it holds (docstring).
            block_B1SX = torch.cat([c_BSC, k_rot_BSR], dim=-1).unsqueeze(1)
            o_BHSV = self.core(
                q_BHSE, block_B1SX, None, document_ids_BS, kv_expander=_LatentExpansion(self)
            )
            self._agree_on_latent_amax()
            return self.o_proj(o_BHSV.transpose(1, 2).reshape(B, S, heads * V))
        # All-gather CP: the rank's [c ; RoPE(k_rot)] travel, not the expanded K/V (docstring).
        gathered = self.core.gathers_kv()
        if gathered:
            kv_latent_BSX = torch.cat([c_BSC, k_rot_BSR], dim=-1)
            kv_latent_BTX = gather_sequence(kv_latent_BSX, SEQUENCE_DIM, self.core.cp_group)
            c_BTC, k_rot_BTR = kv_latent_BTX.split([C, R], dim=-1)
        else:
            c_BTC, k_rot_BTR = c_BSC, k_rot_BSR
        k_BTHE, v_BTHV = self.expand_latent(c_BTC, k_rot_BTR)
        o_BHSV = self.core(
            q_BHSE,
            k_BTHE.transpose(1, 2),
            v_BTHV.transpose(1, 2),
            document_ids_BS,
            kv_gathered=gathered,
        )
        return self.o_proj(o_BHSV.transpose(1, 2).reshape(B, S, heads * V))

    @torch.compiler.disable  # a collective on FP8 state, outside any compiled graph
    def _agree_on_latent_amax(self) -> None:
        """Ring CP under delayed scaling: MAX-reduce ``kv_b``'s recorded input amax of this
        step over cp, making it the whole sequence's on every rank (module docstring)."""
        if not self.kv_b_proj.fp8_enabled:
            return
        meta = self.kv_b_proj.fp8_meta.input_meta
        if not meta.has_delayed_state:
            return
        current = meta.amax_history[0, int(TensorRole.INPUT)]
        # NaN travels as +inf, as in mt_fp8.update_fp8_scales (both are skipped there).
        amax = torch.where(torch.isnan(current), float("inf"), current).reshape(1)
        current.copy_(mt_comm.all_reduce(amax, "max", group=self.core.cp_group)[0])

    def expand_latent(
        self, c_BTC: torch.Tensor, k_rot_BTR: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_BTHE, v_BTHV)`` of this TP rank's heads from the normed latent ``c`` and the
        rotated shared key: ``[k_nope, k_rot]`` and ``v`` with ``k_nope, v = kv_b(c)``."""
        N, R, V = self.nope_dim, self.rope_dim, self.v_dim
        B, T, _ = c_BTC.shape
        # The GEMMs (FP8 kernels included) read contiguous inputs; the latents are narrow.
        kv_BTHW = self.kv_b_proj.forward_prepared(c_BTC.contiguous()).view(B, T, -1, N + V)
        k_nope_BTHN, v_BTHV = kv_BTHW.split([N, V], dim=-1)
        k_rot_BTHR = k_rot_BTR.reshape(B, T, 1, R).expand(B, T, kv_BTHW.shape[2], R)
        return torch.cat([k_nope_BTHN, k_rot_BTHR], dim=-1), v_BTHV


class _LatentExpansion:
    """Ring CP's block expander (:class:`~mt_parallel.ring_attention.KVExpander`): a held
    block ``(B, 1, j, C + R)`` of ``[RMSNorm_kv(c) ; RoPE(k_rot)]`` into this TP rank's heads'
    ``k_BHjE``, ``v_BHjV`` (:meth:`MultiLatentAttention.expand_latent`); the ring returns the
    gradient of ``kv_b``'s parameters through :attr:`params`."""

    def __init__(self, mla: MultiLatentAttention) -> None:
        self.mla = mla
        self.params = tuple(p for p in mla.kv_b_proj.parameters() if p.requires_grad)

    def __call__(self, block_B1jX: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, _, j, X = block_B1jX.shape
        C = self.mla.kv_lora_rank
        c_BjC, k_rot_BjR = block_B1jX.reshape(B, j, X).split([C, X - C], dim=-1)
        k_BjHE, v_BjHV = self.mla.expand_latent(c_BjC, k_rot_BjR)
        return k_BjHE.transpose(1, 2), v_BjHV.transpose(1, 2)
