"""dp=2·cp=2·tp=2 on 8 gloo ranks: every group, and FP8 gathers on the largest world."""

from __future__ import annotations

import comm_checks
import pytest
import torch

from mt_comm import ParallelDims
from mt_comm.testing import DistributedPool


@pytest.fixture(scope="module")
def pool():
    # Not from distributed_pools: no other module runs 8 ranks, and 8 idle ranks kept until the
    # session ends would hold about 3 GB (about 400 MB each) beside the shared pools.
    with DistributedPool(world_size=8) as pool:
        yield pool


def test_dp2_cp2_tp2(pool: DistributedPool) -> None:
    reports = pool.run(comm_checks.layout, dp=2, cp=2, tp=2, ep=2)
    dims = ParallelDims(8, dp=2, cp=2, tp=2, ep=2)
    explicit = {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "tp_cp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "ep": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "edp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    }
    for dim, groups in explicit.items():
        assert dims.group_ranks(dim) == groups, dim
    for report in reports:
        rank = report["rank"]
        for dim, groups in explicit.items():
            (members,) = [group for group in groups if rank in group]
            assert report[dim]["ranks"] == members
            assert report[dim]["gathered"] == members
            assert report[dim]["sum"] == float(sum(members))
            assert report[dim]["group_rank"] == members.index(rank)


def test_fp8_all_gather_is_bit_exact_on_8_ranks(pool: DistributedPool) -> None:
    results = pool.run(comm_checks.fp8_round_trip, seed=11)
    for dtype in ("torch.float8_e4m3fn", "torch.float8_e5m2"):
        expected = torch.cat([r[f"{dtype}-local"] for r in results], dim=1)
        for result in results:
            assert torch.equal(result[f"{dtype}-gathered"], expected)
