"""The MoE model family in mt-train: published Mixtral-8x7B counts on the meta device, configs
and their errors, mixtral_tiny training on the CPU with its auxiliary losses logged, the
aux-loss-free bias moving in every mode (and saved), and on two gloo ranks expert parallelism
(ep=2) matching one process, resuming exactly, and loading at ep=1."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import train_checks
from train_checks import tiny_overrides

from mt_comm.testing import DistributedPool, PoolCache
from mt_train import Trainer, compose_config, to_train_config
from mt_train.hf_checkpoints import load_model
from mt_train.hf_checkpoints import main as main_convert
from mt_train.models import build_model, family_of, model_sizes
from mt_train.models.moe import active_parameters

# fp32 on the CPU; ep=2 and one process differ only in summation order (gradient all-reduce,
# rows inside grouped GEMMs), a few ulps per step; 8 AdamW steps keep that far below 1e-4.
RTOL = 1e-4
MOE = {
    "model": "mixtral_tiny", "model.dim": 64, "model.n_layers": 2, "model.n_heads": 4,
    "model.n_kv_heads": 2, "model.moe.expert_ffn_dim": 64, "scheduler": "constant",
}  # fmt: skip
DEEPSEEK = {**MOE, "model": "deepseek_moe_tiny", "model.n_kv_heads": 4, "model.ffn_dim": 128}


def overrides(data: Path, **extra: object) -> list[str]:
    base = {**MOE, **extra}
    plain = [o for o in tiny_overrides(data) if not o.startswith("model.")]
    return plain + [f"{k}={'null' if v is None else v}" for k, v in base.items()]


def test_mixtral_8x7b_has_the_published_parameter_counts() -> None:
    cfg = model_sizes()["mixtral_8x7b"]
    model = build_model(cfg, "meta")
    family = family_of(cfg)
    assert family.name == "moe"
    assert family.num_params(model) == 46_702_792_704  # Mistral's published total
    assert active_parameters(model, cfg) == 12_879_925_248  # and active per token


def test_moe_sizes_compose_and_bad_expert_parallel_is_one_clear_error() -> None:
    cfg = to_train_config(compose_config(["model=deepseek_moe_tiny", "parallel=ep2"])).model
    assert cfg.moe.score_function == "sigmoid" and cfg.moe.n_shared_experts == 1
    assert cfg.first_k_dense == 1
    with pytest.raises(
        ValueError, match=re.escape("parallel.ep=3 does not divide moe.num_experts=8")
    ):
        to_train_config(compose_config(["model=mixtral_tiny", "parallel.ep=3"]))
    with pytest.raises(ValueError, match=re.escape("parallel.ep=2 with parallel.compile=true")):
        to_train_config(
            compose_config(["model=mixtral_tiny", "parallel=ep2", "parallel.compile=true"])
        )
    with pytest.raises(ValueError, match=re.escape("moe.top_k=9 exceeds moe.num_experts=8")):
        to_train_config(compose_config(["model=mixtral_tiny", "model.moe.top_k=9"]))


def test_mixtral_tiny_learns_and_logs_its_moe_metrics(kjv_data: Path, tmp_path: Path) -> None:
    summary = train_checks.fit(
        overrides(kjv_data, **{"trainer.max_steps": 16, "trainer.log_interval": 1}), tmp_path
    )[1]
    assert summary.losses[-1] < summary.losses[0] - 0.5, summary.losses
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "moe_aux_loss" in r]
    assert logged, rows[:3]
    # A balanced router gives aux = coeff (0.01) per layer; 2 layers, so about 0.02.
    assert 0.015 < logged[-1]["moe_aux_loss"] < 0.1
    assert logged[-1]["moe_max_vio"] >= 0 and logged[-1]["moe_dropped"] == 0
    # The global batch's MaxVio (counts summed over micro-batches and ranks) is never above
    # the worst micro-batch's in one process, where the global batch is two micro-batches.
    assert 0 <= logged[-1]["moe_max_vio_global"] <= 8
    per_layer = [logged[-1][f"moe_max_vio_global/layers.{i}.mlp.router"] for i in range(2)]
    assert max(per_layer) == logged[-1]["moe_max_vio_global"]
    assert logged[-1]["loss"] == pytest.approx(logged[-1]["ce_loss"] + logged[-1]["moe_aux_loss"])


@pytest.mark.parametrize(
    "mode", [{}, {"parallel": "recompute"}, {"trainer.micro_batch_size": 2}],
    ids=["eager", "recompute-full", "accumulation"],
)  # fmt: skip
def test_aux_free_bias_moves_in_every_mode_and_is_checkpointed(
    mode: dict, kjv_data: Path, tmp_path: Path
) -> None:
    cfg = to_train_config(compose_config(overrides(kjv_data, **DEEPSEEK, **mode)))
    trainer = Trainer(cfg, output_dir=tmp_path)
    try:
        routers = [m.router for m in trainer.module.modules() if hasattr(m, "router")]
        assert len(routers) == 1  # 2 layers, the first dense
        # One step's forward and backward count every token's top-k choices exactly once
        # (not again when recompute re-runs the forward inside backward).
        micro = trainer.sampler.next_step()
        trainer.runner.forward_backward([trainer.collate(trainer.data.train, i) for i in micro])
        assert routers[0].step_counts.sum() == 8 * 64 * cfg.model.moe.top_k
        trainer.optimizer.zero_grad(set_to_none=True)
        routers[0].step_counts.zero_()
        trainer.train_step()
        bias = routers[0].expert_bias
        # γ·sign(mean − load): every expert moved by exactly γ or 0, not all by 0.
        step = bias.abs()
        rate = torch.tensor(cfg.model.moe.bias_update_rate)
        assert bool(((step == 0) | torch.isclose(step, rate)).all()), bias
        assert bias.abs().sum() > 0
        assert routers[0].step_counts.sum() == 0  # reset after the update
        trainer.train_step()
        trainer.save()
        trainer.checkpointer.wait()
        saved = bias.clone()
    finally:
        trainer.close()
    manifest = next((tmp_path / "checkpoints").glob("step-*/manifest.json")).read_text()
    assert "model/layers.1.mlp.router.expert_bias" in manifest
    resumed = Trainer(
        to_train_config(compose_config(overrides(kjv_data, **DEEPSEEK, **mode))),
        output_dir=tmp_path,
    )
    try:
        resumed.load(next((tmp_path / "checkpoints").glob("step-*")))
        router = next(m.router for m in resumed.module.modules() if hasattr(m, "router"))
        assert torch.equal(router.expert_bias, saved)
    finally:
        resumed.close()


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=2)


def test_expert_parallel_run_matches_one_process_and_resumes(
    pool: DistributedPool, kjv_data: Path, tmp_path: Path
) -> None:
    steps = {"trainer.max_steps": 12}
    single = train_checks.run_losses(overrides(kjv_data, **steps), tmp_path / "single")
    ep2 = pool.run(
        train_checks.run_losses, overrides(kjv_data, parallel="ep2", **steps), tmp_path / "ep2"
    )
    assert ep2[0] == ep2[1]
    assert ep2[0] == pytest.approx(single, rel=RTOL)
    # The 12-step run's own step-8 checkpoint is resumed: under MOE's constant schedule a run
    # stopped at step 8 would have written the same one.
    step8_ep2 = tmp_path / "ep2" / "checkpoints" / "step-00000008"
    manifest = (step8_ep2 / "manifest.json").read_text()
    # Each ep rank wrote its half of the experts (and of their AdamW moments).
    assert "model/layers.0.mlp.experts.gate_proj.weight@elems0-" in manifest
    assert "optim/layers.0.mlp.experts.down_proj.weight/exp_avg@elems" in manifest
    resume = {"trainer.max_steps": 12, "checkpoint.resume": step8_ep2}
    resumed = pool.run(
        train_checks.run_losses, overrides(kjv_data, parallel="ep2", **resume), tmp_path / "ep2-r"
    )
    assert resumed[0] == resumed[1] == ep2[0][8:]  # exact, step by step
    one_process = train_checks.run_losses(overrides(kjv_data, **resume), tmp_path / "ep1-r")
    assert one_process == pytest.approx(single[8:], rel=RTOL)  # ep=2 checkpoint loads at ep=1
    # An ep=2 checkpoint exports to Hugging Face Mixtral with the same logits.
    transformers = pytest.importorskip("transformers")
    assert main_convert(["export", str(step8_ep2), str(tmp_path / "hf")]) == 0
    ours = load_model(step8_ep2).eval()
    theirs = transformers.MixtralForCausalLM.from_pretrained(
        tmp_path / "hf", use_kernels=False, attn_implementation="eager"
    ).eval()
    tokens = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # fp32, different op order: a few ulps of logits of size ~1 (as in mt-convert's tests).
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=0, atol=1e-4)
    # And back: the one-process checkpoint of step 8 (whole expert tensors) cut for ep=2.
    step8 = tmp_path / "single" / "checkpoints" / "step-00000008"
    from_ep1 = {"trainer.max_steps": 12, "checkpoint.resume": str(step8)}
    back = pool.run(
        train_checks.run_losses, overrides(kjv_data, parallel="ep2", **from_ep1), tmp_path / "back"
    )
    assert back[0] == pytest.approx(single[8:], rel=RTOL)


def test_mixtral_tiny_trains_with_fp8_experts(kjv_data: Path, tmp_path: Path) -> None:
    # Its checkpoint holds each weight once, under the names of the model without FP8, so
    # load_model (and export) read it (the FP8 layers' shared weights were saved again before).
    cfg = to_train_config(
        compose_config(overrides(kjv_data, fp8="rowwise", **{"trainer.max_steps": 4}))
    )
    trainer = Trainer(cfg, output_dir=tmp_path)
    try:
        experts = [m for m in trainer.module.modules() if type(m).__name__ == "GroupedLinear"]
        assert experts and all(m.fp8_enabled for m in experts)
        summary = trainer.fit()
        trainer.save()
        trained = {k: v.detach().clone() for k, v in trainer.module.state_dict().items()}
    finally:
        trainer.close()
    assert all(torch.isfinite(torch.tensor(summary.losses)))
    assert summary.losses[-1] < summary.losses[0]
    loaded = load_model(tmp_path / "checkpoints").state_dict()
    assert loaded.keys() == trained.keys()
    assert all(torch.equal(loaded[k], trained[k]) for k in loaded)


def test_dead_experts_are_an_event(kjv_data: Path, tmp_path: Path) -> None:
    trainer = Trainer(to_train_config(compose_config(overrides(kjv_data))), output_dir=tmp_path)
    try:
        trainer.train_step()
        counts = trainer.expert_load.counts
        assert set(counts) == {"layers.0.mlp.router", "layers.1.mlp.router"}
        counts["layers.1.mlp.router"][[2, 5]] = 0  # two experts got no token
        metrics: dict = {}
        trainer.expert_load.log(metrics, trainer.step)
        events = len(trainer.events.records)
        trainer.expert_load.log({}, trainer.step)  # the same dead experts: no second event
        assert len(trainer.events.records) == events
    finally:
        trainer.close()
    assert metrics["moe_max_vio_global"] > 0
    event = trainer.events.records[-1]
    assert event["event"] == "moe_dead_experts"
    assert event["experts"] == {"layers.1.mlp.router": [2, 5]}


def test_cuda_graph_is_refused_for_moe_models(kjv_data: Path, tmp_path: Path) -> None:
    cfg = to_train_config(compose_config(overrides(kjv_data, **{"trainer.cuda_graph": True})))
    with pytest.raises(ValueError, match="MoE layers read their routing's group sizes"):
        Trainer(cfg, output_dir=tmp_path)


@pytest.mark.slow
def test_aux_free_bias_moves_under_compile(kjv_data: Path, tmp_path: Path) -> None:
    # Slow (compiling on the CPU); the eager tests above cover the same update code.
    cfg = to_train_config(
        compose_config(overrides(kjv_data, **DEEPSEEK, **{"trainer.compile": True}))
    )
    trainer = Trainer(cfg, output_dir=tmp_path)
    try:
        router = next(m.router for m in trainer.module.modules() if hasattr(m, "router"))
        micro = trainer.sampler.next_step()
        trainer.runner.forward_backward([trainer.collate(trainer.data.train, i) for i in micro])
        assert router.step_counts.sum() == 8 * 64 * cfg.model.moe.top_k  # counted once
        trainer.optimizer.zero_grad(set_to_none=True)
        router.step_counts.zero_()
        trainer.train_step()
        assert router.expert_bias.abs().sum() > 0
    finally:
        trainer.close()


def test_expert_parallel_over_context_parallel_ranks_matches_one_process(
    pool: DistributedPool, kjv_data: Path, tmp_path: Path
) -> None:
    # ep carved out of cp (cp=2, dp=1): each rank routes its load-balanced half of every
    # sequence. Balancing off: an auxiliary loss is a product of per-rank token statistics, so
    # under cp it is computed on other token sets than in one process (as in Megatron), which
    # moves the curve by ~1e-4; everything else must match.
    steps = {"trainer.max_steps": 6, "model.moe.balancing": "none"}
    single = train_checks.run_losses(overrides(kjv_data, **steps), tmp_path / "single")
    layout = {"parallel": "cp2", "parallel.ep": 2}
    per_rank = pool.run(
        train_checks.run_losses, overrides(kjv_data, **layout, **steps), tmp_path / "run"
    )
    assert per_rank[0] == per_rank[1]
    assert per_rank[0] == pytest.approx(single, rel=RTOL)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_tensor_and_sequence_parallel_run_matches_one_process(
    pool: DistributedPool, kjv_data: Path, tmp_path: Path, recompute: str
) -> None:
    # tp=2 with SP (parallel=tp2): each rank routes half of every sequence; the aux loss, the
    # z-loss and the logged load statistics (rank 0 logs) are those of the whole sequences,
    # so the loss curve (CE + aux + z) and the logged values are one process's up to fp32
    # summation order (RTOL); an unsummed router gradient moves the curve by ~1e-3. Full
    # recompute runs the routers' TP sums again inside the backward, on both ranks alike.
    steps = {
        "trainer.max_steps": 6,
        "model.moe.z_loss_coeff": 1e-3,
        "parallel.recompute": recompute,
    }
    single = train_checks.run_logged(overrides(kjv_data, **steps), tmp_path / "single")
    per_rank = pool.run(
        train_checks.run_logged, overrides(kjv_data, parallel="tp2", **steps), tmp_path / "run"
    )
    assert per_rank[0]["losses"] == per_rank[1]["losses"]
    assert per_rank[0]["losses"] == pytest.approx(single["losses"], rel=RTOL)
    expected = train_checks.model_metrics(single["rows"])
    assert {"moe_aux_loss", "moe_z_loss", "moe_max_vio"} <= {key for _, key in expected}
    assert train_checks.model_metrics(per_rank[0]["rows"]) == pytest.approx(expected, rel=RTOL)


@pytest.mark.parametrize("mode", ["fsdp", "zero1"])
def test_moe_under_fsdp_and_zero1_at_ep1_matches_one_process(
    mode: str, pool: DistributedPool, kjv_data: Path, tmp_path: Path
) -> None:
    # ep=1: the experts are ordinary parameters, sharded by FSDP2 (along the expert dim) or by
    # ZeRO-1's flat optimizer state like every other one.
    steps = {"trainer.max_steps": 6}
    single = train_checks.run_losses(overrides(kjv_data, **steps), tmp_path / "single")
    per_rank = pool.run(
        train_checks.run_losses, overrides(kjv_data, parallel=mode, **steps), tmp_path / "run"
    )
    assert per_rank[0] == pytest.approx(single, rel=RTOL)
