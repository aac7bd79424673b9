"""On 8 gloo ranks: the decoder block at dp=2 × cp=2 × tp=2 (with sequence parallel), and MoE
experts split over ep=2 at dp=4 × tp=2 with sequence parallel under FSDP2 and ZeRO-1, whose
expert-data-parallel groups (2 ranks) reduce-scatter the expert gradients and then sum their
shards over TP once per step, against one process in float64."""

from __future__ import annotations

import moe_data_parallel_checks
import parallel_checks as checks
import pytest
from parallel_tolerances import assert_close
from test_moe_data_parallel_world4 import (
    FP64_BOUND,
    NORM_BOUND,
    assert_one_expert_tp_sum_per_step,
)

from mt_comm.testing import DistributedPool


@pytest.fixture(scope="module")
def pool():
    # Not from distributed_pools: no other module runs 8 ranks, and 8 idle ranks kept until the
    # session ends would hold about 3 GB (about 400 MB each) beside the shared pools.
    with DistributedPool(world_size=8) as pool:
        yield pool


def test_decoder_block_dp2_cp2_tp2_sp(pool: DistributedPool) -> None:
    for result in pool.run(checks.decoder_lm, dp=2, cp=2, tp=2, sp=True):
        assert_close(result)


@pytest.mark.parametrize("mode", ["fsdp", "zero1"])
def test_moe_experts_over_edp2_with_sequence_parallel(pool: DistributedPool, mode: str) -> None:
    # Bounds and their reasons: test_moe_data_parallel_world4.py. Without the experts' TP sum
    # each TP rank steps with the gradient of its own tokens only; summed on each TP rank's
    # shard, the sum is right only if the TP ranks' shards hold the same elements.
    for result in pool.run(moe_data_parallel_checks.train_steps, mode=mode, tp=2):
        assert any(result["clipped"]), result["clipped"]
        assert max(result["norms"]) < NORM_BOUND, result["norms"]
        assert max(result["params"].values()) < FP64_BOUND, result["params"]
        assert max(result["expert_grads"]) < FP64_BOUND, result["expert_grads"]
        assert_one_expert_tp_sum_per_step(result, mode)  # a 1/2 shard, not 6 per micro-batch
        # Four local experts over an edp group of two: FSDP2 shards them along dim 0.
        assert result["expert_local_shape"][0] == (2 if mode == "fsdp" else 4)
        assert result["expert_shard_dims"] == ([0] if mode == "fsdp" else [])
