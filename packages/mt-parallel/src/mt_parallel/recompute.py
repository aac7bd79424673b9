"""Activation recomputation applied to a model as a transform.

Policies (:class:`~mt_parallel.ParallelConfig` ``recompute``):

* ``none``: keep every activation.
* ``selective``: recompute only the cheap-to-redo, expensive-to-keep parts: ``attention`` wraps
  every :class:`~mt_parallel.model.CoreAttention` (the ``S×S`` softmax probabilities are not
  kept), ``mlp`` every :class:`~mt_parallel.model.SwiGLU` (the ``S×F`` activation product).
* ``full``: recompute whole blocks, block ``i`` when ``i % every == 0`` (``every=1``: all).

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

import functools
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from mt_parallel.config import RECOMPUTE_POLICIES, SELECTIVE_TARGETS
from mt_parallel.model import CoreAttention, DecoderBlock, SwiGLU
from mt_parallel.rng import recompute_rng_contexts

_SELECTIVE_TYPES: dict[str, type[nn.Module]] = {"attention": CoreAttention, "mlp": SwiGLU}


def _forks_rng(module: nn.Module) -> bool:
    return any(m.forks_rng() for m in module.modules() if hasattr(m, "forks_rng"))


def _recomputed_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # The plain context otherwise: torch.compile accepts no other context_fn.
    context_fn = recompute_rng_contexts if _forks_rng(module) else noop_context_fn
    return checkpoint(
        type(module).forward, module, *args, use_reentrant=False, context_fn=context_fn, **kwargs
    )


def recompute_module(module: nn.Module) -> None:
    """Make ``module`` recompute its forward in backward instead of keeping activations."""
    if is_recomputed(module):
        return
    # A partial of the module itself (not a closure) so copy.deepcopy rebinds it to the copy.
    module.forward = functools.partial(_recomputed_forward, module)  # type: ignore[method-assign]


def is_recomputed(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _recomputed_forward


def apply_recompute(
    model: nn.Module,
    policy: str,
    every: int = 1,
    targets: tuple[str, ...] | list[str] = ("attention",),
    block_types: tuple[type[nn.Module], ...] = (DecoderBlock,),
) -> nn.Module:
    """Apply ``policy`` to ``model`` in place (module docstring); returns ``model``."""
    if policy not in RECOMPUTE_POLICIES:
        raise ValueError(f"recompute policy {policy!r}; valid: {', '.join(RECOMPUTE_POLICIES)}")
    if every < 1:
        raise ValueError(f"recompute every={every} must be a positive integer")
    if policy == "full":
        blocks = [m for m in model.modules() if isinstance(m, block_types)]
        for index, block in enumerate(blocks):
            if index % every == 0:
                recompute_module(block)
    elif policy == "selective":
        unknown = [t for t in targets if t not in SELECTIVE_TARGETS]
        if unknown or not targets:
            raise ValueError(
                f"selective recompute targets {list(targets)}; valid: {', '.join(SELECTIVE_TARGETS)}"
            )
        kinds = tuple(_SELECTIVE_TYPES[t] for t in targets)
        for module in model.modules():
            if isinstance(module, kinds):
                recompute_module(module)
    return model
