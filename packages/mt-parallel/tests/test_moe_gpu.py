"""MoE on one CUDA GPU: the grouped-GEMM experts (``torch._grouped_mm`` with groups padded to
16 rows) against the per-expert loop on the same bf16 operands, and the MoE layer under bf16
autocast (and with FP8 experts) against the float64 CPU reference, and the layer with the fused
Triton permute/unpermute against its PyTorch path. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from moe_reference import poison_rows_past_the_groups, reference_moe

import mt_fp8
import mt_parallel as mp
from mt_fp8.testing import run_without_synchronizing
from mt_parallel.moe import MoE, MoEConfig, grouped_mm, grouped_mm_reason, looped_mm
from mt_parallel.moe import experts as experts_module
from mt_parallel.moe.experts import GroupedExperts

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


def test_expert_mlp_never_reads_the_rows_past_its_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bf16 expert MLP on CUDA pads into a buffer of host-known size whose rows past the
    last group the grouped GEMM leaves uninitialized (``PaddedLayout``): with those rows and
    their gradient set to NaN, output and every gradient are finite and match float64."""
    monkeypatch.setattr(
        experts_module, "padded_grouped_mm",
        poison_rows_past_the_groups(experts_module.padded_grouped_mm),
    )  # fmt: skip
    torch.manual_seed(0)
    reference = GroupedExperts(len(SIZES), K, N, K**-0.5, N**-0.5).double()
    module = GroupedExperts(len(SIZES), K, N, K**-0.5, N**-0.5).cuda()
    module.load_state_dict(reference.state_dict())
    x = torch.randn(sum(SIZES), K, dtype=torch.float64)
    dy = torch.randn(sum(SIZES), K, dtype=torch.float64)
    x_cuda = x.float().cuda().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = module(x_cuda, torch.tensor(SIZES, device="cuda"))
    y.backward(dy.cuda().to(y.dtype))
    x_ref = x.clone().requires_grad_()
    y_ref = reference(x_ref, torch.tensor(SIZES))
    y_ref.backward(dy)
    pairs = [(y, y_ref), (x_cuda.grad, x_ref.grad)]
    params = zip(module.parameters(), reference.parameters(), strict=True)
    pairs += [(a.grad, b.grad) for a, b in params]
    for actual, expected in pairs:
        assert actual.isfinite().all()
        # bf16 operands through two chained GEMMs and SwiGLU (and back): a few 2^-8 of the
        # largest entry; a NaN row read or a misplaced row is O(1).
        assert _rel(actual, expected) < 3e-2


def test_deferred_expert_weight_gradients_equal_the_plain_ones_on_cuda() -> None:
    """The experts' weight gradients queued in a sink (zero-bubble pipelines) equal autograd's
    bit for bit on the CUDA grouped GEMM too (bf16 autocast, padded groups, an idle expert)."""
    from mt_fp8 import WeightGradSink

    torch.manual_seed(0)
    module = GroupedExperts(len(SIZES), K, N, K**-0.5, N**-0.5).cuda()
    x = torch.randn(sum(SIZES), K, device="cuda")
    dy = torch.randn(sum(SIZES), K, device="cuda", dtype=torch.bfloat16)

    def run(sink: WeightGradSink | None) -> list[torch.Tensor]:
        module.zero_grad(set_to_none=True)
        for proj in (module.gate_proj, module.up_proj, module.down_proj):
            proj.wgrad_sink = sink
        x_leaf = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = module(x_leaf, torch.tensor(SIZES, device="cuda"))
        y.backward(dy)
        if sink is not None:
            assert all(p.grad is None for p in module.parameters())
            sink.take()()
        return [x_leaf.grad, *(p.grad for p in module.parameters())]

    for plain, deferred in zip(run(None), run(WeightGradSink()), strict=True):
        assert torch.equal(plain, deferred)


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


