"""MoE training on 4 gloo ranks: ep=4 (dp=4), ep2 × tp2 and ep2 × tp2 with sequence parallel
(dp=2) match one process step by step (slow: the default tier covers the same code with ep=2
and tp=2 with SP in the trainer and ep×tp (with SP) at the layer level, mt-parallel's
test_moe_world4.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import train_checks
from test_train_moe import RTOL, overrides

from mt_comm.testing import DistributedPool

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pool():
    with DistributedPool(world_size=4) as pool:
        yield pool


@pytest.mark.parametrize(
    "layout",
    [
        {"parallel": "ep2", "parallel.ep": 4},
        {"parallel": "ep2", "parallel.tp": 2},
        {"parallel": "tp2", "parallel.ep": 2},
    ],
    ids=["ep4-dp4", "ep2-tp2-dp2", "ep2-tp2-sp-dp2"],
)
def test_expert_parallel_layouts_match_one_process(
    pool: DistributedPool, layout: dict, kjv_data: Path, tmp_path: Path
) -> None:
    steps = {"trainer.max_steps": 6, "trainer.micro_batch_size": 2}
    single = train_checks.run_losses(overrides(kjv_data, **steps), tmp_path / "single")
    per_rank = pool.run(
        train_checks.run_losses, overrides(kjv_data, **layout, **steps), tmp_path / "run"
    )
    assert per_rank[0] == per_rank[1] == per_rank[2] == per_rank[3]
    assert per_rank[0] == pytest.approx(single, rel=RTOL)
