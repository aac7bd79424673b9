"""A token-by-token float64 MoE written from the formulas, for the MoE tests (not a test module:
the spawned gloo workers import it by name)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mt_parallel.moe import MoE


def reference_moe(
    layer: MoE, x_BSD: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``y_t = Σ_j w_tj · SwiGLU_{e_tj}(x_t) (+ shared)`` one token at a time, dropless, with
    ``layer``'s weights (full, ep=1) and its config; independent of the layer's dispatch code."""
    cfg = layer.cfg
    wr = layer.router.weight.double()
    wg, wu, wd = (p.weight.double() for p in (layer.experts.gate_proj, layer.experts.up_proj,
                                             layer.experts.down_proj))  # fmt: skip
    out = []
    for x_D in x_BSD.reshape(-1, x_BSD.shape[-1]).double():
        logits = wr @ x_D
        scores = logits.softmax(0) if cfg.score_function == "softmax" else logits.sigmoid()
        select = scores + (bias if bias is not None else 0)
        if cfg.n_group > 1:
            groups = select.view(cfg.n_group, -1)
            if cfg.score_function == "sigmoid":
                group_score = groups.sort(descending=True).values[:, :2].sum(1)
            else:
                group_score = groups.max(1).values
            allowed = group_score.sort(descending=True).indices[: cfg.topk_group]
            masked = torch.full_like(groups, float("-inf"))
            masked[allowed] = groups[allowed]
            select = masked.flatten()
        chosen = select.sort(descending=True).indices[: cfg.top_k]
        weights = scores[chosen]
        if cfg.normalize_weights and cfg.top_k > 1:
            weights = weights / weights.sum()
        weights = weights * cfg.routed_scaling_factor
        y = torch.zeros_like(x_D)
        for w, e in zip(weights, chosen, strict=True):
            y = y + w * (wd[e] @ (F.silu(wg[e] @ x_D) * (wu[e] @ x_D)))
        out.append(y)
    y_BSD = torch.stack(out).view(x_BSD.shape)
    if layer.shared_experts is not None:
        shared = layer.shared_experts
        g = x_BSD.double() @ shared.gate_proj.weight.double().T
        u = x_BSD.double() @ shared.up_proj.weight.double().T
        y_BSD = y_BSD + (F.silu(g) * u) @ shared.down_proj.weight.double().T
    return y_BSD


def poison_rows_past_the_groups(padded_grouped_mm):
    """``padded_grouped_mm`` whose output rows past the last group, and their gradient, are NaN:
    the kernel leaves those rows uninitialized, so nothing may read them, forward or backward."""

    def poisoned(x_PK, weight_LNK, layout, *deferred):
        y_PN = padded_grouped_mm(x_PK, weight_LNK, layout, *deferred)
        tail = torch.arange(int(layout.ends_L[-1]), y_PN.shape[0], device=y_PN.device)
        if y_PN.requires_grad:
            y_PN.register_hook(lambda grad: grad.index_fill(0, tail, float("nan")))
        return y_PN.index_fill(0, tail, float("nan"))

    return poisoned
