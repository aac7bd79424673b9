"""Rewind targets: in-memory snapshots of the training state and the stable-checkpoint rule.

Snapshot. :func:`capture` copies this rank's whole training state to host memory, under
the local names of :mod:`mt_train.checkpoint.state` (model entries with the FP8 scaling
state, AdamW state, torch's generators and mt_parallel's RNG tracker; under FSDP2 / ZeRO-1
this rank's pieces only). It is restored into the same layout it came from.

The same host copy is what a checkpoint writes (:func:`mt_train.checkpoint.checkpointer.shard_tensors`
renames it into the shard's names), so holding a snapshot costs no extra copy. :func:`restore`
copies it back, cloning every tensor it hands to the optimizer, so one snapshot can be
restored any number of times.

Stable rule. Every checkpoint (and the state a run starts from) becomes a :class:`Target`.
A target at step ``s`` is *stable* once the step counter reaches ``s + stable_after``: since
any anomaly rewinds the counter to a target at or before it, that means ``stable_after``
healthy steps followed ``s`` in the current timeline. Rewind goes to the newest stable target;
when none is stable yet (or its copy cannot be read) it takes the oldest other target held
(the one most healthy steps follow) and says ``"stable": false`` in the event. :class:`Targets` keeps only what a rewind may still need —
the newest stable target and every newer one — and drops the memory of the rest; the
checkpointer never prunes those from disk (``protected``). After a rewind to ``s``, targets
newer than ``s`` belong to the abandoned timeline and are discarded, on disk too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import mt_fp8.state
from mt_train.checkpoint.state import StateLayout, live_state, load_state, restore_rng


def capture(module: nn.Module, optimizer: Any, device: Any) -> dict[str, torch.Tensor]:
    """Host copies of :func:`~mt_train.checkpoint.state.live_state` (never views)."""
    return {
        k: v.detach().to("cpu", copy=True) for k, v in live_state(module, optimizer, device).items()
    }


@torch.no_grad()
def restore(host: dict[str, torch.Tensor], module: nn.Module, optimizer: Any, device: Any) -> None:
    """Put a :func:`capture` back into the same layout (``host`` stays unchanged)."""
    load_state(
        module, optimizer, StateLayout.of(module, optimizer), lambda name, _, __: host.get(name)
    )
    restore_rng(host, device)
    after_load(module)


def after_load(module: nn.Module) -> None:
    """FP8 layers requantize cached weights with the restored scales (and delayed scaling
    uses them once they come from recorded amaxes); health starts afresh."""
    for _, meta in mt_fp8.state.fp8_metas(module):
        meta.after_load()
    mt_fp8.reset_fp8_health(module)


@dataclass
class Target:
    """A state rewind can go back to: a checkpoint on disk, in memory, or both."""

    step: int
    consumed: int
    """The sampler position (global draws) at that step."""
    path: Path | None = None
    host: dict[str, torch.Tensor] | None = None
    stable: bool = False

    def describe(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "path": str(self.path) if self.path else None,
            "in_memory": self.host is not None,
            "stable": self.stable,
        }


class Targets:
    """The rewind targets of a run and the stable rule (see the module docstring)."""

    def __init__(self, stable_after: int) -> None:
        self.stable_after = stable_after
        self.items: list[Target] = []  # ascending step

    def add(self, target: Target) -> None:
        self.items = [t for t in self.items if t.step != target.step]
        self.items.append(target)
        self.items.sort(key=lambda t: t.step)
        self._prune()

    def advance(self, step: int) -> list[Target]:
        """The counter reached ``step`` after a healthy step; returns targets that just became
        stable."""
        newly = [t for t in self.items if not t.stable and step - t.step >= self.stable_after]
        for t in newly:
            t.stable = True
        if newly:
            self._prune()
        return newly

    def _prune(self) -> None:
        stable = [i for i, t in enumerate(self.items) if t.stable]
        if stable:
            self.items = self.items[stable[-1] :]

    def choose(self, step: int) -> list[Target]:
        """Targets at or before ``step`` to try, best first: stable ones newest first, then the
        others oldest first (used only when no stable one can be read)."""
        held = [t for t in self.items if t.step <= step]
        return [t for t in reversed(held) if t.stable] + [t for t in held if not t.stable]

    def discard_after(self, step: int) -> list[Target]:
        """Drop targets newer than ``step`` (the abandoned timeline); returns them."""
        dropped = [t for t in self.items if t.step > step]
        self.items = [t for t in self.items if t.step <= step]
        return dropped

    def drop(self, target: Target) -> None:
        self.items = [t for t in self.items if t is not target]

    @property
    def protected(self) -> set[int]:
        """Steps whose checkpoints must stay on disk."""
        return {t.step for t in self.items if t.path is not None}

    @property
    def stable_steps(self) -> list[int]:
        return [t.step for t in self.items if t.stable and t.path is not None]
