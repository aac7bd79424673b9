"""Token-choice top-k router: fp32 scores, optional group-limited selection, z-loss.

Shape suffixes: B batch, S sequence (this rank's), T = B·S tokens, D width, E routed experts,
K top-k, G expert groups (``n_group``).

Math (``W_ED`` the router weight, ``b_E`` the aux-loss-free selection bias, zero otherwise)::

    logits_TE = x_TD · W_EDᵀ                         fp32 GEMM, autocast off
    s_TE      = softmax(logits)   or   sigmoid(logits)         (score_function)
    c_TE      = s_TE + b_E                           selection scores; b never weights a token
    group-limited (G > 1): group score = max of c over the group (softmax) or the sum of its
      top two (sigmoid, DeepSeek-V3); keep the ``topk_group`` best groups, c = -inf elsewhere
    idx_TK    = topk(c_TE, K)
    w_TK      = s_TE[idx]  (/ Σ_K s_TE[idx] if normalize_weights) · routed_scaling_factor
    z-loss    = z_coeff · mean_T(logsumexp(logits_T)²)          over the TP region's tokens

Sequence parallel (:meth:`Router.set_tensor_parallel`): the router routes this rank's S/tp
tokens; ``counts_E`` (and the balancing and z-losses, :mod:`mt_parallel.moe.balance`) are
those of the whole TP region, summed over the TP group, so every TP rank holds the statistics
and losses of the full sequences. The weight, replicated over TP but now seeing different
tokens on each rank, gets its gradient summed over TP (``copy_to_group`` on the weight, as the
SP norms do).

The router GEMM runs in fp32 (fp64 for fp64 inputs) with autocast disabled: under bf16 autocast ``F.linear`` on fp32
inputs still runs in bf16, which flips about one expert choice in nine (design notes, measured
on an H200). Balancing losses and the bias update live in :mod:`mt_parallel.moe.balance`.

Deferred weight gradient (``Router.wgrad_sink``, as the parallel linears' and the experts'; set
by the pipeline runtime for the zero-bubble schedules where torch's own split of the backward is
wrong or the chunk uses a sink anyway, :mod:`mt_parallel.pipeline.runtime`): the router GEMM
then runs through :class:`_DeferredRouterGEMM`, whose backward returns ``dx = dlogits · W`` and
queues ``dW = dlogitsᵀ · x`` (in the GEMM's fp32, fp64 for fp64 inputs) in the sink: the
formulas autograd uses for ``F.linear``'s ``mm`` on the same operands, cast to the parameter's
dtype and, under sequence parallel, summed over TP in the queued work instead of by
``copy_to_group`` (which the deferred path leaves out), then accumulated as autograd would; so
the gradient equals the plain path's bit for bit and is summed over TP exactly once, at ``W``
(every TP rank runs the same action list, so the all-reduces pair up). Under recompute the
forward runs again in the backward but queues nothing: only the backward queues. From ``I`` to
``W`` the queue holds ``x`` (saved for the backward anyway) and ``dlogits`` (``T × E``, small).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

import mt_comm
from mt_fp8.wgrad import WeightGradSink, accumulate_grad
from mt_parallel.mappings import copy_to_group, group_size, sum_gradient_over_group
from mt_parallel.moe.balance import balancing_loss, token_mean
from mt_parallel.moe.capacity import expert_counts
from mt_parallel.moe.config import MoEConfig


@dataclass
class Routing:
    """One forward's routing decision and its losses."""

    indices_TK: torch.Tensor
    """Chosen experts per token (int64)."""
    weights_TK: torch.Tensor
    """Their combine weights (fp32, differentiable)."""
    counts_E: torch.Tensor
    """Assignments per expert before capacity (int64; the TP region's tokens: this rank's, or
    under sequence parallel every TP rank's)."""
    aux_loss: torch.Tensor
    """Balancing loss (0-d, 0 for ``aux_free`` and ``none``), already weighted."""
    z_loss: torch.Tensor
    """Router z-loss (0-d), already weighted."""


