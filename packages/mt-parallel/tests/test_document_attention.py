"""Document masking by FlexAttention (:mod:`mt_parallel.document_attention`) against running
every document on its own (fp64) and against the explicit-mask path, forward and gradients;
the block-mask cache; recompute and FP8 composition; the kernel choice and its refusals.

Bounds. Both fp64 comparisons (flex against the per-document SDPA reference) differ only in
summation order and the softmax's formulation (flex's online log-sum-exp against SDPA's math
path): a few ulps (u = 1.1e-16) per operation over dot products of length ≤ 64 and ≤ 2
blocks, ~1e-14 relative, far below ``FP64_VS_FP64`` (1e-10) and far above nothing: a key of
another document leaking into a row moves that row by 1e-2..1. fp32 against fp64 uses
``FP32_VS_FP64`` (parallel_tolerances.py says why). With FP8 (tensorwise) linears the first
layer's q/k/v are the same FP8 bytes for both kernels (quantized before the core); later
quantizations see inputs that differ by fp32 rounding, which changes an FP8 value only if an
input lies within that rounding of an FP8 rounding boundary (~1e-6 of the elements at fp32's
2⁻²⁴ against E4M3's 2⁻³ spacing; the seed is fixed), so the kernels again agree to
``FP32_VS_FP64``.

torch refuses FlexAttention's backward on the CPU in its input checks only; these tests lift
that refusal (``sequence_checks.flex_backward_on_cpu``) and run the eager math path beneath it;
``test_parallel_gpu.py`` holds the fused CUDA kernel to the explicit path.
"""

from __future__ import annotations

import pytest
import torch
from parallel_tolerances import FP32_VS_FP64, FP64_VS_FP64
from sequence_checks import attention_by_document, document_ids, flex_backward_on_cpu
from toy_lm import DecoderLM

import mt_fp8
import mt_parallel as mp
from mt_parallel.document_attention import BLOCK_MASKS, document_block_mask

VOCAB, DIM, LAYERS, HEADS, KV_HEADS, FFN = 64, 32, 2, 4, 2, 64


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max())


def _qkv(seed: int, B: int, T: int, d: int, dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = ((B, HEADS, T, d), (B, KV_HEADS, T, d), (B, KV_HEADS, T, d))
    return [torch.randn(s, generator=generator, dtype=dtype).requires_grad_() for s in shapes]


# T = 200 spans two 128-token blocks of the block mask (a partial last block too) and T = 24
# sits inside one, so empty, full and partial tiles are all exercised.
@pytest.mark.parametrize("T", [24, 200])
def test_flex_core_equals_separate_documents_in_fp64(T: int) -> None:
    ids = document_ids(1, 2, T, documents=5)
    q, k, v = _qkv(2, 2, T, 8, torch.float64)
    dy = torch.randn(2, HEADS, T, 8, generator=torch.Generator().manual_seed(3), dtype=q.dtype)
    core = mp.CoreAttention()
    core.set_document_mask_kernel("flex")
    with flex_backward_on_cpu():
        out = core(q, k, v, ids)
        grads = torch.autograd.grad(out, (q, k, v), dy)
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref_out = attention_by_document(*ref, ids)
    ref_grads = torch.autograd.grad(ref_out, ref, dy)
    assert _rel(out, ref_out) < FP64_VS_FP64
    for name, mine, theirs in zip("qkv", grads, ref_grads, strict=True):
        assert _rel(mine, theirs) < FP64_VS_FP64, name
    unmasked = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True
    )
    assert _rel(unmasked, ref_out) > 1e-3  # the documents do see each other without the mask


def test_flex_core_with_value_heads_unlike_the_key_heads() -> None:
    # Multi-latent attention's layout: V head dim 16 against a QK head dim of 24, all heads K/V.
    ids = document_ids(8, 2, 40)
    generator = torch.Generator().manual_seed(9)
    q, k = (torch.randn(2, HEADS, 40, 24, generator=generator, dtype=torch.float64) for _ in "qk")
    v = torch.randn(2, HEADS, 40, 16, generator=generator, dtype=torch.float64)
    outputs, grads = {}, {}
    for kernel in ("flex", "explicit"):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        core = mp.CoreAttention()
        core.set_document_mask_kernel(kernel)
        with flex_backward_on_cpu():
            outputs[kernel] = core(*inputs, ids)
            grads[kernel] = torch.autograd.grad(outputs[kernel].square().sum(), inputs)
    assert outputs["flex"].shape == (2, HEADS, 40, 16)
    assert _rel(outputs["flex"], outputs["explicit"]) < FP64_VS_FP64
    for name, mine, theirs in zip("qkv", grads["flex"], grads["explicit"], strict=True):
        assert _rel(mine, theirs) < FP64_VS_FP64, name


def _lm(kernel: str, fp8: bool = False) -> DecoderLM:
    model = DecoderLM(VOCAB, DIM, LAYERS, HEADS, KV_HEADS, FFN)
    mp.init_weights(model, 0)
    if fp8:
        mp.apply_fp8(model, mt_fp8.recipe_from_name("tensorwise"))
    return mp.apply_document_mask_kernel(model, kernel)


