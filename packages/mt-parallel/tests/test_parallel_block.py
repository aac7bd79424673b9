"""Single-process tests of the decoder block: the fused mt-fp8 ops against plain PyTorch,
document masking against per-document runs, and the RNG tracker.

Bound for the fused ops. In fp64, ``mt_fp8.ops`` compute in fp64 (``compute_dtype``), and their
hand-written backwards are the exact derivatives of the same formulas, so the block differs from
the plain-PyTorch formulas only in rounding order: a few ulps (u = 1.1e-16) per operation,
grown by dot products of length ≤ 64 and two blocks, i.e. ~1e-14 relative. ``FP64_VS_FP64``
(1e-10) is far above that and far below any formula error (a wrong sign, a missing ``eps``,
a swapped RoPE half: 1e-3..1).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from parallel_tolerances import FP32_VS_FP64, FP64_VS_FP64
from sequence_checks import document_ids, lm_by_document
from toy_lm import DecoderLM

import mt_parallel as mp

VOCAB, DIM, LAYERS, HEADS, KV_HEADS, FFN = 64, 32, 2, 4, 2, 64


def _model() -> DecoderLM:
    model = DecoderLM(VOCAB, DIM, LAYERS, HEADS, KV_HEADS, FFN)
    mp.init_weights(model, 0)
    with torch.no_grad():  # non-trivial norm weights, so their use is checked too
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))
    return model.double()


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _plain_logits(model: DecoderLM, tokens_BT: torch.Tensor) -> torch.Tensor:
    """The Llama forward written with plain PyTorch ops on ``model``'s parameters."""
    B, T = tokens_BT.shape
    x = F.embedding(tokens_BT, model.embed.weight)
    positions = torch.arange(T)
    for layer in model.layers:
        att = layer.attention
        hd = att.head_dim
        n = _rms(x, layer.attention_norm.weight, layer.attention_norm.eps)
        q, k, v = (
            F.linear(n, proj.weight).view(B, T, -1, hd).transpose(1, 2)
            for proj in (att.q_proj, att.k_proj, att.v_proj)
        )
        inv_freq = att.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        angles = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)
        cos, sin = angles.cos(), angles.sin()

        def rope(t: torch.Tensor, cos: torch.Tensor = cos, sin: torch.Tensor = sin) -> torch.Tensor:
            t1, t2 = t.chunk(2, dim=-1)
            return t * cos + torch.cat([-t2, t1], dim=-1) * sin

        o = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True, enable_gqa=True)
        h = x + F.linear(o.transpose(1, 2).reshape(B, T, -1), att.o_proj.weight)
        m = _rms(h, layer.ffn_norm.weight, layer.ffn_norm.eps)
        mlp = layer.mlp
        act = F.silu(F.linear(m, mlp.gate_proj.weight)) * F.linear(m, mlp.up_proj.weight)
        x = h + F.linear(act, mlp.down_proj.weight)
    return F.linear(_rms(x, model.norm.weight, model.norm.eps), model.lm_head.weight)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max())


def test_fused_block_equals_plain_pytorch_in_fp64() -> None:
    model = _model()
    tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(2))
    x, y = tokens[:, :-1], tokens[:, 1:]
    params = list(model.parameters())

    logits = model(x)
    loss = model.loss(logits, y)  # mt-fp8's chunked cross-entropy at tp=1
    grads = torch.autograd.grad(loss, params)
    plain_logits = _plain_logits(model, x)
    plain_loss = F.cross_entropy(plain_logits.reshape(-1, VOCAB), y.reshape(-1))
    plain_grads = torch.autograd.grad(plain_loss, params)

    assert _rel(logits, plain_logits) < FP64_VS_FP64
    assert abs(float(loss.detach() - plain_loss.detach())) < FP64_VS_FP64
    for (name, _), g, p in zip(model.named_parameters(), grads, plain_grads, strict=True):
        assert _rel(g, p) < FP64_VS_FP64, name


def test_document_masking_equals_separate_documents() -> None:
    model = _model()
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    ids = document_ids(4, 2, 16)
    expected = lm_by_document(model, tokens, ids)
    fp32 = model.float()
    assert _rel(fp32(tokens, None, ids).double(), expected) < FP32_VS_FP64
    unmasked = fp32(tokens).double()
    assert _rel(unmasked, expected) > 1e-3  # the documents do see each other without the ids


def test_document_ids_from_cu_seqlens() -> None:
    cu = torch.tensor([0, 3, 8, 8, 12], dtype=torch.int32)
    ids = mp.document_ids_from_cu_seqlens(cu, batch=2, seq_len=6)
    assert ids.tolist() == [[0, 0, 0, 1, 1, 1], [1, 1, 3, 3, 3, 3]]
    with pytest.raises(ValueError, match=r"rise from 0 to batch·seq_len = 12"):
        mp.document_ids_from_cu_seqlens(torch.tensor([0, 5, 10]), batch=2, seq_len=6)


def test_rng_tracker_fork_leaves_the_default_stream_alone() -> None:
    tracker = mp.get_rng_tracker()
    mp.manual_seed(5)
    plain = torch.rand(8)
    mp.manual_seed(5)
    with tracker.fork():
        forked_first = torch.rand(8)
    assert torch.equal(torch.rand(8), plain)  # as if the fork had not drawn
    snapshot = tracker.get_states()
    with tracker.fork():
        forked_second = torch.rand(8)
    assert not torch.equal(forked_first, forked_second)  # the stream carries on
    tracker.set_states(snapshot)
    with tracker.fork():
        assert torch.equal(torch.rand(8), forked_second)  # and replays from a snapshot
    with pytest.raises(ValueError, match="already seeded"):
        tracker.add(mp.rng.TENSOR_PARALLEL, 1)
    tracker.reset()
    with pytest.raises(RuntimeError, match="not seeded"), tracker.fork():
        pass


def test_dropout_without_tp_is_plain_dropout() -> None:
    mp.get_rng_tracker().reset()
    x = torch.ones(64)
    torch.manual_seed(0)
    ours = mp.Dropout(0.3)(x)
    torch.manual_seed(0)
    assert torch.equal(ours, F.dropout(x, 0.3))
    assert torch.equal(mp.Dropout(0.3).eval()(x), x)
    with pytest.raises(ValueError, match=r"p=1.0 must be in \[0, 1\)"):
        mp.Dropout(1.0)
