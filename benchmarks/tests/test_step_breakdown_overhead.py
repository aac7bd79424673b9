"""``benchmarks/step_breakdown_overhead.py``: its arithmetic, and a CPU smoke run of two launches.

The smoke run's launches run ``mt_train.cli.main`` (what ``python -m mt_train`` runs) in this
process instead of a subprocess each, which would import torch and mt_train again."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import step_breakdown_overhead as bench


def test_throughput_and_overhead_arithmetic() -> None:
    records = [
        {"kind": "train", "step": 10, "tok/s": 1.0, "time/data": 9.0},
        {"kind": "eval", "step": 20, "val_loss": 1.0},
        {"kind": "train", "step": 20, "tok/s": 100.0, "time/data": 0.1},
        {"kind": "train", "step": 30, "tok/s": 104.0, "time/data": 0.3},
        {"kind": "train", "step": 40, "tok/s": 90.0, "time/data": 0.2},
    ]
    assert bench.launch_throughput(records, skip=10) == 100.0  # step 10 (warm-up) left out
    assert bench.mean_breakdown(records, skip=10) == {"time/data": pytest.approx(0.2)}
    assert bench.overhead(on=[99.0, 98.0, 97.0], off=[100.0, 50.0, 101.0]) == pytest.approx(0.02)
    with pytest.raises(ValueError, match="no train record after step 40"):
        bench.launch_throughput(records, skip=40)


def _launch_here(command: list[str], **kwargs: object) -> subprocess.CompletedProcess:
    """``subprocess.run`` for ``python -m mt_train ARGS``: ``mt_train.cli.main(ARGS)`` here."""
    from mt_train.cli import main

    assert command[:3] == [sys.executable, "-m", "mt_train"], command
    return subprocess.CompletedProcess(command, main(command[3:]), "", "")


def test_tiny_cpu_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "subprocess", SimpleNamespace(run=_launch_here))
    row = bench.main(
        ["--tiny", "--steps", "4", "--log-interval", "2", "--skip", "0", "--rounds", "1",
         "--workdir", str(tmp_path)]
    )  # fmt: skip
    assert len(row["tokens_per_s_on"]) == len(row["tokens_per_s_off"]) == 1
    assert row["breakdown_s"]["time/forward_backward"] > 0
    off = (tmp_path / "off-0" / "metrics.jsonl").read_text().splitlines()
    assert off and not any("time/" in line for line in off)  # the breakdown was off there
