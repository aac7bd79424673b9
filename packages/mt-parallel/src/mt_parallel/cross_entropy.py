"""Cross-entropy over vocabulary-parallel logits, without ever gathering the full logits.

Shape suffixes: B batch, T sequence, V vocabulary, ``V_l = V / tp`` the local vocabulary slice
``[r·V_l, (r+1)·V_l)`` of TP rank ``r`` (the layout of a column-parallel LM head).

Per token with logits ``z`` and target ``t``::

    m    = max_v z_v                         (all-reduce MAX of the local maxima)
    S    = Σ_v exp(z_v − m)                  (all-reduce SUM of local sums)
    z_t  = the target logit                  (all-reduce SUM: only the owning rank adds it)
    loss = log S − (z_t − m)
    ∂loss/∂z_v = softmax(z)_v − [v = t]      (local: each rank writes its V_l slice)

Only ``(B, T)``-sized tensors cross the network (three all-reduces), never ``(B, T, V)``. The
math runs in fp32 (fp64 for fp64 logits), and the gradient is returned in the logits' dtype.
Tokens whose target is ``ignore_index`` get loss 0 and gradient 0.

Without TP (one rank holds the whole vocabulary) the mean goes through mt-fp8's chunked
cross-entropy (``mt_fp8.ops.cross_entropy``: the same math, Triton on CUDA, logits kept in their
dtype and upcast one chunk at a time, only the log-sum-exp saved for backward).

The whole sequence's mean under context parallelism (:func:`sequence_mean_cross_entropy`).
The cp ranks of a sequence hold ``n_r`` unignored targets each (``N = Σ_r n_r``), unequal
once some targets are ignored (an image, a prompt, the tail of a shifted sequence). Each rank
returns the share ``cp·Σ_local / N``, so the mean over the cp group (the gradient average of
DDP / FSDP2 / ZeRO-1 over dp×cp) is ``Σ_all / N``, the one-process mean; a per-rank mean
averaged over cp would weight the ranks' targets unequally. One all-reduce of two scalars
(``Σ_local`` detached and ``n_r``) gives ``N`` and the whole sequence's mean for logging.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

import mt_comm
from mt_fp8.ops import cross_entropy
from mt_parallel.mappings import group_rank, group_size


def _all_reduce(x: torch.Tensor, op: str, group: Any) -> torch.Tensor:
    if group_size(group) > 1:
        mt_comm.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits_BTV_l: torch.Tensor, target_BT: torch.Tensor, group: Any, ignore: int
    ) -> torch.Tensor:
        z_BTV = logits_BTV_l.to(torch.promote_types(logits_BTV_l.dtype, torch.float32))
        max_BT = z_BTV.amax(dim=-1)
        _all_reduce(max_BT, "max", group)
        z_BTV = z_BTV - max_BT.unsqueeze(-1)

        vocab_l = z_BTV.shape[-1]
        start = group_rank(group) * vocab_l
        owned_BT = (target_BT >= start) & (target_BT < start + vocab_l)
        local_t_BT = torch.where(owned_BT, target_BT - start, 0)
        target_logit_BT = z_BTV.gather(-1, local_t_BT.unsqueeze(-1)).squeeze(-1)
        target_logit_BT = torch.where(owned_BT, target_logit_BT, 0.0)
        _all_reduce(target_logit_BT, "sum", group)

        exp_BTV = z_BTV.exp_()
        sum_BT = exp_BTV.sum(dim=-1)
        _all_reduce(sum_BT, "sum", group)
        valid_BT = target_BT != ignore
        loss_BT = torch.where(valid_BT, sum_BT.log() - target_logit_BT, 0.0)

        softmax_BTV = exp_BTV.div_(sum_BT.unsqueeze(-1))
        ctx.save_for_backward(softmax_BTV, owned_BT & valid_BT, local_t_BT, valid_BT)
        ctx.dtype = logits_BTV_l.dtype
        return loss_BT

    @staticmethod
    def backward(ctx: Any, dloss_BT: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax_BTV, owned_BT, local_t_BT, valid_BT = ctx.saved_tensors
        grad_BTV = softmax_BTV.clone()  # saved tensors must survive retain_graph
        onehot = owned_BT.to(grad_BTV.dtype).unsqueeze(-1)
        grad_BTV.scatter_add_(-1, local_t_BT.unsqueeze(-1), -onehot)
        scale_BT = torch.where(valid_BT, dloss_BT.to(grad_BTV.dtype), 0.0)
        grad_BTV.mul_(scale_BT.unsqueeze(-1))
        return grad_BTV.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits_BTV_l: torch.Tensor,
    target_BT: torch.Tensor,
    tp_group: Any = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of vocab-sharded logits (module docstring).

    ``reduction``: ``"none"`` (per-token ``(B, T)`` fp32 losses), ``"sum"``, or ``"mean"`` over
    the tokens whose target is not ``ignore_index``. With ``tp_group=None`` the logits are the
    full vocabulary and this equals ``torch.nn.functional.cross_entropy``.
    """
    if target_BT.shape != logits_BTV_l.shape[:-1]:
        raise ValueError(
            f"targets of shape {tuple(target_BT.shape)} do not match logits of shape "
            f"{tuple(logits_BTV_l.shape)} (expected the logits' shape without the vocab axis)"
        )
    if group_size(tp_group) == 1 and reduction == "mean":
        return cross_entropy(
            logits_BTV_l.reshape(-1, logits_BTV_l.shape[-1]), target_BT.reshape(-1), ignore_index
        )
    loss_BT = _VocabParallelCrossEntropy.apply(logits_BTV_l, target_BT, tp_group, ignore_index)
    if reduction == "none":
        return loss_BT
    if reduction == "sum":
        return loss_BT.sum()
    if reduction == "mean":
        count = (target_BT != ignore_index).sum().clamp(min=1)
        return loss_BT.sum() / count
    raise ValueError(f"reduction={reduction!r}; valid: none, sum, mean")


