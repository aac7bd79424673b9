"""Token dispatch to the experts of the expert-parallel (ep) group, and the way back.

Shape suffixes: T this rank's tokens, K top-k, N this rank's kept assignments (rows of the
permuted input, see :mod:`mt_parallel.moe.capacity`), M rows this rank's experts compute, D
width, E all routed experts, P ep ranks, L = E/P local experts (rank ``r`` owns experts
``[r·L, (r+1)·L)``).

Both dispatchers map the permuted rows ``x_ND`` (sorted by global expert, ``sizes_E`` rows per
expert) to the rows of the local experts, sorted by local expert, run ``compute(x_MD,
local_sizes_L)`` and return its output rows aligned with ``x_ND``:

* :class:`AllToAllDispatcher` (uneven splits): the ``P×L`` counts are exchanged first (one
  small all-to-all), then the rows. Received rows arrive ordered (source rank, local expert)
  and are regrouped to (local expert, source rank) for the grouped GEMM; the way back undoes
  both. Traffic per rank: its own rows out and back. Split sizes are host integers (one
  device-to-host copy of the counts per layer call, as in every uneven all-to-all).
* :class:`AllGatherDispatcher`: every rank all-gathers the ``T`` tokens and routing of the
  group (equal ``T`` on every rank), computes its local experts' rows for all of them, and a
  reduce-scatter over the per-assignment outputs (each assignment computed by exactly one
  rank, zeros elsewhere) returns each rank its own. Traffic ``P·T·D`` in, ``P·T·K·D`` back:
  for small groups and small ``T``. Padding to capacity does not apply (it changes no value).

Gradients: the all-to-all's backward is the all-to-all with the splits swapped; all-gather's
is reduce-scatter (:func:`mt_parallel.all_gather_grad_rs`) and back. With ``ep=1`` (no group)
both are the identity around ``compute``.

Overlap (:func:`all_to_all_in_flight`): inside that context the row all-to-alls of
:class:`AllToAllDispatcher`, forward and backward, are started asynchronously and the
context's ``while_in_flight()`` runs before each is waited on, so another piece of work (the
other half of a DualPipeV ``OVERLAP_F_B`` pair, :mod:`mt_parallel.pipeline.overlap`) computes
while the rows travel. The values are the blocking all-to-all's, bit for bit: only the moment
the caller blocks moves. The small exchange of the ``P×L`` counts is not handed to
``while_in_flight`` (its result sizes the row exchange); :class:`AllGatherDispatcher` is not
affected.

Work while the counts travel (``while_counts_travel``, the MoE layer's shared experts,
Megatron-Core's ``moe_shared_expert_overlap``): the host must read the counts before it can
start the rows, and on an accelerator that read would leave the device idle from the moment
the counts arrive until the host has queued the next kernels. So the order on the current
stream is: count all-to-all, copy of both count tables to pinned host memory
(``non_blocking``), an event, then ``while_counts_travel()``'s kernels; the host waits for the
event only, and queues the row all-to-all while the device runs that work. On the CPU (gloo)
the same order runs with a plain read: the count exchange blocks, nothing overlaps. The work
computes what it computes afterwards, so every value is unchanged; it is called exactly once
when counts are exchanged (:class:`AllToAllDispatcher` over several ranks) and never
otherwise, inside :func:`all_to_all_in_flight` too (it runs on the calling half, which keeps
the turn).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

import mt_comm
from mt_parallel.mappings import all_gather_grad_rs, group_rank, group_size, reduce_scatter_grad_ag
from mt_parallel.moe.capacity import (
    PermutePlan,
    expert_counts,
    permute,
    permute_plan,
    unpermute,
)
from mt_parallel.moe.experts import PaddedLayout

ExpertCompute = Callable[..., torch.Tensor]
"""``compute(x_MD, local_sizes_L) -> y_MD``: the local experts on rows sorted by local expert;
``compute(x_PD, sizes_L, layout)`` on rows already in the padded groups of ``layout``
(:func:`dispatch_and_combine`)."""
PaddedLayoutOf = Callable[[torch.Tensor, int, torch.dtype], PaddedLayout | None]
"""``padded_layout(sizes_L, rows, dtype)``: the experts' padded groups for those rows, or None."""


