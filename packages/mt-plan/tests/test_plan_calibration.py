"""The calibration lookup between measured shapes.

A shape between measured ones takes a rate multilinear in log shape between the measured shapes
that bracket it: a shape halfway (in log) between two grid points takes their mean, not the
rate of whichever entry the table lists first (the nearest-shape rule's tie, which priced
Llama3-1B's 2048-wide GEMMs at the rate of a 1024-wide one, the grid's slowest neighbour).
Grid points keep their own rate, shapes beyond the grid its edge's, and a shape whose bracketing
corners were not all measured the nearest measured shape's.

Each GEMM pass (forward, dgrad, wgrad) is priced from its own entries (the shipped H100 table
has them); a table measured before the passes (the shipped H200 table) prices every pass from its
layout-free ``gemm`` entries.
"""

from __future__ import annotations

import itertools

import pytest

from mt_plan.calibration import GEMM_PASSES, CalibrationTable, Entry, load_table

GRID = (1024, 4096)


def _table(skip: tuple[int, ...] | None = None) -> CalibrationTable:
    entries = [
        Entry("gemm", "bf16", shape, 1e14 * (1 + i))
        for i, shape in enumerate(itertools.product(GRID, GRID, GRID))
        if shape != skip
    ]
    return CalibrationTable("test", entries)


def _rate(table: CalibrationTable, shape: tuple[int, int, int]) -> float:
    flops = 2.0 * shape[0] * shape[1] * shape[2]
    seconds, source = table.compute_time("gemm", "bf16", shape, flops, 1.0, 1e30, 1e30)
    assert source == "measured"
    return flops / seconds


def test_rates_are_interpolated_between_measured_shapes() -> None:
    table = _table()
    rates = [e.rate for e in table.entries]
    assert _rate(table, (2048, 2048, 2048)) == pytest.approx(sum(rates) / 8)
    # along one axis only: the mean of the two grid points that bracket it
    assert _rate(table, (1024, 1024, 2048)) == pytest.approx((rates[0] + rates[1]) / 2)
    # a quarter of the way in log (1448 ≈ 1024·2^0.5 of 1024…4096's two octaves)
    assert _rate(table, (1024, 1024, 1448)) == pytest.approx(
        0.75 * rates[0] + 0.25 * rates[1], rel=1e-3
    )
    for i, shape in enumerate(itertools.product(GRID, GRID, GRID)):
        assert _rate(table, shape) == pytest.approx(rates[i])
    assert _rate(table, (64, 64, 65536)) == pytest.approx(rates[1])  # clamped to the edge


def test_a_missing_corner_falls_back_to_the_nearest_shape() -> None:
    table = _table(skip=(4096, 4096, 4096))
    assert _rate(table, (2048, 2048, 2048)) == pytest.approx(table.entries[0].rate)
    assert _rate(table, (3800, 3800, 2048)) == pytest.approx(table.entries[-1].rate)


@pytest.mark.parametrize("op,traffic", [("rmsnorm", 2.0), ("rope", 9 / 4), ("swiglu", 1.0)])
def test_memory_bound_rates_count_what_the_calibration_harness_moved(op, traffic) -> None:
    # ``op(...).sum().backward()`` with never-cleared leaf gradients moved (24+4A)/(12+2A) times
    # RMSNorm's rated bytes and 9A/4A times RoPE's: the op's bandwidth is the rate times that
    rate, moved, bandwidth = 1e12, 3e9, 1e30
    table = CalibrationTable("test", [Entry(op, "bf16", (8192, 4096), rate)])
    seconds, source = table.membound_time(op, "bf16", (8192, 4096), moved, bandwidth)
    assert source == "measured"
    assert seconds == pytest.approx(moved / (rate * traffic))
    # an op without entries takes copy's rate as it is (the copy harness moves what it rates)
    copy = CalibrationTable("test", [Entry("copy", "bf16", (8192, 4096), rate)])
    assert copy.membound_time(op, "bf16", (8192, 4096), moved, bandwidth)[0] == moved / rate


def _pass_time(table: CalibrationTable, op: str, dtype: str = "bf16") -> tuple[float, str]:
    shape = (4096, 4096, 4096)
    return table.compute_time(op, dtype, shape, 2.0 * 4096**3, 1.0, 1e30, 1e30)


def test_each_gemm_pass_is_priced_from_its_own_entries_else_the_layout_free_ones() -> None:
    flops, shape = 2.0 * 4096**3, (4096, 4096, 4096)
    # a table measured before the passes (a @ b, row-major) prices every pass from ``gemm``
    old = CalibrationTable("old", [Entry("gemm", "bf16", shape, 5e14)])
    for gemm_pass in GEMM_PASSES:
        assert _pass_time(old, f"gemm_{gemm_pass}") == (flops / 5e14, "measured")
        assert old.layout_free(f"gemm_{gemm_pass}", "bf16")
    # a pass's own entries win over the layout-free ones
    both = CalibrationTable("new", [*old.entries, Entry("gemm_wgrad", "bf16", shape, 6e14)])
    assert _pass_time(both, "gemm_wgrad") == (flops / 6e14, "measured")
    assert _pass_time(both, "gemm_fwd") == (flops / 5e14, "measured")
    assert not both.layout_free("gemm_wgrad", "bf16") and both.layout_free("gemm_fwd", "bf16")
    # a recipe's own (even layout-free) rates come before fp8_tensorwise's
    fp8 = CalibrationTable("fp8", [Entry("gemm", "fp8_rowwise", shape, 1e15),
                                   Entry("gemm_dgrad", "fp8_tensorwise", shape, 1.2e15)])  # fmt: skip
    assert _pass_time(fp8, "gemm_dgrad", "fp8_rowwise") == (flops / 1e15, "measured")
    assert _pass_time(fp8, "gemm_dgrad", "fp8_delayed") == (flops / 1.2e15, "derived")
    assert _pass_time(fp8, "gemm_fwd", "fp8_delayed")[1] == "roofline"


@pytest.mark.parametrize("name", ["h100", "h200"])
def test_shipped_tables_price_every_pass(name) -> None:
    # h100 (2026-12-07) times each pass and has no layout-free entries left; h200 predates the
    # passes and prices every one from its layout-free gemm and grouped_gemm entries
    table = load_table(name)
    per_pass = name == "h100"
    for gemm_pass in GEMM_PASSES:
        for dtype in ("bf16", "fp8_tensorwise", "fp8_rowwise"):
            assert table.has(f"gemm_{gemm_pass}", dtype) is per_pass
            assert table.layout_free(f"gemm_{gemm_pass}", dtype) is not per_pass
            assert _pass_time(table, f"gemm_{gemm_pass}", dtype)[1] == "measured"
        assert table.has(f"grouped_gemm_{gemm_pass}", "bf16") is per_pass
        assert table.layout_free(f"grouped_gemm_{gemm_pass}", "bf16") is not per_pass
