"""Pipeline parallelism in the trainer on two gloo ranks (pp=2): every schedule's loss curve
and greedy sample match one process; checkpoints are written per stage, resume bit for bit at
pp=2 (dropout on, rewind off), load at pp=1 and back; ZeRO-1 and the model's validation work.
A pool shared across modules; the single-process references run in this process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import train_checks
from train_checks import rewind_overrides, tiny_overrides

from mt_comm.testing import DistributedPool, PoolCache
from mt_train.hf_checkpoints import load_model

# fp32 on CPU. A pipelined step runs the same operations in the same order as the pp=1
# accumulation loop (each chunk's forward and backward, gradients accumulated per micro-batch
# in order); only the gradient norm sums its squares over two ranks in another order, which
# can move the clip coefficient by an ulp. Observed: equal to the last bit; 1e-6 is the bound.
RTOL = 1e-6
# Four layers (one per chunk for the two-chunk schedules), four micro-batches per step.
PIPELINE = {"model.n_layers": 4, "trainer.micro_batch_size": 2}
CONSTANT = {"scheduler": "constant"}
SCHEDULES = {
    "gpipe": {},
    "1f1b": {},
    "interleaved_1f1b": {"parallel.pp_chunks": 2},
    "zero_bubble": {},
    "zbv": {},
    "dualpipev": {},
}


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=2)


@pytest.fixture(scope="module")
def reference(kjv_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    overrides = tiny_overrides(kjv_data, **PIPELINE, **{"trainer.sample_tokens": 12})
    return train_checks.run_summary(overrides, tmp_path_factory.mktemp("single"))


def pp2(schedule: str = "1f1b", **extra: object) -> dict:
    """The ``parallel=pp2`` preset with ``schedule``."""
    return {**PIPELINE, "parallel": "pp2", "parallel.pp_schedule": schedule,
            **SCHEDULES[schedule], **extra}  # fmt: skip


# The trainer's pipeline step is the same for every schedule; what differs is the schedule
# (mt-parallel's test_pipeline_world2.py::test_schedule_matches_one_process checks each in
# float64) and the stage layout. gpipe lays out as 1f1b and zbv as dualpipev, which stay here.
SLOW_SCHEDULES = {"gpipe", "zbv"}


@pytest.mark.parametrize(
    "schedule",
    [
        pytest.param(name, marks=pytest.mark.slow) if name in SLOW_SCHEDULES else name
        for name in SCHEDULES
    ],
)
def test_schedule_matches_single_process(
    schedule: str, pool, kjv_data: Path, reference: dict, tmp_path: Path
) -> None:
    overrides = tiny_overrides(kjv_data, **pp2(schedule, **{"trainer.sample_tokens": 12}))
    per_rank = pool.run(train_checks.run_summary, overrides, tmp_path)
    assert per_rank[0] == per_rank[1]  # both stages report the global loss, same sample
    assert per_rank[0]["losses"] == pytest.approx(reference["losses"], rel=RTOL)
    assert per_rank[0]["sample"] == reference["sample"]
    step = tmp_path / "checkpoints" / "step-00000008"
    assert (step / "rank-00000.safetensors").is_file()
    assert (step / "rank-00001.safetensors").is_file()


def test_zero1_under_pp_matches_single_process(
    pool, kjv_data: Path, reference: dict, tmp_path: Path
) -> None:
    """ZeRO-1 over one data-parallel rank per stage, its norm summed over both stages."""
    overrides = tiny_overrides(
        kjv_data, **pp2("zero_bubble", **{"parallel.data_parallel": "zero1"})
    )
    per_rank = pool.run(train_checks.run_losses, overrides, tmp_path)
    assert per_rank[0] == pytest.approx(reference["losses"], rel=RTOL)


def test_pp2_checkpoint_resumes_exactly_and_loads_at_pp1(
    pool, kjv_data: Path, tmp_path: Path
) -> None:
    # The uninterrupted run's own step-8 checkpoint is the one resumed: under the constant
    # schedule a run stopped at step 8 would have written the same one.
    common = {**CONSTANT, "model.dropout": 0.1, "trainer.max_steps": 12}
    full = pool.run(
        train_checks.run_losses,
        tiny_overrides(kjv_data, **pp2("zbv", **common)),
        tmp_path / "full",
    )[0]
    step = tmp_path / "full" / "checkpoints" / "step-00000008"
    manifest = (step / "manifest.json").read_text()
    assert "model/layers.3.attention.q_proj.weight" in manifest and "model/embed.weight" in manifest
    resumed = pool.run(
        train_checks.run_losses,
        tiny_overrides(kjv_data, **pp2("zbv", **common, **{"checkpoint.resume": step})),
        tmp_path / "resumed",
    )
    assert resumed[0] == resumed[1] == full[8:]  # exact float equality, step by step


@pytest.fixture(scope="module")
def uninterrupted(kjv_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list, Path]:
    """One process, 12 steps under the constant schedule: its losses and its checkpoints'
    folder (steps 4, 8 and 12; the step-8 one equals that of a run stopped at step 8)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    overrides = tiny_overrides(kjv_data, **PIPELINE, **CONSTANT, **{"trainer.max_steps": 12})
    return train_checks.run_losses(overrides, out), out / "checkpoints"


