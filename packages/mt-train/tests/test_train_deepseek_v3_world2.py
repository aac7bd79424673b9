"""deepseek_v3_tiny (MLA + MoE + MTP) on 2 gloo ranks against one process: trained at tp=2,
tp=2 with sequence parallel, ep=2 (dp=2), cp=2 on packed documents and ep=2 carved out of
cp=2; and one float64 step of multi-token prediction (depths 1 and 2, all-gather and ring
attention) at cp=2 on packed documents, loss by loss and gradient by gradient, and at pp=2
(the MTP modules and an embedding copy on the last stage) through two AdamW steps
(:mod:`mtp_checks`). A pool shared across modules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import train_checks
from mtp_checks import FP64_BOUND, mtp_cp_step, mtp_pp_step
from train_checks import tiny_overrides

from mt_comm.testing import DistributedPool, PoolCache
from mt_train.checkpoint.state import ADAM_KEYS

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
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=2)


@pytest.fixture(scope="module")
def one_process(kjv_data: Path, tmp_path_factory: pytest.TempPathFactory):
    """``one_process(**job)``: the one-process run of ``overrides(kjv_data, **job)`` (its
    losses and logged rows, ``train_checks.run_logged``), trained once per job in this module:
    the tp=2, ep=2 and sequence-parallel layouts all compare with the plain job's run."""
    runs: dict[tuple, dict] = {}

    def run(**job: object) -> dict:
        key = tuple(sorted(job.items()))
        if key not in runs:
            out = tmp_path_factory.mktemp("single")
            runs[key] = train_checks.run_logged(overrides(kjv_data, **job), out)
        return runs[key]

    return run


LAYOUTS = {
    "tp2-mtp": {"parallel.tp": 2},
    "ep2-mtp": {"parallel": "ep2"},
    "cp2-mtp": {"parallel": "cp2", "data.document_masking": "true"},
    # Balancing off: an aux statistic is per rank's tokens under cp.
    "cp2-ep2-mtp": {"parallel": "cp2", "parallel.ep": 2, "model.moe.balancing": "none"},
}  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_layout_matches_one_process(
    layout: dict, pool: DistributedPool, one_process, kjv_data: Path, tmp_path: Path
) -> None:
    single = one_process(**{k: v for k, v in layout.items() if not k.startswith("parallel")})
    per_rank = pool.run(train_checks.run_losses, overrides(kjv_data, **layout), tmp_path / "run")
    assert per_rank[0] == per_rank[1]
    assert per_rank[0] == pytest.approx(single["losses"], rel=RTOL)
    if layout is LAYOUTS["cp2-mtp"]:
        # Logged extras are a dp rank's micro-batches'; at cp=2 (dp=1) the MTP loss is the
        # whole sequence's over the cp group, so the whole batch's as in one process.
        lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        logged = _logged([json.loads(line) for line in lines], "mtp_loss_1")
        expected = _logged(single["rows"], "mtp_loss_1")
        assert len(logged) >= 2 and logged == pytest.approx(expected, rel=RTOL)


def _logged(rows: list[dict], name: str) -> list[float]:
    return [row[name] for row in rows if name in row]


@pytest.mark.parametrize(
    ("depth", "cp_attention"),
    [(1, "all_gather"), (2, "all_gather"), (2, "ring")],
    ids=["depth1", "depth2", "depth2-ring"],
)
def test_mtp_at_cp2_equals_one_process_in_float64(
    depth: int, cp_attention: str, pool: DistributedPool
) -> None:
    per_rank = pool.run(mtp_cp_step, depth, cp_attention)
    for result in per_rank:
        assert result["mtp_keys"] == [f"mtp_loss_{k}" for k in range(1, depth + 1)]
        assert "needs mtp_tokens_BTK and mtp_targets_BTK shifted on the whole" in result["refusal"]
        assert result["loss"] < FP64_BOUND
        assert result["ce_loss"] < FP64_BOUND
        assert max(result["mtp"]) < FP64_BOUND, result["mtp"]
        # Every parameter, the MTP modules and the shared embedding and head included.
        assert sorted(result["grads"]) == result["params"]
        assert any(name.startswith("mtp.") for name in result["grads"])
        worst = max(result["grads"].items(), key=lambda kv: kv[1])
        assert worst[1] < FP64_BOUND, worst
    # Rank 0 holds the sequence's tail, whose shifted targets are masked: the ranks hold
    # different numbers of MTP targets, so a per-rank mean would not be the sequence's.
    assert per_rank[0]["counts"] != per_rank[1]["counts"]


