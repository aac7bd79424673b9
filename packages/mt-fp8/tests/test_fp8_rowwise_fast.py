"""The Triton rowwise quantizer (:mod:`mt_fp8.kernels.rowwise_quantize`).

Bit-identical to ``quantize(x, fmt, ROWWISE)`` (FP8 bytes and scales; where a value is NaN only
NaN-ness is compared), with the same health counts; an ``FP8Linear`` with the rowwise recipe
gives identical outputs, gradients and counts on the fused and the PyTorch path. The CPU cases
run the kernel in Triton's interpreter, only under ``TRITON_INTERPRET=1`` (otherwise they skip)::

    TRITON_INTERPRET=1 pytest -q packages/mt-fp8/tests/test_fp8_rowwise_fast.py

The kernel loops over a runtime column count, which Triton 3.6's interpreter handles only with
numpy < 2.3 (it converts 1-element arrays to Python ints, which newer numpy refuses).
"""

from __future__ import annotations

import pytest
import torch
from test_fp8_block_fast import (
    DEVICES,
    FORMATS,
    assert_same_quantization,
    awkward_input,
    fused_calls_of_a_layer_matching_the_pytorch_path,
)

from mt_fp8 import FP8Format, RowwiseScaling, quantize
from mt_fp8.quantized import ROWWISE, QuantizedTensor


def rowwise_kernels():
    from mt_fp8.kernels import rowwise_quantize

    return rowwise_quantize


# (201, 1100): a partial last program (201 % 4 rows) and a partial last column tile (1100 %
# 1024); (3, 64): fewer rows than one program, one short tile.
SHAPES = [(201, 1100), (3, 64)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_rowwise_kernel_matches_quantize(device, dtype, shape, fmt):
    x = awkward_input(*shape, dtype, device)
    stats = torch.zeros(3, dtype=torch.int64, device=device)
    q = rowwise_kernels().quantize_rows(x, fmt, stats)
    expected_stats = torch.zeros(3, dtype=torch.int64, device=device)
    expected = quantize(x, fmt, ROWWISE, stats=expected_stats)
    assert_same_quantization(q, expected)
    assert torch.equal(stats, expected_stats)
    if shape[0] > 150 and dtype != torch.float16:
        # The edge cases are really there: a zero row, NaN rows, a floored scale, flushes.
        assert (expected.scale == 1).any() and expected.scale.isnan().any()
        assert (expected.scale == 2.0**-126).any() and stats[1] > 0
    # Columns of x are rows of xᵀ: the transposed operand, from x's columns.
    q_t = rowwise_kernels().quantize_columns_transposed(x, fmt)
    assert_same_quantization(q_t, quantize(x.t(), fmt, ROWWISE))
    if shape[0] > 150:  # columns with inf and NaN: NaN scales
        assert q_t.scale.isnan().any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_group_column_quantizer_matches_quantize_per_group(device, dtype, fmt):
    # Groups of rows (uneven, one shorter than a 128-row tile, boundaries inside tiles), each
    # quantized along its rows with its own column scales, side by side in one xᵀ.
    sizes = [70, 100, 31]
    x = awkward_input(sum(sizes), 1100, dtype, device)
    starts = [0, 70, 170]
    expected = [
        quantize(x[s : s + n].t(), fmt, ROWWISE) for s, n in zip(starts, sizes, strict=True)
    ]
    scale_GC = torch.stack([q.scale.reshape(-1) for q in expected])
    group_R = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes)).to(device)
    q_CR = rowwise_kernels().quantize_group_columns_transposed(x, scale_GC, group_R, fmt)
    assert q_CR.shape == (1100, sum(sizes))
    for s, n, q in zip(starts, sizes, expected, strict=True):
        got = QuantizedTensor(q_CR[:, s : s + n].contiguous(), q.scale, ROWWISE, fmt)
        assert_same_quantization(got, q)
    assert scale_GC.isnan().any() and (scale_GC == 1).any()  # the edge cases are there
    with pytest.raises(ValueError, match="scale_GC must be fp32 of shape"):
        rowwise_kernels().quantize_group_columns_transposed(x, scale_GC[:, :5], group_R, fmt)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(0, 64), (5, 0)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_column_quantizer_takes_empty_inputs(device, shape):
    x = torch.zeros(shape, device=device, dtype=torch.bfloat16)
    q_t = rowwise_kernels().quantize_columns_transposed(x, FP8Format.E4M3)
    assert q_t.data.shape == (shape[1], shape[0]) and q_t.scale.shape == (shape[1], 1)
    expected = rowwise_kernels().quantize_rows(x.t().contiguous(), FP8Format.E4M3)
    assert torch.equal(q_t.scale, expected.scale)  # rows of xᵀ with nothing in them: scale 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["quantize_rows", "quantize_columns_transposed"])
def test_rowwise_quantizer_refuses_float64(device, name):
    with pytest.raises(ValueError, match="takes a 2-D bfloat16, float16 or float32 tensor"):
        getattr(rowwise_kernels(), name)(
            torch.randn(4, 64, device=device, dtype=torch.float64), FP8Format.E4M3
        )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_rowwise_kernel_matches_quantize_at_scale_on_cuda(dtype):
    # Many programs at once and rows longer than several column tiles.
    x = awkward_input(4000, 5000, dtype, "cuda")
    q = rowwise_kernels().quantize_rows(x, FP8Format.E4M3)
    assert_same_quantization(q, quantize(x, FP8Format.E4M3, ROWWISE))
    q_t = rowwise_kernels().quantize_columns_transposed(x, FP8Format.E4M3)
    assert_same_quantization(q_t, quantize(x.t(), FP8Format.E4M3, ROWWISE))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_fp8_linear_rowwise_fused_matches_pytorch_path(device, dtype, monkeypatch):
    names = ("quantize_rows", "quantize_columns_transposed")
    calls = fused_calls_of_a_layer_matching_the_pytorch_path(
        device, dtype, RowwiseScaling(), rowwise_kernels(), names, monkeypatch
    )
    # x, w and dy along their rows and, for xᵀ, wᵀ and dyᵀ, along their columns: every operand
    # through the kernels.
    shapes = [(200, 256), (384, 256), (200, 384)]
    assert calls == sorted((name, shape) for name in names for shape in shapes)
