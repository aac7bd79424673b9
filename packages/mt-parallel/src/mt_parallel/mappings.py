"""Differentiable collectives: the forward/backward pairs that TP, SP and CP are built from.

Each function is an ``autograd.Function`` whose backward is the adjoint of its forward over the
group (Megatron's "mappings")::

    forward                          backward
    copy_to_group        identity           all-reduce (sum)
    reduce_from_group    all-reduce (sum)   identity
    scatter_to_group     keep own slice     all-gather
    gather_from_group    all-gather         keep own slice
    all_gather_grad_rs   all-gather         reduce-scatter (sum)
    reduce_scatter_grad_ag  reduce-scatter  all-gather

``group=None`` (or a group of one rank) makes every one of them the identity, so a layer built
without a group is exactly the single-process layer. Slices are contiguous and in rank order
along ``dim``; the size along ``dim`` must be divisible by the group size.
"""

from __future__ import annotations

from typing import Any

import torch

import mt_comm


def group_size(group: Any) -> int:
    """Ranks in ``group``; 1 for ``None`` (unlike mt_comm, where None means the world)."""
    return 1 if group is None else mt_comm.group_size(group)


def group_rank(group: Any) -> int:
    """This rank's index in ``group``; 0 for ``None``."""
    return 0 if group is None else mt_comm.group_rank(group)


def _split(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    world = group_size(group)
    if x.shape[dim] % world:
        raise ValueError(f"cannot split dimension {dim} of size {x.shape[dim]} over {world} ranks")
    return x.chunk(world, dim=dim)[group_rank(group)].contiguous()


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    return mt_comm.all_reduce(x.contiguous().clone(), group=group)


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(dy, ctx.group), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None]:
        return dy, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return mt_comm.all_gather(dy.contiguous(), dim=ctx.dim, group=ctx.group), None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return mt_comm.all_gather(x.contiguous(), dim=dim, group=group)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _split(dy, ctx.dim, ctx.group), None, None


class _GatherReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return mt_comm.all_gather(x.contiguous(), dim=dim, group=group)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        dx = mt_comm.reduce_scatter(dy.contiguous(), dim=ctx.dim, group=ctx.group)
        return dx.contiguous(), None, None


class _ReduceScatterGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return mt_comm.reduce_scatter(x.contiguous(), dim=dim, group=group).contiguous()

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return mt_comm.all_gather(dy.contiguous(), dim=ctx.dim, group=ctx.group), None, None


def _active(group: Any) -> bool:
    return group_size(group) > 1


def copy_to_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Identity forward; gradients summed over ``group`` (input of a column-parallel GEMM)."""
    return _Copy.apply(x, group) if _active(group) else x


def sum_gradient_over_group(grad: torch.Tensor, group: Any) -> torch.Tensor:
    """``grad`` summed over ``group`` in place (returned): :func:`copy_to_group`'s backward, for
    a deferred weight gradient whose forward left ``copy_to_group`` out (zero-bubble sinks)."""
    if _active(group):
        mt_comm.all_reduce(grad, group=group)
    return grad


def reduce_from_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum partial results over ``group``; identity backward (output of a row-parallel GEMM)."""
    return _Reduce.apply(x, group) if _active(group) else x


def scatter_to_group(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Keep this rank's slice along ``dim``; gradients all-gathered."""
    return _Scatter.apply(x, dim, group) if _active(group) else x


def gather_from_group(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """All-gather along ``dim``; the gradient of the result is sliced back (no reduction)."""
    return _Gather.apply(x, dim, group) if _active(group) else x


def all_gather_grad_rs(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """All-gather along ``dim``; gradients reduce-scattered (SP before column-parallel, CP K/V)."""
    return _GatherReduceScatter.apply(x, dim, group) if _active(group) else x


def reduce_scatter_grad_ag(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Sum over ``group`` keeping this rank's slice along ``dim``; gradients all-gathered."""
    return _ReduceScatterGather.apply(x, dim, group) if _active(group) else x
