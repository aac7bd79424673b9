"""Pipeline parallelism in the trainer on four gloo ranks: pp=2 with tp=2 (sequence parallel)
and pp=2 with dp=2 match one process; a single-process checkpoint resumes at pp=4. One pool
for the module; the single-process references run in this process."""

from __future__ import annotations

from pathlib import Path

import pytest
import train_checks
from test_train_pipeline import CONSTANT, PIPELINE
from train_checks import tiny_overrides

from mt_comm.testing import DistributedPool

# fp32 on CPU. TP splits the attention/MLP dot products and the vocabulary, DP averages the
# gradients with an all-reduce: both reorder sums (a few ulps per step, as the pp=1 layouts of
# test_train_parallel.py); 8 AdamW steps keep the drift far below 1e-4.
RTOL = 1e-4


@pytest.fixture(scope="module")
def pool():
    with DistributedPool(world_size=4) as pool:
        yield pool


@pytest.fixture(scope="module")
def reference(kjv_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    overrides = tiny_overrides(kjv_data, **PIPELINE, **{"trainer.sample_tokens": 12})
    return train_checks.run_summary(overrides, tmp_path_factory.mktemp("single"))


@pytest.mark.parametrize(
    "layout",
    [
        {"parallel": "tp2", "parallel.pp_schedule": "1f1b"},
        {"parallel.pp_schedule": "zero_bubble"},
        {"parallel": "zero1", "parallel.pp_schedule": "interleaved_1f1b", "parallel.pp_chunks": 2},
        {"parallel": "cp2", "parallel.pp_schedule": "dualpipev"},
    ],
    ids=[
        "pp2-tp2-sp-1f1b",
        "pp2-dp2-zero_bubble",
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


def test_single_process_checkpoint_resumes_at_pp4(pool, kjv_data: Path, tmp_path: Path) -> None:
    single = {**PIPELINE, **CONSTANT}
    uninterrupted = train_checks.run_losses(
        tiny_overrides(kjv_data, **single, **{"trainer.max_steps": 12}), tmp_path / "full"
    )
    train_checks.run_losses(
        tiny_overrides(kjv_data, **single, **{"trainer.max_steps": 8}), tmp_path / "split"
    )
    resume = {"trainer.max_steps": 12, "checkpoint.resume": "auto", "parallel.pp": 4}
    resumed = pool.run(
        train_checks.run_losses, tiny_overrides(kjv_data, **single, **resume), tmp_path / "split"
    )
    assert resumed[0] == pytest.approx(uninterrupted[8:], rel=RTOL)
