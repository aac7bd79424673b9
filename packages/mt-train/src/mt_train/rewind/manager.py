"""The rewind policy: judge each step, pick the target, skip data, cool the LR, bound the retries.

The trainer calls, per step: :meth:`RewindManager.judge` (detectors + agreement over ranks),
then :meth:`accept` for a healthy step, or, for an anomaly, :meth:`plan` (the bound, the targets
to try) and, once it restored one, :meth:`commit` (history, cool-down, data skipped, event).

Data skipped after restoring target ``c`` (sampler position ``p_c``) for an anomaly whose step
drew global draws ``[a, b)`` (``rewind.skip``):

* ``window``: ``[p_c, b)`` — every batch trained on since ``c``, the anomalous one included;
* ``batches``: ``[a, b)`` — only the anomalous step's batch; the ones before it are replayed;
* ``none``: nothing — everything is replayed (for transient faults).

The sampler goes back to ``p_c`` and jumps over skipped ranges as it meets them, so the run
trains on exactly the data it would have, minus the skipped draws.

LR cool-down: after a rewind to step ``c`` the LR multiplier is
``λ(s) = f + (1 - f)·(s - c)/W`` for ``c ≤ s < c + W`` (``f = lr_cooldown_factor``,
``W = lr_cooldown_steps``) and 1 otherwise — the next anomaly's window replaces it.

Bound: an anomaly at step ``t`` is rewound only if fewer than ``N = max_rewinds`` earlier
rewinds had their anomaly at a step after ``t - M`` (``M = max_rewinds_window``); otherwise the
run stops with :class:`RewindLimitError`, whose message lists those rewinds. A batch that spikes
every time it is replayed therefore stops the run after ``N`` rewinds instead of looping.

State kept across rewinds (it describes the run, not the model): the detectors' baselines,
the history, the cool-down, the targets at or before the restored step. All of it goes into
every checkpoint manifest (JSON), so a restarted run carries on with the same policy state.
A rewind's own decisions (skipped data, history, cool-down) are newer than the checkpoint it
restored, so the trainer also writes them to ``rewind-decisions.json`` in the checkpoint folder
at once (atomically); a resume merges them, and a crash right after a rewind loses nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from mt_train.config.rewind import RewindConfig
from mt_train.rewind.consensus import Verdict, agree
from mt_train.rewind.detectors import DetectorSuite, StepSignals
from mt_train.rewind.events import EventLog, describe_anomaly
from mt_train.rewind.snapshot import Target, Targets


class RewindLimitError(FloatingPointError):
    """The run stopped instead of rewinding again (too many rewinds, or no target)."""


class RewindManager:
    """Per-run rewind state and policy (see the module docstring)."""

    def __init__(self, cfg: RewindConfig, events: EventLog, device: torch.device) -> None:
        self.cfg = cfg
        self.events = events
        self.device = device
        detector_cfg = cfg
        if not cfg.enabled:  # rewind off: only non-finite values are checked, to stop the run
            detector_cfg = RewindConfig(detectors=["non_finite"])
        self.detectors = DetectorSuite(detector_cfg)
        self.targets = Targets(cfg.stable_after)
        self.history: list[dict[str, Any]] = []
        self.cooldown: dict[str, float] | None = None

    @property
    def rewinds(self) -> int:
        return len(self.history)

    # ------------------------------------------------------------------ per step
    def judge(self, steps_done: int, signals: StepSignals, stop: bool) -> Verdict:
        """This step's verdict, the same on every rank (collective: every rank calls it)."""
        return agree(self.detectors.check(steps_done, signals), stop, self.device)

    def accept(self, steps_done: int, signals: StepSignals) -> None:
        """A healthy step made the counter ``steps_done``: feed the baselines, mark stability."""
        self.detectors.accept(signals)
        for target in self.targets.advance(steps_done):
            self.events.emit(
                "stable",
                steps_done,
                quiet=True,
                checkpoint=target.step,
                path=str(target.path) if target.path else None,
                healthy_steps=steps_done - target.step,
            )

    def lr_factor(self, step: int) -> float:
        """The cool-down multiplier of the LR at ``step`` (0-based, the step being taken)."""
        c = self.cooldown
        if c is None or not c["start"] <= step < c["start"] + c["steps"]:
            return 1.0
        return c["factor"] + (1.0 - c["factor"]) * (step - c["start"]) / c["steps"]

    def add_target(self, target: Target) -> None:
        if self.cfg.enabled:
            self.targets.add(target)

    # ------------------------------------------------------------------ anomalies
    def _in_window(self, step: int) -> list[dict[str, Any]]:
        return [h for h in self.history if h["step"] > step - self.cfg.max_rewinds_window]

    def give_up(self, steps_done: int, verdict: Verdict, reason: str) -> RewindLimitError:
        """Log the ``give_up`` event; the error (with the report) for the caller to raise."""
        record = self.events.emit(
            "give_up",
            steps_done,
            detector=verdict.detector,
            detectors=verdict.detectors,
            ranks=verdict.ranks,
            values=verdict.values,
            reason=reason,
            history=self.history,
        )
        lines = [f"rewind: stopped at step {steps_done + 1}: {describe_anomaly(record)}", reason]
        for h in self.history:
            lines.append(
                f"  rewind at step {h['step']}: {h['detector']}, restored step "
                f"{h['restored']} ({h['source']}), skipped {h['skipped_steps']} step(s) of data"
            )
        if self.cfg.skip == "none" and self.history:
            lines.append(
                "  rewind.skip=none replays the same data; rewind.skip=window (or batches) skips "
                "the batches that led to the anomaly"
            )
        stable = [t for t in self.targets.items if t.stable and t.path is not None]
        if stable:
            lines.append(f"  newest stable checkpoint: {stable[-1].path}")
        return RewindLimitError("\n".join(lines))

    def plan(self, steps_done: int, verdict: Verdict) -> list[Target]:
        """Targets to try for the anomaly of step ``steps_done + 1``, best first; raises
        :class:`RewindLimitError` past the bound or with nothing to go back to."""
        step = steps_done + 1
        recent = self._in_window(step)
        cfg = self.cfg
        if len(recent) >= cfg.max_rewinds:
            raise self.give_up(
                steps_done,
                verdict,
                f"{len(recent)} rewind(s) within the last {cfg.max_rewinds_window} steps already "
                f"(rewind.max_rewinds={cfg.max_rewinds}, "
                f"rewind.max_rewinds_window={cfg.max_rewinds_window})",
            )
        targets = self.targets.choose(steps_done)
        if not targets:
            raise self.give_up(steps_done, verdict, "no checkpoint or snapshot to rewind to")
        return targets

    def skip_range(self, target: Target, draws: tuple[int, int]) -> tuple[int, int] | None:
        """The global draws to skip after restoring ``target`` (``rewind.skip``)."""
        if self.cfg.skip == "window":
            return (target.consumed, draws[1])
        if self.cfg.skip == "batches":
            return draws
        return None

    def commit(
        self,
        steps_done: int,
        verdict: Verdict,
        target: Target,
        source: str,
        skipped: tuple[int, int] | None,
        global_batch: int,
    ) -> list[Target]:
        """Record the rewind of step ``steps_done + 1`` to ``target``; returns the targets of
        the abandoned timeline (newer than ``target``) for the caller to delete."""
        cfg = self.cfg
        skipped_steps = (skipped[1] - skipped[0]) // global_batch if skipped else 0
        self.history.append(
            {
                "step": steps_done + 1,
                "detector": verdict.detector,
                "restored": target.step,
                "source": source,
                "skipped_steps": skipped_steps,
            }
        )
        self.cooldown = None
        if cfg.lr_cooldown_steps > 0 and cfg.lr_cooldown_factor < 1:
            self.cooldown = {
                "start": target.step,
                "steps": cfg.lr_cooldown_steps,
                "factor": cfg.lr_cooldown_factor,
            }
        dropped = self.targets.discard_after(target.step)
        self.events.emit(
            "rewind",
            steps_done,
            detector=verdict.detector,
            detectors=verdict.detectors,
            ranks=verdict.ranks,
            values=verdict.values,
            restored={**target.describe(), "source": source},
            skipped={
                "policy": cfg.skip,
                "draws": [list(skipped)] if skipped else [],
                "steps": skipped_steps,
            },
            lr_cooldown=(
                {"factor": cfg.lr_cooldown_factor, "steps": cfg.lr_cooldown_steps}
                if self.cooldown
                else None
            ),
            discarded=[t.step for t in dropped],
            rewinds_in_window=len(self._in_window(steps_done + 1)),
            max_rewinds=cfg.max_rewinds,
            window=cfg.max_rewinds_window,
        )
        return dropped

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        return {
            "detectors": self.detectors.state_dict(),
            "history": list(self.history),
            "cooldown": self.cooldown,
            "stable": self.targets.stable_steps,
        }

    def decisions(self) -> dict[str, Any]:
        """What a rewind decided that the restored checkpoint does not know (see
        ``merge_decisions``)."""
        return {"history": list(self.history), "cooldown": self.cooldown}

    def merge_decisions(self, state: dict[str, Any]) -> None:
        """After loading a checkpoint: take the later of its history and ``state``'s (a history
        only grows, so the longer one is the later)."""
        if len(state.get("history", [])) > len(self.history):
            self.history = list(state["history"])
            self.cooldown = state.get("cooldown")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.detectors.load_state_dict(state.get("detectors", {}))
        self.history = list(state.get("history", []))
        self.cooldown = state.get("cooldown")
