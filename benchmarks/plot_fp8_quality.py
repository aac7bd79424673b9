"""Plot issue 7's FP8-vs-bf16 quality runs from the ``fp8_quality.json`` of ``fp8_quality.py``.

Three panels, step on every x axis:

* validation loss of every run (bf16 black);
* each FP8 recipe's (and each bf16 run at another seed, dashed grey) validation loss
  relative to bf16 at the same step,
  ``100 · (v_recipe / v_bf16 − 1)`` in %, with the ±1% band of the issue's criterion shaded
  (a 1% difference is invisible on the first panel's scale);
* training loss (one step's loss every log interval) smoothed by a bias-corrected exponential
  moving average, ``m_i = β·m_{i−1} + (1−β)·x_i``, shown as ``m_i / (1 − β^i)``.

``--seeds`` draws instead, for results with several seeds per recipe (``fp8_quality.py
--merge``), what the verdict judges: each plain FP8 recipe's final difference from the bf16 run
of the same seed, one marker per seed, their mean as a bar and the ±1% band; a bf16 row shows
how far bf16 moves from the default seed's bf16 by seed alone. The second panel is each
recipe's relative validation curve averaged over its seeds (steps every seed evaluated).

Needs matplotlib, which no mt package depends on (``pip install matplotlib``); it is imported
only when plotting.

Run (repository root)::

    python benchmarks/plot_fp8_quality.py results/fp8_quality/fp8_quality.json
    python benchmarks/plot_fp8_quality.py /tmp/q/fp8_quality.json --out /tmp/q/fp8_vs_bf16.png
    python benchmarks/plot_fp8_quality.py docs/data/fp8_quality_seeds.json --seeds \
        --out docs/img/fp8_vs_bf16_seeds.png
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "docs" / "img" / "fp8_vs_bf16.png"
REFERENCE = "none"
TOLERANCE_PCT = 1.0


def ema(values: list[float], beta: float) -> list[float]:
    """Bias-corrected exponential moving average (module docstring)."""
    out, m = [], 0.0
    for i, x in enumerate(values, start=1):
        m = beta * m + (1.0 - beta) * x
        out.append(m / (1.0 - beta**i))
    return out


def reference_label(run: dict[str, Any]) -> str:
    """``fp8=none`` trains in the trainer's precision: bf16 autocast on a GPU, fp32 on a CPU."""
    return "fp32" if " fp32" in (run.get("trainer") or "") else "bf16"


def common_overrides(runs: dict[str, Any]) -> list[str]:
    """The ``+key=value`` overrides every run has (``+model.vocab_size=128256``): the title
    names them once and the run labels leave them out."""
    parts = [spec.split("+")[1:] for spec in runs]
    return [e for e in parts[0] if all(e in other for other in parts[1:])] if parts else []


def run_name(spec: str, run: dict[str, Any], common: list[str]) -> str:
    """``spec`` without the common overrides, ``none`` shown as bf16 (or fp32), ``@seed`` as
    `` seed N``."""
    base, *extra = spec.split("+")
    recipe, _, seed = base.partition("@")
    name = reference_label(run) if recipe == REFERENCE else recipe
    name = "+".join([name, *(e for e in extra if e not in common)])
    return f"{name} seed {seed}" if seed else name


def title(result: dict[str, Any]) -> str:
    s = result["settings"]
    text = f"{s['model']}"
    described = next((r["trainer"] for r in result["runs"].values() if r.get("trainer")), "")
    params = re.search(r"Llama, ([\d.]+M) params", described)
    device = re.search(r" on \d+x (.+?) \[", described)
    if params:
        text += f" ({params.group(1)} parameters)"
    text += f", {s['steps']} steps of {s['global_batch']}×{s['seq_len']} tokens, lr {s['lr']:g}"
    if device:
        text += f", {device.group(1)}"
    common = common_overrides(result["runs"])
    if common:
        text += f"; every run: {' '.join(common)}"
    return text


def relative_pct(run: dict[str, Any], ref: dict[str, Any]) -> tuple[list[int], list[float]]:
    ref_val = {int(step): v for step, v in ref["val_loss"]}
    steps, pct = [], []
    for step, v in run["val_loss"]:
        if int(step) in ref_val:
            steps.append(int(step))
            pct.append(100.0 * (v / ref_val[int(step)] - 1.0))
    return steps, pct


