"""Ring attention for context parallelism: K/V travel around the cp group while blocks compute.

Layout and shapes as in :mod:`mt_parallel.context_parallel`: rank ``r`` of ``c`` CP ranks holds
the load-balanced chunks ``r`` and ``2c−1−r`` (``L`` tokens each, ``t = 2L``) of q, k, v. Shape
suffixes: B batch, H = K·G query heads in K groups of G (GQA: query head ``k·G + g`` reads KV
head ``k``), t local tokens, d query/key head dim, e value head dim (equal to d except in
multi-latent attention). K and V travel as one ``(B, K, t, d + e)`` message.

Forward. Step ``s = 0..c−1``: this rank holds the K/V of rank ``src = r − s (mod c)`` and sends
them on to rank ``r+1`` (receiving the next from ``r−1``) while it computes the block::

    src = r:  all local queries × all held keys, causal mask on global positions
    src < r:  all local queries × src's early chunk (wholly in the past; its late chunk is
              wholly in the future)
    src > r:  the late query chunk × all held keys (wholly in the past of it; the early query
              chunk sees none of them)

so every step after the first costs ``2L·L`` scores on every rank (load balance). Each block
gives partial outputs ``o_b`` and log-sum-exps ``lse_b``, merged exactly::

    lse = log(e^lse + e^lse_b),   o = o·e^(lse−lse) + o_b·e^(lse_b−lse)

(the first block holds every query's own key, so ``lse`` is finite from then on; a row a block
masks entirely has ``lse_b = −∞`` and weight 0).

Backward (the same ring again). With ``Δ = rowsum(dO·O)`` and the final ``lse``, per block
``P = exp(S − lse)``, ``dV = Pᵀ dO``, ``dS = P·(dO Vᵀ − Δ)``, ``dQ += dS K·scale``,
``dK = dSᵀ Q·scale``. ``dQ`` stays local; the fp32 ``dK, dV`` of a block travel with it: each
rank adds its contribution to the buffer it receives for the K/V it holds and passes it on, and
after ``c`` hops every buffer is home. K/V and gradient messages use different tags.

Document masks (packed sequences): the mask is also ``same document``; the ids of all tokens
are all-gathered once (``B·T`` integers). Attention dropout is not supported here (use the
all-gather variant). Blocks are computed with plain PyTorch in fp32 (fp64 for fp64 inputs);
:func:`_block_forward` / :func:`_block_backward` are where fused flash kernels that return
``lse`` slot in on GPU.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

import mt_comm
from mt_parallel.context_parallel import check_document_ids, load_balanced_positions
from mt_parallel.mappings import group_rank, group_size

KV_TAG, GRAD_TAG = 0, 1


class _Ring:
    """Asynchronous send-to-next / receive-from-previous around ``group``.

    NOTE: torch.distributed directly, because mt_comm's ``batch_send_recv`` waits at once and
    the point here is to compute while the messages are in flight.
    """

    def __init__(self, group: Any) -> None:
        rank, size = group_rank(group), group_size(group)
        self.group = group
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)

    def start(self, send: torch.Tensor, tag: int) -> tuple[torch.Tensor, list[Any]]:
        recv = torch.empty_like(send)
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, send, self.next, self.group, tag),
                dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
            ]
        )
        return recv, works


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


def _mask(
    pos_q: torch.Tensor | None,
    pos_k: torch.Tensor | None,
    doc_q: torch.Tensor | None,
    doc_k: torch.Tensor | None,
) -> torch.Tensor | None:
    """``(B or 1, 1, 1, q, k)`` boolean mask (causal and/or same document), or None."""
    mask = None
    if pos_q is not None:
        mask = (pos_k.unsqueeze(0) <= pos_q.unsqueeze(1)).unsqueeze(0)
    if doc_q is not None:
        same = doc_q.unsqueeze(2) == doc_k.unsqueeze(1)
        mask = same if mask is None else mask & same
    return None if mask is None else mask[:, None, None]


def _block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o_BKGqd, lse_BKGq)`` of one block; fully masked rows give ``o = 0, lse = −∞``."""
    s = torch.einsum("bkgqd,bkjd->bkgqj", q, k) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1))
    return torch.einsum("bkgqj,bkjd->bkgqd", p, v), lse


