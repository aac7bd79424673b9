"""Context parallelism: causal attention over a sequence split across the cp group.

Layout (load balancing). A sequence of length ``T`` is cut into ``2·cp`` chunks of ``L = T/(2·cp)``
tokens. CP rank ``r`` holds chunk ``r`` followed by chunk ``2·cp−1−r`` (one early, one late), so
under a causal mask every rank attends to the same number of keys::

    cp=2, T=8 (L=2):  rank 0 holds positions [0 1 | 6 7], rank 1 holds [2 3 | 4 5]

:func:`shard_sequence` produces this layout (for tokens, labels and positions),
:func:`unshard_sequence` inverts it.

Attention (all-gather K/V, as in Llama 3 training). Shape suffixes: B batch, H query heads,
K key/value heads (GQA: H a multiple of K), t local tokens ``2L``, S gathered tokens ``T``, d head
dim. Each rank all-gathers ``k_BKtd`` and ``v_BKtd`` over cp (backward: reduce-scatter, summing
every rank's contribution to each key's gradient), reorders the gathered chunks into global order,
and for each of its two query chunks with global index ``g`` attends to the keys ``[0, (g+1)·L)``
with the causal mask aligned to the lower right (query ``i`` of the chunk sits at global position
``g·L + i`` and sees keys ``≤ g·L + i``). Work per rank is ``L·(r+1)·L + L·(2cp−r)·L``, the same
for every ``r``. RoPE is applied before the gather with each token's global position, so the
gathered keys carry their own rotation. :func:`gather_sequence` is that gather for any
per-token tensor (all-gather, reorder; backward reduce-scatter), so a caller may gather
something narrower than K/V and hand the core the whole sequence's K/V (``kv_gathered=True``):
multi-head latent attention gathers its compressed latent and expands it on every rank
(:mod:`mt_parallel.mla`).

Packed sequences. With per-token ``document_ids`` (or :func:`document_ids_from_cu_seqlens`),
a query also needs the key's document to equal its own: the mask is ``causal ∧ same document``
(the causal offsets above, unchanged). Under CP each rank all-gathers the ids of the keys with
K/V (``B·T`` integers) and reorders them like the keys. A query always sees itself, so no row
of the mask is empty.

Ring attention (K/V passed around the cp group with p2p while blocks compute, the GPU
performance path, one K/V block in flight instead of the whole sequence) is
:func:`mt_parallel.ring_attention`, with the same layout and results.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import mt_comm
from mt_parallel.config import validate_cp_sequence
from mt_parallel.mappings import all_gather_grad_rs, group_rank, group_size


def load_balanced_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global positions held by ``cp_rank``: chunk ``r`` then chunk ``2·cp−1−r``."""
    validate_cp_sequence(cp_size, seq_len)
    if cp_size == 1:
        return torch.arange(seq_len)
    chunk = seq_len // (2 * cp_size)
    early = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    late_start = (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([early, torch.arange(late_start, late_start + chunk)])


def shard_sequence(x: torch.Tensor, dim: int, cp_group: Any) -> torch.Tensor:
    """This rank's load-balanced part of ``x`` along ``dim`` (no autograd through the cut)."""
    cp = group_size(cp_group)
    positions = load_balanced_positions(x.shape[dim], cp, group_rank(cp_group))
    return x.index_select(dim, positions.to(x.device)) if cp > 1 else x


def unshard_sequence(x_local: torch.Tensor, dim: int, cp_group: Any) -> torch.Tensor:
    """Gather every rank's load-balanced part back into the full sequence (no autograd)."""
    cp = group_size(cp_group)
    if cp == 1:
        return x_local
    gathered = mt_comm.all_gather(x_local.contiguous(), dim=dim, group=cp_group)
    seq_len = gathered.shape[dim]
    order = torch.cat([load_balanced_positions(seq_len, cp, r) for r in range(cp)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(seq_len)
    return gathered.index_select(dim, inverse.to(x_local.device))


def document_ids_from_cu_seqlens(
    cu_seqlens: torch.Tensor, batch: int, seq_len: int
) -> torch.Tensor:
    """Per-token document ids ``(batch, seq_len)`` from cumulative document lengths.

    ``cu_seqlens`` is flash-attention's varlen layout over the flattened batch:
    ``[0, l₀, l₀+l₁, ..., batch·seq_len]``. Token ``i`` gets the index of the document that
    holds it; a document cut at a row end continues under the same id on the next row, which is
    harmless (rows never attend to each other). Shard the ids like the tokens under CP.
    """
    total = batch * seq_len
    bounds = cu_seqlens.to(torch.long)
    if bounds.dim() != 1 or bounds[0] != 0 or bounds[-1] != total or (bounds.diff() < 0).any():
        raise ValueError(
            f"cu_seqlens must rise from 0 to batch·seq_len = {total}, got {cu_seqlens.tolist()}"
        )
    tokens = torch.arange(total, device=bounds.device)
    return torch.searchsorted(bounds[1:], tokens, right=True).view(batch, seq_len)


def _global_order(chunk: int, cp: int) -> torch.Tensor:
    """Indices into the rank-ordered gather that put the ``2·cp`` chunks in global order."""
    slot_of_chunk = {}
    for rank in range(cp):
        slot_of_chunk[rank] = 2 * rank
        slot_of_chunk[2 * cp - 1 - rank] = 2 * rank + 1
    return torch.cat(
        [
            torch.arange(slot_of_chunk[g] * chunk, (slot_of_chunk[g] + 1) * chunk)
            for g in range(2 * cp)
        ]
    )


def gather_sequence(x_BtX: torch.Tensor, dim: int, cp_group: Any) -> torch.Tensor:
    """The whole sequence, in global order, from every cp rank's load-balanced part of ``x``
    along ``dim`` (``t`` tokens each, ``cp·t`` out); differentiable: the backward
    reduce-scatters, summing every rank's contribution to each token's gradient."""
    cp = group_size(cp_group)
    if cp == 1:
        return x_BtX
    local = x_BtX.shape[dim]
    if local % 2:
        raise ValueError(f"context-parallel attention needs an even local length, got {local}")
    order = _global_order(local // 2, cp).to(x_BtX.device)
    return all_gather_grad_rs(x_BtX, dim, cp_group).index_select(dim, order)


def whole_sequence_kv(
    q_BHtd: torch.Tensor,
    k_BKtd: torch.Tensor,
    v_BKtd: torch.Tensor,
    cp_group: Any,
    kv_gathered: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of the whole sequence in global order: gathered here (:func:`gather_sequence`), or
    as handed over (``kv_gathered``), which must hold ``cp`` times the queries' tokens."""
    cp = group_size(cp_group)
    if not kv_gathered:
        return gather_sequence(k_BKtd, 2, cp_group), gather_sequence(v_BKtd, 2, cp_group)
    if k_BKtd.shape[2] != cp * q_BHtd.shape[2]:
        raise ValueError(
            f"gathered K/V hold {k_BKtd.shape[2]} tokens, not cp·t = {cp}·{q_BHtd.shape[2]}"
        )
    return k_BKtd, v_BKtd


def check_document_ids(q_BHtd: torch.Tensor, document_ids_Bt: torch.Tensor | None) -> None:
    """Document ids, if any, have the queries' ``(batch, tokens)`` shape."""
    if document_ids_Bt is not None and document_ids_Bt.shape != q_BHtd.shape[::2]:
        raise ValueError(
            f"document ids of shape {tuple(document_ids_Bt.shape)} do not match the "
            f"(batch, tokens) = {tuple(q_BHtd.shape[::2])} of the queries"
        )


def _mask(
    query_pos_q: torch.Tensor,
    keys: int,
    doc_q_Bq: torch.Tensor | None,
    doc_k_Bk: torch.Tensor | None,
) -> torch.Tensor:
    """Boolean ``(1 or B, 1, q, keys)`` mask: key position ≤ query position, same document."""
    mask_qk = torch.arange(keys, device=query_pos_q.device).unsqueeze(0) <= query_pos_q.unsqueeze(1)
    if doc_q_Bq is None:
        return mask_qk
    same_doc_Bqk = doc_q_Bq.unsqueeze(2) == doc_k_Bk[:, :keys].unsqueeze(1)
    return (mask_qk & same_doc_Bqk).unsqueeze(1)


def context_parallel_attention(
    q_BHtd: torch.Tensor,
    k_BKtd: torch.Tensor,
    v_BKtd: torch.Tensor,
    cp_group: Any,
    dropout_p: float = 0.0,
    document_ids_Bt: torch.Tensor | None = None,
    kv_gathered: bool = False,
) -> torch.Tensor:
    """Causal attention of this rank's load-balanced queries over the whole sequence.

    ``document_ids_Bt`` (integer ids of this rank's tokens, sharded like them): a query sees
    only keys of its own document (packed sequences). ``kv_gathered``: ``k``/``v`` already hold
    the whole sequence in global order (:func:`gather_sequence`), so they are not gathered here.
    """
    cp, rank = group_size(cp_group), group_rank(cp_group)
    gqa = q_BHtd.shape[1] != k_BKtd.shape[1]
    check_document_ids(q_BHtd, document_ids_Bt)
    if cp == 1:
        if document_ids_Bt is None:
            return F.scaled_dot_product_attention(
                q_BHtd, k_BKtd, v_BKtd, dropout_p=dropout_p, is_causal=True, enable_gqa=gqa
            )
        positions = torch.arange(q_BHtd.shape[2], device=q_BHtd.device)
        mask = _mask(positions, len(positions), document_ids_Bt, document_ids_Bt)
        return F.scaled_dot_product_attention(
            q_BHtd, k_BKtd, v_BKtd, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa
        )
    local = q_BHtd.shape[2]
    if local % 2:
        raise ValueError(f"context-parallel attention needs an even local length, got {local}")
    chunk = local // 2
    order = _global_order(chunk, cp).to(q_BHtd.device)
    k_BKSd, v_BKSd = whole_sequence_kv(q_BHtd, k_BKtd, v_BKtd, cp_group, kv_gathered)
    doc_BS = None
    if document_ids_Bt is not None:
        gathered = mt_comm.all_gather(document_ids_Bt.contiguous(), dim=1, group=cp_group)
        doc_BS = gathered.index_select(1, order)
    outputs = []
    for half, g in enumerate((rank, 2 * cp - 1 - rank)):
        rows = slice(half * chunk, (half + 1) * chunk)
        keys = (g + 1) * chunk
        query_pos = torch.arange(chunk, device=q_BHtd.device) + g * chunk
        doc_q = None if document_ids_Bt is None else document_ids_Bt[:, rows]
        outputs.append(
            F.scaled_dot_product_attention(
                q_BHtd[:, :, rows],
                k_BKSd[:, :, :keys],
                v_BKSd[:, :, :keys],
                attn_mask=_mask(query_pos, keys, doc_q, doc_BS),
                dropout_p=dropout_p,
                enable_gqa=gqa,
            )
        )
    return torch.cat(outputs, dim=2)
