"""Hugging Face ``DeepseekV3ForCausalLM`` ⇄ mt DeepSeek-V3 (``mt-convert``): config and tensors.

Name map (``i`` a layer, ``e`` an expert; embedding, final norm, head and the block norms as
Llama's adapter names them, :mod:`mt_train.models.llama.hf`)::

    model.layers.i.self_attn.q_proj                  layers.i.attention.q_proj        (no q-lora)
    model.layers.i.self_attn.q_a_proj / q_b_proj     layers.i.attention.q_a_proj / q_b_proj
    model.layers.i.self_attn.q_a_layernorm           layers.i.attention.q_a_norm
    model.layers.i.self_attn.kv_a_proj_with_mqa      layers.i.attention.kv_a_proj
    model.layers.i.self_attn.kv_a_layernorm          layers.i.attention.kv_a_norm
    model.layers.i.self_attn.kv_b_proj / o_proj      layers.i.attention.kv_b_proj / o_proj
    model.layers.i.mlp.{gate,up,down}_proj           layers.i.mlp.{gate,up,down}_proj  (dense)
    model.layers.i.mlp.gate.weight                   layers.i.mlp.router.weight        [E, D]
    model.layers.i.mlp.gate.e_score_correction_bias  layers.i.mlp.router.expert_bias   [E]
    model.layers.i.mlp.experts.e.{gate,up,down}_proj layers.i.mlp.experts.*_proj.weight[e]
    model.layers.i.mlp.shared_experts.*              layers.i.mlp.shared_experts.*

Multi-token prediction. MTP module ``k`` (``k < num_nextn_predict_layers``) is stored as the
layer ``j = num_hidden_layers + k``: a decoder layer under the names above (mt:
``mtp.k.block.*``) plus::

    model.layers.j.enorm / hnorm                     mtp.k.embed_norm / hidden_norm
    model.layers.j.eh_proj       [D, 2D]             mtp.k.proj    (input [enorm(Emb); hnorm(h)])
    model.layers.j.shared_head.norm                  mtp.k.norm    (a norm of its own)
    model.layers.j.embed_tokens / shared_head.head   (copies of embed / output, shared in mt)

The input order, embedding first, is the one transformers' ``MtpLayer`` reads DeepSeek-V3
checkpoints with (the paper writes the hidden state first). Depth ``k + 1`` reads depth ``k``'s
block output before ``shared_head.norm``, the paper's ``h^k``; transformers' ``MtpModel`` (a
drafting model) passes the normed state on instead. V3 has one MTP module, so its checkpoint
does not tell the two apart; they differ only from depth 2 on. mt's modules share the
main embedding and head, so import refuses an MTP layer whose copies differ from them, and
export writes the copies back. :meth:`DeepseekV3HF.import_view` picks the depth: every MTP layer
the safetensors hold (transformers' ``save_pretrained`` writes none, whatever its config says),
or ``mt-convert import --mtp-depth D`` for the first ``D`` (0: none, one line names what is
skipped; more than the checkpoint holds is refused naming both numbers). Export writes
``num_nextn_predict_layers = model.mtp_depth``, so a round trip is bitwise lossless;
``mt-convert export --mtp-depth D`` (:meth:`DeepseekV3HF.export_view`) writes only the first
``D`` (0: a plain next-token model).

RoPE layout. With ``rope_interleave`` (DeepSeek's checkpoints) transformers rotates the pairs
``(x_2j, x_2j+1)`` and returns them de-interleaved; mt rotates ``(x_j, x_j+R/2)``. Import
reorders the rotary rows of ``q_proj``/``q_b_proj`` (per head) and of ``kv_a_proj`` (the shared
key) to ``[0, 2, 4, …, 1, 3, 5, …]``, which makes mt's rotate-half output equal transformers'
(q and k are reordered alike, so the scores are the same); export writes the inverse and
``rope_interleave=true``, so a round trip is bitwise lossless.

FP8 Hub weights. ``deepseek-ai/DeepSeek-V3`` stores every linear of the attention
(``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``), the dense
MLPs, the experts and the shared experts, the MTP layer's block included, as
``float8_e4m3fn`` with a float32 ``weight_scale_inv`` per 128 × 128 block
(``kv_a_proj_with_mqa``'s 576 rows end in a half block); the embeddings, norms, the router's
``gate.weight`` and ``e_score_correction_bias``, ``eh_proj`` and ``lm_head`` are unquantized.
:func:`mt_train.hf_checkpoints.import_hf` dequantizes them as it reads the shards (its module
docstring: the block from ``quantization_config.weight_block_size``, the float32 product
stored in ``torch_dtype``), so this adapter sees only unquantized tensors; export writes
unquantized weights and no ``quantization_config``.

Refused with one line (never silently different logits): an activation other than SiLU,
attention biases or dropout, ``num_key_value_heads ≠ num_attention_heads``, RoPE types other
than ``default`` and ``yarn`` (and YaRN with an explicit ``attention_factor`` or without
truncation), ``rms_norm_eps ≠ 1e-6`` (transformers' latent norms always use 1e-6, mt's
``model.norm_eps`` is every norm's), no shared experts, top-1 routing with ``norm_topk_prob``.
Export refuses what ``DeepseekV3ForCausalLM`` cannot express (softmax scores, capacity
dropping, a shared-expert width other than ``n_shared·moe_intermediate_size``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection
from typing import Any

import torch

from mt_parallel import YarnConfig
from mt_parallel.moe import MoEConfig
from mt_train.models.deepseek_v3.config import DeepSeekV3Config
from mt_train.models.family import GroupKey, HFAdapter, layer_groups
from mt_train.models.llama.hf import SILU_NAMES

_ATTENTION = {
    "q_proj": "q_proj", "q_a_proj": "q_a_proj", "q_b_proj": "q_b_proj",
    "q_a_layernorm": "q_a_norm", "kv_a_proj_with_mqa": "kv_a_proj",
    "kv_a_layernorm": "kv_a_norm", "kv_b_proj": "kv_b_proj", "o_proj": "o_proj",
}  # fmt: skip
_LAYER = {
    **{f"self_attn.{hf}.weight": f"attention.{mt}.weight" for hf, mt in _ATTENTION.items()},
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate.weight": "mlp.router.weight",
    "mlp.gate.e_score_correction_bias": "mlp.router.expert_bias",
    **{f"mlp.{p}_proj.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
    **{
        f"mlp.shared_experts.{p}_proj.weight": f"mlp.shared_experts.{p}_proj.weight"
        for p in ("gate", "up", "down")
    },
}
_TOP = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
        "lm_head.weight": "output.weight"}  # fmt: skip
_LAYER_INVERSE = {mt: hf for hf, mt in _LAYER.items()}
_MTP = {"enorm.weight": "embed_norm.weight", "hnorm.weight": "hidden_norm.weight",
        "eh_proj.weight": "proj.weight", "shared_head.norm.weight": "norm.weight"}  # fmt: skip
_MTP_INVERSE = {mt: hf for hf, mt in _MTP.items()}
_MTP_SHARED = {"embed_tokens.weight": "embed.weight", "shared_head.head.weight": "output.weight"}
"""An MTP layer's copies of the main embedding and head (mt shares them)."""
_MTP_COPY = {main: rest for rest, main in _MTP_SHARED.items()}
_MAIN_NAME = {mt: hf for hf, mt in _TOP.items()}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_MT_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_MT_MTP_BLOCK = re.compile(r"^mtp\.(\d+)\.block\.(.+)$")
_MT_MTP = re.compile(r"^mtp\.(\d+)\.(.+)$")
_MT_EXPERTS = re.compile(r"^mlp\.experts\.(gate|up|down)_proj\.weight$")
LATENT_NORM_EPS = 1e-6
"""The epsilon of transformers' ``q_a_layernorm`` / ``kv_a_layernorm`` (not configurable)."""