def test_sequence_parallel_matches_one_process(
    pool: DistributedPool, one_process, kjv_data: Path, tmp_path: Path
) -> None:
    # tp=2 with SP (parallel=tp2), MTP on: MLA's latents all-gathered, the routers and routed
    # experts on each rank's half of every sequence. Besides the losses (RTOL, as above), the
    # logged CE, MTP losses and MaxVio (per batch, and of the global batch per router) equal
    # one process's: MaxVio comes from the expert counts, which are summed over TP; counted
    # per rank, they are those of half the sequences and MaxVio moves by O(0.1) (rank 0 logs).
    single = one_process()
    per_rank = pool.run(
        train_checks.run_logged, overrides(kjv_data, parallel="tp2"), tmp_path / "run"
    )
    assert per_rank[0]["losses"] == per_rank[1]["losses"]
    assert per_rank[0]["losses"] == pytest.approx(single["losses"], rel=RTOL)
    expected = train_checks.model_metrics(single["rows"])
    assert any(key.startswith("moe_max_vio_global/") for _, key in expected)
    assert train_checks.model_metrics(per_rank[0]["rows"]) == pytest.approx(expected, rel=RTOL)


@pytest.mark.parametrize(
    ("depth", "schedule"), [(1, "1f1b"), (2, "1f1b"), (1, "zbv")], ids=["1", "2", "1-zbv"]
)
def test_mtp_at_pp2_equals_one_process_in_float64(
    depth: int, schedule: str, pool: DistributedPool
) -> None:
    """The loss, every logged extra (``mtp_loss_k`` on both stages), every gradient (the
    embedding's summed over the stage that embeds the tokens and the one that embeds the
    shifted tokens); after two AdamW steps both embeddings are equal bit for bit and equal
    to the reference's. Under ZBV the first and last chunks are both on rank 0, which holds
    the one embedding both use (their gradients accumulate into it, split backward
    included). Bound: FP64_BOUND (float64, the same operations in another summation order;
    the issue asks 1e-6)."""
    per_rank = pool.run(mtp_pp_step, depth, schedule)
    v_shape = schedule == "zbv"
    assert [r["holds_mtp"] for r in per_rank] == ([True, False] if v_shape else [False, True])
    # A checkpoint stores the embedding and its AdamW state once: stage 0 writes them.
    stored = ["model/embed.weight"] + [f"optim/embed.weight/{k}" for k in ADAM_KEYS]
    assert [r["written_embedding"] for r in per_rank] == [sorted(stored), []]
    for result in per_rank:
        assert result["loss"] < FP64_BOUND
        mtp_keys = {f"mtp_loss_{k}" for k in range(1, depth + 1)}
        assert mtp_keys | {"ce_loss", "moe_max_vio"} <= set(result["extras"])
        assert set(result["extras"]) == set(result["reference_extras"])
        # The extras are summed in fp32 on both sides (logging precision), in the same order.
        worst = max(result["extras"].items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-6, worst
        # Under ZBV rank 1 holds the middle chunks only.
        assert ("embed.weight" in result["grads"]) == (not v_shape or result is per_rank[0])
        worst = max(result["grads"].items(), key=lambda kv: kv[1])
        assert worst[1] < FP64_BOUND, worst
        assert result["copies_equal"] and result["embedding"] < FP64_BOUND
