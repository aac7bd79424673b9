"""Hugging Face ``LlamaForCausalLM`` ⇄ mt Llama: config and tensor names (``mt-convert``).

The two layouts hold the same tensors under different names; mt's attention uses the
rotate-half RoPE layout that Hugging Face uses, so no weight is permuted and a round trip is
bitwise lossless. Name map (``i`` a layer index)::

    model.embed_tokens.weight                          embed.weight
    model.layers.i.self_attn.{q,k,v,o}_proj.weight     layers.i.attention.{q,k,v,o}_proj.weight
    model.layers.i.mlp.{gate,up,down}_proj.weight      layers.i.mlp.{gate,up,down}_proj.weight
    model.layers.i.input_layernorm.weight              layers.i.attention_norm.weight
    model.layers.i.post_attention_layernorm.weight     layers.i.ffn_norm.weight
    model.norm.weight                                  norm.weight
    lm_head.weight                                     output.weight

Every field of transformers' ``LlamaConfig`` is either read, irrelevant to the logits (token
ids, ``use_cache``, ``max_position_embeddings``: mt has no learned positions) or refused with
one line when its value is one mt's Llama does not compute: an activation other than SiLU,
attention or MLP biases, a head dim other than ``hidden_size / num_attention_heads``, RoPE types
other than ``default`` and ``llama3``, partial rotary, ``pretraining_tp > 1``, attention dropout.
A tied model (``tie_word_embeddings``) is imported untied (the head gets a copy of the
embedding, so the logits are the same), and its export is untied. Both the transformers 4
(``rope_theta`` + ``rope_scaling``) and 5 (``rope_parameters``) spellings are read; export
writes the 4 spelling, which transformers 5 also reads. llama3 scaling without
``original_max_position_embeddings`` falls back to ``max_position_embeddings``, as
transformers does.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

import torch

from mt_train.models.family import HFAdapter, layer_groups
from mt_train.models.llama.config import LlamaConfig, RopeScalingConfig

_LAYER_MAP = {
    "self_attn.q_proj": "attention.q_proj",
    "self_attn.k_proj": "attention.k_proj",
    "self_attn.v_proj": "attention.v_proj",
    "self_attn.o_proj": "attention.o_proj",
    "mlp.gate_proj": "mlp.gate_proj",
    "mlp.up_proj": "mlp.up_proj",
    "mlp.down_proj": "mlp.down_proj",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}
_TOP_MAP = {"model.embed_tokens": "embed", "model.norm": "norm", "lm_head": "output"}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.weight$")
_MT_LAYER = re.compile(r"^layers\.(\d+)\.(.+)\.weight$")
SILU_NAMES = ("silu", "swish")
"""``hidden_act`` values that are SiLU in transformers' ``ACT2FN``."""
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor")


def hf_to_mt_name(name: str) -> str:
    match = _HF_LAYER.match(name)
    if match and match.group(2) in _LAYER_MAP:
        return f"layers.{match.group(1)}.{_LAYER_MAP[match.group(2)]}.weight"
    stem = name.removesuffix(".weight")
    if stem in _TOP_MAP and name.endswith(".weight"):
        return f"{_TOP_MAP[stem]}.weight"
    raise ValueError(f"unexpected tensor {name!r} in a Hugging Face Llama checkpoint")


def mt_to_hf_name(name: str) -> str:
    inverse_layer = {v: k for k, v in _LAYER_MAP.items()}
    match = _MT_LAYER.match(name)
    if match and match.group(2) in inverse_layer:
        return f"model.layers.{match.group(1)}.{inverse_layer[match.group(2)]}.weight"
    inverse_top = {v: k for k, v in _TOP_MAP.items()}
    stem = name.removesuffix(".weight")
    if stem in inverse_top:
        return f"{inverse_top[stem]}.weight"
    raise ValueError(f"unexpected tensor {name!r} in an mt Llama checkpoint")


