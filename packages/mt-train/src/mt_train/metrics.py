"""Metrics on rank 0: a progress bar (or log lines) and the run's metric loggers.

The loggers (JSONL, TensorBoard, W&B, MLflow and any plugin's) share one interface and
registry, :mod:`mt_train.loggers`; :class:`MetricsLogger` hands every record to each of them.
Metrics are not worth stopping a run for: a logger that fails with an operating-system error
(a full or read-only disk) is reported in one warning line and dropped; training, checkpoints,
the console and the other loggers go on.

Throughput is measured between two log points: ``tokens/s = tokens / wall seconds`` over all
ranks, after synchronising the device so queued GPU work is counted. Model FLOPs
utilisation is ``MFU = flops_per_token · tokens/s / (peak · world_size)`` with the device's
dense bf16 peak from ``mt_core`` (``Capabilities.peak_bf16_flops``); on a device without a
known peak (the CPU) MFU is left out rather than guessed.
"""

from __future__ import annotations

import contextlib
import errno
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from mt_train.config.schema import LoggingConfig
from mt_train.loggers import RunInfo, build_sinks


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.3g}"
        return f"{value:.4f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


class MetricsLogger:
    """Rank 0 writes; other ranks' calls are no-ops."""

    def __init__(
        self,
        cfg: LoggingConfig,
        output_dir: Path,
        total_steps: int,
        start_step: int,
        enabled: bool,
        run: RunInfo | None = None,
    ) -> None:
        self.enabled = enabled
        self.bar = None
        self.sinks: dict[str, Any] = {}
        if not enabled:
            return
        if cfg.progress_bar:
            self.bar = tqdm(
                total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True
            )
        self.sinks = build_sinks(cfg, run or RunInfo(output_dir), self._warn)

    def _warn(self, name: str, err: OSError, sink: Any = None) -> None:
        """One warning line for logger ``name`` failing with ``err`` (module docstring)."""
        code = errno.errorcode.get(err.errno or 0, "no errno")
        what = getattr(sink, "path", None) or err.filename or f"the {name} logger"
        self.write(
            f"mt-train: warning: cannot write {what}: {err.strerror or err} ({code}); the "
            f"{name} logger stops here, training goes on"
        )

    def _drop(self, name: str, err: OSError) -> None:
        sink = self.sinks.pop(name)
        self._warn(name, err, sink)
        with contextlib.suppress(OSError):  # what it cannot flush is lost with it
            sink.close()

    def advance(self, steps: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(steps)

    def set_step(self, step: int) -> None:
        """Move the bar to ``step`` (after a rewind took the step counter back)."""
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def log(self, step: int, metrics: dict[str, Any], kind: str = "train") -> None:
        if not self.enabled:
            return
        finite = {k: v for k, v in metrics.items() if not (isinstance(v, float) and math.isnan(v))}
        for name, sink in list(self.sinks.items()):
            try:
                sink.log(step, kind, finite)
            except OSError as err:
                self._drop(name, err)
        shown = {k: _fmt(v) for k, v in finite.items() if k in DISPLAY}
        if self.bar is not None:
            if kind == "train":
                self.bar.set_postfix(shown, refresh=True)
            else:
                self.bar.write(
                    f"step {step} {kind}: " + " ".join(f"{k}={v}" for k, v in shown.items())
                )
        else:
            print(
                f"step {step} {kind}: " + " ".join(f"{k}={v}" for k, v in shown.items()),
                file=sys.stderr,
            )

    def write(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        for sink in self.sinks.values():
            sink.close()
        self.sinks = {}


DISPLAY = ("loss", "val_loss", "grad_norm", "lr", "tok/s", "mfu", "mem_gib", "moe_max_vio", "event")


class Throughput:
    """Tokens/s, MFU and peak memory between two log points (module docstring)."""

    def __init__(
        self,
        device: Any,
        tokens_per_step: int,
        flops_per_token: float,
        world_size: int,
        observe: Callable[[dict[str, float], int], dict[str, float]] | None = None,
    ) -> None:
        self.device, self.tokens_per_step = device, tokens_per_step
        self.flops_per_token, self.world_size = flops_per_token, world_size
        self.observe = observe
        """Called at every measurement with its numbers and step count; what it returns is
        added (the step-time breakdown, :meth:`mt_train.observer.RunObserver.at_log_point`)."""
        self.peak_flops = device.capabilities().peak_bf16_flops
        self.start()

    def start(self) -> None:
        """Start measuring now (the run's first step, or after a log point)."""
        self.since, self.steps = time.perf_counter(), 0

    def measure(self) -> dict[str, float]:
        """``tok/s``, ``mfu`` (when the peak is known) and ``mem_gib`` over the healthy steps
        since the last call (``steps`` is counted by the caller), and what ``observe`` adds."""
        self.device.synchronize()
        now = time.perf_counter()
        tps = self.steps * self.tokens_per_step / (now - self.since)
        out = {"tok/s": tps}
        if self.peak_flops:
            out["mfu"] = self.flops_per_token * tps / (self.peak_flops * self.world_size)
        out["mem_gib"] = self.device.memory_stats().get("peak_allocated", 0) / 2**30
        steps, self.since, self.steps = self.steps, now, 0
        if self.observe is not None:
            out.update(self.observe(out, steps))
        return out
