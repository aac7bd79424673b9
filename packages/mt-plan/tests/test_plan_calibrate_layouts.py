"""``mt-plan calibrate`` times the GEMMs training runs: the same calls on the same operand layouts.

Training's GEMM calls are recorded from the trainer's own layers, forward and backward: an
``F.linear`` through autograd, mt-fp8's ``FP8Linear`` per recipe and mt-parallel's
``GroupedLinear``. Every one must be among the calls ``calibrate(tiny=True)`` timed. A call is
identified by what its kernel is chosen by: the op and each operand's shape, strides and dtype;
for an FP8 GEMM (``mt_fp8.fp8_gemm``) each operand's shape, strides, format and scale layout and
the output dtype. The calibration once timed ``a @ b`` on row-major matrices (dgrad's layout
alone) and only the forward FP8 GEMM: training's forward and wgrad calls (dense and grouped)
and its FP8 backward GEMMs were not among its calls.

The recording timer runs each timed function once and the recorded ``fp8_gemm`` returns zeros
of the product's shape without multiplying (only the call is compared), so the test takes
seconds on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mt_fp8
from mt_parallel.moe.experts import GroupedLinear
from mt_plan import measure
from mt_plan.calibration import CalibrationTable

GEMM_OPS = ("aten.mm", "aten.addmm", "aten.bmm", "aten._grouped_mm")
RECIPES = ["tensorwise", "rowwise", "blockwise", "delayed", "mxfp8"]


def _tensor(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.dtype)


class _Recorder(TorchDispatchMode):
    """Records every GEMM op dispatched inside it and every ``mt_fp8.fp8_gemm`` call."""

    def __init__(self, calls: set) -> None:
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in GEMM_OPS:
            self.calls.add((name, *(_tensor(a) for a in args if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))

    def fp8_gemm(self, a, b, out_dtype=torch.float32, bias=None, backend="auto"):
        operands = [(q.shape, q.data.stride(), q.fmt, q.layout) for q in (a, b)]
        self.calls.add(("fp8_gemm", *operands, out_dtype))
        return torch.zeros(a.shape[0], b.shape[0], dtype=out_dtype)


@pytest.fixture(scope="module")
def calibrated() -> tuple[set, CalibrationTable]:
    """The calls ``calibrate(tiny=True)`` timed (every FP8 recipe), and the table it wrote."""
    calls: set = set()
    recorder = _Recorder(calls)

    def timer(device, tiny=False):
        def measure_once(fn, **counts):
            with recorder:
                fn()
            return 1e-3

        return measure_once

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(measure, "_timer", timer)
        patch.setattr(mt_fp8, "fp8_gemm", recorder.fp8_gemm)
        patch.setattr(mt_fp8.functional, "fp8_gemm", recorder.fp8_gemm)
        table = measure.calibrate("cpu", tiny=True, fp8_recipes=RECIPES)
    return calls, table


def _training_calls(step) -> set:
    """The calls ``step()`` makes (a forward and its backward)."""
    calls: set = set()
    recorder = _Recorder(calls)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mt_fp8.functional, "fp8_gemm", recorder.fp8_gemm)
        with recorder:
            step()
    return calls


def _assert_timed(training: set, calibrated: tuple[set, CalibrationTable]) -> None:
    assert len(training) == 3, training  # forward, dgrad, wgrad
    missing = training - calibrated[0]
    assert not missing, f"training GEMM calls the calibration did not time: {missing}"


def _entries(calibrated: tuple[set, CalibrationTable]) -> set:
    return {(e.op, e.dtype, e.shape) for e in calibrated[1].entries}


@pytest.mark.parametrize("M,N,K", measure.TINY_GEMMS)
def test_dense_gemms_are_the_linear_layers(calibrated, M, N, K) -> None:
    # the model's activations are [batch, seq, features]; F.linear folds them into one GEMM
    x = torch.randn(2, M // 2, K, requires_grad=True)
    w = torch.randn(N, K, requires_grad=True)

    def step():
        torch.nn.functional.linear(x, w).backward(torch.randn(2, M // 2, N))

    _assert_timed(_training_calls(step), calibrated)
    # each pass is its own entry, on the GEMM's own shape (out rows, out columns, contraction)
    for op, shape in [("gemm_fwd", (M, N, K)), ("gemm_dgrad", (M, K, N)),
                      ("gemm_wgrad", (N, K, M))]:  # fmt: skip
        assert (op, "bf16", shape) in _entries(calibrated)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("M,N,K", measure.TINY_GEMMS)
def test_fp8_gemms_are_the_fp8_linear_layers(calibrated, recipe, M, N, K) -> None:
    layer = mt_fp8.FP8Linear(K, N, bias=False, recipe=mt_fp8.recipe_from_name(
        measure.RECIPE_OF[recipe]))  # fmt: skip
    x = torch.randn(M, K, requires_grad=True)

    def step():
        layer(x).backward(torch.randn(M, N))

    _assert_timed(_training_calls(step), calibrated)
    assert ("gemm_wgrad", f"fp8_{recipe}", (N, K, M)) in _entries(calibrated)


@pytest.mark.parametrize("rows,N,K,groups", measure.TINY_GROUPED)
def test_grouped_gemms_are_the_expert_layers(calibrated, rows, N, K, groups) -> None:
    layer = GroupedLinear(groups, K, N, init_std=0.02)
    x = torch.randn(rows, K, requires_grad=True)
    sizes = torch.full((groups,), rows // groups)

    def step():
        layer(x, sizes).backward(torch.randn(rows, N))

    _assert_timed(_training_calls(step), calibrated)
    assert ("grouped_gemm_wgrad", "bf16", (N, K, rows, groups)) in _entries(calibrated)
