"""Pipeline parallelism in the trainer on four gloo ranks: pp=2 with tp=2 (sequence parallel)
and pp=2 with dp=2 (DDP's reduction, started per chunk inside the schedule, ZeRO-1, FSDP2)
match one process; a single-process
checkpoint resumes at pp=4, FSDP2 and ZeRO-1 ones at pp=2 resume exactly and load in one
process;
DeepSeek-V3 with MTP (the embedding shared by the first and last stages) trains at pp=2 × dp=2
under FSDP2 and, with the first and last chunks on one rank, under DualPipeV as one process;
with them on one rank under FSDP2 (the embedding its own FSDP2 unit) it trains under ZBV as
one process and resumes exactly, and its gradients under ZBV and DualPipeV equal one
process's in float64. A pool shared across modules; the single-process references run in
this process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import train_checks
from mtp_checks import FP64_BOUND, mtp_pp_step
from test_train_deepseek_v3_world2 import overrides as deepseek_overrides
from test_train_pipeline import CONSTANT, PIPELINE
from train_checks import tiny_overrides

from mt_comm.testing import DistributedPool, PoolCache
from mt_train.checkpoint.state import MOMENTS

# fp32 on CPU. TP splits the attention/MLP dot products and the vocabulary, DP averages the
# gradients with an all-reduce: both reorder sums (a few ulps per step, as the pp=1 layouts of
# test_train_parallel.py); 8 AdamW steps keep the drift far below 1e-4.
RTOL = 1e-4


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=4)


@pytest.fixture(scope="module")
def reference(kjv_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    overrides = tiny_overrides(kjv_data, **PIPELINE, **{"trainer.sample_tokens": 12})
    return train_checks.run_summary(overrides, tmp_path_factory.mktemp("single"))


@pytest.mark.parametrize(
    "layout",
    [
        {"parallel": "tp2", "parallel.pp_schedule": "1f1b"},
        {"parallel.pp_schedule": "zbv"},
        {"parallel": "zero1", "parallel.pp_schedule": "interleaved_1f1b", "parallel.pp_chunks": 2},
        {"parallel": "cp2", "parallel.pp_schedule": "dualpipev"},
    ],
    ids=[
        "pp2-tp2-sp-1f1b",
        "pp2-dp2-zbv",
        "pp2-dp2-zero1-interleaved",
        "pp2-cp2-dualpipev",
    ],
)
def test_pp2_composed_matches_single_process(
    layout: dict, pool, kjv_data: Path, reference: dict, tmp_path: Path
) -> None:
    overrides = tiny_overrides(
        kjv_data, **PIPELINE, **layout, **{"parallel.pp": 2, "trainer.sample_tokens": 12}
    )
    per_rank = pool.run(train_checks.run_summary, overrides, tmp_path)
    assert all(r == per_rank[0] for r in per_rank)
    assert per_rank[0]["losses"] == pytest.approx(reference["losses"], rel=RTOL)
    assert per_rank[0]["sample"] == reference["sample"]


def test_ddp_averages_a_chunk_while_the_rank_runs_its_other_chunk(
    pool, kjv_data: Path, tmp_path: Path
) -> None:
    """ZBV puts two chunks on each rank: the first finished chunk's dp×cp average starts at its
    REDUCE_GRAD action, before the rank's last backward (the pp2-dp2-zbv case above shows the
    losses are still one process's)."""
    overrides = tiny_overrides(
        kjv_data, **PIPELINE, **{"parallel.pp": 2, "parallel.pp_schedule": "zbv"}
    )
    for events in pool.run(train_checks.gradient_average_timeline, overrides, tmp_path):
        backwards = [i for i, (kind, _) in enumerate(events) if kind == "backward"]
        averages = [(i, stage) for i, (kind, stage) in enumerate(events) if kind == "average"]
        assert sorted(stage for _, stage in averages) == sorted({events[i][1] for i in backwards})
        assert averages[0][0] < backwards[-1], events


