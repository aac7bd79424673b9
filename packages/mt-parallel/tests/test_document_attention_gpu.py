"""Document masking on one GPU: FlexAttention's fused kernel (``torch.compile``'d
``flex_attention``) against the explicit-mask SDPA path, both in bf16, each held to the fp64
per-document reference on the CPU; the attention core alone and the decoder LM with compiled
blocks under bf16 autocast.

Bounds. bf16 has 8 significant bits (u = 2⁻⁹); attention outputs and their gradients are
weighted sums with fp32 accumulation, so both kernels land within a few u of the largest entry:
``CORE_BOUND`` (2⁻⁶ = 1.6e-2, eight u). Through two blocks the model's bounds are
``test_parallel_gpu.py``'s bf16 ones. A key of another document leaking into a row costs
1e-1..1, far above both.

Runs under pytest (``-m gpu``) or as a script on machines that have CUDA but not pytest.
"""

from __future__ import annotations

import pytest
import torch
from sequence_checks import attention_by_document, document_ids, runs
from test_parallel_gpu import (
    BOUNDS,
    DIM,
    FFN,
    HEADS,
    KV_HEADS,
    LAYERS,
    VOCAB,
    _max_rel,
    errors_against,
)
from toy_lm import DecoderLM

import mt_parallel as mp

CORE_BOUND = 2.0**-6


def core_errors(kernel: str, T: int = 1024, d: int = 64, dv: int = 64) -> dict[str, float]:
    """``kernel``'s bf16 attention core on CUDA against the fp64 per-document reference
    (``d`` the query/key head dim, ``dv`` the value one)."""
    generator = torch.Generator().manual_seed(0)
    ids = document_ids(1, 2, T, documents=T // 128)
    shapes = ((2, HEADS, T, d), (2, KV_HEADS, T, d), (2, KV_HEADS, T, dv))
    ref = [
        torch.randn(s, generator=generator, dtype=torch.float64).requires_grad_() for s in shapes
    ]
    dy = torch.randn(2, HEADS, T, dv, generator=generator, dtype=torch.float64)
    ref_out = attention_by_document(*ref, ids)
    ref_out.backward(dy)
    core = mp.CoreAttention()
    core.set_document_mask_kernel(kernel)
    mine = [t.detach().cuda().bfloat16().requires_grad_() for t in ref]
    out = core(*mine, ids.cuda())
    out.backward(dy.cuda().bfloat16())
    errors = {"out": _max_rel(out, ref_out)}
    for name, t, r in zip("qkv", mine, ref, strict=True):
        errors[f"d{name}"] = _max_rel(t.grad, r.grad)
    return errors


def model_errors(kernel: str) -> dict[str, object]:
    """The decoder LM (compiled blocks, bf16 autocast) on packed rows against the fp64
    per-document reference."""
    reference = DecoderLM(VOCAB, DIM, LAYERS, HEADS, KV_HEADS, FFN)
    mp.init_weights(reference, 0)
    model = DecoderLM(VOCAB, DIM, LAYERS, HEADS, KV_HEADS, FFN).cuda()
    mp.init_weights(model, 0)
    mp.apply_document_mask_kernel(model, kernel)
    for block in model.layers:
        block.compile()
    reference = reference.double()
    tokens = torch.randint(0, VOCAB, (2, 257), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    ids = document_ids(2, 2, 256)
    ref_logits = torch.cat(
        [torch.cat([reference(x[b : b + 1, doc]) for doc in runs(ids[b])], dim=1) for b in range(2)]
    )
    ref_loss = reference.loss(ref_logits, y)
    ref_loss.backward()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(x.cuda(), None, ids.cuda())
        loss = model.loss(logits, y.cuda())
    loss.backward()
    return errors_against(model, reference, logits, ref_logits, loss, ref_loss)


@pytest.mark.gpu
@pytest.mark.parametrize(("d", "dv"), [(128, 128), (192, 128)], ids=["llama", "mla"])
def test_flex_core_on_gpu_matches_the_reference_like_the_explicit_mask(d: int, dv: int) -> None:
    # Llama 3's head dim, and DeepSeek-V3's multi-latent attention (QK 192, V 128).
    flex, explicit = core_errors("flex", d=d, dv=dv), core_errors("explicit", d=d, dv=dv)
    for name, error in flex.items():
        assert error < CORE_BOUND, (name, error, explicit[name])
        assert explicit[name] < CORE_BOUND, (name, explicit[name])


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["flex", "explicit"])
def test_compiled_model_with_documents_on_gpu_matches_the_reference(kernel: str) -> None:
    torch._dynamo.reset()
    result = model_errors(kernel)
    bounds = BOUNDS[False]
    assert result["logits"] < bounds["logits"], result
    assert result["loss"] < bounds["loss"], result
    for name, error in result["grads"].items():
        assert error < bounds["grads"], (name, error)


if __name__ == "__main__":
    for kernel_name in ("flex", "explicit"):
        print(kernel_name, "core", core_errors(kernel_name))
        outcome = model_errors(kernel_name)
        worst = max(outcome["grads"].items(), key=lambda item: item[1])
        print(
            f"{kernel_name} model: logits {outcome['logits']:.3e}, loss {outcome['loss']:.3e}, "
            f"worst grad {worst[0]} {worst[1]:.3e}"
        )
    for qk_dim, v_dim in ((128, 128), (192, 128)):
        test_flex_core_on_gpu_matches_the_reference_like_the_explicit_mask(qk_dim, v_dim)
    print("GPU CHECK PASSED")
