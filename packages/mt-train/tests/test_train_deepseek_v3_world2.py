"""deepseek_v3_tiny (MLA + MoE + MTP) trained on 2 gloo ranks against one process: tp=2, tp=2
with sequence parallel, ep=2 (dp=2) and, without MTP, ep=2 carved out of cp=2 (one pool for
the module)."""

from __future__ import annotations

from pathlib import Path

import pytest
import train_checks
from train_checks import tiny_overrides

from mt_comm.testing import DistributedPool

# fp32 on the CPU; the layouts differ from one process only in summation order (TP partial
# sums, gradient all-reduces, grouped-GEMM rows), a few ulps per step; 6 AdamW steps keep the
# losses far below 1e-4 apart. This is the integration check of the layouts; AdamW's scale
# invariance hides a gradient that is off by a constant factor, so the exact gradient checks
# are the layer tests (mt-parallel's test_mla_world2.py, test_moe_world4.py, fp64 at 1e-10).
RTOL = 1e-4
MODEL = {
    "model": "deepseek_v3_tiny", "model.dim": 64, "model.n_layers": 2, "model.ffn_dim": 128,
    "model.q_lora_rank": 32, "model.kv_lora_rank": 16, "model.qk_nope_head_dim": 16,
    "model.qk_rope_head_dim": 8, "model.v_head_dim": 16, "model.moe.expert_ffn_dim": 32,
    "scheduler": "constant", "trainer.max_steps": 6,
}  # fmt: skip


def overrides(data: Path, **extra: object) -> list[str]:
    plain = [o for o in tiny_overrides(data) if not o.startswith("model.")]
    return plain + [f"{k}={v}" for k, v in {**MODEL, **extra}.items()]


@pytest.fixture(scope="module")
def pool():
    with DistributedPool(world_size=2) as pool:
        yield pool


LAYOUTS = {
    "tp2-mtp": {"parallel.tp": 2},
    "ep2-mtp": {"parallel": "ep2"},
    # MTP is refused under cp; balancing off: an aux statistic is per rank's tokens under cp.
    "cp2-ep2": {"parallel": "cp2", "parallel.ep": 2, "model.mtp_depth": 0,
                "model.moe.balancing": "none"},
}  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_layout_matches_one_process(
    layout: dict, pool: DistributedPool, kjv_data: Path, tmp_path: Path
) -> None:
    same_model = {k: v for k, v in layout.items() if k.startswith("model.")}
    single = train_checks.run_losses(overrides(kjv_data, **same_model), tmp_path / "single")
    per_rank = pool.run(train_checks.run_losses, overrides(kjv_data, **layout), tmp_path / "run")
    assert per_rank[0] == per_rank[1]
    assert per_rank[0] == pytest.approx(single, rel=RTOL)


def test_sequence_parallel_matches_one_process(
    pool: DistributedPool, kjv_data: Path, tmp_path: Path
) -> None:
    # tp=2 with SP (parallel=tp2), MTP on: MLA's latents all-gathered, the routers and routed
    # experts on each rank's half of every sequence. Besides the losses (RTOL, as above), the
    # logged CE, MTP losses and MaxVio (per batch, and of the global batch per router) equal
    # one process's: MaxVio comes from the expert counts, which are summed over TP; counted
    # per rank, they are those of half the sequences and MaxVio moves by O(0.1) (rank 0 logs).
    single = train_checks.run_logged(overrides(kjv_data), tmp_path / "single")
    per_rank = pool.run(
        train_checks.run_logged, overrides(kjv_data, parallel="tp2"), tmp_path / "run"
    )
    assert per_rank[0]["losses"] == per_rank[1]["losses"]
    assert per_rank[0]["losses"] == pytest.approx(single["losses"], rel=RTOL)
    expected = train_checks.model_metrics(single["rows"])
    assert any(key.startswith("moe_max_vio_global/") for _, key in expected)
    assert train_checks.model_metrics(per_rank[0]["rows"]) == pytest.approx(expected, rel=RTOL)
