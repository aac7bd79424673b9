"""Hugging Face ``LlavaForConditionalGeneration`` ⇄ mt's vision-language model (``mt-convert``).

The vision tower is CLIP's (``CLIPVisionModel``: class token, pre- and post-LayerNorm, biased
linears), the projector LLaVA-1.5's, the decoder Llama (:mod:`mt_train.models.llama.hf` maps
its names and refuses what it does not compute). Three spellings of the prefixes are read:
transformers 5's (``model.vision_tower.``, ``model.multi_modal_projector.``,
``model.language_model.``, ``lm_head.``), transformers 4's (``vision_tower.``,
``multi_modal_projector.``, ``language_model.model.``, ``language_model.lm_head.``) and
llava-hf's hub layout (``vision_tower.vision_model.``); export writes what transformers 5's
``save_pretrained`` writes (the transformers 4 spelling, which it converts on load). Vision
names (``i`` a block)::

    embeddings.class_embedding / patch_embedding.weight / position_embedding.weight
                                           vision.embeddings.cls / patch / positions
    pre_layrnorm.*, post_layernorm.*       vision.pre_norm.*, vision.post_norm.*
    encoder.layers.i.self_attn.{q,k,v}_proj.*, out_proj.*
                                           vision.layers.i.attention.{q,k,v}_proj.*, o_proj.*
    encoder.layers.i.layer_norm{1,2}.*     vision.layers.i.norm{1,2}.*
    encoder.layers.i.mlp.fc{1,2}.*         vision.layers.i.mlp.fc{1,2}.*
    multi_modal_projector.linear_{1,2}.*   projector.linear_{1,2}.*

Refused with one line: a list ``vision_feature_layer`` (several layers concatenated), a
projector activation other than GELU, a vision activation other than quick GELU or GELU,
non-square images, and (on export, before anything is written) a projector token reduction
(``model.projector_reduction``: transformers' Llava projects every patch) and an encoder
without CLIP's class token and both norms. Import always gives ``projector_reduction=none``.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

import torch

from mt_train.models.family import HFAdapter, layer_groups
from mt_train.models.llama.hf import LlamaHF, hf_to_mt_name, mt_to_hf_name
from mt_train.models.vlm.config import VisionConfig, VLMConfig

_VISION_TOP = {
    "embeddings.class_embedding": "embeddings.cls",
    "embeddings.patch_embedding.weight": "embeddings.patch",
    "embeddings.position_embedding.weight": "embeddings.positions",
    "pre_layrnorm.weight": "pre_norm.weight",
    "pre_layrnorm.bias": "pre_norm.bias",
    "post_layernorm.weight": "post_norm.weight",
    "post_layernorm.bias": "post_norm.bias",
}
_VISION_LAYER = {
    "self_attn.q_proj": "attention.q_proj",
    "self_attn.k_proj": "attention.k_proj",
    "self_attn.v_proj": "attention.v_proj",
    "self_attn.out_proj": "attention.o_proj",
    "layer_norm1": "norm1",
    "layer_norm2": "norm2",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}
_HF_VISION_LAYER = re.compile(r"^encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_MT_VISION_LAYER = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
_PREFIXES = (  # spelling -> transformers 5's, longest first
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."),
    ("model.language_model.", "language_model."),
    ("language_model.model.", "language_model."),
    ("language_model.lm_head.", "lm_head."),
    ("lm_head.", "lm_head."),
)
GELU_NAMES = ("gelu", "gelu_pytorch_tanh")
FEATURE_SELECT = {"default": "patch", "full": "all"}


def _canonical(name: str) -> str:
    for prefix, canonical in _PREFIXES:
        if name.startswith(prefix):
            return canonical + name[len(prefix) :]
    raise ValueError(f"unexpected tensor {name!r} in a Hugging Face LLaVA checkpoint")


def hf_to_mt(name: str) -> str:
    """mt's name of a Hugging Face LLaVA tensor (any of the spellings of the docstring)."""
    name = _canonical(name)
    if name.startswith("vision_tower."):
        rest = name.removeprefix("vision_tower.")
        if rest in _VISION_TOP:
            return "vision." + _VISION_TOP[rest]
        match = _HF_VISION_LAYER.match(rest)
        if match and match.group(2) in _VISION_LAYER:
            i, part, kind = match.groups()
            return f"vision.layers.{i}.{_VISION_LAYER[part]}.{kind}"
    elif name.startswith("multi_modal_projector."):
        return "projector." + name.removeprefix("multi_modal_projector.")
    elif name.startswith("language_model."):
        return "language." + hf_to_mt_name("model." + name.removeprefix("language_model."))
    elif name == "lm_head.weight":
        return "language.output.weight"
    raise ValueError(f"unexpected tensor {name!r} in a Hugging Face LLaVA checkpoint")


def mt_to_hf(name: str) -> str:
    """The saved (transformers 4 spelling) name of an mt vision-language tensor."""
    if name.startswith("vision."):
        rest = name.removeprefix("vision.")
        top = {v: k for k, v in _VISION_TOP.items()}
        if rest in top:
            return "vision_tower." + top[rest]
        match = _MT_VISION_LAYER.match(rest)
        layer = {v: k for k, v in _VISION_LAYER.items()}
        if match and match.group(2) in layer:
            i, part, kind = match.groups()
            return f"vision_tower.encoder.layers.{i}.{layer[part]}.{kind}"
    elif name.startswith("projector."):
        return "multi_modal_projector." + name.removeprefix("projector.")
    elif name == "language.output.weight":
        return "language_model.lm_head.weight"
    elif name.startswith("language."):
        return "language_model." + mt_to_hf_name(name.removeprefix("language."))
    raise ValueError(f"unexpected tensor {name!r} in an mt vision-language checkpoint")