def _block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one block (module docstring); ``lse`` is the final, finite one."""
    s = torch.einsum("bkgqd,bkjd->bkgqj", q, k) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.exp(s - lse.unsqueeze(-1))
    dv = torch.einsum("bkgqj,bkgqd->bkjd", p, do)
    ds = p * (torch.einsum("bkgqd,bkjd->bkgqj", do, v) - delta.unsqueeze(-1))
    dq = torch.einsum("bkgqj,bkjd->bkgqd", ds, k) * scale
    dk = torch.einsum("bkgqj,bkgqd->bkjd", ds, q) * scale
    return dq, dk, dv


class _Plan:
    """Which rows of q and keys of the held K/V meet at each step (module docstring)."""

    def __init__(self, rank: int, cp: int, local: int, doc_all: torch.Tensor | None) -> None:
        self.rank, self.cp, self.local, self.doc_all = rank, cp, local, doc_all
        half = local // 2
        self.all, self.early, self.late = slice(0, local), slice(0, half), slice(half, local)
        self.positions = load_balanced_positions(local * cp, cp, rank)

    def step(self, s: int) -> tuple[slice, slice, torch.Tensor | None, torch.Tensor | None]:
        """``(query rows, key rows, positions if causal, doc ids of the held tokens)``."""
        src = (self.rank - s) % self.cp
        doc_k = None
        if self.doc_all is not None:
            doc_k = self.doc_all[:, src * self.local : (src + 1) * self.local]
        if src == self.rank:
            return self.all, self.all, self.positions, doc_k
        if src < self.rank:
            return self.all, self.early, None, doc_k
        return self.late, self.all, None, doc_k

    def mask(self, s: int, doc_q: torch.Tensor | None, device: torch.device) -> Any:
        rows, keys, positions, doc_k = self.step(s)
        pos = None if positions is None else positions.to(device)
        return _mask(
            None if pos is None else pos[rows],
            None if pos is None else pos[keys],
            None if doc_q is None else doc_q[:, rows],
            None if doc_k is None else doc_k[:, keys],
        )


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q_BHtd, k_BKtd, v_BKtd, group: Any, doc_q, doc_all):  # type: ignore[override]
        B, H, t, d = q_BHtd.shape
        K, e = k_BKtd.shape[1], v_BKtd.shape[-1]
        work = torch.float64 if q_BHtd.dtype == torch.float64 else torch.float32
        scale = 1.0 / math.sqrt(d)
        ring, plan = _Ring(group), _Plan(group_rank(group), group_size(group), t, doc_all)
        q = q_BHtd.to(work).view(B, K, H // K, t, d)
        out = torch.zeros((B, K, H // K, t, e), dtype=work, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=work, device=q.device)
        kv = torch.cat([k_BKtd, v_BKtd], dim=-1).contiguous()
        for s in range(plan.cp):
            if s + 1 < plan.cp:
                next_kv, works = ring.start(kv, KV_TAG)
            rows, keys, _, _ = plan.step(s)
            o_b, lse_b = _block_forward(
                q[:, :, :, rows],
                kv[:, :, keys, :d].to(work),
                kv[:, :, keys, d:].to(work),
                plan.mask(s, doc_q, q.device),
                scale,
            )
            new = torch.logaddexp(lse[..., rows], lse_b)
            out[..., rows, :] = out[..., rows, :] * torch.exp(lse[..., rows] - new).unsqueeze(
                -1
            ) + o_b * torch.exp(lse_b - new).unsqueeze(-1)
            lse[..., rows] = new
            if s + 1 < plan.cp:
                _wait(works)
                kv = next_kv
        ctx.save_for_backward(q_BHtd, k_BKtd, v_BKtd, out, lse, doc_q, doc_all)
        ctx.group, ctx.scale = group, scale
        return out.view(B, H, t, e).to(q_BHtd.dtype)

    @staticmethod
    def backward(ctx: Any, dout_BHtd):  # type: ignore[override]
        q_BHtd, k_BKtd, v_BKtd, out, lse, doc_q, doc_all = ctx.saved_tensors
        B, H, t, d = q_BHtd.shape
        K, e, work = k_BKtd.shape[1], v_BKtd.shape[-1], out.dtype
        ring = _Ring(ctx.group)
        plan = _Plan(group_rank(ctx.group), group_size(ctx.group), t, doc_all)
        q = q_BHtd.to(work).view(B, K, H // K, t, d)
        do = dout_BHtd.to(work).view_as(out)
        delta = (do * out).sum(-1)
        dq = torch.zeros_like(q)
        kv = torch.cat([k_BKtd, v_BKtd], dim=-1).contiguous()
        arrived, grad_works = None, []
        for s in range(plan.cp):
            if s + 1 < plan.cp:
                next_kv, kv_works = ring.start(kv, KV_TAG)
            rows, keys, _, _ = plan.step(s)
            dq_b, dk_b, dv_b = _block_backward(
                q[:, :, :, rows],
                kv[:, :, keys, :d].to(work),
                kv[:, :, keys, d:].to(work),
                do[:, :, :, rows],
                lse[..., rows],
                delta[..., rows],
                plan.mask(s, doc_q, q.device),
                ctx.scale,
            )
            dq[:, :, :, rows] += dq_b
            dkv = torch.zeros((B, K, t, d + e), dtype=work, device=q.device)
            dkv[:, :, keys, :d], dkv[:, :, keys, d:] = dk_b, dv_b
            if arrived is not None:
                _wait(grad_works)
                dkv += arrived
            arrived, grad_works = ring.start(dkv, GRAD_TAG)
            if s + 1 < plan.cp:
                _wait(kv_works)
                kv = next_kv
        _wait(grad_works)
        return (
            dq.view(B, H, t, d).to(q_BHtd.dtype),
            arrived[..., :d].to(k_BKtd.dtype),
            arrived[..., d:].to(v_BKtd.dtype),
            None,
            None,
            None,
        )


def ring_attention(
    q_BHtd: torch.Tensor,
    k_BKtd: torch.Tensor,
    v_BKtd: torch.Tensor,
    cp_group: Any,
    document_ids_Bt: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal (GQA, optionally document-masked) attention of the load-balanced local tokens
    over the whole sequence, exchanging K/V around the cp ring (module docstring)."""
    cp = group_size(cp_group)
    if cp == 1:
        raise ValueError("ring attention needs a cp group of more than one rank")
    local = q_BHtd.shape[2]
    if local % 2:
        raise ValueError(f"ring attention needs an even local length, got {local}")
    if q_BHtd.shape[1] % k_BKtd.shape[1]:
        raise ValueError(
            f"{q_BHtd.shape[1]} query heads are not a multiple of {k_BKtd.shape[1]} KV heads"
        )
    check_document_ids(q_BHtd, document_ids_Bt)
    doc_all = None
    if document_ids_Bt is not None:
        doc_all = mt_comm.all_gather(document_ids_Bt.contiguous(), dim=1, group=cp_group)
    return _RingAttention.apply(q_BHtd, k_BKtd, v_BKtd, cp_group, document_ids_Bt, doc_all)
