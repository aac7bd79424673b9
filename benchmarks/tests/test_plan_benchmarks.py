"""The planner's benchmark scripts on the CPU: the search-speed script runs and reports a
search that ranked layouts (the speed itself is a measurement for docs/benchmarks-log.md, not
asserted here: a shared machine's load would make it flaky)."""

from __future__ import annotations

import json

import plan_search_speed


def test_search_speed_smoke(tmp_path, capsys) -> None:
    out = tmp_path / "speed.jsonl"
    assert plan_search_speed.main(["--tiny", "--out", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["fits"] > 0 and row["enumerated"] >= row["fits"] + row["rule"] + row["memory"]
    assert row["layouts_per_minute"] > 0
    assert "layouts/min" in capsys.readouterr().out