def vision_from_hf(v: dict[str, Any], hf: dict[str, Any]) -> VisionConfig:
    layer = hf.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise ValueError(
            f"vision_feature_layer={layer!r} is not supported: mt reads one layer's features"
        )
    act = v.get("hidden_act", "quick_gelu")
    if act not in ("quick_gelu", "gelu"):
        raise ValueError(f"vision hidden_act={act!r} is not supported; valid: quick_gelu, gelu")
    strategy = hf.get("vision_feature_select_strategy", "default")
    if strategy not in FEATURE_SELECT:
        raise ValueError(
            f"vision_feature_select_strategy={strategy!r}; valid: {', '.join(FEATURE_SELECT)}"
        )
    image_size = v.get("image_size", 224)
    if not isinstance(image_size, int):
        raise ValueError(f"image_size={image_size!r} is not supported: mt's encoder is square")
    return VisionConfig(
        image_size=image_size,
        patch_size=v.get("patch_size", 32),
        channels=v.get("num_channels", 3),
        dim=v["hidden_size"],
        n_layers=v["num_hidden_layers"],
        n_heads=v["num_attention_heads"],
        ffn_dim=v["intermediate_size"],
        act=act,
        norm_eps=float(v.get("layer_norm_eps", 1e-5)),
        cls_token=True,
        pre_norm=True,
        post_norm=True,
        feature_layer=layer,
        feature_select=FEATURE_SELECT[strategy],
    )


class LlavaHF(HFAdapter):
    """The vision-language family's Hugging Face adapter (module docstring)."""

    architectures = ("LlavaForConditionalGeneration",)
    model_types = ("llava",)

    def config_from_hf(self, hf: dict[str, Any], name: str = "hf_llava") -> VLMConfig:
        act = hf.get("projector_hidden_act", "gelu")
        if act != "gelu":
            raise ValueError(f"projector_hidden_act={act!r} is not supported: LLaVA-1.5 uses gelu")
        text = LlamaHF().config_from_hf({"model_type": "llama", **hf["text_config"]}, name)
        fields = {f: getattr(text, f) for f in text.__dataclass_fields__}
        return VLMConfig(
            **fields,
            vision=vision_from_hf(hf["vision_config"], hf),
            image_token_id=hf.get("image_token_index", hf.get("image_token_id", 32000)),
            projector_bias=hf.get("multimodal_projector_bias", True),
        )

    def config_to_hf(self, cfg: VLMConfig, dtype: torch.dtype) -> dict[str, Any]:
        if cfg.projector_reduction != "none":
            raise ValueError(
                f"model.projector_reduction={cfg.projector_reduction} (r="
                f"{cfg.projector_reduction_factor}) has no LlavaForConditionalGeneration "
                "equivalent: transformers' Llava projects every patch token; only "
                "projector_reduction=none exports"
            )
        v = cfg.vision
        if not (v.cls_token and v.pre_norm and v.post_norm):
            raise ValueError(
                "LlavaForConditionalGeneration's CLIP encoder needs model.vision.cls_token, "
                f"pre_norm and post_norm all true, got {v.cls_token}, {v.pre_norm}, {v.post_norm}"
            )
        text = LlamaHF().config_to_hf(cfg, dtype)
        for key in ("architectures", "torch_dtype", "dtype"):
            text.pop(key)
        dtype_name = str(dtype).removeprefix("torch.")
        strategy = {value: key for key, value in FEATURE_SELECT.items()}[v.feature_select]
        return {
            "architectures": list(self.architectures),
            "model_type": "llava",
            "image_token_index": cfg.image_token_id,
            "image_seq_length": cfg.image_tokens,
            "projector_hidden_act": "gelu",
            "multimodal_projector_bias": cfg.projector_bias,
            "vision_feature_layer": v.feature_layer,
            "vision_feature_select_strategy": strategy,
            "tie_word_embeddings": False,
            "text_config": text,
            "vision_config": {
                "model_type": "clip_vision_model",
                "hidden_size": v.dim,
                "intermediate_size": v.ffn_dim,
                "num_hidden_layers": v.n_layers,
                "num_attention_heads": v.n_heads,
                "num_channels": v.channels,
                "image_size": v.image_size,
                "patch_size": v.patch_size,
                "hidden_act": v.act,
                "layer_norm_eps": v.norm_eps,
                "projection_dim": v.dim,
            },
            "torch_dtype": dtype_name,
            "dtype": dtype_name,
        }

    def import_groups(self, names: Collection[str], hf: dict[str, Any]) -> list[list[str]]:
        """Every name converts on its own: the top-level tensors, then one group per vision
        and per language layer."""
        return layer_groups(names)

    def tensors_from_hf(
        self, tensors: dict[str, torch.Tensor], hf: dict[str, Any]
    ) -> dict[str, torch.Tensor]:
        if hf.get("tie_word_embeddings") or hf["text_config"].get("tie_word_embeddings"):
            raise ValueError("tie_word_embeddings=true is not supported for LLaVA checkpoints")
        return {hf_to_mt(k): v for k, v in tensors.items()}

    def export_groups(self, names: Collection[str], cfg: VLMConfig) -> list[list[str]]:
        """The top-level tensors, then one group per vision and per language layer."""
        return layer_groups(names)

    def tensors_to_hf(
        self, tensors: dict[str, torch.Tensor], cfg: VLMConfig
    ) -> dict[str, torch.Tensor]:
        return {mt_to_hf(k): v.contiguous() for k, v in tensors.items() if "fp8" not in k}
