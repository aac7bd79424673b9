"""The DeepSeek-V3 family in mt-train: published V3 and V2-Lite counts on the meta device, the
config's validation, and a tiny MLA + MoE model that learns on the bundled corpus."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import train_checks
from train_checks import tiny_overrides

import mt_parallel
import mt_parallel as mp
from mt_train import compose_config, to_train_config
from mt_train.models import build_model, family_of, model_sizes
from mt_train.models.deepseek_v3 import (
    DeepSeekV3,
    DeepSeekV3Config,
    active_parameters,
    attention_parameters,
    flops_per_token,
    mtp_parameters,
)


@pytest.mark.parametrize(
    ("size", "total", "active", "published"),
    [
        # Exact counts of the Hugging Face config shapes (module docstring of
        # mt_train.models.deepseek_v3.model: total = every parameter, the main model without
        # the MTP module; active = what a token uses, without the input-embedding lookup).
        # DeepSeek-V3 paper: 671B total, 37B activated. With the MTP module (11,610,067,968
        # of its own + its copies of embedding and head) and the 58+1 expert-bias buffers the
        # sum is the 684,489,845,504 of the Hub checkpoint.
        ("deepseek_v3_671b", 671_026_404_352, 36_625_603_584, (671, 37, 0.5)),
        # DeepSeek-V2 paper: V2-Lite has 15.7B total and 2.4B activated parameters (2.45B
        # here; with the input embedding 2.66B, so the paper leaves it out too).
        ("deepseek_v2_lite", 15_706_484_224, 2_451_435_008, (15.7, 2.4, 0.06)),
    ],
)
def test_published_parameter_counts(size: str, total: int, active: int, published) -> None:
    cfg = model_sizes()[size]
    model = build_model(cfg, "meta")
    family = family_of(cfg)
    assert family.name == "deepseek_v3"
    mtp = mtp_parameters(model)
    # V3's one MTP module: 11,610,067,968 of its own (embedding and head shared); V2-Lite none.
    assert mtp == (11_610_067_968 if cfg.mtp_depth else 0)
    assert family.num_params(model) - mtp == total
    assert active_parameters(model, cfg) == active
    assert round(total / 1e9, 1 if published[0] < 100 else 0) == published[0]
    assert abs(active / 1e9 - published[1]) < published[2]  # the papers' rounding
    attention = model.layers[0].attention
    assert isinstance(attention, mt_parallel.MultiLatentAttention)
    assert sum(p.numel() for p in attention.parameters()) == attention_parameters(cfg)
    # 6·N_active (with the output head, N as counted above) + the attention score FLOPs; an
    # MTP depth adds its module's parameters a token uses, the shared head and one attention.
    seq = 4096
    heads = cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    main_only = dataclasses.replace(cfg, mtp_depth=0)
    assert flops_per_token(main_only, seq) == 6.0 * active + 6.0 * cfg.n_layers * seq * heads
    if cfg.mtp_depth:
        skipped = (cfg.moe.num_experts - cfg.moe.top_k) * 3 * cfg.dim * cfg.moe.expert_ffn_dim
        mtp_active = mtp - skipped + cfg.vocab_size * cfg.dim
        extra = 6.0 * mtp_active + 6.0 * seq * heads
        assert flops_per_token(cfg, seq) == pytest.approx(
            flops_per_token(main_only, seq) + extra, rel=1e-15
        )


def test_deepseek_config_composes_and_rejects_bad_values() -> None:
    cfg = to_train_config(compose_config(["model=deepseek_v3_tiny", "parallel=ep2"])).model
    assert cfg.moe.score_function == "sigmoid" and cfg.moe.n_shared_experts == 1
    assert cfg.q_lora_rank == 64 and cfg.first_k_dense == 1
    sequence_parallel = to_train_config(compose_config(["model=deepseek_v3_tiny", "parallel=tp2"]))
    assert sequence_parallel.parallel.sequence_parallel  # MLA and MoE both run under SP
    lite = to_train_config(compose_config(["model=deepseek_v2_lite"])).model
    assert lite.q_lora_rank is None and lite.yarn.mscale_all_dim == 0.707
    bad = {
        "model.qk_rope_head_dim=15": "model.qk_rope_head_dim=15 must be even",
        "model.first_k_dense=4": "model.first_k_dense=4 must be in [0, model.n_layers=4)",
        "model.yarn.factor=0.5": "yarn.factor=0.5 must be >= 1",
        "parallel.tp=3": "tp=3 does not divide",
        "parallel.ep=3": "parallel.ep=3 does not divide moe.num_experts=16",
        "model.mtp_depth=-1": "model.mtp_depth=-1 must be an integer >= 0",
        "model.mtp_loss_weight_switch_step=-5": "model.mtp_loss_weight_switch_step=-5 must be",
        "model.mtp_loss_weight_final=-1": "model.mtp_loss_weight_final=-1.0 must be >= 0",
    }
    for override, message in bad.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            to_train_config(compose_config(["model=deepseek_v3_tiny", *override.split()]))
    # MTP under pp under FSDP2, the first and last chunks on different ranks (the embedding
    # copy) or on one (the embedding its own FSDP2 unit).
    for schedule in ("zero_bubble", "zbv", "dualpipev"):
        pipelined = ["model=deepseek_v3_tiny", "parallel=pp2", f"parallel.pp_schedule={schedule}"]
        fsdp = to_train_config(compose_config([*pipelined, "parallel.data_parallel=fsdp"]))
        assert fsdp.model.mtp_depth == 1 and fsdp.parallel.pp_schedule == schedule


def test_deepseek_v3_tiny_learns(kjv_data: Path, tmp_path: Path) -> None:
    plain = [o for o in tiny_overrides(kjv_data) if not o.startswith("model.")]
    overrides = [
        *plain, "model=deepseek_v3_tiny", "model.dim=64", "model.n_layers=2", "model.ffn_dim=128",
        "model.q_lora_rank=32", "model.kv_lora_rank=16", "model.qk_nope_head_dim=16",
        "model.qk_rope_head_dim=8", "model.v_head_dim=16", "model.moe.expert_ffn_dim=32",
        "scheduler=constant", "trainer.max_steps=16", "trainer.log_interval=1",
    ]  # fmt: skip
    summary = train_checks.fit(overrides, tmp_path)[1]
    assert summary.losses[-1] < summary.losses[0] - 0.5, summary.losses
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "moe_max_vio" in r]
    last = logged[-1]
    assert last["moe_aux_loss"] == 0  # aux-loss-free balancing: no balancing loss
    # Block 0 is dense (first_k_dense=1): block 1 and the MTP module's block have routers.
    per_layer = sorted(k for k in last if k.startswith("moe_max_vio_global/"))
    assert per_layer == [
        "moe_max_vio_global/layers.1.mlp.router", "moe_max_vio_global/mtp.0.block.mlp.router"
    ]  # fmt: skip
    # MTP depth 1 with λ = 0.3: loss = CE + 0.3·MTP_1, the MTP loss logged on its own.
    assert last["loss"] == pytest.approx(last["ce_loss"] + 0.3 * last["mtp_loss_1"], rel=1e-5)
    assert rows[0].get("mtp_loss_1", 0) > last["mtp_loss_1"] > 0


def _tiny(**overrides: object) -> DeepSeekV3Config:
    base = dataclasses.replace(
        model_sizes()["deepseek_v3_tiny"], vocab_size=96, dim=32, n_layers=2, n_heads=2,
        q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        ffn_dim=64,
    )  # fmt: skip
    base.moe = dataclasses.replace(base.moe, expert_ffn_dim=16)
    return dataclasses.replace(base, **overrides)


def _reference_mtp_losses(model, tokens, targets, docs) -> list[torch.Tensor]:
    """The paper's truncated formulation: depth k runs on positions [0, T-k) only, with
    tokens[k:] embedded, targets[k:] predicted, pairs across documents ignored."""
    T = tokens.shape[1]
    h = model.embed(tokens)
    for layer in model.layers:
        h = layer(h, None, docs)
    losses = []
    for k, module in enumerate(model.mtp, start=1):
        h = h[:, : T - k]
        e = model.embed(tokens[:, k:])
        doc = docs[:, : T - k]
        x = module.proj(torch.cat([module.embed_norm(e), module.hidden_norm(h)], -1))
        h = module.block(x, None, doc)
        logits = model.output(module.norm(h))
        want = targets[:, k:].clone()
        want[docs[:, : T - k] != docs[:, k:]] = -100
        losses.append(F.cross_entropy(logits.flatten(0, 1), want.flatten(), ignore_index=-100))
    return losses


@pytest.mark.parametrize("depth", [1, 2])
def test_mtp_losses_equal_the_truncated_reference(depth: int) -> None:
    cfg = _tiny(mtp_depth=depth, mtp_loss_weight=0.25)
    model = DeepSeekV3(cfg).double()
    mp.init_weights(model, seed=4)
    model.train()
    gen = torch.Generator().manual_seed(5)
    stream = torch.randint(0, 96, (2, 25), generator=gen)
    tokens, targets = stream[:, :-1], stream[:, 1:].clone()
    targets[0, 3] = -100  # an ignored target stays ignored at every depth
    docs = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])  # packed documents in row 0
    logits = model(tokens, None, docs)
    loss, logged = model.loss(logits, targets)
    model.eval()  # the reference calls the same modules; no aux-loss side effects needed
    with torch.no_grad():
        expected = _reference_mtp_losses(model, tokens, targets, docs)
    assert [k for k in logged if k.startswith("mtp_loss_")] == [
        f"mtp_loss_{k}" for k in range(1, depth + 1)
    ]
    for k, want in enumerate(expected, start=1):
        # Both float64, the same modules; only SDPA over T vs T-k tokens differs: ulps.
        torch.testing.assert_close(logged[f"mtp_loss_{k}"], want, rtol=1e-12, atol=0)
    mtp_term = 0.25 / depth * sum(expected)
    ce_and_aux = loss.detach() - mtp_term
    torch.testing.assert_close(ce_and_aux, logged["ce_loss"] + _aux(logged), rtol=1e-12, atol=0)


def _aux(logged: dict) -> torch.Tensor:
    return logged["moe_aux_loss"] + logged["moe_z_loss"]


def test_mtp_weight_switches_after_its_step(kjv_data: Path, tmp_path: Path) -> None:
    cfg = _tiny(mtp_depth=1, mtp_loss_weight_switch_step=2, mtp_loss_weight_final=0.1)
    model = DeepSeekV3(cfg).double()
    mp.init_weights(model, seed=8)
    model.train()
    # The hook says when λ changed (a captured step must then be captured again); a rewind to
    # before the switch brings 0.3 back.
    assert [model.set_train_step(s) for s in (0, 1, 2, 3, 0)] == [False, False, True, False, True]
    model.set_train_step(2)
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(9))
    loss, logged = model.loss(model(tokens), tokens.roll(-1, 1))
    expected = logged["ce_loss"] + _aux(logged) + 0.1 * logged["mtp_loss_1"]
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-12, atol=0)
    # The trainer calls the hook before every step: after 2 steps λ is the final one.
    plain = [o for o in tiny_overrides(kjv_data) if not o.startswith("model.")]
    overrides = [
        *plain, "model=deepseek_v3_tiny", "model.dim=64", "model.n_layers=2",
        "model.ffn_dim=128", "model.moe.expert_ffn_dim=32", "trainer.max_steps=3",
        "model.mtp_loss_weight_switch_step=2", "model.mtp_loss_weight_final=0.05",
    ]  # fmt: skip
    trainer = train_checks.fit(overrides, tmp_path)[0]
    assert len(trainer.step_hooks) == 1 and trainer.module.mtp_weight == 0.05


def test_mtp_depth_zero_is_the_plain_model() -> None:
    with_mtp = DeepSeekV3(_tiny(mtp_depth=1)).double()
    mp.init_weights(with_mtp, seed=6)
    plain = DeepSeekV3(_tiny(mtp_depth=0)).double()
    state = {k: v for k, v in with_mtp.state_dict().items() if not k.startswith("mtp.")}
    plain.load_state_dict(state)
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(7))
    targets = tokens.roll(-1, 1)
    for model in (with_mtp, plain):
        model.train()
    logits, plain_logits = with_mtp(tokens), plain(tokens)
    assert torch.equal(logits, plain_logits)
    loss, logged = with_mtp.loss(logits, targets)
    plain_loss, plain_logged = plain.loss(plain_logits, targets)
    assert "mtp_loss_1" in logged and "mtp_loss_1" not in plain_logged
    # Aux-loss-free routing (no balancing loss): the losses differ by λ·MTP_1 exactly.
    torch.testing.assert_close(loss, plain_loss + 0.3 * logged["mtp_loss_1"], rtol=1e-12, atol=0)
    assert torch.equal(plain_loss, plain_logged["ce_loss"] + _aux(plain_logged))
    with_mtp.eval()  # evaluation: CE alone, no MTP forward
    assert torch.equal(
        with_mtp.loss(with_mtp(tokens), targets)[0], plain.eval().loss(plain(tokens), targets)[0]
    )


@pytest.fixture(scope="module")
def high_precision(kjv_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list, list]:
    """The job the FP8 and recompute runs modify, and its fp32 curve (trained once for both)."""
    plain = [o for o in tiny_overrides(kjv_data) if not o.startswith("model.")]
    # Rotary dims 16: kv_a's output (kv_lora_rank + rope) is then a multiple of 16 (FP8 GEMMs).
    base = [*plain, "model=deepseek_v3_tiny", "model.dim=64", "model.n_layers=2",
            "model.ffn_dim=128", "model.q_lora_rank=32", "model.kv_lora_rank=16",
            "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=16", "model.v_head_dim=16",
            "model.moe.expert_ffn_dim=32", "scheduler=constant", "trainer.max_steps=6"]  # fmt: skip
    return base, train_checks.fit(base, tmp_path_factory.mktemp("fp32"))[1].losses


@pytest.mark.parametrize(
    "mode", [{"fp8": "rowwise"}, {"parallel": "recompute"}], ids=["fp8-rowwise", "recompute"]
)
def test_deepseek_v3_tiny_trains_with_fp8_and_recompute(
    mode: dict, high_precision: tuple[list, list], tmp_path: Path
) -> None:
    base, reference = high_precision
    trainer, summary = train_checks.fit(
        base + [f"{k}={v}" for k, v in mode.items()], tmp_path / "m"
    )
    attention = trainer.module.layers[0].attention
    # FP8: every MLA projection, the replicated compressions included, runs in FP8 and the
    # curve stays within 5% of the high-precision one over 6 steps (rowwise E4M3 has a 2^-4
    # relative step; a broken FP8 GEMM gives O(1) loss differences). Recompute: the same math
    # run again, equal to fp32 rounding (1e-6).
    fp8 = {name: p.fp8_enabled for name, p in attention.named_children() if hasattr(p, "gemm")}
    assert fp8 and all(fp8.values()) == ("fp8" in mode), fp8
    assert summary.losses == pytest.approx(reference, rel=0.05 if "fp8" in mode else 1e-6)


def test_deepseek_v3_tiny_resumes_bit_exact(kjv_data: Path, tmp_path: Path) -> None:
    plain = [o for o in tiny_overrides(kjv_data) if not o.startswith("model.")]
    base = [*plain, "model=deepseek_v3_tiny", "model.dim=64", "model.n_layers=2",
            "model.ffn_dim=128", "model.moe.expert_ffn_dim=32", "scheduler=constant"]  # fmt: skip
    whole = train_checks.run_losses([*base, "trainer.max_steps=8"], tmp_path / "whole")
    # Its own step-4 checkpoint: under the constant schedule a run stopped at step 4 would
    # have written the same one.
    step = tmp_path / "whole" / "checkpoints" / "step-00000004"
    rest = train_checks.run_losses(
        [*base, "trainer.max_steps=8", f"checkpoint.resume={step}"], tmp_path / "rest"
    )
    # The aux-loss-free biases, the MTP module and the RNG state are in the checkpoint: exact.
    assert rest == whole[4:]


def test_readme_deepseek_commands_compose() -> None:
    import shlex

    readme = Path(__file__).parents[1] / "README.md"
    text = readme.read_text().split("### DeepSeek-V3 models", 1)[1].split("\n## ", 1)[0]
    commands = [shlex.split(line, comments=True)[1:] for line in text.splitlines()
                if line.startswith("mt-train ")]  # fmt: skip
    assert len(commands) == 4
    for args in commands:
        assert to_train_config(compose_config(args)).model.name == "deepseek_v3_tiny"
