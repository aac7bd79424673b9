"""Anomaly detectors: what makes a step unhealthy, judged on one rank.

Every step yields :class:`StepSignals`: the loss ``L`` (mean over the global batch, the same on
every rank), the pre-clip global gradient norm ``n`` (the same on every data-parallel rank),
this rank's own loss ``ℓ_r`` and the largest FP8 saturated fraction ``σ_r`` over this rank's FP8
layers and roles (mt_fp8's health counts: values clipped at the format maximum / all values).

Running baseline. For ``x ∈ {L, n}`` the last ``W`` healthy values ``x_1..x_W`` (``window``) give
a robust centre and spread that a single outlier cannot drag::

    m = median(x_i)          MAD = median(|x_i - m|)          σ̂ = 1.4826 · MAD

(``1.4826·MAD`` estimates the standard deviation of normal data.) A value is a spike when::

    x > T = max(f · m,  m + k · σ̂)

with a factor ``f`` and a robust z-score ``k`` per signal (``loss_spike_*``,
``grad_norm_spike_*``): it must be both *large* (``f``: a relative jump, which stops a
plateau whose MAD shrinks toward 0 from flagging ordinary noise) and *improbable* (``k``: far
outside the recent spread, which stops a noisy phase from flagging its own noise). While
the loss falls, the median of the window lags above the current loss, so falling curves only
make the test more lenient.

Detectors, in priority order (the first that fired names an event):

* ``non_finite``: ``ℓ_r``, ``L`` or ``n`` is NaN or ±inf. Always on, even during warm-up.
* ``fp8_overflow``: ``σ_r > fp8_saturation`` — a burst of values clipped by a stale or wrong
  FP8 scale (delayed scaling lags a sudden activation or gradient jump by one step).
* ``loss_spike``: ``L > T_L``.
* ``grad_norm_spike``: ``n > T_n``.

The spike and FP8 checks wait for ``warmup_steps`` completed steps and ``min_samples`` values
in the window (early training moves too fast for a baseline to mean anything).

Invariants: only healthy steps (the verdict agreed over all ranks) enter the baselines, and
they enter with the global ``L`` and ``n``, so every rank holds the same baselines. Findings
can still differ between ranks: ``ℓ_r`` and ``σ_r`` are rank-local, and a fault on one rank
(a bit flip in its gradients after the all-reduce) changes its ``n`` only; that is why every
rank acts on the verdict agreed over all of them (:mod:`mt_train.rewind.consensus`), never on
its own findings. The baselines are plain floats, saved as JSON in every
checkpoint manifest, so a resumed run judges exactly as the uninterrupted one would.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from mt_train.config.rewind import RewindConfig

PRIORITY = ("non_finite", "fp8_overflow", "loss_spike", "grad_norm_spike")
"""Detector names in the order that decides which one names an event."""
MAD_TO_SIGMA = 1.4826


@dataclass
class StepSignals:
    """What one step tells the detectors (see the module docstring)."""

    loss: float
    grad_norm: float
    local_loss: float
    fp8_saturation: float = 0.0
    fp8_worst: str = ""
    """Which layer/role saturated most on this rank (for the event log)."""


@dataclass
class Finding:
    """One detector that fired on this rank, with the values that made it fire."""

    detector: str
    value: float
    """The headline value (the loss, the norm, the saturated fraction)."""
    details: dict[str, Any] = field(default_factory=dict)


class RobustBaseline:
    """The last ``window`` healthy values of one signal, with the median / MAD threshold."""

    def __init__(self, window: int) -> None:
        self.values: deque[float] = deque(maxlen=window)

    def __len__(self) -> int:
        return len(self.values)

    def add(self, value: float) -> None:
        if math.isfinite(value):
            self.values.append(float(value))

    def threshold(self, factor: float, k: float) -> dict[str, float]:
        """``{"median", "mad", "threshold"}`` of the current window (needs one value)."""
        median = statistics.median(self.values)
        mad = statistics.median(abs(x - median) for x in self.values)
        threshold = max(factor * median, median + k * MAD_TO_SIGMA * mad)
        return {"median": median, "mad": mad, "threshold": threshold}

    def state(self) -> list[float]:
        return list(self.values)

    def load(self, values: list[float]) -> None:
        self.values.clear()
        self.values.extend(float(v) for v in values)


class DetectorSuite:
    """The enabled detectors of one rank and the baselines they judge against."""

    def __init__(self, cfg: RewindConfig) -> None:
        self.cfg = cfg
        self.enabled = set(cfg.detectors)
        self.loss = RobustBaseline(cfg.window)
        self.grad_norm = RobustBaseline(cfg.window)

    def _warm(self, steps_done: int, baseline: RobustBaseline) -> bool:
        return steps_done >= self.cfg.warmup_steps and len(baseline) >= self.cfg.min_samples

    def check(self, steps_done: int, s: StepSignals) -> list[Finding]:
        """This rank's findings for the step after ``steps_done`` completed steps."""
        cfg, found = self.cfg, []
        if "non_finite" in self.enabled:
            values = {"local_loss": s.local_loss, "loss": s.loss, "grad_norm": s.grad_norm}
            bad = {k: v for k, v in values.items() if not math.isfinite(v)}
            if bad:
                found.append(Finding("non_finite", next(iter(bad.values())), bad))
        if not (math.isfinite(s.loss) and math.isfinite(s.grad_norm)):
            return found  # a spike test of a non-finite value says nothing more
        fp8_on = "fp8_overflow" in self.enabled and steps_done >= cfg.warmup_steps
        if fp8_on and s.fp8_saturation > cfg.fp8_saturation:
            details = {
                "saturated": s.fp8_saturation,
                "threshold": cfg.fp8_saturation,
                "where": s.fp8_worst,
            }
            found.append(Finding("fp8_overflow", s.fp8_saturation, details))
        if "loss_spike" in self.enabled and self._warm(steps_done, self.loss):
            stats = self.loss.threshold(cfg.loss_spike_factor, cfg.loss_spike_k)
            if s.loss > stats["threshold"]:
                found.append(Finding("loss_spike", s.loss, {"loss": s.loss, **stats}))
        if "grad_norm_spike" in self.enabled and self._warm(steps_done, self.grad_norm):
            stats = self.grad_norm.threshold(cfg.grad_norm_spike_factor, cfg.grad_norm_spike_k)
            if s.grad_norm > stats["threshold"]:
                found.append(
                    Finding("grad_norm_spike", s.grad_norm, {"grad_norm": s.grad_norm, **stats})
                )
        return found

    def accept(self, s: StepSignals) -> None:
        """A step all ranks agreed was healthy: its global values join the baselines."""
        self.loss.add(s.loss)
        self.grad_norm.add(s.grad_norm)

    def state_dict(self) -> dict[str, list[float]]:
        return {"loss": self.loss.state(), "grad_norm": self.grad_norm.state()}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        self.loss.load(state.get("loss", []))
        self.grad_norm.load(state.get("grad_norm", []))