def refuse_unsupported(hf: dict[str, Any]) -> None:
    """Raise with one line for the first field whose value mt's Llama does not compute."""
    if hf.get("model_type", "llama") != "llama":
        raise ValueError(f"model_type={hf.get('model_type')!r}; this adapter reads llama configs")
    act = hf.get("hidden_act", "silu")
    if act not in SILU_NAMES:
        raise ValueError(f"hidden_act={act!r} is not supported: mt's Llama MLP is SwiGLU (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ValueError(f"{key}=true is not supported: mt's Llama linears have no biases")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim")
    if head_dim not in (None, hf["hidden_size"] // heads):
        raise ValueError(
            f"head_dim={head_dim} is not supported: mt's Llama has head_dim = hidden_size / "
            f"num_attention_heads = {hf['hidden_size']} / {heads} = {hf['hidden_size'] // heads}"
        )
    if (hf.get("pretraining_tp") or 1) > 1:
        raise ValueError(
            f"pretraining_tp={hf['pretraining_tp']} is not supported: set it to 1 (it only "
            "splits the GEMMs into slices in transformers)"
        )
    if hf.get("attention_dropout"):
        raise ValueError(
            f"attention_dropout={hf['attention_dropout']} is not supported: mt's model.dropout "
            "also drops the residual branches; set attention_dropout to 0 and choose "
            "model.dropout when training"
        )


def rope_from_hf(hf: dict[str, Any]) -> tuple[float, RopeScalingConfig]:
    """``rope_theta`` and the scaling of either spelling (module docstring)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(
            f"partial_rotary_factor={partial} is not supported: mt's Llama rotates whole heads"
        )
    if rope_type == "default":
        return theta, RopeScalingConfig(factor=1.0)
    if rope_type != "llama3":
        raise ValueError(f"rope type {rope_type!r} is not supported; valid: default, llama3")
    missing = [key for key in LLAMA3_ROPE_KEYS if rope.get(key) is None]
    original = rope.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
    if original is None:
        missing.append("original_max_position_embeddings (or max_position_embeddings)")
    if missing:
        raise ValueError(f"llama3 rope scaling in config.json lacks {', '.join(missing)}")
    scaling = RopeScalingConfig(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position=int(original),
    )
    return theta, scaling


def llama_fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The Llama-shaped fields of a config (sizes, heads, norm, RoPE, init) read from an HF
    ``config.json`` that :func:`refuse_unsupported` accepted; Mixtral configs share them."""
    theta, scaling = rope_from_hf(hf)
    heads = hf["num_attention_heads"]
    return {
        "vocab_size": hf["vocab_size"],
        "dim": hf["hidden_size"],
        "n_layers": hf["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": hf.get("num_key_value_heads") or heads,
        "ffn_dim": hf["intermediate_size"],
        "norm_eps": float(hf.get("rms_norm_eps", 1e-5)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "init_std": float(hf.get("initializer_range", 0.02)),
    }


class LlamaHF(HFAdapter):
    """The Llama family's Hugging Face adapter (module docstring)."""

    architectures = ("LlamaForCausalLM",)
    model_types = ("llama",)

    def config_from_hf(self, hf: dict[str, Any], name: str = "hf_llama") -> LlamaConfig:
        refuse_unsupported(hf)
        return LlamaConfig(name=name, **llama_fields_from_hf(hf))

    def config_to_hf(
        self, cfg: LlamaConfig, dtype: torch.dtype, max_position: int = 131072
    ) -> dict[str, Any]:
        s = cfg.rope_scaling
        rope_scaling = None
        if s.factor != 1.0:
            rope_scaling = {
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position,
            }
        dtype_name = str(dtype).removeprefix("torch.")
        return {
            "architectures": list(self.architectures),
            "model_type": "llama",
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.dim,
            "intermediate_size": cfg.ffn_dim,
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta,
            "rope_scaling": rope_scaling,
            "max_position_embeddings": max(max_position, s.original_max_position + 1),
            "initializer_range": cfg.init_std,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": dtype_name,
            "dtype": dtype_name,
        }

    def import_groups(self, names: Collection[str], hf: dict[str, Any]) -> list[list[str]]:
        """Embedding, final norm and head (the tie needs both), then one group per layer."""
        return layer_groups(names)

    def tensors_from_hf(
        self, tensors: dict[str, torch.Tensor], hf: dict[str, Any]
    ) -> dict[str, torch.Tensor]:
        out = {hf_to_mt_name(k): v for k, v in tensors.items()}
        if hf.get("tie_word_embeddings") and "embed.weight" in out:
            if "output.weight" in out and not torch.equal(
                out["output.weight"], out["embed.weight"]
            ):
                raise ValueError(
                    "tie_word_embeddings=true but lm_head.weight differs from "
                    "model.embed_tokens.weight; transformers would use the embedding for both"
                )
            out["output.weight"] = out["embed.weight"].clone()
        return out

    def export_groups(self, names: Collection[str], cfg: LlamaConfig) -> list[list[str]]:
        """Embedding, final norm and head, then one group per layer."""
        return layer_groups(names)

    def tensors_to_hf(
        self, tensors: dict[str, torch.Tensor], cfg: LlamaConfig
    ) -> dict[str, torch.Tensor]:
        return {
            mt_to_hf_name(k): v.contiguous()
            for k, v in tensors.items()
            if k.endswith(".weight") and "fp8" not in k
        }
