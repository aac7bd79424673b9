"""``benchmarks/doc_masking.py`` on the CPU at toy sizes: every stack runs (FlexAttention's CPU
backward refusal lifted, as mt-parallel's tests do), and the two masked stacks compute the same
first loss while the unmasked one differs."""

from __future__ import annotations

import doc_masking
import pytest
import torch.nn.attention.flex_attention as flex


def test_smoke_runs_every_stack_and_the_masks_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flex, "_validate_device", lambda *tensors: None)
    rows = doc_masking.main(
        ["--smoke", "--layers", "1", "--doc-len", "16", "--modes", "eager", "--iters", "1",
         "--warmup", "0"]
    )  # fmt: skip
    steps = {row["stack"]: row for row in rows if row["kind"] == "step"}
    attention = {row["stack"]: row for row in rows if row["kind"] == "attention"}
    assert set(steps) == set(attention) == set(doc_masking.STACKS)
    assert steps["flex"]["documents"] >= 3  # 64 tokens in documents of 8..24
    for row in rows:
        assert row["ms"] > 0
    assert attention["flex"]["mask_ms"] > 0 and attention["unmasked"]["mask_ms"] is None
    assert steps["unmasked"]["overhead"] == 0
    # fp32 on the CPU, same weights and tokens: the masked stacks differ only by the attention's
    # summation order (~1e-7 relative on a loss of ~6); the unmasked loss sees other documents.
    assert steps["flex"]["first_loss"] == pytest.approx(steps["explicit"]["first_loss"], rel=1e-5)
    assert steps["unmasked"]["first_loss"] != pytest.approx(
        steps["explicit"]["first_loss"], rel=1e-5
    )