def plot(result: dict[str, Any], out: Path, beta: float) -> None:
    plt = _pyplot()
    runs = result["runs"]
    common = common_overrides(runs)
    # Each FP8 run against its own bf16 run (fp8_quality.py's "reference": same seed and
    # non-FP8 overrides); the black curve is the reference of the default seed.
    references = {run.get("reference") or REFERENCE for run in runs.values()}
    ref_spec = next((r for r in references if r in runs and "@" not in r), REFERENCE)
    ref = runs.get(ref_spec)
    fig, (ax_val, ax_rel, ax_train) = plt.subplots(1, 3, figsize=(17, 5.2))
    colors = plt.get_cmap("tab10").colors
    rel_seen: list[float] = []
    train_seen: list[float] = []
    max_step = result["settings"]["steps"]
    for i, (recipe, run) in enumerate(runs.items()):
        is_ref = recipe == ref_spec
        name = run_name(recipe, run, common)
        if is_ref:
            style = {"color": "black", "linewidth": 2.2, "zorder": 5}
        elif recipe.partition("@")[0].split("+")[0] == REFERENCE:  # bf16 at another seed: noise
            style = {"color": "dimgray", "linewidth": 1.4, "linestyle": "--"}
        else:
            style = {"color": colors[i % len(colors)], "linewidth": 1.4}
        label = name
        if run["final_val_loss"] is not None:
            label += f": {run['final_val_loss']:.4f}"
            if run.get("vs_bf16_pct") is not None:
                label += f" ({run['vs_bf16_pct']:+.2f}%)"
        if run["status"] != "ok":
            label += f" [{run['status'].split(' (')[0]}]"
        if run["val_loss"]:
            steps, values = zip(*run["val_loss"], strict=True)
            ax_val.plot(steps, values, marker="o", markersize=2.5, label=label, **style)
        if run["train_loss"]:
            steps, values = zip(*run["train_loss"], strict=True)
            smooth = ema(list(values), beta)
            ax_train.plot(steps, smooth, label=name, **style)
            train_seen += [v for s, v in zip(steps, smooth, strict=True) if s >= max_step / 20]
        own_ref = runs.get(run.get("reference") or ref_spec)
        if not is_ref and own_ref is not None and run["val_loss"]:
            steps, pct = relative_pct(run, own_ref)
            ax_rel.plot(steps, pct, marker="o", markersize=2.5, label=name, **style)
            rel_seen += [p for s, p in zip(steps, pct, strict=True) if s >= max_step / 4]

    ax_val.set(title="validation loss", xlabel="step", ylabel="loss (nats/byte)")
    ax_val.legend(title="final validation loss", fontsize=8)
    ax_rel.axhspan(-TOLERANCE_PCT, TOLERANCE_PCT, color="tab:green", alpha=0.12, label="±1%")
    ax_rel.axhline(0.0, color="black", linewidth=1.2)
    lim = max(1.5 * TOLERANCE_PCT, 1.15 * max((abs(p) for p in rel_seen), default=0.0))
    ax_rel.set_ylim(-lim, lim)
    ref_name = reference_label(ref) if ref is not None else "bf16"
    ax_rel.set(
        title=f"validation loss vs {ref_name} (y range from steps ≥ {max_step // 4})",
        xlabel="step",
        ylabel=f"100·(loss / {ref_name} loss − 1)  [%]",
    )
    ax_rel.legend(fontsize=8)
    ax_train.set(
        title=f"training loss (EMA, β = {beta}; y range from step {max_step // 20})",
        xlabel="step",
        ylabel="loss (nats/byte)",
    )
    ax_train.legend(fontsize=8)
    if train_seen:  # the first steps' loss (≈ ln vocab) would flatten the rest
        top = max(train_seen)
        ax_train.set_ylim(min(train_seen) - 0.05 * (top - min(train_seen)), top)
    for ax in (ax_val, ax_rel, ax_train):
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(title(result))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise SystemExit(
            "plot_fp8_quality.py needs matplotlib (no mt package depends on it): "
            "pip install matplotlib"
        ) from err
    return plt


