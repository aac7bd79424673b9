"""MoE training on 4 gloo ranks: ep=4 (dp=4, also under fsdp: one rank per edp group), ep2 ×
tp2 and ep2 × tp2 with sequence parallel (dp=2; also under fsdp and zero1, which sum the
experts' gradients over TP once per step too) match one process step by step (slow: the
default tier covers the same code with ep=2 and tp=2 with SP in the trainer and ep×tp (with
SP) at the layer level, mt-parallel's test_moe_world4.py and test_moe_data_parallel_world4.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import train_checks
from test_train_moe import RTOL, overrides

from mt_comm.testing import DistributedPool, PoolCache

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=4)


@pytest.mark.parametrize(
    "layout",
    [
        {"parallel": "ep2", "parallel.ep": 4},
        {"parallel": "ep2", "parallel.tp": 2},
        {"parallel": "tp2", "parallel.ep": 2},
        {"parallel": "tp2", "parallel.ep": 2, "parallel.data_parallel": "fsdp"},
        {"parallel": "tp2", "parallel.ep": 2, "parallel.data_parallel": "zero1"},
        {"parallel": "ep2", "parallel.ep": 4, "parallel.data_parallel": "fsdp"},
    ],
    ids=[
        "ep4-dp4",
        "ep2-tp2-dp2",
        "ep2-tp2-sp-dp2",
        "ep2-tp2-sp-dp2-fsdp",
        "ep2-tp2-sp-dp2-zero1",
        "ep4-dp4-fsdp",
    ],
)
def test_expert_parallel_layouts_match_one_process(
    pool: DistributedPool, layout: dict, kjv_data: Path, tmp_path: Path
) -> None:
    steps = {"trainer.max_steps": 6, "trainer.micro_batch_size": 2, "trainer.log_interval": 1}
    single = train_checks.run_logged(overrides(kjv_data, **steps), tmp_path / "single")
    per_rank = pool.run(
        train_checks.run_logged, overrides(kjv_data, **layout, **steps), tmp_path / "run"
    )
    losses = [rank["losses"] for rank in per_rank]
    assert losses[0] == losses[1] == losses[2] == losses[3]
    assert losses[0] == pytest.approx(single["losses"], rel=RTOL)
    # AdamW is nearly scale-free: a gradient scaled wrongly shows in the norm, not the losses.
    norms = [row["grad_norm"] for row in per_rank[0]["rows"] if "grad_norm" in row]
    assert len(norms) == steps["trainer.max_steps"]
    assert norms == pytest.approx(
        [row["grad_norm"] for row in single["rows"] if "grad_norm" in row], rel=RTOL
    )
