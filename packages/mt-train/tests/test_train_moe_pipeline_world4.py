"""MoE models under pipeline and expert parallelism on four gloo ranks (pp=2 × dp=2, ep=2
inside each stage): the loss curve and the global-batch MaxVio of every router (counts summed
over each stage's dp×cp group, then met over the pipeline) equal one process's; experts are
reduced over their expert-data-parallel group after the schedule (by ZeRO-1 at its step, by
FSDP2's reduce-scatter at the chunk's last backward), the rest over dp×cp. One pool for the
module."""

from __future__ import annotations

from pathlib import Path

import pytest
import train_checks
from test_train_moe_pipeline import DEEPSEEK, MOE, overrides

from mt_comm.testing import DistributedPool, PoolCache

# fp32 on the CPU; dp=2 × ep=2 adds gradient all-reduces and the experts' rows in another order
# than one process (a few ulps per step, as in test_train_moe.py's ep=2 test); eight AdamW steps
# keep that far below 1e-4.
RTOL = 1e-4
PP_EP = {"parallel": "pp2", "parallel.ep": 2}


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=4)


def check(pool: DistributedPool, data: Path, tmp_path: Path, model: dict, **layout: object) -> None:
    single = train_checks.run_logged(overrides(data, **model), tmp_path / "single")
    per_rank = pool.run(
        train_checks.run_logged, overrides(data, **model, **{**PP_EP, **layout}), tmp_path / "run"
    )
    assert all(r["losses"] == per_rank[0]["losses"] for r in per_rank)
    assert per_rank[0]["losses"] == pytest.approx(single["losses"], rel=RTOL)
    rows, reference = (
        [r for r in run["rows"] if r["kind"] == "train"] for run in (per_rank[0], single)
    )
    assert len(rows) == len(reference) == 8
    for row, ref in zip(rows, reference, strict=True):
        names = [n for n in ref if n.startswith("moe_max_vio_global")]
        assert len(names) >= 3  # the worst and each router: at least one per stage
        assert {n: row[n] for n in names} == pytest.approx({n: ref[n] for n in names}, rel=RTOL)


# fsdp in the full tier; the default tier runs FSDP2 with MoE layers under pp in
# test_train_pipeline_world4.py's DeepSeek-V3 test (ep = 1).
@pytest.mark.parametrize("data_parallel", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_mixtral_pp2_ep2_dp2_matches_one_process(
    pool: DistributedPool, kjv_data: Path, tmp_path: Path, data_parallel: str
) -> None:
    # fsdp: each chunk's experts are their own FSDP2 unit over the edp group, the rest over dp.
    check(pool, kjv_data, tmp_path, MOE, **{"parallel.data_parallel": data_parallel})


def test_mixtral_pp2_ep2_dp2_under_overlapped_dualpipev_matches_one_process(
    pool: DistributedPool, kjv_data: Path, tmp_path: Path
) -> None:
    # DualPipeV's overlapped pairs run their halves interleaved at the experts' all-to-alls
    # (parallel.pp_overlap, on by default at ep > 1); four layers for its two chunks per rank,
    # four micro-batches per rank for its 2·pp minimum.
    model = {**MOE, "model.n_layers": 4, "trainer.global_batch_size": 16}
    check(pool, kjv_data, tmp_path, model, **{"parallel.pp_schedule": "dualpipev"})


@pytest.mark.slow
def test_deepseek_pp2_ep2_dp2_under_zero_bubble_matches_one_process(
    pool: DistributedPool, kjv_data: Path, tmp_path: Path
) -> None:
    check(
        pool,
        kjv_data,
        tmp_path,
        {**DEEPSEEK, "model.n_layers": 3},
        **{"parallel.pp_schedule": "zero_bubble"},
    )


@pytest.mark.slow
def test_mixtral_pp2_tp2_with_sequence_parallel_matches_one_process(
    pool: DistributedPool, kjv_data: Path, tmp_path: Path
) -> None:
    # pp=2 × tp=2 with SP (dp=1, so ep=1): each stage's routers see their TP rank's half of the
    # sequence; the carried aux losses and the global MaxVio are the whole sequences'.
    layout = {"parallel.tp": 2, "parallel.sequence_parallel": "true", "parallel.ep": 1}
    check(pool, kjv_data, tmp_path, MOE, **layout)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["zero1", "none"])
def test_mixtral_pp2_ep2_dp2_under_zero1_and_none_matches_one_process(
    pool: DistributedPool, kjv_data: Path, tmp_path: Path, mode: str
) -> None:
    # Slow: the default tier checks ep=2 under zero1 and none at pp=1
    # (test_train_moe_data_parallel_world4.py) and this layout under ddp above. After the
    # schedule, ZeRO-1 reduce-scatters the experts over edp; none reduces them like ddp.
    check(pool, kjv_data, tmp_path, MOE, **{"parallel.data_parallel": mode})
