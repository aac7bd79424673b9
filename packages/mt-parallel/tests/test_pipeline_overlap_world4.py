"""DualPipeV's overlap function on 4 gloo ranks (the world-4 pool shared across modules): pp=2 ×
dp=2 with the MoE experts split over ep=2. Overlapped and back-to-back pairs give the same
losses, gradients, MoE records and generator state bit for bit (also with dropout under full
recompute, where the recomputed masks replay a saved generator state in the middle of the
other half); and the trace shows each half's all-to-alls in flight while the other computes,
which the back-to-back run never has."""

from __future__ import annotations

import pipeline_overlap_checks as checks
import pytest

from mt_comm.testing import DistributedPool, PoolCache


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=4)


def _check_equal(results: list[dict]) -> None:
    for result in results:
        assert result["overlaps"] == (True, False), result["overlaps"]
        assert result["grad_count"] > 0 and result["grads_differing"] == [], result
        assert result["losses_equal"] and result["records_equal"] and result["rng_equal"], result
    assert sum(r["holds_last"] for r in results) == 2  # one per dp replica


def test_overlap_equals_back_to_back_and_overlaps(pool: DistributedPool) -> None:
    results = pool.run(checks.dualpipev_overlap)
    _check_equal(results)
    for result in results:
        pairs = result["pairs"]
        # Every pair starts the forward's first dispatch and then runs the backward's start;
        # the backward's first exchange (combine's gradient) travels during the forward's
        # expert MLP: at least one of each half's exchanges per pair overlaps the other half.
        for half in ("F", "B"):
            overlapped = result["overlapped"][half][1]
            assert pairs > 0 and overlapped >= pairs, (half, result["overlapped"], pairs)
            assert result["back_to_back"][half] == [0, 0], result["back_to_back"]


def test_overlap_with_dropout_under_full_recompute(pool: DistributedPool) -> None:
    _check_equal(pool.run(checks.dualpipev_overlap, dropout=0.1, recompute="full"))
