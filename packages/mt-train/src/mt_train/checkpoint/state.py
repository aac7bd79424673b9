"""This rank's training state as named local tensors, in every data-parallel mode.

Local names (no TP or DP suffixes; :func:`mt_train.checkpoint.checkpointer.shard_tensors`
turns them into a checkpoint's names)::

    model/<key>                  an entry of the model's state dict (FP8 scaling state included)
    optim/<param>/<k>            AdamW state, k ∈ {step, exp_avg, exp_avg_sq}
    rng/cpu, rng/<device>        torch's default generators
    rng/tracker/<stream>/<what>  mt_parallel's RNG tracker: each stream's seed and its
                                 generator state per device (the dropout masks of TP-sharded
                                 regions come from there)

Whole entries and pieces. Under ``ddp`` and ``none`` every model and optimizer entry is whole
and identical on all dp×cp ranks. Under ``fsdp`` parameters and their AdamW moments are
DTensors sharded along one dim ``d`` (``Shard(d)``) over the ``W`` ranks of a 1-D mesh (dp×cp;
edp for split experts) with ``torch.chunk``'s rule: rank ``r`` holds indices
``[i₀, i₁) = [min(r·⌈S/W⌉, S), min((r+1)·⌈S/W⌉, S))`` of dim ``d`` (size ``S``). Dense
parameters use ``d = 0``; routed-expert weights ``[L, N, K]`` may use ``d = 1``
(:func:`mt_parallel.data_parallel.expert_shard_dim`). In the flattened TP-local tensor, with
``O`` the product of the sizes before ``d`` and ``C`` of those after it, that shard is ``O``
runs of elements: run ``o`` is ``[(o·S + i₀)·C, (o·S + i₁)·C)``, and the local tensor's
flattened elements are the runs' in order (``O = 1`` for dim 0: one run). Under ``zero1`` the
moments are one flat shard per rank (:class:`mt_train.optim.Zero1AdamW`), and each parameter
overlapping it owns one run ``[a, b)`` of its flattened TP-local tensor. Every run is a
*piece*: flat elements ``[start, start + numel)`` of a tensor of a known shape, and the pieces
of the ``W`` ranks tile that tensor exactly; the checkpoint stores pieces only, so its format
does not depend on the shard dim (a ``Shard(1)`` checkpoint loads where the same tensor is
sharded along dim 0, or whole). :class:`StateLayout` records, for every entry that is made of
pieces on this rank, its runs and the full shape.

Expert parallelism (``parallel.ep > 1``): an MoE layer's routed-expert weights ``[E, out, in]``
are split along dim 0 over the ep ranks, so ep rank ``r`` holds the flat elements
``[r·n, (r+1)·n)`` (``n`` its local numel) of the whole tensor: a piece, with its AdamW moments.
Under ``ddp`` and ``none`` its expert-data-parallel replicas (edp rank > 0) hold the same piece
and do not write it (:attr:`StateLayout.replicas`). Under ``fsdp`` the local experts are a
DTensor sharded over the edp ranks (the rule above, over edp, along dim 0 or 1), and under
``zero1`` their moments are slices of the edp-sharded expert partition: runs of a piece,
each starting at ``r·n`` plus its start within the local experts (dim 0 of the whole tensor is
the experts, so a run inside ep rank ``r``'s experts is the same run shifted by ``r·n``),
written by every rank that holds it (ZeRO-1's weights themselves stay whole on each edp rank,
replicas as under ``ddp``). Loading re-cuts pieces for any ep degree, data-parallel mode and
shard dim (ep=2 → ep=1 and back).

Pipeline copies: the last stage's copy of a module the first stage holds (DeepSeek-V3's input
embedding under multi-token prediction, ``param.pipeline_copy``) equals the first stage's
after every step, so only the first stage writes it (and its AdamW state); the copy loads the
first stage's entries by name.

Invariant: ZeRO-1's master weights equal the fp32 parameters after every step (it copies them
in), so neither snapshots nor checkpoints store them; they are rebuilt from the restored
parameters (:meth:`~mt_train.optim.Zero1AdamW.sync_master`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

import mt_parallel
from mt_train.models.build import canonical_key
from mt_train.optim import Zero1AdamW

ADAM_KEYS = ("step", "exp_avg", "exp_avg_sq")
MOMENTS = ("exp_avg", "exp_avg_sq")


def named_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return {canonical_key(k): p for k, p in model.named_parameters()}


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part: the local shard of a DTensor, else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


Run = tuple[int, int]
"""``(start, numel)``: flat elements ``[start, start + numel)`` of a whole tensor."""


def shard_runs(tensor: DTensor) -> list[Run]:
    """This rank's shard of ``tensor`` as runs of the whole tensor's flat elements, in the
    order of its local tensor's flat elements (module docstring)."""
    placements = tuple(tensor.placements)
    if len(placements) != 1 or not isinstance(placements[0], Shard):
        raise ValueError(
            f"expected an FSDP2 parameter sharded along one dim over one mesh dimension "
            f"(Shard(d),), got placements {placements}"
        )
    dim, shape, mesh = placements[0].dim % tensor.ndim, tuple(tensor.shape), tensor.device_mesh
    # The coordinate, not get_local_rank(): that resolves the mesh's process group by name, and
    # a state dict's DTensors may carry an equal mesh of an earlier, destroyed group (DTensor's
    # sharding cache compares meshes by ranks, not groups: a second trainer in one process).
    size, world, (rank,) = shape[dim], mesh.size(), mesh.get_coordinate()
    per_rank = math.ceil(size / world)
    first, last = min(rank * per_rank, size), min((rank + 1) * per_rank, size)
    outer, inner = math.prod(shape[:dim]), math.prod(shape[dim + 1 :])
    if first == last or inner == 0:
        return []
    return [((o * size + first) * inner, (last - first) * inner) for o in range(outer)]


