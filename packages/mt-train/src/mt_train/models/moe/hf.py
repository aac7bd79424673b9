"""Hugging Face ``MixtralForCausalLM`` ⇄ mt MoE (``mt-convert``): config and tensor names.

Attention, norms, embeddings and head use the Llama adapter's names
(:mod:`mt_train.models.llama.hf`). The MoE layers (``i`` a layer, ``e`` an expert)::

    hub layout (what transformers saves and the Hub holds)
    model.layers.i.block_sparse_moe.gate.weight           layers.i.mlp.router.weight        [E, D]
    model.layers.i.block_sparse_moe.experts.e.w1.weight   layers.i.mlp.experts.gate_proj.weight[e]
    model.layers.i.block_sparse_moe.experts.e.w3.weight   layers.i.mlp.experts.up_proj.weight[e]
    model.layers.i.block_sparse_moe.experts.e.w2.weight   layers.i.mlp.experts.down_proj.weight[e]

    transformers 5 in-memory layout (also read)
    model.layers.i.mlp.gate.weight                        router
    model.layers.i.mlp.experts.gate_up_proj   [E, 2F, D]  gate rows [0, F), up rows [F, 2F)
    model.layers.i.mlp.experts.down_proj      [E, D, F]

Export writes the hub layout (transformers 5 loads it into its fused experts). Mixtral's
routing is mt's softmax top-k with renormalised weights; its ``router_aux_loss_coef`` is
``E·Σ_e f_e·P_e`` with ``f`` summing to ``top_k`` (transformers' ``load_balancing_loss_func``)
where mt's ``f`` sums to 1, so ``moe.aux_loss_coeff = router_aux_loss_coef · top_k``. Refused
with one line: sliding-window attention, router jitter, everything Llama's adapter refuses, and
on export every mt option Mixtral does not have (sigmoid scores, groups, shared experts, dense
first layers, a routed scaling factor, a non-zero aux-loss-free bias, capacity dropping).
The aux-loss-free bias (all zeros from Mixtral) is created on import and dropped on export.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

import torch

from mt_parallel.moe import MoEConfig
from mt_train.models.family import GroupKey, HFAdapter, layer_groups, layer_key
from mt_train.models.llama.hf import (
    hf_to_mt_name,
    llama_fields_from_hf,
    mt_to_hf_name,
    refuse_unsupported,
)
from mt_train.models.moe.config import MoEModelConfig

_HUB_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$"
)
_HUB_GATE = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight$")
_FUSED = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)$"
)
_MT_MOE = re.compile(
    r"^layers\.(\d+)\.mlp\.(router\.weight|router\.expert_bias|experts\.(\w+)\.weight)$"
)
_HUB_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _group_key(name: str) -> GroupKey | None:
    """A hub expert's (layer, projection) group; other names by layer (:func:`layer_groups`)."""
    if match := _HUB_EXPERT.match(name):
        return "model.layers", int(match.group(1)), match.group(3)
    return layer_key(name)


def _mt_group_key(name: str) -> GroupKey | None:
    """:func:`_group_key` of the mt names: a layer's stacked experts by projection."""
    match = _MT_MOE.match(name)
    if match and match.group(3):
        return "layers", int(match.group(1)), match.group(3)
    return layer_key(name)


