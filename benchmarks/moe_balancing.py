"""MoE load-balancing quality: one model trained with each balancing mode on the bundled corpus,
final validation loss and MaxVio curves, and the issue's verdicts.

Run on an H200 (about an hour for the defaults)::

    python benchmarks/moe_balancing.py --out results/moe_balancing            # the three modes
    python benchmarks/moe_balancing.py --plot results/moe_balancing/moe_balancing.json \\
        --png docs/img/moe_balancing.png                                       # the figure

``--smoke`` trains a tiny model for a few steps on whatever device is present (the CPU test).

Model (``--overrides`` adds to or replaces these): mt-train's ``deepseek_moe_tiny`` family
scaled to width 512, 8 layers (the first dense), 64 routed experts of FFN 256, top-6 from 4 of
8 groups, 2 shared experts, sigmoid scores, sequence 1024, global batch 32, 2,000 steps;
aux-loss-free γ = 1e-3 (DeepSeek-V3's). Modes: ``aux_free``, ``aux_loss`` (coefficient 1e-2
on softmax-normalised sigmoid scores, ``mt_parallel.moe.balance``) and ``none``, same seed and
data. Every step's metrics are logged (``trainer.log_interval=1``), so the curves are:
``moe_max_vio`` (per micro-batch, the worst layer, averaged over the step's micro-batches) and
``moe_max_vio_global`` (the step's whole global batch, the worst layer).

Verdicts (the issue's, computed over the steps after ``--settle``, default 1,000):
``aux_free``'s global-batch MaxVio at most 0.05 (its median over those steps, and its last
value) and per-batch p95 at most 0.2; ``none`` visibly worse (its median global MaxVio at least
twice ``aux_free``'s); ``aux_free``'s final validation loss no more than 1% above ``aux_loss``'s.
Results go to ``<out>/moe_balancing.json`` (one entry per mode: the curves, the final
validation loss, the run folder).

Plotting needs matplotlib (not an mt dependency); it is imported only for ``--plot``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

MODES = ("aux_free", "aux_loss", "none")
MODEL = {
    "model": "deepseek_moe_tiny", "model.dim": 512, "model.n_layers": 8, "model.n_heads": 8,
    "model.n_kv_heads": 8, "model.ffn_dim": 1536, "model.moe.num_experts": 64,
    "model.moe.top_k": 6, "model.moe.expert_ffn_dim": 256, "model.moe.n_group": 8,
    "model.moe.topk_group": 4, "model.moe.n_shared_experts": 2,
    "model.moe.bias_update_rate": 1e-3, "model.moe.aux_loss_coeff": 1e-2,
    "trainer.seq_len": 1024, "trainer.global_batch_size": 32, "trainer.micro_batch_size": 16,
    "trainer.max_steps": 2000, "trainer.eval_interval": 250, "trainer.checkpoint_interval": 2000,
    "trainer.sample_tokens": 0, "logging.progress_bar": False, "trainer.log_interval": 1,
}  # fmt: skip
SMOKE = {
    "model": "deepseek_moe_tiny", "model.dim": 64, "model.n_layers": 2, "model.ffn_dim": 128,
    "model.moe.expert_ffn_dim": 32, "trainer.seq_len": 32, "trainer.global_batch_size": 4,
    "trainer.micro_batch_size": 2, "trainer.max_steps": 4, "trainer.eval_interval": 2,
    "trainer.eval_batches": 1, "scheduler.warmup_steps": 1, "checkpoint.enabled": False,
    "trainer.sample_tokens": 0, "logging.progress_bar": False, "trainer.log_interval": 1,
}  # fmt: skip


def run_mode(mode: str, settings: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Train one mode; its curves from ``metrics.jsonl``."""
    from mt_train import Trainer, compose_config, to_train_config

    overrides = [f"{k}={v}" for k, v in {**settings, "model.moe.balancing": mode}.items()]
    trainer = Trainer(to_train_config(compose_config(overrides)), output_dir=folder)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    return {
        "mode": mode,
        "folder": str(folder),
        "final_val_loss": summary.val_loss,
        "steps": [r["step"] for r in train],
        "loss": [r["loss"] for r in train],
        "max_vio": [r["moe_max_vio"] for r in train],
        "max_vio_global": [r["moe_max_vio_global"] for r in train],
        "val": [[r["step"], r["val_loss"]] for r in rows if r["kind"] == "eval"],
    }


