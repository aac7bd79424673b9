"""The verdicts of ``benchmarks/fp8_quality.py``, on made-up results.

The FP8 verdict judges each recipe by its difference from bf16 averaged over the seeds that
have their own bf16 run; the parity table holds each mt run to its plain-PyTorch counterpart of
the same seed; ``--merge`` joins the results of runs made at different times. The training runs
themselves need a GPU and minutes each; these tests feed the judging code hand-written
validation curves whose differences are known exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import fp8_quality
import pytest

SETTINGS = {
    "model": "llama_125m", "steps": 200, "seq_len": 256, "global_batch": 16, "micro_batch": 16,
    "lr": 6e-4, "warmup": 10, "eval_interval": 100, "eval_batches": 21, "seed": 1234,
    "concurrent": 4, "extra": [],
}  # fmt: skip


def _run(final: float, steps: int = 200) -> dict[str, Any]:
    curve = [[step, final + 0.5 * (steps - step) / steps] for step in range(100, steps + 1, 100)]
    return {
        "status": "ok", "returncode": 0, "wall_s": 1.0, "train_loop_s": 1.0, "steps": steps,
        "val_loss": curve, "train_loss": [], "final_val_loss": curve[-1][1],
        "final_step": curve[-1][0], "median_tokens_per_s": None, "trainer": None,
    }  # fmt: skip


def _write(path: Path, runs: dict[str, float], settings: dict[str, Any] = SETTINGS) -> str:
    path.write_text(
        json.dumps({"settings": settings, "runs": {k: _run(v) for k, v in runs.items()}})
    )
    return str(path)


def _merge(tmp_path: Path, *sources: str, recipes: str | None = None) -> dict[str, Any]:
    argv = ["--out", str(tmp_path / "out"), "--merge", *sources]
    if recipes is not None:
        argv += ["--recipes", recipes]
    assert fp8_quality.main(argv) == 0
    return json.loads((tmp_path / "out" / "fp8_quality.json").read_text())


def test_the_verdict_averages_each_recipe_over_its_seeds(tmp_path: Path) -> None:
    first = _write(
        tmp_path / "a.json",
        {
            "none": 1.0,
            "rowwise": 0.988,
            "tensorwise": 1.005,
            "tensorwise+fp8.output_head=true": 1.03,
        },
    )
    second = _write(
        tmp_path / "b.json",
        {"none@5678": 1.02, "rowwise@5678": 1.02 * 1.004, "tensorwise@5678": 1.02 * 1.012},
    )
    result = _merge(tmp_path, first, second)
    rowwise, tensorwise = result["paired"]["rowwise"], result["paired"]["tensorwise"]
    # rowwise: −1.2% at one seed (outside the band on its own), +0.4% at the other: mean −0.4%.
    assert rowwise["vs_bf16_pct_by_seed"] == pytest.approx({"1234": -1.2, "5678": 0.4})
    assert rowwise["mean_vs_bf16_pct"] == pytest.approx(-0.4) and rowwise["within_1pct"]
    assert result["runs"]["rowwise"]["within_1pct"] is False
    # tensorwise: +0.5% and +1.2%: mean +0.85%, within.
    assert tensorwise["mean_vs_bf16_pct"] == pytest.approx(0.85) and tensorwise["within_1pct"]
    # The +3% head variant is reported, not judged.
    assert not result["paired"]["tensorwise+fp8.output_head=true"]["within_1pct"]
    assert result["all_within_1pct"] is True
    third = _write(tmp_path / "c.json", {"none@9999": 1.0, "tensorwise@9999": 1.016})
    # +0.5, +1.2, +1.6: mean +1.1% fails the recipe, and with it the verdict.
    assert _merge(tmp_path, first, second, third)["all_within_1pct"] is False


def test_merge_takes_a_run_from_the_last_source_and_checks_the_settings(tmp_path: Path) -> None:
    old = _write(tmp_path / "old.json", {"none": 1.0, "rowwise": 0.98})
    new = _write(tmp_path / "new.json", {"none": 1.0, "rowwise": 0.995})
    result = _merge(tmp_path, old, new, recipes="none,rowwise")
    assert result["runs"]["rowwise"]["source"] == new
    assert result["runs"]["rowwise"]["vs_bf16_pct"] == pytest.approx(-0.5)
    with pytest.raises(SystemExit, match=r"no run \['delayed'\]"):
        _merge(tmp_path, old, new, recipes="none,delayed")
    other = _write(tmp_path / "other.json", {"none": 1.0}, {**SETTINGS, "lr": 1e-3})
    with pytest.raises(SystemExit, match=r"other settings than .*old.json: \['lr'\]"):
        _merge(tmp_path, old, other)
    # A run setting (how many runs shared the GPU) does not change what a run computes.
    shared = _write(tmp_path / "shared.json", {"delayed": 0.995}, {**SETTINGS, "concurrent": 9})
    assert _merge(tmp_path, old, shared)["paired"]["delayed"]["within_1pct"]


def test_parity_holds_each_mt_run_to_its_plain_counterpart_of_the_same_seed(
    tmp_path: Path,
) -> None:
    seeds = ("1234", "5678", "9999")
    plain = {"1234": 1.0, "5678": 1.01, "9999": 0.99}
    runs: dict[str, float] = {}
    for seed in seeds:
        runs[f"plain@{seed}"] = plain[seed]
        runs[f"none@{seed}"] = plain[seed] * 1.002  # +0.2% at every seed: met
        runs[f"torchao-tensorwise@{seed}"] = plain[seed] * 1.01
        runs[f"tensorwise@{seed}"] = plain[seed] * 1.01 * 1.005  # +0.5% against torchao: missed
    runs["blockwise@1234"] = plain["1234"] * 1.002 * 1.004  # +0.4% against mt bf16, one seed
    runs["none@1234+model.scaled_residual_init=true"] = plain["1234"] * 1.03
    result = _merge(tmp_path, _write(tmp_path / "p.json", runs))
    configs = result["parity"]["configs"]
    assert configs["none"]["pct_by_seed"] == pytest.approx({s: 0.2 for s in seeds})
    assert configs["none"]["met"] is True
    assert (
        configs["tensorwise"]["mean_pct"] == pytest.approx(0.5) and not configs["tensorwise"]["met"]
    )
    # One seed is too few to meet a target, even inside its bound.
    assert configs["blockwise"]["against"] == "mt bf16"
    assert (
        configs["blockwise"]["mean_pct"] == pytest.approx(0.4) and not configs["blockwise"]["met"]
    )
    # An ablation is compared with the plain run of its seed, and reported without a target.
    ablation = configs["none+model.scaled_residual_init=true"]
    assert ablation["mean_pct"] == pytest.approx(3.0) and ablation["met"] is None
    assert result["runs"]["none@1234+model.scaled_residual_init=true"]["reference"] == "none@1234"
    spreads = result["parity"]["spreads"]
    assert spreads["plain"]["spread_pct"] == pytest.approx(100 * 0.02 / 1.0)
    assert spreads["none"]["no_wider_than_plain"] is True


def test_plain_runs_take_the_model_shapes_and_their_overrides_as_flags(tmp_path: Path) -> None:
    args = fp8_quality.parse_args(
        [
            "--out",
            str(tmp_path),
            "--model",
            "debug",
            "--recipes",
            "torchao-rowwise@7+sampler=random",
        ]
    )
    launch = fp8_quality.plain_command(args, args.recipes[0], tmp_path / "run", tmp_path / "data")
    script, *argv = launch.command[1:]
    flags = dict(zip(argv[::2], argv[1::2], strict=False))
    assert script.endswith("plain_llama.py")
    assert flags["--seed"] == "7" and flags["--float8"] == "rowwise"
    assert flags["--sampler"] == "random" and flags["--dim"] == "128" and flags["--layers"] == "4"
    assert flags["--vocab-size"] == "320"  # the byte tokenizer's 257 rounded up to 64
    assert "--compile" in launch.command  # torchao's float8 runs compiled
    mt = fp8_quality.mt_command(args, "none@7+env.MT_FP8_DISABLE_TRITON=1", tmp_path, tmp_path)
    assert mt.env == {"MT_FP8_DISABLE_TRITON": "1"}
    assert not any(arg.startswith("env.") for arg in mt.command)
