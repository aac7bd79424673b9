"""MoE on one CUDA GPU: the grouped-GEMM experts (``torch._grouped_mm`` with groups padded to
16 rows) against the per-expert loop on the same bf16 operands, and the MoE layer under bf16
autocast (and with FP8 experts) against the float64 CPU reference. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from moe_reference import reference_moe

import mt_fp8
import mt_parallel as mp
from mt_parallel.moe import MoE, MoEConfig, grouped_mm, grouped_mm_reason, looped_mm

pytestmark = pytest.mark.gpu

# Uneven groups, an empty one, none a multiple of 16: the padding is exercised.
SIZES = [37, 0, 50, 73, 5]
K, N = 256, 128


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.detach().double().cpu()
    return float((actual.detach().double().cpu() - expected).abs().max() / expected.abs().max())


def test_grouped_mm_matches_the_loop_on_cuda() -> None:
    torch.manual_seed(0)
    x = torch.randn(sum(SIZES), K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(len(SIZES), N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5
    w.requires_grad_()
    assert grouped_mm_reason(x, w) is None, grouped_mm_reason(x, w)
    sizes = torch.tensor(SIZES, device="cuda")
    y = grouped_mm(x, w, sizes)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y_loop = looped_mm(x2, w2, SIZES)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_loop.backward(dy)
    # Same bf16 operands, fp32 accumulation in both kernels in different orders, one bf16
    # rounding of each output (2^-8 relative to the largest entry at most, twice): 1e-2.
    for a, b in ((y, y_loop), (x.grad, x2.grad), (w.grad, w2.grad)):
        assert _rel(a, b) < 1e-2
    assert torch.equal(w.grad[1], torch.zeros_like(w.grad[1]))  # the empty expert


@pytest.mark.parametrize("fp8", [None, "rowwise"], ids=["bf16", "fp8-rowwise"])
def test_moe_layer_on_cuda_matches_the_float64_reference(fp8: str | None) -> None:
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=8, top_k=2, expert_ffn_dim=256, n_shared_experts=1)
    reference = MoE(128, cfg).double()
    mp.init_weights(reference, seed=1)
    with torch.no_grad():
        reference.router.weight.mul_(25)  # spread scores: bf16 inputs must not flip choices
    layer = MoE(128, cfg).cuda()
    layer.load_state_dict(reference.state_dict())
    if fp8:
        mp.apply_fp8(layer, mt_fp8.recipe_from_name(fp8))
    x = torch.randn(2, 64, 128, dtype=torch.float64)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x.float().cuda())
    expected = reference_moe(reference, x)
    # bf16 operands (2^-8 relative each) through three chained GEMMs and SwiGLU: a few 1e-3
    # of the largest output, 3e-2 with margin; FP8 (E4M3, 2^-4 per operand): 0.2. A wrong
    # expert, weight or padding row moves the output by O(1) of its size.
    assert _rel(y, expected) < (0.2 if fp8 else 3e-2)


if __name__ == "__main__":
    test_grouped_mm_matches_the_loop_on_cuda()
    for recipe in (None, "rowwise"):
        test_moe_layer_on_cuda_matches_the_float64_reference(recipe)
    print("MoE GPU checks passed")
