"""Worker functions for packed-sequence (document) masking and dropout RNG regions.

Document masking is checked against a reference that runs every document on its own (fp64,
one process), so it proves that no query sees a key of another document, at any cp degree.
Dropout is checked by looking at the masks themselves: equal across TP ranks where the
activations are replicated, different where they are sharded. Devices and degrees as in
:mod:`parallel_checks` (``device`` defaults to this process's device; results come back on the
CPU).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from parallel_checks import (
    HEADS,
    KV_HEADS,
    _batch,
    _lm,
    _local_batch,
    compare_grads,
    device_of,
    rel_err,
)
from toy_lm import PLAN, DecoderLM

import mt_comm
import mt_parallel as mp


@contextlib.contextmanager
def flex_backward_on_cpu() -> Iterator[None]:
    """Let FlexAttention's eager implementation run its backward on the CPU.

    torch refuses it in ``flex_attention``'s input checks (``_validate_device``) only; the
    higher-order op underneath has a device-independent math forward and backward, which is
    what the CPU tests run: they check the block mask, the GQA layout and the wiring, and the
    GPU test holds the fused CUDA kernel to the same numbers.
    """
    import torch.nn.attention.flex_attention as flex

    refusal = flex._validate_device
    flex._validate_device = lambda *tensors: None
    try:
        yield
    finally:
        flex._validate_device = refusal


def document_ids(seed: int, batch: int, seq: int, documents: int = 4) -> torch.Tensor:
    """``(batch, seq)`` ids 0, 0, 1, 1, 1, 2, ...: ``documents`` random-length runs per row."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        cuts = torch.randperm(seq - 1, generator=generator)[: documents - 1] + 1
        starts = torch.zeros(seq, dtype=torch.long)
        starts[cuts] = 1
        rows.append(starts.cumsum(0))
    return torch.stack(rows)


def runs(ids_T: torch.Tensor) -> list[slice]:
    """The slices of equal consecutive ids (the documents of one row)."""
    starts = [0] + [t for t in range(1, len(ids_T)) if ids_T[t] != ids_T[t - 1]] + [len(ids_T)]
    return [slice(a, b) for a, b in itertools.pairwise(starts)]


def attention_by_document(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ids_BT: torch.Tensor
) -> torch.Tensor:
    """Causal GQA attention run on every document of every row separately."""
    rows = []
    for b in range(q.shape[0]):
        pieces = [
            F.scaled_dot_product_attention(
                q[b : b + 1, :, doc], k[b : b + 1, :, doc], v[b : b + 1, :, doc],
                is_causal=True, enable_gqa=True,
            )
            for doc in runs(ids_BT[b])
        ]  # fmt: skip
        rows.append(torch.cat(pieces, dim=2))
    return torch.cat(rows)


def cp_attention_documents(
    seed: int = 0, cp: int | None = None, tp: int = 1, device: str | None = None
) -> dict[str, float]:
    """Document-masked causal attention at cp (default: world over tp) vs. the per-document
    reference."""
    dev = device_of(device)
    cp = mt_comm.group_size() // tp if cp is None else cp
    state = mt_comm.init_parallel_state(cp=cp, tp=tp)
    cp_group = state.group("cp")
    generator = torch.Generator().manual_seed(seed)
    B, T, d = 2, 8 * state.size("cp"), 8
    ids = document_ids(seed + 1, B, T)
    q = torch.randn(B, HEADS, T, d, generator=generator, dtype=torch.float64)
    k = torch.randn(B, KV_HEADS, T, d, generator=generator, dtype=torch.float64)
    v = torch.randn(B, KV_HEADS, T, d, generator=generator, dtype=torch.float64)
    dy = torch.randn(B, HEADS, T, d, generator=generator, dtype=torch.float64)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = attention_by_document(*ref, ids)
    ref_out.backward(dy)

    local = [mp.shard_sequence(t, 2, cp_group).float().to(dev).requires_grad_() for t in (q, k, v)]
    local_ids = mp.shard_sequence(ids, 1, cp_group).to(dev)
    out = mp.context_parallel_attention(*local, cp_group, document_ids_Bt=local_ids)
    out.backward(mp.shard_sequence(dy, 2, cp_group).float().to(dev))
    errors = {"out": rel_err(out, mp.shard_sequence(ref_out, 2, cp_group))}
    for name, mine, theirs in zip("qkv", local, ref, strict=True):
        errors[f"d{name}"] = rel_err(mine.grad, mp.shard_sequence(theirs.grad, 2, cp_group))
    return errors


