"""Ring attention for context parallelism: K/V travel around the cp group while blocks compute.

Layout and shapes as in :mod:`mt_parallel.context_parallel`: rank ``r`` of ``c`` CP ranks holds
the load-balanced chunks ``r`` and ``2c−1−r`` (``L`` tokens each, ``t = 2L``) of q, k, v. Shape
suffixes: B batch, H = K·G query heads in K groups of G (GQA: query head ``k·G + g`` reads KV
head ``k``), t local tokens, d query/key head dim, e value head dim (equal to d except in
multi-latent attention). K and V travel as one ``(B, K, t, d + e)`` message (or a narrower
block that each rank expands, "Block expanders" below).

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

Block expanders (:func:`expanded_ring_attention`). A caller whose K/V are a per-token function
of something narrower passes that instead: the message is this rank's block ``(B, 1, t, X)``
and a :class:`KVExpander` turns every block a rank holds (its own and each received one) into
the block's K/V before the block attention above, which is unchanged. Multi-head latent
attention passes its compressed latent ``[RMSNorm(c) ; RoPE(k_rot)]`` (X = C + R values per
token) and expands it with ``kv_b`` (:mod:`mt_parallel.mla`). The backward receives the blocks
again, expands each once more with its graph (the ring keeps no expanded K/V: that would be the
whole sequence's), runs the block backward on it, and takes the block's ``dK, dV`` back through
the expansion (``torch.autograd.grad``): the block's gradient joins the buffer that travels home
as ``dK, dV`` do above (now ``X`` wide), and the gradients of the expander's ``params`` (``kv_b``'s
weight) are summed over the steps and returned as the gradients of the ring's inputs, so they
reach the parameters through autograd like any other (DDP/FSDP hooks, TP shards: each rank's
expander reads its own heads' slice). Per block on the wire: ``X`` values per token where K/V
take ``K·(d + e)``; the price is the expansion of ``cp`` blocks per rank in the forward and again
in the backward (the module docstring of :mod:`mt_parallel.mla` counts both for MLA). Plain
:func:`ring_attention` passes ``K|V`` and splits it, with no expansion and no extra autograd.

Precision regions. The block attention above runs with ``torch.autocast`` off, in the forward
as in the backward, whatever region the caller runs the forward in: flash blocks in the
inputs' dtype, plain ones in fp32 (fp64 for fp64 inputs; "Block kernels" below) (an autocast region turned the forward's score and output GEMMs into bf16 while
the backward recomputed the probabilities in fp32 against the forward's ``lse``). An expander
instead runs in the caller's regions, and the backward enters them again: ``torch.autocast``
and :func:`mt_fp8.fp8_autocast` as they were at the forward, captured there, so every block is
expanded to the very K/V its forward attended to (the trainer runs the forward under bf16
autocast and the backward outside it: before, the backward expanded a bf16 block with an fp32
``kv_b`` and failed on the dtype mismatch).

Document masks (packed sequences): the mask is also ``same document``; the ids of all tokens
are all-gathered once (``B·T`` integers). Attention dropout is not supported here (use the
all-gather variant).

Block kernels. Without document masks a block is one call of PyTorch's flash attention, which
returns ``lse`` (:func:`fused_blocks` says where: any float dtype on the CPU,
``_scaled_dot_product_flash_attention_for_cpu``; bf16/fp16 on CUDA with flash enabled,
``_scaled_dot_product_flash_attention``), in the dtype q, k, v arrive in (bf16 under the
trainer's autocast; the merge and the ``dQ``/``dK, dV`` sums stay in fp32). Its backward kernel
is given the merged ``O`` and ``lse`` of the block's rows, from which it forms ``Δ`` and
``P = exp(S − lse)`` as above, so each block's gradients are the same terms (the scheme of
PyTorch's own context-parallel ring). GQA without copying K/V where the block has no mask: the
``G`` query heads of a KV head are folded into its rows (``(B, K, G·q, d)`` against
``(B, K, j, d)``: rows are independent); the first step's causal block expands K/V to the
``H`` heads instead (its mask is on row positions). A value head dim ``e < d`` (MLA) is padded
with zeros to ``d`` (flash takes one head dim; zero columns change no score, their outputs are
dropped). Elsewhere (document masks, fp32 on CUDA, flash off) the blocks run the plain
PyTorch formulas above in fp32 (fp64 for fp64 inputs).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

import mt_comm
import mt_fp8
from mt_parallel.context_parallel import check_document_ids, load_balanced_positions
from mt_parallel.mappings import group_rank, group_size

KV_TAG, GRAD_TAG = 0, 1


class KVExpander(Protocol):
    """Turns a message block the ring passes into that block's K and V (module docstring,
    "Block expanders")."""

    params: tuple[torch.Tensor, ...]
    """The tensors (weights) the expansion reads that need gradients; the ring returns theirs."""

    def __call__(self, block_B1jX: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_BKjd, v_BKje)`` of the block's ``j`` tokens, differentiable in the block and in
        :attr:`params`."""
        ...


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


