"""Dropout under tensor / sequence / context parallelism: which random stream draws each mask.

Regions (Megatron's rule). An activation is either *replicated* over the TP group (the residual
stream without sequence parallel: every TP rank holds the same tokens) or *sharded* over it
(attention probabilities of this rank's heads; the residual stream's sequence shard under SP).

* Replicated regions draw from the default generators (CPU and device). Every TP rank must draw
  the same mask, so the default generators are seeded identically on all TP ranks and only
  replicated regions ever advance them (the invariant that keeps them in step).
* Sharded regions draw from the tracker's ``"tensor-parallel"`` state, seeded with a
  TP-rank offset, so every shard gets its own mask. :meth:`RNGStatesTracker.fork` swaps that
  state into the default generator of the tensor's device for the region and swaps it back out
  afterwards: the default stream is exactly as if the region had not drawn.

Seeds (:func:`manual_seed`), for base ``seed``, TP rank ``t`` and CP rank ``c``::

    default          = seed + CP_SEED_STRIDE·c        (same on all TP ranks)
    tensor-parallel  = default + 2718 + t             (Megatron's offset)

CP ranks hold different tokens everywhere, so both streams differ per CP rank; DP ranks share
them (their data differ). At tp=1 with no seed set, sharded regions use the default generators
(plain single-process dropout); at tp>1 every dropout needs :func:`manual_seed` first, since
nothing else guarantees that replicated regions agree or that sharded ones differ.

Recompute. ``torch.utils.checkpoint`` restores the default generators before recomputing, which
replays replicated-region masks; :func:`recompute_rng_contexts` (its ``context_fn``) snapshots
the tracker at the forward and restores that snapshot for the recomputation (and the tracker's
current states after it), which replays sharded-region masks. Checkpoints save
:meth:`RNGStatesTracker.get_states` next to the default generator states for exact resumption.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mt_parallel.mappings import group_size

TENSOR_PARALLEL = "tensor-parallel"
TP_SEED_OFFSET = 2718
CP_SEED_STRIDE = 1 << 20


def _generator_module(device_type: str) -> Any:
    """The module with ``get_rng_state``/``set_rng_state``/``manual_seed`` for a device type."""
    return torch if device_type == "cpu" else torch.get_device_module(device_type)


class RNGStatesTracker:
    """Named random streams that a region can fork into (module docstring).

    Each name has a seed; its state per device type is created from the seed on the first fork
    on that device and carried from fork to fork afterwards.
    """

    def __init__(self) -> None:
        self._seeds: dict[str, int] = {}
        self._states: dict[tuple[str, str], torch.Tensor] = {}

    def reset(self) -> None:
        self._seeds.clear()
        self._states.clear()

    def add(self, name: str, seed: int) -> None:
        if "/" in name:
            raise ValueError(f"RNG stream name {name!r} must not contain '/'")
        if name in self._seeds:
            raise ValueError(f"RNG stream {name!r} is already seeded")
        if seed in self._seeds.values():
            raise ValueError(f"seed {seed} is already used by another RNG stream")
        self._seeds[name] = seed

    def is_seeded(self, name: str = TENSOR_PARALLEL) -> bool:
        return name in self._seeds

    def get_states(self) -> dict[str, torch.Tensor]:
        """A snapshot for :meth:`set_states`, flat enough for safetensors checkpoints:
        ``"<name>/seed"`` (int64) and ``"<name>/<device type>"`` (the generator state)."""
        states = {f"{name}/seed": torch.tensor(seed) for name, seed in self._seeds.items()}
        states.update({f"{name}/{device}": state for (name, device), state in self._states.items()})
        return states

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.reset()
        for key, value in states.items():
            name, what = key.split("/", 1)
            if what == "seed":
                self._seeds[name] = int(value)
            else:
                self._states[(name, what)] = value

    @contextlib.contextmanager
    def fork(self, name: str = TENSOR_PARALLEL, device_type: str = "cpu") -> Iterator[None]:
        """Draw from stream ``name`` on ``device_type`` inside the block; default stream untouched."""
        if name not in self._seeds:
            raise RuntimeError(f"RNG stream {name!r} is not seeded: call mt_parallel.manual_seed")
        module = _generator_module(device_type)
        outer = module.get_rng_state()
        key = (name, device_type)
        if key in self._states:
            module.set_rng_state(self._states[key])
        else:
            module.manual_seed(self._seeds[name])
        try:
            yield
        finally:
            self._states[key] = module.get_rng_state()
            module.set_rng_state(outer)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker that :class:`Dropout` and the attention core fork into."""
    return _TRACKER


