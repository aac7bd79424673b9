"""mt-convert for DeepSeek-V3's multi-token-prediction (MTP) layers, stored as the Hub checkpoint
stores them: ``model.layers.{num_hidden_layers + k}`` holds a decoder layer plus ``enorm``,
``hnorm``, ``eh_proj`` (input ``[enorm(embedding); hnorm(hidden)]``), ``shared_head.norm`` and
copies of the main ``embed_tokens`` and ``lm_head``.

The checkpoint is a tiny random transformers ``DeepseekV3ForCausalLM`` of ``L + D`` layers whose
last ``D`` layers become the MTP blocks, so the reference MTP logits come from transformers'
own decoder layer (MLA with interleaved RoPE, MoE) on the truncated sequences of the paper.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from train_checks import export_round_trip

from mt_train.checkpoint.checkpointer import TPLayout, load_into
from mt_train.checkpoint.files import CheckpointReader, checkpoint_folder
from mt_train.checkpoint.state import StateLayout
from mt_train.hf_checkpoints import (
    full_model_tensors,
    import_hf,
    load_model,
    main,
    model_config_of,
)
from mt_train.models import model_sizes
from mt_train.models.deepseek_v3 import DeepSeekV3
from mt_train.models.deepseek_v3.hf import DeepseekV3HF
from mt_train.models.llama.hf import LlamaHF
from mt_train.run_state import model_differences

transformers = pytest.importorskip(
    "transformers", reason="the test extra: pip install 'mt-train[test]'"
)

VOCAB, LAYERS, DEPTH, DIM, EPS = 320, 2, 2, 64, 1e-6
ATTENTION_GAIN = 4.0
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
        "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip


def _hf_config(layers: int) -> object:
    return transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5, n_group=4,
        topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=24,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        max_position_embeddings=640, rope_parameters=YARN, tie_word_embeddings=False,
        rms_norm_eps=EPS, attn_implementation="eager",
    )  # fmt: skip


@pytest.fixture(scope="module")
def hub_mtp(tmp_path_factory: pytest.TempPathFactory):
    """(transformers model of LAYERS + DEPTH layers, the MTP extras by HF name, the folder of
    a LAYERS-layer checkpoint with DEPTH MTP layers)."""
    torch.manual_seed(0)
    big = transformers.DeepseekV3ForCausalLM(_hf_config(LAYERS + DEPTH)).eval()
    with torch.no_grad():  # spread router scores (near-ties must not decide) and a real bias
        for layer in big.model.layers[1:]:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.05)
        for layer in big.model.layers:  # peaked attention, so the RoPE row order shows
            for proj in ("q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"):
                getattr(layer.self_attn, proj).weight.mul_(ATTENTION_GAIN)
    folder = tmp_path_factory.mktemp("hub_mtp")
    big.save_pretrained(folder, safe_serialization=True)
    (file,) = folder.glob("*.safetensors")
    tensors = load_file(str(file))
    extras: dict[str, torch.Tensor] = {}
    for k in range(DEPTH):
        layer = f"model.layers.{LAYERS + k}"
        for norm in ("enorm", "hnorm", "shared_head.norm"):  # gains ≠ 1 expose a swap
            extras[f"{layer}.{norm}.weight"] = 1.0 + 0.2 * torch.randn(DIM)
        extras[f"{layer}.eh_proj.weight"] = 0.1 * torch.randn(DIM, 2 * DIM)
        extras[f"{layer}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        extras[f"{layer}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({**tensors, **extras}, str(file), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config.update(num_hidden_layers=LAYERS, num_nextn_predict_layers=DEPTH)
    (folder / "config.json").write_text(json.dumps(config))
    return big, extras, folder


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def _reference_mtp_logits(big, extras, tokens_BT: torch.Tensor) -> list[torch.Tensor]:
    """MTP depth k's logits at positions ``0 .. T-k-1`` (the paper's truncated sequences):
    transformers' decoder layers for the main stack and the MTP blocks, the rest written out."""
    m = big.model

    def run(layers, x_BTD: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x_BTD.shape[1])[None]
        rope = m.rotary_emb(x_BTD, positions)
        n = x_BTD.shape[1]
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
        for layer in layers:
            x_BTD = layer(
                x_BTD, attention_mask=causal, position_ids=positions, position_embeddings=rope
            )
        return x_BTD

    h_BTD = run(m.layers[:LAYERS], m.embed_tokens(tokens_BT))
    logits = []
    for k in range(1, DEPTH + 1):
        layer = f"model.layers.{LAYERS + k - 1}"
        e_BTD = m.embed_tokens(tokens_BT[:, k:])
        embedded_BTD = _rms_norm(e_BTD, extras[f"{layer}.enorm.weight"])
        hidden_BTD = _rms_norm(h_BTD[:, : e_BTD.shape[1]], extras[f"{layer}.hnorm.weight"])
        x_BTD = torch.cat([embedded_BTD, hidden_BTD], dim=-1) @ extras[f"{layer}.eh_proj.weight"].T
        h_BTD = run([m.layers[LAYERS + k - 1]], x_BTD)
        logits.append(big.lm_head(_rms_norm(h_BTD, extras[f"{layer}.shared_head.norm.weight"])))
    return logits


