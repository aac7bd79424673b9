"""Expert capacity: which assignments an expert takes, in what order, and padding.

Shape suffixes: T tokens, K top-k, A = T·K assignments (``a = t·K + j``: token ``t``'s
``j``-th choice), E experts, N kept assignments.

Assignments are sorted by expert with a stable sort, so inside an expert they keep token
order. Dropless (``capacity_factor=None``) keeps all. With a capacity factor ``c`` each expert
takes at most ``C = ceil(c · T·K / E)`` of this rank's assignments, the first ``C`` in token
order; the rest are dropped (they add nothing to the output: the residual stream carries the
token). Capacity is counted on the tokens of the rank that routes them, before dispatch, so
every expert-parallel layout drops the same assignments. Under sequence parallel the routing
rank holds S/tp tokens of each sequence, so ``T`` is its share and capacity is counted per TP
rank (Megatron-Core's semantics): an expert may drop on one rank's shard what another rank's
shard had room for, unlike the layer without SP; dropless routing is unaffected.
``pad_to_capacity`` gives every expert exactly ``C`` rows (zeros past its kept ones): static
shapes at the price of computing on padding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mt_fp8.ops import permute_rows, unpermute_rows


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert (int64, ``num_experts`` long) of the expert indices ``experts``.

    ``torch.bincount``'s values, by a scatter-add: CUDA's bincount reads the largest index to
    the host to size its output, a device synchronization in every MoE layer's forward."""
    flat = experts.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=experts.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))


def expert_capacity(tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """``ceil(factor · tokens·top_k / num_experts)`` (module docstring)."""
    return math.ceil(factor * tokens * top_k / num_experts)


@dataclass
class PermutePlan:
    """Where this rank's assignments go (module docstring)."""

    order_N: torch.Tensor
    """Flat assignment index of each kept assignment, sorted by expert (int64)."""
    group_sizes_E: torch.Tensor
    """Rows each expert receives (kept assignments, or the capacity when padded) (int64)."""
    rows_N: torch.Tensor | None
    """With padding: the padded row of each kept assignment (None: rows are ``0..N-1``)."""
    dropped: int | torch.Tensor
    """Assignments dropped by capacity (0-d int64 tensor, or 0)."""
    num_rows: int
    """Rows of the permuted input: ``N``, or with padding those of the padded buffer (a host
    int, so permuting never reads the device)."""


def permute_plan(
    indices_TK: torch.Tensor,
    num_experts: int,
    capacity_factor: float | None = None,
    pad_to_capacity: bool = False,
) -> PermutePlan:
    """The :class:`PermutePlan` of one rank's routing decision (module docstring)."""
    tokens, top_k = indices_TK.shape
    experts_A = indices_TK.reshape(-1)
    order_A = torch.argsort(experts_A, stable=True)
    counts_E = expert_counts(experts_A, num_experts)
    if capacity_factor is None:
        return PermutePlan(order_A, counts_E, None, 0, order_A.numel())
    capacity = expert_capacity(tokens, top_k, num_experts, capacity_factor)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    sorted_experts_A = experts_A[order_A]
    position_A = torch.arange(order_A.numel(), device=order_A.device) - starts_E[sorted_experts_A]
    keep_A = position_A < capacity
    order_N = order_A[keep_A]
    kept_E = counts_E.clamp(max=capacity)
    dropped = (counts_E - kept_E).sum()
    if not pad_to_capacity:
        return PermutePlan(order_N, kept_E, None, dropped, order_N.numel())
    rows_N = sorted_experts_A[keep_A] * capacity + position_A[keep_A]
    sizes_E = torch.full_like(counts_E, capacity)
    return PermutePlan(order_N, sizes_E, rows_N, dropped, num_experts * capacity)


def permute(x_TD: torch.Tensor, plan: PermutePlan, top_k: int) -> torch.Tensor:
    """Rows of ``x_TD`` in the plan's order (each token once per kept assignment), zero rows on
    padding (:func:`mt_fp8.ops.permute_rows`: one Triton gather on CUDA)."""
    return permute_rows(x_TD, plan.order_N, plan.rows_N, plan.num_rows, top_k)


def unpermute(y_ND: torch.Tensor, plan: PermutePlan, weights_TK: torch.Tensor) -> torch.Tensor:
    """``out_t = Σ_j w_tj · y(a = t·K + j)`` over the kept assignments (dropped ones add 0).

    The weighted sum runs in the wider of ``y``'s and the weights' dtypes (fp32 at least: the
    router's weights are fp32) and returns ``y``'s dtype (:func:`mt_fp8.ops.unpermute_rows`:
    one Triton kernel reading ``y`` through the inverse map on CUDA).
    """
    return unpermute_rows(y_ND, plan.order_N, plan.rows_N, weights_TK)