def interleaved_to_half(rows: int) -> torch.Tensor:
    """Row order that turns interleaved rotary pairs into the rotate-half layout."""
    return torch.cat([torch.arange(0, rows, 2), torch.arange(1, rows, 2)])


def _permute_rope_rows(weight: torch.Tensor, heads: int, nope: int, rope: int, inverse: bool):
    """Reorder the last ``rope`` rows of each of ``heads`` row blocks of ``nope + rope`` rows."""
    order = interleaved_to_half(rope)
    if inverse:
        order = torch.argsort(order)
    blocks = weight.view(heads, nope + rope, -1)
    rotary = blocks[:, nope:].index_select(1, order)
    return torch.cat([blocks[:, :nope], rotary], dim=1).reshape(weight.shape)


def _rope_rows(name: str, tensor: torch.Tensor, hf: dict[str, Any], inverse: bool):
    """``tensor`` with its rotary rows reordered (module docstring) if ``name`` has them."""
    nope, rope = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
    if name.endswith(("attention.q_proj.weight", "attention.q_b_proj.weight")):
        return _permute_rope_rows(tensor, hf["num_attention_heads"], nope, rope, inverse)
    if name.endswith("attention.kv_a_proj.weight"):
        return _permute_rope_rows(tensor, 1, hf["kv_lora_rank"], rope, inverse)
    return tensor


