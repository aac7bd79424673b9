"""FSDP2 for a module that two of a rank's pipeline chunks share.

Under ``zbv`` and ``dualpipev`` rank 0 holds the first and the last chunk. A model whose last
chunk also runs modules of the first (the layout's ``last_shared``: DeepSeek-V3's MTP embeds
the shifted tokens with the input embedding) then has one module ``S`` in both chunks, used
by both chunks' forwards, its gradient ``g = g_first + g_last`` accumulated by autograd into
one ``.grad`` from both chunks' backwards (the one-process gradient: ``S``'s gradient is the
sum over its uses). FSDP2 lets a parameter belong to one unit, and torch's pipeline runtime
drives each chunk as one FSDP2 root: ``UNSHARD`` all-gathers every unit inside the chunk
before its first action, ``RESHARD`` frees them when the chunk leaves its look-ahead, and
``REDUCE_GRAD`` (after the chunk's last backward) reduce-scatters every unit of the root and
reshards it. Taken as is, the first chunk's ``REDUCE_GRAD`` would reduce ``g_first`` alone,
or the last chunk's ``RESHARD`` free ``S`` while the first chunk's backwards still need it.
So, with ``data_parallel=fsdp``:

* :func:`shard_chunks` makes ``S`` its own FSDP2 unit over dp×cp (``reshard_after_forward
  =False``, as the chunks) *before* the chunks' ``fully_shard``, so neither chunk's units
  hold its parameters, and its own root: each chunk root is initialised (FSDP2's lazy init,
  which picks the root of every unit below it) with ``S`` out of its module tree, then ``S``
  on its own. ``S``'s hooks (all-gather before a forward or backward that finds it sharded,
  the post-backward callback) and gradient flags are then its own; the chunks' are theirs.
  ``S`` is one unit with no unit inside (a shared module holding routed experts, which
  FSDP2 shards as units of their own, is refused).
* :class:`SharedUnits` makes the runtime reduce ``S`` once per step. At the step's start
  ``S`` accumulates without reducing (the runtime also sets every unit of a chunk, ``S``
  included, to no-sync before each of its backwards); a chunk's ``REDUCE_GRAD`` reduces the
  chunk's own units and leaves ``S`` accumulating while another chunk holding it still has a
  backward to run; after the last one's ``REDUCE_GRAD``, ``S``'s ``g`` is reduce-scattered
  once (averaged over dp×cp as every FSDP2 gradient) and ``S`` resharded, as torch's
  ``REDUCE_GRAD`` does for a chunk. A step that ends with ``S`` unreduced raises.
* ``RESHARD`` of a chunk frees ``S`` only when no other chunk holding it is unsharded (or
  being unsharded): ``S`` is gathered once per step, at the first chunk's ``UNSHARD`` (the
  other chunk's finds it gathered), and stays so while either chunk may still compute.

Parameter names, optimizer state and checkpoints are as for any FSDP2 parameter: ``S``'s are
DTensors sharded along dim 0 over dp×cp under their one name in
:class:`~mt_parallel.PipelineModule`. Every parameter of ``S`` gets a gradient in every step
(both chunks run it on every micro-batch), so every rank of the dp×cp group takes the
reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from mt_parallel.data_parallel import apply_data_parallel
from mt_parallel.pipeline.split import PipelineChunk, detached


def shared_paths(chunks: Sequence[PipelineChunk]) -> dict[str, nn.Module]:
    """The modules (by path) that more than one of ``chunks`` holds besides its blocks."""
    holders: dict[str, list[nn.Module]] = {}
    for chunk in chunks:
        for path in chunk.held_paths:
            holders.setdefault(path, []).append(chunk.get_submodule(path))
    return {path: held[0] for path, held in holders.items() if len(held) > 1}


def shard_chunks(
    chunks: Sequence[PipelineChunk],
    group: Any,
    device_type: str,
    block_types: tuple[type[nn.Module], ...],
) -> None:
    """FSDP2 over ``group`` for each chunk (blocks, expert units and the chunk as one root)
    and for each module several chunks share, as its own unit and root (module docstring)."""
    shared = shared_paths(chunks)
    for path, module in shared.items():
        apply_data_parallel(module, "fsdp", group, device_type, (), reshard_after_forward=False)
        # SharedUnits reduces and reshards the shared unit alone: none may be nested in it.
        nested = [
            n for n, m in module.named_modules() if m is not module and isinstance(m, FSDPModule)
        ]
        if nested:
            raise ValueError(
                f"the module {path!r}, which several pipeline chunks of this rank hold, has "
                f"FSDP2 units of its own inside ({nested}, routed experts): not supported "
                "under data_parallel=fsdp; use ddp, zero1 or none, or a schedule that puts "
                "the chunks on different ranks"
            )
    for chunk in chunks:
        apply_data_parallel(
            chunk, "fsdp", group, device_type, block_types, reshard_after_forward=False
        )
    if not shared:
        return
    for chunk in chunks:
        with detached(chunk, [path for path in chunk.held_paths if path in shared]):
            fully_shard.state(chunk)._lazy_init()
    for module in shared.values():
        fully_shard.state(module)._lazy_init()


class SharedUnits:
    """The FSDP2 units in more than one of a rank's chunks, and the runtime actions that
    reduce each once per step and keep it gathered while a chunk may use it (module
    docstring)."""

    def __init__(self, chunks: Sequence[nn.Module], stage_ids: Sequence[int]) -> None:
        holders: dict[nn.Module, set[int]] = {}
        for chunk, stage in zip(chunks, stage_ids, strict=True):
            for module in chunk.modules():
                if isinstance(module, FSDPModule) and module is not chunk:
                    holders.setdefault(module, set()).add(stage)
        self.holders = {m: frozenset(s) for m, s in holders.items() if len(s) > 1}
        """Each shared unit -> the stages (global chunk indices) holding it."""
        self._waiting: dict[nn.Module, set[int]] = {}

    def __bool__(self) -> bool:
        return bool(self.holders)

    def start_step(self) -> None:
        """Every shared unit accumulates until its last chunk's ``REDUCE_GRAD``."""
        for unit, stages in self.holders.items():
            _accumulate(unit)
            unit.set_is_last_backward(False)
            self._waiting[unit] = set(stages)

    def chunk_reduced(self, stage: int) -> None:
        """After torch's ``REDUCE_GRAD`` of ``stage`` (which set the flags of every unit in
        its chunk to reduce): reduce the shared units no other chunk still needs, keep the
        others accumulating."""
        for unit, waiting in self._waiting.items():
            if stage not in waiting:
                continue
            waiting.discard(stage)
            if waiting:
                _accumulate(unit)
            else:
                _reduce(unit)

    def finish_step(self) -> None:
        """Raise if a shared unit's gradient was not reduced in the step."""
        left = {type(u).__name__: sorted(w) for u, w in self._waiting.items() if w}
        if left:
            raise RuntimeError(
                f"shared FSDP2 units {left} still wait for the REDUCE_GRAD of these stages "
                "after the schedule: their gradients were never reduced"
            )

    def reshard(self, action: Any, ctx: Any) -> None:
        """``RESHARD`` of a chunk: torch's action (every FSDP2 unit in the chunk freed, the
        stage marked sharded), except for shared units another chunk still has gathered."""
        runtime, index = ctx.schedule_ref, action.stage_index
        if index not in runtime.unsharded_stages or index in runtime.unshard_ops:
            raise AssertionError(f"resharding stage {index}, which is not unsharded")
        stage = next(s for s in runtime._stages if s.stage_index == index)
        active = (runtime.unsharded_stages | set(runtime.unshard_ops)) - {index}
        for module in stage.submod.modules():
            if isinstance(module, FSDPModule) and not self.holders.get(module, set()) & active:
                module.reshard()
        runtime.unsharded_stages.remove(index)


def _accumulate(unit: FSDPModule) -> None:
    unit.set_requires_gradient_sync(False, recurse=False)
    unit.set_reshard_after_backward(False, recurse=False)


def _reduce(unit: FSDPModule) -> None:
    """What torch's ``REDUCE_GRAD`` does for a chunk root (``PipelineStage.
    perform_reduce_grad``): FSDP2's post-backward (reduce-scatter, reshard), then its final
    callback (waits for the reduction, clears the step's state)."""
    unit.set_is_last_backward(True)
    unit.set_reshard_after_backward(True, recurse=False)
    unit.set_requires_gradient_sync(True, recurse=False)
    state = fully_shard.state(unit)
    for group in fsdp_param_groups(state):
        group.post_backward()
    state._root_post_backward_final_callback()


def fsdp_param_groups(state: Any) -> list[Any]:
    """The FSDP2 state's parameter groups: a list since torch 2.13, one or None before."""
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    return [state._fsdp_param_group] if state._fsdp_param_group is not None else []
