"""``data.blend`` across processes (two gloo ranks, a pool shared across modules): a run stopped by
SIGTERM resumes with ``checkpoint.resume=auto`` at another data-parallel size (dp=2 → 1 and
1 → 2) and continues the uninterrupted run's losses and per-source token counts; a rewind on a
blend at dp=2 skips the draws it names: no rank trains on them afterwards, and the per-source
token counts leave them out.

The blend is the 3:1 two-source one of ``train_checks.blend_sources``; global batch 8, so the
draws of step k are ``[8(k-1), 8k)`` at every dp.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import train_checks
from train_checks import blend_sources, rewind_overrides, tiny_overrides

from mt_comm.testing import DistributedPool, PoolCache

# Global batch 8 as two micro-batches of 4: one process accumulates the two micro-batch
# gradients, g1 + g2; at dp=2 each rank holds one and the gloo all-reduce forms the same single
# fp32 sum of two terms (addition of two numbers is commutative), so dp=1 and dp=2 agree bit
# for bit and a resume at the other dp is compared exactly. (At dp=4 the summation order of four
# terms would differ, and equality would hold only to fp32 rounding.)
STEPS, STOP = 8, 3  # SIGTERM as step 3 begins: step 3 finishes and is saved off the interval
SOURCES = ("bible", "verse")


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=2)


@pytest.fixture(scope="module")
def blend(tmp_path_factory: pytest.TempPathFactory) -> str:
    return blend_sources(tmp_path_factory.mktemp("blend"))


def _overrides(blend: str, **extra: object) -> list[str]:
    extra = {"data.path": None, "data.blend": blend, "trainer.max_steps": STEPS, **extra}
    return tiny_overrides("unused", **extra)


def _tokens(rows: list[dict]) -> dict[int, tuple[int, ...]]:
    """Per logged step, the tokens consumed from each source."""
    return {
        r["step"]: tuple(r[f"tokens/{s}"] for s in SOURCES) for r in rows if "tokens/bible" in r
    }


@pytest.fixture(scope="module")
def uninterrupted(blend: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """8 steps in one process: the losses and metric rows the resumed runs continue."""
    return train_checks.run_logged(_overrides(blend), tmp_path_factory.mktemp("whole"))


@pytest.mark.parametrize("dp", [(2, 1), (1, 2)], ids=["dp2_to_dp1", "dp1_to_dp2"])
def test_blend_resumes_at_another_dp(
    dp: tuple[int, int], pool, blend: str, uninterrupted: dict, tmp_path: Path
) -> None:
    def train(ranks: int, overrides: list[str]) -> dict:
        if ranks == 1:
            return train_checks.run_logged(overrides, tmp_path)
        return pool.run(train_checks.run_logged, overrides, tmp_path)[0]  # rank 0 logs

    stop = _overrides(blend, **{"fault.sigterm_at_step": STOP})
    first = train(dp[0], stop)
    assert (tmp_path / "checkpoints" / f"step-{STOP:08d}" / "manifest.json").is_file()
    resumed = train(dp[1], [*stop, "fault.sigterm_at_step=null", "checkpoint.resume=auto"])

    whole = uninterrupted["losses"]
    assert len(first["losses"]) == STOP and len(resumed["losses"]) == STEPS - STOP
    assert first["losses"] == whole[:STOP]
    assert resumed["losses"] == whole[STOP:]  # exact float equality, step by step

    # Token counts come from the global draw count, so they are exact at any dp; the resumed
    # run logs step 4 and 8 as the uninterrupted one does.
    expected = _tokens(uninterrupted["rows"])
    assert sorted(expected) == [4, 8]
    assert _tokens(resumed["rows"]) == expected
    bible, verse = expected[STEPS]
    assert bible + verse == STEPS * 8 * 64 and bible > verse  # steps · batch · seq, 3:1


# The fault scenario of test_train_rewind_dist on a blend: rank 1's gradient norm spikes at
# step 16, both ranks rewind to step 8 (the newest stable checkpoint) and skip the draws of
# steps 9-16.
REWIND_STEPS, FAULT, STABLE = 24, 16, 8


def _logged_tokens(folder: Path) -> dict[int, tuple[int, ...]]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return _tokens(rows)


def test_rewind_on_a_blend_never_trains_on_the_skipped_draws(
    pool, blend: str, tmp_path: Path
) -> None:
    # What one process draws in 32 uninterrupted steps, step by step (the draws at any dp).
    steps = {"trainer.max_steps": 2 * FAULT, "trainer.log_interval": STABLE}
    reference = train_checks.run_collated(_overrides(blend, **steps), tmp_path / "reference")
    fault = {"fault.rank": 1, "fault.grad_spike_at_step": FAULT, "fault.spike_factor": 100.0}
    extra = {"trainer.max_steps": REWIND_STEPS, "trainer.eval_interval": REWIND_STEPS, **fault}
    overrides = rewind_overrides("unused", **{"data.path": None, "data.blend": blend, **extra})
    results = pool.run(train_checks.run_collated, overrides, tmp_path / "rewound")

    for result in results:
        assert result["steps"] == REWIND_STEPS
        (rewind,) = [e for e in result["events"] if e["event"] == "rewind"]
        assert rewind["restored"]["step"] == STABLE
        assert rewind["skipped"]["draws"] == [[STABLE * 8, FAULT * 8]]
    # Every step any rank ran, the undone steps 9-16 included: the union of both ranks' rows.
    ran = [sorted(a + b) for a, b in zip(*(r["collated"] for r in results), strict=True)]
    drawn = [sorted(rows) for rows in reference["collated"]]
    # Steps 1-16 as drawn uninterrupted; after the rewind, steps 9-24 train on the draws of
    # uninterrupted steps 17-32: the skipped draws (steps 9-16) come back at no step. Draw
    # for draw, not by row: a source's rows repeat in its next epoch.
    assert len(ran) == REWIND_STEPS + FAULT - STABLE
    assert ran == drawn

    # Per-source tokens count only trained draws: [0, 64) and [128, 256).
    whole = _logged_tokens(tmp_path / "reference")
    ends = zip(whole[STABLE], whole[FAULT], whole[2 * FAULT], strict=True)
    trained = tuple(before + end - skipped for before, skipped, end in ends)
    assert trained != whole[REWIND_STEPS]  # counting the skipped draws would show
    assert max(_logged_tokens(tmp_path / "rewound").items()) == (REWIND_STEPS, trained)
