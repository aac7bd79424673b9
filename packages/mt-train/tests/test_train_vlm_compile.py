"""The CLIP encoder block compiled with FP8 linears: how many graphs it splits into.

``mt_fp8.FP8Linear`` runs eagerly behind a graph break inside compiled blocks, so a compiled
block is a sequence of graphs, each a compiled call in the forward and another in the
backward; the encoder of a VLM is small enough per image (577 tokens for CLIP ViT-L/14-336)
that these calls, not its kernels, set its time. A block must split only where its own code
computes between two linears, whatever its token count and however its linears are biased."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import mt_parallel
from mt_train.models.vlm.config import VisionConfig
from mt_train.models.vlm.vision import VisionBlock

SEGMENTS_BETWEEN_FP8_LINEARS = (
    "norm1",
    "head views, attention, head merge",
    "residual add, norm2",
    "activation",
    "residual add",
)
"""The code of :class:`VisionBlock` that computes before, between and after its six linears
(q, k, v, o, fc1, fc2): one graph each."""


@pytest.mark.parametrize("tokens", [577, 576], ids=["cls_token", "patches_only"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_compiled_vision_block_splits_only_between_its_fp8_linears(tokens: int, fp8: bool) -> None:
    torch.manual_seed(0)
    cfg = VisionConfig(image_size=336, patch_size=14, channels=3, dim=32, n_heads=2, ffn_dim=64)
    block = VisionBlock(cfg, init_std=0.02)
    if fp8:
        mt_parallel.apply_fp8(block)
    eager = copy.deepcopy(block)
    counter = CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=counter)
    x = torch.randn(1, tokens, cfg.dim)
    for _ in range(2):  # the second pass reuses the graphs of the first
        with torch.autocast("cpu", torch.bfloat16):
            y = compiled(x)
        y.float().square().mean().backward()
    torch._dynamo.reset()
    assert counter.frame_count == (len(SEGMENTS_BETWEEN_FP8_LINEARS) if fp8 else 1)
    # The counting backend runs the captured graphs as traced: eager's ops, eager's bits.
    with torch.autocast("cpu", torch.bfloat16):
        y_eager = eager(x)
    y_eager.float().square().mean().backward()
    assert torch.equal(y, y_eager)
    for ours, theirs in zip(block.parameters(), eager.parameters(), strict=True):
        assert torch.equal(ours.grad, 2 * theirs.grad)
