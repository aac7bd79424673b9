"""Global gradient-norm clipping and a ZeRO-1 distributed optimizer, both TP-aware.

Global norm. ``‖g‖² = Σ over every distinct parameter element of g²``, across all parallel
dimensions. A TP-sharded parameter (``param.tensor_parallel = True``) is a different slice on
each TP rank: every rank counts its slice. A TP-replicated parameter (norm weights, row-parallel
biases) is identical on every TP rank: only TP rank 0 counts it. The partial sums are then
summed over the model-parallel group (tp×pp: every rank that holds different parameters). After
gradient reduction, gradients are identical over dp×cp, so no reduction there, except for
gradients that are themselves sharded over dp×cp (FSDP2 DTensors, the ZeRO-1 shards), whose
partial sums are summed over dp×cp first. Expert-parallel parameters (MoE experts split over
``ep``: ``param.expert_group``) are different experts on each ep rank: their partial sums are
summed over that group first; sharded further over their expert-data-parallel (edp) group
(FSDP2's edp mesh, ZeRO-1's expert shard), every element sits on exactly one rank of
dp×cp = ep×edp, so they join the dp×cp sum of the other sharded gradients instead. A pipeline
stage's copy of a module another stage holds (``param.pipeline_copy = True``, an input
embedding shared by the first and last stages) is counted only by the stage that owns it. Clip
coefficient: ``min(1, max_norm / (‖g‖ + 1e-6))``, torch's formula.

Distributed optimizer (ZeRO-1). The parameters of this rank form one or two *partitions*,
each viewed as one flat vector (fp32, or fp64 for fp64 parameters) of length ``n`` padded to
``W·s`` over its group of ``W`` ranks (``s`` = shard length); group rank ``i`` owns elements
``[i·s, (i+1)·s)``. The dense partition (every parameter but the experts) is sharded over
dp×cp; with expert parallelism, the expert partition (``param.expert_data_group``) over the
edp group, whose ranks hold the same experts. This rank's master shard is the dense shard
followed by the expert shard. :meth:`DistributedOptimizer.step` is
:meth:`~DistributedOptimizer.reduce_gradients` (1–2) then
:meth:`~DistributedOptimizer.apply_update` (3–5); a caller that judges the step on its norm
first (a trainer's anomaly detectors) calls the two itself and may skip the second:

1. reduce-scatter each partition's flat gradient: the dense one averaged over dp×cp, the
   expert one summed over edp and divided by dp×cp (``param.expert_grad_divisor``; the
   gradient of the global mean loss, :mod:`mt_parallel.data_parallel`); each rank gets only
   its shards. Under sequence parallel the expert shard is also summed over TP
   (``param.expert_sequence_group``: each TP rank routed its own tokens to the experts),
   before the division: the TP ranks of one edp rank build the same partition and own the
   same elements of it, so this is the TP sum of the gradient at 1/edp of its bytes, once per
   step (:mod:`mt_parallel.moe.experts`);
2. global norm from the shards (above): each element of either partition lies in exactly one
   rank's shard of dp×cp, so the squared sums are added over dp×cp, then over tp×pp;
3. clipping, and with a ``decay`` filter the decoupled weight decay ``θ ← θ·(1 - lr·λ)`` of the
   selected parameters' master elements (the inner optimizer then runs with ``λ = 0``; decay
   before the update is torch's AdamW order);
4. the inner optimizer (AdamW by default) updates the fp32 master shard, holding its state
   (two moments) only for the shard: optimizer memory per rank is ``1/W``;
5. all-gather the updated master shards (each partition over its group) and copy them into
   the model parameters (cast to their dtype, e.g. bf16: bf16 compute with fp32 master
   weights).

Why ours and not ``torch.distributed.optim.ZeroRedundancyOptimizer``: ZeRO shards whole
parameters (uneven with few large matrices), expects DDP to all-reduce the full gradients first
(twice the traffic of one reduce-scatter), keeps master weights in the parameter dtype (no fp32
master for bf16 parameters), and its clipping cannot tell TP-sharded from TP-replicated
parameters. Ours is element-sharded, reduce-scatters once per step (so gradient accumulation
never communicates before the last micro-batch), keeps fp32 masters, and only copies values into
the parameters in place, so FP8 layers see a weight update through the ``_version`` bump and
requantize their cached weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import mt_comm
from mt_parallel.data_parallel import REDUCED_BY_OPTIMIZER, is_expert_parameter
from mt_parallel.mappings import group_rank, group_size


def _all_reduce_sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    if group_size(group) > 1:
        mt_comm.all_reduce(x, group=group)
    return x


def _counts_here(param: torch.Tensor, tp_rank: int) -> bool:
    if getattr(param, "pipeline_copy", False):  # counted on the first pipeline stage
        return False
    return bool(getattr(param, "tensor_parallel", False)) or tp_rank == 0


def _local_grad(param: nn.Parameter) -> tuple[torch.Tensor | None, bool]:
    """(the gradient as a local tensor, whether it is sharded over dp×cp)."""
    grad = param.grad
    if grad is None:
        return None, False
    to_local = getattr(grad, "to_local", None)
    if to_local is not None:  # a DTensor from FSDP2: this rank's shard
        return to_local(), True
    return grad, False


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return list(groups.values())


def clip_grad_norm_(
    parameters: Iterable[nn.Parameter],
    max_norm: float,
    tp_group: Any = None,
    mp_group: Any = None,
    dp_cp_group: Any = None,
) -> torch.Tensor:
    """Clip gradients in place to the global norm ``max_norm`` (module docstring); returns the norm.

    ``mp_group`` defaults to ``tp_group``; ``dp_cp_group`` is used only for dp-sharded (FSDP2)
    gradients. ``max_norm <= 0`` only computes the norm.
    """
    params = [p for p in parameters if p.grad is not None]
    mp_group = tp_group if mp_group is None else mp_group
    tp_rank = group_rank(tp_group)
    # Accumulate on the gradients' device: the collectives below may run on a backend
    # (NCCL) that refuses host tensors, and no per-parameter host sync is needed.
    first = _local_grad(params[0])[0] if params else None
    device = first.device if first is not None else torch.device("cpu")
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    sharded = torch.zeros((), dtype=torch.float64, device=device)
    counted: dict[bool, list[torch.Tensor]] = {False: [], True: []}
    expert_grads, expert_group = [], None
    for param in params:
        grad, dp_sharded = _local_grad(param)
        if grad is not None and is_expert_parameter(param) and not dp_sharded:
            expert_group = param.expert_group  # type: ignore[attr-defined]
            if tp_rank == 0:
                expert_grads.append(grad.detach())
        elif grad is not None and _counts_here(param, tp_rank):
            counted[dp_sharded].append(grad.detach())  # FSDP2's edp-sharded experts too
    # One multi-tensor norm per (device, dtype) group, read once, accumulated in the gradients'
    # dtype (fp32 for fp32 gradients); the per-tensor norms are summed in fp64.
    for dp_sharded, grads in counted.items():
        for group in _by_device_and_dtype(grads):
            norms = torch.stack(torch._foreach_norm(group)).to(device, torch.float64)
            (sharded if dp_sharded else replicated).add_(norms.pow(2).sum())
    if any(_local_grad(p)[1] for p in params):  # every rank of the group takes this branch
        _all_reduce_sum(sharded, dp_cp_group)
    if expert_group is not None:  # every rank of an MoE model with ep > 1 takes it
        experts = torch.zeros((), dtype=torch.float64, device=device)
        for group in _by_device_and_dtype(expert_grads):
            norms = torch.stack(torch._foreach_norm(group)).to(device, torch.float64)
            experts.add_(norms.pow(2).sum())
        sharded.add_(_all_reduce_sum(experts, expert_group))
    total = _all_reduce_sum(replicated + sharded, mp_group).sqrt()
    if max_norm > 0:
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        grads = [g for g in (_local_grad(p)[0] for p in params) if g is not None]
        for group in _by_device_and_dtype(grads):
            torch._foreach_mul_(group, coefficient.to(group[0].device, group[0].dtype))
    return total.float()


@dataclass(frozen=True)
class _Partition:
    """Parameters whose flat vector is sharded over ``group`` (module docstring)."""

    params: list[nn.Parameter]
    group: Any
    shard: int
    """Elements per rank (``s``)."""
    lo: int
    """First element of the flat vector this rank owns."""
    offset: int
    """Where this rank's shard starts in the master shard."""
    divisor: int | None
    """None: the gradient is averaged over ``group``; else summed, then divided by it."""
    sum_group: Any = None
    """A group the reduced shard is also summed over before the division (the TP group, for
    experts under sequence parallel), or None."""

    @classmethod
    def of(
        cls,
        params: list[nn.Parameter],
        group: Any,
        offset: int,
        divisor: int | None,
        sum_group: Any = None,
    ) -> _Partition:
        shard = math.ceil(sum(p.numel() for p in params) / group_size(group))
        return cls(params, group, shard, group_rank(group) * shard, offset, divisor, sum_group)


