"""DeepSeek-V3's multi-token prediction at cp=2 × tp=2 and at pp=2 × cp=2 on 4 gloo ranks
equals one process in float64 (:mod:`mtp_checks`): the MTP losses' vocabulary-parallel
cross-entropy over tp inside the whole sequence's mean over cp; the last stage's MTP modules
on its cp rank's chunks with the shifted inputs cut like the tokens. Slow: the default tier
covers cp=2, tp=2 and pp=2 (world 2, test_train_deepseek_v3_world2.py) apart."""

from __future__ import annotations

import pytest
from mtp_checks import FP64_BOUND, mtp_cp_step, mtp_pp_step

from mt_comm.testing import DistributedPool, PoolCache

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=4)


def test_mtp_at_cp2_tp2_equals_one_process_in_float64(pool: DistributedPool) -> None:
    for result in pool.run(mtp_cp_step, 2, "all_gather", 2):
        assert result["loss"] < FP64_BOUND
        assert result["ce_loss"] < FP64_BOUND
        assert max(result["mtp"]) < FP64_BOUND, result["mtp"]
        assert sorted(result["grads"]) == result["params"]
        worst = max(result["grads"].items(), key=lambda kv: kv[1])
        assert worst[1] < FP64_BOUND, worst


def test_mtp_at_pp2_cp2_equals_one_process_in_float64(pool: DistributedPool) -> None:
    per_rank = pool.run(mtp_pp_step, 2, cp=2)
    for result in per_rank:
        assert result["loss"] < FP64_BOUND
        assert {"mtp_loss_1", "mtp_loss_2", "ce_loss"} == set(result["extras"])
        # The extras are summed in fp32 on both sides (logging precision).
        worst = max(result["extras"].items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-6, worst
        worst = max(result["grads"].items(), key=lambda kv: kv[1])
        assert worst[1] < FP64_BOUND, worst
        assert result["copies_equal"] and result["embedding"] < FP64_BOUND
    assert sum(r["holds_mtp"] for r in per_rank) == 2  # the last stage's two cp ranks
