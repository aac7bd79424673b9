"""The planner's benchmark scripts on the CPU: the search-speed script runs and reports a
search that ranked layouts (the speed itself is a measurement for docs/benchmarks-log.md, not
asserted here: a shared machine's load would make it flaky); the validation harness measures
its tiny configurations (its ``--measure`` subprocess run in this process) and reports."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from types import SimpleNamespace

import plan_search_speed


def test_search_speed_smoke(tmp_path, capsys) -> None:
    out = tmp_path / "speed.jsonl"
    # --tiny's model and sequence on its 4 GPUs with a global batch of 1 (one micro-batch
    # size): every tp, cp, pp, vpp and schedule, 2,130 layouts instead of --tiny's 8,820.
    small = ["--model", "llama3_1b", "--gpus", "4", "--seq", "2048", "--global-batch", "1"]
    assert plan_search_speed.main([*small, "--out", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["fits"] > 0 and row["enumerated"] >= row["fits"] + row["rule"] + row["memory"]
    assert row["layouts_per_minute"] > 0
    assert "layouts/min" in capsys.readouterr().out


def _measure_here(command: list[str], **kwargs: object) -> subprocess.CompletedProcess:
    """``subprocess.run`` for the harness's ``python plan_validation.py --measure ...``: its
    ``main`` here, with what it prints."""
    import plan_validation

    assert command[:3] == [sys.executable, plan_validation.__file__, "--measure"], command
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = plan_validation.main(command[2:])
    return subprocess.CompletedProcess(command, status, printed.getvalue(), "")


def test_validation_harness_smoke(tmp_path, capsys, monkeypatch) -> None:
    import plan_validation

    replaced = SimpleNamespace(run=_measure_here, TimeoutExpired=subprocess.TimeoutExpired)
    monkeypatch.setattr(plan_validation, "subprocess", replaced)
    out = tmp_path / "validation.jsonl"
    args = ["--tiny", "--out", str(out), "--warmup", "1", "--steps", "2"]
    assert plan_validation.main(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["name"] for r in rows] == list(plan_validation.TINY_CONFIGS)
    for row in rows:
        assert row["measured_step_s"] > 0 and row["predicted_step_s"] > 0 and row["predicted_fits"]
    text = capsys.readouterr().out
    assert "Kendall τ of step times" in text and "debug-l4-s64: predicted best" in text


def test_kendall_tau() -> None:
    import plan_validation

    assert plan_validation.kendall_tau([1, 2, 3], [10, 20, 30]) == 1.0
    assert plan_validation.kendall_tau([1, 2, 3], [30, 20, 10]) == -1.0
    assert plan_validation.kendall_tau([1, 2, 3, 4], [1, 2, 4, 3]) == 4 / 6


def test_repredict_recomputes_the_predictions_of_recorded_rows(tmp_path, capsys) -> None:
    import plan_validation

    rows = []
    for i, (name, overrides) in enumerate(plan_validation.TINY_CONFIGS.items()):
        rows.append({"name": name, "overrides": plan_validation.with_batch(overrides),
                     "oom": False, "measured_step_s": 0.01 * (i + 1), "vocab": 320,
                     "measured_alloc_bytes": 2**20 * (i + 1), "predicted_step_s": 1.0,
                     "predicted_alloc_bytes": 1.0, "predicted_fits": True,
                     "tokens_per_step": 128})  # fmt: skip
    recorded = tmp_path / "recorded.jsonl"
    recorded.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "now.jsonl"
    args = ["--repredict", str(recorded), "--calibration", "h200", "--cluster", "h200",
            "--out", str(out)]  # fmt: skip
    assert plan_validation.main(args) == 0
    now = [json.loads(line) for line in out.read_text().splitlines()]
    for old, new in zip(rows, now, strict=True):
        expected = plan_validation.predict(old["overrides"], "h200", 320, "h200")
        assert new["predicted_step_s"] == expected["predicted_step_s"] != old["predicted_step_s"]
        assert new["predicted_alloc_bytes"] == expected["predicted_alloc_bytes"]
        assert new["measured_step_s"] == old["measured_step_s"]
        assert new["measured_alloc_bytes"] == old["measured_alloc_bytes"]
    text = capsys.readouterr().out
    assert "predicted s, recorded" in text and "|error|, recorded → now" in text
    assert "Kendall τ of step times" in text
