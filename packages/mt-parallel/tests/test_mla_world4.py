"""Multi-head latent attention at cp=2 × tp=2 on 4 gloo ranks against one process, with and
without sequence parallel, on packed documents: the latent is gathered over cp after the TP
preparation (``copy_to_group``, or the SP all-gather along the sequence), so each rank's heads
expand the whole sequence's latent. Slow: the default tier covers cp=2 and tp=2 (with SP)
apart (test_mla_world2.py)."""

from __future__ import annotations

import mla_checks
import pytest
from mla_checks import SHAPES
from parallel_tolerances import FP64_VS_FP64, assert_close

from mt_comm.testing import DistributedPool, PoolCache

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=4)


@pytest.mark.parametrize("sp", [False, True], ids=["cp2-tp2", "cp2-tp2-sp"])
def test_mla_cp2_tp2_equals_one_process(pool: DistributedPool, sp: bool) -> None:
    for result in pool.run(mla_checks.cp_parity, tp=2, q_lora_rank=10, kernel="explicit", sp=sp):
        # Every TP rank of a cp group gathers the same latent (C + R per token, not its heads'
        # K/V). float64 both sides: summation order only (FP64_VS_FP64, 1e-10); a latent
        # gradient not summed over tp or over cp is an O(1) error.
        mla_checks.check_latent_traffic(result, SHAPES)
        assert_close(result, FP64_VS_FP64)
