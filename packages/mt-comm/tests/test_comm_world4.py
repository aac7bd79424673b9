"""Parallel groups and collectives on 4 gloo ranks (a pool shared across modules), and the pool's
own guarantees: sharing, state put back after every function, dead ranks replaced."""

from __future__ import annotations

import os

import comm_checks
import pytest
import torch

import mt_comm.testing
from mt_comm.testing import DistributedPool, PoolCache


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=4)


def _check_report(reports: list[dict], expected: dict[str, list[list[int]]]) -> None:
    for report in reports:
        rank = report["rank"]
        for dim, groups in expected.items():
            (members,) = [group for group in groups if rank in group]
            entry = report[dim]
            assert entry["ranks"] == members, (rank, dim)
            assert entry["size"] == len(members)
            assert entry["rank"] == entry["group_rank"] == members.index(rank)
            assert entry["sum"] == float(sum(members)), (rank, dim)
            assert entry["gathered"] == members, (rank, dim)


def test_dp2_tp2(pool: DistributedPool) -> None:
    reports = pool.run(comm_checks.layout, dp=2, tp=2)
    _check_report(
        reports,
        {
            "tp": [[0, 1], [2, 3]],
            "dp": [[0, 2], [1, 3]],
            "cp": [[0], [1], [2], [3]],
            "pp": [[0], [1], [2], [3]],
            "dp_cp": [[0, 2], [1, 3]],
            "mp": [[0, 1], [2, 3]],
            "world": [[0, 1, 2, 3]],
        },
    )


def test_pp2_tp2(pool: DistributedPool) -> None:
    reports = pool.run(comm_checks.layout, dp=1, pp=2, tp=2)
    _check_report(
        reports,
        {
            "tp": [[0, 1], [2, 3]],
            "pp": [[0, 2], [1, 3]],
            "dp": [[0], [1], [2], [3]],
            "mp": [[0, 1, 2, 3]],
        },
    )
    by_rank = {r["rank"]: r for r in reports}
    assert (by_rank[0]["pp_prev"], by_rank[0]["pp_next"]) == (None, 2)
    assert (by_rank[3]["pp_prev"], by_rank[3]["pp_next"]) == (1, None)


def test_dp4_ep2(pool: DistributedPool) -> None:
    reports = pool.run(comm_checks.layout, dp=4, ep=2)
    _check_report(
        reports,
        {
            "dp": [[0, 1, 2, 3]],
            "ep": [[0, 1], [2, 3]],
            "edp": [[0, 2], [1, 3]],
            "tp": [[0], [1], [2], [3]],
        },
    )


def test_collectives_on_a_subgroup(pool: DistributedPool) -> None:
    results = pool.run(comm_checks.collectives_on_tp_group)
    import torch

    for rank, result in enumerate(results):
        pair = [rank - rank % 2, rank - rank % 2 + 1]  # this rank's tp group
        tp_rank = rank % 2
        summed = sum(torch.arange(8.0).reshape(2, 4) + 10 * r for r in pair)
        assert result["scattered"] == summed[:, 2 * tp_rank : 2 * tp_rank + 2].flatten().tolist()
        assert result["gathered"] == summed.flatten().tolist()
        assert result["max"] == [float(pair[1])]
        assert result["avg"] == [sum(pair) / 2]
        assert result["started_sum"] == [float(sum(pair))]
        assert result["started_avg"] == [sum(pair) / 2]
        assert result["all_to_all"] == [pair[0] * 10.0 + tp_rank, pair[1] * 10.0 + tp_rank]
        assert result["broadcast"] == [float(pair[0])]


def test_uneven_all_to_all(pool: DistributedPool) -> None:
    results = pool.run(comm_checks.uneven_all_to_all)
    for rank, rows in enumerate(results):
        assert rows == [float(peer) for peer in range(4) for _ in range(peer + 1)], rank


def test_fp8_all_gather_is_bit_exact(pool: DistributedPool) -> None:
    import torch

    results = pool.run(comm_checks.fp8_round_trip, seed=3)
    for dtype in ("torch.float8_e4m3fn", "torch.float8_e5m2"):
        expected = torch.cat([r[f"{dtype}-local"] for r in results], dim=1)
        for rank, result in enumerate(results):
            assert torch.equal(result[f"{dtype}-gathered"], expected), (dtype, rank)
            assert torch.equal(result[f"{dtype}-broadcast"], results[0][f"{dtype}-local"])
    for rank, result in enumerate(results):
        sent_by_previous = (torch.arange(16, dtype=torch.float32) + (rank - 1) % 4).to(
            torch.float8_e4m3fn
        )
        assert torch.equal(result["ring_received"], sent_by_previous.view(torch.uint8))
        assert "FP8 has no arithmetic" in result["reduce_error"]


def test_pipeline_neighbours_exchange(pool: DistributedPool) -> None:
    assert pool.run(comm_checks.pipeline_send_recv) == [[0.0] * 3, [1.0] * 3, [0.0] * 3, [1.0] * 3]


def test_failures_report_the_rank_and_the_pool_recovers(pool: DistributedPool) -> None:
    with pytest.raises(
        AssertionError, match=r"(?s)failed on ranks \[0, 1, 2, 3\].*must equal the world size 4"
    ):
        pool.run(comm_checks.layout, dp=2, tp=4)
    assert [r["rank"] for r in pool.run(comm_checks.layout, dp=4)] == [0, 1, 2, 3]


def test_a_rank_stuck_in_a_collective_is_reported_and_the_pool_restarts(
    pool: DistributedPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ranks 1-3 wait in the all-reduce until the collective timeout (90 s), so they answer
    # within no grace period: 1 s instead of the default 10 s gives the same report sooner.
    monkeypatch.setattr(mt_comm.testing, "FAILURE_GRACE_S", 1.0)
    with pytest.raises(TimeoutError, match=r"ranks \[1, 2, 3\] gave no result within 1 s"):
        pool.run(comm_checks.fail_on_rank_zero_then_all_reduce)
    assert [r["rank"] for r in pool.run(comm_checks.layout, dp=4)] == [0, 1, 2, 3]


def test_device_mesh_matches_the_parallel_state(pool: DistributedPool) -> None:
    for result in pool.run(comm_checks.device_mesh_groups):
        for dim in ("pp", "dp", "cp", "tp"):
            assert sorted(result[dim]) == result[f"state_{dim}"], dim


def test_modules_asking_for_the_same_setting_share_one_pool(
    pool: DistributedPool, distributed_pools: PoolCache
) -> None:
    assert distributed_pools.get(world_size=4) is pool


def test_the_worker_puts_back_the_process_state_after_every_function(
    pool: DistributedPool,
) -> None:
    before = pool.run(comm_checks.process_state)
    pool.run(comm_checks.change_process_state)
    after = pool.run(comm_checks.process_state)
    for was, now in zip(before, after, strict=True):
        assert torch.equal(was.pop("torch_draw"), now.pop("torch_draw"))
        assert was == now


def test_a_rank_that_died_between_functions_is_replaced(pool: DistributedPool) -> None:
    pids = pool.run(comm_checks.exit_after_answering)
    for process in pool._processes:  # wait for the exits (a private list, this module's own)
        process.join(timeout=30)
    new_pids = pool.run(os.getpid)
    assert not set(pids) & set(new_pids)
    assert [r["rank"] for r in pool.run(comm_checks.layout, dp=4)] == [0, 1, 2, 3]