def ring_attention(
    documents: bool,
    seed: int = 0,
    cp: int | None = None,
    tp: int = 1,
    device: str | None = None,
    value_dim: int = 8,
) -> dict[str, dict[str, float]]:
    """Ring attention at cp (default: world over tp) vs. the all-gather version and the fp64
    reference; values of ``value_dim`` (keys 8: MLA's V head dim differs from its QK one)."""
    dev = device_of(device)
    cp = mt_comm.group_size() // tp if cp is None else cp
    state = mt_comm.init_parallel_state(cp=cp, tp=tp)
    cp_group = state.group("cp")
    generator = torch.Generator().manual_seed(seed)
    B, T, d = 2, 8 * state.size("cp"), 8
    ids = document_ids(seed + 1, B, T) if documents else None
    q = torch.randn(B, HEADS, T, d, generator=generator, dtype=torch.float64)
    k = torch.randn(B, KV_HEADS, T, d, generator=generator, dtype=torch.float64)
    v = torch.randn(B, KV_HEADS, T, value_dim, generator=generator, dtype=torch.float64)
    dy = torch.randn(B, HEADS, T, value_dim, generator=generator, dtype=torch.float64)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    if documents:
        ref_out = attention_by_document(*ref, ids)
    else:
        ref_out = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True)
    ref_out.backward(dy)

    local_ids = None if ids is None else mp.shard_sequence(ids, 1, cp_group).to(dev)
    local_dy = mp.shard_sequence(dy, 2, cp_group).float().to(dev)
    results = {}
    for name, attention in (("ring", mp.ring_attention), ("gather", mp.context_parallel_attention)):
        local = [
            mp.shard_sequence(t, 2, cp_group).float().to(dev).requires_grad_() for t in (q, k, v)
        ]
        out = attention(*local, cp_group, document_ids_Bt=local_ids)
        out.backward(local_dy)
        results[name] = (out.detach(), *(t.grad for t in local))
    errors = {"vs_reference": {}, "vs_all_gather": {}}
    expected = [ref_out, *(t.grad for t in ref)]
    for index, key in enumerate(("out", "dq", "dk", "dv")):
        mine = results["ring"][index]
        errors["vs_reference"][key] = rel_err(mine, mp.shard_sequence(expected[index], 2, cp_group))
        errors["vs_all_gather"][key] = rel_err(mine, results["gather"][index])
    return errors


def ring_flash_vs_plain(value_dim: int = 8) -> dict[str, object]:
    """fp64 ring attention at cp = world with its blocks in PyTorch's flash attention (the
    CPU kernel) and again in the plain formulas (``fused_blocks`` answering False): output
    and q, k, v gradients as relative errors between the two, and how many blocks each run
    sent through flash (forward, backward)."""
    import importlib
    from unittest import mock

    ring = importlib.import_module(
        "mt_parallel.ring_attention"
    )  # the package's name is its function

    state = mt_comm.init_parallel_state(cp=mt_comm.group_size())
    cp_group = state.group("cp")
    generator = torch.Generator().manual_seed(3)
    B, T, d = 2, 8 * state.size("cp"), 8
    q, k = (torch.randn(B, h, T, d, generator=generator, dtype=torch.float64)
            for h in (HEADS, KV_HEADS))  # fmt: skip
    v = torch.randn(B, KV_HEADS, T, value_dim, generator=generator, dtype=torch.float64)
    dy = torch.randn(B, HEADS, T, value_dim, generator=generator, dtype=torch.float64)
    calls = {"forward": 0, "backward": 0}
    forward, backward = ring._FlashBlock.forward, ring._FlashBlock.backward

    def counted(name, method):
        def run(*args, **kwargs):
            calls[name] += 1
            return method(*args, **kwargs)

        return run

    runs = {}
    for fused in (True, False):
        local = [mp.shard_sequence(t, 2, cp_group).requires_grad_() for t in (q, k, v)]
        with (
            mock.patch.object(ring, "fused_blocks", lambda q, documents, on=fused: on),
            mock.patch.object(ring._FlashBlock, "forward", counted("forward", forward)),
            mock.patch.object(ring._FlashBlock, "backward", counted("backward", backward)),
        ):
            out = mp.ring_attention(*local, cp_group)
            out.backward(mp.shard_sequence(dy, 2, cp_group))
        runs[fused] = (out.detach(), *(t.grad for t in local))
    errors = {
        key: rel_err(a, b)
        for key, a, b in zip(("out", "dq", "dk", "dv"), runs[True], runs[False], strict=True)
    }
    return {"errors": errors, "calls": calls}


def lm_by_document(
    reference: DecoderLM, tokens_BT: torch.Tensor, ids_BT: torch.Tensor
) -> torch.Tensor:
    """The reference's logits with every document run as its own sequence (positions from 0)."""
    rows = [
        torch.cat([reference(tokens_BT[b : b + 1, doc]) for doc in runs(ids_BT[b])], dim=1)
        for b in range(tokens_BT.shape[0])
    ]
    return torch.cat(rows)


