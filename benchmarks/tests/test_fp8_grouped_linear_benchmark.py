"""``benchmarks/fp8_grouped_linear.py --smoke`` runs end to end on the CPU (every FP8 column is
the per-expert loop there) and times every column it promises."""

from __future__ import annotations

import fp8_grouped_linear


def test_fp8_grouped_linear_smoke(capsys) -> None:
    rows = fp8_grouped_linear.main(["--smoke"])
    ((experts, k, n),) = fp8_grouped_linear.SMOKE_SHAPES
    row = rows[f"{experts}, {k}, {n}"]
    assert sum(row["sizes"]) == fp8_grouped_linear.SMOKE_TOKENS
    names = [name for name, _ in fp8_grouped_linear.RECIPES]
    assert "mxfp8" in names and "block" in names
    for name in names:
        assert row[f"{name} loop"] > 0
        # On the CPU no grouped FP8 GEMM runs: each grouped column says why in a note.
        assert row[f"{name} grouped"] is None
        assert any(note.startswith(f"{name} grouped: loop (") for note in row["notes"])
    out = capsys.readouterr().out
    assert "- mxfp8: grouped GEMMs forward, dgrad, wgrad" in out
    assert "mxfp8 loop | mxfp8 grouped" in out
