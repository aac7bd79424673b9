"""MoE permute/unpermute: the Triton kernels against the PyTorch path, both against float64.

``kernel`` tests run the Triton kernels (on CUDA, ``gpu`` marker, or on the CPU under
``TRITON_INTERPRET=1``: ``nox -s tests-mt-fp8-triton``) and require bit-identical forwards,
``dx`` and ``dy`` to the PyTorch path: the kernels form the same fp32 products and sum them in
the same order without FMA (:mod:`mt_fp8.ops.moe_permute`). ``dw`` is a D-long fp32 dot
product summed in another order, so it is held to the float64 dot product with the forward
error bound of recursive summation: ``(D + 1) · 2^-24 · Σ_d |y_d · dout_d|`` (one rounding per
product, one per add). The ``reference`` tests hold the PyTorch path itself to a float64 loop.
"""

from __future__ import annotations

import math

import pytest
import torch

from mt_fp8.ops.dispatch import triton_runs_on
from mt_fp8.ops.moe_permute import (
    assignment_rows,
    permute_rows,
    permute_rows_reference,
    unpermute_rows,
    unpermute_rows_reference,
)

U32 = 2.0**-24
"""Unit roundoff of fp32."""
SEQUENTIAL_SUM_TERMS = 4
"""PyTorch's CPU ``sum`` over a strided dim of at most 4 terms adds them in order (SumKernel.cpp:
its 4-way interleave gives ``((p0 + p1) + p2) + p3``); past 4 the order depends on where a
column falls in its SIMD blocks, so the kernels' j-ordered forward is held to float64 instead."""
TOKENS, HIDDEN, EXPERTS = 12, 40, 12
# Routing: (top_k, capacity factor or None for dropless, pad to capacity).
ROUTINGS = [
    (1, None, False),
    (2, None, False),
    (2, 1.0, False),
    (2, 1.0, True),
    (4, 0.75, True),
    (8, None, False),
    (8, 1.25, True),
]


def kernel_devices():
    return [
        pytest.param(
            "cpu",
            marks=pytest.mark.skipif(
                not triton_runs_on("cpu"), reason="Triton on the CPU needs TRITON_INTERPRET=1"
            ),
        ),
        pytest.param("cuda", marks=pytest.mark.gpu),
    ]


def routing_plan(top_k, capacity_factor, pad, seed=0):
    """Indices, weights and the ``(order_N, rows_N, num_rows)`` of mt_parallel's permute_plan.

    Experts ``EXPERTS - 2`` and ``EXPERTS - 1`` receive nothing (empty groups); skewed choices
    make capacity drop assignments.
    """
    generator = torch.Generator().manual_seed(seed)
    used = EXPERTS - 2
    scores = torch.rand(TOKENS, used, generator=generator) + torch.linspace(1, 0, used)
    indices_TK = scores.topk(top_k, dim=1).indices
    weights_TK = torch.softmax(torch.randn(TOKENS, top_k, generator=generator), dim=1)
    experts_A = indices_TK.reshape(-1)
    order_A = torch.argsort(experts_A, stable=True)
    counts_E = torch.bincount(experts_A, minlength=EXPERTS)
    if capacity_factor is None:
        order_N, rows_N, num_rows = order_A, None, order_A.numel()
    else:
        capacity = math.ceil(capacity_factor * TOKENS * top_k / EXPERTS)
        starts_E = torch.cumsum(counts_E, 0) - counts_E
        sorted_experts_A = experts_A[order_A]
        position_A = torch.arange(order_A.numel()) - starts_E[sorted_experts_A]
        keep_A = position_A < capacity
        assert not keep_A.all(), "the routing should drop assignments"
        order_N = order_A[keep_A]
        if pad:
            rows_N = sorted_experts_A[keep_A] * capacity + position_A[keep_A]
            num_rows = EXPERTS * capacity
        else:
            rows_N, num_rows = None, order_N.numel()
    return weights_TK, order_N, rows_N, num_rows


def rows_of(num, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num, HIDDEN, generator=generator).to(dtype)


def outputs_and_grads(fn, inputs, upstream, device):
    """``fn``'s output and input gradients on copies of ``inputs`` moved to ``device``, on the CPU."""
    leaves = [x.detach().to(device).requires_grad_() for x in inputs]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, upstream.to(device))
    return out.cpu(), [g.cpu() for g in grads]


def assert_bitwise(actual, expected):
    assert actual.dtype == expected.dtype
    assert torch.equal(actual, expected), (actual.double() - expected.double()).abs().max().item()


@pytest.fixture(autouse=True)
def fused_on_cuda(monkeypatch):
    """The kernels run by default on CUDA unless MT_FUSED_MOE_PERMUTE=0; these tests need them."""
    monkeypatch.delenv("MT_FUSED_MOE_PERMUTE", raising=False)


