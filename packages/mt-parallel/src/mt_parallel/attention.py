"""Grouped-query self-attention with RoPE on column/row-parallel projections, and its core.

Shape suffixes: B batch, T tokens this rank holds, S tokens inside a TP region (``T_seq/cp``),
D model width, H query heads, K key/value heads (both per TP rank), d head dim, P = d/2.

::

    o = o_proj(core(rope(q_proj(n)), rope(k_proj(n)), v_proj(n)))

q/k/v are column-parallel (heads split over TP), o is row-parallel. RoPE uses the rotate-half
layout (Hugging Face's): the pair ``(x_i, x_{i+d/2})`` at position ``p`` is rotated by
``p·f_i``; :meth:`Attention.rope_tables` gives ``cos/sin(p·f_i)`` with plain ``f_i =
θ^(-2i/d)`` and is the hook a model family overrides for scaled frequencies (Llama 3.1, YaRN).
q and k are rotated together by ``mt_fp8.ops.apply_rotary`` (Triton on CUDA, PyTorch on the
CPU, fp32; fp64 for fp64 inputs so fp64 references stay exact). Positions are one row
``positions_S`` shared by the batch, or one row per sequence ``positions_BS`` (packed samples
whose positions restart at each sample); per-row tables rotate the batch flattened to one
sequence of ``B·S`` tokens, which the rotation treats token by token.

:class:`CoreAttention` is causal softmax attention with GQA (query head ``h`` reads KV head
``h // (H/K)``), masked to each token's own document when ``document_ids`` are given (by an
explicit mask, or by FlexAttention after ``set_document_mask_kernel("flex")``:
:mod:`mt_parallel.document_attention`); with a cp group it is
:func:`context_parallel_attention` (or :func:`ring_attention`); ``kv_gathered=True`` hands it
K/V that already hold the whole sequence in global order (only where
:meth:`CoreAttention.gathers_kv`: multi-head latent attention gathers its narrower latent
instead). It is its own module so selective recompute can wrap exactly this part
(``recompute_target = "attention"``), and it takes the cp group through
``set_context_parallel`` (the hook :func:`mt_parallel.apply_context_parallel` calls). The local
head counts are read off the projection shapes, so the forward code is the same at every TP
degree.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, ClassVar

import torch
from torch import nn

from mt_fp8.ops import apply_rotary
from mt_parallel.context_parallel import context_parallel_attention
from mt_parallel.document_attention import check_flex, flex_document_attention
from mt_parallel.layers import ColumnParallelLinear, RowParallelLinear, scaled_init_std
from mt_parallel.mappings import group_size
from mt_parallel.ring_attention import KVExpander, expanded_ring_attention, ring_attention
from mt_parallel.rng import forks_rng, rng_region

RING_DROPOUT_ERROR = "ring attention has no attention dropout: use cp_attention=all_gather"


def rope_cos_sin(
    positions_S: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``, ``sin`` of shape ``(S, d/2)`` (``mt_fp8.ops.apply_rotary``'s tables), or
    ``(B, S, d/2)`` for per-row positions ``(B, S)``; angles in fp64."""
    inv_freq_P = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles_SP = positions_S.to(torch.float64).unsqueeze(-1) * inv_freq_P.to(positions_S.device)
    return angles_SP.cos().to(dtype), angles_SP.sin().to(dtype)


