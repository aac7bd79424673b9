"""``benchmarks/vlm_throughput.py`` on the CPU at toy sizes: every stack runs, the encoder share
is a fraction of the step, and the plain-PyTorch reference is the same model as mt's (same
initial weights, same first loss in fp32)."""

from __future__ import annotations

import pytest
import vlm_throughput


def test_smoke_runs_every_stack_and_the_reference_is_the_same_model() -> None:
    rows = vlm_throughput.main(
        ["--tiny", "--no-compile", "--device", "cpu", "--vision-layers", "2", "--text-layers", "2"]
    )
    by_stack = {row["stack"]: row for row in rows}
    assert set(by_stack) == {"reference", "mt_bf16", "mt_fp8"}
    for row in rows:
        # One CPU repetition each on a shared machine: the share is a fraction, loosely.
        assert row["tokens_per_s"] > 0 and 0 < row["encoder_share"] < 1.5
    # fp32 on both sides from the same weights: the first losses differ only by op order
    # (fused RMSNorm/RoPE vs PyTorch's), ulps of a loss of ~6.
    assert by_stack["reference"]["first_loss"] == pytest.approx(
        by_stack["mt_bf16"]["first_loss"], rel=1e-5
    )
    # FP8 (tensorwise, E4M3 forward) moves the first loss by well under 1% at this size.
    assert by_stack["mt_fp8"]["first_loss"] == pytest.approx(
        by_stack["mt_bf16"]["first_loss"], rel=1e-2
    )


def test_a_graphed_stack_needs_cuda() -> None:
    with pytest.raises(SystemExit, match="'mt_bf16_graphed' captures a CUDA graph"):
        vlm_throughput.main(["--tiny", "--device", "cpu", "--stacks", "mt_bf16_graphed"])
