"""``data.blend`` across processes (two gloo ranks, one pool for the module): a run stopped by
SIGTERM resumes with ``checkpoint.resume=auto`` at another data-parallel size (dp=2 → 1 and
1 → 2) and continues the uninterrupted run's losses and per-source token counts; a rewind on a
blend at dp=2 skips the draws it names, and no rank trains on them afterwards.

The blend is the 3:1 two-source one of ``train_checks.blend_sources``; global batch 8, so the
draws of step k are ``[8(k-1), 8k)`` at every dp.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import train_checks
from train_checks import blend_sources, tiny_overrides

from mt_comm.testing import DistributedPool

# fp32 on CPU. dp=1 and dp=2 differ only in where the gradient of a global batch is summed
# (one backward over both micro-batches vs two ranks' backwards and a gloo all-reduce), which
# moves each loss by a few ulps per step; 8 AdamW steps keep that far below 1e-4 relative.
# The same run at the same dp is compared exactly.
RTOL = 1e-4
STEPS, STOP = 8, 3  # SIGTERM as step 3 begins: step 3 finishes and is saved off the interval
SOURCES = ("bible", "verse")


@pytest.fixture(scope="module")
def pool():
    with DistributedPool(world_size=2) as pool:
        yield pool


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
    assert first["losses"] == pytest.approx(whole[:STOP], rel=RTOL)
    assert resumed["losses"] == pytest.approx(whole[STOP:], rel=RTOL)
    # A wrong data position would show: the tiny model's losses differ by far more than RTOL
    # from one step's batch to the next.
    assert min(abs(a - b) / b for a, b in itertools.pairwise(whole)) > 10 * RTOL

    # Token counts come from the global draw count, so they are exact at any dp; the resumed
    # run logs step 4 and 8 as the uninterrupted one does.
    expected = _tokens(uninterrupted["rows"])
    assert sorted(expected) == [4, 8]
    assert _tokens(resumed["rows"]) == expected
    bible, verse = expected[STEPS]
    assert bible + verse == STEPS * 8 * 64 and bible > verse  # steps · batch · seq, 3:1
