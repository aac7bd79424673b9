"""Load balancing: auxiliary losses and the auxiliary-loss-free bias update.

Shape suffixes as in :mod:`mt_parallel.moe.router`. ``p_TE`` are the router's probabilities:
the softmax scores, or the sigmoid scores divided by their sum over experts (DeepSeek-V3).
``n_E`` counts the top-k assignments of each expert (``Σ_E n_E = T·K``).

* ``aux_loss`` (Switch Transformer / GShard, Megatron's ``switch_load_balancing_loss_func``)::

      L = α · E · Σ_e f_e · P_e,   f_e = n_e / (T·K),   P_e = mean_T p_Te

  L = α exactly when routing is uniform and probabilities are flat; only ``P`` has a gradient.
* ``seq_aux_loss`` (DeepSeek-V3, eq. 17-20): the same per sequence, with V3's scaling
  ``f_e = E/(K·S) · n_e(seq)``, ``P_e = mean_S p_Se``, ``L = α · mean_B Σ_e f_e · P_e``.
* ``aux_free`` (DeepSeek-V3, Loss-Free Balancing): no loss; after each optimizer step
  ``b_e += γ · sign(mean_e(n) − n_e)`` with ``n_e`` the step's assignments summed over every
  micro-batch and over the data-parallel world (dp×cp, one all-reduce for all layers). The bias
  only shifts the *selection* scores; overloaded experts become less likely. Counting skips
  the recomputation of a forward inside backward (``recompute=full``) and evaluation forwards.
* ``none``: nothing.

Sequence parallel (``group``: the TP group when ``parallel.sequence_parallel``): each TP rank
routes its own S/tp tokens of every sequence, and the statistics above are those of the whole
sequences, as without SP: ``n_e`` (and a sequence's ``n_e(seq)``) are summed over the group,
``P_e`` is the group's sum of per-rank probability sums divided by the region's token count
(:func:`token_mean`, through ``reduce_from_group``: its backward is the identity, so each
rank's probabilities get exactly their share of the loss's gradient, and the router weight's
TP-summed gradient is the one-process gradient). Every TP rank then holds the whole loss.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import mt_comm
from mt_parallel.mappings import group_size, reduce_from_group
from mt_parallel.moe.config import MoEConfig


def router_probabilities(cfg: MoEConfig, scores_TE: torch.Tensor) -> torch.Tensor:
    """``p_TE`` of the module docstring (sums to 1 over experts)."""
    if cfg.score_function == "softmax":
        return scores_TE
    return scores_TE / (scores_TE.sum(-1, keepdim=True) + 1e-20)


def token_mean(x: torch.Tensor, dim: int, group: Any = None) -> torch.Tensor:
    """``x.mean(dim)`` over the tokens of the whole TP region: this rank's, and under sequence
    parallel those of every rank of ``group`` (module docstring); the gradient of the sum
    reaches each rank's own tokens."""
    if group_size(group) == 1:
        return x.mean(dim)
    return reduce_from_group(x.sum(dim), group) / (x.shape[dim] * group_size(group))


def switch_aux_loss(
    probs_TE: torch.Tensor,
    counts_E: torch.Tensor,
    top_k: int,
    coeff: float,
    group: Any = None,
) -> torch.Tensor:
    """``α · E · Σ_e f_e · P_e`` over the micro-batch (module docstring). Under sequence
    parallel ``probs_TE`` are this rank's tokens and ``counts_E`` the TP region's counts."""
    tokens, experts = probs_TE.shape[0] * group_size(group), probs_TE.shape[1]
    fraction_E = counts_E.to(probs_TE.dtype) / (tokens * top_k)
    return coeff * experts * (fraction_E * token_mean(probs_TE, 0, group)).sum()


def sequence_aux_loss(
    probs_TE: torch.Tensor,
    indices_TK: torch.Tensor,
    batch: int,
    coeff: float,
    group: Any = None,
) -> torch.Tensor:
    """DeepSeek-V3's per-sequence balance loss, averaged over the ``batch`` sequences. Under
    sequence parallel each rank holds ``S/tp`` tokens of every sequence; the per-sequence
    counts and probability means are those of the whole sequences (module docstring)."""
    tokens, experts = probs_TE.shape
    top_k, local_seq = indices_TK.shape[1], tokens // batch
    seq = local_seq * group_size(group)
    one_hot_BSKE = torch.zeros(tokens, top_k, experts, dtype=probs_TE.dtype, device=probs_TE.device)
    one_hot_BSKE.scatter_(2, indices_TK[..., None], 1.0)
    counts_BE = one_hot_BSKE.view(batch, local_seq * top_k, experts).sum(1)
    if group_size(group) > 1:
        mt_comm.all_reduce(counts_BE, group=group)
    fraction_BE = counts_BE * experts / (top_k * seq)
    mean_prob_BE = token_mean(probs_TE.view(batch, local_seq, experts), 1, group)
    return coeff * (fraction_BE * mean_prob_BE).sum(-1).mean()


def balancing_loss(
    cfg: MoEConfig,
    scores_TE: torch.Tensor,
    indices_TK: torch.Tensor,
    counts_E: torch.Tensor,
    batch: int,
    group: Any = None,
) -> torch.Tensor:
    """The configured auxiliary loss (0-d zeros for ``aux_free`` and ``none``); ``group``: the
    TP group under sequence parallel, ``counts_E`` then already summed over it."""
    if cfg.balancing == "aux_loss" and cfg.aux_loss_coeff > 0:
        probs_TE = router_probabilities(cfg, scores_TE)
        return switch_aux_loss(probs_TE, counts_E, cfg.top_k, cfg.aux_loss_coeff, group)
    if cfg.balancing == "seq_aux_loss" and cfg.aux_loss_coeff > 0:
        probs_TE = router_probabilities(cfg, scores_TE)
        return sequence_aux_loss(probs_TE, indices_TK, batch, cfg.aux_loss_coeff, group)
    return scores_TE.new_zeros(())


def bias_update(counts_E: torch.Tensor, rate: float) -> torch.Tensor:
    """``γ · sign(mean(n) − n)``: the step every expert's bias takes (module docstring)."""
    load = counts_E.double()
    return (rate * torch.sign(load.mean() - load)).float()


@torch.no_grad()
def update_expert_biases(model: nn.Module, apply: bool = True) -> dict[str, torch.Tensor]:
    """After an optimizer step: sum every router's counts over its ``count_group`` (one
    all-reduce), move the ``aux_free`` biases, reset the counts. Returns each router's global
    counts of the step (by module name), for the load statistics; empty for dense models.
    ``apply=False`` (a step that was not applied) only resets the counts, on every rank."""
    from mt_parallel.moe.router import Router

    named = [(n, m) for n, m in model.named_modules() if isinstance(m, Router)]
    if not named:
        return {}
    if not apply:
        for _, router in named:
            router.step_counts.zero_()
        return {}
    flat = torch.cat([router.step_counts for _, router in named])
    group = named[0][1].count_group
    if group_size(group) > 1:
        mt_comm.all_reduce(flat, group=group)
    out = {}
    sizes = [router.cfg.num_experts for _, router in named]
    for (name, router), counts in zip(named, flat.split(sizes), strict=True):
        if router.cfg.balancing == "aux_free":
            router.expert_bias.add_(bias_update(counts, router.cfg.bias_update_rate))
        router.step_counts.zero_()
        out[name] = counts
    return out
