"""The calibration lookup between measured shapes.

A shape between measured ones takes a rate multilinear in log shape between the measured shapes
that bracket it: a shape halfway (in log) between two grid points takes their mean, not the
rate of whichever entry the table lists first (the nearest-shape rule's tie, which priced
Llama3-1B's 2048-wide GEMMs at the rate of a 1024-wide one, the grid's slowest neighbour).
Grid points keep their own rate, shapes beyond the grid its edge's, and a shape whose bracketing
corners were not all measured the nearest measured shape's.
"""

from __future__ import annotations

import itertools

import pytest

from mt_plan.calibration import CalibrationTable, Entry

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
