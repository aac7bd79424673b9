"""mt-plan's predictions against measured mt-train steps on one GPU (the planner's validation).

For each configuration of :data:`CONFIGS` (dense and MoE families, sizes, layer counts,
sequences, micro-batches, recompute policies and FP8 recipes; all on one GPU) the script

1. predicts the step time and the allocated peak memory with ``mt_plan`` (cluster ``--cluster``, default ``h200``,
   the calibration table given by ``--calibration``), and whether it fits;
2. measures them in a subprocess of its own: mt-train's ``Trainer`` on the bundled corpus,
   ``--warmup`` steps, then the median of ``--steps`` timed ``train_step`` calls between device
   synchronisations, and ``torch.cuda.max_memory_allocated`` over the timed steps; a
   configuration that runs out of memory is recorded as such.

``--report`` reads the JSON lines back and prints the verdicts the issue asks for: median and
largest |step-time error| (≤ 5% and ≤ 12%), memory error (within ±5%), the predicted best's
measured speed within 5% of the measured best, Kendall's τ between predicted and measured
step times (≥ 0.8), and no configuration predicted to fit that ran out of memory; ``--plot``
writes the predicted-vs-measured figure (matplotlib).

Run on an H200 (after ``mt-plan calibrate --out h200.json``)::

    python benchmarks/plan_validation.py --calibration h200.json --out plan_validation.jsonl
    python benchmarks/plan_validation.py --report plan_validation.jsonl --plot docs/img/plan_validation.png

``--tiny`` measures two toy configurations on the CPU (a smoke run of the whole path), both in
one subprocess (a GPU run gives each configuration its own, so one's allocations and OOM never
reach the next; on the CPU that isolation buys nothing and a subprocess costs seconds of imports).

``--repredict`` recomputes the predictions of recorded rows on the CPU (no GPU, no new
measurement): each row's overrides and vocabulary through today's cost model with the table of
``--calibration`` on ``--cluster``; it prints each row's step and memory errors with the recorded
predictions and with the new ones, then the report of the new ones (``--out``: the rows with
the new predictions, their measurements as recorded)::

    python benchmarks/plan_validation.py --repredict docs/data/plan_validation_h100.jsonl \
        --calibration h100 --cluster h100_nodes
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

L8 = ["model=llama3_8b", "model.n_layers=8"]
MIXTRAL = ["model=mixtral_8x7b", "model.n_layers=2"]
V2LITE = ["model=deepseek_v2_lite", "model.n_layers=4", "model.first_k_dense=1"]
CONFIGS: dict[str, list[str]] = {
    "8b-l8-s8k-bf16": [*L8, "trainer.seq_len=8192"],
    "8b-l8-s8k-tensorwise": [*L8, "trainer.seq_len=8192", "fp8=tensorwise"],
    "8b-l8-s8k-rowwise": [*L8, "trainer.seq_len=8192", "fp8=rowwise"],
    "8b-l8-s8k-blockwise": [*L8, "trainer.seq_len=8192", "fp8=blockwise"],
    "8b-l8-s8k-delayed": [*L8, "trainer.seq_len=8192", "fp8=delayed"],
    "8b-l8-s4k-mb2": [*L8, "trainer.seq_len=4096", "trainer.micro_batch_size=2"],
    "8b-l8-s8k-mb2": [*L8, "trainer.seq_len=8192", "trainer.micro_batch_size=2"],
    "8b-l8-s8k-full": [*L8, "trainer.seq_len=8192", "parallel.recompute=full"],
    "8b-l8-s8k-full-keep": [*L8, "trainer.seq_len=8192", "parallel.recompute=full",
                            "parallel.recompute_keep=[attention]"],
    "8b-l8-s8k-selective": [*L8, "trainer.seq_len=8192", "parallel.recompute=selective"],
    "8b-l16-s4k": ["model=llama3_8b", "model.n_layers=16", "trainer.seq_len=4096"],
    "8b-l4-s16k-full": ["model=llama3_8b", "model.n_layers=4", "trainer.seq_len=16384",
                        "parallel.recompute=full"],
    "8b-l32-s4k-full": ["model=llama3_8b", "trainer.seq_len=4096", "parallel.recompute=full"],
    "1b-s8k-mb2": ["model=llama3_1b", "trainer.seq_len=8192", "trainer.micro_batch_size=2"],
    "1b-s4k-mb4-tensorwise": ["model=llama3_1b", "trainer.seq_len=4096",
                              "trainer.micro_batch_size=4", "fp8=tensorwise"],
    "70b-l2-s4k-bf16": ["model=llama3_70b", "model.n_layers=2", "trainer.seq_len=4096"],
    "70b-l2-s4k-tensorwise": ["model=llama3_70b", "model.n_layers=2", "trainer.seq_len=4096",
                              "fp8=tensorwise"],
    "mixtral-l2-s4k-bf16": [*MIXTRAL, "trainer.seq_len=4096"],
    "mixtral-l2-s4k-rowwise": [*MIXTRAL, "trainer.seq_len=4096", "fp8=rowwise"],
    "mixtral-l2-s4k-full": [*MIXTRAL, "trainer.seq_len=4096", "parallel.recompute=full"],
    "v2lite-l4-s4k-bf16": [*V2LITE, "trainer.seq_len=4096"],
    "v2lite-l4-s4k-tensorwise": [*V2LITE, "trainer.seq_len=4096", "fp8=tensorwise"],
    "v2lite-l4-s2k-mb2": [*V2LITE, "trainer.seq_len=2048", "trainer.micro_batch_size=2"],
}  # fmt: skip
TINY_CONFIGS: dict[str, list[str]] = {
    "debug-l4-s64-none": ["model=debug", "trainer.seq_len=64", "trainer.micro_batch_size=2"],
    "debug-l4-s64-full": ["model=debug", "trainer.seq_len=64", "trainer.micro_batch_size=2",
                       "parallel.recompute=full"],
}  # fmt: skip
MEASURED = "measured: "
"""Prefix of a ``--measure`` subprocess's result lines."""
COMMON = [
    "trainer.max_steps=1000", "trainer.eval_interval=1000", "trainer.checkpoint_interval=1000",
    "trainer.sample_tokens=0", "logging.progress_bar=false", "checkpoint.async_save=false",
]  # fmt: skip


