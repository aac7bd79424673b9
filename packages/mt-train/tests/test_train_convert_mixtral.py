"""mt-convert for Mixtral: a tiny random transformers MixtralForCausalLM imports with matching
logits (hub layout and transformers 5's fused in-memory layout), exports back losslessly, and
mt options Mixtral cannot express are refused on export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_checks import export_round_trip

from mt_train.hf_checkpoints import load_model, main
from mt_train.models import build_model
from mt_train.models.moe.hf import MixtralHF

transformers = pytest.importorskip(
    "transformers", reason="the test extra: pip install 'mt-train[test]'"
)

VOCAB = 320


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=256,
        tie_word_embeddings=False, attn_implementation="eager",
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():  # spread the router scores so near-ties cannot flip a choice
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(20)
    folder = tmp_path_factory.mktemp("hf")
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))


def test_import_matches_hf_logits(hf_model, tmp_path: Path) -> None:
    model, folder = hf_model
    saved = load_file(str(next(folder.glob("*.safetensors"))))
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in saved  # the hub layout
    assert main(["import", str(folder), str(tmp_path / "mt")]) == 0
    ours = load_model(tmp_path / "mt").eval()
    with torch.no_grad():
        want = model(_tokens()).logits
        got = ours(_tokens())
    # Same fp32 math in a different op order (SDPA vs eager softmax, grouped GEMM vs per-expert
    # F.linear): a few ulps of logits of size ~1; 1e-4 absolute catches any layout error.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_fused_in_memory_layout_imports_too(hf_model) -> None:
    model, _ = hf_model
    hf_cfg = model.config.to_dict()
    adapter = MixtralHF()
    cfg = adapter.config_from_hf(hf_cfg)
    state = adapter.tensors_from_hf(dict(model.state_dict()), hf_cfg)
    ours = build_model(cfg, "cpu")
    ours.load_state_dict(state)
    ours.eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(_tokens()), model(_tokens()).logits, rtol=0, atol=1e-4)
    assert cfg.moe.aux_loss_coeff == pytest.approx(hf_cfg["router_aux_loss_coef"] * 2)


def test_round_trip_is_lossless(hf_model, tmp_path: Path) -> None:
    model, folder = hf_model
    export_round_trip(folder, tmp_path)
    reloaded = transformers.MixtralForCausalLM.from_pretrained(
        tmp_path / "back", use_kernels=False, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(_tokens()).logits, model(_tokens()).logits)
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert cfg["num_local_experts"] == 4 and cfg["router_aux_loss_coef"] == pytest.approx(
        model.config.router_aux_loss_coef
    )


def test_export_refuses_what_mixtral_cannot_express(tmp_path: Path) -> None:
    from mt_train.models import model_sizes

    cfg = model_sizes()["deepseek_moe_tiny"]
    with pytest.raises(ValueError, match=r"model\.moe\.score_function='sigmoid' has no Mixtral"):
        MixtralHF().config_to_hf(cfg, torch.float32)
    with pytest.raises(ValueError, match="needs num_local_experts, num_experts_per_tok"):
        MixtralHF().config_from_hf({"model_type": "mixtral", "hidden_size": 64})
    with pytest.raises(ValueError, match="sliding_window=4096 is not supported"):
        MixtralHF().config_from_hf(
            {**transformers.MixtralConfig().to_dict(), "sliding_window": 4096}
        )
