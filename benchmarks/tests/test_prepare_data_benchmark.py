"""``benchmarks/prepare_data.py`` on a tiny corpus: both sides run and the row is consistent."""

from __future__ import annotations

import prepare_data


def test_prepare_data_benchmark_smoke() -> None:
    (row,) = prepare_data.run([1.0], workers=2, batch=200, vocab_size=300, sample_mb=0.2)
    assert row["input_mb"] >= 1.0 and row["documents"] > 500 and row["tokens"] > row["documents"]
    assert row["mt_seconds"] > 0 and row["bare_seconds"] > 0
    # Both trees hold at least a Python interpreter (tens of MB) and far less than the 1.5 GB
    # bound; a broken /proc poll would read 0.
    for side in ("mt", "bare"):
        assert 0.01 < row[f"{side}_peak_rss_gb"] < 1.5, row
    # The row's seconds are rounded to 0.01 s and its ratio is taken before rounding, so the ratio
    # of the printed seconds may differ from it by up to 0.005 s on either side.
    bare, mt = row["bare_seconds"], row["mt_seconds"]
    assert (
        (bare - 0.005) / (mt + 0.005) - 1e-3 <= row["ratio"] <= (bare + 0.005) / (mt - 0.005) + 1e-3
    )
