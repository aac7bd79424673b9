"""Parallel dimensions: validation messages and the rank layout, without processes."""

from __future__ import annotations

import pytest

from mt_comm import ParallelDims


def test_world_size_must_match_the_product() -> None:
    with pytest.raises(ValueError, match=r"dp·cp·tp·pp = 2·1·2·1 = 4 must equal the world size 8"):
        ParallelDims(8, dp=2, tp=2)


def test_ep_must_divide_dp_times_cp() -> None:
    with pytest.raises(ValueError, match=r"ep=3 must divide dp·cp = 2·2 = 4"):
        ParallelDims(8, dp=2, cp=2, tp=2, ep=3)


@pytest.mark.parametrize("field", ["dp", "cp", "tp", "pp", "ep"])
def test_degrees_must_be_positive(field: str) -> None:
    with pytest.raises(ValueError, match=rf"parallel degree {field}=0 must be a positive integer"):
        ParallelDims(1, **{field: 0})


def test_infer_dp() -> None:
    assert ParallelDims.infer_dp(8, tp=2, pp=2).dp == 2
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by cp·tp·pp = 1·4·1 = 4"):
        ParallelDims.infer_dp(6, tp=4)


def test_tp_is_fastest_then_cp_dp_pp() -> None:
    dims = ParallelDims(16, dp=2, cp=2, tp=2, pp=2)
    assert dims.group_ranks("tp")[:2] == [[0, 1], [2, 3]]
    assert dims.group_ranks("cp")[0] == [0, 2]
    assert dims.group_ranks("dp")[0] == [0, 4]
    assert dims.group_ranks("pp")[0] == [0, 8]
    assert dims.group_ranks("dp_cp")[0] == [0, 2, 4, 6]
    c = dims.coordinates(13)  # 13 = ((1·2 + 1)·2 + 0)·2 + 1
    assert (c["pp"], c["dp"], c["cp"], c["tp"]) == (1, 1, 0, 1)


def test_every_dimension_partitions_the_world() -> None:
    dims = ParallelDims(8, dp=4, tp=2, ep=2)
    for dim in ("tp", "cp", "dp", "pp", "ep", "edp", "dp_cp", "tp_cp", "mp", "world"):
        groups = dims.group_ranks(dim)
        flat = sorted(rank for group in groups for rank in group)
        assert flat == list(range(8)), dim
        assert len({len(group) for group in groups}) == 1, dim


def test_expert_parallel_is_carved_out_of_dp() -> None:
    dims = ParallelDims(8, dp=4, tp=2, ep=2)
    # dp groups (fixed tp) are [0,2,4,6] and [1,3,5,7]; ep takes neighbours in dp.
    assert dims.group_ranks("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.group_ranks("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.edp == 2


def test_unknown_dimension() -> None:
    with pytest.raises(ValueError, match="unknown parallel dimension 'xp'"):
        ParallelDims(1).group_ranks("xp")