def test_imported_mtp_logits_and_losses_match_a_transformers_reference(hub_mtp, tmp_path) -> None:
    big, extras, folder = hub_mtp
    assert main(["import", str(folder), str(tmp_path / "mt")]) == 0
    ours = load_model(tmp_path / "mt").train()
    assert len(ours.mtp) == DEPTH
    sequence = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(1))
    tokens_BT, targets_BT = sequence[:, :-1], sequence[:, 1:]
    T = tokens_BT.shape[1]
    with torch.no_grad():
        want = _reference_mtp_logits(big, extras, tokens_BT)
        _, logged = ours.loss(ours(tokens_BT), targets_BT)
        ours(tokens_BT)
        got = list(ours._mtp_logits)
    for k in range(1, DEPTH + 1):
        # Same fp32 math in another op order: a few ulps of logits of size ~1 (2.1e-7 seen);
        # 1e-5 is far below what the MTP block's RoPE row order (2.2e-3 when left out) or a
        # swap of enorm/hnorm (0.2) moves them by.
        torch.testing.assert_close(got[k - 1][:, : T - k], want[k - 1], rtol=0, atol=1e-5)
        reference = F.cross_entropy(want[k - 1].flatten(0, 1), targets_BT[:, k:].flatten())
        # |Δ log-softmax| <= 2·max|Δ logit|, so the mean losses agree to 2e-5.
        assert abs(logged[f"mtp_loss_{k}"].item() - reference.item()) <= 2e-5