def with_batch(overrides: list[str]) -> list[str]:
    """One micro-batch per step unless the configuration says otherwise."""
    mb = next((o.split("=")[1] for o in overrides if o.startswith("trainer.micro_batch_size")), "1")
    extra = [] if any(o.startswith("trainer.micro_batch_size") for o in overrides) else [
        f"trainer.micro_batch_size={mb}"]  # fmt: skip
    return [*COMMON, *overrides, *extra, f"trainer.global_batch_size={mb}"]


def predict(overrides: list[str], calibration: str, vocab: int, cluster: str = "h200") -> dict:
    from mt_plan import CostModel, Workload, load_cluster, load_table
    from mt_plan.cli import layout_of
    from mt_plan.models import resolve, shape_of
    from mt_train.models.build import resolve_vocab

    train = resolve(overrides)
    shape = shape_of(resolve_vocab(train.model, vocab))
    tr = train.trainer
    work = Workload(seq_len=tr.seq_len, global_batch=tr.global_batch_size,
                    act_bytes=4 if tr.precision == "fp32" else 2)  # fmt: skip
    cost = CostModel(shape, load_cluster(cluster), load_table(calibration), work)
    est = cost.estimate(layout_of(train, 1))
    return {
        "predicted_step_s": est.step_time,
        "predicted_alloc_bytes": est.peak_memory / (1 + work.allocator_overhead),
        "predicted_fits": est.fits,
        "tokens_per_step": tr.global_batch_size * tr.seq_len,
        "roofline_share": est.roofline_share,
    }