@pytest.fixture(params=[False, True], ids=["one_block", "blocked_rows"])
def block_sizes(request, monkeypatch):
    """Also run with rows split over several blocks (the kernels' masked loops)."""
    if request.param:
        monkeypatch.setattr("mt_fp8.kernels.moe_permute.MAX_BLOCK_D", 16)
        monkeypatch.setattr("mt_fp8.kernels.moe_permute.MAX_TILE", 64)


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("top_k", "capacity_factor", "pad"), ROUTINGS)
def test_kernels_against_pytorch(device, dtype, top_k, capacity_factor, pad, block_sizes):
    """The kernels on ``device`` against the PyTorch path on the CPU (on CUDA, ``index_add``'s
    atomics sum in no fixed order, so the CPU is the deterministic reference)."""
    weights_TK, order_N, rows_N, num_rows = routing_plan(top_k, capacity_factor, pad)
    plan = [order_N, rows_N]
    on_device = [None if t is None else t.to(device) for t in plan]
    x_TD = rows_of(TOKENS, dtype, 1)
    dx_MD = rows_of(num_rows, dtype, 2)
    x_MD, (dx,) = outputs_and_grads(
        lambda x: permute_rows(x, *on_device, num_rows, top_k), [x_TD], dx_MD, device
    )
    x_MD_ref, (dx_ref,) = outputs_and_grads(
        lambda x: permute_rows_reference(x, *plan, num_rows, top_k), [x_TD], dx_MD, "cpu"
    )
    assert_bitwise(x_MD, x_MD_ref)
    assert_bitwise(dx, dx_ref)

    y_MD = rows_of(num_rows, dtype, 3)
    dout_TD = rows_of(TOKENS, dtype, 4)
    out, (dy, dw) = outputs_and_grads(
        lambda y, w: unpermute_rows(y, *on_device, w), [y_MD, weights_TK], dout_TD, device
    )
    out_ref, (dy_ref, dw_ref) = outputs_and_grads(
        lambda y, w: unpermute_rows_reference(y, *plan, w), [y_MD, weights_TK], dout_TD, "cpu"
    )
    rows_TK = assignment_rows(order_N, rows_N, TOKENS, top_k)
    if top_k <= SEQUENTIAL_SUM_TERMS:
        assert_bitwise(out, out_ref)
    else:
        for name, value in (("triton", out), ("pytorch", out_ref)):
            check_unpermute_bound(name, value, y_MD, rows_TK, weights_TK)
    assert_bitwise(dy, dy_ref)
    products_TKD = y_MD.double()[rows_TK.clamp(min=0)] * dout_TD.double()[:, None, :]
    products_TKD[rows_TK < 0] = 0
    dw_64 = products_TKD.sum(-1)
    bound = (HIDDEN + 1) * U32 * products_TKD.abs().sum(-1)
    for name, value in (("triton", dw), ("pytorch", dw_ref)):
        assert value.dtype == torch.float32
        excess = ((value.double() - dw_64).abs() - bound).max().item()
        assert excess <= 0, f"{name} dw exceeds the bound by {excess}"
    assert torch.all(dw[rows_TK < 0] == 0)


def check_unpermute_bound(name, out, y_MD, rows_TK, weights_TK):
    """``out`` within fp32 summation error of the float64 sum, ``(K + 1) · 2^-24 · Σ_j |w y|``
    (one rounding per product and per add), plus the rounding to ``out``'s dtype
    (``eps · |out|``: half an ulp is ``eps/2`` relative, doubled to cover the sum's error)."""
    top_k = rows_TK.shape[1]
    out_64 = float64_unpermute(y_MD, rows_TK, weights_TK)
    magnitude = float64_unpermute(y_MD.abs(), rows_TK, weights_TK.abs())
    bound = (top_k + 1) * U32 * magnitude + torch.finfo(out.dtype).eps * out_64.abs()
    excess = ((out.double() - out_64).abs() - bound).max().item()
    assert excess <= 0, f"{name} output exceeds the bound by {excess}"


def float64_unpermute(y_MD, rows_TK, weights_TK):
    out = torch.zeros(rows_TK.shape[0], y_MD.shape[1], dtype=torch.float64)
    for t, j in zip(*torch.nonzero(rows_TK >= 0, as_tuple=True), strict=True):
        out[t] += weights_TK[t, j].double() * y_MD[rows_TK[t, j]].double()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("top_k", "capacity_factor", "pad"), ROUTINGS)
def test_reference_against_float64(dtype, top_k, capacity_factor, pad):
    """The PyTorch path against a float64 loop: rows gathered exactly, padding zero, and the
    weighted sum within fp32 summation error (``(K + 1) · 2^-24 · Σ_j |w y|``) plus the
    rounding to ``dtype`` (``eps · |out|``)."""
    weights_TK, order_N, rows_N, num_rows = routing_plan(top_k, capacity_factor, pad)
    rows_TK = assignment_rows(order_N, rows_N, TOKENS, top_k)
    x_TD = rows_of(TOKENS, dtype, 1)
    x_MD = permute_rows_reference(x_TD, order_N, rows_N, num_rows, top_k)
    kept = rows_TK >= 0
    assert torch.equal(x_MD[rows_TK[kept]], x_TD[torch.nonzero(kept)[:, 0]])
    padding = torch.ones(num_rows, dtype=torch.bool)
    padding[rows_TK[kept]] = False
    assert torch.all(x_MD[padding] == 0)
    assert padding.any() == (pad and capacity_factor is not None)

    y_MD = rows_of(num_rows, dtype, 3)
    out = unpermute_rows_reference(y_MD, order_N, rows_N, weights_TK)
    assert out.dtype == dtype
    check_unpermute_bound("pytorch", out, y_MD, rows_TK, weights_TK)


def test_assignment_rows_marks_dropped_assignments():
    order_N = torch.tensor([4, 0, 3, 1])
    rows_N = torch.tensor([0, 1, 4, 5])
    rows_TK = assignment_rows(order_N, rows_N, tokens=3, top_k=2)
    assert rows_TK.tolist() == [[1, 5], [-1, 4], [0, -1]]
    assert assignment_rows(order_N, None, 3, 2).tolist() == [[1, 3], [-1, 2], [0, -1]]
