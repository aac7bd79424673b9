"""benchmarks/moe_permute.py runs end to end on the CPU with tiny shapes (``--smoke``) and writes
one row per op, shape and capacity setting."""

from __future__ import annotations

import json
from pathlib import Path

import moe_permute


def test_moe_permute_smoke(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    moe_permute.main(["--smoke", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    expected = {
        (op, shape[0], capacity)
        for shape in moe_permute.SMOKE_SHAPES
        for capacity in moe_permute.CAPACITIES
        for op in ("permute", "unpermute")
    }
    assert {(r["op"], r["shape"], r["capacity_factor"]) for r in rows} == expected
    assert len(rows) == len(expected)
    for row in rows:
        assert row["pytorch_ms"] > 0 and row["fused_ms"] > 0 and row["bytes"] > 0
        tokens, top_k = row["tokens"], row["top_k"]
        if row["capacity_factor"] is None:
            assert row["rows"] == tokens * top_k
        else:  # padded: every expert gets ceil(1.25 · T·K / E) rows
            assert row["rows"] == row["experts"] * -(-5 * tokens * top_k // (4 * row["experts"]))