def _loss_and_grads(model: DecoderLM, tokens: torch.Tensor, ids: torch.Tensor) -> tuple:
    x, y = tokens[:, :-1], tokens[:, 1:]
    with flex_backward_on_cpu():
        logits = model(x, None, ids[:, :-1])
        loss = model.loss(logits, y)
        grads = torch.autograd.grad(loss, list(model.parameters()))
    return logits, grads


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8-tensorwise"])
def test_flex_model_equals_explicit_mask(fp8: bool) -> None:
    tokens = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(4))
    ids = document_ids(5, 2, 33)
    flex_logits, flex_grads = _loss_and_grads(_lm("flex", fp8), tokens, ids)
    explicit_logits, explicit_grads = _loss_and_grads(_lm("explicit", fp8), tokens, ids)
    assert _rel(flex_logits, explicit_logits) < FP32_VS_FP64
    for (name, _), mine, theirs in zip(
        _lm("flex").named_parameters(), flex_grads, explicit_grads, strict=True
    ):
        assert _rel(mine, theirs) < FP32_VS_FP64, name
    assert _rel(flex_logits, _lm("flex", fp8)(tokens[:, :-1])) > 1e-3  # the mask mattered


@pytest.mark.parametrize(
    ("policy", "keep"), [("selective", ()), ("full", ()), ("full", ("attention",))]
)
def test_flex_under_recompute_changes_no_gradient_bit(policy: str, keep: tuple) -> None:
    # The recomputation gets the same id tensor, so the same cached block mask: bit-identical.
    tokens = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(10))
    ids = document_ids(11, 2, 33)
    _, plain = _loss_and_grads(_lm("flex"), tokens, ids)
    model = mp.apply_recompute(_lm("flex"), policy, 1, ("attention",), (mp.DecoderBlock,), keep)
    _, recomputed = _loss_and_grads(model, tokens, ids)
    for mine, theirs in zip(recomputed, plain, strict=True):
        assert torch.equal(mine, theirs)


def test_one_block_mask_per_micro_batch_shared_by_every_layer() -> None:
    model = _lm("flex")
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(6))
    ids = document_ids(7, 2, 16)
    before = BLOCK_MASKS.builds
    with flex_backward_on_cpu():
        model.loss(model(tokens, None, ids), tokens).backward()
        assert BLOCK_MASKS.builds == before + 1  # LAYERS layers, one mask
        model(tokens, None, ids.clone())  # the next micro-batch's ids: a new mask
        assert BLOCK_MASKS.builds == before + 2
        ids2 = ids.clone()
        model(tokens, None, ids2)
        ids2[:, 8:] += 1  # ids edited in place are not served a stale mask
        model(tokens, None, ids2)
        assert BLOCK_MASKS.builds == before + 4


def test_compiled_block_mask_builder_equals_the_eager_one_and_compiles_once() -> None:
    # CUDA builds block masks through torch.compile(create_block_mask); run that path on the
    # CPU against the eager builder, for three batches of new ids (new mask_mod closures).
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    for seed in range(3):
        ids = document_ids(20 + seed, 2, 200, documents=6)
        compiled = document_block_mask(ids, compiled=True).as_tuple()
        eager = document_block_mask(ids, compiled=False).as_tuple()
        assert compiled[:2] == eager[:2]  # the sequence lengths
        tensors = [(a, b) for a, b in zip(compiled, eager, strict=True) if torch.is_tensor(a)]
        assert len(tensors) >= 4 and all(torch.equal(a, b) for a, b in tensors)
    assert counters["stats"]["unique_graphs"] == graphs + 1


def test_kernel_choice_and_refusals() -> None:
    assert mp.resolve_document_mask_kernel("auto", "cuda") == "flex"
    assert mp.resolve_document_mask_kernel("auto", "cpu") == "explicit"
    assert mp.resolve_document_mask_kernel("auto", "cuda", cp=2) == "flex"
    assert mp.resolve_document_mask_kernel("auto", "cuda", cp=2, ring=True) == "explicit"
    assert mp.resolve_document_mask_kernel("auto", "cuda", attention_dropout=0.1) == "explicit"
    assert mp.resolve_document_mask_kernel("explicit", "cuda") == "explicit"
    assert mp.resolve_document_mask_kernel("flex", "cuda") == "flex"
    with pytest.raises(ValueError, match=r"kernel='fused' is unknown; valid: auto, flex, explicit"):
        mp.resolve_document_mask_kernel("fused", "cuda")
    with pytest.raises(ValueError, match=r"inside ring attention \(cp=2, cp_attention=ring\)"):
        mp.resolve_document_mask_kernel("flex", "cuda", cp=2, ring=True)
    with pytest.raises(ValueError, match=r"no attention dropout \(dropout=0.1\)"):
        mp.resolve_document_mask_kernel("flex", "cuda", attention_dropout=0.1)
    with pytest.raises(ValueError, match=r"needs a GPU"):
        mp.resolve_document_mask_kernel("flex", "cpu")
    with pytest.raises(ValueError, match=r"no attention dropout \(dropout=0.5\)"):
        mp.CoreAttention(dropout=0.5).set_document_mask_kernel("flex")
    with pytest.raises(ValueError, match=r"kernel='auto' is unknown; valid: explicit, flex"):
        mp.CoreAttention().set_document_mask_kernel("auto")
