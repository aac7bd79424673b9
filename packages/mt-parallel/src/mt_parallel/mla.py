"""Multi-head latent attention (MLA, DeepSeek-V2/V3) on tensor-parallel projections.

Shape suffixes: B batch, S tokens in the TP region (``T_seq/cp``), D model width, H query heads
(this TP rank's), N = ``qk_nope_head_dim``, R = ``qk_rope_head_dim``, E = N + R, V =
``v_head_dim``, Q = ``q_lora_rank``, C = ``kv_lora_rank``, P = R/2.

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
(``scaled_dot_product_attention``'s own ``1/sqrt(E)``, document masking, context parallel by
all-gathering the expanded K/V). RoPE uses the rotate-half layout; DeepSeek's checkpoints use
interleaved pairs, which the Hugging Face converter permutes into this layout (the dot products
are unchanged because q and k are permuted alike).

Tensor parallelism (Megatron's MLA): ``q_b``/``q_proj`` and ``kv_b`` are column parallel (heads
split), ``o_proj`` row parallel; the compressed projections ``q_a``, ``kv_a`` and their RMSNorms
are replicated (:class:`ReplicatedLinear`), so every TP rank computes the full latent. Their
gradients stay identical across ranks: the column-parallel ``q_b``/``kv_b`` all-reduce their input
gradient, and the shared rotary key, which every rank uses only for its own heads, passes
through ``copy_to_group`` (gradient summed over TP). Sequence parallel is refused.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from mt_fp8.ops import apply_rotary
from mt_parallel.attention import CoreAttention
from mt_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    _ParallelLinear,
    scaled_init_std,
)
from mt_parallel.mappings import copy_to_group, group_size
from mt_parallel.norm import RMSNorm
from mt_parallel.yarn import YarnConfig, yarn_cos_sin, yarn_frequencies


class ReplicatedLinear(_ParallelLinear):
    """``y = x Wᵀ (+ b)`` with the same full weight on every TP rank (MLA's compressions).

    A tensor-parallel layer with nothing to shard: it is initialised like the others (the same
    full matrix at every TP degree) and can run in FP8; its input is used as it is.
    """

    tp_shard_dims: ClassVar[dict[str, int]] = {}

    def __init__(self, in_features: int, out_features: int, init_std: float) -> None:
        super().__init__(in_features, out_features, False, None, False, init_std, None, None)

    def _gemm_bias(self) -> torch.Tensor | None:
        return self.bias if self.has_bias else None

    def forward(self, x_BSK: torch.Tensor) -> torch.Tensor:
        return self.gemm(x_BSK)


class MultiLatentAttention(torch.nn.Module):
    """MLA (module docstring): ``forward(n_BSD, positions_S, document_ids_BS) -> y_BSD``.

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
        freqs_P = yarn_frequencies(qk_rope_head_dim, rope_theta, self.yarn)
        self.register_buffer("inv_freq_P", freqs_P, persistent=False)

    def check_tp(self, tp: int) -> None:
        """Raise unless ``tp`` divides the heads."""
        if self.num_heads % tp:
            raise ValueError(
                f"tensor parallel size tp={tp} does not divide MLA num_heads={self.num_heads}"
            )

    def set_tensor_parallel(self, tp_group: Any, sequence_parallel: bool) -> None:
        if sequence_parallel:
            raise ValueError(
                "multi-head latent attention does not support parallel.sequence_parallel=true; "
                "use tp without sequence parallel"
            )
        self.tp_group = tp_group

    def rope_tables(
        self, positions_S: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos_SP``, ``sin_SP`` of the YaRN frequencies, times the tables' attention factor."""
        return yarn_cos_sin(positions_S, self.inv_freq_P, self.yarn, dtype)

    def forward(
        self,
        n_BSD: torch.Tensor,
        positions_S: torch.Tensor | None = None,
        document_ids_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, S, _ = n_BSD.shape
        N, R, V = self.nope_dim, self.rope_dim, self.v_dim
        if self.q_proj is not None:
            q = self.q_proj(n_BSD)
        else:
            assert self.q_a_proj is not None and self.q_a_norm is not None and self.q_b_proj
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(n_BSD)))
        q_BSHE = q.view(B, S, -1, N + R)
        c_BSC, k_rot_BS1R = self.kv_a_proj(n_BSD).split([self.kv_lora_rank, R], dim=-1)
        kv_BSHW = self.kv_b_proj(self.kv_a_norm(c_BSC)).view(B, S, -1, N + V)
        k_nope_BSHN, v_BSHV = kv_BSHW.split([N, V], dim=-1)
        k_rot_BS1R = copy_to_group(k_rot_BS1R.reshape(B, S, 1, R), self.tp_group)
        if positions_S is None:
            if group_size(self.core.cp_group) > 1:
                raise ValueError("context-parallel attention needs the tokens' global positions")
            positions_S = torch.arange(S, device=n_BSD.device)
        table_dtype = torch.float64 if q_BSHE.dtype == torch.float64 else torch.float32
        cos_SP, sin_SP = self.rope_tables(positions_S, table_dtype)
        q_nope_BSHN, q_rot_BSHR = q_BSHE.split([N, R], dim=-1)
        q_rot_BSHR, k_rot_BS1R = apply_rotary(
            q_rot_BSHR.contiguous(), k_rot_BS1R.contiguous(), cos_SP, sin_SP
        )
        heads = q_BSHE.shape[2]
        q_BSHE = torch.cat([q_nope_BSHN, q_rot_BSHR], dim=-1) * self.yarn.softmax_scale_factor
        k_BSHE = torch.cat([k_nope_BSHN, k_rot_BS1R.expand(B, S, heads, R)], dim=-1)
        o_BHSV = self.core(
            q_BSHE.transpose(1, 2), k_BSHE.transpose(1, 2), v_BSHV.transpose(1, 2), document_ids_BS
        )
        return self.o_proj(o_BHSV.transpose(1, 2).reshape(B, S, heads * V))
