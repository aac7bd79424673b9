"""Ring attention's flash blocks (``_FlashBlock``) alone, one process: a block's output, ``lse``
and gradients against the ring's plain fp64 formulas (``_block_forward``/``_block_backward``)
for the causal first step (K/V expanded to the query heads) and an unmasked step (query heads
folded into the rows), with GQA and DeepSeek-V3's key/value head dims (192/128: the value
padded). Given one block, the merged output and ``lse`` the backward kernel takes are the
block's own. On the CPU in fp64; on CUDA (``gpu`` marker) in bf16 through PyTorch's flash
kernels, whose private signatures these calls pin down."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

ring = importlib.import_module("mt_parallel.ring_attention")

DEVICES = [("cpu", torch.float64), pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)]


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double().cpu(), expected.double().cpu()
    return float((actual - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize(("device", "dtype"), DEVICES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "unmasked"])
@pytest.mark.parametrize(("d", "e"), [(64, 64), (192, 128)], ids=["d64", "mla"])
def test_flash_block_equals_the_plain_formulas(device, dtype, causal, d, e) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    B, K, G, rows, keys = 2, 2, 3, 32, 32 if causal else 16
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, K, G, rows, d, generator=gen, dtype=torch.float64)
    k = torch.randn(B, K, keys, d, generator=gen, dtype=torch.float64)
    v = torch.randn(B, K, keys, e, generator=gen, dtype=torch.float64)
    do = torch.randn(B, K, G, rows, e, generator=gen, dtype=torch.float64)
    scale = 1.0 / math.sqrt(d)
    mask = None
    if causal:
        positions = torch.arange(rows)
        mask = (positions[None, :] <= positions[:, None])[None, None, None]
    out_ref, lse_ref = ring._block_forward(q, k, v, mask, scale)
    delta = (do * out_ref).sum(-1)
    grads_ref = ring._block_backward(q, k, v, do, lse_ref, delta, mask, scale)

    block = ring._FlashBlock(*(t.to(device, dtype) for t in (q, k, v)), causal)
    out, lse, rest = block.forward(scale)
    work = torch.float64 if dtype == torch.float64 else torch.float32  # the ring's merge dtype
    grads = block.backward(do.to(device, dtype), out.to(work), lse.to(work), rest, scale)
    # fp64 on the CPU: the same sums in another order. bf16 on CUDA: inputs rounded to 8
    # significant bits (2^-9 relative each) and the products accumulated in fp32; a few times
    # that over 16-32 terms of mixed sign.
    tol = 1e-12 if dtype == torch.float64 else 3e-2
    assert out.shape == out_ref.shape and lse.shape == lse_ref.shape
    assert _rel(out, out_ref) < tol and _rel(lse, lse_ref) < tol
    for name, got, want in zip(("dq", "dk", "dv"), grads, grads_ref, strict=True):
        assert got.shape == want.shape, name
        assert _rel(got, want) < tol, (name, _rel(got, want))


def test_flash_blocks_are_taken_where_the_kernels_run() -> None:
    q64 = torch.zeros(1, 2, 4, 8, dtype=torch.float64)
    assert ring.fused_blocks(q64, documents=False)
    assert not ring.fused_blocks(q64, documents=True)  # same-document masks: plain formulas
    assert not ring.fused_blocks(torch.zeros(1, 2, 4, 8, dtype=torch.int64), documents=False)