def take_runs(flat: torch.Tensor, runs: list[Run]) -> torch.Tensor:
    """The elements of ``runs`` of the 1-D ``flat``, in order (one run: a view)."""
    if len(runs) == 1:
        start, numel = runs[0]
        return flat[start : start + numel]
    return torch.cat([flat[start : start + numel] for start, numel in runs]) if runs else flat[:0]


@dataclass
class StateLayout:
    """Which local entries are pieces of a larger tensor: ``runs[name]`` (the flat elements
    held here, in local order) and ``shapes[name]`` (the whole TP-local tensor's shape).
    ``shapes`` lists every entry any rank stores as pieces, so rank 0 can put it in the
    manifest."""

    runs: dict[str, list[Run]] = field(default_factory=dict)
    shapes: dict[str, list[int]] = field(default_factory=dict)
    replicas: set[str] = field(default_factory=set)
    """Entries this rank holds but another rank writes (expert-data-parallel replicas, a
    pipeline stage's copy of the first stage's embedding)."""

    @classmethod
    def of(cls, module: nn.Module, optimizer: Any) -> StateLayout:
        layout = cls()
        zero1 = isinstance(optimizer, Zero1AdamW)
        if zero1:
            for name, param in zip(optimizer.names, optimizer.params, strict=True):
                for key in MOMENTS:
                    layout.shapes[f"optim/{name}/{key}"] = list(param.shape)
            for view in optimizer.views():
                run = (view.start, view.local.stop - view.local.start)
                for key in MOMENTS:
                    layout.runs[f"optim/{view.name}/{key}"] = [run]
        for key, value in module.state_dict().items():
            if isinstance(value, DTensor):
                short = canonical_key(key)
                runs = shard_runs(value)
                names = [f"model/{short}"] + [f"optim/{short}/{k}" for k in MOMENTS]
                for name in names:
                    layout.runs[name] = runs
                    layout.shapes[name] = list(value.shape)
        for short, param in named_parameters(module).items():
            if getattr(param, "pipeline_copy", False):
                layout.replicas.add(f"model/{short}")
                layout.replicas.update(f"optim/{short}/{k}" for k in ADAM_KEYS)
                continue
            expert = getattr(param, "expert_rank", None)
            if expert is None:
                continue
            ep_rank, ep_size, edp_rank = expert
            names = [f"model/{short}"] + [f"optim/{short}/{k}" for k in MOMENTS]
            offset = ep_rank * param.numel()  # this ep rank's experts in the whole tensor
            for name in names:
                layout.shapes[name] = [param.shape[0] * ep_size, *param.shape[1:]]
                within = layout.runs.get(name)  # FSDP2's or ZeRO-1's edp shard, if any
                if within is not None:
                    layout.runs[name] = [(offset + start, numel) for start, numel in within]
                elif not (zero1 and name.startswith("optim/")):  # else not in this shard
                    layout.runs[name] = [(offset, param.numel())]  # whole, as on every edp rank
                    if edp_rank != 0:
                        layout.replicas.add(name)
        return layout


