"""Generate or check the tables of ``docs/performance.md`` that come from results in ``docs/data``.

``docs/performance.md`` holds the current figures, one section per workload. Where a benchmark
kept its JSON results in ``docs/data`` (today: the FP8-against-bf16 quality runs of
``benchmarks/fp8_quality.py``), the table is generated from that JSON and sits between two
markers::

    <!-- performance_tables: quality_seeds -->
    | ... the generated table ... |
    <!-- /performance_tables -->

The name after ``performance_tables:`` picks the generator in :data:`GENERATORS`. The other
tables (throughput and kernel timings, whose runs kept only the printed tables) are written by
hand from ``docs/benchmarks-log.md``. Every ``###`` section that holds a table must say where its
numbers come from, in list items that start with ``Date:``, ``Commit:``, ``Hardware:`` and
``Command:`` (:data:`REQUIRED_FIELDS`); ``--check`` verifies that as well.

Run from the repository root::

    python benchmarks/performance_tables.py           # rewrite the generated tables in place
    python benchmarks/performance_tables.py --check   # exit 1, naming each stale table or missing field

Needs only the standard library (CI runs ``--check`` through ``benchmarks/tests``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "performance.md"
DATA = ROOT / "docs" / "data"

BLOCK = re.compile(
    r"(?P<open><!-- performance_tables: (?P<name>[a-z0-9_]+) -->\n)"
    r"(?P<body>.*?)"
    r"(?P<close><!-- /performance_tables -->)",
    re.DOTALL,
)
REQUIRED_FIELDS = ("Date:", "Commit:", "Hardware:", "Command:")
SEEDS_FILE = "fp8_quality_seeds.json"
HEAD_128K_FILE = "fp8_quality_2026-12-04_5f7f294.json"
HEAD_128K_CALLS = ("call_1", "call_3")
VOCAB_128K = "+model.vocab_size=128256"
PARITY_FILE = "loss_parity_2026-12-04.json"
PARITY_1B_FILE = "loss_parity_1b_2026-12-04.json"
SHARED_INIT_FILE = "loss_parity_2026-12-06.json"
MX_CEIL = "mxfp8+fp8.recipe_args.scale_rounding=ceil"
SHARED_INIT_ROWS = (
    ("mt bf16", "none", "plain bf16 from mt's initial weights", "plain"),
    ("mt rowwise", "rowwise", "torchao rowwise on the plain loop", "torchao-rowwise"),
    ("torchao rowwise", "torchao-rowwise", "plain bf16", "plain"),
    ("mt rowwise", "rowwise", "mt bf16", "none"),
    ("mt delayed", "delayed", "mt bf16", "none"),
    ("mt blockwise", "blockwise", "mt bf16", "none"),
    ("mt MXFP8, the OCP spec's scale rounding", "mxfp8", "mt bf16", "none"),
    ("mt MXFP8, scales rounded up (the default since 2026-12-06)", MX_CEIL, "mt bf16", "none"),
)
"""The rows of the shared-initial-weights table, as ``PARITY_ROWS``; a pair whose runs did not
both finish is compared at the last validation step both reached (the cell says which)."""
OLD_INIT = "+model.scaled_residual_init=true"
PARITY_ROWS = (
    ("mt bf16", "none", "plain bf16 (same windows, same order)", "plain"),
    ("mt tensorwise", "tensorwise", "torchao tensorwise on the plain loop", "torchao-tensorwise"),
    ("torchao tensorwise", "torchao-tensorwise", "plain bf16", "plain"),
    ("mt tensorwise", "tensorwise", "mt bf16", "none"),
    ("mt bf16, scaled residual init", "none" + OLD_INIT, "plain bf16", "plain"),
    ("plain bf16, random windows", "plain+sampler=random", "plain bf16", "plain"),
)
"""(run label, its spec without the seed, reference label, the reference's spec) of the parity
table: each cell is the run's final validation loss against the reference of the same seed."""
ABLATIONS = (
    ("model.scaled_residual_init=false (now the default)", "none"),
    ("data.sampling=random", "none+data.sampling=random" + OLD_INIT),
    (
        "optimizer.embedding_weight_decay=false",
        "none+optimizer.embedding_weight_decay=false" + OLD_INIT,
    ),
    (
        "MT_FP8_DISABLE_TRITON=1 (plain-PyTorch fused ops and AdamW)",
        "none+env.MT_FP8_DISABLE_TRITON=1" + OLD_INIT,
    ),
)
"""(change, spec without the seed) of the ablation table, each against the old default
``none+model.scaled_residual_init=true`` of the same seed."""


def signed_pct(value: float) -> str:
    """``-0.587`` -> ``−0.59%`` (a typographic minus, as in the rest of the docs)."""
    text = f"{value:+.2f}%"
    return text.replace("-", "−")


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _load(data: Path, name: str) -> dict:
    path = data / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; the generated tables read it")
    return json.loads(path.read_text())


def quality_seeds(data: Path) -> str:
    """Each FP8 recipe's final validation loss against bf16 of the same seed, per seed and mean.

    From ``fp8_quality_seeds.json`` (``fp8_quality.py --merge``): ``paired`` holds each recipe's
    difference by seed and their mean; ``runs`` the bf16 losses and each run's source file.
    """
    result = _load(data, SEEDS_FILE)
    paired, runs = result["paired"], result["runs"]
    seeds = sorted({seed for entry in paired.values() for seed in entry["vs_bf16_pct_by_seed"]})
    header = ["recipe", *(f"seed {seed}" for seed in seeds), "mean", "mean within 1%"]
    rows = []
    for recipe, entry in paired.items():
        by_seed = entry["vs_bf16_pct_by_seed"]
        cells = [signed_pct(by_seed[s]) if s in by_seed else "—" for s in seeds]
        verdict = "yes" if entry["within_1pct"] else "no"
        rows.append([recipe, *cells, f"**{signed_pct(entry['mean_vs_bf16_pct'])}**", verdict])
    bf16 = []
    for seed in seeds:
        run = runs.get("none" if seed == str(result["settings"]["seed"]) else f"none@{seed}")
        bf16.append(f"{run['final_val_loss']:.4f}" if run else "—")
    rows.append(["bf16 validation loss (the reference)", *bf16, "", ""])
    sources: dict[str, list[str]] = {}
    for spec, run in runs.items():
        sources.setdefault(run["source"].split(":")[0], []).append(spec)
    listing = "; ".join(
        f"`{Path(source).name}`: {', '.join(specs)}" for source, specs in sorted(sources.items())
    )
    return table(header, rows) + f"\nRuns by result file: {listing}.\n"


def quality_head_128k(data: Path) -> str:
    """Delayed scaling with each choice of FP8 head GEMMs at a 128,256-entry vocabulary.

    From the two calls of ``fp8_quality_2026-12-04_5f7f294.json``: every run is compared with
    the bf16 run of its seed at the last step both reached (``compare_step``).
    """
    result = _load(data, HEAD_128K_FILE)
    rows = []
    for call in HEAD_128K_CALLS:
        runs = result[call]["runs"]
        for spec, run in runs.items():
            if run["vs_bf16_pct"] is None:  # a bf16 reference itself
                continue
            reference = runs[run["reference"]]
            step = run["compare_step"]
            bf16 = {int(s): loss for s, loss in reference["val_loss"]}[step]
            recipe, _, rest = spec.partition("+")
            seed = recipe.partition("@")[2] or str(result[call]["settings"]["seed"])
            rows.append(
                [
                    seed,
                    head_gemms(rest.replace(VOCAB_128K, "")),
                    str(step),
                    f"{run['final_val_loss']:.4f}",
                    f"{bf16:.4f}",
                    signed_pct(run["vs_bf16_pct"]),
                ]
            )
    header = ["seed", "head GEMMs in FP8", "step", "FP8 delayed", "bf16", "difference"]
    return table(header, rows)


def head_gemms(overrides: str) -> str:
    """``fp8.output_head=true+fp8.output_head_gemms=[forward,wgrad]`` -> ``forward, wgrad``."""
    if "fp8.output_head=true" not in overrides:
        return "none (the default bf16 head)"
    match = re.search(r"fp8\.output_head_gemms=\[([a-z,]+)\]", overrides)
    return ", ".join(match.group(1).split(",")) if match else "all three"


def _seeded(spec: str, seed: str) -> str:
    """``none+x`` at seed 5678 -> ``none@5678+x``."""
    base, plus, rest = spec.partition("+")
    return f"{base}@{seed}{plus}{rest}"


def _final(runs: dict, spec: str, steps: int) -> float | None:
    run = runs.get(spec)
    if run is None or run["final_step"] != steps:
        return None
    return run["final_val_loss"]


def _at_common_step(runs: dict, spec: str, ref: str) -> tuple[float, float, int] | None:
    """Both runs' validation losses at the last validation step both reached, and that step."""
    if spec not in runs or ref not in runs:
        return None
    mine, theirs = (dict(map(tuple, runs[name]["val_loss"])) for name in (spec, ref))
    common = set(mine) & set(theirs)
    if not common:
        return None
    step = max(common)
    return mine[step], theirs[step], step


def _paired_rows(
    runs: dict,
    steps: int,
    seeds: list[str],
    pairs: list[tuple[str, str, str, str]],
    *,
    common_step: bool = False,
) -> list[list[str]]:
    """One row per pair: each seed's loss and its difference from the reference's.

    Pairs are compared on final losses of complete runs; with ``common_step``, a pair of which
    a run stopped early is compared at the last validation step both reached instead.
    """
    rows = []
    for label, spec, ref_label, ref in pairs:
        cells, diffs = [], []
        for seed in seeds:
            mine, theirs = (
                _final(runs, _seeded(spec, seed), steps),
                _final(runs, _seeded(ref, seed), steps),
            )
            at = ""
            if (mine is None or theirs is None) and common_step:
                found = _at_common_step(runs, _seeded(spec, seed), _seeded(ref, seed))
                if found is not None:
                    mine, theirs, step = found
                    at = f", step {step:,}"
            if mine is None or theirs is None:
                cells.append("—")
                continue
            diffs.append(100.0 * (mine / theirs - 1.0))
            cells.append(f"{mine:.4f} ({signed_pct(diffs[-1])}{at})")
        mean = f"**{signed_pct(sum(diffs) / len(diffs))}**" if diffs else "—"
        rows.append([label, ref_label, *cells, mean])
    return rows


def loss_parity(data: Path) -> str:
    """mt against the plain-PyTorch loop and torchao, final validation losses per seed.

    From ``loss_parity_2026-12-04.json`` (``fp8_quality.py --merge`` of three runs): each cell
    is a run's final validation loss and, in parentheses, its difference from the reference
    run of the same seed; the last column is the mean of those differences.
    """
    result = _load(data, PARITY_FILE)
    runs, steps = result["runs"], result["settings"]["steps"]
    seeds = ["1234", "5678", "9999"]
    rows = _paired_rows(runs, steps, seeds, list(PARITY_ROWS))
    header = ["run", "against", *(f"seed {s}" for s in seeds), "mean difference"]
    spreads = []
    for name, spread in result["parity"]["spreads"].items():
        if name in ("none", "plain", "tensorwise", "torchao-tensorwise"):
            spreads.append(f"{name} {spread['spread_pct']:.2f}%")
    return table(header, rows) + (
        "\nSeed spread, 100·(max − min)/mean of the final losses: " + ", ".join(spreads) + ".\n"
    )


def loss_ablation(data: Path) -> str:
    """One change at a time from the old default (scaled residual init), per seed.

    From ``loss_parity_2026-12-04.json``; the old default at seeds 5678 and 9999 comes from
    ``fp8_quality_seeds.json`` (its ``source`` says so).
    """
    result = _load(data, PARITY_FILE)
    runs, steps = result["runs"], result["settings"]["steps"]
    seeds = ["1234", "5678", "9999"]
    base = "none" + OLD_INIT
    old = [_final(runs, _seeded(base, seed), steps) for seed in seeds]
    pairs = [(label, spec, "old default", base) for label, spec in ABLATIONS]
    rows = [["old default: scaled residual init", "", *(f"{v:.4f}" for v in old), ""]]
    rows += _paired_rows(runs, steps, seeds, pairs)
    header = ["change", "against", *(f"seed {s}" for s in seeds), "mean difference"]
    return table(header, rows)


def loss_parity_1b(data: Path) -> str:
    """The same check at the Llama 3.2 1B shapes, one seed, from ``loss_parity_1b_2026-12-04.json``."""
    result = _load(data, PARITY_1B_FILE)
    runs, steps = result["runs"], result["settings"]["steps"]
    pairs = [
        ("mt bf16", "none", "plain bf16", "plain"),
        ("mt bf16, scaled residual init", "none" + OLD_INIT, "plain bf16", "plain"),
        ("mt bf16, scaled residual init", "none" + OLD_INIT, "mt bf16", "none"),
    ]
    rows = _paired_rows(runs, steps, ["1234"], pairs)
    plain = _final(runs, "plain@1234", steps)
    rows.append(["plain bf16", "", f"{plain:.4f}", ""])
    return table(["run", "against", "seed 1234", "difference"], rows)


def loss_parity_shared_init(data: Path) -> str:
    """mt against the plain loop and torchao when both start from mt's initial weights.

    From ``loss_parity_2026-12-06.json`` (``fp8_quality.py --merge`` of the 2026-12-05 file,
    itself with mt bf16 from ``loss_parity_2026-12-04.json``, and the rounded-up MXFP8 runs),
    per seed and mean, with each configuration's seed spread.
    """
    result = _load(data, SHARED_INIT_FILE)
    runs, steps = result["runs"], result["settings"]["steps"]
    seeds = ["1234", "5678", "9999"]
    rows = _paired_rows(runs, steps, seeds, list(SHARED_INIT_ROWS), common_step=True)
    header = ["run", "against", *(f"seed {s}" for s in seeds), "mean difference"]
    spreads = [
        f"{name} {spread['spread_pct']:.2f}%"
        for name, spread in result["parity"]["spreads"].items()
        if name in ("none", "plain", "torchao-rowwise", "delayed", "blockwise", MX_CEIL)
    ]
    return table(header, rows) + (
        "\nSeed spread of the complete runs, 100·(max − min)/mean of the final losses: "
        + ", ".join(spreads)
        + ".\n"
    )


GENERATORS: dict[str, Callable[[Path], str]] = {
    "loss_parity_shared_init": loss_parity_shared_init,
    "loss_parity": loss_parity,
    "loss_ablation": loss_ablation,
    "loss_parity_1b": loss_parity_1b,
    "quality_seeds": quality_seeds,
    "quality_head_128k": quality_head_128k,
}


def render(text: str, data: Path) -> str:
    """``text`` with every generated block replaced by what its generator makes now."""

    def replace(match: re.Match) -> str:
        name = match.group("name")
        if name not in GENERATORS:
            raise KeyError(f"unknown table {name!r}; known: {', '.join(sorted(GENERATORS))}")
        return match.group("open") + GENERATORS[name](data) + match.group("close")

    return BLOCK.sub(replace, text)


def missing_fields(text: str) -> list[str]:
    """``'<section>: <field>'`` for each ``###`` section with a table but without a field."""
    problems = []
    for section in re.split(r"\n(?=### )", text):
        if not section.startswith("### ") or "\n| " not in section:
            continue
        title = section.splitlines()[0][4:]
        items = [line[2:] for line in section.splitlines() if line.startswith("- ")]
        for field in REQUIRED_FIELDS:
            if not any(item.startswith(field) for item in items):
                problems.append(f"{title}: no '- {field}' line")
    return problems


def check(doc: Path, data: Path) -> list[str]:
    """Everything wrong with ``doc``: stale generated tables and sections missing a field."""
    text = doc.read_text()
    problems = [
        f"generated table {m.group('name')!r} differs from {data} (rerun without --check)"
        for m, fresh in zip(BLOCK.finditer(text), BLOCK.finditer(render(text, data)), strict=True)
        if m.group("body") != fresh.group("body")
    ]
    if not BLOCK.search(text):
        problems.append(f"{doc} has no generated table")
    return problems + missing_fields(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="verify instead of rewriting")
    parser.add_argument("--doc", type=Path, default=DOC, help="default: docs/performance.md")
    parser.add_argument("--data", type=Path, default=DATA, help="default: docs/data")
    args = parser.parse_args(argv)
    if args.check:
        problems = check(args.doc, args.data)
        for problem in problems:
            print(f"{args.doc}: {problem}", file=sys.stderr)
        return 1 if problems else 0
    text = args.doc.read_text()
    fresh = render(text, args.data)
    if fresh != text:
        args.doc.write_text(fresh)
        print(f"updated {args.doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
