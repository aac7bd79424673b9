"""MoE models under pipeline parallelism on two gloo ranks (pp=2): one step's gradients of
every parameter, with unequal micro-batch loss factors, equal one process's; mixtral_tiny with its
balancing and z-losses on and deepseek_moe_tiny with the aux-loss-free bias (its first stage
holding only the dense layer) train with the single-process loss curve, and every logged MoE
metric (auxiliary losses, MaxVio per micro-batch and over the global batch, dropped fraction,
cross-entropy) equals one process's: each stage's auxiliary losses reach the routers' gradients
through :mod:`mt_parallel.moe.carry`, and the biases move per stage; DeepSeek-V3 with MTP
(slow) trains and logs its MTP loss as one process, and its pp=2 checkpoint (the embedding
stored once) resumes at pp=1. A pool shared across modules;
the single-process references run in this process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import train_checks
from train_checks import tiny_overrides

from mt_comm.testing import DistributedPool, PoolCache
from mt_train.hf_checkpoints import load_model

# fp32 on the CPU. A pipelined step runs each micro-batch's chunk forwards and backwards in the
# pp=1 accumulation loop's order; the auxiliary losses' gradient is the micro-batch's weight
# 1/M (exact for M=2) instead of autograd's product through `(CE + a)/M`, and the reported
# sums add CE and the auxiliary losses in another order: a few ulps per step, so eight AdamW
# steps stay below 1e-6 (observed: one ulp, 1e-7).
RTOL = 1e-6
MOE = {
    "model": "mixtral_tiny", "model.dim": 64, "model.n_layers": 2, "model.n_heads": 4,
    "model.n_kv_heads": 2, "model.moe.expert_ffn_dim": 64, "model.moe.z_loss_coeff": 1e-3,
    "scheduler": "constant", "trainer.micro_batch_size": 2, "trainer.log_interval": 1,
}  # fmt: skip
DEEPSEEK = {**MOE, "model": "deepseek_moe_tiny", "model.n_kv_heads": 4, "model.ffn_dim": 128}
METRICS = ("ce_loss", "moe_aux_loss", "moe_z_loss", "moe_max_vio", "moe_dropped")


def overrides(data: Path, **extra: object) -> list[str]:
    plain = [o for o in tiny_overrides(data) if not o.startswith("model.")]
    return plain + [f"{k}={'null' if v is None else v}" for k, v in extra.items()]


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=2)


def check_against_one_process(
    pool: DistributedPool, data: Path, tmp_path: Path, model: dict, schedule: str, **extra: object
) -> list[dict]:
    single = train_checks.run_logged(overrides(data, **model), tmp_path / "single")
    pp = {"parallel": "pp2", "parallel.pp_schedule": schedule, **extra}
    per_rank = pool.run(train_checks.run_logged, overrides(data, **model, **pp), tmp_path / "pp")
    assert per_rank[0]["losses"] == per_rank[1]["losses"]  # both stages report the total
    assert per_rank[0]["losses"] == pytest.approx(single["losses"], rel=RTOL)
    rows, reference = (
        [r for r in run["rows"] if r["kind"] == "train"] for run in (per_rank[0], single)
    )
    assert len(rows) == len(reference) == 8, rows
    for row, ref in zip(rows, reference, strict=True):
        names = [n for n in ref if n in METRICS or n.startswith(("moe_max_vio_global", "mtp_"))]
        assert {n: row[n] for n in names} == pytest.approx({n: ref[n] for n in names}, rel=RTOL)
        assert set(names) <= set(row)
    return reference


def test_first_step_gradients_with_loss_factors_equal_one_process_at_pp2(
    pool: DistributedPool, kjv_data: Path, tmp_path: Path
) -> None:
    """Every parameter's gradient (routers included: balancing and z-losses on both stages),
    the loss and the MoE extras of one step with unequal micro-batch loss factors."""
    factors = [1.0, 0.5, 2.0, 1.0]  # four micro-batches of 2
    single = train_checks.first_step_gradients(
        overrides(kjv_data, **MOE), tmp_path / "one", factors
    )
    pp = {**MOE, "parallel": "pp2"}
    per_rank = pool.run(
        train_checks.first_step_gradients, overrides(kjv_data, **pp), tmp_path / "pp", factors
    )
    held = [set(r["grads"]) for r in per_rank]
    assert not held[0] & held[1] and held[0] | held[1] == set(single["grads"])
    assert any("router" in name for name in held[0]) and any("router" in n for n in held[1])
    for result in per_rank:
        for name, grad in result["grads"].items():
            # fp32, the same operations in the same order but the auxiliary losses' weight
            # (f_m/M directly, not autograd's product): a few ulps of gradients of size <= 1.
            torch.testing.assert_close(grad, single["grads"][name], rtol=1e-5, atol=1e-7)
        assert result["loss"] == pytest.approx(single["loss"], rel=RTOL)
        assert result["extras"] == pytest.approx(single["extras"], rel=RTOL)


def test_mixtral_with_aux_and_z_losses_matches_one_process_at_pp2(
    pool: DistributedPool, kjv_data: Path, tmp_path: Path
) -> None:
    reference = check_against_one_process(pool, kjv_data, tmp_path, MOE, "1f1b")
    # Both layers' (one per stage) losses are in the logged sums: a balanced router gives
    # aux = coeff (0.01) per layer, so about 0.02 for two and about 0.01 for one.
    assert reference[-1]["moe_aux_loss"] > 0.015
    assert reference[-1]["moe_z_loss"] > 0
    assert "moe_max_vio_global/layers.1.mlp.router" in reference[-1]


def test_deepseek_aux_free_bias_moves_per_stage_under_zero_bubble(
    pool: DistributedPool, kjv_data: Path, tmp_path: Path
) -> None:
    """Split backward (I/W) and a first stage without MoE layers (the dense layer 0)."""
    reference = check_against_one_process(pool, kjv_data, tmp_path, DEEPSEEK, "zero_bubble")
    assert reference[-1]["moe_aux_loss"] == 0  # aux-loss-free: the bias balances


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schedule", "extra"),
    [
        ("interleaved_1f1b", {"parallel.pp_chunks": 2}),
        ("dualpipev", {}),
        ("1f1b", {"parallel.recompute": "full"}),
    ],
    ids=["interleaved_1f1b", "dualpipev", "1f1b-recompute-full"],
)
def test_mixtral_four_layers_matches_one_process(
    schedule: str, extra: dict, pool: DistributedPool, kjv_data: Path, tmp_path: Path
) -> None:
    model = {**MOE, "model.n_layers": 4}
    check_against_one_process(pool, kjv_data, tmp_path, model, schedule, **extra)


V3 = {
    "model": "deepseek_v3_tiny", "model.dim": 64, "model.n_layers": 3, "model.ffn_dim": 128,
    "model.q_lora_rank": 32, "model.kv_lora_rank": 16, "model.qk_nope_head_dim": 16,
    "model.qk_rope_head_dim": 8, "model.v_head_dim": 16, "model.moe.expert_ffn_dim": 32,
    "model.mtp_depth": 0, "scheduler": "constant", "trainer.micro_batch_size": 2,
    "trainer.log_interval": 1,
}  # fmt: skip


@pytest.mark.slow
def test_deepseek_v3_without_mtp_matches_one_process_at_pp2(
    pool: DistributedPool, kjv_data: Path, tmp_path: Path
) -> None:
    """MLA blocks, the dense layer 0 and MoE layers 1 (stage 0) and 2 (stage 1)."""
    check_against_one_process(pool, kjv_data, tmp_path, V3, "1f1b")


@pytest.mark.slow
def test_deepseek_v3_mtp_under_zero1_and_zero_bubble_matches_one_process(
    pool: DistributedPool, kjv_data: Path, tmp_path: Path
) -> None:
    """ZeRO-1 (its norm over the stage shards counting the embedding once, its update of the
    copy from the summed gradient) under a split-backward schedule."""
    model = {**V3, "model.mtp_depth": 1, "parallel.data_parallel": "zero1"}
    reference = check_against_one_process(pool, kjv_data, tmp_path, model, "zero_bubble")
    assert reference[-1]["mtp_loss_1"] > 0


@pytest.mark.slow
def test_deepseek_v3_mtp_checkpoint_at_pp2_loads_at_pp1(
    pool: DistributedPool, kjv_data: Path, tmp_path: Path
) -> None:
    """MTP at pp=2 (its module, an MoE block, and the embedding copy on stage 1) trains with
    the single-process curve, and both stages log its ``mtp_loss_1`` and MoE metrics; the
    checkpoint stores the embedding once (stage 0 writes it), one process and mt-convert's
    loader join the stage files, and the resumed run continues the single-process curve."""
    model = {**V3, "model.mtp_depth": 1}
    steps = {"trainer.max_steps": 12}
    single = train_checks.run_logged(overrides(kjv_data, **model, **steps), tmp_path / "full")
    pp = {"parallel": "pp2", "trainer.max_steps": 8}
    per_rank = pool.run(
        train_checks.run_logged, overrides(kjv_data, **model, **pp), tmp_path / "split"
    )
    assert per_rank[0]["losses"] == per_rank[1]["losses"]
    assert per_rank[0]["losses"] == pytest.approx(single["losses"][:8], rel=RTOL)
    # Rank 0 logs; it holds stage 0, without the head or the MTP module.
    rows, reference = (
        [r for r in run["rows"] if r["kind"] == "train"] for run in (per_rank[0], single)
    )
    names = ("mtp_loss_1", "ce_loss", "moe_max_vio")
    assert len(rows) == 8 and all(r["mtp_loss_1"] > 0 for r in rows)
    for row, ref in zip(rows, reference, strict=False):
        assert {n: row[n] for n in names} == pytest.approx({n: ref[n] for n in names}, rel=RTOL)
    step = tmp_path / "split" / "checkpoints" / "step-00000008"
    manifest = (step / "manifest.json").read_text()
    assert manifest.count('"model/embed.weight"') == 1, manifest
    assert manifest.count('"optim/embed.weight/exp_avg"') == 1
    assert "model/mtp.0.proj.weight" in manifest
    exported = load_model(tmp_path / "split" / "checkpoints")
    assert torch.isfinite(exported(torch.arange(8)[None])).all()
    resume = {"trainer.max_steps": 12, "checkpoint.resume": "auto"}
    at_pp1 = train_checks.run_losses(overrides(kjv_data, **model, **resume), tmp_path / "split")
    assert at_pp1 == pytest.approx(single["losses"][8:], rel=RTOL)


@pytest.mark.slow
def test_deepseek_pp2_checkpoint_resumes_at_pp1_with_its_biases(
    pool: DistributedPool, kjv_data: Path, tmp_path: Path
) -> None:
    """Each stage saves its routers' aux-loss-free biases under the whole model's names; one
    process joins them and continues the single-process curve."""
    steps = {"trainer.max_steps": 12}
    single = train_checks.run_losses(overrides(kjv_data, **DEEPSEEK, **steps), tmp_path / "full")
    pp = {"parallel": "pp2", "trainer.max_steps": 8}
    pool.run(train_checks.run_losses, overrides(kjv_data, **DEEPSEEK, **pp), tmp_path / "split")
    manifest = (tmp_path / "split" / "checkpoints" / "step-00000008" / "manifest.json").read_text()
    assert "model/layers.1.mlp.router.expert_bias" in manifest
    resume = {"trainer.max_steps": 12, "checkpoint.resume": "auto"}
    at_pp1 = train_checks.run_losses(overrides(kjv_data, **DEEPSEEK, **resume), tmp_path / "split")
    assert at_pp1 == pytest.approx(single[8:], rel=RTOL)


@pytest.mark.slow
def test_mixtral_fp8_experts_under_zero_bubble_match_one_process(
    pool: DistributedPool, kjv_data: Path, tmp_path: Path
) -> None:
    """FP8 (rowwise, emulated on the CPU) grouped experts in split-backward stages."""
    check_against_one_process(pool, kjv_data, tmp_path, {**MOE, "fp8": "rowwise"}, "zero_bubble")
