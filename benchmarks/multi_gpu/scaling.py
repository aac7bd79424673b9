"""Weak-scaling matrix: run ``throughput.py`` once per configuration (each its own ``torchrun``),
then report tokens/s per GPU, MFU, peak memory and the efficiency against one device.

Configurations, for ``--gpus N`` (each model × precision):

* models: ``L8`` (8 layers, no recompute, DDP) and ``L32`` (32 layers, full recompute, FSDP2:
  with fp32 parameters and AdamW the 32-layer model needs ~128 GB of parameters, gradients and
  optimizer state, so DDP's extra gradient buckets cannot fit on one 141 GB H200 and even the
  one-device baseline is tight; that is an estimate, the run will tell);
* layouts: ``dp1`` on one device (the baseline), then ``dpN``, ``tp2-sp`` (dp = N/2), ``tpN-sp``
  (N > 2), ``cp2`` (dp = N/2), and for N ≥ 4 ``dp{N/4}-cp2-tp2-sp`` and for N = 8 ``dp2-tp4-sp``;
* precisions: ``bf16`` and ``fp8`` (mt_fp8 tensorwise).

Efficiency = tokens/s/GPU of the layout / tokens/s/GPU of ``dp1`` with the same model, precision,
data-parallel mode, recompute and sequence (weak scaling: each device gets the same number of
tokens per step, see throughput.py). Targets (issue 8): ≥ 90% for pure data parallel, ≥ 80% for
tp=2 with sequence parallel. Rows without a one-device baseline (it failed or was not run) show
no efficiency.

Runs are started in matrix order until ``--budget-s`` has passed (for a job with a time limit),
each under ``--run-timeout-s``; every row (or its error) is appended to ``--out``, and
``--report FILE`` prints the table of everything in FILE, so a matrix can be spread over several
commands. ``--dry-run`` prints the commands only.

    # on N GPUs (docs/multi_gpu.md says how to read the report)
    python3 benchmarks/multi_gpu/scaling.py --gpus 8 --models L8 --precisions bf16 --out s.jsonl
    python3 benchmarks/multi_gpu/scaling.py --report s.jsonl
    # CPU rehearsal
    python3 benchmarks/multi_gpu/scaling.py --gpus 4 --tiny --device cpu --out /tmp/s.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: the shared harness
import harness  # noqa: E402

# Lines that name what went wrong, most telling first (a rank's collective mismatch or refusal
# before the "connection reset" its peers report as a consequence).
ERROR_PATTERNS = [
    re.compile(p)
    for p in (r"refused:", r"enforce fail", r"OutOfMemoryError", r"^\w*(Error|Exception)\b")
]
THROUGHPUT = HERE / "throughput.py"
MODELS = {
    "L8": ["--layers", "8", "--dp-mode", "ddp"],
    "L32": ["--layers", "32", "--recompute", "full", "--dp-mode", "fsdp"],
}
TARGETS = {"dp": 0.90, "tp2-sp": 0.80}
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def layouts(gpus: int) -> list[tuple[int, str]]:
    """(processes, layout) in run order: the one-device baseline first."""
    out = [(1, "dp1")]
    if gpus >= 2:
        out += [(gpus, f"dp{gpus}"), (gpus, "tp2-sp")]
        if gpus > 2:
            out.append((gpus, f"tp{gpus}-sp"))
        out.append((gpus, "cp2"))
    if gpus >= 4 and gpus % 4 == 0:
        out.append((gpus, f"dp{gpus // 4}-cp2-tp2-sp"))
    if gpus == 8:
        out.append((gpus, "dp2-tp4-sp"))
    return out


def matrix(args: argparse.Namespace) -> list[tuple[int, list[str]]]:
    wanted = set(args.layouts.split(",")) if args.layouts else None
    runs = []
    for model in args.models.split(","):
        for precision in args.precisions.split(","):
            for nproc, layout in layouts(args.gpus):
                if wanted is not None and layout not in wanted:
                    continue
                argv = [*MODELS[model], "--layout", layout, "--precision", precision]
                argv += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
                if args.tiny:
                    argv += ["--tiny", "--layers", "2" if model == "L8" else "4"]
                if args.device != "auto":
                    argv += ["--device", args.device]
                argv += args.extra
                runs.append((nproc, argv))
    return runs


def launch(nproc: int, argv: list[str], args: argparse.Namespace) -> dict[str, Any] | None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", str(THROUGHPUT), *argv,
    ]  # fmt: skip
    if args.out:
        command += ["--out", args.out]
    print("$ " + " ".join(command[1:]), flush=True)
    if args.dry_run:
        return None
    env = {**os.environ, **NO_MULTICAST}
    if args.device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    run = harness.run_isolated(command, timeout_s=args.run_timeout_s, marker="RESULT ", env=env)
    if run.returncode is None:
        row = {"tag": " ".join(argv), "world": nproc, "error": "timeout"}
        harness.append_jsonl(args.out, row)
        return row
    if run.result is not None:
        return run.result  # throughput.py appended it to --out itself
    row = {"tag": " ".join(argv), "world": nproc, "error": f"exit {run.returncode}: "}
    ranks = [json.loads(ln.split(" ", 1)[1]) for ln in run.stdout.splitlines() if ln[:4] == "RANK"]
    lines = run.stderr.splitlines()
    first = next(
        (ln.strip() for pattern in ERROR_PATTERNS for ln in lines if pattern.search(ln)), ""
    )
    if ranks:
        row.update({k: v for k, v in ranks[0].items() if k != "error"})
    row["error"] += first[:300] or (ranks[0]["error"] if ranks else "no output")
    harness.append_jsonl(args.out, row)
    return row


def _group(row: dict[str, Any]) -> tuple:
    return tuple(
        row.get(k)
        for k in ("layers", "precision", "dp_mode", "recompute", "seq", "tiny", "compile")
    )


def _target(row: dict[str, Any]) -> float | None:
    if row["world"] > 1 and row["tp"] == row["cp"] == 1:
        return TARGETS["dp"]
    if row["tp"] == 2 and row["sp"] and row["cp"] == 1:
        return TARGETS["tp2-sp"]
    return None


def report(rows: list[dict[str, Any]]) -> str:
    good = [r for r in rows if "error" not in r]
    baselines = {_group(r): r for r in good if r["world"] == 1}
    lines = [
        "| model | precision | layout | GPUs | tokens/s/GPU | MFU | peak GiB | efficiency "
        "| target |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in good:
        base = baselines.get(_group(r))
        eff = r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"] if base else None
        target = _target(r)
        verdict = "—"
        if target is not None:
            verdict = f"≥ {target:.0%}: " + (
                "no baseline" if eff is None else ("met" if eff >= target else "NOT met")
            )
        model = f"L{r['layers']}" + (f" rc={r['recompute']}" if r["recompute"] != "none" else "")
        model += f" {r['dp_mode']}" + (" (tiny)" if r.get("tiny") else "")
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "—"
        mem = f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") is not None else "—"
        lines.append(
            f"| {model} | {r['precision']} | {r['layout']} | {r['world']} | "
            f"{r['tokens_per_s_per_gpu']:,.0f} | {mfu} | {mem} | "
            f"{'—' if eff is None else f'{eff:.1%}'} | {verdict} |"
        )
    for r in rows:
        if "error" in r:
            lines.append(f"| {r.get('tag')} | | | {r.get('world')} | error: {r['error']} | | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, default=8, help="devices on this machine")
    parser.add_argument("--models", default="L8,L32")
    parser.add_argument("--precisions", default="bf16,fp8")
    parser.add_argument("--layouts", default="", help="only these layout names (comma-separated)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--run-timeout-s", type=float, default=300)
    parser.add_argument("--budget-s", type=float, default=540, help="start no run after this")
    parser.add_argument("--out", default=None, help="JSON lines (appended)")
    parser.add_argument("--report", default=None, help="only print the table of this file")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("extra", nargs="*", help="after --: more throughput.py arguments")
    args = parser.parse_args(argv)
    if args.report:
        rows = [json.loads(line) for line in Path(args.report).read_text().splitlines() if line]
        print(report(rows))
        return 0
    began = time.perf_counter()
    rows = []
    for nproc, run_argv in matrix(args):
        if time.perf_counter() - began > args.budget_s:
            print(f"# budget: not started: {' '.join(run_argv)}", flush=True)
            continue
        row = launch(nproc, run_argv, args)
        if row is not None:
            rows.append(row)
            shown = row.get("error") or f"{row['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU"
            print(
                f"#   {row.get('tag')}: {shown} ({time.perf_counter() - began:.0f} s)", flush=True
            )
    if rows:
        print()
        print(report(rows))
    return 0 if rows and all("error" not in r for r in rows) else (0 if args.dry_run else 1)


if __name__ == "__main__":
    sys.exit(main())
