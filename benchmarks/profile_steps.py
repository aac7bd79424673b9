"""Kernel time by name of one mt-train step per plan-validation configuration (one GPU).

For each configuration of ``plan_validation.CONFIGS`` named on the command line, a fresh
process builds the trainer from that configuration's overrides, runs 3 warm-up steps, times 3
steps (their median is ``step_s``), then profiles one more with ``torch.profiler`` and sums
the device time of the CUDA kernels by name. What ``docs/plan.md`` compares with the cost
model's per-op charges; these steps are not validation rows.

Run: ``python3 benchmarks/profile_steps.py 8b-l8-s8k-bf16,8b-l8-s8k-tensorwise --out profile.jsonl``
(one JSON object per configuration: ``name``, ``step_s``, ``kernels``: name → [µs, launches]).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import plan_validation

WARMUP, TIMED = 3, 3


def profile_one(name: str) -> dict[str, Any]:
    """The module docstring's measurement of configuration ``name`` in this process."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from mt_train import Trainer, compose_config, to_train_config

    overrides = plan_validation.with_batch(plan_validation.CONFIGS[name])
    cfg = to_train_config(compose_config([*overrides, "trainer.device=auto"]))
    with tempfile.TemporaryDirectory() as folder:
        trainer = Trainer(cfg, output_dir=folder)
        for _ in range(WARMUP):
            trainer.train_step()
        torch.cuda.synchronize()
        times = []
        for _ in range(TIMED):
            start = time.perf_counter()
            trainer.train_step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            trainer.train_step()
            torch.cuda.synchronize()
        trainer.close()
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels.setdefault(event.name, [0.0, 0])
            entry[0] += event.device_time_total
            entry[1] += 1
    return {"name": name, "step_s": statistics.median(times), "kernels": kernels}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("configs", help="comma-separated plan_validation configuration names")
    parser.add_argument("--out", type=Path, default=Path("profile.jsonl"))
    parser.add_argument("--one", action="store_true", help="profile one in this process")
    parser.add_argument("--timeout-s", type=float, default=170)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(profile_one(args.configs)))
        return 0
    for name in args.configs.split(","):
        began = time.time()
        cmd = [sys.executable, __file__, name, "--one"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
        lines = done.stdout.strip().splitlines()
        if done.returncode or not lines:
            print(name, "failed:", done.stderr[-2000:], flush=True)
            continue
        row = json.loads(lines[-1])
        with args.out.open("a") as out:
            out.write(json.dumps(row) + "\n")
        print(f"{name}: step {row['step_s']:.4f} s ({time.time() - began:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
