"""How the trainer's ranks agree on small things: barriers, scalar means, string broadcasts
and gathers.

(Gradient reduction is mt_parallel's: DDP or ``all_reduce_gradients``.) Strings (the run
folder, the run id) are broadcast as uint8 tensors, not pickled objects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import mt_comm
from mt_train.errors import RankZeroError, UserError


def active(group: Any = None) -> bool:
    return dist.is_available() and dist.is_initialized() and mt_comm.group_size(group) > 1


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def broadcast_str(value: str, device: torch.device, src: int = 0, group: Any = None) -> str:
    """Global rank ``src``'s ``value`` on every rank of ``group`` (None: the world)."""
    if not active(group):
        return value
    data = torch.tensor(list(value.encode("utf-8")), dtype=torch.uint8, device=device)
    length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    mt_comm.broadcast(length, src=src, group=group)
    buffer = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
    if dist.get_rank() == src:
        buffer.copy_(data)
    mt_comm.broadcast(buffer, src=src, group=group)
    return bytes(buffer.cpu().tolist()).decode("utf-8")


def all_gather_str(value: str, device: torch.device, group: Any = None) -> list[str]:
    """Every rank's ``value``, in ``group``'s rank order (padded uint8 rows, one all-gather
    of their lengths first)."""
    if not active(group):
        return [value]
    data = torch.tensor(list(value.encode("utf-8")), dtype=torch.uint8, device=device)
    lengths = mt_comm.all_gather(
        torch.tensor([data.numel()], dtype=torch.int64, device=device), group=group
    ).tolist()
    row = torch.zeros((1, max(lengths)), dtype=torch.uint8, device=device)
    row[0, : data.numel()] = data
    rows = mt_comm.all_gather(row, group=group).cpu()
    return [bytes(rows[i, :n].tolist()).decode("utf-8") for i, n in enumerate(lengths)]


def mean_scalar(value: torch.Tensor, group: Any) -> torch.Tensor:
    """Average a 0-d tensor over ``group`` (returns a new tensor)."""
    out = value.detach().clone().reshape(1).float()
    if active(group):
        mt_comm.all_reduce(out, op="avg", group=group)
    return out[0]


def on_rank0(action: Callable[[], None], rank: int, device: torch.device) -> None:
    """Run ``action`` on rank 0 only; a :class:`~mt_train.errors.UserError` it raises stops
    every rank (the others raise a :class:`~mt_train.errors.RankZeroError` with rank 0's
    message), so no rank waits for one that stopped."""
    failure: UserError | None = None
    if rank == 0:
        try:
            action()
        except UserError as err:
            failure = err
    message = broadcast_str(str(failure) if failure is not None else "", device)
    if failure is not None:
        raise failure
    if message:
        raise RankZeroError(message)