class DistributedOptimizer:
    """ZeRO-1 over ``group`` (dp×cp) around an inner optimizer (module docstring).

    ``optimizer_cls(**kwargs)`` is built over one flat fp32 master shard, so only element-wise
    optimizers (AdamW, Adam, SGD) are exact; their hyper-parameters apply to every element,
    except the weight decay when ``decay`` is given: then ``kwargs["weight_decay"]`` (default 0)
    applies, decoupled, only to the parameters for which ``decay(param)`` is true (e.g.
    ``lambda p: p.dim() >= 2``: matrices, not norm gains or biases). ``inner`` is the inner
    optimizer (give it to an LR scheduler). Expert-parallel parameters among ``params`` form
    the expert partition over their ``expert_data_group``; they are marked
    (:data:`mt_parallel.data_parallel.REDUCED_BY_OPTIMIZER`) so that
    :func:`mt_parallel.accumulate` leaves their gradients to :meth:`reduce_gradients`.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        group: Any = None,
        tp_group: Any = None,
        mp_group: Any = None,
        optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
        decay: Callable[[nn.Parameter], bool] | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("DistributedOptimizer got no trainable parameters")
        self.group, self.tp_group = group, tp_group
        self.mp_group = tp_group if mp_group is None else mp_group
        self.numel = sum(p.numel() for p in self.params)
        dense = [p for p in self.params if getattr(p, "expert_data_group", None) is None]
        experts = [p for p in self.params if getattr(p, "expert_data_group", None) is not None]
        self.partitions: list[_Partition] = []
        if dense:
            self.partitions.append(_Partition.of(dense, group, 0, None))
        if experts:
            edp_group, divisor = experts[0].expert_data_group, experts[0].expert_grad_divisor
            tp_sum = getattr(experts[0], "expert_sequence_group", None)
            offset = sum(part.shard for part in self.partitions)
            self.partitions.append(_Partition.of(experts, edp_group, offset, divisor, tp_sum))
            for param in experts:
                setattr(param, REDUCED_BY_OPTIMIZER, True)
        self.shard = sum(part.shard for part in self.partitions)
        device = self.params[0].device
        # Master weights in at least fp32 (fp64 parameters keep fp64 masters).
        self.master_dtype = torch.promote_types(self.params[0].dtype, torch.float32)
        with torch.no_grad():
            shards = [
                self._flatten(part, [p.detach() for p in part.params], device)[
                    part.lo : part.lo + part.shard
                ]
                for part in self.partitions
            ]
        self.master = nn.Parameter(torch.cat(shards))
        self.weight_decay = 0.0
        self.decay_mask: torch.Tensor | None = None
        if decay is not None:
            self.weight_decay = float(optimizer_kwargs.pop("weight_decay", 0.0))
            self.decay_mask = torch.zeros(self.shard, dtype=torch.bool, device=device)
            for param, _, local in self.shard_slices():
                self.decay_mask[local] = bool(decay(param))
            optimizer_kwargs["weight_decay"] = 0.0
        self.inner = optimizer_cls([self.master], **optimizer_kwargs)
        # Slices of the shard whose elements count towards the global norm on this rank.
        tp_rank = group_rank(tp_group)
        self._norm_slices = [
            local for param, _, local in self.shard_slices() if _counts_here(param, tp_rank)
        ]
        self._reduced: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    def shard_slices(self) -> list[tuple[nn.Parameter, int, slice]]:
        """``(param, start, local)`` for every parameter overlapping this rank's shards: its
        elements from ``start`` (of the flattened parameter) sit at ``local`` in the master
        shard."""
        out = []
        for part in self.partitions:
            offset, hi = 0, part.lo + part.shard
            for param in part.params:
                start, end = max(offset, part.lo), min(offset + param.numel(), hi)
                if start < end:
                    local = slice(part.offset + start - part.lo, part.offset + end - part.lo)
                    out.append((param, start - offset, local))
                offset += param.numel()
        return out

    def _flatten(
        self, part: _Partition, tensors: list[torch.Tensor | None], device: torch.device
    ) -> torch.Tensor:
        padded = part.shard * group_size(part.group)
        flat = torch.zeros(padded, dtype=self.master_dtype, device=device)
        offset = 0
        for param, tensor in zip(part.params, tensors, strict=True):
            if tensor is not None:
                flat[offset : offset + param.numel()] = tensor.reshape(-1)
            offset += param.numel()
        return flat

    @torch.no_grad()
    def reduce_gradients(self) -> torch.Tensor:
        """Steps 1–2: reduce-scatter the gradients to this rank's shards (averaged; experts
        summed over edp, and over TP under sequence parallel, and divided by dp×cp); returns
        the global gradient norm.
        :meth:`apply_update` then uses the reduced shard."""
        shards = []
        for part in self.partitions:
            flat = self._flatten(part, [p.grad for p in part.params], self.master.device)
            op = "avg" if part.divisor is None else "sum"
            if group_size(part.group) > 1:
                flat = mt_comm.reduce_scatter(flat, op=op, group=part.group)
            if group_size(part.sum_group) > 1:
                mt_comm.all_reduce(flat, group=part.sum_group)
            shards.append(flat if part.divisor is None else flat.div_(part.divisor))
        grad = torch.cat(shards)
        sumsq = torch.zeros((), dtype=torch.float64, device=grad.device)
        if self._norm_slices:
            norms = torch._foreach_norm([grad[local] for local in self._norm_slices])
            sumsq += torch.stack(norms).double().pow(2).sum()
        _all_reduce_sum(sumsq, self.group)
        norm = _all_reduce_sum(sumsq, self.mp_group).sqrt()
        self._reduced = (grad, norm)
        return norm.to(self.master_dtype)

    @torch.no_grad()
    def apply_update(self, max_grad_norm: float = 0.0) -> torch.Tensor:
        """Steps 3–5 on the gradients of :meth:`reduce_gradients`: clip to ``max_grad_norm``
        (if > 0), decay, update the master shard, all-gather into the parameters. Returns the
        norm (before clipping)."""
        if self._reduced is None:
            raise RuntimeError("DistributedOptimizer.apply_update() needs reduce_gradients() first")
        (grad, norm), self._reduced = self._reduced, None
        if max_grad_norm > 0:
            grad.mul_(torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0).to(grad.dtype))
        if self.decay_mask is not None and self.weight_decay > 0:
            lr = self.inner.param_groups[0]["lr"]
            keep = torch.tensor(1 - lr * self.weight_decay, dtype=self.master.dtype)
            self.master.mul_(torch.where(self.decay_mask, keep, 1.0))
        self.master.grad = grad
        self.inner.step()
        self.master.grad = None
        for part in self.partitions:
            full = self.master.detach()[part.offset : part.offset + part.shard]
            if group_size(part.group) > 1:
                full = mt_comm.all_gather(full.contiguous(), group=part.group)
            offset = 0
            for param in part.params:
                param.copy_(full[offset : offset + param.numel()].view_as(param))
                offset += param.numel()
        return norm.to(self.master_dtype)

    def step(self, max_grad_norm: float = 0.0) -> torch.Tensor:
        """Reduce-scatter gradients, clip to ``max_grad_norm`` (if > 0), update, all-gather.

        Returns the global gradient norm (before clipping).
        """
        self.reduce_gradients()
        return self.apply_update(max_grad_norm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._reduced = None
        for param in self.params:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: master weights and the inner optimizer's state."""
        return {"master": self.master.detach().clone(), "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["master"].shape != self.master.shape:
            raise ValueError(
                f"master shard of shape {tuple(state['master'].shape)} does not match this "
                f"rank's shard {tuple(self.master.shape)} (different dp×cp or ep size, or model?)"
            )
        with torch.no_grad():
            self.master.copy_(state["master"])
        self.inner.load_state_dict(state["inner"])
