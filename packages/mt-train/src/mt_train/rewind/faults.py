"""Fault injection (config group ``fault``): real faults, injected on purpose, for tests and drills.

Step ``K`` is the optimizer step computed when ``K - 1`` steps are done. With spike factor
``F`` (``fault.spike_factor``):

* ``nan_at_step``: every micro-batch loss of step K is multiplied by NaN, so the loss and all
  gradients are non-finite;
* ``spike_at_step``: every micro-batch loss of step K is multiplied by ``F`` before backward:
  the reported loss and the gradients are ``F`` times larger;
* ``grad_spike_at_step``: after backward (and the gradient all-reduce) the gradients are
  multiplied by ``F``; the loss is untouched;
* ``fp8_overflow_at_step``: forward pre-hooks multiply the input of every FP8 linear by ``F``
  during step K; a delayed-scaling recipe quantizes it with last step's scale and saturates;
* ``bad_batch_at_step``: ``S_K``, the samples of step K in the fault-free data order (global
  draws ``[(K-1)·G, K·G)``), are poisoned: a micro-batch holding any of them has its loss
  multiplied by ``F`` every time it is trained on, whatever the step. Replaying them spikes
  again, so only skipping data gets past it;
* ``kill_at_step``: as step K begins the process sends itself SIGKILL (nothing runs after it:
  no handler, no flush; an async checkpoint save may be half written);
* ``sigterm_at_step``: as step K begins the process sends itself SIGTERM (a preemption);
* ``hang_at_step``: as step K begins the process sleeps ``fault.hang_s`` seconds (a hang, for
  the step watchdog and the collective timeout);
* ``corrupt_latest_checkpoint``: at start-up, before resuming, bytes in the middle of the
  newest complete checkpoint's first shard are flipped (its sha256 no longer matches).

Every fault but ``bad_batch`` is one-shot per run folder: the ``fault`` event is written to
``events.jsonl`` (fsynced) before the fault acts, and a run that finds it there at start-up
(a restart after the kill) leaves that fault disarmed. All ranks decide identically whether a
fault fires; with ``fault.rank`` set only that rank applies it, so the others must learn of
the anomaly through the agreed verdict.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from mt_train import ranks
from mt_train.checkpoint.files import latest_checkpoint
from mt_train.config.rewind import FaultConfig
from mt_train.data.dataset import ResumableSampler
from mt_train.rewind.events import EventLog


@dataclass
class StepFaults:
    """What the faults do to the step being computed (1: nothing)."""

    loss: float = 1.0
    grads: float = 1.0
    fp8_inputs: float = 1.0


def corrupt_latest(root: Path) -> Path | None:
    """Flip 64 bytes in the middle of the newest complete checkpoint's first shard."""
    latest = latest_checkpoint(root)
    if latest is None:
        return None
    shard = sorted(latest.glob("rank-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    for i in range(middle, min(middle + 64, len(data))):
        data[i] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard


class FaultInjector:
    """Applies ``cfg`` on this rank (see the module docstring)."""

    def __init__(
        self,
        cfg: FaultConfig,
        rank: int,
        fired: Iterable[str],
        bad_samples: Iterable[int],
        events: EventLog,
    ) -> None:
        self.cfg = cfg
        self.acts = cfg.rank is None or cfg.rank == rank
        self.fired = set(fired)
        self.bad_samples = np.asarray(sorted(bad_samples), dtype=np.int64)
        self.events = events
        self.current = StepFaults()

    def _fire(self, name: str, step: int) -> bool:
        """Whether one-shot fault ``name`` fires at ``step`` (recorded once, on every rank)."""
        at = self.cfg.step_faults.get(name)
        if at != step or name in self.fired:
            return False
        self.fired.add(name)
        self.events.emit("fault", step - 1, fault=name, at_step=step, rank=self.cfg.rank)
        return True

    def corrupt_at_start(self, root: Path) -> None:
        """``corrupt_latest_checkpoint``: rank 0 damages the newest checkpoint (once per run)."""
        name = "corrupt_latest_checkpoint"
        if not self.cfg.corrupt_latest_checkpoint or name in self.fired:
            return
        self.fired.add(name)
        shard = corrupt_latest(root) if self.events.path is not None else None
        self.events.emit("fault", 0, fault=name, at_step=0, shard=str(shard) if shard else None)
        ranks.barrier()

    def begin_step(self, step: int) -> StepFaults:
        """Fire the faults of step ``step`` (1-based); returns what they do to it."""
        F = self.cfg.spike_factor
        if self._fire("kill", step):
            ranks.barrier()  # the event is on disk before any rank dies
            if self.acts:
                os.kill(os.getpid(), signal.SIGKILL)
        if self._fire("sigterm", step) and self.acts:
            os.kill(os.getpid(), signal.SIGTERM)
        if self._fire("hang", step) and self.acts:
            time.sleep(self.cfg.hang_s)
        faults = StepFaults()
        if self._fire("nan", step) and self.acts:
            faults.loss = float("nan")
        if self._fire("spike", step) and self.acts:
            faults.loss = F
        if self._fire("grad_spike", step) and self.acts:
            faults.grads = F
        if self._fire("fp8_overflow", step) and self.acts:
            faults.fp8_inputs = F
        self.current = faults
        return faults

    def micro_loss_factor(self, indices: np.ndarray) -> float:
        """The bad-batch factor of a micro-batch holding sample ``indices`` (1 if clean)."""
        if not self.acts or self.bad_samples.size == 0:
            return 1.0
        return self.cfg.spike_factor if np.isin(indices, self.bad_samples).any() else 1.0

    def install_fp8_hooks(self, model: nn.Module) -> None:
        """Pre-hooks on the FP8 linears that scale their input while ``fp8_inputs != 1``."""

        def hook(_module: nn.Module, args: tuple) -> tuple | None:
            factor = self.current.fp8_inputs
            if factor == 1.0 or not args or not isinstance(args[0], torch.Tensor):
                return None
            return (args[0] * factor, *args[1:])

        for module in model.modules():
            if getattr(module, "fp8_enabled", False):
                module.register_forward_pre_hook(hook)


def fault_injector(
    cfg: FaultConfig,
    rank: int,
    fired: Iterable[str],
    train_samples: int,
    seed: int,
    global_batch_size: int,
    independent_draws: bool,
    events: EventLog,
    model: nn.Module,
) -> FaultInjector:
    """This run's injector: the one-shot faults in ``fired`` (already recorded in the run
    folder) disarmed, the bad batch's samples drawn from the fault-free data order (the run's
    ``independent_draws`` sampling), and the FP8
    input hooks installed on ``model`` when ``fp8_overflow_at_step`` is set."""
    bad: list[int] = []
    if cfg.bad_batch_at_step is not None:
        order = ResumableSampler(
            train_samples, seed, global_batch_size, global_batch_size,
            independent=independent_draws,
        )  # fmt: skip
        order.consumed = (cfg.bad_batch_at_step - 1) * global_batch_size
        bad = order.next_step()[0].tolist()
    injector = FaultInjector(cfg, rank, fired, bad, events)
    if cfg.fp8_overflow_at_step is not None:
        injector.install_fp8_hooks(model)
    return injector
