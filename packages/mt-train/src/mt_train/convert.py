"""``mt-convert``: Hugging Face Llama checkpoints (config.json + safetensors) ⇄ mt checkpoints.

The two layouts hold the same tensors under different names; mt's attention uses the
rotate-half RoPE layout that Hugging Face uses, so no weight is permuted and a round trip
is bitwise lossless. Name map (``i`` a layer index)::

    model.embed_tokens.weight                          embed.weight
    model.layers.i.self_attn.{q,k,v,o}_proj.weight     layers.i.attention.{q,k,v,o}_proj.weight
    model.layers.i.mlp.{gate,up,down}_proj.weight      layers.i.mlp.{gate,up,down}_proj.weight
    model.layers.i.input_layernorm.weight              layers.i.attention_norm.weight
    model.layers.i.post_attention_layernorm.weight     layers.i.ffn_norm.weight
    model.norm.weight                                  norm.weight
    lm_head.weight                                     output.weight

Import writes an mt checkpoint root holding ``step-00000000`` (model tensors only, manifest
``model`` = the :class:`ModelConfig`), which ``checkpoint.init_from=<root>`` trains from.
A tied HF model (``tie_word_embeddings``) is imported untied (the head gets a copy of the
embedding), so its export is untied. Both the transformers 4 (``rope_theta`` +
``rope_scaling``) and 5 (``rope_parameters``) config spellings are read; export writes the
4 spelling, which transformers 5 also reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mt_train.checkpoint.checkpointer import TPLayout, read_resharded
from mt_train.checkpoint.files import (
    CheckpointReader,
    latest_checkpoint,
    publish,
    tmp_dir,
    write_shard,
)
from mt_train.config.schema import ModelConfig, RopeScalingConfig
from mt_train.models.build import build_model
from mt_train.models.llama import Llama

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


def model_config_from_hf(hf: dict[str, Any], name: str = "hf_llama") -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face ``LlamaConfig`` dict."""
    if hf.get("model_type", "llama") != "llama":
        raise ValueError(f"model_type={hf.get('model_type')!r}; mt-convert reads llama checkpoints")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("attention_bias/mlp_bias=true: mt's Llama has no biases")
    heads = hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, hf["hidden_size"] // heads):
        raise ValueError(f"head_dim={hf['head_dim']} != hidden_size/num_attention_heads")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3":
        scaling = RopeScalingConfig(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position=int(rope["original_max_position_embeddings"]),
        )
    elif rope_type == "default":
        scaling = RopeScalingConfig(factor=1.0)
    else:
        raise ValueError(f"rope type {rope_type!r} is not supported; valid: default, llama3")
    return ModelConfig(
        name=name,
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        ffn_dim=hf["intermediate_size"],
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        init_std=float(hf.get("initializer_range", 0.02)),
    )


def hf_config_from_model(cfg: ModelConfig, max_position: int = 131072) -> dict[str, Any]:
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
    return {
        "architectures": ["LlamaForCausalLM"],
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
        "torch_dtype": "float32",
    }


def _read_hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {str(folder)!r}")
    out: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                out[key] = f.get_tensor(key)
    return out


def import_hf(hf_dir: str | Path, out_root: str | Path) -> Path:
    """Write ``<out_root>/step-00000000`` from a Hugging Face Llama folder; returns it."""
    hf_dir, out_root = Path(hf_dir), Path(out_root)
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{str(hf_dir)!r} has no config.json")
    hf_cfg = json.loads(config_path.read_text())
    cfg = model_config_from_hf(hf_cfg, name=hf_dir.name)
    tensors = {f"model/{hf_to_mt_name(k)}": v for k, v in _read_hf_tensors(hf_dir).items()}
    if "model/output.weight" not in tensors and hf_cfg.get("tie_word_embeddings"):
        tensors["model/output.weight"] = tensors["model/embed.weight"].clone()
    expected = {f"model/{k}" for k in build_model(cfg, "meta").state_dict()}
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise ValueError(
            f"tensor names do not match the config: missing {missing[:3]}, extra {extra[:3]}"
        )
    run_id = uuid.uuid4().hex
    write_shard(tmp_dir(out_root, 0), 0, run_id, tensors)
    manifest = {
        "step": 0,
        "config": {"model": dataclasses.asdict(cfg)},
        "model": dataclasses.asdict(cfg),
        "data": None,
        "world_size": 1,
        "parallel": {"tp": 1, "dp": 1},
        "tp_plan": {},
        "source": {"huggingface": str(hf_dir)},
    }
    return publish(out_root, 0, 1, run_id, manifest, keep_last=1)


def checkpoint_folder(path: Path) -> Path:
    """A checkpoint folder, or the newest one under a checkpoint root."""
    if (path / "manifest.json").is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise FileNotFoundError(f"{str(path)!r} is neither an mt checkpoint nor a folder of them")
    return latest


def model_config_of(reader: CheckpointReader) -> ModelConfig:
    raw = dict(reader.manifest.get("model") or reader.manifest["config"]["model"])
    raw["rope_scaling"] = RopeScalingConfig(**raw["rope_scaling"])
    return ModelConfig(**raw)


def full_model_tensors(reader: CheckpointReader) -> dict[str, torch.Tensor]:
    """Every model tensor at tp=1 (TP slices and FSDP2 pieces re-joined)."""
    plan = reader.manifest.get("tp_plan", {})
    keys = {n.removeprefix("model/").split("@")[0] for n in reader.names("model/")}
    single = TPLayout(plan, 0, 1)
    return {k: read_resharded(reader, f"model/{k}", plan.get(k), single) for k in sorted(keys)}


def load_model(path: str | Path, device: str | torch.device = "cpu") -> Llama:
    """An mt checkpoint (folder or root) as a plain tp=1 :class:`Llama`."""
    reader = CheckpointReader(checkpoint_folder(Path(path)))
    model = build_model(model_config_of(reader), device)
    model.load_state_dict(full_model_tensors(reader))
    return model


def export_hf(path: str | Path, out_dir: str | Path) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (HF names) from an mt checkpoint."""
    reader = CheckpointReader(checkpoint_folder(Path(path)))
    cfg = model_config_of(reader)
    tensors = {
        mt_to_hf_name(k): v.contiguous()
        for k, v in full_model_tensors(reader).items()
        if k.endswith(".weight") and "fp8" not in k
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(hf_config_from_model(cfg), indent=2) + "\n")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mt-convert", description="Convert Llama checkpoints between Hugging Face and mt."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Hugging Face folder -> mt checkpoint root")
    imp.add_argument("hf_dir", type=Path)
    imp.add_argument("out", type=Path)
    exp = sub.add_parser("export", help="mt checkpoint (folder or root) -> Hugging Face folder")
    exp.add_argument("checkpoint", type=Path)
    exp.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "import":
            written = import_hf(args.hf_dir, args.out)
        else:
            written = export_hf(args.checkpoint, args.out)
    except (OSError, ValueError, KeyError) as err:
        print(f"mt-convert: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
