"""mt-train's model configs as :class:`~mt_plan.shape.ModelShape` (this module imports mt_train).

``resolve(overrides)`` composes mt-train's own config from the same overrides the trainer
takes (``model=llama3_70b model.n_layers=40 trainer.seq_len=8192``), so the planner sees exactly
the model, sequence length and batch a run would use. :func:`shape_of` reads a family config
into shapes: Llama, the MoE family (Mixtral-style), DeepSeek-V3 (MLA + MoE + MTP) and the
LLaVA-style VLM (its vision tower and projector become ``extra_params`` and
``extra_flops_per_token``, its vision blocks ``blocks_before``). A third-party family is
refused with the families it knows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mt_plan.shape import ModelShape


def resolve(overrides: Sequence[str]) -> Any:
    """The validated ``mt_train.TrainConfig`` of ``overrides`` (raises ``ValueError``)."""
    from mt_train.config import compose_config, to_train_config

    return to_train_config(compose_config(list(overrides)))


def _llama_fields(cfg: Any) -> dict[str, Any]:
    return {
        "name": cfg.name,
        "n_layers": cfg.n_layers,
        "dim": cfg.dim,
        "vocab_size": cfg.vocab_size,
        "n_heads": cfg.n_heads,
        "n_kv_heads": cfg.n_kv_heads,
        "head_dim": cfg.dim // cfg.n_heads,
        "ffn_dim": cfg.ffn_dim,
    }


def shape_of(cfg: Any) -> ModelShape:
    """The :class:`ModelShape` of a family config (vocabulary resolved)."""
    from mt_train.models.registry import family_of

    family = family_of(cfg).name
    if cfg.vocab_size is None:
        raise ValueError(
            f"model={cfg.name} has no vocab_size (the trainer takes it from the data's "
            "tokenizer): set model.vocab_size"
        )
    common = {"dropout": cfg.dropout}
    if family == "llama":
        f = _llama_fields(cfg)
        tp = (("num_heads", f["n_heads"]), ("num_kv_heads", f["n_kv_heads"]),
              ("ffn_dim", f["ffn_dim"]), ("vocab_size", f["vocab_size"]))  # fmt: skip
        return ModelShape(family=family, tp_divides=tp, **common, **f)
    if family == "moe":
        f = _llama_fields(cfg)
        m = cfg.moe
        tp = (("num_heads", f["n_heads"]), ("num_kv_heads", f["n_kv_heads"]),
              ("ffn_dim", f["ffn_dim"]), ("vocab_size", f["vocab_size"]))  # fmt: skip
        return ModelShape(
            family=family, num_experts=m.num_experts, top_k=m.top_k,
            expert_ffn_dim=m.expert_ffn_dim, shared_ffn_dim=m.shared_hidden_dim,
            first_k_dense=cfg.first_k_dense, tp_divides=tp, **common, **f,
        )  # fmt: skip
    if family == "deepseek_v3":
        m = cfg.moe
        tp = [("num_heads", cfg.n_heads), ("ffn_dim", cfg.ffn_dim), ("vocab_size", cfg.vocab_size)]
        if m.n_shared_experts:
            tp.append(("moe shared expert width", m.shared_hidden_dim))
        return ModelShape(
            name=cfg.name, family=family, n_layers=cfg.n_layers, dim=cfg.dim,
            vocab_size=cfg.vocab_size, n_heads=cfg.n_heads, ffn_dim=cfg.ffn_dim,
            attention="mla", q_lora_rank=cfg.q_lora_rank or 0, kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim, num_experts=m.num_experts, top_k=m.top_k,
            expert_ffn_dim=m.expert_ffn_dim, shared_ffn_dim=m.shared_hidden_dim,
            first_k_dense=cfg.first_k_dense, mtp_depth=cfg.mtp_depth, tp_divides=tuple(tp),
            **common,
        )  # fmt: skip
    if family == "vlm":
        from mt_train.models.vlm.model import image_flops_per_token

        f = _llama_fields(cfg)
        v = cfg.vision
        per_block = 4 * v.dim * v.dim + 4 * v.dim + 2 * v.dim * v.ffn_dim + v.ffn_dim + v.dim
        tower = v.n_layers * (per_block + 4 * v.dim)  # + two LayerNorms (gain, bias) per block
        tower += v.channels * v.patch_size**2 * v.dim + (v.num_patches + int(v.cls_token)) * v.dim
        tower += int(v.cls_token) * v.dim + 2 * v.dim * (int(v.pre_norm) + int(v.post_norm))
        projector = cfg.projector_in_dim * cfg.dim + cfg.dim * cfg.dim
        projector += 2 * cfg.dim * int(cfg.projector_bias)
        extra_flops = image_flops_per_token(cfg)
        tp = (("num_heads", f["n_heads"]), ("num_kv_heads", f["n_kv_heads"]),
              ("ffn_dim", f["ffn_dim"]), ("vocab_size", f["vocab_size"]),
              ("model.vision.n_heads", v.n_heads), ("model.vision.ffn_dim", v.ffn_dim))  # fmt: skip
        return ModelShape(
            family=family, extra_params=tower + projector, extra_flops_per_token=extra_flops,
            blocks_before=v.n_layers, tp_divides=tp, **common, **f,
        )  # fmt: skip
    raise ValueError(
        f"mt-plan has no cost model for the model family {family!r} (model={cfg.name}); "
        "it knows llama, moe, deepseek_v3 and vlm"
    )
