"""What the cost model charges for FP8 linears, against hand-counted bytes of mt-fp8's kernels.

* layers reading one tensor quantize it once (q/k/v, gate/up: ``quantize_shared_input``);
* under tensorwise and delayed scaling the down projection's input ``silu(gate)·up`` is quantized
  from gate and up (SwiGLU's forward does not run); other recipes compute it, then quantize it;
* the quantizers read the high-precision tensor as often as each recipe's kernels do (delayed
  once, tensorwise and blockwise twice, rowwise three times), priced from the table's current
  tensorwise ``quantize`` rate, which is rated per ``A + 2`` of the ``2A + 2`` bytes it moves;
* the fp32 weights are quantized once per step with their own read counts;
* rowwise converts each bf16 weight gradient to fp32 (inside the time of the table's own rowwise
  wgrad entries, where it has them);
* under FP8, selective ``mlp`` recompute is selective recompute (no SwiGLU module runs).
"""

from __future__ import annotations

import pytest

from mt_plan.calibration import CalibrationTable, Entry
from mt_plan.cluster import load_cluster
from mt_plan.cost import CostModel, Workload
from mt_plan.layout import Layout
from mt_plan.shape import ModelShape

SHAPE = ModelShape(
    name="llama_2l", family="llama", n_layers=2, dim=4096, vocab_size=32000, n_heads=32,
    n_kv_heads=8, head_dim=128, ffn_dim=14336,
)  # fmt: skip
T, D, KV, F = 4096, 4096, 1024, 14336
A = 2
QUANTIZE_RATE, COPY_RATE = 1e12, 2e12  # below the H100's bandwidth: the rates bind
PER_BYTE = (A + 2) / (2 * A + 2)
"""Seconds at the quantize rate are for A + 2 of every 2A + 2 bytes the quantizer moves."""


def _estimate(fp8: str, recompute: str = "none", copy: bool = False, extra: tuple = ()):
    entries = [Entry("quantize", "bf16", (8192, 4096), QUANTIZE_RATE), *extra]
    if copy:
        entries.append(Entry("copy", "bf16", (8192, 4096), COPY_RATE))
    cost = CostModel(SHAPE, load_cluster("h100_nodes").with_gpus(1),
                     CalibrationTable("test", entries), Workload(seq_len=T, global_batch=1))  # fmt: skip
    return cost.estimate(Layout(fp8=fp8, recompute=recompute))


def _quantize_seconds(reads: int, swiglu_reads: int | None) -> float:
    """Both layers' activation and gradient quantizations (optimizer's weights apart): forward
    the attention input once for q/k/v, the attention output, the MLP input once for gate/up,
    and down's input (from gate and up with ``swiglu_reads``, else the SwiGLU product);
    backward each linear's output gradient."""
    act = reads * A + 2
    down = (swiglu_reads * 2 * A + 2) if swiglu_reads else act
    forward = 3 * T * D * act + T * F * down
    backward = (3 * T * D + 2 * T * KV + 2 * T * F) * act
    return 2 * (forward + backward) * PER_BYTE / QUANTIZE_RATE


@pytest.mark.parametrize(
    "fp8,reads,swiglu_reads",
    [("tensorwise", 2, 2), ("delayed", 1, 1), ("blockwise", 2, None), ("rowwise", 3, None)],
)
def test_quantization_is_charged_as_mt_fp8_runs_it(fp8, reads, swiglu_reads) -> None:
    est = _estimate(fp8)
    assert est.compute["fp8_quantize"] == pytest.approx(_quantize_seconds(reads, swiglu_reads))


def test_swiglu_forward_is_the_down_projections_quantizer_under_tensorwise_scales() -> None:
    # the SwiGLU rate falls back to copy's: forward 3A·T·F and backward 5A·T·F, the bytes its
    # kernels move, the forward only where the product is computed in high precision
    backward = 2 * 5 * A * T * F / COPY_RATE
    for fp8 in ("tensorwise", "delayed"):
        assert _estimate(fp8, copy=True).compute["swiglu"] == pytest.approx(backward)
    for fp8 in ("none", "rowwise", "blockwise"):
        assert _estimate(fp8, copy=True).compute["swiglu"] == pytest.approx(backward * 8 / 5)