def manual_seed(seed: int, tp_rank: int = 0, cp_rank: int = 0) -> None:
    """Seed the default generators (CPU and accelerators, via ``torch.manual_seed``) and the
    tracker's ``"tensor-parallel"`` stream (module docstring)."""
    default = seed + CP_SEED_STRIDE * cp_rank
    torch.manual_seed(default)  # also seeds the accelerators' default generators
    _TRACKER.reset()
    _TRACKER.add(TENSOR_PARALLEL, default + TP_SEED_OFFSET + tp_rank)


def rng_region(
    sharded: bool, tp_group: Any, device: torch.device
) -> contextlib.AbstractContextManager:
    """The context a dropout on ``device`` runs in: a tracker fork for sharded activations."""
    seeded = _TRACKER.is_seeded()
    if group_size(tp_group) > 1 and not seeded:
        raise RuntimeError(
            "dropout under tensor parallelism needs mt_parallel.manual_seed(seed, tp_rank, "
            "cp_rank) first: replicated activations must draw the same mask on every TP rank, "
            "sharded ones different masks"
        )
    if sharded and seeded:
        return _TRACKER.fork(TENSOR_PARALLEL, device.type)
    return contextlib.nullcontext()


def forks_rng(training: bool, p: float, sharded: bool) -> bool:
    """Whether a dropout with these settings draws from the tracker in its next forward."""
    return training and p > 0 and sharded and _TRACKER.is_seeded()


def recompute_rng_contexts() -> tuple[contextlib.AbstractContextManager, Any]:
    """``context_fn`` for ``torch.utils.checkpoint``: replay the tracker in the recomputation."""
    snapshot = _TRACKER.get_states()
    return contextlib.nullcontext(), _replay(snapshot)


@contextlib.contextmanager
def _replay(snapshot: dict[str, torch.Tensor]) -> Iterator[None]:
    current = _TRACKER.get_states()
    _TRACKER.set_states(snapshot)
    try:
        yield
    finally:
        _TRACKER.set_states(current)


class Dropout(nn.Module):
    """``F.dropout`` whose mask comes from the right region (module docstring).

    ``sharded``: the activations differ across TP ranks even without sequence parallel (e.g.
    inside a TP region). Dropouts on the residual stream start replicated and become sharded
    when :func:`mt_parallel.apply_tensor_parallel` turns sequence parallel on.
    """

    def __init__(self, p: float = 0.0, sharded: bool = False) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability p={p} must be in [0, 1)")
        self.p, self.sharded = p, sharded
        self.tp_group: Any = None

    def set_tensor_parallel(self, tp_group: Any, sequence_parallel: bool) -> None:
        """Hook of the TP transform: under SP the residual stream is a sequence shard."""
        self.tp_group = tp_group
        self.sharded = self.sharded or sequence_parallel

    def forks_rng(self) -> bool:
        """Whether the next forward draws from the tracker (recompute then replays it)."""
        return forks_rng(self.training, self.p, self.sharded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        with rng_region(self.sharded, self.tp_group, x.device):
            return F.dropout(x, self.p, training=True)

    def extra_repr(self) -> str:
        return f"p={self.p}, sharded={self.sharded}"
