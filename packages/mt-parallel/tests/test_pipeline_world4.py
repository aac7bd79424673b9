"""Pipeline parallelism on 4 gloo ranks (a pool shared across modules): every schedule at pp=4, and
pp=2 composed with data parallelism (dp=2) and with tensor + sequence parallelism (tp=2),
each against one process running the whole model (float64); at pp=4 the micro-batch chunks
whose activations a rank holds at once peak exactly where the simulator says; under FSDP2 at
pp=2 × dp=2 an embedding the first and last chunks share on one rank (ZBV, DualPipeV) is
gathered and reduced once per step and trains as one process."""

from __future__ import annotations

import pipeline_checks as checks
import pytest
from parallel_tolerances import FP32_VS_FP64, FP64_VS_FP64, assert_close
from test_pipeline_world2 import check, chunks_of

from mt_comm.testing import DistributedPool, PoolCache
from mt_parallel.pipeline import (
    SCHEDULES,
    chunks_per_rank,
    minimum_microbatches,
    schedule_actions,
    simulate,
)


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=4)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_pp4_schedule_matches_one_process(pool: DistributedPool, schedule: str) -> None:
    microbatches = minimum_microbatches(schedule, 4, chunks_of(schedule)) + 1  # odd for most
    if schedule == "interleaved_1f1b":
        microbatches = 8  # rounds of pp micro-batches
    results = pool.run(
        checks.pipeline_lm, schedule=schedule, microbatches=microbatches,
        chunks=chunks_of(schedule),
    )  # fmt: skip
    check(results, microbatches)
    # The activations held at once on each rank are the simulator's peak, exactly.
    v = chunks_per_rank(schedule, chunks_of(schedule))
    order = schedule_actions(schedule, 4, microbatches, v)
    peaks = simulate(order, 4 * v, chunks_per_rank=v).peak_activations
    for result in results:
        assert result["peak_in_flight"] == peaks[result["pp_rank"]], (result["pp_rank"], peaks)
    assert sorted(s for r in results for s in r["stages"]) == list(
        range(4 * (2 if schedule in ("interleaved_1f1b", "zbv", "dualpipev") else 1))
    )


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble", "zbv"])
def test_pp2_with_dp2(pool: DistributedPool, schedule: str) -> None:
    """Gradients averaged over dp after the schedule (the flat all-reduce runs in fp32)."""
    results = pool.run(checks.pipeline_lm, schedule=schedule, microbatches=4, dp=2)
    check(results, 4, FP32_VS_FP64, replicas=2)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "dualpipev"])
def test_pp2_with_tp2_and_sequence_parallel(pool: DistributedPool, schedule: str) -> None:
    results = pool.run(
        checks.pipeline_lm, schedule=schedule, microbatches=4, tp=2, sp=True,
        chunks=chunks_of(schedule),
    )  # fmt: skip
    check(results, 4, replicas=2)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_pp2_with_tp2_and_sequence_parallel_defers_on_older_torch(
    pool: DistributedPool, moe: bool
) -> None:
    """ZBV at tp=2 with sequence parallelism where torch's split backward is wrong: the parallel
    linears' weight gradients, queued for W from the all-gathered input and the local weight
    shard, give one process's gradients; each linear defers once per micro-batch. With MoE
    layers the routers' weight gradients, each rank's on its own tokens, are summed over TP
    when W runs them (once: one process's gradients still), and so are the bf16 experts'; no
    GEMM weight stays at I, so nothing warns."""
    results = pool.run(
        checks.pipeline_lm, schedule="zbv", microbatches=4, tp=2, sp=True, moe=moe,
        whole_backward_at_i=True,
    )  # fmt: skip
    check(results, 4, replicas=2)
    for r in results:
        assert r["deferred"] == 4 * r["sink_layers"] > 0, r
    assert not any(r["warned_split"] for r in results), results
    if moe:
        assert all(r["total_loss_error"] < 1e-6 for r in results)  # as in test_pipeline_world2


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_shared_embedding_under_fsdp2_on_the_first_and_last_chunks_rank(
    pool: DistributedPool, schedule: str
) -> None:
    """pp=2 × dp=2 under FSDP2, the first and last chunks (both running the embedding) on pp
    rank 0: the embedding is an FSDP2 unit of its own. Three float64 AdamW steps equal one
    process running all the micro-batches (first step's losses, gradients averaged over dp
    and clipped norm; the final embedding), and in every step the unit is all-gathered once
    and its gradient, summed over both chunks, reduce-scattered once."""
    results = pool.run(
        checks.shared_embedding_step, schedule=schedule, steps=3, data_parallel="fsdp", dp=2
    )
    for result in results:
        assert_close({"grads": result["grads"]}, FP64_VS_FP64)
        assert result["norm"] < FP64_VS_FP64 and result["embedding"] < FP64_VS_FP64
    last = [r for r in results if r["holds_last"]]
    assert len(last) == 2 and all(r["losses"] and max(r["losses"]) < FP64_VS_FP64 for r in last)
    holders = [r for r in results if r["holds_embedding"]]
    assert holders == last and all(r["copy_marked"] == [] for r in results)
    for result in holders:
        assert result["shared_units"] == ["FSDPVocabParallelEmbedding"]
        assert result["shared_unit_work"] == [{"gathers": 1, "reductions": 1}] * 3
    assert all(r["shared_units"] == [] for r in results if not r["holds_embedding"])