def fused_blocks(q_BHtd: torch.Tensor, documents: bool) -> bool:
    """Whether the ring runs its blocks in PyTorch's flash attention (module docstring, "Block
    kernels"): no document masks, and on CUDA bf16/fp16 inputs with flash attention enabled
    and a head dim its kernels take (a multiple of 8, at most 256)."""
    if documents:
        return False
    if q_BHtd.device.type == "cpu":
        return q_BHtd.is_floating_point()
    d = q_BHtd.shape[-1]
    return (
        q_BHtd.device.type == "cuda"
        and q_BHtd.dtype in (torch.bfloat16, torch.float16)
        and d % 8 == 0
        and d <= 256
        and torch.backends.cuda.flash_sdp_enabled()
    )


class _FlashBlock:
    """One block through flash attention in the layout the kernel takes (module docstring,
    "Block kernels"): queries ``(B, K, G, q, d)``, K ``(B, K, j, d)``, V ``(B, K, j, e)``."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
        B, K, G, rows, d = q.shape
        self.shape, self.causal, self.e = (B, K, G, rows), causal, v.shape[-1]
        if self.e < d:
            v = torch.nn.functional.pad(v, (0, d - self.e))
        if causal:  # the mask is on row positions: one head per query head
            self.q = q.reshape(B, K * G, rows, d)
            self.k = k.repeat_interleave(G, dim=1)
            self.v = v.repeat_interleave(G, dim=1)
        else:
            self.q = q.reshape(B, K, G * rows, d)
            self.k, self.v = k.contiguous(), v.contiguous()

    def rows_layout(self, t: torch.Tensor) -> torch.Tensor:
        """A ``(B, K, G, q, ·)`` tensor (or ``(B, K, G, q)``) in the kernel's layout."""
        B, K, G, rows = self.shape
        heads, length = (K * G, rows) if self.causal else (K, G * rows)
        return t.reshape(B, heads, length, *t.shape[4:]).contiguous()

    def forward(self, scale: float) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """``(o_BKGqe, lse_BKGq, rest)``; ``rest`` is what the backward kernel takes back."""
        if self.q.device.type == "cpu":
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                self.q, self.k, self.v, 0.0, self.causal, scale=scale
            )
            rest: tuple = (lse.dtype,)  # the backward takes lse back in its own dtype
        else:
            o, lse, *rest_list = torch.ops.aten._scaled_dot_product_flash_attention(
                self.q, self.k, self.v, 0.0, self.causal, False, scale=scale
            )
            rest = tuple(rest_list[:6])  # cum_seq_q/k, max_q/k, philox seed/offset
        return o.reshape(*self.shape, -1)[..., : self.e], lse.reshape(self.shape), rest

    def backward(
        self, do: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, rest: tuple, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq_BKGqd, dk_BKjd, dv_BKje)`` of the block given the merged ``out`` and ``lse``
        of its rows and ``dO``."""
        d = self.q.shape[-1]
        if self.e < d:
            do = torch.nn.functional.pad(do, (0, d - self.e))
            out = torch.nn.functional.pad(out, (0, d - self.e))
        do, out = self.rows_layout(do.to(self.q.dtype)), self.rows_layout(out.to(self.q.dtype))
        if self.q.device.type == "cpu":
            (lse_dtype,) = rest
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                do, self.q, self.k, self.v, out, self.rows_layout(lse.to(lse_dtype)), 0.0,
                self.causal, scale=scale,
            )  # fmt: skip
        else:
            lse = self.rows_layout(lse.float())
            cum_q, cum_k, max_q, max_k, seed, offset = rest
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                do, self.q, self.k, self.v, out, lse, cum_q, cum_k, max_q, max_k, 0.0,
                self.causal, seed, offset, scale=scale,
            )  # fmt: skip
        B, K, G, rows = self.shape
        if self.causal:
            dk = dk.view(B, K, G, *dk.shape[2:]).sum(2)
            dv = dv.view(B, K, G, *dv.shape[2:]).sum(2)
        return dq.reshape(B, K, G, rows, d), dk, dv[..., : self.e]


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


def _rows(block: torch.Tensor, keys: slice) -> torch.Tensor:
    """The ``keys`` tokens of a message block (tokens on dim 2)."""
    return block[:, :, keys]


def _callers_regions(device_type: str) -> Callable[[], contextlib.ExitStack]:
    """A context entering the caller's ``torch.autocast`` (for ``device_type``) and
    :func:`mt_fp8.fp8_autocast` settings as they are now, for the expansions (module docstring,
    "Precision regions")."""
    autocast = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    fp8 = mt_fp8.current_fp8_state()

    def enter() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast(device_type, autocast[1], enabled=autocast[0]))
        if fp8 is not None:
            stack.enter_context(mt_fp8.fp8_autocast(fp8.enabled, fp8.recipe, fp8.amax_group))
        return stack

    return enter


def _held_kv(
    block: torch.Tensor,
    expander: KVExpander | None,
    d: int,
    work: torch.dtype,
    regions: Callable[[], contextlib.ExitStack] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V (in ``work``) of a message block: split at ``d``, or expanded inside the
    caller's ``regions`` (given with an expander)."""
    if expander is None:
        return block[..., :d].to(work), block[..., d:].to(work)
    assert regions is not None
    with regions():
        k, v = expander(block)
    return k.to(work), v.to(work)


