"""What the step-time breakdown costs: mt-train's tokens/s with ``logging.step_breakdown`` on and off.

Runs ``python -m mt_train <overrides> logging.step_breakdown=<on|off>`` as separate launches,
alternating off, on, off, on, ... for ``--rounds`` rounds (so drift of the machine hits both
alike), each ``--steps`` steps with a log point every ``--log-interval`` steps. A launch's
throughput is the median ``tok/s`` of its log records after the first ``--skip`` steps
(compilation, CUDA-graph capture and allocator warm-up excluded); the overhead is
``1 - median(on) / median(off)`` over the launches. The "on" launches' records also give the
mean breakdown of a step (``time/<phase>`` in ms, ``time/step_max``), printed as a table.

The default workload is the dense Llama slice of ``docs/performance.md`` (Llama3-8B shapes cut
to 8 layers, sequence 8192, batch 1, bf16, FP8 delayed scaling, CUDA graph); ``--overrides``
replaces it, ``--tiny`` runs a toy model on the CPU (the smoke test).

Run: ``python benchmarks/step_breakdown_overhead.py --out results.jsonl`` (GPU), or
``python benchmarks/step_breakdown_overhead.py --tiny`` on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import harness

SLICE = (
    "model=llama3_8b model.n_layers=8 trainer.seq_len=8192 trainer.global_batch_size=1 "
    "trainer.micro_batch_size=1 trainer.precision=bf16 fp8=delayed trainer.cuda_graph=true"
)
TINY = (
    "model.dim=64 model.n_layers=2 model.n_heads=4 model.n_kv_heads=2 model.ffn_dim=128 "
    "trainer.seq_len=64 trainer.global_batch_size=8 trainer.micro_batch_size=8 "
    "trainer.device=cpu"
)
COMMON = (  # a stable LR (train_throughput.py's): a non-finite loss would end a launch
    "checkpoint=disabled trainer.eval_interval=1000000 trainer.sample_tokens=0 "
    "logging.progress_bar=false optimizer.lr=1e-4 scheduler.warmup_steps=1"
)


def launch_throughput(records: list[dict[str, Any]], skip: int) -> float:
    """Median tokens/s of a launch's train records after step ``skip``."""
    rates = [r["tok/s"] for r in records if r.get("kind") == "train" and r["step"] > skip]
    if not rates:
        raise ValueError(f"no train record after step {skip}: run more steps or skip fewer")
    return statistics.median(rates)


def mean_breakdown(records: list[dict[str, Any]], skip: int) -> dict[str, float]:
    """Mean of every ``time/*`` value (seconds per step) over the train records after ``skip``."""
    rows = [r for r in records if r.get("kind") == "train" and r["step"] > skip]
    keys = sorted({k for r in rows for k in r if k.startswith("time/")})
    return {k: statistics.fmean(r[k] for r in rows) for k in keys}


def overhead(on: list[float], off: list[float]) -> float:
    """``1 - median(on) / median(off)``: the fraction of throughput the breakdown costs."""
    return 1.0 - statistics.median(on) / statistics.median(off)


def run_once(args: argparse.Namespace, breakdown: bool, folder: Path) -> list[dict[str, Any]]:
    overrides = [
        *(args.overrides or (TINY if args.tiny else SLICE)).split(),
        *COMMON.split(),
        f"trainer.max_steps={args.steps}",
        f"trainer.log_interval={args.log_interval}",
        f"logging.step_breakdown={str(breakdown).lower()}",
        f"trainer.output_dir={folder}",
        f"hydra.run.dir={folder}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run(
        [args.python, "-m", "mt_train", *overrides],
        capture_output=True,
        text=True,
        env=env,
        timeout=args.timeout_s,
    )
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"mt-train exited {done.returncode}:\n{tail}")
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--overrides", default=None, help="mt-train overrides (the workload)")
    parser.add_argument("--tiny", action="store_true", help="a toy model on the CPU")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--skip", type=int, default=20, help="steps left out of the medians")
    parser.add_argument("--rounds", type=int, default=2, help="off/on launch pairs")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per launch")
    parser.add_argument("--workdir", default=None, help="run folders (default: a temp dir)")
    parser.add_argument("--out", default=None, help="append the result as a JSON line")
    args = parser.parse_args(argv)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    breakdowns: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(args.workdir or scratch)
        for round_ in range(args.rounds):
            for label, on in (("off", False), ("on", True)):
                records = run_once(args, on, root / f"{label}-{round_}")
                rates[label].append(launch_throughput(records, args.skip))
                if on:
                    breakdowns.append(mean_breakdown(records, args.skip))
    keys = breakdowns[0].keys()
    mean = {k: statistics.fmean(b[k] for b in breakdowns) for k in keys}
    row = {
        "workload": args.overrides or ("tiny" if args.tiny else "dense Llama slice"),
        "steps": args.steps,
        "log_interval": args.log_interval,
        "tokens_per_s_off": rates["off"],
        "tokens_per_s_on": rates["on"],
        "overhead": overhead(rates["on"], rates["off"]),
        "breakdown_s": mean,
    }
    print("| phase | ms per step |\n| --- | --- |")
    for key, seconds in mean.items():
        print(f"| {key.removeprefix('time/')} | {seconds * 1e3:.2f} |")
    print(
        f"tokens/s off {statistics.median(rates['off']):,.0f}, on "
        f"{statistics.median(rates['on']):,.0f}: overhead {row['overhead']:+.2%}"
    )
    harness.emit(row, args.out, prefix="RESULT ")
    return row


if __name__ == "__main__":
    main()