def test_autocast_weight_casts_are_charged_for_the_bf16_linears() -> None:
    # every bf16 linear's fp32 weight is cast to bf16 in the forward and its bf16 gradient back
    # to fp32, (4 + A) bytes per weight each way, at copy's rate; FP8 layers quantize from the
    # fp32 weight, so under FP8 only the bf16 head pays them
    blocks = 2 * (D * (D + 2 * KV + D) + 3 * D * F)
    head = SHAPE.vocab_size * D
    bf16 = _estimate("none", copy=True)
    assert bf16.compute["weight_cast"] == pytest.approx(2 * (4 + A) * (blocks + head) / COPY_RATE)
    fp8 = _estimate("tensorwise", copy=True)
    assert fp8.compute["weight_cast"] == pytest.approx(2 * (4 + A) * head / COPY_RATE)


def test_cross_entropy_charges_one_read_forward_and_a_read_and_write_backward() -> None:
    # the fused kernel streams the bf16 logits once forward (online max and sum) and once
    # backward, writing their gradient: 3A bytes per logit in all, at copy's rate here
    ce = _estimate("none", copy=True).compute["cross_entropy"]
    assert ce == pytest.approx(3 * A * T * SHAPE.vocab_size / COPY_RATE)


def test_weights_are_quantized_once_per_step_with_each_recipes_reads() -> None:
    # optimizer time = AdamW + clip norm (same for every recipe) + the fp32 weights' quantization:
    # 4 bytes read per pass, FP8 w and wᵀ written (rowwise: + its FP8 byte transpose)
    params = 2 * (D * (D + 2 * KV + D) + 3 * D * F)
    weight_bytes = {"delayed": 4 + 2, "blockwise": 4 + 2, "tensorwise": 2 * 4 + 2,
                    "rowwise": 3 * 4 + 2 + 2}  # fmt: skip
    base = _estimate("delayed").optimizer_time - params * 6 * PER_BYTE / QUANTIZE_RATE
    for fp8, moved in weight_bytes.items():
        expected = base + params * moved * PER_BYTE / QUANTIZE_RATE
        assert _estimate(fp8).optimizer_time == pytest.approx(expected, rel=1e-9), fp8


def test_rowwise_converts_each_weight_gradient_to_fp32() -> None:
    # cuBLAS's rowwise GEMM writes bf16: 2 bytes read and 4 written per weight, per micro-batch
    linears = 2 * (D * (D + 2 * KV + D) + 3 * D * F)
    est = _estimate("rowwise", copy=True)
    assert est.compute["fp8_wgrad_convert"] == pytest.approx(6 * linears / COPY_RATE)
    assert "fp8_wgrad_convert" not in _estimate("tensorwise", copy=True).compute
    # rowwise's own wgrad entries timed mt_fp8.fp8_gemm with its fp32 output: the conversion
    # is inside their time, so it is not charged again
    wgrad = Entry("gemm_wgrad", "fp8_rowwise", (4096, 4096, 4096), 1e15)
    assert "fp8_wgrad_convert" not in _estimate("rowwise", copy=True, extra=(wgrad,)).compute


def test_selective_mlp_recompute_under_fp8_is_selective_recompute() -> None:
    for fp8 in ("tensorwise", "rowwise"):
        mlp, core = _estimate(fp8, "selective_mlp"), _estimate(fp8, "selective")
        assert mlp.compute["recompute"] == pytest.approx(core.compute["recompute"])
        assert mlp.memory["activations"] == pytest.approx(core.memory["activations"])
    mlp, core = _estimate("none", "selective_mlp"), _estimate("none", "selective")
    assert mlp.compute["recompute"] > core.compute["recompute"]
    assert mlp.memory["activations"] < core.memory["activations"]