def measure_one(overrides: list[str], warmup: int, steps: int, device: str) -> dict:
    """Run in a subprocess of its own: time ``steps`` train steps after ``warmup``."""
    import torch

    from mt_train import Trainer, compose_config, to_train_config

    cfg = to_train_config(compose_config([*overrides, f"trainer.device={device}"]))
    cuda = torch.cuda.is_available() and device != "cpu"
    try:
        with tempfile.TemporaryDirectory() as folder:
            trainer = Trainer(cfg, output_dir=folder)
            try:
                for _ in range(warmup):
                    trainer.train_step()
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                times = []
                for _ in range(steps):
                    start = time.perf_counter()
                    trainer.train_step()
                    if cuda:
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
                peak = torch.cuda.max_memory_allocated() if cuda else None
                vocab = trainer.model_cfg.vocab_size
            finally:
                trainer.close()
    except torch.OutOfMemoryError:
        return {"oom": True}
    return {"oom": False, "measured_step_s": statistics.median(times),
            "measured_alloc_bytes": peak, "vocab": vocab}  # fmt: skip


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's τ-a of two equally long sequences."""
    n, score = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            score += (a[i] - a[j]) * (b[i] - b[j]) > 0
            score -= (a[i] - a[j]) * (b[i] - b[j]) < 0
    return score / (n * (n - 1) / 2)


def best_verdicts(ran: list[dict]) -> list[str]:
    """Per workload (configurations named alike up to the recipe: same model, layers,
    sequence), whether the layout predicted to give the most tokens/s measured within 5% of
    the measured best."""
    groups: dict[str, list[dict]] = {}
    for r in ran:
        groups.setdefault("-".join(r["name"].split("-")[:3]), []).append(r)
    out = []
    for workload, members in groups.items():
        if len(members) < 2:
            continue

        def speed(r: dict, key: str) -> float:
            return r["tokens_per_step"] / r[key]

        chosen = max(members, key=lambda r: speed(r, "predicted_step_s"))
        best = max(speed(r, "measured_step_s") for r in members)
        gap = 1 - speed(chosen, "measured_step_s") / best
        tau = kendall_tau([speed(r, "predicted_step_s") for r in members],
                          [speed(r, "measured_step_s") for r in members])  # fmt: skip
        out.append(f"{workload}: predicted best {chosen['name']} is {gap:.1%} slower than the "
                   f"measured best (≤ 5%); τ within {tau:.3f} over {len(members)}")  # fmt: skip
    return out


