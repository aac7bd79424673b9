"""Metrics sinks: a progress bar (or log lines), a JSONL file and optional TensorBoard.

Throughput is measured between two log points: ``tokens/s = tokens / wall seconds`` over all
ranks, after synchronising the device so queued GPU work is counted. Model FLOPs
utilisation is ``MFU = flops_per_token · tokens/s / (peak · world_size)`` with the device's
dense bf16 peak from ``mt_core`` (``Capabilities.peak_bf16_flops``); on a device without a
known peak (the CPU) MFU is left out rather than guessed.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from mt_train.config.schema import LoggingConfig


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.3g}"
        return f"{value:.4f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


class MetricsLogger:
    """Rank 0 writes; other ranks' calls are no-ops."""

    def __init__(
        self, cfg: LoggingConfig, output_dir: Path, total_steps: int, start_step: int, enabled: bool
    ) -> None:
        self.enabled = enabled
        self.bar = None
        self.jsonl = None
        self.tb = None
        if not enabled:
            return
        if cfg.progress_bar:
            self.bar = tqdm(
                total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True
            )
        if cfg.jsonl:
            self.jsonl = open(output_dir / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise ImportError(
                    "logging.tensorboard=true needs TensorBoard: pip install 'mt-train[tensorboard]'"
                ) from err
            self.tb = SummaryWriter(str(output_dir / "tensorboard"))

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
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"kind": kind, "step": step, **finite}) + "\n")
            self.jsonl.flush()
        if self.tb is not None:
            for key, value in finite.items():
                if isinstance(value, int | float):
                    self.tb.add_scalar(f"{kind}/{key}", value, step)
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
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()


DISPLAY = ("loss", "val_loss", "grad_norm", "lr", "tok/s", "mfu", "mem_gib", "moe_max_vio", "event")


class Throughput:
    """Tokens/s, MFU and peak memory between two log points (module docstring)."""

    def __init__(
        self, device: Any, tokens_per_step: int, flops_per_token: float, world_size: int
    ) -> None:
        self.device, self.tokens_per_step = device, tokens_per_step
        self.flops_per_token, self.world_size = flops_per_token, world_size
        self.peak_flops = device.capabilities().peak_bf16_flops
        self.start()

    def start(self) -> None:
        """Start measuring now (the run's first step, or after a log point)."""
        self.since, self.steps = time.perf_counter(), 0

    def measure(self) -> dict[str, float]:
        """``tok/s``, ``mfu`` (when the peak is known) and ``mem_gib`` over the healthy steps
        since the last call (``steps`` is counted by the caller)."""
        self.device.synchronize()
        now = time.perf_counter()
        tps = self.steps * self.tokens_per_step / (now - self.since)
        out = {"tok/s": tps}
        if self.peak_flops:
            out["mfu"] = self.flops_per_token * tps / (self.peak_flops * self.world_size)
        out["mem_gib"] = self.device.memory_stats().get("peak_allocated", 0) / 2**30
        self.since, self.steps = now, 0
        return out
