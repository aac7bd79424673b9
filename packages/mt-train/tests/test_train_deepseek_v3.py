"""The DeepSeek-V3 family in mt-train: published V3 and V2-Lite counts on the meta device, the
config's validation, and a tiny MLA + MoE model that learns on the bundled corpus."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import train_checks
from train_checks import tiny_overrides

import mt_parallel
from mt_train import compose_config, to_train_config
from mt_train.models import build_model, family_of, model_sizes
from mt_train.models.deepseek_v3 import active_parameters, attention_parameters, flops_per_token


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
    assert family.num_params(model) == total
    assert active_parameters(model, cfg) == active
    assert round(total / 1e9, 1 if published[0] < 100 else 0) == published[0]
    assert abs(active / 1e9 - published[1]) < published[2]  # the papers' rounding
    attention = model.layers[0].attention
    assert isinstance(attention, mt_parallel.MultiLatentAttention)
    assert sum(p.numel() for p in attention.parameters()) == attention_parameters(cfg)
    # 6·N_active (with the output head, N as counted above) + the attention score FLOPs.
    seq = 4096
    heads = cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    assert flops_per_token(cfg, seq) == 6.0 * active + 6.0 * cfg.n_layers * seq * heads


def test_deepseek_config_composes_and_rejects_bad_values() -> None:
    cfg = to_train_config(compose_config(["model=deepseek_v3_tiny", "parallel=ep2"])).model
    assert cfg.moe.score_function == "sigmoid" and cfg.moe.n_shared_experts == 1
    assert cfg.q_lora_rank == 64 and cfg.first_k_dense == 1
    lite = to_train_config(compose_config(["model=deepseek_v2_lite"])).model
    assert lite.q_lora_rank is None and lite.yarn.mscale_all_dim == 0.707
    bad = {
        "model.qk_rope_head_dim=15": "model.qk_rope_head_dim=15 must be even",
        "model.first_k_dense=4": "model.first_k_dense=4 must be in [0, model.n_layers=4)",
        "model.yarn.factor=0.5": "yarn.factor=0.5 must be >= 1",
        "parallel.tp=3": "tp=3 does not divide",
        "parallel.ep=3": "parallel.ep=3 does not divide moe.num_experts=16",
    }
    for override, message in bad.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            to_train_config(compose_config(["model=deepseek_v3_tiny", override]))


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
    # Aux-loss-free balancing: no balancing loss, the loss is the cross-entropy.
    assert last["moe_aux_loss"] == 0 and last["loss"] == pytest.approx(last["ce_loss"])
    # Block 0 is dense (first_k_dense=1): only block 1 has a router.
    per_layer = sorted(k for k in last if k.startswith("moe_max_vio_global/"))
    assert per_layer == ["moe_max_vio_global/layers.1.mlp.router"]