_while_in_flight: Callable[[], None] | None = None
"""Run between starting and waiting for each row all-to-all (module docstring); None: they block."""


@contextlib.contextmanager
def all_to_all_in_flight(while_in_flight: Callable[[], None]) -> Iterator[None]:
    """Start every row all-to-all asynchronously and call ``while_in_flight()`` before waiting
    for it (module docstring). Process-wide: every thread's dispatch sees it, as the two
    halves of an overlapped pair run on two threads."""
    global _while_in_flight
    if _while_in_flight is not None:
        raise RuntimeError("all_to_all_in_flight regions do not nest")
    _while_in_flight = while_in_flight
    try:
        yield
    finally:
        _while_in_flight = None


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any):
    """:func:`mt_comm.all_to_all` of ``x``'s rows, started before and waited for after
    ``_while_in_flight()`` inside :func:`all_to_all_in_flight`."""
    while_in_flight = _while_in_flight
    if while_in_flight is None or group_size(group) == 1:
        return mt_comm.all_to_all(x, out_splits, in_splits, group=group)
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    work = dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=True)
    while_in_flight()
    work.wait()
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _exchange(x.contiguous(), out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        back = _exchange(grad.contiguous(), ctx.in_splits, ctx.out_splits, ctx.group)
        return back, None, None, None


def all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any
) -> torch.Tensor:
    """Differentiable uneven all-to-all of dim-0 rows over ``group``."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def _counts_to_host(counts: torch.Tensor, while_copying: Callable[[], None] | None) -> list:
    """``counts.tolist()``, with ``while_copying()`` queued between the device-to-host copy and
    the host's wait for it (module docstring)."""
    host = counts.to("cpu", non_blocking=True)  # from an accelerator: pinned, copied async
    copied = None
    if counts.device.type != "cpu":
        copied = torch.Event(counts.device)
        copied.record()  # on the current stream, after the copy and before while_copying's work
    if while_copying is not None:
        while_copying()
    if copied is not None:
        copied.synchronize()
    return host.tolist()


def _regroup(x: torch.Tensor, sizes: list[int], rows: int, cols: int) -> torch.Tensor:
    """Chunks laid out (row, col) in ``x`` (``sizes`` in that order) re-laid out (col, row)."""
    chunks = x.split(sizes)
    return torch.cat([chunks[r * cols + c] for c in range(cols) for r in range(rows)])