def decoder_lm_documents(
    cp: int = 1,
    tp: int = 1,
    sp: bool = False,
    seed: int = 0,
    heads: int = HEADS,
    kv_heads: int = KV_HEADS,
    device: str | None = None,
    kernel: str = "explicit",
) -> dict[str, object]:
    """The decoder LM on packed rows (document ids) under parallelize() vs. per-document runs,
    with the document masks applied by ``kernel`` (``explicit`` or ``flex``).

    The parallel model gets global positions, the reference positions from 0 per document:
    RoPE scores depend only on position differences, so both must agree. dp is the world over
    cp·tp; every dp rank gets two rows of its own.
    """
    dev = device_of(device)
    state = mt_comm.init_parallel_state(cp=cp, tp=tp)
    dp = state.size("dp")
    config = mp.ParallelConfig(tp=tp, cp=cp, sequence_parallel=sp)
    reference = _lm(heads=heads, kv_heads=kv_heads)
    mp.init_weights(reference, seed)
    reference = reference.double()
    model = _lm(heads=heads, kv_heads=kv_heads)
    mp.init_weights(model, seed)
    model = mp.parallelize(model.to(dev), config, state, PLAN)
    mp.apply_document_mask_kernel(model, kernel)

    tokens, targets = _batch(seed + 1, 2 * dp, 16)
    ids = document_ids(seed + 2, 2 * dp, 16)
    ref_logits = lm_by_document(reference, tokens, ids)
    ref_losses = mp.vocab_parallel_cross_entropy(ref_logits, targets, reduction="none")
    ref_losses.mean().backward()

    local_tokens, local_targets, positions, rows = _local_batch(state, tokens, targets)
    local_ids = mp.shard_sequence(ids[rows], 1, state.group("cp"))
    lift = kernel == "flex" and dev.type == "cpu"
    on_cpu = flex_backward_on_cpu() if lift else contextlib.nullcontext()
    with on_cpu:
        logits = model(local_tokens.to(dev), positions.to(dev), local_ids.to(dev))
        inner = model.module if hasattr(model, "module") else model  # DDP over dp×cp
        loss = inner.loss(logits, local_targets.to(dev))
        loss.backward()
    tp_rank = state.rank("tp")
    return {
        "logits": rel_err(logits, ref_logits[rows][:, positions].chunk(tp, dim=-1)[tp_rank]),
        "loss": rel_err(loss, ref_losses[rows][:, positions].mean()),
        "grads": compare_grads(inner, reference, tp_rank, tp),
    }


def dropout_masks(
    seed: int = 0, tp: int | None = None, device: str | None = None
) -> dict[str, object]:
    """Dropout masks of every region at tp (default: world) on identical inputs (the test
    compares ranks of one TP group; the tensors come back on the CPU).

    Replicated-region masks are drawn before and after sharded ones, to show that forking the
    tracker leaves the shared default stream where it was. ``default_state`` is the default
    generator state of ``device`` (the CPU generator on the CPU, the CUDA one on a GPU).
    """
    dev = device_of(device)
    tp = mt_comm.group_size() if tp is None else tp
    state = mt_comm.init_parallel_state(tp=tp)
    tp_group, tp_rank = state.group("tp"), state.rank("tp")

    def dropout(sharded: bool, sequence_parallel: bool) -> mp.Dropout:
        module = mp.Dropout(0.5, sharded=sharded)
        module.set_tensor_parallel(tp_group, sequence_parallel)
        return module

    masks: dict[str, object] = {"unseeded": "no error"}
    mp.get_rng_tracker().reset()
    try:
        dropout(False, False)(torch.ones(4, device=dev))
    except RuntimeError as error:
        masks["unseeded"] = str(error)
    mp.manual_seed(seed, tp_rank)

    ones = torch.ones(8, 64, device=dev)
    masks["replicated_before"] = (dropout(False, False)(ones) != 0).cpu()
    masks["sharded"] = (dropout(True, False)(ones) != 0).cpu()
    masks["sequence_parallel"] = (dropout(False, True)(ones) != 0).cpu()
    masks["replicated_after"] = (dropout(False, False)(ones) != 0).cpu()

    # Attention probabilities of this rank's heads: same q, k, v on every rank, so the outputs
    # differ exactly when the masks do.
    core = mp.CoreAttention(dropout=0.5)
    core.set_tensor_parallel(tp_group, False)
    qkv = torch.randn(3, 1, 2, 16, 8, generator=torch.Generator().manual_seed(seed)).to(dev)
    masks["attention_output"] = core(*qkv).cpu()
    masks["default_state"] = (
        torch.get_rng_state()
        if dev.type == "cpu"
        else torch.get_device_module(dev.type).get_rng_state(dev)
    )

    # In the model: the residual dropouts are replicated without SP and sharded with it.
    for sp in (False, True):
        model = mp.apply_tensor_parallel(_lm(dropout=0.1, layers=1), tp_group, sp)
        masks[f"block_sharded_sp={sp}"] = model.layers[0].dropout.sharded
    return masks