def _yarn_from_hf(hf: dict[str, Any]) -> tuple[float, YarnConfig]:
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return theta, YarnConfig()
    if rope_type != "yarn":
        raise ValueError(f"rope type {rope_type!r} is not supported; valid: default, yarn")
    if rope.get("attention_factor") is not None:
        raise ValueError(
            f"yarn attention_factor={rope['attention_factor']} is not supported: mt derives it "
            "from factor, mscale and mscale_all_dim"
        )
    if rope.get("truncate", True) is not True:
        raise ValueError("yarn truncate=false is not supported: mt rounds the correction range")
    original = int(rope["original_max_position_embeddings"])
    factor = rope.get("factor") or hf["max_position_embeddings"] / original
    yarn = YarnConfig(
        factor=float(factor), original_max_position=original,
        beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
        mscale=float(rope.get("mscale") or 1.0), mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
    )  # fmt: skip
    return theta, yarn


def _refuse_unsupported(hf: dict[str, Any]) -> None:
    act = hf.get("hidden_act", "silu")
    if act not in SILU_NAMES:
        raise ValueError(f"hidden_act={act!r} is not supported: mt's MLPs are SwiGLU (silu)")
    if hf.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported: mt's MLA linears have no biases")
    if hf.get("attention_dropout"):
        raise ValueError(
            f"attention_dropout={hf['attention_dropout']} is not supported: set it to 0 and "
            "choose model.dropout when training"
        )
    heads = hf["num_attention_heads"]
    if (hf.get("num_key_value_heads") or heads) != heads:
        raise ValueError(
            f"num_key_value_heads={hf['num_key_value_heads']} ≠ num_attention_heads={heads} "
            "is not supported: MLA expands the latent to every head"
        )
    eps = float(hf.get("rms_norm_eps", LATENT_NORM_EPS))
    if eps != LATENT_NORM_EPS:
        raise ValueError(
            f"rms_norm_eps={eps} is not supported: transformers' latent norms use "
            f"{LATENT_NORM_EPS} and mt's model.norm_eps is every norm's epsilon"
        )
    if not hf.get("n_shared_experts"):
        raise ValueError("n_shared_experts=0 is not supported: transformers builds an empty MLP")
    if hf.get("num_experts_per_tok") == 1 and hf.get("norm_topk_prob"):
        raise ValueError(
            "num_experts_per_tok=1 with norm_topk_prob=true is not supported: mt keeps the "
            "single expert's score, transformers normalises it to 1"
        )


