"""Collective and point-to-point helpers that the upper layers use.

Conventions:

- ``group=None`` means the default (world) group when torch.distributed is
  initialised, and "no communication" in a world of size 1 without a process
  group: every helper is then the identity (gathers and reductions over one
  rank return their input).
- Tensors are gathered and scattered along any dimension ``dim``; the wire
  format is always the contiguous dim-0 layout that
  ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` need.
- FP8 tensors travel as their bytes: they are sent as ``uint8`` views and
  viewed back on arrival, which is bit-exact and works on backends that
  cannot carry FP8 dtypes (gloo). Reductions of FP8 tensors are refused:
  FP8 has no arithmetic, reduce in a wider type and quantise after.
- Ranks (``src``, ``dst``) are global ranks, as in torch.distributed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

FP8_DTYPES = frozenset(
    getattr(torch, name)
    for name in (
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
    if hasattr(torch, name)
)

# torch 2.13 renamed the single-tensor collectives; older releases (>= 2.6) have
# only the *_tensor names.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
    "avg": dist.ReduceOp.AVG,
}


def is_fp8(tensor: torch.Tensor) -> bool:
    """True for the FP8 dtypes (and E8M0), which travel as bytes."""
    return tensor.dtype in FP8_DTYPES


def _active(group: Any) -> bool:
    return dist.is_available() and dist.is_initialized() and group_size(group) > 1


def group_size(group: Any = None) -> int:
    """Ranks in ``group`` (1 without torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def group_rank(group: Any = None) -> int:
    """This rank's index in ``group`` (0 without torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as it travels: FP8 as a ``uint8`` view of the same bytes."""
    tensor = tensor.contiguous()
    return tensor.view(torch.uint8) if is_fp8(tensor) else tensor


def _reduce_op(op: str, tensor: torch.Tensor) -> Any:
    if is_fp8(tensor):
        raise TypeError(
            f"cannot reduce a {tensor.dtype} tensor: FP8 has no arithmetic; reduce in "
            "float32/bfloat16 and quantise the result"
        )
    try:
        return _REDUCE_OPS[op]
    except KeyError:
        raise ValueError(f"unknown reduce op {op!r}; valid: {', '.join(_REDUCE_OPS)}") from None


def _backend_reduce(op: str, reduce_op: Any, group: Any) -> tuple[Any, int]:
    """The backend's reduce op for ``op`` (``reduce_op``: its :func:`_reduce_op`) and what its
    result is divided by afterwards: gloo has no AVG, so it sums and the caller divides by the
    group size."""
    if op == "avg" and dist.get_backend(group) == "gloo":
        return dist.ReduceOp.SUM, group_size(group)
    return reduce_op, 1


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: Any = None) -> torch.Tensor:
    """Reduce ``tensor`` in place over ``group`` (``op``: sum, max, min, product, avg)."""
    reduce_op = _reduce_op(op, tensor)  # a bad op or an FP8 tensor is refused in one process too
    if _active(group):
        reduce_op, divisor = _backend_reduce(op, reduce_op, group)
        dist.all_reduce(tensor, op=reduce_op, group=group)
        if divisor != 1:
            tensor.div_(divisor)
    return tensor


class PendingReduce:
    """An :func:`all_reduce_start` in flight; :meth:`wait` blocks until its result is in the
    tensor (on CUDA: until the current stream is ordered after it) and returns the tensor."""

    def __init__(self, tensor: torch.Tensor, work: Any, divisor: int) -> None:
        self.tensor, self._work, self._divisor = tensor, work, divisor

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
            if self._divisor != 1:
                self.tensor.div_(self._divisor)
        return self.tensor


def all_reduce_start(tensor: torch.Tensor, op: str = "sum", group: Any = None) -> PendingReduce:
    """Start :func:`all_reduce` of ``tensor`` in place without waiting for it: the collective
    runs while the caller goes on (a different stream on CUDA, gloo's own threads on the CPU);
    ``tensor`` must not be read or written until the returned handle's ``wait()``."""
    reduce_op = _reduce_op(op, tensor)  # a bad op or an FP8 tensor is refused in one process too
    if not _active(group):
        return PendingReduce(tensor, None, 1)
    reduce_op, divisor = _backend_reduce(op, reduce_op, group)
    work = dist.all_reduce(tensor, op=reduce_op, group=group, async_op=True)
    return PendingReduce(tensor, work, divisor)