def test_mtp_round_trip_is_lossless(hub_mtp, tmp_path: Path) -> None:
    big, _, folder = hub_mtp
    back = export_round_trip(folder, tmp_path)
    config = json.loads((back / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_nextn_predict_layers"]) == (LAYERS, DEPTH)
    reloaded = transformers.DeepseekV3ForCausalLM.from_pretrained(
        back, attn_implementation="eager"
    ).eval()
    tokens_BT = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        main_model = transformers.DeepseekV3ForCausalLM(_hf_config(LAYERS)).eval()
        state = {k: v for k, v in big.state_dict().items() if not k.startswith("model.layers.")}
        for i in range(LAYERS):
            state |= {
                f"model.layers.{i}.{k}": v for k, v in big.model.layers[i].state_dict().items()
            }
        main_model.load_state_dict(state)
        assert torch.equal(reloaded(tokens_BT).logits, main_model(tokens_BT).logits)


def test_transformers_mtp_model_reads_the_exported_depth_1(hub_mtp, tmp_path, monkeypatch):
    """transformers' own reader of DeepSeek MTP layers (``MtpModel``, a drafting model) loads
    the export and its depth-1 logits equal mt's. Depth 2 is not compared: ``MtpModel`` passes
    the normed state on (hf.py's docstring)."""
    folder = hub_mtp[2]
    assert main(["import", str(folder), str(tmp_path / "mt")]) == 0
    assert main(["export", str(tmp_path / "mt"), str(tmp_path / "back")]) == 0
    # MtpModel finds the MTP keys through this pattern, which transformers writes for V3's 61.
    monkeypatch.setattr(
        transformers.DeepseekV3ForCausalLM,
        "_keys_to_ignore_on_load_unexpected",
        [rf"model\.layers\.({LAYERS}|{LAYERS + 1})\..*"],
    )
    hf_main = transformers.DeepseekV3ForCausalLM.from_pretrained(
        tmp_path / "back", attn_implementation="eager"
    ).eval()
    drafter = transformers.modeling_layers.MtpModel.from_pretrained(hf_main).eval()
    ours = load_model(tmp_path / "mt").train()
    tokens_BT = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    T = tokens_BT.shape[1]
    with torch.no_grad():
        before_norm: list[torch.Tensor] = []
        hf_main.model.norm.register_forward_hook(lambda m, i, o: before_norm.append(i[0]))
        hf_main.model(tokens_BT)
        h_BTD = drafter.forward_layer(
            0, before_norm[0][:, : T - 1], torch.arange(1, T)[None], None,
            input_ids=tokens_BT[:, 1:],
        )  # fmt: skip
        want = drafter._project_to_logits(h_BTD)
        ours(tokens_BT)
        got = ours._mtp_logits[0][:, : T - 1]
    # As the reference comparison above: fp32 in another op order (4.5e-8 seen).
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_mtp_depth_selects_how_many_layers_are_imported(hub_mtp, tmp_path, capsys) -> None:
    folder = hub_mtp[2]
    full = load_model(import_hf(folder, tmp_path / "all")).state_dict()
    for depth in (1, 0):
        lines: list[str] = []
        root = import_hf(folder, tmp_path / f"d{depth}", mtp_depth=depth, log=lines.append)
        assert lines == [
            f"skipping {DEPTH - depth} of the checkpoint's {DEPTH} multi-token-prediction "
            f"layers (model.layers.{LAYERS + depth}..{LAYERS + DEPTH - 1}; --mtp-depth={depth})"
        ]
        model = load_model(root)
        assert len(model.mtp) == depth
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, full[name]), name
    assert main(["import", str(folder), str(tmp_path / "x"), "--mtp-depth", "3"]) != 0
    assert (
        "--mtp-depth=3 but the checkpoint holds 2 multi-token-prediction layers "
        "(num_nextn_predict_layers=2); valid: 0 to 2" in capsys.readouterr().err
    )


def test_export_mtp_depth_writes_the_first_modules(hub_mtp, tmp_path, capsys) -> None:
    folder = hub_mtp[2]
    original = load_file(str(next(folder.glob("*.safetensors"))))
    assert main(["import", str(folder), str(tmp_path / "mt")]) == 0
    for depth in (1, 0):
        out = tmp_path / f"back{depth}"
        assert main(["export", str(tmp_path / "mt"), str(out), "--mtp-depth", str(depth)]) == 0
        config = json.loads((out / "config.json").read_text())
        assert config["num_nextn_predict_layers"] == depth
        back = load_file(str(out / "model.safetensors"))
        layers = [f"model.layers.{LAYERS + k}." for k in range(depth, DEPTH)]
        assert back.keys() == {k for k in original if not k.startswith(tuple(layers))}
        assert all(torch.equal(tensor, original[k]) for k, tensor in back.items())
    assert main(["export", str(tmp_path / "mt"), str(tmp_path / "x"), "--mtp-depth", "3"]) != 0
    assert (
        "--mtp-depth=3 but the checkpoint's model has model.mtp_depth=2; valid: 0 to 2"
        in capsys.readouterr().err
    )


def test_init_from_loads_the_first_mtp_depth_modules(hub_mtp, tmp_path: Path) -> None:
    """``checkpoint.init_from``'s loader (``load_into``) with ``model.mtp_depth`` below, at and
    above the imported depth."""
    folder = checkpoint_folder(import_hf(hub_mtp[2], tmp_path / "mt"))
    reader = CheckpointReader(folder)
    cfg, full = model_config_of(reader), full_model_tensors(reader)

    def init_from(depth: int) -> DeepSeekV3:
        model = DeepSeekV3(dataclasses.replace(cfg, mtp_depth=depth))
        load_into(reader, model, None, StateLayout.of(model, None), TPLayout({}, 0, 1), "cpu")
        return model

    for depth in range(DEPTH + 1):
        for name, tensor in init_from(depth).state_dict().items():
            assert torch.equal(tensor, full[name]), name
    with pytest.raises(KeyError, match=re.escape(f"the saved state has no 'model/mtp.{DEPTH}.")):
        init_from(DEPTH + 1)
    deeper = dataclasses.replace(cfg, mtp_depth=DEPTH + 1)
    assert f"mtp_depth={DEPTH} (this run: {DEPTH + 1})" in model_differences(folder, deeper)


def test_mtp_layers_the_config_does_not_name_or_unshared_copies_are_refused(hub_mtp) -> None:
    folder = hub_mtp[2]
    hf = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(next(folder.glob("*.safetensors"))))
    adapter = DeepseekV3HF()
    with pytest.raises(ValueError, match=re.escape("layers [2, 3] in the checkpoint, num_hidden")):
        adapter.import_view({**hf, "num_nextn_predict_layers": 1}, set(tensors), None)
    with pytest.raises(ValueError, match=re.escape("--mtp-depth=-1 but the checkpoint holds 2")):
        adapter.import_view(hf, set(tensors), -1)
    first = {n for n in tensors if not n.startswith(f"model.layers.{LAYERS + 1}.")}
    view, note = adapter.import_view(hf, first, None)
    assert view["num_nextn_predict_layers"] == 1
    assert note == (
        "the checkpoint holds 1 of its num_nextn_predict_layers=2 multi-token-prediction "
        "layers (transformers' save_pretrained writes none); importing 1"
    )
    head = f"model.layers.{LAYERS}.shared_head.head.weight"
    tensors[head] = tensors[head] + 1.0
    with pytest.raises(ValueError, match=re.escape(f"{head} differs from the main model's lm_h")):
        adapter.tensors_from_hf(tensors, hf)
    with pytest.raises(ValueError, match=r"--mtp-depth=1: architectures=\['LlamaForCausalLM'\]"):
        LlamaHF().import_view({"architectures": ["LlamaForCausalLM"]}, set(), 1)
    with pytest.raises(ValueError, match="--mtp-depth=1: model 'debug' has no multi-token-pre"):
        LlamaHF().export_view(model_sizes()["debug"], [], 1)


