"""``benchmarks/fp8_cpu_gemm.py`` on its smallest shape: both GEMMs run and agree."""

from __future__ import annotations

import fp8_cpu_gemm


def test_fp8_cpu_gemm_rows_are_consistent() -> None:
    for recipe in fp8_cpu_gemm.RECIPES:
        row = fp8_cpu_gemm.measure(64, 64, 32, recipe, repeats=1)
        assert row["scaled_mm_ms"] > 0 and row["emulate_ms"] > 0
        assert row["speedup"] == round(row["scaled_mm_ms"] / row["emulate_ms"], 1)
        # Same exact products, fp32 accumulation over K = 64 terms in another order and the
        # scales applied at another point: far below 64 * 2^-24 ≈ 4e-6 of Σ|a||b|.
        assert row["max_rel_diff"] < 64 * 2**-24, row
