"""The FP8 weight cache: a layer's quantized weight, kept across the micro-batches of one step.

Each FP8 layer owns a :class:`WeightCache` (``FP8Linear.fp8_weight_cache``; an
``FP8GroupedLinear`` one per expert and one for its grouped path) holding at most one
:class:`CachedWeight`: the FP8 weight ``w`` and, when the dgrad GEMM needs it, ``wᵀ``. The entry
is reused while its key still matches (:func:`weight_key`):

* the weight is the same tensor object (a weak reference, so a new parameter that happens to
  reuse freed memory is not mistaken for the old one), with the same storage pointer, device and
  ``_version``;
* the caller's context is the same (recipe, delayed-scaling ``scale_version``, amax group,
  whether ``wᵀ`` is needed);
* no ``torch.optim`` optimizer has stepped since (:func:`optimizer_steps`): i.e. across the
  micro-batches of one optimizer step.

The last condition is a counter that a global optimizer step post-hook
(``torch.optim.optimizer.register_optimizer_step_post_hook``) advances after every step of every
torch optimizer. It is registered by :func:`install_optimizer_step_hook`, which every
:class:`WeightCache` calls when it is created (so creating the first FP8 layer installs it; it is
idempotent, and importing :mod:`mt_fp8` registers nothing). NOTE: the version counter alone is
not enough: fused optimizer kernels (``torch.optim.AdamW(fused=True)``, the default on GPUs)
update parameters in place without bumping ``_version`` (seen with torch 2.11 and 2.13), and a
cache keyed on it kept serving the first step's FP8 weights. Writes outside a torch optimizer
that do not bump ``_version`` either (``p.data.copy_(...)``, a custom fused update) need a call
to :func:`mt_fp8.clear_fp8_weight_caches` afterwards. Under ``torch.compile`` the cache is
bypassed (the weight is quantized inside the graph, where the compiler can fuse it).

Inside :func:`final_micro_batch` (``mt_parallel.accumulate(model, is_last=True)`` enters it) a
layer's backward drops its cache entry once it has run (:meth:`WeightCache.release_after_backward`):
no later call of this optimizer step needs it, and the entries would otherwise stay alive until
the next step's forward, adding the FP8 ``w`` and ``wᵀ`` of every layer (2 bytes per weight
element) to the memory peak at the end of backward, where all gradients exist. Under activation
recompute the recomputed forward still finds the entry (it runs just before the layer's
backward), so the weight is quantized once per step either way.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

_steps = 0
"""Steps taken by any torch optimizer since :func:`install_optimizer_step_hook` ran."""

_hook: Any = None
"""The handle of the registered optimizer step post-hook, or None before it is installed."""

_open_final_micro_batches = 0
"""Open :func:`final_micro_batch` contexts. A plain global, not thread-local: the autograd
engine runs CUDA backward functions on its own device threads."""


def _count_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    global _steps
    _steps += 1


def install_optimizer_step_hook() -> None:
    """Register the global optimizer step post-hook that :func:`optimizer_steps` counts with;
    a no-op once registered (module docstring)."""
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_post_hook(_count_optimizer_step)


def optimizer_steps() -> int:
    """Steps taken by any torch optimizer in this process since the hook was installed."""
    return _steps


def weight_owner(weight: torch.Tensor) -> torch.Tensor:
    """The tensor whose identity a cache entry holds: a view's base (an expert's slice of a
    grouped weight is a new object on every call; views share the base's version counter)."""
    return weight._base if weight._base is not None else weight


def weight_key(weight: torch.Tensor, context: tuple[Hashable, ...]) -> tuple[Hashable, ...]:
    """The key an entry for ``weight`` is stored and found under: the optimizer step count,
    ``weight``'s version, storage pointer and device, then the caller's ``context``."""
    return (optimizer_steps(), weight._version, weight.data_ptr(), weight.device, *context)


@dataclass(frozen=True)
class CachedWeight:
    """One cached FP8 weight and what it was made for."""

    key: tuple[Hashable, ...]
    """:func:`weight_key` of the weight it was quantized from."""
    owner: weakref.ref
    """A weak reference to that weight's :func:`weight_owner`."""
    weight: Any
    """The FP8 ``w`` (a :class:`~mt_fp8.quantized.QuantizedTensor`; stacked for a grouped
    layer)."""
    weight_transposed: Any | None
    """The FP8 ``wᵀ`` for the dgrad GEMM, or None when it was not needed."""


class WeightCache:
    """At most one :class:`CachedWeight` of one layer (module docstring). False when empty."""

    def __init__(self) -> None:
        install_optimizer_step_hook()
        self.entry: CachedWeight | None = None
        """The cached weight, or None."""

    def __bool__(self) -> bool:
        return self.entry is not None

    def lookup(self, key: tuple[Hashable, ...], weight: torch.Tensor) -> CachedWeight | None:
        """The entry if it was made under ``key`` from this very ``weight``, else None."""
        entry = self.entry
        if entry is not None and entry.key == key and entry.owner() is weight_owner(weight):
            return entry
        return None

    def store(
        self,
        key: tuple[Hashable, ...],
        weight: torch.Tensor,
        weight_q: Any,
        weight_t_q: Any | None,
    ) -> None:
        """Keep ``weight_q`` (and ``weight_t_q``), quantized from ``weight`` under ``key``."""
        self.entry = CachedWeight(key, weakref.ref(weight_owner(weight)), weight_q, weight_t_q)

    def clear(self) -> None:
        """Drop the entry."""
        self.entry = None

    def release_after_backward(self) -> None:
        """Called by FP8 layers' backward: drop the entry inside :func:`final_micro_batch`."""
        if _open_final_micro_batches:
            self.entry = None


@contextlib.contextmanager
def final_micro_batch() -> Iterator[None]:
    """Run the last micro-batch of an optimizer step: each FP8 layer's backward inside drops
    the layer's cached FP8 weight after using it (module docstring)."""
    global _open_final_micro_batches
    _open_final_micro_batches += 1
    try:
        yield
    finally:
        _open_final_micro_batches -= 1