def _autocast_off(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method(ctx, x, ...)`` run with ``torch.autocast`` off on ``x``'s device (module
    docstring, "Precision regions")."""

    @functools.wraps(method)
    def run(ctx: Any, x: torch.Tensor, *args: Any) -> Any:
        with torch.autocast(x.device.type, enabled=False):
            return method(ctx, x, *args)

    return run


class _RingAttention(torch.autograd.Function):
    """The ring loop over messages ``msg_B·t·`` (module docstring): ``expander`` None for K|V
    concatenated along the last dim (split at q's head dim ``d``), else the block expander,
    whose ``params`` follow as the last inputs and receive its weight gradients. Both passes
    run with autocast off, the expansions in the caller's ``regions`` (module docstring)."""

    @staticmethod
    @_autocast_off
    def forward(ctx: Any, q_BHtd, msg, expander, regions, group, doc_q, doc_all, *params):  # type: ignore[override]
        B, H, t, d = q_BHtd.shape
        work = torch.float64 if q_BHtd.dtype == torch.float64 else torch.float32
        fused = fused_blocks(q_BHtd, doc_q is not None)
        blocks = q_BHtd.dtype if fused else work  # the dtype the blocks compute in
        scale = 1.0 / math.sqrt(d)
        ring, plan = _Ring(group), _Plan(group_rank(group), group_size(group), t, doc_all)
        out = lse = q = None
        rests = []
        kv = msg.contiguous()
        for s in range(plan.cp):
            if s + 1 < plan.cp:
                next_kv, works = ring.start(kv, KV_TAG)
            rows, keys, _, _ = plan.step(s)
            k, v = _held_kv(_rows(kv, keys), expander, d, blocks, regions)
            if out is None:  # the K/V heads and value dim are known once a block is expanded
                K, e = k.shape[1], v.shape[-1]
                if H % K:
                    raise ValueError(f"{H} query heads are not a multiple of {K} KV heads")
                q = q_BHtd.to(blocks).view(B, K, H // K, t, d)
                out = torch.zeros((B, K, H // K, t, e), dtype=work, device=q.device)
                lse = torch.full(q.shape[:-1], float("-inf"), dtype=work, device=q.device)
            if fused:
                o_b, lse_b, rest = _FlashBlock(q[:, :, :, rows], k, v, s == 0).forward(scale)
                o_b, lse_b = o_b.to(work), lse_b.to(work)
                rests.append(rest)
            else:
                o_b, lse_b = _block_forward(
                    q[:, :, :, rows], k, v, plan.mask(s, doc_q, q.device), scale
                )
            new = torch.logaddexp(lse[..., rows], lse_b)
            out[..., rows, :] = out[..., rows, :] * torch.exp(lse[..., rows] - new).unsqueeze(
                -1
            ) + o_b * torch.exp(lse_b - new).unsqueeze(-1)
            lse[..., rows] = new
            if s + 1 < plan.cp:
                _wait(works)
                kv = next_kv
        ctx.save_for_backward(q_BHtd, msg, out, lse, doc_q, doc_all)
        ctx.group, ctx.scale, ctx.params, ctx.rests = group, scale, params, rests
        ctx.expander, ctx.regions = expander, regions
        return out.view(B, H, t, -1).to(q_BHtd.dtype)

    @staticmethod
    @_autocast_off
    def backward(ctx: Any, dout_BHtd):  # type: ignore[override]
        q_BHtd, msg, out, lse, doc_q, doc_all = ctx.saved_tensors
        expander, regions, params = ctx.expander, ctx.regions, ctx.params
        B, H, t, d = q_BHtd.shape
        K, work = out.shape[1], out.dtype
        fused = bool(ctx.rests)
        blocks = q_BHtd.dtype if fused else work
        ring = _Ring(ctx.group)
        plan = _Plan(group_rank(ctx.group), group_size(ctx.group), t, doc_all)
        q = q_BHtd.to(blocks).view(B, K, H // K, t, d)
        do = dout_BHtd.to(work).view_as(out)
        delta = None if fused else (do * out).sum(-1)
        dq = torch.zeros(q.shape, dtype=work, device=q.device)
        param_grads: list[torch.Tensor | None] = [None] * len(params)
        kv = msg.contiguous()
        arrived, grad_works = None, []
        for s in range(plan.cp):
            if s + 1 < plan.cp:
                next_kv, kv_works = ring.start(kv, KV_TAG)
            rows, keys, _, _ = plan.step(s)
            block = _rows(kv, keys)
            if expander is not None:
                # The block is expanded again (the ring keeps no expanded K/V), with its graph
                # this time, so the block's dK, dV go back through the expansion below.
                block = block.detach().requires_grad_()
                with torch.enable_grad():
                    k_graph, v_graph = _held_kv(block, expander, d, blocks, regions)
                k, v = k_graph.detach(), v_graph.detach()
            else:
                k, v = _held_kv(block, None, d, blocks, regions)
            if fused:
                dq_b, dk_b, dv_b = _FlashBlock(q[:, :, :, rows], k, v, s == 0).backward(
                    do[:, :, :, rows], out[..., rows, :], lse[..., rows], ctx.rests[s], ctx.scale
                )
            else:
                dq_b, dk_b, dv_b = _block_backward(
                    q[:, :, :, rows],
                    k,
                    v,
                    do[:, :, :, rows],
                    lse[..., rows],
                    delta[..., rows],
                    plan.mask(s, doc_q, q.device),
                    ctx.scale,
                )
            dq[:, :, :, rows] += dq_b
            if expander is None:
                d_block = torch.cat([dk_b, dv_b], dim=-1)
            else:
                d_block, *d_params = torch.autograd.grad(
                    (k_graph, v_graph), (block, *params), (dk_b, dv_b), allow_unused=True
                )
                for i, grad in enumerate(d_params):
                    if grad is not None:
                        acc = param_grads[i]
                        param_grads[i] = grad.to(work) if acc is None else acc + grad
            dkv = torch.zeros(kv.shape, dtype=work, device=q.device)
            dkv[:, :, keys] = d_block
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
            arrived.to(msg.dtype),
            None,
            None,
            None,
            None,
            None,
            *(
                None if g is None else g.to(p.dtype)
                for g, p in zip(param_grads, params, strict=True)
            ),
        )


def _check(q_BHtd: torch.Tensor, cp_group: Any, doc: Any) -> Any:
    """Validate the ring's inputs; the all-gathered document ids (``B·T`` integers) or None."""
    cp = group_size(cp_group)
    if cp == 1:
        raise ValueError("ring attention needs a cp group of more than one rank")
    local = q_BHtd.shape[2]
    if local % 2:
        raise ValueError(f"ring attention needs an even local length, got {local}")
    check_document_ids(q_BHtd, doc)
    if doc is None:
        return None
    return mt_comm.all_gather(doc.contiguous(), dim=1, group=cp_group)


def ring_attention(
    q_BHtd: torch.Tensor,
    k_BKtd: torch.Tensor,
    v_BKtd: torch.Tensor,
    cp_group: Any,
    document_ids_Bt: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal (GQA, optionally document-masked) attention of the load-balanced local tokens
    over the whole sequence, exchanging K/V around the cp ring (module docstring)."""
    doc_all = _check(q_BHtd, cp_group, document_ids_Bt)
    kv_BKtf = torch.cat([k_BKtd, v_BKtd], dim=-1)
    return _RingAttention.apply(q_BHtd, kv_BKtf, None, None, cp_group, document_ids_Bt, doc_all)


def expanded_ring_attention(
    q_BHtd: torch.Tensor,
    block_B1tX: torch.Tensor,
    expander: KVExpander,
    cp_group: Any,
    document_ids_Bt: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`ring_attention` passing ``block_B1tX`` (this rank's tokens of a narrower
    message, tokens on dim 2) around the ring instead of K/V; each rank turns every block it
    holds into K/V with ``expander`` (module docstring, "Block expanders")."""
    if block_B1tX.dim() != 4 or block_B1tX.shape[2] != q_BHtd.shape[2]:
        raise ValueError(
            f"the ring's block of shape {tuple(block_B1tX.shape)} must be (batch, ·, tokens, ·) "
            f"with the queries' {q_BHtd.shape[2]} tokens"
        )
    doc_all = _check(q_BHtd, cp_group, document_ids_Bt)
    params = tuple(expander.params)
    regions = _callers_regions(q_BHtd.device.type)
    return _RingAttention.apply(
        q_BHtd, block_B1tX, expander, regions, cp_group, document_ids_Bt, doc_all, *params
    )