class SequenceMean(NamedTuple):
    """:func:`sequence_mean_cross_entropy`'s result."""

    loss: torch.Tensor
    """This cp rank's share ``cp·Σ_local / N`` (0-d, differentiable): its mean over the cp group
    is the whole sequence's mean."""
    mean: torch.Tensor
    """The whole sequence's mean ``Σ_all / N`` (0-d, detached; equal on every cp rank)."""
    count: torch.Tensor
    """``N``, the cp group's unignored targets (0-d, the loss's dtype)."""


def sequence_mean_cross_entropy(
    logits_BTV_l: torch.Tensor,
    target_BT: torch.Tensor,
    tp_group: Any = None,
    cp_group: Any = None,
    ignore_index: int = -100,
) -> SequenceMean:
    """Mean cross-entropy over the unignored targets of the whole sequence, which the cp group
    holds in parts (module docstring); without CP the plain mean. Logits vocab-sharded over
    ``tp_group`` as in :func:`vocab_parallel_cross_entropy`, whose chunked mean it calls."""
    local_mean = vocab_parallel_cross_entropy(logits_BTV_l, target_BT, tp_group, ignore_index)
    local_count = (target_BT != ignore_index).sum().to(local_mean.dtype)
    cp = group_size(cp_group)
    if cp == 1:
        return SequenceMean(local_mean, local_mean.detach(), local_count)
    # The mean divides by max(n, 1), so mean·n is the local sum (0 when n = 0).
    local_sum = local_mean * local_count
    totals = torch.stack([local_sum.detach(), local_count])
    mt_comm.all_reduce(totals, op="sum", group=cp_group)
    total_sum, count = totals.unbind()
    divisor = count.clamp(min=1)
    return SequenceMean(local_sum * (cp / divisor), total_sum / divisor, count)


class SequenceCrossEntropy(nn.Module):
    """:func:`sequence_mean_cross_entropy` as a parameter-free module holding the cp group the
    CP transform gives it (``set_context_parallel``), so a model's loss can sit on the last
    pipeline chunk with the head, where the transform reaches it (a model object kept outside
    the chunks is never reached)."""

    def __init__(self, ignore_index: int = -100) -> None:
        super().__init__()
        self.ignore_index = ignore_index
        self.cp_group: Any = None
        """The cp group under context parallelism (set by the CP transform)."""

    def set_context_parallel(self, cp_group: Any, ring: bool) -> None:
        """Hook of the CP transform: the mean spans the cp group's whole sequence."""
        self.cp_group = cp_group

    def forward(
        self, logits_BTV_l: torch.Tensor, target_BT: torch.Tensor, tp_group: Any
    ) -> SequenceMean:
        return sequence_mean_cross_entropy(
            logits_BTV_l, target_BT, tp_group, self.cp_group, self.ignore_index
        )
