"""Two gloo ranks (dp=2): a fault that only rank 1 sees makes both ranks rewind to the same
checkpoint, skip the same data and end identical (also under ZeRO-1, restoring each rank's
optimizer pieces from disk); a SIGTERM that reaches rank 1 only stops both after the same step.
A pool shared across modules.

24 steps, checkpoints every 4, stable after 4, the fault at step 16: at the anomaly 15 steps
are done, step-12 is 3 healthy steps old (not stable) and step-8 is the newest stable one.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import train_checks
from train_checks import rewind_overrides

from mt_comm.testing import DistributedPool, PoolCache
from mt_train.rewind import read_events

STEPS, FAULT, STABLE = 24, 16, 8


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=2)


def _overrides(data: Path, **extra: object) -> list[str]:
    return rewind_overrides(
        data, **{"trainer.max_steps": STEPS, "trainer.eval_interval": STEPS, **extra}
    )


def _same_everywhere(record: dict) -> dict:
    """A rewind record without what legitimately differs by rank (the clock, own values)."""
    return {k: v for k, v in record.items() if k not in ("time", "values")}


FAULTS = {
    # Rank 1's gradients are scaled after the all-reduce: only its norm spikes.
    "grad_spike": (
        {"fault.grad_spike_at_step": FAULT, "fault.spike_factor": 100.0},
        "grad_norm_spike",
    ),
    # Rank 1's FP8 inputs saturate; rank 0's do not (loss checks off: rank 1's garbage
    # activations also raise the mean loss, which both ranks would see). The scaled residual
    # init keeps this tiny model's own delayed-scaling saturation below the detector's threshold
    # after the rewind, so the injected burst is the only one.
    "fp8_overflow": (
        {
            "fault.fp8_overflow_at_step": FAULT,
            "fp8": "delayed",
            "rewind.detectors": "[non_finite,fp8_overflow]",
            "model.scaled_residual_init": True,
        },
        "fp8_overflow",
    ),
    # A NaN in rank 1's loss: its local loss is NaN before the mean makes everyone's NaN.
    "nan": ({"fault.nan_at_step": FAULT}, "non_finite"),
}


@pytest.mark.parametrize("name", list(FAULTS))
def test_one_rank_fault_rewinds_both_ranks(name: str, pool, kjv_data: Path, tmp_path: Path) -> None:
    extra, detector = FAULTS[name]
    results = pool.run(
        train_checks.run_rewind, _overrides(kjv_data, **{"fault.rank": 1, **extra}), tmp_path
    )
    for result in results:
        assert result["steps"] == STEPS and result["rewinds"] == 1
    rewinds = [[e for e in r["events"] if e["event"] == "rewind"] for r in results]
    assert len(rewinds[0]) == len(rewinds[1]) == 1
    r0, r1 = rewinds[0][0], rewinds[1][0]
    assert _same_everywhere(r0) == _same_everywhere(r1)
    assert r0["step"] == FAULT - 1 and r0["detector"] == detector
    assert r0["restored"]["step"] == STABLE and r0["restored"]["stable"] is True
    assert r0["skipped"]["draws"] == [[STABLE * 8, FAULT * 8]]
    seen = r0["ranks"][detector]
    assert seen == ([0, 1] if name == "nan" else [1])  # the mean spreads a NaN, not the rest
    assert "1" in r0["values"][detector]["by_rank"]
    # Both ranks continued in lockstep: the same (dp-mean) losses, step for step.
    assert results[0]["losses"] == results[1]["losses"]
    # Rank 0 wrote the log, naming the rank that saw the fault.
    (logged,) = [e for e in read_events(tmp_path) if e["event"] == "rewind"]
    assert logged["ranks"] == r0["ranks"]


def test_zero1_rewinds_from_disk(pool, kjv_data: Path, tmp_path: Path) -> None:
    extra = {"parallel": "zero1", "rewind.memory_snapshots": False, "fault.nan_at_step": FAULT}
    results = pool.run(train_checks.run_rewind, _overrides(kjv_data, **extra), tmp_path)
    assert [(r["steps"], r["rewinds"]) for r in results] == [(STEPS, 1), (STEPS, 1)]
    (rewind,) = [e for e in results[0]["events"] if e["event"] == "rewind"]
    assert rewind["restored"]["step"] == STABLE and rewind["restored"]["source"] == "disk"
    assert results[0]["losses"] == results[1]["losses"]
    assert all(math.isfinite(x) for x in results[0]["losses"])


def test_sigterm_on_one_rank_stops_both(pool, kjv_data: Path, tmp_path: Path) -> None:
    overrides = _overrides(kjv_data, **{"fault.sigterm_at_step": 10, "fault.rank": 1})
    results = pool.run(train_checks.run_rewind, overrides, tmp_path)
    assert [r["steps"] for r in results] == [10, 10]
    stops = [[e for e in r["events"] if e["event"] == "preempted"] for r in results]
    assert stops[0][0]["signal"] == "a signal on another rank"
    assert stops[1][0]["signal"] == "SIGTERM"
    folder = tmp_path / "checkpoints" / "step-00000010"
    assert (folder / "rank-00000.safetensors").is_file()
    assert (folder / "rank-00001.safetensors").is_file()
