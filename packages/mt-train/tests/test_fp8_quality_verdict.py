"""Issue 7's quality verdict in ``benchmarks/fp8_quality.py``, on made-up results.

The verdict judges each FP8 recipe by its difference from bf16 averaged over the seeds that
have their own bf16 run; ``--merge`` joins the results of several device sessions. The
training runs themselves need a GPU and minutes each; these tests feed the judging code
hand-written validation curves whose differences are known exactly.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "benchmarks" / "fp8_quality.py"
SETTINGS = {
    "model": "llama_125m", "steps": 200, "seq_len": 256, "global_batch": 16, "micro_batch": 16,
    "lr": 6e-4, "warmup": 10, "eval_interval": 100, "eval_batches": 21, "seed": 1234,
    "concurrent": 4, "extra": [],
}  # fmt: skip

pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="needs the repository's benchmarks/")


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("fp8_quality", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


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
    assert _script().main(argv) == 0
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
    # A session setting (how many runs shared the GPU) does not change what a run computes.
    shared = _write(tmp_path / "shared.json", {"delayed": 0.995}, {**SETTINGS, "concurrent": 9})
    assert _merge(tmp_path, old, shared)["paired"]["delayed"]["within_1pct"]