def report(rows: list[dict]) -> str:
    ran = [r for r in rows if not r.get("oom") and "measured_step_s" in r]
    lines = ["| config | predicted s | measured s | error | predicted GiB | measured GiB | error |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in rows:
        if r.get("oom"):
            fit = "predicted to fit" if r["predicted_fits"] else "predicted not to fit"
            lines.append(f"| {r['name']} | {r['predicted_step_s']:.4f} | OOM ({fit}) | | | | |")
            continue
        t_err = r["predicted_step_s"] / r["measured_step_s"] - 1
        m = r.get("measured_alloc_bytes")
        mem = (f"{r['predicted_alloc_bytes'] / 2**30:.2f} | {m / 2**30:.2f} | "
               f"{r['predicted_alloc_bytes'] / m - 1:+.1%}") if m else "| |"  # fmt: skip
        lines.append(f"| {r['name']} | {r['predicted_step_s']:.4f} | {r['measured_step_s']:.4f} "
                     f"| {t_err:+.1%} | {mem} |")  # fmt: skip
    if len(ran) >= 2:
        errors = [abs(r["predicted_step_s"] / r["measured_step_s"] - 1) for r in ran]
        tau = kendall_tau([r["predicted_step_s"] for r in ran], [r["measured_step_s"] for r in ran])
        mem = [abs(r["predicted_alloc_bytes"] / r["measured_alloc_bytes"] - 1) for r in ran
               if r.get("measured_alloc_bytes")]  # fmt: skip
        bad_fits = [r["name"] for r in rows if r.get("oom") and r["predicted_fits"]]
        lines += [
            "",
            f"step time |error|: median {statistics.median(errors):.1%} (target ≤ 5%), "
            f"max {max(errors):.1%} (≤ 12%)",
            f"memory |error|: max {max(mem):.1%} (≤ 5%)" if mem else "memory: not measured",
            f"Kendall τ of step times: {tau:.3f} (≥ 0.8)",
            *best_verdicts(ran),
            f"predicted to fit but ran out of memory: {bad_fits or 'none'}",
        ]
    return "\n".join(lines)


def repredict(rows: list[dict], calibration: str, cluster: str) -> list[dict]:
    """``rows`` with their predictions recomputed from their overrides and vocabulary (the
    measurements as recorded)."""
    return [{**r, **predict(r["overrides"], calibration, r.get("vocab", 320), cluster)}
            for r in rows]  # fmt: skip


def _errors(row: dict) -> tuple[float | None, float | None]:
    """(step-time error, memory error) of a row that ran, else Nones."""
    if row.get("oom") or "measured_step_s" not in row:
        return None, None
    step = row["predicted_step_s"] / row["measured_step_s"] - 1
    m = row.get("measured_alloc_bytes")
    return step, (row["predicted_alloc_bytes"] / m - 1) if m else None


def compare(before: list[dict], after: list[dict]) -> str:
    """Each row's errors with the recorded predictions and with the recomputed ones, and the
    median and largest of each."""
    lines = ["| config | measured s | predicted s, recorded | now | measured GiB | "
             "predicted GiB, recorded | now |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    summary: dict[str, list[float]] = {"step": [], "step now": [], "mem": [], "mem now": []}
    for old, new in zip(before, after, strict=True):
        (t0, m0), (t1, m1) = _errors(old), _errors(new)
        if t0 is None:
            lines.append(f"| {old['name']} | OOM | {old['predicted_step_s']:.4f} | "
                         f"{new['predicted_step_s']:.4f} | | | |")  # fmt: skip
            continue
        summary["step"].append(abs(t0))
        summary["step now"].append(abs(t1))
        row = (f"| {old['name']} | {old['measured_step_s']:.4f} | "
               f"{old['predicted_step_s']:.4f} ({t0:+.1%}) | {new['predicted_step_s']:.4f} "
               f"({t1:+.1%}) |")  # fmt: skip
        if m0 is None:
            lines.append(row + " | | |")
            continue
        summary["mem"].append(abs(m0))
        summary["mem now"].append(abs(m1))
        gib = 2**30
        lines.append(row + f" {old['measured_alloc_bytes'] / gib:.2f} | "
                     f"{old['predicted_alloc_bytes'] / gib:.2f} ({m0:+.1%}) | "
                     f"{new['predicted_alloc_bytes'] / gib:.2f} ({m1:+.1%}) |")  # fmt: skip
    if summary["step"]:
        lines += ["", "|error|, recorded → now: step time median "
                  f"{statistics.median(summary['step']):.1%} → "
                  f"{statistics.median(summary['step now']):.1%}, max {max(summary['step']):.1%}"
                  f" → {max(summary['step now']):.1%}"]  # fmt: skip
    if summary["mem"]:
        lines[-1] += f"; memory max {max(summary['mem']):.1%} → {max(summary['mem now']):.1%}"
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    """Predicted against measured step time, log-log: the diagonal and the ±5% and ±12%
    bands of the targets; MoE rows (``moe`` or ``v2lite`` in the name) marked apart from the
    dense ones, and every row outside ±12% labelled by name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in rows if "measured_step_s" in r]
    fig, ax = plt.subplots(figsize=(6, 6))
    for label, marker, moe in (("dense", "o", False), ("MoE", "s", True)):
        part = [r for r in ran if any(k in r["name"] for k in ("mixtral", "v2lite")) == moe]
        ax.loglog([r["measured_step_s"] for r in part], [r["predicted_step_s"] for r in part],
                  marker, label=label, alpha=0.8)  # fmt: skip
    x = [r["measured_step_s"] for r in ran]
    y = [r["predicted_step_s"] for r in ran]
    lo, hi = min(x + y) * 0.8, max(x + y) * 1.25
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    for band, style in ((0.05, ":"), (0.12, "--")):
        for side in (1 + band, 1 - band):
            ax.plot([lo, hi], [lo * side, hi * side], "k" + style, lw=0.6)
    for r in ran:
        if abs(r["predicted_step_s"] / r["measured_step_s"] - 1) > 0.12:
            ax.annotate(r["name"], (r["measured_step_s"], r["predicted_step_s"]), fontsize=7,
                        xytext=(4, -10), textcoords="offset points")  # fmt: skip
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("predicted step time (s)")
    ax.set_title(title + "\ndotted ±5%, dashed ±12%", fontsize=9)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibration", default="h200")
    parser.add_argument("--cluster", default="h200", help="mt-plan cluster of the predictions")
    parser.add_argument("--out", help="JSON lines written (default plan_validation.jsonl)")
    parser.add_argument("--only", help="comma-separated config names")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--timeout-s", type=float, default=300)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--report", help="JSON lines to report on (no runs)")
    parser.add_argument("--plot", help="with --report or --repredict: write the figure here")
    parser.add_argument("--title", default="mt-plan", help="the figure's title")
    parser.add_argument("--repredict", help="JSON lines whose predictions to recompute (no runs)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # JSON list of override lists
    args = parser.parse_args(argv)
    if args.measure:
        for overrides in json.loads(args.measure):
            measured = measure_one(overrides, args.warmup, args.steps, args.device)
            print(MEASURED + json.dumps(measured), flush=True)
        return 0
    if args.report:
        rows = [json.loads(line) for line in Path(args.report).read_text().splitlines()]
        print(report(rows))
        if args.plot:
            plot(rows, args.plot, args.title)
        return 0
    if args.repredict:
        rows = [json.loads(line) for line in Path(args.repredict).read_text().splitlines()]
        new = repredict(rows, args.calibration, args.cluster)
        print(compare(rows, new) + "\n\n" + report(new))
        if args.out:
            Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in new))
        if args.plot:
            plot(new, args.plot, args.title)
        return 0
    out = args.out or "plan_validation.jsonl"
    configs = TINY_CONFIGS if args.tiny else CONFIGS
    names = args.only.split(",") if args.only else list(configs)
    device = "cpu" if args.tiny else args.device
    rows = []
    for batch in [names] if args.tiny else [[name] for name in names]:
        batch_overrides = [with_batch(configs[name]) for name in batch]
        measurements = _measure(args, batch_overrides, device)
        for name, overrides, measured in zip(batch, batch_overrides, measurements, strict=True):
            row = {"name": name, "overrides": overrides, **measured,
                   **predict(overrides, args.calibration, measured.get("vocab", 320),
                             args.cluster)}  # fmt: skip
            rows.append(row)
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    print(report(rows))
    return 0


def _measure(args: argparse.Namespace, overrides: list[list[str]], device: str) -> list[dict]:
    """The measurements of the configurations ``overrides``, in one subprocess; an error or
    timeout of that subprocess is recorded for every configuration it had not measured."""
    command = [sys.executable, __file__, "--measure", json.dumps(overrides),
               "--warmup", str(args.warmup), "--steps", str(args.steps),
               "--device", device]  # fmt: skip
    timeout = args.timeout_s * len(overrides)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        measured = _measured(done.stdout)
        error = None if done.returncode == 0 else (
            done.stderr.strip().splitlines() or ["no output"])[-1]  # fmt: skip
    except subprocess.TimeoutExpired as expired:
        stdout = expired.stdout.decode() if isinstance(expired.stdout, bytes) else expired.stdout
        measured = _measured(stdout or "")
        error = f"timed out after {timeout} s"
    return [*measured, *[{"error": error or "no output"}] * (len(overrides) - len(measured))]


def _measured(stdout: str) -> list[dict]:
    """The measurements a ``--measure`` subprocess printed (other output passed over)."""
    return [json.loads(line[len(MEASURED) :]) for line in stdout.splitlines()
            if line.startswith(MEASURED)]  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