def all_gather(tensor: torch.Tensor, dim: int = 0, group: Any = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` (rank order); same shapes required."""
    world = group_size(group)
    if not _active(group):
        return tensor
    wire = _wire(tensor.movedim(dim, 0))
    out = torch.empty(
        (world * wire.shape[0], *wire.shape[1:]), dtype=wire.dtype, device=wire.device
    )
    _all_gather_single(out, wire, group=group)
    return out.view(tensor.dtype).movedim(0, dim)


def reduce_scatter(
    tensor: torch.Tensor, dim: int = 0, op: str = "sum", group: Any = None
) -> torch.Tensor:
    """Reduce over ``group`` and keep this rank's equal slice along ``dim``.

    ``tensor.shape[dim]`` must be divisible by the group size.
    """
    reduce_op = _reduce_op(op, tensor)
    world = group_size(group)
    if not _active(group):
        return tensor
    if tensor.shape[dim] % world != 0:
        raise ValueError(
            f"reduce_scatter: dimension {dim} has size {tensor.shape[dim]}, which the group "
            f"size {world} does not divide"
        )
    wire = tensor.movedim(dim, 0).contiguous()
    out = torch.empty(
        (wire.shape[0] // world, *wire.shape[1:]), dtype=wire.dtype, device=wire.device
    )
    if op == "avg" and dist.get_backend(group) == "gloo":
        _reduce_scatter_single(out, wire, op=dist.ReduceOp.SUM, group=group)
        out.div_(world)
    else:
        _reduce_scatter_single(out, wire, op=reduce_op, group=group)
    return out.movedim(0, dim)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None) -> torch.Tensor:
    """Overwrite ``tensor`` on every rank with global rank ``src``'s values; returns it."""
    if not _active(group):
        return tensor
    wire = _wire(tensor)
    dist.broadcast(wire, src=src, group=group)
    if wire.data_ptr() != tensor.data_ptr():
        tensor.copy_(wire.view(tensor.dtype).view(tensor.shape))
    return tensor


def all_to_all(
    tensor: torch.Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: Any = None,
) -> torch.Tensor:
    """Exchange dim-0 slices: slice ``i`` of the input goes to rank ``i`` of ``group``.

    Without split sizes the slices are equal. Uneven splits (MoE token dispatch)
    give ``output_split_sizes[i]`` rows from rank ``i``.
    """
    world = group_size(group)
    if not _active(group):
        return tensor
    wire = _wire(tensor)
    if input_split_sizes is not None and sum(input_split_sizes) != wire.shape[0]:
        raise ValueError(
            f"input_split_sizes {list(input_split_sizes)} sum to {sum(input_split_sizes)}, "
            f"but the input has {wire.shape[0]} rows"
        )
    rows = sum(output_split_sizes) if output_split_sizes is not None else wire.shape[0]
    if output_split_sizes is None and wire.shape[0] % world != 0:
        raise ValueError(f"all_to_all: {wire.shape[0]} rows do not split evenly over {world} ranks")
    out = torch.empty((rows, *wire.shape[1:]), dtype=wire.dtype, device=wire.device)
    dist.all_to_all_single(
        out,
        wire,
        output_split_sizes=list(output_split_sizes) if output_split_sizes is not None else None,
        input_split_sizes=list(input_split_sizes) if input_split_sizes is not None else None,
        group=group,
    )
    return out.view(tensor.dtype)


def send(tensor: torch.Tensor, dst: int, group: Any = None) -> None:
    """Blocking send to global rank ``dst``."""
    dist.send(_wire(tensor), dst=dst, group=group)


def recv(tensor: torch.Tensor, src: int, group: Any = None) -> torch.Tensor:
    """Blocking receive from global rank ``src`` into ``tensor``; returns it."""
    wire = _wire(tensor)
    dist.recv(wire, src=src, group=group)
    if wire.data_ptr() != tensor.data_ptr():
        tensor.copy_(wire.view(tensor.dtype))
    return tensor


def batch_send_recv(
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[tuple[torch.Tensor, int]],
    group: Any = None,
) -> None:
    """Post all sends ``(tensor, dst)`` and receives ``(tensor, src)`` together and wait.

    This is what pipeline schedules need: a stage sends its activations forward
    and receives gradients backward in one step without deadlock.
    """
    ops = [dist.P2POp(dist.isend, _wire(t), peer, group) for t, peer in sends]
    recv_wires = [(t, _wire(t)) for t, _ in recvs]
    ops += [
        dist.P2POp(dist.irecv, wire, peer, group)
        for (_, wire), (_, peer) in zip(recv_wires, recvs, strict=True)
    ]
    if not ops:
        return
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    for tensor, wire in recv_wires:
        if wire.data_ptr() != tensor.data_ptr():
            tensor.copy_(wire.view(tensor.dtype))
