"""mt-convert: a tiny random transformers LlamaForCausalLM imports with matching logits,
exports back losslessly, and trains from the imported weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_checks import tiny_overrides

from mt_train import Trainer, compose_config, to_train_config
from mt_train.hf_checkpoints import load_model, main

transformers = pytest.importorskip(
    "transformers", reason="the test extra: pip install 'mt-train[test]'"
)

ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # small, so the test's positions reach the scaled band
}


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        max_position_embeddings=256, rope_theta=500000.0, rope_scaling=dict(ROPE),
        tie_word_embeddings=False, attn_implementation="eager",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("hf")
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


def test_import_matches_hf_logits(hf_model, tmp_path: Path) -> None:
    model, folder = hf_model
    assert main(["import", str(folder), str(tmp_path / "mt")]) == 0
    ours = load_model(tmp_path / "mt")
    tokens = torch.randint(0, 320, (2, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(tokens).logits
        got = ours(tokens)
    # Same fp32 math in a different op order (SDPA vs eager softmax, RoPE tables): a few ulps of
    # logits of size ~1, so 1e-4 absolute is loose enough and still catches any layout error.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_round_trip_is_lossless(hf_model, tmp_path: Path) -> None:
    _, folder = hf_model
    assert main(["import", str(folder), str(tmp_path / "mt")]) == 0
    assert main(["export", str(tmp_path / "mt"), str(tmp_path / "back")]) == 0
    original = load_file(str(next(folder.glob("*.safetensors"))))
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert original.keys() == back.keys()
    for key, tensor in original.items():
        assert torch.equal(tensor, back[key]), key
    # use_kernels=False: recent transformers default to hub kernels, which are not installed.
    reloaded = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "back", use_kernels=False, attn_implementation="eager"
    )
    reloaded.eval()
    tokens = torch.randint(0, 320, (1, 32))
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, hf_model[0](tokens).logits)
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert cfg["rope_scaling"]["factor"] == 8.0 and cfg["num_key_value_heads"] == 2


def test_train_from_imported_weights(hf_model, kjv_data: Path, tmp_path: Path) -> None:
    _, folder = hf_model
    main(["import", str(folder), str(tmp_path / "mt")])
    overrides = tiny_overrides(
        kjv_data,
        **{"checkpoint.init_from": str(tmp_path / "mt"), "model.vocab_size": 320,
           "model.rope_scaling.original_max_position": 64, "trainer.max_steps": 2},
    )  # fmt: skip
    trainer = Trainer(to_train_config(compose_config(overrides)), output_dir=tmp_path / "run")
    try:
        imported = load_model(tmp_path / "mt")
        assert torch.equal(trainer.module.output.weight, imported.output.weight)
        trainer.fit()
    finally:
        trainer.close()


def test_convert_reports_bad_input(tmp_path: Path, capsys) -> None:
    assert main(["import", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "has no config.json" in capsys.readouterr().err