class MixtralHF(HFAdapter):
    """The MoE family's Hugging Face adapter for Mixtral (module docstring)."""

    architectures = ("MixtralForCausalLM",)
    model_types = ("mixtral",)

    def config_from_hf(self, hf: dict[str, Any], name: str = "hf_mixtral") -> MoEModelConfig:
        if hf.get("model_type", "mixtral") != "mixtral":
            raise ValueError(f"model_type={hf.get('model_type')!r}; this adapter reads mixtral")
        missing = [k for k in ("num_local_experts", "num_experts_per_tok") if k not in hf]
        if missing:
            raise ValueError(f"a Mixtral config.json needs {', '.join(missing)}")
        refuse_unsupported({**hf, "model_type": "llama"})
        if hf.get("sliding_window") is not None:
            raise ValueError(
                f"sliding_window={hf['sliding_window']} is not supported: mt attends causally "
                "over the whole sequence"
            )
        if hf.get("router_jitter_noise"):
            raise ValueError(
                f"router_jitter_noise={hf['router_jitter_noise']} is not supported: mt's router "
                "has no input jitter"
            )
        top_k = hf["num_experts_per_tok"]
        return MoEModelConfig(
            name=name,
            **llama_fields_from_hf(hf),
            moe=MoEConfig(
                num_experts=hf["num_local_experts"],
                top_k=top_k,
                expert_ffn_dim=hf["intermediate_size"],
                balancing="aux_loss",
                aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)) * top_k,
            ),
        )

    def config_to_hf(self, cfg: MoEModelConfig, dtype: torch.dtype) -> dict[str, Any]:
        m = cfg.moe
        unsupported = {
            "moe.score_function": (m.score_function, "softmax"),
            "moe.normalize_weights": (m.normalize_weights, True),
            "moe.routed_scaling_factor": (m.routed_scaling_factor, 1.0),
            "moe.n_group": (m.n_group, 1),
            "moe.n_shared_experts": (m.n_shared_experts, 0),
            "moe.capacity_factor": (m.capacity_factor, None),
            "first_k_dense": (cfg.first_k_dense, 0),
            "rope_scaling.factor": (cfg.rope_scaling.factor, 1.0),
        }
        for key, (value, mixtral) in unsupported.items():
            if value != mixtral:
                raise ValueError(f"model.{key}={value!r} has no Mixtral equivalent ({mixtral!r})")
        dtype_name = str(dtype).removeprefix("torch.")
        return {
            "architectures": list(self.architectures),
            "model_type": "mixtral",
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.dim,
            "intermediate_size": m.expert_ffn_dim,
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta,
            "max_position_embeddings": 131072,
            "initializer_range": cfg.init_std,
            "num_local_experts": m.num_experts,
            "num_experts_per_tok": m.top_k,
            "router_aux_loss_coef": m.aux_loss_coeff / m.top_k,
            "router_jitter_noise": 0.0,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "torch_dtype": dtype_name,
            "dtype": dtype_name,
        }

    def import_groups(self, names: Collection[str], hf: dict[str, Any]) -> list[list[str]]:
        """Embedding, final norm and head, then per layer its attention, norms and router,
        and its experts' ``w1``, ``w3`` and ``w2`` (each stacked into one tensor) apart."""
        return layer_groups(names, _group_key)

    def tensors_from_hf(
        self, tensors: dict[str, torch.Tensor], hf: dict[str, Any]
    ) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
        for name, tensor in tensors.items():
            if match := _HUB_EXPERT.match(name):
                layer, expert, proj = int(match.group(1)), int(match.group(2)), match.group(3)
                experts.setdefault((layer, _HUB_PROJ[proj]), {})[expert] = tensor
            elif match := _HUB_GATE.match(name):
                out[f"layers.{match.group(1)}.mlp.router.weight"] = tensor
            elif match := _FUSED.match(name):
                prefix, part = f"layers.{match.group(1)}.mlp", match.group(2)
                if part == "gate.weight":
                    out[f"{prefix}.router.weight"] = tensor
                elif part == "experts.gate_up_proj":
                    gate, up = tensor.chunk(2, dim=1)
                    out[f"{prefix}.experts.gate_proj.weight"] = gate.contiguous()
                    out[f"{prefix}.experts.up_proj.weight"] = up.contiguous()
                else:
                    out[f"{prefix}.experts.down_proj.weight"] = tensor
            else:
                out[hf_to_mt_name(name)] = tensor
        count = hf["num_local_experts"]
        for (layer, proj), by_expert in experts.items():
            if sorted(by_expert) != list(range(count)):
                raise ValueError(
                    f"layer {layer} {proj}: experts {sorted(by_expert)} in the checkpoint, "
                    f"num_local_experts={count}"
                )
            out[f"layers.{layer}.mlp.experts.{proj}.weight"] = torch.stack(
                [by_expert[e] for e in range(count)]
            )
        for router in [n for n in out if n.endswith(".mlp.router.weight")]:
            out[router.replace(".router.weight", ".router.expert_bias")] = torch.zeros(count)
        return out

    def export_groups(self, names: Collection[str], cfg: MoEModelConfig) -> list[list[str]]:
        """:meth:`import_groups` of the mt names: each stacked expert projection apart."""
        return layer_groups(names, _mt_group_key)

    def tensors_to_hf(
        self, tensors: dict[str, torch.Tensor], cfg: MoEModelConfig
    ) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        inverse = {v: k for k, v in _HUB_PROJ.items()}
        for name, tensor in tensors.items():
            if "fp8" in name:
                continue
            match = _MT_MOE.match(name)
            if match is None:
                out[mt_to_hf_name(name)] = tensor.contiguous()
                continue
            layer, part, proj = match.group(1), match.group(2), match.group(3)
            prefix = f"model.layers.{layer}.block_sparse_moe"
            if part == "router.expert_bias":
                if not tensor.is_meta and tensor.abs().max() > 0:
                    raise ValueError(
                        f"{name} is non-zero (aux-loss-free balancing): Mixtral routing has no "
                        "selection bias"
                    )
            elif part == "router.weight":
                out[f"{prefix}.gate.weight"] = tensor.contiguous()
            else:
                for e, weight in enumerate(tensor):
                    out[f"{prefix}.experts.{e}.{inverse[proj]}.weight"] = weight.contiguous()
        return out