def plot_seeds(result: dict[str, Any], out: Path) -> None:
    """The ``--seeds`` figure (module docstring)."""
    plt = _pyplot()
    runs = result["runs"]
    recipes = [name for name in result["paired"] if "+" not in name]
    if not recipes:
        raise SystemExit("--seeds: the results pair no plain FP8 recipe with a bf16 run")
    fig, (ax_final, ax_curve) = plt.subplots(1, 2, figsize=(14, 5.2))
    colors = plt.get_cmap("tab10").colors
    markers = "osD^v<>"
    seeds = sorted(
        {int(s) for name in recipes for s in result["paired"][name]["vs_bf16_pct_by_seed"]}
    )
    ref = runs.get(REFERENCE)
    rows = list(recipes)
    noise = {}
    if ref is not None:  # bf16 at each other seed against bf16 at the default seed
        for spec, run in runs.items():
            recipe, _, seed = spec.partition("@")
            if recipe == REFERENCE and seed.isdigit() and run["final_val_loss"] is not None:
                noise[int(seed)] = 100.0 * (run["final_val_loss"] / ref["final_val_loss"] - 1.0)
        if noise:
            rows.append("bf16 (seed noise)")
    ax_final.axvspan(-TOLERANCE_PCT, TOLERANCE_PCT, color="tab:green", alpha=0.12, label="±1%")
    ax_final.axvline(0.0, color="black", linewidth=1.0)
    for y, name in enumerate(rows):
        if name in result["paired"]:
            by_seed = {int(k): v for k, v in result["paired"][name]["vs_bf16_pct_by_seed"].items()}
            mean = result["paired"][name]["mean_vs_bf16_pct"]
            ax_final.barh(y, mean, height=0.5, color=colors[y % len(colors)], alpha=0.45)
            ax_final.annotate(f"mean {mean:+.2f}%", (mean, y + 0.3), fontsize=8, ha="center")
        else:
            by_seed = noise
        for seed, pct in by_seed.items():
            index = seeds.index(seed) if seed in seeds else len(seeds) % len(markers)
            label = f"seed {seed}" if y == 0 or name not in result["paired"] else None
            ax_final.plot(pct, y, markers[index % len(markers)], color="black", label=label)
    seen = [abs(v) for n in recipes for v in result["paired"][n]["vs_bf16_pct_by_seed"].values()]
    lim = max(1.5 * TOLERANCE_PCT, 1.15 * max([*seen, *map(abs, noise.values())]))
    ax_final.set_xlim(-lim, lim)
    ax_final.set_yticks(range(len(rows)), rows)
    ax_final.invert_yaxis()
    handles, labels = ax_final.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax_final.legend(unique.values(), unique.keys(), fontsize=8, loc="lower right")
    ax_final.set(
        title="final validation loss vs bf16 of the same seed",
        xlabel="100·(loss / bf16 loss − 1)  [%]",
    )
    max_step = result["settings"]["steps"]
    for y, name in enumerate(recipes):
        curves = []
        for spec, run in runs.items():
            recipe_seed, *extra = spec.split("+")
            own_ref = runs.get(run.get("reference") or "")
            if "+".join([recipe_seed.partition("@")[0], *extra]) != name or own_ref is None:
                continue
            if run.get("reference") == REFERENCE and "@" in spec:
                continue  # no bf16 run of its own seed
            curves.append(dict(zip(*relative_pct(run, own_ref), strict=True)))
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        mean = [sum(c[s] for c in curves) / len(curves) for s in steps]
        ax_curve.plot(steps, mean, marker="o", markersize=2.5, color=colors[y % len(colors)],
                      label=f"{name} ({len(curves)} seeds)")  # fmt: skip
    ax_curve.axhspan(-TOLERANCE_PCT, TOLERANCE_PCT, color="tab:green", alpha=0.12)
    ax_curve.axhline(0.0, color="black", linewidth=1.0)
    ax_curve.set_xlim(max_step // 10, max_step * 1.02)
    ax_curve.set_ylim(-2.5 * TOLERANCE_PCT, 2.5 * TOLERANCE_PCT)
    ax_curve.set(
        title="validation loss vs bf16, mean over seeds",
        xlabel="step",
        ylabel="100·(loss / bf16 loss − 1)  [%]",
    )
    ax_curve.legend(fontsize=8)
    for ax in (ax_final, ax_curve):
        ax.grid(True, alpha=0.3)
    fig.suptitle(title(result) + f"; seeds {', '.join(map(str, seeds))}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", type=Path, help="fp8_quality.json written by fp8_quality.py")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"PNG (default {DEFAULT_OUT})")
    p.add_argument("--beta", type=float, default=0.9, help="EMA factor of the training loss")
    p.add_argument(
        "--seeds", action="store_true", help="the per-seed verdict figure (module docstring)"
    )
    args = p.parse_args(argv)
    result = json.loads(args.results.read_text())
    if args.seeds:
        plot_seeds(result, args.out)
    else:
        plot(result, args.out, args.beta)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