class DeepseekV3HF(HFAdapter):
    """The DeepSeek-V3 family's Hugging Face adapter (module docstring)."""

    architectures = ("DeepseekV3ForCausalLM",)
    model_types = ("deepseek_v3",)
    float32_names = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
    """The router's weight and bias: float32 in transformers' model at any dtype (its
    ``_keep_in_fp32_modules_strict``), float32 beside bf16 weights in the Hub's checkpoint."""

    def config_from_hf(self, hf: dict[str, Any], name: str = "hf_deepseek_v3") -> DeepSeekV3Config:
        _refuse_unsupported(hf)
        theta, yarn = _yarn_from_hf(hf)
        return DeepSeekV3Config(
            name=name, vocab_size=hf["vocab_size"], dim=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
            q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"], ffn_dim=hf["intermediate_size"],
            first_k_dense=hf.get("first_k_dense_replace") or 0, norm_eps=LATENT_NORM_EPS,
            mtp_depth=hf.get("num_nextn_predict_layers") or 0,
            rope_theta=theta, yarn=yarn, init_std=float(hf.get("initializer_range", 0.02)),
            moe=MoEConfig(
                num_experts=hf["n_routed_experts"], top_k=hf["num_experts_per_tok"],
                expert_ffn_dim=hf["moe_intermediate_size"], score_function="sigmoid",
                normalize_weights=bool(hf.get("norm_topk_prob", True)),
                routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
                balancing="aux_free", n_shared_experts=hf["n_shared_experts"],
            ),
        )  # fmt: skip

    def config_to_hf(self, cfg: DeepSeekV3Config, dtype: torch.dtype) -> dict[str, Any]:
        m = cfg.moe
        unsupported = {
            "moe.score_function": (m.score_function, "sigmoid"),
            "moe.capacity_factor": (m.capacity_factor, None),
            "moe.shared_ffn_dim": (m.shared_ffn_dim or m.expert_ffn_dim, m.expert_ffn_dim),
            "norm_eps": (cfg.norm_eps, LATENT_NORM_EPS),
        }
        for key, (value, wanted) in unsupported.items():
            if value != wanted:
                raise ValueError(
                    f"model.{key}={value!r} has no DeepseekV3ForCausalLM equivalent ({wanted!r})"
                )
        if m.n_shared_experts == 0:
            raise ValueError("model.moe.n_shared_experts=0 has no DeepseekV3ForCausalLM equivalent")
        y = cfg.yarn
        rope_scaling = None
        if y.enabled:
            rope_scaling = {
                "rope_type": "yarn", "factor": y.factor,
                "original_max_position_embeddings": y.original_max_position,
                "beta_fast": y.beta_fast, "beta_slow": y.beta_slow, "mscale": y.mscale,
                "mscale_all_dim": y.mscale_all_dim,
            }  # fmt: skip
        max_position = int(y.original_max_position * y.factor) if y.enabled else 4096
        dtype_name = str(dtype).removeprefix("torch.")
        return {
            "architectures": list(self.architectures), "model_type": "deepseek_v3",
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
            "intermediate_size": cfg.ffn_dim, "moe_intermediate_size": m.expert_ffn_dim,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_heads, "n_shared_experts": m.n_shared_experts,
            "n_routed_experts": m.num_experts, "routed_scaling_factor": m.routed_scaling_factor,
            "kv_lora_rank": cfg.kv_lora_rank, "q_lora_rank": cfg.q_lora_rank,
            "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim,
            "qk_nope_head_dim": cfg.qk_nope_head_dim, "n_group": m.n_group,
            "topk_group": m.topk_group, "num_experts_per_tok": m.top_k,
            "first_k_dense_replace": cfg.first_k_dense, "norm_topk_prob": m.normalize_weights,
            "hidden_act": "silu", "max_position_embeddings": max_position,
            "initializer_range": cfg.init_std, "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta, "rope_scaling": rope_scaling, "rope_interleave": True,
            "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
            "num_nextn_predict_layers": cfg.mtp_depth, "torch_dtype": dtype_name,
            "dtype": dtype_name,
        }  # fmt: skip

    def import_view(
        self, hf: dict[str, Any], names: set[str], mtp_depth: int | None
    ) -> tuple[dict[str, Any], str | None]:
        """``num_nextn_predict_layers`` set to the MTP depth to import (module docstring)."""
        layers, claimed = hf["num_hidden_layers"], hf.get("num_nextn_predict_layers") or 0
        held = sorted({int(m.group(1)) - layers for n in names if (m := _HF_LAYER.match(n))})
        held = [k for k in held if k >= 0]
        if held != list(range(len(held))) or len(held) > claimed:
            valid = f"model.layers.{layers}..{layers + claimed - 1}" if claimed else "none"
            raise ValueError(
                f"multi-token-prediction layers {[layers + k for k in held]} in the checkpoint, "
                f"num_hidden_layers={layers} and num_nextn_predict_layers={claimed} (valid: "
                f"{valid})"
            )
        depth = len(held) if mtp_depth is None else mtp_depth
        if not 0 <= depth <= len(held):
            raise ValueError(
                f"--mtp-depth={mtp_depth} but the checkpoint holds {len(held)} multi-token-"
                f"prediction layers (num_nextn_predict_layers={claimed}); valid: 0 to {len(held)}"
            )
        note = None
        if depth < len(held):
            note = (
                f"skipping {len(held) - depth} of the checkpoint's {len(held)} multi-token-"
                f"prediction layers (model.layers.{layers + depth}..{layers + len(held) - 1}; "
                f"--mtp-depth={depth})"
            )
        elif len(held) < claimed:
            note = (
                f"the checkpoint holds {len(held)} of its num_nextn_predict_layers={claimed} "
                f"multi-token-prediction layers (transformers' save_pretrained writes none); "
                f"importing {len(held)}"
            )
        return {**hf, "num_nextn_predict_layers": depth}, note

    def export_view(
        self, cfg: DeepSeekV3Config, names: Collection[str], mtp_depth: int | None
    ) -> tuple[DeepSeekV3Config, Collection[str]]:
        """The first ``mtp_depth`` MTP modules (None: all; 0: next-token inference only)."""
        if mtp_depth is None:
            return cfg, names
        if not 0 <= mtp_depth <= cfg.mtp_depth:
            raise ValueError(
                f"--mtp-depth={mtp_depth} but the checkpoint's model has model.mtp_depth="
                f"{cfg.mtp_depth}; valid: 0 to {cfg.mtp_depth}"
            )
        kept = [
            name
            for name in names
            if not ((mtp := _MT_MTP.match(name)) and int(mtp.group(1)) >= mtp_depth)
        ]
        return dataclasses.replace(cfg, mtp_depth=mtp_depth), kept

    def import_groups(self, names: Collection[str], hf: dict[str, Any]) -> list[list[str]]:
        """Embedding, final norm, head and the MTP layers' copies of them (checked equal to
        them), then per layer (MTP layers included) its attention, norms, router, dense or
        shared MLP, and each of its routed experts' projections apart (stacked into one
        ``[E, out, in]`` tensor each: 7.5 GB of V3's 22 GB layer in bf16). MTP layers beyond
        the imported depth are not read."""
        layers, depth = hf["num_hidden_layers"], hf.get("num_nextn_predict_layers") or 0

        def key(name: str) -> GroupKey | None:
            match = _HF_LAYER.match(name)
            if match is None:
                return None
            layer, rest = int(match.group(1)), match.group(2)
            if layer >= layers and rest in _MTP_SHARED:
                return None
            expert = _HF_EXPERT.match(rest)
            return "model.layers", layer, expert.group(2) if expert else ""

        def imported(name: str) -> bool:
            match = _HF_LAYER.match(name)
            return match is None or int(match.group(1)) < layers + depth

        return layer_groups([n for n in names if imported(n)], key)

    def tensors_from_hf(
        self, tensors: dict[str, torch.Tensor], hf: dict[str, Any]
    ) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
        shared_copies: dict[str, str] = {}
        layers, depth = hf["num_hidden_layers"], hf.get("num_nextn_predict_layers") or 0
        for name, tensor in tensors.items():
            if name in _TOP:
                out[_TOP[name]] = tensor
                continue
            match = _HF_LAYER.match(name)
            if match is None:
                raise ValueError(f"unexpected tensor {name!r} in a DeepSeek-V3 checkpoint")
            layer, rest = int(match.group(1)), match.group(2)
            if layer >= layers + depth:
                continue  # an MTP layer beyond the imported depth (import_view told the user)
            prefix = f"layers.{layer}" if layer < layers else f"mtp.{layer - layers}.block"
            if layer >= layers and rest in _MTP_SHARED:
                shared_copies[name] = _MTP_SHARED[rest]
            elif layer >= layers and rest in _MTP:
                out[f"mtp.{layer - layers}.{_MTP[rest]}"] = tensor
            elif expert := _HF_EXPERT.match(rest):
                experts.setdefault((prefix, expert.group(2)), {})[int(expert.group(1))] = tensor
            elif rest in _LAYER:
                mt_name = f"{prefix}.{_LAYER[rest]}"
                if hf.get("rope_interleave", True):
                    tensor = _rope_rows(mt_name, tensor, hf, inverse=False)
                out[mt_name] = tensor
            else:
                raise ValueError(f"unexpected tensor {name!r} in a DeepSeek-V3 checkpoint")
        count = hf["n_routed_experts"]
        for (prefix, proj), by_expert in experts.items():
            if sorted(by_expert) != list(range(count)):
                raise ValueError(
                    f"{prefix} {proj}_proj: experts {sorted(by_expert)} in the checkpoint, "
                    f"n_routed_experts={count}"
                )
            out[f"{prefix}.mlp.experts.{proj}_proj.weight"] = torch.stack(
                [by_expert[e] for e in range(count)]
            )
        if hf.get("tie_word_embeddings") and "output.weight" not in out and "embed.weight" in out:
            out["output.weight"] = out["embed.weight"].clone()
        for name, main in shared_copies.items():
            if not torch.equal(tensors[name], out[main]):
                raise ValueError(
                    f"{name} differs from the main model's {_MAIN_NAME[main]}: mt's MTP modules "
                    "share the main embedding and head (as DeepSeek-V3 trains them); import "
                    "with --mtp-depth 0 to leave the MTP layers out"
                )
        return out

    def export_groups(self, names: Collection[str], cfg: DeepSeekV3Config) -> list[list[str]]:
        """:meth:`import_groups` of the mt names: embedding, final norm and head (whose
        conversion writes the MTP layers' copies of them), then each layer and each MTP
        module (its block and its own norms and projection), routed experts by projection."""

        def key(name: str) -> GroupKey | None:
            match = _MT_LAYER.match(name) or _MT_MTP.match(name)
            if match is None:
                return None
            rest = match.group(2).removeprefix("block.")
            experts = _MT_EXPERTS.match(rest)
            stem = "layers" if name.startswith("layers.") else "mtp"
            return stem, int(match.group(1)), experts.group(1) if experts else ""

        return layer_groups(names, key)

    def tensors_to_hf(
        self, tensors: dict[str, torch.Tensor], cfg: DeepSeekV3Config
    ) -> dict[str, torch.Tensor]:
        layers = cfg.n_layers
        shapes = {"num_attention_heads": cfg.n_heads, "qk_nope_head_dim": cfg.qk_nope_head_dim,
                  "qk_rope_head_dim": cfg.qk_rope_head_dim, "kv_lora_rank": cfg.kv_lora_rank}  # fmt: skip
        out: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            if "fp8" in name:
                continue
            if name in _MAIN_NAME:
                out[_MAIN_NAME[name]] = tensor.contiguous()
                if name in _MTP_COPY:  # the Hub's copy in each MTP layer, cloned (a
                    for k in range(cfg.mtp_depth):  # safetensors file holds no aliases)
                        out[f"model.layers.{layers + k}.{_MTP_COPY[name]}"] = tensor.clone()
                continue
            match = _MT_LAYER.match(name) or _MT_MTP_BLOCK.match(name)
            if match is not None:
                layer = int(match.group(1)) + (layers if name.startswith("mtp.") else 0)
                _layer_to_hf(f"model.layers.{layer}", match.group(2), tensor, out, name, shapes)
                continue
            mtp = _MT_MTP.match(name)
            if mtp is None or mtp.group(2) not in _MTP_INVERSE:
                raise ValueError(f"unexpected tensor {name!r} in an mt DeepSeek-V3 checkpoint")
            hf_layer = f"model.layers.{layers + int(mtp.group(1))}"
            out[f"{hf_layer}.{_MTP_INVERSE[mtp.group(2)]}"] = tensor.contiguous()
        return out


def _layer_to_hf(
    hf_layer: str,
    rest: str,
    tensor: torch.Tensor,
    out: dict[str, torch.Tensor],
    name: str,
    shapes: dict[str, int],
) -> None:
    """Write one block tensor (``rest`` named as in a :func:`deepseek_block`) under ``hf_layer``."""
    if experts := _MT_EXPERTS.match(rest):
        for e, weight in enumerate(tensor):
            out[f"{hf_layer}.mlp.experts.{e}.{experts.group(1)}_proj.weight"] = weight.contiguous()
    elif rest in _LAYER_INVERSE:
        tensor = _rope_rows(name, tensor, shapes, inverse=True)
        out[f"{hf_layer}.{_LAYER_INVERSE[rest]}"] = tensor.contiguous()
    else:
        raise ValueError(f"unexpected tensor {name!r} in an mt DeepSeek-V3 checkpoint")
