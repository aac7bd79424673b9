"""The trainer's collectives: gradient averaging over data parallel, barriers, small broadcasts.

Data parallelism: after the last micro-batch's backward, each dp×cp rank holds
``g_r = ∇(1/A · Σ_m loss_{r,m})``; the all-reduce replaces it by ``(1/dp) Σ_r g_r``, the gradient
of the mean loss over the global batch (all micro-batches have the same number of tokens).
Gradients are flattened into one buffer per dtype first, so a step costs one collective per
dtype, and the sum is taken in a fixed order, so results do not depend on timing.

Strings (the run folder, the run id) are broadcast as uint8 tensors, not pickled objects.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import mt_comm


def active(group: Any = None) -> bool:
    return dist.is_available() and dist.is_initialized() and mt_comm.group_size(group) > 1


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def broadcast_str(value: str, device: torch.device, src: int = 0) -> str:
    """Rank ``src``'s ``value`` on every rank."""
    if not active():
        return value
    data = torch.tensor(list(value.encode("utf-8")), dtype=torch.uint8, device=device)
    length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    mt_comm.broadcast(length, src=src)
    buffer = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
    if dist.get_rank() == src:
        buffer.copy_(data)
    mt_comm.broadcast(buffer, src=src)
    return bytes(buffer.cpu().tolist()).decode("utf-8")


def average_gradients(params: Iterable[nn.Parameter], group: Any) -> None:
    """Average ``.grad`` over ``group`` in place (one flat all-reduce per dtype)."""
    if not active(group):
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        mt_comm.all_reduce(flat, op="avg", group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def mean_scalar(value: torch.Tensor, group: Any) -> torch.Tensor:
    """Average a 0-d tensor over ``group`` (returns a new tensor)."""
    out = value.detach().clone().reshape(1).float()
    if active(group):
        mt_comm.all_reduce(out, op="avg", group=group)
    return out[0]
