"""The vision-language model on two gloo ranks: dp=2 and tp=2 (both towers' heads and MLPs
split, the projector too) train the digits captions as one process does, in fp32 and with
tensorwise FP8 on both towers; a checkpointed run resumes bit for bit on the CPU (sequence and
context parallel: test_train_vlm_sequence.py; pipeline parallel: test_train_vlm_pipeline.py).
A pool shared across modules; references run in this process."""

from __future__ import annotations

from pathlib import Path

import pytest
import train_checks

from mt_comm.testing import DistributedPool, PoolCache

pytest.importorskip("sklearn", reason="the vision extra: pip install 'mt-train[vision]'")

# fp32 on CPU; the layouts differ only in summation order (DDP's gradient all-reduce, TP's
# partial sums in the row-parallel linears and the vocab-parallel loss), which moves each loss
# by a few ulps per step; 8 AdamW steps keep that far below 1e-4 (as for the Llama layouts in
# test_train_parallel.py). Dropout off there: one process and dp ranks draw different masks.
RTOL = 1e-4
NO_DROPOUT = {"model.dropout": 0.0}


def vlm_overrides(data: Path, **extra: object) -> list[str]:
    base: dict[str, object] = {
        "model": "vlm_tiny",
        "data": "digits",
        "data.path": str(data),
        "trainer.max_steps": 8,
        "trainer.global_batch_size": 8,
        "trainer.micro_batch_size": 4,
        "trainer.log_interval": 4,
        "trainer.eval_interval": 8,
        "trainer.eval_batches": 2,
        "trainer.checkpoint_interval": 4,
        "logging.progress_bar": False,
        "scheduler.warmup_steps": 2,
        "checkpoint.async_save": False,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=2)


@pytest.fixture(scope="module")
def reference(digits: Path, tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    overrides = vlm_overrides(digits, **NO_DROPOUT)
    return train_checks.run_losses(overrides, tmp_path_factory.mktemp("single"))


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_layout_matches_single_process(
    layout: str, pool, digits: Path, reference: list[float], tmp_path: Path
) -> None:
    extra = {"parallel.tp": 2, **NO_DROPOUT} if layout == "tp2" else NO_DROPOUT
    per_rank = pool.run(train_checks.run_losses, vlm_overrides(digits, **extra), tmp_path)
    assert per_rank[0] == per_rank[1]  # every rank reports the global mean loss
    assert per_rank[0] == pytest.approx(reference, rel=RTOL)
    assert reference[-1] < reference[0]


def test_fp8_at_tp2_matches_fp8_at_tp1(pool, digits: Path, tmp_path: Path) -> None:
    # Tensorwise FP8 on both towers: under TP each sharded tensor's amax is MAX-reduced over
    # the tp group, so both layouts quantize with the same scales. The first step's loss agrees
    # as the fp32 layouts do; after it, fp32 summation-order differences (ulps) flip the E4M3
    # rounding of the few values that sit at a rounding boundary (a 2^-4 relative step each),
    # which moved the 8-step losses by up to 4.6e-4 relative here: bound 2e-3.
    fp8 = {"fp8": "tensorwise", "model.fp8_vision": True, **NO_DROPOUT}
    single = train_checks.run_losses(vlm_overrides(digits, **fp8), tmp_path / "single")
    per_rank = pool.run(
        train_checks.run_losses, vlm_overrides(digits, **fp8, **{"parallel.tp": 2}), tmp_path
    )
    assert per_rank[0] == per_rank[1]
    assert per_rank[0][0] == pytest.approx(single[0], rel=RTOL)
    assert per_rank[0] == pytest.approx(single, rel=2e-3)


def test_checkpoint_resumes_bit_for_bit(digits: Path, tmp_path: Path) -> None:
    # vlm_tiny's dropout on: the checkpoint's RNG state makes the resumed masks the same.
    constant = {"scheduler": "constant"}
    full = train_checks.run_losses(
        vlm_overrides(digits, **constant, **{"trainer.max_steps": 12}), tmp_path / "full"
    )
    train_checks.run_losses(vlm_overrides(digits, **constant), tmp_path / "run")
    resumed = train_checks.run_losses(
        vlm_overrides(digits, **constant, **{"trainer.max_steps": 12, "checkpoint.resume": "auto"}),
        tmp_path / "run",
    )
    assert resumed == full[8:]  # exact float equality, step by step