class AllToAllDispatcher:
    """Uneven all-to-all over the ep group (module docstring)."""

    def __init__(self, num_experts: int, group: Any = None) -> None:
        self.num_experts, self.group = num_experts, group

    def __call__(
        self,
        x_ND: torch.Tensor,
        sizes_E: torch.Tensor,
        compute: ExpertCompute,
        while_counts_travel: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        ranks = group_size(self.group)
        if ranks == 1:
            return compute(x_ND, sizes_E)
        local = self.num_experts // ranks
        send_PL = sizes_E.view(ranks, local)
        recv_PL = mt_comm.all_to_all(send_PL.contiguous(), group=self.group)
        counts = torch.stack([send_PL, recv_PL])
        send_host, recv_host = _counts_to_host(counts, while_counts_travel)  # one host read
        in_splits = [sum(row) for row in send_host]
        out_splits = [sum(row) for row in recv_host]
        x_MD = all_to_all(x_ND, out_splits, in_splits, self.group)
        by_source = [n for row in recv_host for n in row]
        x_MD = _regroup(x_MD, by_source, ranks, local)
        y_MD = compute(x_MD, recv_PL.sum(0))
        by_expert = [recv_host[r][e] for e in range(local) for r in range(ranks)]
        y_MD = _regroup(y_MD, by_expert, local, ranks)
        return all_to_all(y_MD, in_splits, out_splits, self.group)


class AllGatherDispatcher:
    """All-gather the group's tokens, compute the local experts, reduce-scatter back."""

    def __init__(self, num_experts: int, group: Any = None) -> None:
        self.num_experts, self.group = num_experts, group

    def __call__(
        self,
        x_ND: torch.Tensor,
        sizes_E: torch.Tensor,
        compute: ExpertCompute,
        while_counts_travel: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """A group of one rank: every expert is local, nothing moves (no counts travel, so
        ``while_counts_travel`` is not called)."""
        if group_size(self.group) > 1:
            raise RuntimeError("AllGatherDispatcher over several ranks: use dispatch_combine")
        return compute(x_ND, sizes_E)

    def dispatch_combine(
        self,
        x_TD: torch.Tensor,
        indices_TK: torch.Tensor,
        plan: PermutePlan,
        compute: ExpertCompute,
    ) -> torch.Tensor:
        """Per-assignment outputs ``y_AD`` (``A = T·K``, zeros for dropped assignments)."""
        tokens, top_k = indices_TK.shape
        ranks, rank = group_size(self.group), group_rank(self.group)
        local = self.num_experts // ranks
        # Mark dropped assignments with expert -1, then gather the group's routing.
        kept_A = torch.full((tokens * top_k,), -1, dtype=torch.long, device=x_TD.device)
        kept_A[plan.order_N] = indices_TK.reshape(-1)[plan.order_N]
        x_all = all_gather_grad_rs(x_TD, 0, self.group)
        kept_all = mt_comm.all_gather(kept_A, dim=0, group=self.group)
        mine = (kept_all >= rank * local) & (kept_all < (rank + 1) * local)
        mine_A = torch.nonzero(mine).squeeze(1)
        local_experts = kept_all[mine_A] - rank * local
        order = torch.argsort(local_experts, stable=True)
        rows = mine_A[order]
        sizes_L = expert_counts(local_experts, local)
        y_MD = compute(x_all.index_select(0, rows // top_k), sizes_L)
        y_all = y_MD.new_zeros(kept_all.numel(), x_TD.shape[1]).index_copy(0, rows, y_MD)
        return reduce_scatter_grad_ag(y_all, 0, self.group)


def dispatch_and_combine(
    dispatcher: AllToAllDispatcher | AllGatherDispatcher,
    x_TD: torch.Tensor,
    indices_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    compute: ExpertCompute,
    capacity_factor: float | None,
    pad_to_capacity: bool,
    while_counts_travel: Callable[[], None] | None = None,
    padded_layout: PaddedLayoutOf | None = None,
) -> tuple[torch.Tensor, int | torch.Tensor]:
    """The routed experts' weighted output ``y_TD`` and the number of dropped assignments.
    ``while_counts_travel()`` runs once while the ``P×L`` counts travel, where they do
    (:class:`AllToAllDispatcher` over several ranks), and is not called otherwise.

    ``padded_layout`` (the experts' :meth:`~mt_parallel.moe.experts.GroupedExperts.padded_layout`):
    with every expert local (one ep rank) and no padding to capacity, the permutation writes
    the rows straight into the experts' padded groups and the combine reads them from there,
    and ``compute(x_PD, sizes_E, layout)`` runs on the padded rows: the same rows meet the same
    kernels, without the experts' own pad and unpad copies."""
    plan = permute_plan(indices_TK, dispatcher.num_experts, capacity_factor, pad_to_capacity)
    if padded_layout is not None and group_size(dispatcher.group) == 1 and plan.rows_N is None:
        layout = padded_layout(plan.group_sizes_E, plan.num_rows, x_TD.dtype)
        if layout is not None:
            plan = dataclasses.replace(plan, rows_N=layout.dest_M, num_rows=layout.rows)
            y_PD = compute(permute(x_TD, plan, indices_TK.shape[1]), plan.group_sizes_E, layout)
            return unpermute(y_PD, plan, weights_TK), plan.dropped
    if isinstance(dispatcher, AllGatherDispatcher) and group_size(dispatcher.group) > 1:
        y_AD = dispatcher.dispatch_combine(x_TD, indices_TK, plan, compute)
        tokens, top_k = weights_TK.shape
        wide = torch.promote_types(y_AD.dtype, weights_TK.dtype)
        weighted = y_AD.view(tokens, top_k, -1).to(wide) * weights_TK[..., None]
        return weighted.sum(1).to(y_AD.dtype), plan.dropped
    x_ND = permute(x_TD, plan, indices_TK.shape[1])
    y_ND = dispatcher(x_ND, plan.group_sizes_E, compute, while_counts_travel)
    return unpermute(y_ND, plan, weights_TK), plan.dropped
