"""Four gloo ranks: FP8 (current tensorwise scaling) with FSDP2 over dp=2 and tensor parallelism
tp=2 trains like one process. This combination once desynchronised the TP ranks (FP8 weight
caches keyed on FSDP2's re-materialised weights: docs/multi_gpu.md, finding 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import train_checks
from train_checks import tiny_overrides

from mt_comm.testing import DistributedPool, PoolCache

# FP8 under TP quantizes every shard with the whole tensor's scale (the amax is MAX-reduced
# over TP), so the FP8 operands equal the single-process ones except where a high-precision
# input differs by its summation order (TP partial sums, gradient reduce-scatter) and a value
# then rounds to the neighbouring FP8 code. Such flips are rare and each moves a loss by far
# less than an E4M3 ulp (2^-3 relative) of one element's contribution: 1e-3 on the loss.
RTOL = 1e-3
# FP8 emulation makes a CPU step seconds long on four ranks; four steps already re-quantize the
# weights FSDP2 re-materialises after three updates.
FP8 = {"fp8": "tensorwise", "trainer.max_steps": 4, "trainer.eval_interval": 4}


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=4)


def test_fp8_fsdp_tp2_matches_single_process(pool, kjv_data: Path, tmp_path: Path) -> None:
    single = train_checks.run_losses(tiny_overrides(kjv_data, **FP8), tmp_path / "single")
    overrides = tiny_overrides(
        kjv_data, **FP8, **{"parallel": "tp2", "parallel.data_parallel": "fsdp"}
    )
    per_rank = pool.run(train_checks.run_losses, overrides, tmp_path / "fsdp_tp2")
    assert all(losses == per_rank[0] for losses in per_rank)
    assert per_rank[0] == pytest.approx(single, rel=RTOL)
    assert per_rank[0][-1] < per_rank[0][0]  # it trains
