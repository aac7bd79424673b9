"""Data parallelism over the dp×cp group: torch DDP / FSDP2, gradient accumulation, plain reduce.

Gradients of dense parameters are averaged over dp×cp: data-parallel replicas see different
samples, context-parallel ranks different tokens of the same samples, and each rank's loss is the
mean over its own tokens, so (with equal token counts per rank) the average of the ranks'
gradients is the gradient of the global mean loss.

Modes (:class:`~mt_parallel.ParallelConfig` ``data_parallel``):

* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over the dp×cp process group. It only
  hooks parameter gradients, so it composes with our TP layers (plain local tensors) and FP8.
* ``fsdp``: FSDP2 ``fully_shard`` on every block (the ``block_types`` the caller names) and
  the root, over a 1-D mesh of the dp×cp group (parameters sharded along dim 0 of the local TP
  shard; routed-expert weights by :func:`expert_shard_dim`, below). FP8 layers already in the
  model stop caching FP8 weights (``cache_weight=False``): FSDP2 re-materialises the unsharded
  weights without bumping their version counter, which the cache key relies on.
* ``zero1``: no wrapper; :class:`~mt_parallel.DistributedOptimizer` reduce-scatters at the step.
* ``none``: no wrapper; call :func:`all_reduce_gradients` yourself.

Expert-parallel parameters (MoE experts split over ``ep``, marked by
:func:`mt_parallel.moe.apply_expert_parallel`) differ between the ranks of the dp×cp group. The
gradient of the global mean loss for them is ``Σ_edp g / (dp·cp)``: summed over the
expert-data-parallel (edp) group, the ``dp·cp/ep`` ranks holding the same experts (each rank's
gradient already sums every token its ep group routed to them), divided by all dp×cp ranks
whose mean losses are averaged. Who computes it, per mode:

* ``ddp`` and ``none``: DDP ignores them under every name they have (an FP8 expert layer holds
  the weight as ``..._fp8.weight`` too, and DDP collects parameters module by module;
  ``none``'s caller leaves them out), and
  :func:`accumulate` all-reduces them over edp at the end of the last micro-batch
  (:func:`mt_parallel.moe.reduce_expert_gradients`, which reduces every expert parameter that
  neither FSDP2 shards nor ZeRO-1 marks);
* ``fsdp``: each maximal submodule holding only expert parameters (an MoE layer's
  ``experts``) is its own ``fully_shard`` unit over a mesh of the edp group, as torchtitan
  shards ``moe.experts``, with a sum reduce-scatter divided by dp×cp
  (``set_force_sum_reduction_for_comms`` + ``set_gradient_divide_factor``): the same sum and
  division as ``ddp``'s; the rest is sharded over dp×cp as above. With an edp group of one
  rank (``ep = dp·cp``) there is nothing to shard, and FSDP2's single-rank reduce path divides
  by both the forced-sum factor and the divide factor (the gradient came out divided by
  (dp·cp)²): the experts are left out of FSDP2 (``ignored_params``) and reduced as under
  ``ddp``;
* ``zero1``: :class:`~mt_parallel.DistributedOptimizer` reduce-scatters them over edp at its
  step (sum, then the division) and shards their optimizer state there; it marks them so
  :func:`accumulate` leaves them alone.

Which dim FSDP2 shards a routed-expert weight ``[L, N, K]`` along (``L`` local experts, ``E/ep``;
``W`` ranks in its FSDP2 mesh: edp when split over ep, dp×cp at ep = 1), torchtitan's rule:
dim 1 when ``W > L`` and ``W`` divides ``N``, else dim 0 (:func:`expert_shard_dim`). Dim 0
follows ``torch.chunk``: with ``W > L`` the first ``L`` ranks hold one whole expert each and
the other ``W − L`` none, and FSDP2 pads every shard to ``⌈L/W⌉`` rows, so those ranks still
all-gather and reduce-scatter a whole padded expert (DeepSeek-V3: 256 experts at ep = 64 are
4 local experts, over an edp of 8 or more). Dim 1 gives every rank ``[L, N/W, K]``, an equal
share with no padding; FSDP2 refuses a non-zero shard dim that ``W`` does not divide, hence
the fallback to dim 0 (uneven, padded, but correct). With ``W ≤ L`` dim 0 is kept: whole
experts per rank, which a checkpoint stores as one flat piece per rank. The choice is
FSDP2's ``shard_placement_fn`` (torch ≥ 2.6, the oldest torch this package supports, has it);
it changes which elements a rank holds, never the gradients' arithmetic: FSDP2 reduce-scatters
``Shard(1)`` parameters by chunking each gradient along dim 1, so every element is still the
sum over the ``W`` ranks, divided as below.

Under sequence parallel the split experts' gradients are also summed over TP (each TP rank
routed its own tokens to them; the weight's ``expert_sequence_group`` mark), once per step on
the gradients accumulated over the micro-batches (:mod:`mt_parallel.moe.experts`): by
:func:`~mt_parallel.moe.reduce_expert_gradients` with the edp sum under ``ddp`` and ``none``,
by the same function on this rank's shard after FSDP2's reduce-scatter under ``fsdp`` (as
under ``ddp`` with a one-rank edp group, whose experts FSDP2 leaves out), and by
:meth:`~mt_parallel.DistributedOptimizer.reduce_gradients` on its shard after its
reduce-scatter under ``zero1``. A shard's elements are the same experts' on every TP rank
(the TP ranks of one edp rank hold the same experts and shard them alike), so the sum of the
shards is the shard of the sum. Every path adds the same terms (one per micro-batch, TP rank
and edp rank) and divides by dp×cp; only the order of the additions (and, under FSDP2, the
division before the TP sum) differs between them.

Gradient accumulation: run every micro-batch but the last inside :func:`accumulate`'s
``is_last=False`` context (DDP ``no_sync``, FSDP2 ``set_requires_gradient_sync(False)``), so
gradients are accumulated locally and reduced once; scale each micro-batch's loss by
``1/num_micro_batches``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

import mt_comm
import mt_fp8
from mt_parallel.mappings import group_size


def apply_data_parallel(
    model: nn.Module,
    mode: str,
    dp_cp_group: Any,
    device_type: str = "cpu",
    block_types: tuple[type[nn.Module], ...] = (),
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Wrap (``ddp``) or shard (``fsdp``) ``model`` over ``dp_cp_group``; see the module doc.

    ``fsdp`` shards every module of ``block_types`` (the model's blocks) and then the root;
    ``reshard_after_forward=False`` keeps each unit's gathered parameters from its forward to
    its backward (pipeline chunks: one all-gather per step, not one per micro-batch)."""
    if mode in ("zero1", "none") or (group_size(dp_cp_group) == 1 and mode == "ddp"):
        return model
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # Every name of an expert weight: DDP collects parameters module by module, so an alias
        # (an FP8 expert layer's view of the weight, ``..._fp8.weight``) would be reduced as dense.
        experts = [
            n for n, p in model.named_parameters(remove_duplicate=False) if is_expert_parameter(p)
        ]
        if experts:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, experts)
        return DistributedDataParallel(model, process_group=dp_cp_group, broadcast_buffers=False)
    if mode == "fsdp":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard

        mesh = DeviceMesh.from_group(dp_cp_group, device_type)
        # FSDP2 re-materialises unsharded weights with their version counter preserved: FP8
        # layers must not cache FP8 weights keyed on it (mt_fp8.linear, "weight cache").
        set_fp8_weight_cache(model, False)
        # fully_shard replaces the parameters by DTensor ones: carry our marks over.
        marks = {
            name: {mark: getattr(p, mark) for mark in PARAMETER_MARKS if hasattr(p, mark)}
            for name, p in model.named_parameters()
        }
        from mt_parallel.moe.experts import GroupedLinear

        grouped = {m.weight for m in model.modules() if isinstance(m, GroupedLinear)}

        def placement(mesh_size: int) -> Any:
            """FSDP2's ``shard_placement_fn`` for a unit over ``mesh_size`` ranks: routed-expert
            weights by :func:`expert_shard_dim`, everything else dim 0 (None)."""

            def place(param: nn.Parameter) -> Any:
                if param not in grouped:
                    return None
                return Shard(expert_shard_dim(tuple(param.shape), mesh_size))

            return place

        ignored: set[nn.Parameter] = set()
        for experts in expert_modules(model):  # first: the blocks skip parameters sharded here
            param = next(experts.parameters())
            if group_size(param.expert_data_group) == 1:  # module docstring: left to DDP's path
                ignored.update(experts.parameters())
                continue
            edp_mesh = DeviceMesh.from_group(param.expert_data_group, device_type)
            fully_shard(
                experts,
                mesh=edp_mesh,
                reshard_after_forward=reshard_after_forward,
                shard_placement_fn=placement(edp_mesh.size()),
            )
            experts.set_force_sum_reduction_for_comms(True)
            experts.set_gradient_divide_factor(float(param.expert_grad_divisor))
        shard = functools.partial(
            fully_shard,
            mesh=mesh,
            ignored_params=ignored or None,
            reshard_after_forward=reshard_after_forward,
            shard_placement_fn=placement(mesh.size()),  # experts at ep = 1
        )
        for module in model.modules():
            if isinstance(module, block_types):
                shard(module)
        shard(model)
        for name, param in model.named_parameters():
            for mark, value in marks[name].items():
                setattr(param, mark, value)
        return model
    raise ValueError(f"data parallel mode {mode!r}; valid: ddp, fsdp, zero1, none")