def test_export_writes_the_mtp_modules_under_the_hub_names() -> None:
    cfg = dataclasses.replace(
        model_sizes()["deepseek_v3_tiny"], vocab_size=VOCAB, n_layers=2, mtp_depth=2
    )
    state = DeepSeekV3(cfg).state_dict()
    adapter = DeepseekV3HF()
    hf = adapter.tensors_to_hf(state, cfg)
    assert adapter.config_to_hf(cfg, torch.float32)["num_nextn_predict_layers"] == 2
    for k in range(2):
        layer = f"model.layers.{2 + k}"
        assert torch.equal(hf[f"{layer}.eh_proj.weight"], state[f"mtp.{k}.proj.weight"])
        assert torch.equal(hf[f"{layer}.hnorm.weight"], state[f"mtp.{k}.hidden_norm.weight"])
        assert torch.equal(hf[f"{layer}.embed_tokens.weight"], state["embed.weight"])
        assert torch.equal(hf[f"{layer}.shared_head.head.weight"], state["output.weight"])
        assert (
            hf[f"{layer}.shared_head.head.weight"].data_ptr() != state["output.weight"].data_ptr()
        )
    plain_cfg = dataclasses.replace(cfg, mtp_depth=0)
    plain = adapter.tensors_to_hf(DeepSeekV3(plain_cfg).state_dict(), plain_cfg)
    assert not any(name.startswith("model.layers.2.") for name in plain)
