"""The vision-language family: published LLaVA-1.5-7B parameter count, image placement,
freezing, and ``mt-convert`` against transformers' LlavaForConditionalGeneration."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from train_checks import export_round_trip
from vlm_checks import fp8_tensorwise_model

from mt_train.hf_checkpoints import load_model, main
from mt_train.models import build_model, family_of, model_sizes
from mt_train.models.vlm import IGNORE_INDEX, VLMConfig

transformers = pytest.importorskip(
    "transformers", reason="the test extra: pip install 'mt-train[test]'"
)

# llava-hf/llava-1.5-7b-hf's config.json (the shapes; token ids and dtypes do not change counts).
LLAVA_1_5_7B = {
    "vision_config": {
        "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
        "num_attention_heads": 16, "image_size": 336, "patch_size": 14, "projection_dim": 768,
        "hidden_act": "quick_gelu",
    },
    "text_config": {
        "vocab_size": 32064, "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    },
    "image_token_index": 32000, "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default", "projector_hidden_act": "gelu",
}  # fmt: skip


def test_llava_1_5_7b_has_the_published_parameter_count() -> None:
    cfg = model_sizes()["llava_1_5_7b"]
    family = family_of(cfg)
    ours = family.num_params(build_model(cfg, "meta"))
    hf_config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**LLAVA_1_5_7B["vision_config"]),
        text_config=transformers.LlamaConfig(**LLAVA_1_5_7B["text_config"]),
        **{k: v for k, v in LLAVA_1_5_7B.items() if not k.endswith("_config")},
    )
    with torch.device("meta"):
        published = sum(
            p.numel() for p in transformers.LlavaForConditionalGeneration(hf_config).parameters()
        )
    assert ours == published == 7_063_427_072  # LLaVA-1.5-7B: "7.06B params"
    assert cfg.image_tokens == 576


def tiny(**overrides: object) -> VLMConfig:
    cfg = model_sizes()["vlm_tiny"]
    return dataclasses.replace(cfg, vocab_size=320, **overrides)


def test_images_fill_their_placeholders_and_counts_are_checked() -> None:
    torch.manual_seed(0)
    cfg = tiny()
    model = build_model(cfg, "cpu", seed=1).double().eval()  # eval: no dropout masks
    L = cfg.image_tokens
    tokens = torch.randint(0, 256, (2, 3 * L + 4))
    tokens[0, 1 : 1 + L] = cfg.image_token_id  # sample 0: one image, sample 1: two
    tokens[1, 2 : 2 + 2 * L] = cfg.image_token_id
    images = torch.rand(3, 1, 8, 8, dtype=torch.float64)
    logits = model(tokens, images=images)
    # The same placement by hand: image k's projected features are run k of the placeholders.
    features = model.projector(model.vision(images)).reshape(-1, cfg.dim)
    x = model.language.embed(tokens)
    x[tokens == cfg.image_token_id] = features
    for layer in model.language.layers:
        x = layer(x)
    torch.testing.assert_close(logits, model.language.output(model.language.norm(x)))
    # Changing the second image changes only sample 1's logits after its placeholders.
    other = images.clone()
    other[1] += 1
    changed = (model(tokens, images=other) - logits).abs().amax(-1)
    assert changed[0].max() == 0 and changed[1, 2:].min() > 0 and changed[1, :2].max() == 0
    with pytest.raises(ValueError, match=f"{3 * L} image placeholder tokens .* for 2 images"):
        model(tokens, images=images[:2])


def test_loss_only_on_unmasked_targets_and_counts() -> None:
    model = build_model(tiny(), "cpu", seed=1).double()
    logits = torch.randn(2, 5, 320, dtype=torch.float64)
    targets = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 3, 4, IGNORE_INDEX], [1, 2, 3, 4, 5]])
    loss, extras = model.loss(logits, targets)
    keep = targets != IGNORE_INDEX
    want = torch.nn.functional.cross_entropy(logits[keep], targets[keep])
    # Same fp64 log-sum-exp in another order: ulps of a loss of ~6.
    torch.testing.assert_close(loss.double(), want, rtol=1e-12, atol=1e-12)
    assert extras["masked_tokens"].item() == 3 and extras["loss_tokens"].item() == 7


@pytest.mark.parametrize(
    ("freeze", "trained"),
    [("none", {"vision", "projector", "language"}), ("encoder", {"projector", "language"}),
     ("encoder_and_decoder", {"projector"})],
)  # fmt: skip
def test_freeze_options(freeze: str, trained: set[str]) -> None:
    model = build_model(tiny(freeze=freeze), "cpu", seed=1)
    assert {n.split(".")[0] for n, p in model.named_parameters() if p.requires_grad} == trained


def test_bad_freeze_value_names_the_options() -> None:
    with pytest.raises(ValueError, match=r"model\.freeze=.all.; valid: none, encoder"):
        tiny(freeze="all")


@pytest.fixture(scope="module")
def hf_llava(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    torch.manual_seed(0)
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            image_size=8, patch_size=2, num_channels=3, hidden_act="quick_gelu",
        ),
        text_config=transformers.LlamaConfig(
            vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
        image_token_index=300, vision_feature_layer=-2, attn_implementation="eager",
    )  # fmt: skip
    model = transformers.LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a swapped name would show
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias") or "embedding" in name:
                param.add_(0.1 * torch.randn_like(param))
    folder = tmp_path_factory.mktemp("hf_llava")
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


def llava_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (2, 40), generator=g)
    tokens[0, 3:19] = 300  # 16 patch tokens per 8x8 image in 2x2 patches
    tokens[1, 10:26] = 300
    return tokens, torch.randn(2, 3, 8, 8, generator=g)


def test_import_matches_transformers_logits(hf_llava, tmp_path: Path) -> None:
    model, folder = hf_llava
    assert main(["import", str(folder), str(tmp_path / "mt")]) == 0
    ours = load_model(tmp_path / "mt")
    assert ours.cfg.vision.feature_layer == -2 and ours.cfg.image_token_id == 300
    tokens, images = llava_inputs()
    with torch.no_grad():
        want = model(input_ids=tokens, pixel_values=images).logits
        got = ours(tokens, images=images)
    # The same fp32 math in another op order (SDPA vs eager softmax, conv vs conv): a few ulps of
    # logits of size ~1, so 1e-4 absolute is loose enough and still catches any layout error.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_export_round_trip_is_lossless(hf_llava, tmp_path: Path) -> None:
    model, folder = hf_llava
    export_round_trip(folder, tmp_path)
    reloaded = transformers.LlavaForConditionalGeneration.from_pretrained(
        tmp_path / "back", use_kernels=False, attn_implementation="eager"
    ).eval()
    tokens, images = llava_inputs()
    with torch.no_grad():
        assert torch.equal(
            reloaded(input_ids=tokens, pixel_values=images).logits,
            model(input_ids=tokens, pixel_values=images).logits,
        )
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert cfg["architectures"] == ["LlavaForConditionalGeneration"]
    assert cfg["vision_feature_layer"] == -2 and cfg["image_token_index"] == 300


def test_hub_layout_names_import() -> None:
    from mt_train.models.vlm.hf import hf_to_mt

    hub = "vision_tower.vision_model.encoder.layers.3.self_attn.out_proj.bias"
    assert hf_to_mt(hub) == "vision.layers.3.attention.o_proj.bias"
    assert hf_to_mt("language_model.model.layers.0.mlp.up_proj.weight") == (
        "language.layers.0.mlp.up_proj.weight"
    )
    assert hf_to_mt("language_model.lm_head.weight") == "language.output.weight"


@pytest.mark.parametrize("fp8_vision", [True, False])
def test_fp8_covers_both_towers_unless_fp8_vision_is_off(fp8_vision: bool) -> None:
    cfg = tiny(fp8_vision=fp8_vision)
    model = fp8_tensorwise_model(cfg)
    fp8 = {n.split(".")[0] for n, m in model.named_modules() if getattr(m, "fp8_enabled", False)}
    assert fp8 == ({"vision", "projector", "language"} if fp8_vision else {"language"})
    assert not model.language.output.fp8_enabled  # the head stays high precision by default
    tokens = torch.full((2, 20), 65)
    tokens[:, 2:6] = cfg.image_token_id
    loss, _ = model.loss(model(tokens, images=torch.rand(2, 1, 8, 8)), tokens.roll(-1, 1))
    loss.backward()
    assert torch.isfinite(loss) and model.vision.embeddings.patch.grad.abs().sum() > 0