PARAMETER_MARKS = (
    "tensor_parallel",
    "expert_group",
    "expert_rank",
    "expert_data_group",
    "expert_grad_divisor",
    "expert_sequence_group",
)
"""Attributes that earlier transforms set on parameters (TP sharding, expert parallelism) and
that FSDP2's DTensor parameters must keep."""

REDUCED_BY_OPTIMIZER = "expert_grads_reduced_by_optimizer"
"""Set (True) on expert parameters whose gradients an optimizer reduces at its step (ZeRO-1),
so :func:`accumulate` does not reduce them first."""


def expert_shard_dim(shape: tuple[int, ...], mesh_size: int) -> int:
    """The dim FSDP2 shards a routed-expert weight of ``shape`` ``[L, N, K]`` along over
    ``mesh_size`` ranks: 1 when ``mesh_size > L`` and ``mesh_size`` divides ``N``, else 0
    (module docstring)."""
    local, rows = shape[0], shape[1]
    return 1 if mesh_size > local and rows % mesh_size == 0 else 0


def is_expert_parameter(param: nn.Parameter) -> bool:
    return getattr(param, "expert_group", None) is not None


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The largest submodules of ``model`` whose parameters are all expert-parallel (module
    docstring: FSDP2 shards each over its edp group)."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        params = list(module.parameters())
        if params and all(is_expert_parameter(p) for p in params):
            found.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return found