def test_pp2_checkpoint_loads_at_pp1(
    pool, kjv_data: Path, uninterrupted: tuple[list, Path], tmp_path: Path
) -> None:
    """Stage checkpoints are joined by name in one process, which continues the curve."""
    pool.run(
        train_checks.run_losses,
        tiny_overrides(kjv_data, **pp2("dualpipev", **CONSTANT, **{"trainer.max_steps": 8})),
        tmp_path / "split",
    )
    # mt-convert's loader joins the stage files too (a strict load of every tensor).
    exported = load_model(tmp_path / "split" / "checkpoints")
    assert torch.isfinite(exported(torch.arange(8)[None])).all()
    resume = {"trainer.max_steps": 12, "checkpoint.resume": "auto"}
    at_pp1 = train_checks.run_losses(
        tiny_overrides(kjv_data, **PIPELINE, **CONSTANT, **resume), tmp_path / "split"
    )
    assert at_pp1 == pytest.approx(uninterrupted[0][8:], rel=RTOL)


def test_pp1_checkpoint_loads_at_pp2(
    pool, kjv_data: Path, uninterrupted: tuple[list, Path], tmp_path: Path
) -> None:
    losses, checkpoints = uninterrupted
    resume = {"trainer.max_steps": 12, "checkpoint.resume": checkpoints / "step-00000008"}
    resumed = pool.run(
        train_checks.run_losses,
        tiny_overrides(kjv_data, **pp2("1f1b", **CONSTANT, **resume)),
        tmp_path,
    )
    assert resumed[0] == pytest.approx(losses[8:], rel=RTOL)


# FP8 emulation makes a CPU step of the tiny model take seconds: three steps, no checkpoints.
FP8_SHORT = {"trainer.max_steps": 3, "trainer.eval_interval": 3, "trainer.eval_batches": 1,
             "checkpoint.enabled": False}  # fmt: skip


@pytest.mark.slow  # the FP8 sink path is covered in the default tier by mt-parallel's world-2 test
@pytest.mark.parametrize(
    "extra",
    [{"fp8": "delayed", "parallel.recompute": "full", **FP8_SHORT}],
    ids=["fp8-delayed-recompute"],
)
def test_fp8_and_recompute_under_zero_bubble_match_single_process(
    extra: dict, pool, kjv_data: Path, tmp_path: Path
) -> None:
    """FP8 weight-gradient GEMMs deferred to W (the sink), delayed scaling's amax history and
    full recompute inside the chunks: the same curve as one process with the same options."""
    single = train_checks.run_losses(tiny_overrides(kjv_data, **PIPELINE, **extra), tmp_path / "1")
    per_rank = pool.run(
        train_checks.run_losses,
        tiny_overrides(kjv_data, **pp2("zero_bubble", **extra)),
        tmp_path / "pp2",
    )
    assert per_rank[0] == per_rank[1]
    assert per_rank[0] == pytest.approx(single, rel=RTOL)


@pytest.mark.parametrize(
    ("fault", "snapshots"),
    [
        ("nan_at_step", True),
        ("nan_at_step", False),
        # nan-memory takes the same path (a fault factor on the last stage's loss, restored
        # from memory), test_schedule_matches_single_process that every stage sees the global
        # loss, test_train_rewind.py the spike detector.
        pytest.param("spike_at_step", True, marks=pytest.mark.slow),
    ],
    ids=["nan-memory", "nan-disk", "loss-spike-memory"],
)
def test_rewind_restores_the_same_step_on_every_stage(
    fault: str, snapshots: bool, pool, kjv_data: Path, tmp_path: Path
) -> None:
    """A NaN or a spike in the last stage's loss at step 16 (24 steps, checkpoints every 4,
    stable after 4): both stages see it (the loss, with its fault factor, is summed over the
    pipeline, the norm over tp×pp), agree, restore step 8 from memory or from their own stage
    files, and end identical."""
    overrides = rewind_overrides(
        kjv_data, **pp2("1f1b"), **{"trainer.max_steps": 24, "trainer.eval_interval": 24,
        f"fault.{fault}": 16, "fault.rank": 1, "rewind.memory_snapshots": snapshots},
    )  # fmt: skip
    results = pool.run(train_checks.run_rewind, overrides, tmp_path)
    assert [(r["steps"], r["rewinds"]) for r in results] == [(24, 1), (24, 1)]
    restored = [[e["restored"] for e in r["events"] if e["event"] == "rewind"] for r in results]
    assert restored[0] == restored[1] and restored[0][0]["step"] == 8
    assert restored[0][0]["source"] == ("memory" if snapshots else "disk")
    assert results[0]["losses"] == results[1]["losses"]
