"""Activation recomputation applied to a model as a transform.

Policies (:class:`~mt_parallel.ParallelConfig` ``recompute``):

* ``none``: keep every activation.
* ``selective``: recompute only the cheap-to-redo, expensive-to-keep parts: every module whose
  class declares ``recompute_target`` equal to a requested target. ``attention``:
  :class:`~mt_parallel.CoreAttention` (the ``S×S`` softmax probabilities are not kept);
  ``mlp``: :class:`~mt_parallel.SwiGLU` (the ``S×F`` activation product). A model family's own
  attention core or activation declares the same attribute.
* ``full``: recompute whole blocks (the ``block_types`` the caller names, e.g. a
  :class:`~mt_parallel.ParallelizePlan`'s), block ``i`` when ``i % every == 0`` (``every=1``:
  all).
  ``keep`` names outputs the recomputation reuses instead of computing again (PyTorch's
  selective activation checkpointing: the forward stores the outputs of the chosen operators,
  and the recomputation returns them in the same order instead of running the operators).
  ``attention`` keeps the attention core's output and log-sum-exp: 2·B·S·D bytes in bf16 per
  block for one attention forward less per block in the backward. At long sequences that is the
  block's best trade of memory for time: the attention forward costs O(S²·D), its output is
  O(S·D), while each projection's output costs as many bytes per FLOP as its GEMM.
  The kept operators are the fused ``scaled_dot_product_attention`` kernels (flash, efficient,
  cuDNN, CPU flash); attention that runs through PyTorch's math fallback is recomputed, and ring
  attention (``cp_attention="ring"``) keeps the partial output of every ring step.
  In eager mode the dispatch modes that store and return the outputs are entered around each
  attention-core call only, not around the whole block, because a Python dispatch mode costs
  host time on every operator under it (docs/performance.md, "32 layers").
  Under ``torch.compile`` (which traces such modes away) they cover the block, as PyTorch's
  selective checkpointing is documented.
  Refused with dropout in the block: an operator that is not run again does not advance the
  random generator, so the recomputation's later dropout masks would differ.

Wrapping replaces the module's ``forward`` on the instance by a call through
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``; parameters, their names and the
state dict are untouched. The checkpoint saves the CPU and device RNG states and restores them
for the recomputation, and (when a dropout inside forks the RNG tracker) the tracker's states
too (:func:`mt_parallel.rng.recompute_rng_contexts`), so dropout draws the same mask twice, in
replicated and in TP-sharded regions alike, and gradients are bit-identical to those without
recompute. Collectives inside a recomputed region (TP, SP, CP) run again in
backward, in the same order on every rank.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from mt_parallel.config import RECOMPUTE_KEEP_TARGETS, RECOMPUTE_POLICIES, SELECTIVE_TARGETS
from mt_parallel.rng import Dropout, recompute_rng_contexts


def _forks_rng(module: nn.Module) -> bool:
    return any(m.forks_rng() for m in module.modules() if hasattr(m, "forks_rng"))


@functools.cache
def _kept_ops(keep: tuple[str, ...]) -> frozenset[Any]:
    """The operators whose outputs a recomputation with ``keep`` reuses (module docstring)."""
    names = {
        "attention": (
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
        )
    }
    return frozenset(
        getattr(torch.ops.aten, name).default
        for target in keep
        for name in names[target]
        if hasattr(torch.ops.aten, name)  # which kernels exist depends on the torch build
    )


def _keep_policy(keep: tuple[str, ...]) -> Any:
    ops = _kept_ops(keep)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


# The dispatch mode (storing in the forward, returning in the recomputation) that the kept
# modules of the running checkpoint enter; a stack, as checkpoints may nest. One stack per
# thread: a checkpoint's forward publishes on the thread running it and its recomputation on
# the autograd engine's, and DualPipeV's overlapped halves (mt_parallel.pipeline.overlap) run
# a forward and a backward on two threads that take turns inside them.
_KEEP_MODES = threading.local()


def _active_keep_modes() -> list[Any]:
    modes = getattr(_KEEP_MODES, "stack", None)
    if modes is None:
        modes = _KEEP_MODES.stack = []
    return modes


@contextlib.contextmanager
def _publish(mode: Any) -> Iterator[None]:
    modes = _active_keep_modes()
    modes.append(mode)
    try:
        yield
    finally:
        modes.pop()


def _scoped_keep_contexts(keep: tuple[str, ...]) -> tuple[Any, Any]:
    """``context_fn``: PyTorch's selective-checkpoint modes, published for the kept modules to
    enter instead of being entered around the whole region (module docstring)."""
    forward_mode, recompute_mode = create_selective_checkpoint_contexts(_keep_policy(keep))
    return _publish(forward_mode), _publish(recompute_mode)


def _kept_module_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward of a module whose operators' outputs a recomputation reuses."""
    modes = _active_keep_modes()
    if not modes:
        return type(module).forward(module, *args, **kwargs)
    with modes[-1]:
        return type(module).forward(module, *args, **kwargs)