@contextlib.contextmanager
def accumulate(model: nn.Module, is_last: bool) -> Iterator[None]:
    """Context for one micro-batch's forward+backward: reduce gradients only if ``is_last``
    (expert-parallel ones too, after the backward, as far as FSDP2 or ZeRO-1 do not: module
    docstring).

    The last micro-batch also runs inside :func:`mt_fp8.final_micro_batch`: FP8 layers free
    their cached FP8 weights as their backward finishes, not at the next step's forward.
    """
    no_sync = getattr(model, "no_sync", None)
    set_sync = getattr(model, "set_requires_gradient_sync", None)
    with mt_fp8.final_micro_batch() if is_last else contextlib.nullcontext():
        if set_sync is not None:
            set_sync(is_last)
            yield
        elif no_sync is not None and not is_last:
            with no_sync():
                yield
        else:
            yield
    # Experts FSDP2 reduce-scatters get only their TP sum there; ZeRO-1's are left to its step.
    if is_last:
        from mt_parallel.moe.layer import reduce_expert_gradients

        reduce_expert_gradients(model)


def set_fp8_weight_cache(model: nn.Module, enabled: bool) -> None:
    """Turn the FP8 weight cache of every FP8 layer in ``model`` on or off (``mt_fp8.FP8Linear``
    and ``FP8GroupedLinear``, and the FP8 GEMM of the TP linears).

    On (their default), a layer quantizes its weight once per optimizer step and keeps the FP8
    ``w`` (and ``wᵀ``) from the first micro-batch's forward to its last backward; off, it
    quantizes in every forward (and every recomputed forward), which saves that memory: two
    FP8 bytes per weight element of each layer between its forward and its backward.
    """
    for module in model.modules():
        fp8_layer = getattr(module, "_fp8", None) or module
        if hasattr(fp8_layer, "cache_weight"):
            fp8_layer.cache_weight = enabled


@torch.no_grad()
def all_reduce_gradients(parameters: Iterable[nn.Parameter], group: Any) -> None:
    """Average the gradients over ``group`` with one flat all-reduce (mode ``none``), summed in
    fp32 or the gradients' wider dtype (fp64)."""
    start_gradient_average(parameters, group).finish()


class PendingGradientAverage:
    """:func:`start_gradient_average` in flight: :meth:`finish` waits for the all-reduce and
    writes the averages back into the gradients."""

    def __init__(self, grads: list[torch.Tensor], flat: torch.Tensor | None, group: Any) -> None:
        self._grads = grads
        self._pending = None if flat is None else mt_comm.all_reduce_start(flat, "avg", group)

    @torch.no_grad()
    def finish(self) -> None:
        if self._pending is None:
            return
        flat, self._pending = self._pending.wait(), None
        offset = 0
        for grad in self._grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


@torch.no_grad()
def start_gradient_average(
    parameters: Iterable[nn.Parameter], group: Any
) -> PendingGradientAverage:
    """Start :func:`all_reduce_gradients` (one flat all-reduce of a copy of the gradients) and
    return at once; the gradients must not change before ``finish()`` writes the averages
    into them. Each element's average depends only on the ranks' values of that element, so
    splitting the parameters over several calls gives the same bits as one call."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads or group_size(group) == 1:
        return PendingGradientAverage([], None, group)
    dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads), torch.float32)
    flat = torch.cat([g.reshape(-1).to(dtype) for g in grads])
    return PendingGradientAverage(grads, flat, group)