def apply_rope(x_BHSd: torch.Tensor, cos_Sd: torch.Tensor, sin_Sd: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of one tensor with full ``(S, d)`` tables: ``x·cos + rotate_half(x)·sin``.

    For callers that build their own tables; :class:`Attention` rotates q and k together with
    ``mt_fp8.ops.apply_rotary`` and the half tables of :meth:`Attention.rope_tables`.
    """
    x1, x2 = x_BHSd.chunk(2, dim=-1)
    return x_BHSd * cos_Sd + torch.cat([-x2, x1], dim=-1) * sin_Sd


def rotate_rows(
    q_BSHd: torch.Tensor, k_BSKd: torch.Tensor, cos_BSP: torch.Tensor, sin_BSP: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary`` with one table row per token of each sequence (per-row positions): the
    batch as one sequence of ``B·S`` tokens, so the fused rotation applies unchanged."""
    B, S = q_BSHd.shape[:2]
    q_1NHd, k_1NKd = apply_rotary(
        q_BSHd.reshape(1, B * S, *q_BSHd.shape[2:]),
        k_BSKd.reshape(1, B * S, *k_BSKd.shape[2:]),
        cos_BSP.reshape(B * S, -1),
        sin_BSP.reshape(B * S, -1),
    )
    return q_1NHd.view_as(q_BSHd), k_1NKd.view_as(k_BSKd)


class CoreAttention(nn.Module):
    """Causal softmax attention with GQA, optional document masking; context parallel when
    ``cp_group`` has >1 rank (all-gather K/V, or :func:`ring_attention` when ``cp_ring``).

    The probabilities belong to this rank's heads, so their dropout is a sharded region
    (:mod:`mt_parallel.rng`).
    """

    recompute_target: ClassVar[str] = "attention"
    """The ``parallel.recompute_targets`` / ``recompute_keep`` entry naming this module."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = dropout
        self.cp_group: Any = None
        self.cp_ring = False
        self.tp_group: Any = None
        self.document_mask_kernel = "explicit"
        """How document masks are applied: ``explicit`` or ``flex``
        (:mod:`mt_parallel.document_attention`)."""

    def set_tensor_parallel(self, tp_group: Any, sequence_parallel: bool) -> None:
        self.tp_group = tp_group

    def set_context_parallel(self, cp_group: Any, ring: bool) -> None:
        """Attend over the sequence split across ``cp_group`` (all-gather K/V, or the ring)."""
        if ring and self.dropout > 0:
            raise ValueError(RING_DROPOUT_ERROR)
        self.cp_group, self.cp_ring = cp_group, ring

    def set_document_mask_kernel(self, kernel: str) -> None:
        """Apply document masks with ``kernel``: ``explicit`` (SDPA with a boolean mask) or
        ``flex`` (FlexAttention's block masks; refused with dropout or ring attention)."""
        if kernel not in ("explicit", "flex"):
            raise ValueError(f"document mask kernel={kernel!r} is unknown; valid: explicit, flex")
        if kernel == "flex":
            check_flex(group_size(self.cp_group), self.dropout, ring=self.cp_ring)
        self.document_mask_kernel = kernel

    def gathers_kv(self) -> bool:
        """Whether the forward all-gathers K/V over cp (cp > 1 without the ring), so a caller
        may gather a narrower tensor itself and pass ``kv_gathered=True``."""
        return group_size(self.cp_group) > 1 and not self.cp_ring

    def rings_kv(self) -> bool:
        """Whether the forward passes K/V around the cp ring (cp > 1 with the ring), so a
        caller may hand it a narrower block and a ``kv_expander`` instead."""
        return group_size(self.cp_group) > 1 and self.cp_ring

    def forks_rng(self) -> bool:
        """Whether the next forward draws from the RNG tracker (recompute then replays it)."""
        return forks_rng(self.training, self.dropout, sharded=True)

    def forward(
        self,
        q_BHSd: torch.Tensor,
        k_BKSd: torch.Tensor,
        v_BKSd: torch.Tensor | None,
        document_ids_BS: torch.Tensor | None = None,
        kv_gathered: bool = False,
        kv_expander: KVExpander | None = None,
    ) -> torch.Tensor:
        """``kv_gathered``: ``k``/``v`` hold the whole sequence in global order
        (:func:`~mt_parallel.context_parallel.gather_sequence`); only where :meth:`gathers_kv`.
        ``kv_expander``: ``k`` is the rank's block of a narrower tensor the ring passes instead
        of K/V, ``v`` is None, and ``kv_expander`` turns each held block into K/V
        (:func:`~mt_parallel.ring_attention.expanded_ring_attention`); only where
        :meth:`rings_kv`."""
        if kv_gathered and not self.gathers_kv():
            raise ValueError("gathered K/V need all-gather context parallelism (cp > 1, no ring)")
        if kv_expander is not None and not self.rings_kv():
            raise ValueError(
                "a K/V block expander needs ring context parallelism (cp > 1, cp_attention=ring)"
            )
        p = self.dropout if self.training else 0.0
        if document_ids_BS is not None and self.document_mask_kernel == "flex":
            check_flex(group_size(self.cp_group), p, ring=self.cp_ring)
            return flex_document_attention(
                q_BHSd, k_BKSd, v_BKSd, document_ids_BS, self.cp_group, kv_gathered
            )
        if self.cp_ring and group_size(self.cp_group) > 1:
            if p > 0:
                raise ValueError(RING_DROPOUT_ERROR)
            if kv_expander is not None:
                return expanded_ring_attention(
                    q_BHSd, k_BKSd, kv_expander, self.cp_group, document_ids_BS
                )
            return ring_attention(q_BHSd, k_BKSd, v_BKSd, self.cp_group, document_ids_BS)
        region = rng_region(True, self.tp_group, q_BHSd.device) if p > 0 else nullcontext()
        with region:
            return context_parallel_attention(
                q_BHSd, k_BKSd, v_BKSd, self.cp_group, p, document_ids_BS, kv_gathered
            )


class Attention(nn.Module):
    """GQA self-attention with RoPE from column/row-parallel projections (module docstring).

    ``num_layers`` scales the init of the output projection (``init_std / sqrt(2·num_layers)``).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        rope_theta: float = 10000.0,
        dropout: float = 0.0,
        num_layers: int = 1,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim={dim} is not divisible by num_heads={num_heads}")
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads} (GQA)"
            )
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim, self.rope_theta = dim // num_heads, rope_theta
        hd = self.head_dim
        self.q_proj = ColumnParallelLinear(dim, num_heads * hd, bias=False, init_std=init_std)
        self.k_proj = ColumnParallelLinear(dim, num_kv_heads * hd, bias=False, init_std=init_std)
        self.v_proj = ColumnParallelLinear(dim, num_kv_heads * hd, bias=False, init_std=init_std)
        self.o_proj = RowParallelLinear(
            num_heads * hd, dim, bias=False, init_std=scaled_init_std(init_std, num_layers)
        )
        self.core = CoreAttention(dropout)

    def shared_input_linears(self) -> tuple[ColumnParallelLinear, ...]:
        """The projections that read one normalised input (:func:`mt_parallel.apply_fp8`
        ties their FP8 input scales)."""
        return (self.q_proj, self.k_proj, self.v_proj)

    def check_tp(self, tp: int) -> None:
        """Raise unless ``tp`` divides the query and the key/value heads."""
        for name, value in (("num_heads", self.num_heads), ("num_kv_heads", self.num_kv_heads)):
            if value % tp:
                raise ValueError(f"tensor parallel size tp={tp} does not divide {name}={value}")

    def rope_tables(
        self, positions_S: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos_SP``, ``sin_SP`` for the tokens' positions; override for other frequencies."""
        return rope_cos_sin(positions_S, self.head_dim, self.rope_theta, dtype)

    def forward(
        self,
        x_BTD: torch.Tensor,
        positions_S: torch.Tensor | None = None,
        document_ids_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        n_BSD = self.q_proj.prepare_input(x_BTD)
        B, S, _ = n_BSD.shape
        hd = self.head_dim
        q_BSHd = self.q_proj.forward_prepared(n_BSD).view(B, S, -1, hd)
        k_BSKd = self.k_proj.forward_prepared(n_BSD).view(B, S, -1, hd)
        v_BSKd = self.v_proj.forward_prepared(n_BSD).view(B, S, -1, hd)
        if positions_S is None:
            if group_size(self.core.cp_group) > 1:
                raise ValueError("context-parallel attention needs the tokens' global positions")
            positions_S = torch.arange(S, device=x_BTD.device)
        # The tables in the rotation's compute precision (fp64 only for fp64 activations).
        table_dtype = torch.float64 if q_BSHd.dtype == torch.float64 else torch.float32
        cos_SP, sin_SP = self.rope_tables(positions_S, table_dtype)
        if positions_S.dim() == 2:
            q_BSHd, k_BSKd = rotate_rows(q_BSHd, k_BSKd, cos_SP, sin_SP)
        else:
            q_BSHd, k_BSKd = apply_rotary(q_BSHd, k_BSKd, cos_SP, sin_SP)
        o_BHSd = self.core(
            q_BSHd.transpose(1, 2), k_BSKd.transpose(1, 2), v_BSKd.transpose(1, 2), document_ids_BS
        )
        return self.o_proj(o_BHSd.transpose(1, 2).reshape(B, S, -1))