@pytest.mark.parametrize(
    ("top_k", "capacity_factor", "pad"),
    [(2, None, False), (2, 1.0, True), (8, 1.0, False)],
    ids=["top2-dropless", "top2-padded", "top8-dropping"],
)
def test_moe_layer_fused_permute_matches_the_pytorch_permute(
    monkeypatch: pytest.MonkeyPatch, top_k: int, capacity_factor: float | None, pad: bool
) -> None:
    """The layer with mt-fp8's Triton permute/unpermute against the same layer with their
    PyTorch path (everything else identical). Top-2: the forward is bit-identical (two fp32
    products and one add in both, no FMA); top-8 sums 8 terms in another order (fp32, 8 · 2^-24
    relative, then one bf16 rounding). Gradients: the routing weights' gradient is an fp32 dot
    product in another order and reaches the input through the router, so a bf16 ulp
    (2^-8 relative) may flip: 1e-2 of the largest entry."""
    cfg = MoEConfig(
        num_experts=16, top_k=top_k, expert_ffn_dim=256, capacity_factor=capacity_factor,
        pad_to_capacity=pad,
    )  # fmt: skip
    monkeypatch.delenv("MT_FUSED_MOE_PERMUTE", raising=False)  # the fused kernels: CUDA's default
    layer = MoE(128, cfg).cuda()
    mp.init_weights(layer, seed=1)
    x = torch.randn(2, 64, 128, device="cuda")
    dy = torch.randn(2, 64, 128, device="cuda")
    params = [p for p in layer.parameters() if p.requires_grad]

    def forward_backward():
        x_leaf = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x_leaf)
        return y, torch.autograd.grad(y, [x_leaf, *params], dy.to(y.dtype), allow_unused=True)

    y_fused, grads_fused = forward_backward()
    monkeypatch.setattr("mt_fp8.ops.moe_permute.use_triton", lambda *tensors: False)
    y_plain, grads_plain = forward_backward()
    if top_k == 2:
        assert torch.equal(y_fused, y_plain)
    else:
        assert _rel(y_fused, y_plain) < 1e-2
    for fused, plain in zip(grads_fused, grads_plain, strict=True):
        assert (fused is None) == (plain is None)
        if fused is not None and plain.abs().max() > 0:
            assert _rel(fused, plain) < 1e-2


def test_bf16_layer_never_synchronizes() -> None:
    """A dropless bf16 layer's forward + backward never waits for the device: the padded
    buffer's size is a host-known bound (``PaddedLayout``), counts by scatter-add (bincount
    reads its largest index to the host), no host-to-device copy of the dropped count; a new
    sync point in the layer makes this fail and the warning names where."""
    import warnings

    layer = MoE(128, MoEConfig(num_experts=16, top_k=4, expert_ffn_dim=256, n_shared_experts=1))
    layer = layer.cuda()
    mp.init_weights(layer, seed=1)
    x = torch.randn(2, 64, 128, device="cuda", requires_grad=True)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        y.float().sum().backward()

    step()  # Triton kernels compile
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    syncs = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
    assert not syncs, syncs


@pytest.mark.parametrize("fp8", ["block", "mxfp8", "rowwise"])
def test_fp8_expert_mlp_never_synchronizes(fp8: str) -> None:
    """The FP8 experts under block scaling and MXFP8 (the grouped Triton path: 16 experts, K
    and N multiples of 128) and rowwise scaling (all-E4M3 experts, every GEMM in
    ``torch._scaled_grouped_mm``) take the router's counts on the device
    (``reads_sizes_on_device``): the expert MLP's forward + backward, and the dropless layer's
    around it, never wait for the device (CUDA's sync debug mode raises on a blocking copy,
    ``.tolist()`` or ``.item()``). Before, ``GroupedExperts`` read the counts to the host once
    per MLP."""
    recipe = mt_fp8.recipe_from_name(fp8)
    torch.manual_seed(0)
    experts = GroupedExperts(16, 128, 256, 128**-0.5, 256**-0.5).cuda()
    mp.apply_fp8(experts, recipe)
    x = torch.randn(300, 128, device="cuda", requires_grad=True)
    sizes = torch.tensor([40, 0, 3, 17, 0, 60, 1, 9, 30, 0, 45, 25, 20, 10, 30, 10], device="cuda")
    layer = MoE(128, MoEConfig(num_experts=16, top_k=4, expert_ffn_dim=256)).cuda()
    mp.init_weights(layer, seed=1)
    mp.apply_fp8(layer, recipe)
    x_layer = torch.randn(2, 64, 128, device="cuda", requires_grad=True)
    assert all(p._fp8.reads_sizes_on_device(x) for p in (experts.gate_proj, experts.down_proj))

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = experts(x, sizes)
            y_layer = layer(x_layer)
        (y.float().sum() + y_layer.float().sum()).backward()

    run_without_synchronizing(step)
    grads = [x.grad, x_layer.grad, *(p.grad for p in experts.parameters())]
    assert all(g is not None and g.isfinite().all() for g in grads)


if __name__ == "__main__":
    test_grouped_mm_matches_the_loop_on_cuda()
    for recipe in (None, "rowwise"):
        test_moe_layer_on_cuda_matches_the_float64_reference(recipe)
    print("MoE GPU checks passed")
