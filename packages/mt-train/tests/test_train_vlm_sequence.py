"""The vision-language model under sequence parallel (tp=2) and context parallel (cp=2) on two
gloo ranks equals one process in float64: loss, logits and every gradient over two SGD steps
on micro-batches whose images straddle cp chunks and SP shards, also with several samples
packed per row whose boundaries cross them (:mod:`vlm_checks`); and the
trainer's digits run at those layouts reports the one-process losses. One pool for the
module."""

from __future__ import annotations

from pathlib import Path

import pytest
import train_checks
from test_train_vlm_parallel import NO_DROPOUT, RTOL, vlm_overrides
from vlm_checks import FP64_BOUND, vlm_parallel_step

from mt_comm.testing import DistributedPool, PoolCache

pytest.importorskip("sklearn", reason="the vision extra: pip install 'mt-train[vision]'")

LAYOUTS = {"tp2_sp": (2, 1, True), "cp2": (1, 2, False)}


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=2)


@pytest.mark.parametrize("packed", [False, True], ids=["one_sample", "packed"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_step_matches_one_process_in_float64(layout: str, packed: bool, pool) -> None:
    tp, cp, sp = LAYOUTS[layout]
    for result in pool.run(vlm_parallel_step, tp, cp, sp, packed=packed):
        assert result["loss"] < FP64_BOUND
        assert result["logits"] < FP64_BOUND
        assert sorted(result["grads"]) == result["graded"]  # vision, projector, language
        worst = max(result["grads"].items(), key=lambda kv: kv[1])
        assert worst[1] < FP64_BOUND, worst
        for trained, expected in result["counts"]:
            assert trained == expected  # the cp group's unmasked targets: the whole sequence's


@pytest.fixture(scope="module")
def reference(digits: Path, tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    overrides = vlm_overrides(digits, **NO_DROPOUT)
    return train_checks.run_losses(overrides, tmp_path_factory.mktemp("single"))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_trainer_layout_matches_single_process(
    layout: str, pool, digits: Path, reference: list[float], tmp_path: Path
) -> None:
    tp, cp, sp = LAYOUTS[layout]
    extra = {"parallel.tp": tp, "parallel.cp": cp, "parallel.sequence_parallel": sp}
    per_rank = pool.run(
        train_checks.run_losses, vlm_overrides(digits, **extra, **NO_DROPOUT), tmp_path
    )
    assert per_rank[0] == per_rank[1]  # every rank reports the global mean loss
    # fp32 over 8 AdamW steps, as the tp=2 and dp=2 layouts (test_train_vlm_parallel.py).
    assert per_rank[0] == pytest.approx(reference, rel=RTOL)


PACKED = {"data.pack_samples": True, "trainer.seq_len": 64, **NO_DROPOUT}
"""Three digits samples per 64-token row; at cp=2 the rows' sample boundaries (every 19
tokens) fall inside the load-balanced chunks of 16."""


@pytest.fixture(scope="module")
def packed_reference(digits: Path, tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    overrides = vlm_overrides(digits, **PACKED)
    return train_checks.run_losses(overrides, tmp_path_factory.mktemp("packed_single"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_packed_trainer_layout_matches_single_process(
    layout: str, pool, digits: Path, packed_reference: list[float], tmp_path: Path
) -> None:
    """The trainer's own path for packed rows: document ids and the per-sample positions cut
    for each cp rank by the runner (the float64 step test cuts them itself)."""
    tp, cp, sp = LAYOUTS[layout]
    extra = {"parallel.tp": tp, "parallel.cp": cp, "parallel.sequence_parallel": sp}
    per_rank = pool.run(train_checks.run_losses, vlm_overrides(digits, **extra, **PACKED), tmp_path)
    assert per_rank[0] == per_rank[1]
    assert per_rank[0] == pytest.approx(packed_reference, rel=RTOL)