def _recomputed_forward(module: nn.Module, keep: tuple[str, ...], *args: Any, **kwargs: Any) -> Any:
    if keep and torch.compiler.is_compiling():
        policy = _keep_policy(keep)
        contexts = {"context_fn": functools.partial(create_selective_checkpoint_contexts, policy)}
    elif keep:
        contexts = {"context_fn": functools.partial(_scoped_keep_contexts, keep)}
    elif _forks_rng(module):
        contexts = {"context_fn": recompute_rng_contexts}
    else:  # no context_fn: torch.compile traces no other (not even the default, passed in)
        contexts = {}
    return checkpoint(
        type(module).forward, module, *args, use_reentrant=False, **contexts, **kwargs
    )


def _targets(module: nn.Module, name: str) -> list[nn.Module]:
    """The submodules (``module`` included) whose class declares ``recompute_target = name``."""
    return [m for m in module.modules() if getattr(m, "recompute_target", None) == name]


def _has_dropout(module: nn.Module) -> bool:
    """A residual :class:`~mt_parallel.Dropout` or an attention core with dropout inside."""
    return any(isinstance(m, Dropout) and m.p > 0 for m in module.modules()) or any(
        core.dropout > 0 for core in _targets(module, "attention")
    )


def recompute_module(module: nn.Module, keep: tuple[str, ...] | list[str] = ()) -> None:
    """Make ``module`` recompute its forward in backward instead of keeping activations,
    except the outputs named in ``keep`` (module docstring)."""
    keep = tuple(keep)
    unknown = [t for t in keep if t not in RECOMPUTE_KEEP_TARGETS]
    if unknown:
        raise ValueError(
            f"recompute keep={list(keep)}; valid entries: {', '.join(RECOMPUTE_KEEP_TARGETS)}"
        )
    if keep and _has_dropout(module):
        raise ValueError(
            f"recompute keep={list(keep)} with dropout in {type(module).__name__}: a kept "
            "operator is not run again, so the recomputation's dropout masks would differ; "
            "set the dropout to 0 or keep nothing"
        )
    if is_recomputed(module):
        return
    if "attention" in keep:
        for core in _targets(module, "attention"):
            core.forward = functools.partial(_kept_module_forward, core)  # type: ignore[method-assign]
    # A partial of the module itself (not a closure) so copy.deepcopy rebinds it to the copy.
    module.forward = functools.partial(_recomputed_forward, module, keep)  # type: ignore[method-assign]


def is_recomputed(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _recomputed_forward


def apply_recompute(
    model: nn.Module,
    policy: str,
    every: int = 1,
    targets: tuple[str, ...] | list[str] = ("attention",),
    block_types: tuple[type[nn.Module], ...] = (),
    keep: tuple[str, ...] | list[str] = (),
) -> nn.Module:
    """Apply ``policy`` to ``model`` in place (module docstring); returns ``model``. ``keep``
    applies to ``full`` only, which needs the ``block_types`` it recomputes."""
    if policy not in RECOMPUTE_POLICIES:
        raise ValueError(f"recompute policy {policy!r}; valid: {', '.join(RECOMPUTE_POLICIES)}")
    if keep and policy != "full":
        raise ValueError(f"recompute keep={list(keep)} needs the full policy, got {policy!r}")
    if every < 1:
        raise ValueError(f"recompute every={every} must be a positive integer")
    if policy == "full":
        if not block_types:
            raise ValueError("full recompute needs the block types to recompute (block_types)")
        blocks = [m for m in model.modules() if isinstance(m, block_types)]
        for index, block in enumerate(blocks):
            if index % every == 0:
                recompute_module(block, keep)
    elif policy == "selective":
        unknown = [t for t in targets if t not in SELECTIVE_TARGETS]
        if unknown or not targets:
            raise ValueError(
                f"selective recompute targets {list(targets)}; valid: {', '.join(SELECTIVE_TARGETS)}"
            )
        for target in targets:
            for module in _targets(model, target):
                recompute_module(module)
    return model
