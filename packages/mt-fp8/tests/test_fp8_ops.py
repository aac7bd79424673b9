"""Fused ops against plain PyTorch formulas (autograd of the textbook expression), fwd + bwd.

On CPU the ops run in float64 and must match the float64 reference to 1e-10 (only summation
order differs). On CUDA (``gpu`` marker), and on the CPU under ``TRITON_INTERPRET=1``, they run
the Triton kernels in float32, which compute in fp32: error a few ulps of fp32 times the
reduction length, so rtol 1e-4 against float64.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from mt_fp8 import FP8Format, quantize
from mt_fp8.ops import (
    apply_rotary,
    cross_entropy,
    dispatch,
    quantize_transpose_amax,
    rms_norm,
    swiglu,
    swiglu_quantize_transpose_amax,
)
from mt_fp8.ops.dispatch import triton_runs_on, use_triton
from mt_fp8.ops.rope import rope_tables

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


# Under TRITON_INTERPRET=1 the CPU cases run the Triton kernels (in Triton's interpreter), which
# compute in fp32 as on the GPU: the GPU's dtype and bound apply.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def dtype_and_tol(device):
    if device == "cpu" and not INTERPRET:
        return torch.float64, 1e-10
    return torch.float32, 1e-4


def close(actual, expected, tol):
    assert torch.allclose(actual.double(), expected.double(), rtol=tol, atol=tol), (
        (actual.double() - expected.double()).abs().max().item()
    )


def leaf(shape, device, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(shape, generator=generator, dtype=torch.float64)
        .to(device, dtype)
        .requires_grad_()
    )


def grads(output, inputs, seed=99):
    generator = torch.Generator().manual_seed(seed)
    upstream = torch.randn(output.shape, generator=generator, dtype=torch.float64).to(output)
    return torch.autograd.grad(output, inputs, upstream, allow_unused=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(device, with_residual):
    dtype, tol = dtype_and_tol(device)
    x, w = leaf((3, 5, 96), device, dtype, 0), leaf((96,), device, dtype, 1)
    r = leaf((3, 5, 96), device, dtype, 2) if with_residual else None
    inputs = [x, w] + ([r] if with_residual else [])
    out = rms_norm(x, w, eps=1e-5, residual=r)
    h_ref = x + r if with_residual else x
    y_ref = h_ref * torch.rsqrt(h_ref.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    if with_residual:
        y, h = out
        close(h, h_ref, tol)
        # The returned residual stream gets a gradient too: sum both outputs' contributions.
        total, total_ref = (
            y.sum() * 0 + (y * 1.5).sum() + h.square().sum(),
            (y_ref * 1.5).sum() + h_ref.square().sum(),
        )
        for got, want in zip(
            torch.autograd.grad(total, inputs), torch.autograd.grad(total_ref, inputs), strict=True
        ):
            close(got, want, tol)
    else:
        y = out
        for got, want in zip(grads(y, inputs), grads(y_ref, inputs), strict=True):
            close(got, want, tol)
    close(y, y_ref, tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_runs_once_under_the_pipelines_split_backward(device, with_residual):
    """torch's split backward (``stage_backward_input`` for ``I``, ``stage_backward_weight``
    for ``W``, as the zero-bubble pipeline schedules run it) asks the norm node a second time,
    with the gradients it kept, for the norm weight's: the norm computes once and hands back
    the first call's ``dw``; every gradient equals one plain backward's (the same bound as
    above). A second loss through a retained graph, with other gradients, computes afresh."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    dtype, tol = dtype_and_tol(device)
    before, norm_w = leaf((3, 5, 32), device, dtype, 0), leaf((32,), device, dtype, 1)
    w_in, w_out = leaf((32, 32), device, dtype, 2), leaf((32, 32), device, dtype, 3)
    residual = leaf((3, 5, 32), device, dtype, 4).detach() if with_residual else None
    params = [norm_w, w_in, w_out]

    def block(x):
        out = rms_norm(x @ w_in.t(), norm_w, eps=1e-5, residual=residual)
        y, h = out if with_residual else (out, 0)
        return h + y @ w_out.t()

    out = block(before)
    upstream = torch.randn_like(out)
    expected = torch.autograd.grad(out, [before, *params], upstream)
    unpacked = []  # the tensors the backward nodes read back, the norm weight among them
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: unpacked.append(t) or t):
        out = block(before)
        (dx,), param_groups = stage_backward_input([out], [upstream], [before], params)
        stage_backward_weight(params, param_groups)
    close(dx, expected[0], tol)
    for param, want in zip(params, expected[1:], strict=True):
        close(param.grad, want, tol)
    # Only the norm saves its weight: read back by one computing call, not by two.
    assert sum(t is norm_w for t in unpacked) == 1
    out = block(before)
    first = torch.autograd.grad(out, [norm_w], upstream, retain_graph=True)[0]
    second = torch.autograd.grad(out, [norm_w], 2 * upstream)[0]
    close(second, 2 * first, tol)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("width", "dtype", "with_residual", "stages"),
    [
        (4096, torch.bfloat16, True, 3),  # Llama-3-8B
        (8192, torch.bfloat16, True, 2),  # Llama-3-70B
        (8192, torch.float32, False, 1),
        (16384, torch.bfloat16, False, 1),  # Llama-3-405B
        (16384, torch.float32, False, 0),
        (28672, torch.float32, False, 0),  # Llama-3-70B's FFN width
    ],
)
def test_rms_norm_rows_wider_than_the_kernels_shared_memory_fall_back(
    width, dtype, with_residual, stages
):
    """The backward pipelines as many stages as Hopper's shared memory holds (bf16 at 16384 and
    fp32 at 8192 once failed with Triton's OutOfResources at three stages); rows with no stage
    take the PyTorch path. 4096 rows make every backward program walk several iterations, the
    case Triton pipelines (64 rows did not, and hid the failures)."""
    from mt_fp8.kernels.rmsnorm import backward_stages

    device = torch.device("cuda")
    bytes_per_column = (3 if with_residual else 2) * dtype.itemsize
    assert backward_stages(width, device, bytes_per_column) == stages
    x, w = leaf((4096, width), device, dtype, 0), leaf((width,), device, dtype, 1)
    r = leaf((4096, width), device, dtype, 2) if with_residual else None
    out = rms_norm(x, w, eps=1e-5, residual=r)
    h_ref = x.double() + (r.double() if with_residual else 0)
    y_ref = h_ref * torch.rsqrt(h_ref.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    # With a residual the loss reads h too, so the backward streams dh_out as well.
    y, y_ref = (out[0] + out[1], y_ref + h_ref) if with_residual else (out, y_ref)
    # fp32: sums over up to 28672 squares, relative error ~ width · 2^-24 ≈ 2e-3 at worst, 1e-4
    # typical; bf16: up to three roundings (2^-9 each) of values up to ~8, ≤ 0.05
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    close(y, y_ref, tol)
    inputs = [x, w] + ([r] if with_residual else [])
    for got, want in zip(grads(y, inputs), grads(y_ref, inputs), strict=True):
        close(got, want, 10 * tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_out_dtype_is_one_rounding_of_the_fp32_result(device, with_residual):
    """``out_dtype=bf16`` from fp32 input equals the fp32 output cast once: bit for bit, both
    ways (the kernel rounds its fp32 result once, as the cast would); ``h`` and the gradients
    keep the input dtype, and the gradients equal those of the fp32 output cast to bf16."""
    if device == "cpu" and INTERPRET:
        pytest.skip("Triton's interpreter truncates fp32 to bf16 where the GPU rounds")
    x, w = leaf((4, 64), device, torch.float32, 0), leaf((64,), device, torch.float32, 1)
    r = leaf((4, 64), device, torch.float32, 2) if with_residual else None
    inputs = [x, w] + ([r] if with_residual else [])

    def y_of(out):
        return out[0] if with_residual else out

    y16 = y_of(rms_norm(x, w, 1e-5, residual=r, out_dtype=torch.bfloat16))
    y32 = y_of(rms_norm(x, w, 1e-5, residual=r)).to(torch.bfloat16)
    assert y16.dtype == torch.bfloat16
    assert torch.equal(y16, y32)
    for got, want in zip(grads(y16, inputs), grads(y32, inputs), strict=True):
        assert got.dtype == torch.float32
        assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_swiglu(device):
    dtype, tol = dtype_and_tol(device)
    gate, up = leaf((4, 7, 64), device, dtype, 0), leaf((4, 7, 64), device, dtype, 1)
    y, y_ref = swiglu(gate, up), F.silu(gate) * up
    close(y, y_ref, tol)
    for got, want in zip(grads(y, [gate, up]), grads(y_ref, [gate, up]), strict=True):
        close(got, want, tol)
    with pytest.raises(ValueError, match="one shape and dtype"):
        swiglu(gate, up[..., :32])


@pytest.mark.parametrize("device", DEVICES)
def test_rotary(device):
    dtype, tol = dtype_and_tol(device)
    q, k = leaf((2, 6, 4, 32), device, dtype, 0), leaf((2, 6, 2, 32), device, dtype, 1)
    cos, sin = rope_tables(6, 32, device=device)
    q_rot, k_rot = apply_rotary(q, k, cos, sin)

    def reference(x):  # HF Llama: x * cos + rotate_half(x) * sin with duplicated tables
        cos_full = torch.cat([cos, cos], -1)[:, None, :].to(dtype)
        sin_full = torch.cat([sin, sin], -1)[:, None, :].to(dtype)
        x1, x2 = x[..., :16], x[..., 16:]
        return x * cos_full + torch.cat([-x2, x1], -1) * sin_full

    q_ref, k_ref = reference(q), reference(k)
    # The tables are fp32: tolerance is fp32's for the rotation itself.
    close(q_rot, q_ref, max(tol, 1e-6))
    close(k_rot, k_ref, max(tol, 1e-6))
    out, out_ref = q_rot.sum() + (k_rot * 2).sum(), q_ref.sum() + (k_ref * 2).sum()
    for got, want in zip(
        torch.autograd.grad(out, [q, k]), torch.autograd.grad(out_ref, [q, k]), strict=True
    ):
        close(got, want, max(tol, 1e-6))
    with pytest.raises(ValueError, match="must be \\(B, T, H, D\\) with T=6"):
        apply_rotary(q[:, :5], k, cos, sin)


@pytest.mark.parametrize("device", DEVICES)
def test_cross_entropy(device):
    dtype, tol = dtype_and_tol(device)
    logits = leaf((37, 1000), device, dtype, 0)
    target = torch.randint(0, 1000, (37,), generator=torch.Generator().manual_seed(1)).to(device)
    target[::5] = -100
    loss = cross_entropy(logits, target, chunk_rows=8)
    loss_ref = F.cross_entropy(logits, target, ignore_index=-100)
    close(loss, loss_ref, tol)
    close(
        torch.autograd.grad(loss * 3, logits)[0], torch.autograd.grad(loss_ref * 3, logits)[0], tol
    )


@pytest.mark.parametrize("device", DEVICES)
def test_cross_entropy_bf16_keeps_dtype(device):
    logits = leaf((16, 512), device, torch.bfloat16, 0)
    target = torch.arange(16, device=device)
    loss = cross_entropy(logits, target, chunk_rows=4)
    loss.backward()
    assert logits.grad.dtype == torch.bfloat16
    # Same bf16 inputs, fp32 math in both: agree to fp32 rounding; the gradient is rounded to bf16.
    reference = F.cross_entropy(logits.detach().float(), target)
    close(loss, reference, 1e-5)


def byte_mismatches(actual, expected) -> str:
    """Where two FP8 tensors' bytes differ, for the assertion message (none: empty string)."""
    a, e = actual.view(torch.uint8), expected.view(torch.uint8)
    where = (a != e).nonzero()
    if not len(where):
        return ""
    first = tuple(where[0].tolist())
    return f"{len(where)} of {a.numel()} bytes differ, first at {first}: {a[first]} vs {e[first]}"


# Shapes: tiles of 64 both full and masked in either axis (the kernel's TILE), and the shapes of
# mt-parallel's GPU check (256 tokens; 32-wide k/v projections; 128 and 256 features).
SHAPES = [(96, 160), (256, 32), (32, 128), (256, 256), (200, 48)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("fmt", [FP8Format.E4M3, FP8Format.E5M2], ids=lambda f: f.value)
def test_quantize_transpose_amax_matches_quantize(device, dtype, shape, fmt):
    # Bit-exact: both paths multiply by the IEEE inverse scale RN(1/s) with a round-to-nearest
    # product (div.rn.f32 once, mul.rn.f32 per element in the kernel), clamp and cast with
    # round-to-nearest-even; q and qᵀ are checked separately (fp32 qᵀ: the int32-code transpose).
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 7
    x[0, :9] = 1e-9  # flushed to zero by every scale below (health counts)
    x = x.to(device, dtype)
    stats = torch.zeros(3, dtype=torch.int64, device=device)
    q, q_t, amax = quantize_transpose_amax(x, fmt, stats=stats)
    reference_stats = torch.zeros(3, dtype=torch.int64, device=device)
    reference = quantize(x, fmt, stats=reference_stats)
    assert stats.tolist() == reference_stats.tolist() and stats[1].item() >= 9
    assert amax.item() == x.abs().max().item()
    assert torch.equal(q.scale, reference.scale)
    assert not byte_mismatches(q.data, reference.data), byte_mismatches(q.data, reference.data)
    ref_t = reference.data.t().contiguous()
    assert not byte_mismatches(q_t.data, ref_t), byte_mismatches(q_t.data, ref_t)
    # With a fixed (delayed) scale: one pass, saturates, and still reports the true amax.
    fixed = torch.tensor(0.01, device=device)
    stats.zero_()
    q, q_t, amax = quantize_transpose_amax(x, fmt, scale=fixed, stats=stats)
    assert amax.item() == x.abs().max().item()
    # The quantizers' own scaling, x · RN(1/s) (quantized.cast_to_fp8).
    saturated = int((x.float().abs() * torch.reciprocal(fixed) >= fmt.saturation_threshold).sum())
    assert stats[0].item() == saturated and stats[2].item() == x.numel()
    reference_stats.zero_()
    reference = quantize(x, fmt, scale=fixed, stats=reference_stats)
    assert stats.tolist() == reference_stats.tolist()
    assert not byte_mismatches(q.data, reference.data), byte_mismatches(q.data, reference.data)
    ref_t = reference.data.t().contiguous()
    assert not byte_mismatches(q_t.data, ref_t), byte_mismatches(q_t.data, ref_t)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_swiglu_quantize_transpose_amax_matches_swiglu_then_quantize(device, dtype, shape, scaling):
    # Bit-exact: the kernel computes each tile of silu(g)·u as the SwiGLU kernel does, rounds it
    # to g's dtype as that kernel stores it, then quantizes it as quantize_transpose_amax does.
    generator = torch.Generator().manual_seed(1)
    gate, up = (torch.randn(shape, generator=generator).mul(4).to(device, dtype) for _ in "gu")
    fmt = FP8Format.E4M3
    scale = torch.tensor(0.004, device=device) if scaling == "delayed" else None  # saturates some
    stats, reference_stats = (torch.zeros(3, dtype=torch.int64, device=device) for _ in "sr")
    q, q_t, amax = swiglu_quantize_transpose_amax(gate, up, fmt, scale=scale, stats=stats)
    product = swiglu(gate, up)
    ref, ref_t, ref_amax = quantize_transpose_amax(product, fmt, scale=scale, stats=reference_stats)
    assert amax.item() == ref_amax.item() == product.abs().max().item()
    assert torch.equal(q.scale, ref.scale) and stats.tolist() == reference_stats.tolist()
    assert not byte_mismatches(q.data, ref.data), byte_mismatches(q.data, ref.data)
    assert not byte_mismatches(q_t.data, ref_t.data), byte_mismatches(q_t.data, ref_t.data)
    if scaling == "delayed":
        assert stats[0].item() > 0  # the fixed scale saturated some values


def test_swiglu_quantize_transpose_amax_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match=r"gate and up of one shape and dtype, got \(4, 8\)"):
        swiglu_quantize_transpose_amax(torch.ones(4, 8), torch.ones(4, 16), FP8Format.E4M3)
    with pytest.raises(ValueError, match="2-D float32/bfloat16/float16 tensor"):
        swiglu_quantize_transpose_amax(torch.ones(8), torch.ones(8), FP8Format.E4M3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "write_tile, amax_tile",
    [((32, 128, 4), (128, 32, 2)), ((128, 16, 8), (16, 256, 4))],
    ids=["wide_write", "tall_write"],
)
def test_quantize_transpose_amax_other_tiles(device, dtype, write_tile, amax_tile, monkeypatch):
    # benchmarks/quantize_transpose.py --sweep times other tiles than the shipped 64 × 64; each
    # must give the same bytes, scales, amax and health counts, with different tile counts in
    # the two launches (so per-launch partials and tickets) and non-square transposed tiles.
    if not triton_runs_on(device):
        pytest.skip("the tiles are settings of the Triton kernels")
    from mt_fp8.kernels import quantize as kernels

    monkeypatch.setattr(kernels, "WRITE_TILE", write_tile)
    monkeypatch.setattr(kernels, "AMAX_TILE", amax_tile)
    generator = torch.Generator().manual_seed(2)
    for shape in [(96, 160), (200, 48), (256, 256)]:
        x = (torch.randn(shape, generator=generator) * 7).to(device, dtype)
        for scale in (None, torch.tensor(0.01, device=device)):
            stats = torch.zeros(3, dtype=torch.int64, device=device)
            q, q_t, amax = quantize_transpose_amax(x, FP8Format.E4M3, scale=scale, stats=stats)
            reference_stats = torch.zeros(3, dtype=torch.int64, device=device)
            reference = quantize(x, FP8Format.E4M3, scale=scale, stats=reference_stats)
            assert amax.item() == x.abs().max().item(), (shape, scale)
            assert torch.equal(q.scale, reference.scale), (shape, scale)
            assert stats.tolist() == reference_stats.tolist(), (shape, scale)
            assert not byte_mismatches(q.data, reference.data)
            assert not byte_mismatches(q_t.data, reference.data.t().contiguous())
    monkeypatch.setattr(kernels, "WRITE_TILE", (48, 64, 4))
    with pytest.raises(ValueError, match=r"WRITE_TILE=\(48, 64, 4\).*powers of two"):
        quantize_transpose_amax(x, FP8Format.E4M3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group", [None, 4], ids=["group_default", "group4"])
def test_quantize_transpose_amax_back_to_back_sizes(device, group, monkeypatch):
    # The Triton kernels fold their per-tile partials in each launch's last programs, found with
    # ticket counters shared by all launches on a stream; each fold must leave them at zero.
    # Every quantization of a sequence of different tile counts (more and fewer than the one
    # before; a 1×1 grid; given and computed scales) must then match its own reference. Groups
    # of 4 tiles give these small tensors several groups (the last one partial) and let the
    # counters grow.
    if group is not None:
        if not triton_runs_on(device):
            pytest.skip("the group size is a setting of the Triton kernels")
        from mt_fp8.kernels import quantize as kernels

        monkeypatch.setattr(kernels, "GROUP", group)
    generator = torch.Generator().manual_seed(1)
    for shape in [(256, 256), (96, 160), (1, 3), (200, 48), (320, 130)]:
        x = (torch.randn(shape, generator=generator) * 7).to(device, torch.bfloat16)
        for scale in (None, torch.tensor(0.01, device=device)):
            stats = torch.tensor([5, 6, 7], device=device)  # accumulated into, not overwritten
            q, q_t, amax = quantize_transpose_amax(x, FP8Format.E4M3, scale=scale, stats=stats)
            reference_stats = torch.tensor([5, 6, 7], device=device)
            reference = quantize(x, FP8Format.E4M3, scale=scale, stats=reference_stats)
            assert amax.item() == x.abs().max().item(), (shape, scale)
            assert torch.equal(q.scale, reference.scale), (shape, scale)
            assert stats.tolist() == reference_stats.tolist(), (shape, scale)
            assert not byte_mismatches(q.data, reference.data)
            assert not byte_mismatches(q_t.data, reference.data.t().contiguous())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(0, 5), (70, 0), (0, 0)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_quantize_transpose_amax_empty_input(device, shape):
    # An empty x (an expert with no tokens) runs one fully masked program: amax 0, scale 1 (or
    # the given one), no health counts. The plain-PyTorch path takes no empty tensors.
    x = torch.zeros(shape, device=device)
    if not use_triton(x):
        pytest.skip("the Triton kernels run on CUDA or under TRITON_INTERPRET=1")
    stats = torch.tensor([1, 2, 3], device=device)
    q, q_t, amax = quantize_transpose_amax(x, FP8Format.E4M3, stats=stats)
    assert amax.item() == 0.0 and q.scale.tolist() == [[1.0]]
    assert q.data.shape == shape and q_t.data.shape == shape[::-1]
    assert stats.tolist() == [1, 2, 3]
    given = torch.tensor(0.25, device=device)
    q, q_t, amax = quantize_transpose_amax(x, FP8Format.E5M2, scale=given, stats=stats)
    assert amax.item() == 0.0 and q.scale.tolist() == [[0.25]] and q_t.scale.tolist() == [[0.25]]
    assert stats.tolist() == [1, 2, 3]


@pytest.mark.gpu
def test_quantize_transpose_amax_replays_in_a_cuda_graph():
    # Ticket counters first needed during capture are zeroed by the graph itself (module
    # docstring of mt_fp8.kernels.quantize): every replay folds its own launch's partials.
    x = torch.randn(300, 200, device="cuda", dtype=torch.bfloat16)
    given = torch.tensor(0.05, device="cuda")
    stats = torch.zeros(2, 3, dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: the kernels compile outside the capture
        quantize_transpose_amax(x, FP8Format.E4M3, stats=stats[0])
        quantize_transpose_amax(x, FP8Format.E4M3, scale=given, stats=stats[1])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        current = quantize_transpose_amax(x, FP8Format.E4M3, stats=stats[0])
        delayed = quantize_transpose_amax(x, FP8Format.E4M3, scale=given, stats=stats[1])
    generator = torch.Generator().manual_seed(2)
    for magnitude in (1.0, 1e3, 1e-3):
        x.copy_(torch.randn(x.shape, generator=generator) * magnitude)
        stats.zero_()
        graph.replay()
        for (q, q_t, amax), scale, counts in (
            (current, None, stats[0]),
            (delayed, given, stats[1]),
        ):
            reference_stats = torch.zeros(3, dtype=torch.int64, device="cuda")
            reference = quantize(x, FP8Format.E4M3, scale=scale, stats=reference_stats)
            assert amax.item() == x.abs().max().item()
            assert torch.equal(q.scale, reference.scale)
            assert counts.tolist() == reference_stats.tolist()
            assert not byte_mismatches(q.data, reference.data)
            assert not byte_mismatches(q_t.data, reference.data.t().contiguous())
    # Eager calls afterwards use their own stream's counters.
    q, _, amax = quantize_transpose_amax(x, FP8Format.E4M3)
    assert amax.item() == x.abs().max().item()
    assert torch.equal(q.scale, quantize(x, FP8Format.E4M3).scale)


def _compiled_plain_ops_match_eager(fullgraph: bool) -> None:
    """All plain fused ops in one function: compiled (aot_eager) outputs and input gradient
    equal the eager ones exactly."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, generator=generator, requires_grad=True)
    weight = torch.rand(32, generator=generator) + 0.5
    q = torch.randn(1, 4, 2, 16, generator=generator)
    k = torch.randn(1, 4, 1, 16, generator=generator)
    cos, sin = rope_tables(4, 16)
    target = torch.tensor([1, 0, 31, 5])

    def all_ops(x):
        gate, up = x[:, :16], x[:, 16:]
        rq, rk = apply_rotary(q * x[0, 0], k, cos, sin)
        return rms_norm(x, weight), swiglu(gate, up), rq, rk, cross_entropy(x, target)

    expected = all_ops(x)
    expected_grad = torch.autograd.grad(sum(t.sum() for t in expected), x)[0]
    torch._dynamo.reset()
    compiled = torch.compile(all_ops, backend="aot_eager", fullgraph=fullgraph)
    got = compiled(x)
    for actual, want in zip(got, expected, strict=True):
        torch.testing.assert_close(actual, want, rtol=0, atol=0)
    grad = torch.autograd.grad(sum(t.sum() for t in got), x)[0]
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)


@pytest.mark.skipif(INTERPRET, reason="Dynamo cannot trace the interpreter's Triton kernels")
@pytest.mark.skipif(
    not dispatch.PLAIN_FUNCTIONS_COMPILE_ON_CPU, reason="this torch runs them eagerly"
)
def test_plain_paths_compile_into_one_graph_on_the_cpu():
    # On the CPU (torch >= 2.13) the plain-PyTorch autograd functions are traced into compiled
    # graphs (fullgraph: no graph break) and match eager exactly; elsewhere
    # ops.dispatch.plain_apply keeps them eager (its NOTE; checked on the GPU by mt-parallel's
    # test_parallel_gpu.py).
    _compiled_plain_ops_match_eager(fullgraph=True)


@pytest.mark.skipif(INTERPRET, reason="Dynamo cannot trace the interpreter's Triton kernels")
def test_plain_paths_run_eagerly_inside_compiled_code_on_older_torch(monkeypatch):
    # With a torch whose compiled gradients of these functions were wrong (2.11: 100% off on the
    # CPU), plain_apply keeps them out of the graph: the compiled function breaks around them
    # and its gradient is eager's exactly.
    monkeypatch.setattr(dispatch, "PLAIN_FUNCTIONS_COMPILE_ON_CPU", False)
    with pytest.raises(Exception, match=r"(?i)graph break|skip|disable"):
        _compiled_plain_ops_match_eager(fullgraph=True)
    _compiled_plain_ops_match_eager(fullgraph=False)