def test_ddp_buckets_start_inside_the_last_backward(pool, kjv_data: Path, tmp_path: Path) -> None:
    """1F1B at pp2 × dp2 with ``ddp`` buckets of 16 KiB: every rank starts some of its chunk's
    bucket averages inside the chunk's last backward, one bucket after another before that
    backward returns, and the step's weights are bit for bit
    those of averaging everything at ``REDUCE_GRAD`` (each element's average is the same sum).
    """
    overrides = tiny_overrides(
        kjv_data, **PIPELINE, **{"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}
    )
    runs = {
        in_backward: pool.run(
            train_checks.bucketed_average_timeline,
            overrides,
            tmp_path / str(in_backward),
            16 * 1024,
            in_backward,
        )
        for in_backward in (True, False)
    }
    for bucketed, at_reduce in zip(runs[True], runs[False], strict=True):
        assert bucketed["params"].keys() == at_reduce["params"].keys()
        assert all(torch.equal(bucketed["params"][n], p) for n, p in at_reduce["params"].items())
        events = bucketed["events"]
        (last,), (end,) = ([i for i, e in enumerate(events) if e[0] == k] for k in ("last", "end"))
        inside = [e for e in events[last:end] if e[0] == "bucket"]
        assert len(inside) >= 2, events
        # without the hooks every bucket starts after the last backward returned; the same
        # parameters are averaged either way
        late = at_reduce["events"]
        end = next(i for i, e in enumerate(late) if e[0] == "end")
        assert not [e for e in late[:end] if e[0] == "bucket"], late
        assert sum(n for kind, n in events if kind == "bucket") == sum(
            n for kind, n in late if kind == "bucket"
        )


def test_single_process_checkpoint_resumes_at_pp4(pool, kjv_data: Path, tmp_path: Path) -> None:
    # The uninterrupted run's step-8 checkpoint is resumed: under the constant schedule a run
    # stopped at step 8 would have written the same one.
    single = {**PIPELINE, **CONSTANT, "trainer.max_steps": 12}
    uninterrupted = train_checks.run_losses(tiny_overrides(kjv_data, **single), tmp_path / "full")
    step = tmp_path / "full" / "checkpoints" / "step-00000008"
    resume = {"checkpoint.resume": step, "parallel.pp": 4}
    resumed = pool.run(
        train_checks.run_losses, tiny_overrides(kjv_data, **single, **resume), tmp_path / "pp4"
    )
    assert resumed[0] == pytest.approx(uninterrupted[8:], rel=RTOL)


# ZeRO-1's moment pieces take the same manifest path as FSDP2's (full tier only).
@pytest.mark.parametrize("data_parallel", ["fsdp", pytest.param("zero1", marks=pytest.mark.slow)])
def test_sharded_pp2_trains_resumes_exactly_and_loads_in_one_process(
    pool, kjv_data: Path, tmp_path: Path, data_parallel: str
) -> None:
    # Zero bubble: torch's runtime all-gathers each FSDP2 chunk before its first action and
    # reduce-scatters after its last W, with the split I/W backward in between. Both modes
    # save pieces on the second stage, whose shapes rank 0's manifest must list.
    single = {**PIPELINE, **CONSTANT, "trainer.checkpoint_interval": 4}
    layout = {"parallel": data_parallel, "parallel.pp": 2, "parallel.pp_schedule": "zero_bubble"}
    reference = train_checks.run_losses(tiny_overrides(kjv_data, **single), tmp_path / "one")
    full = pool.run(
        train_checks.run_losses, tiny_overrides(kjv_data, **single, **layout), tmp_path / "full"
    )
    assert all(r == full[0] for r in full)
    assert full[0] == pytest.approx(reference, rel=RTOL)
    saved = {"checkpoint.resume": str(tmp_path / "full" / "checkpoints" / "step-00000004")}
    resumed = pool.run(
        train_checks.run_losses,
        tiny_overrides(kjv_data, **single, **layout, **saved),
        tmp_path / "resumed",
    )
    assert resumed[0] == full[0][4:]  # exact, step by step
    loaded = train_checks.run_losses(tiny_overrides(kjv_data, **single, **saved), tmp_path / "1")
    assert loaded == pytest.approx(full[0][4:], rel=RTOL)


# fsdp-dualpipev in the full tier: the default tier runs it in float64 through the pipeline
# step below, and the trainer under FSDP2 with ZBV's shared embedding in the resume test.
@pytest.mark.parametrize(
    ("data_parallel", "schedule"),
    [("fsdp", "1f1b"), ("ddp", "dualpipev"),
     pytest.param("fsdp", "dualpipev", marks=pytest.mark.slow)],
    ids=["fsdp-1f1b", "ddp-dualpipev", "fsdp-dualpipev"],
)  # fmt: skip
def test_deepseek_mtp_at_pp2_dp2_matches_one_process(
    data_parallel: str, schedule: str, pool, kjv_data: Path, tmp_path: Path
) -> None:
    """Under 1F1B the two copies of the embedding are FSDP2 shards alike on both stages, their
    gradients summed shard by shard after the schedule; under DualPipeV the first and last
    chunks share rank 0 and its one embedding (four chunks of one block, four micro-batches),
    under FSDP2 an FSDP2 unit of its own, reduced once after both chunks' backwards."""
    shape = {"trainer.micro_batch_size": 2}
    if schedule == "dualpipev":
        shape = {"trainer.micro_batch_size": 1, "model.n_layers": 4}
    job = deepseek_overrides(kjv_data, **shape)
    single = train_checks.run_losses(job, tmp_path / "single")
    layout = [
        "parallel=pp2", f"parallel.data_parallel={data_parallel}",
        f"parallel.pp_schedule={schedule}",
    ]  # fmt: skip
    per_rank = pool.run(train_checks.run_losses, job + layout, tmp_path / "run")
    assert all(r == per_rank[0] for r in per_rank)
    assert per_rank[0] == pytest.approx(single, rel=RTOL)


def test_deepseek_mtp_under_fsdp2_and_zbv_resumes_exactly_and_loads_in_one_process(
    pool, kjv_data: Path, tmp_path: Path
) -> None:
    """ZBV puts the first and last chunks, and the embedding both run (its own FSDP2 unit), on
    pp rank 0: four steps match one process; from the step-2 checkpoint (the embedding's
    FSDP2 shards written like any FSDP2 parameter's) a resumed run repeats steps 3-4 exactly
    at the same layout, and one process loads it."""
    job = deepseek_overrides(
        kjv_data, **{"model.n_layers": 4, "trainer.micro_batch_size": 2,
                     "trainer.max_steps": 4, "trainer.checkpoint_interval": 2},
    )  # fmt: skip
    layout = ["parallel=pp2", "parallel.data_parallel=fsdp", "parallel.pp_schedule=zbv"]
    single = train_checks.run_losses(job, tmp_path / "single")
    full = pool.run(train_checks.run_losses, job + layout, tmp_path / "full")
    assert all(r == full[0] for r in full)
    assert full[0] == pytest.approx(single, rel=RTOL)
    saved = [f"checkpoint.resume={tmp_path / 'full' / 'checkpoints' / 'step-00000002'}"]
    resumed = pool.run(train_checks.run_losses, job + layout + saved, tmp_path / "resumed")
    assert resumed[0] == full[0][2:]  # exact, step by step
    loaded = train_checks.run_losses(job + saved, tmp_path / "one")
    assert loaded == pytest.approx(full[0][2:], rel=RTOL)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_deepseek_mtp_under_fsdp2_with_first_and_last_chunks_on_one_rank_in_float64(
    schedule: str, pool
) -> None:
    """pp=2 × dp=2 under FSDP2, the first and last chunks (both embedding tokens) on pp rank 0,
    whose embedding is an FSDP2 unit of its own: two float64 AdamW steps through the trainer's
    pipeline step against one process running both dp ranks' micro-batches. The loss and
    every logged extra of each rank's micro-batches, every gradient (the embedding's summed
    over both chunks' backwards and averaged over dp, once) and the final embedding within
    FP64_BOUND (float64, the same operations in another summation order); the checkpoint
    writes the embedding and its AdamW state from the rank holding it."""
    per_rank = pool.run(mtp_pp_step, 1, schedule, dp=2, data_parallel="fsdp")
    holders = [r for r in per_rank if r["holds_mtp"]]
    assert len(holders) == 2 and all("embed.weight" in r["grads"] for r in holders)
    # Each holder writes its FSDP2 half of the embedding and of its AdamW moments, as for
    # any FSDP2 parameter (the checkpoint format is unchanged); the other ranks none.
    assert [r["written_embedding"] for r in per_rank if not r["holds_mtp"]] == [[], []]
    for half, result in zip(("0-1536", "1536-3072"), holders, strict=True):
        pieces = [f"model/embed.weight@elems{half}of3072", "optim/embed.weight/step"]
        pieces += [f"optim/embed.weight/{k}@elems{half}of3072" for k in MOMENTS]
        assert result["written_embedding"] == sorted(pieces)
    for result in per_rank:
        assert result["loss"] < FP64_BOUND
        assert set(result["extras"]) == set(result["reference_extras"])
        # The extras are summed in fp32 on both sides (logging precision), in the same order.
        worst = max(result["extras"].items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-6, worst
        worst = max(result["grads"].items(), key=lambda kv: kv[1])
        assert worst[1] < FP64_BOUND, worst
        assert result["copies_equal"] and result["embedding"] < FP64_BOUND