def _after(run: dict[str, Any], key: str, settle: int) -> list[float]:
    return [v for s, v in zip(run["steps"], run[key], strict=True) if s > settle]


def verdicts(runs: dict[str, dict[str, Any]], settle: int) -> dict[str, Any]:
    """The issue's criteria (module docstring); None where a mode is missing."""
    free, aux, none = (runs.get(m) for m in MODES)
    out: dict[str, Any] = {"settle": settle}
    if free is not None:
        glob, batch = _after(free, "max_vio_global", settle), _after(free, "max_vio", settle)
        if glob:
            out["aux_free_global_median"] = statistics.median(glob)
            out["aux_free_global_last"] = glob[-1]
            out["aux_free_batch_p95"] = sorted(batch)[min(len(batch) - 1, int(0.95 * len(batch)))]
            out["aux_free_balanced"] = (
                out["aux_free_global_median"] <= 0.05
                and out["aux_free_global_last"] <= 0.05
                and out["aux_free_batch_p95"] <= 0.2
            )
        if none is not None and glob and _after(none, "max_vio_global", settle):
            none_median = statistics.median(_after(none, "max_vio_global", settle))
            out["none_global_median"] = none_median
            out["none_visibly_worse"] = none_median >= 2 * out["aux_free_global_median"]
        if aux is not None:
            ratio = free["final_val_loss"] / aux["final_val_loss"] - 1
            out["aux_free_vs_aux_loss_val"] = ratio
            out["aux_free_loss_within_1pct"] = ratio <= 0.01
    return out


def plot(results: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (vio, glob, val) = plt.subplots(1, 3, figsize=(16, 4.5))
    for mode, run in results["runs"].items():
        vio.plot(run["steps"], run["max_vio"], label=mode, linewidth=0.8)
        glob.plot(run["steps"], run["max_vio_global"], label=mode, linewidth=0.8)
        steps, losses = zip(*run["val"], strict=True) if run["val"] else ((), ())
        val.plot(steps, losses, marker="o", label=f"{mode} ({run['final_val_loss']:.4f})")
    for axis, title in (
        (vio, "MaxVio per micro-batch (worst layer)"),
        (glob, "MaxVio of the global batch (worst layer)"),
    ):
        axis.set_yscale("log")
        axis.axhline(0.05 if axis is glob else 0.2, color="grey", linestyle="--", linewidth=0.8)
        axis.set_title(title)
    val.set_title("validation loss")
    for axis in (vio, glob, val):
        axis.set_xlabel("step")
        axis.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="results/moe_balancing")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--settle", type=int, default=1000, help="verdicts use steps after it")
    parser.add_argument("--overrides", nargs="*", default=[], help="key=value for mt-train")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, a few steps")
    parser.add_argument("--plot", default=None, help="plot this moe_balancing.json and exit")
    parser.add_argument("--png", default="docs/img/moe_balancing.png")
    args = parser.parse_args(argv)
    if args.plot:
        plot(json.loads(Path(args.plot).read_text()), Path(args.png))
        return
    settings = dict(SMOKE if args.smoke else MODEL)
    settings.update(dict(o.split("=", 1) for o in args.overrides))
    settle = 0 if args.smoke else args.settle
    out = Path(args.out)
    runs = {mode: run_mode(mode, settings, out / mode) for mode in args.modes.split(",")}
    results = {"settings": settings, "runs": runs, "verdicts": verdicts(runs, settle)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_balancing.json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results["verdicts"], indent=1))


if __name__ == "__main__":
    main()
