"""mt-convert: a tiny random transformers LlamaForCausalLM imports with matching logits,
exports back losslessly, and trains from the imported weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_checks import export_round_trip, tiny_overrides

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
    export_round_trip(folder, tmp_path)
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
    assert cfg["torch_dtype"] == "float32"  # what the file holds


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


def _edited_import(folder: Path, tmp_path: Path, **changes: object) -> tuple[int, Path]:
    """Import a copy of ``folder`` whose config.json has ``changes`` (None deletes a key)."""
    edited = tmp_path / "edited"
    edited.mkdir(exist_ok=True)
    for path in folder.glob("*.safetensors"):
        (edited / path.name).write_bytes(path.read_bytes())
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (edited / "config.json").write_text(json.dumps(cfg))
    return main(["import", str(edited), str(tmp_path / "mt")]), tmp_path / "mt"


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported: mt's Llama MLP is SwiGLU"),
        ({"attention_bias": True}, "attention_bias=true is not supported"),
        ({"mlp_bias": True}, "mlp_bias=true is not supported"),
        ({"head_dim": 32}, "head_dim=32 is not supported: mt's Llama has head_dim = hidden_size"),
        ({"pretraining_tp": 2}, "pretraining_tp=2 is not supported"),
        ({"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_parameters": None},
            "rope type 'yarn' is not supported; valid: default, llama3",
        ),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_parameters": None},
            "rope type 'linear' is not supported",
        ),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not supported"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}, "rope_parameters": None},
            "llama3 rope scaling in config.json lacks low_freq_factor, high_freq_factor",
        ),
        (
            {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
            "architectures=['GPT2LMHeadModel'] (model_type='gpt2') has no registered model "
            "family; readable: DeepseekV3ForCausalLM, LlamaForCausalLM, "
            "LlavaForConditionalGeneration, MixtralForCausalLM",
        ),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else None,
)
def test_import_refuses_what_it_does_not_compute(
    hf_model, tmp_path: Path, capsys, changes: dict, expected: str
) -> None:
    status, _ = _edited_import(hf_model[1], tmp_path, **changes)
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and err.startswith("mt-convert: error: "), err
    assert expected in err, err


def test_llama3_rope_without_original_length_falls_back_as_transformers_does(
    hf_model, tmp_path: Path
) -> None:
    # transformers' _compute_llama3_parameters uses max_position_embeddings when the rope
    # parameters lack original_max_position_embeddings; the import does the same.
    rope = {k: v for k, v in ROPE.items() if k != "original_max_position_embeddings"}
    status, root = _edited_import(
        hf_model[1], tmp_path, rope_scaling=rope, rope_parameters=None, max_position_embeddings=96
    )
    assert status == 0
    scaling = json.loads(next(root.glob("step-*/manifest.json")).read_text())["model"]
    assert scaling["rope_scaling"]["original_max_position"] == 96


def test_tied_embeddings_import_untied_and_refuse_a_differing_head(
    hf_model, tmp_path: Path, capsys
) -> None:
    status, _ = _edited_import(hf_model[1], tmp_path, tie_word_embeddings=True)
    err = capsys.readouterr().err
    # The fixture's head differs from its embedding: a tied config cannot mean both.
    assert status == 2 and "lm_head.weight differs from model.embed_tokens.weight" in err, err
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        tie_word_embeddings=True, attn_implementation="eager",
    )  # fmt: skip
    tied = transformers.LlamaForCausalLM(config).eval()
    tied.save_pretrained(tmp_path / "tied", safe_serialization=True)
    assert main(["import", str(tmp_path / "tied"), str(tmp_path / "tied_mt")]) == 0
    ours = load_model(tmp_path / "tied_mt")
    assert torch.equal(ours.output.weight, ours.embed.weight)
    tokens = torch.randint(0, 320, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), tied(tokens).logits, rtol=0, atol=1e-4)


def test_export_labels_the_dtype_it_writes(hf_model, tmp_path: Path) -> None:
    model, _ = hf_model
    bf16 = tmp_path / "hf_bf16"
    model.to(torch.bfloat16).save_pretrained(bf16, safe_serialization=True)
    model.to(torch.float32)
    assert main(["import", str(bf16), str(tmp_path / "mt")]) == 0
    assert main(["export", str(tmp_path / "mt"), str(tmp_path / "back")]) == 0
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert {t.dtype for t in back.values()} == {torch.bfloat16}
    assert cfg["torch_dtype"] == "bfloat16" and cfg["dtype"] == "bfloat16"
