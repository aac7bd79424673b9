"""mt-convert for DeepSeek-V3: tiny random transformers DeepseekV3ForCausalLM models (q-lora on
and off, YaRN factor 40 with mscale_all_dim 1, group-limited sigmoid routing, shared experts,
a dense first layer, interleaved RoPE) import with matching logits and expert choices, export
back losslessly, and what mt cannot compute is refused with one line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from train_checks import export_round_trip

from mt_parallel.moe import MoE
from mt_train.hf_checkpoints import load_model, main
from mt_train.models.deepseek_v3.hf import DeepseekV3HF

transformers = pytest.importorskip(
    "transformers", reason="the test extra: pip install 'mt-train[test]'"
)

VOCAB = 320
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
        "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip


def _hf_config(q_lora_rank: int | None) -> object:
    return transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, routed_scaling_factor=2.5, n_group=4, topk_group=2,
        num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=q_lora_rank,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        max_position_embeddings=640, rope_parameters=YARN, tie_word_embeddings=False,
        attn_implementation="eager",
    )  # fmt: skip


@pytest.fixture(scope="module", params=[24, None], ids=["q-lora", "no-q-lora"])
def hf_model(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(_hf_config(request.param)).eval()
    with torch.no_grad():  # spread router scores (near-ties must not decide) and a real bias
        for layer in model.model.layers[1:]:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.05)
    folder = tmp_path_factory.mktemp("hf")
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))


def _hf_expert_choices(model) -> list[torch.Tensor]:
    choices = []
    for layer in model.model.layers[1:]:
        layer.mlp.gate.register_forward_hook(lambda m, i, o: choices.append(o[2].sort(-1).values))
    return choices


def test_import_matches_hf_logits_and_expert_choices(hf_model, tmp_path: Path) -> None:
    model, folder = hf_model
    assert main(["import", str(folder), str(tmp_path / "mt")]) == 0
    ours = load_model(tmp_path / "mt").eval()
    ours_choices: list[torch.Tensor] = []
    for module in ours.modules():
        if isinstance(module, MoE):
            module.router.register_forward_hook(
                lambda m, i, o: ours_choices.append(o.indices_TK.sort(-1).values)
            )
    hf_choices = _hf_expert_choices(model)
    with torch.no_grad():
        want = model(_tokens()).logits
        got = ours(_tokens())
    # Same fp32 math in another op order (SDPA vs eager softmax, grouped vs per-expert GEMMs,
    # fp64-then-fp32 RoPE tables vs fp32 ones): a few ulps of logits of size ~1; 1e-4
    # absolute catches any layout, RoPE-order or scale error (a RoPE-order error: 4.6e-3).
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert len(ours_choices) == len(hf_choices) == 2
    for mine, theirs in zip(ours_choices, hf_choices, strict=True):
        assert torch.equal(mine, theirs)


def test_round_trip_is_lossless(hf_model, tmp_path: Path) -> None:
    model, folder = hf_model
    export_round_trip(folder, tmp_path)
    reloaded = transformers.DeepseekV3ForCausalLM.from_pretrained(
        tmp_path / "back", attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(_tokens()).logits, model(_tokens()).logits)


def test_unsupported_configs_are_refused_with_one_line() -> None:
    base = _hf_config(24).to_dict()
    adapter = DeepseekV3HF()
    cases = {
        "hidden_act": ("gelu", "hidden_act='gelu' is not supported"),
        "rms_norm_eps": (1e-5, "rms_norm_eps=1e-05 is not supported"),
        "num_key_value_heads": (2, "num_key_value_heads=2 ≠ num_attention_heads=4"),
        "n_shared_experts": (0, "n_shared_experts=0 is not supported"),
        "rope_parameters": ({**YARN, "rope_type": "longrope"}, "rope type 'longrope'"),
    }
    for key, (value, message) in cases.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            adapter.config_from_hf({**base, key: value})
    from mt_train.models import model_sizes

    with pytest.raises(ValueError, match=r"model\.moe\.score_function='softmax' has no Deepseek"):
        adapter.config_to_hf(model_sizes()["deepseek_v2_lite"], torch.float32)