def group_limited_mask(select_TE: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """``select_TE`` with experts outside each token's ``topk_group`` best groups at -inf."""
    tokens, experts = select_TE.shape
    grouped_TGe = select_TE.view(tokens, cfg.n_group, experts // cfg.n_group)
    if cfg.score_function == "sigmoid" and grouped_TGe.shape[-1] >= 2:
        group_score_TG = grouped_TGe.topk(2, dim=-1).values.sum(-1)
    else:
        group_score_TG = grouped_TGe.amax(dim=-1)
    keep_TG = group_score_TG.topk(cfg.topk_group, dim=-1).indices
    mask_TG = torch.zeros_like(group_score_TG, dtype=torch.bool).scatter_(1, keep_TG, True)
    return grouped_TGe.masked_fill(~mask_TG[..., None], float("-inf")).view(tokens, experts)


class _DeferredRouterGEMM(torch.autograd.Function):
    """``logits_TE = x_TD · W_EDᵀ`` with ``W`` = ``param`` cast to ``x``'s dtype, whose backward
    queues ``dW`` in ``sink``, summed over ``group`` (module docstring: deferred weight
    gradient). Runs with autocast off, as the plain router GEMM does."""

    @staticmethod
    def forward(
        ctx: Any, x_TD: torch.Tensor, param: torch.Tensor, sink: WeightGradSink, group: Any
    ) -> torch.Tensor:
        weight_ED = param.to(x_TD.dtype)
        ctx.save_for_backward(x_TD, weight_ED)
        ctx.param, ctx.sink, ctx.group = param, sink, group
        return F.linear(x_TD, weight_ED)

    @staticmethod
    def backward(ctx: Any, dlogits_TE: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_TD, weight_ED = ctx.saved_tensors
        param, group, device = ctx.param, ctx.group, dlogits_TE.device.type
        dx = None
        with torch.autocast(device, enabled=False):
            if ctx.needs_input_grad[0]:
                dx = dlogits_TE.mm(weight_ED)
        if ctx.needs_input_grad[1]:

            def weight_gradient() -> None:
                with torch.autocast(device, enabled=False):
                    dw_ED = dlogits_TE.t().mm(x_TD).to(param.dtype)
                accumulate_grad(param, sum_gradient_over_group(dw_ED, group))

            ctx.sink.defer(weight_gradient, holds=(dlogits_TE, x_TD))
        return dx, None, None, None


@torch.compiler.disable  # the backward queues Python work
def _deferred_router_gemm(
    x_TD: torch.Tensor, param: torch.Tensor, sink: WeightGradSink, group: Any
) -> torch.Tensor:
    """The router GEMM with its weight gradient queued in ``sink`` (module docstring)."""
    return _DeferredRouterGEMM.apply(x_TD, param, sink, group)


class Router(nn.Module):
    """The router of one MoE layer (module docstring); ``forward(x_BSD) -> Routing``."""

    wgrad_sink: WeightGradSink | None = None
    """Set: the router GEMM's weight gradient is queued here (module docstring: deferred weight
    gradient)."""
    wgrad_sink_optional: ClassVar[bool] = True
    """torch's own split backward separates this weight's gradient too (where it is right): the
    pipeline runtime sets the sink only where it is not, or the chunk has one anyway."""

    def __init__(self, dim: int, cfg: MoEConfig, init_std: float = 0.02) -> None:
        super().__init__()
        self.cfg, self.init_std = cfg, init_std
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, dim))
        # The aux-loss-free bias is state, not a parameter: it is in the state dict (checkpoints)
        # and moved only by balance.update_expert_biases after each optimizer step.
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        self.register_buffer(
            "step_counts", torch.zeros(cfg.num_experts, dtype=torch.int64), persistent=False
        )
        self.count_group = None
        """The group whose token counts the bias update sums (dp×cp; set by expert parallel)."""
        self.sequence_group: Any = None
        """The TP group under sequence parallel (its ranks route different tokens), else None."""
        self.reset_parameters()

    def set_tensor_parallel(self, tp_group: Any, sequence_parallel: bool) -> None:
        """Under SP: statistics over the TP region, weight gradient summed (module docstring)."""
        self.sequence_group = tp_group if sequence_parallel else None

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        full = torch.empty(self.weight.shape, dtype=torch.float32)
        if generator is None:
            full = full.to(self.weight.device)
        full.normal_(0.0, self.init_std, generator=generator)
        self.weight.copy_(full)

    def scores(self, logits_TE: torch.Tensor) -> torch.Tensor:
        if self.cfg.score_function == "softmax":
            return logits_TE.softmax(dim=-1)
        return logits_TE.sigmoid()

    def forward(self, x_BSD: torch.Tensor) -> Routing:
        cfg, group = self.cfg, self.sequence_group
        batch, seq = x_BSD.shape[0], x_BSD.shape[1]
        with torch.autocast(x_BSD.device.type, enabled=False):
            wide = torch.promote_types(x_BSD.dtype, torch.float32)  # fp64 stays fp64 (tests)
            x_TD = x_BSD.reshape(batch * seq, -1).to(wide)
            if self.wgrad_sink is None:
                logits_TE = F.linear(x_TD, copy_to_group(self.weight, group).to(wide))
            else:
                logits_TE = _deferred_router_gemm(x_TD, self.weight, self.wgrad_sink, group)
        scores_TE = self.scores(logits_TE)
        select_TE = scores_TE.detach()
        if cfg.balancing == "aux_free":
            select_TE = select_TE + self.expert_bias
        if cfg.n_group > 1:
            select_TE = group_limited_mask(select_TE, cfg)
        indices_TK = select_TE.topk(cfg.top_k, dim=-1).indices
        weights_TK = scores_TE.gather(1, indices_TK)
        if cfg.normalize_weights and cfg.top_k > 1:
            weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + 1e-20)
        weights_TK = weights_TK * cfg.routed_scaling_factor
        counts_E = expert_counts(indices_TK, cfg.num_experts)
        if group_size(group) > 1:
            mt_comm.all_reduce(counts_E, group=group)
        if self.training and torch._C._current_graph_task_id() == -1:
            # Not a recomputation inside backward (recompute=full runs this forward twice).
            self.step_counts.add_(counts_E)
        aux = balancing_loss(cfg, scores_TE, indices_TK, counts_E, batch, group)
        z_loss = logits_TE.new_zeros(())
        if cfg.z_loss_coeff > 0:
            lse_sq_T = torch.logsumexp(logits_TE, dim=-1).square()
            z_loss = cfg.z_loss_coeff * token_mean(lse_sq_T, 0, group)
        return Routing(indices_TK, weights_TK, counts_E, aux, z_loss)