def live_state(module: nn.Module, optimizer: Any, device: Any) -> dict[str, torch.Tensor]:
    """This rank's training state under local names (live tensors: copy before keeping)."""
    out = {f"model/{canonical_key(k)}": local(v) for k, v in module.state_dict().items()}
    if isinstance(optimizer, Zero1AdamW):
        state = optimizer.inner.state.get(optimizer.master, {})
        if state:
            for name in optimizer.names:
                out[f"optim/{name}/step"] = state["step"]
            for view in optimizer.views():
                for key in MOMENTS:
                    out[f"optim/{view.name}/{key}"] = state[key][view.local]
    else:
        for name, param in named_parameters(module).items():
            for key, value in optimizer.state.get(param, {}).items():
                if key in ADAM_KEYS:
                    out[f"optim/{name}/{key}"] = local(value)
    out["rng/cpu"] = torch.get_rng_state()
    if device.type != "cpu":
        out[f"rng/{device.type}"] = device.get_rng_state()
    for key, value in mt_parallel.get_rng_tracker().get_states().items():
        out[f"rng/tracker/{key}"] = value
    return out


Source = Callable[[str, torch.Tensor, list[Run] | None], torch.Tensor | None]
"""``source(name, live_local, runs)``: values shaped like ``live_local``, the local tensor of
entry ``name``: the whole tensor (``runs`` None) or the elements ``runs`` of the flattened
whole tensor, in order (:attr:`StateLayout.runs`); None when the saved state has no such
entry."""


def _moment_like(param: nn.Parameter, values: torch.Tensor) -> torch.Tensor:
    """An AdamW moment for ``param`` holding this rank's ``values`` (a DTensor under FSDP2)."""
    values = values.to(local(param).device, dtype=param.dtype, copy=True)
    if isinstance(param, DTensor):
        return DTensor.from_local(
            values, param.device_mesh, param.placements, run_check=False,
            shape=param.shape, stride=param.stride(),
        )  # fmt: skip
    return values


@torch.no_grad()
def load_state(module: nn.Module, optimizer: Any, layout: StateLayout, source: Source) -> None:
    """Fill model and optimizer state from ``source`` (same local names); optimizer state
    that ``source`` lacks (a state from before the first step) is cleared."""
    for key, live in module.state_dict().items():
        name = f"model/{canonical_key(key)}"
        target = local(live)
        values = source(name, target, layout.runs.get(name))
        if values is None:
            raise KeyError(f"the saved state has no {name!r}")
        target.copy_(values)
    if optimizer is None:
        return
    if isinstance(optimizer, Zero1AdamW):
        _load_zero1(optimizer, layout, source)
        return
    fused = any(g.get("fused") for g in optimizer.param_groups)
    for name, param in named_parameters(module).items():
        step = source(f"optim/{name}/step", torch.zeros(()), None)
        if step is None:
            optimizer.state.pop(param, None)
            continue
        state = {"step": step.to(local(param).device if fused else "cpu", copy=True)}
        for key in MOMENTS:
            entry = f"optim/{name}/{key}"
            values = source(entry, local(param), layout.runs.get(entry))
            if values is None:
                raise KeyError(f"the saved state has {name!r}'s AdamW step but not its {key}")
            state[key] = _moment_like(param, values)
        optimizer.state[param] = state


def _load_zero1(optimizer: Zero1AdamW, layout: StateLayout, source: Source) -> None:
    optimizer.sync_master()
    step = source(f"optim/{optimizer.names[0]}/step", torch.zeros(()), None)
    if step is None:
        optimizer.inner.state.pop(optimizer.master, None)
        return
    fused = any(g.get("fused") for g in optimizer.param_groups)
    master = optimizer.master
    state = {"step": step.to(master.device if fused else "cpu", copy=True)}
    for key in MOMENTS:
        flat = torch.zeros_like(master)  # padding past the last parameter stays 0
        for view in optimizer.views():
            entry = f"optim/{view.name}/{key}"
            values = source(entry, flat[view.local], layout.runs[entry])
            if values is None:
                raise KeyError(f"the saved state has {view.name!r}'s AdamW step but not its {key}")
            flat[view.local] = values
        state[key] = flat
    optimizer.inner.state[master] = state


def restore_rng(states: dict[str, torch.Tensor], device: Any) -> None:
    """Set torch's generators and mt_parallel's tracker from ``rng/...`` local entries
    (a state without tracker entries leaves the tracker as seeded)."""
    torch.set_rng_state(states["rng/cpu"])
    if device.type != "cpu" and f"rng/{device.type}" in states:
        device.set_rng_state(states[f"rng/{device.type}"])
    prefix = "rng/tracker/"
    tracker = {k[len(prefix) :]: v.clone() for k, v in states.items() if k.startswith(prefix)}
    if tracker:
        mt_parallel.get_rng_tracker().set_states(tracker)
