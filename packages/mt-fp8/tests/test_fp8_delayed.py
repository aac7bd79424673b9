"""Delayed scaling: amax history update, current scales until the first update, state-dict round
trip. Its amax reduction over 2 gloo ranks is tested in test_fp8_amax_reduction.py, in that
module's spawn (one start of two ranks for both)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from mt_fp8 import (
    DelayedScaling,
    FP8Format,
    FP8Linear,
    TensorRole,
    TensorwiseScaling,
    scale_from_amax,
    update_fp8_scales,
)
from mt_fp8.state import FP8Meta

E4M3_MAX, E5M2_MAX = FP8Format.E4M3.max, FP8Format.E5M2.max
FP32_MAX = torch.finfo(torch.float32).max


def step(layer: FP8Linear, x: torch.Tensor, dy: torch.Tensor) -> None:
    layer(x).backward(dy)


def test_history_update_max_most_recent_and_margin():
    torch.manual_seed(0)
    for algo, margin in (("max", 0), ("most_recent", 2)):
        recipe = DelayedScaling(amax_history_len=3, amax_compute_algo=algo, margin=margin)
        layer = FP8Linear(64, 32, recipe=recipe, bias=False)
        w_amax = layer.weight.detach().abs().max()
        amaxes = []
        for scale in (4.0, 1.0):
            x = torch.randn(16, 64) * scale
            dy = torch.randn(16, 32) * scale
            step(layer, x, dy)
            history_row = layer.fp8_meta.amax_history[0].clone()
            assert torch.equal(history_row, torch.stack([x.abs().max(), w_amax, dy.abs().max()]))
            update_fp8_scales(layer, recipe)
            amaxes.append(history_row)
            # Rolled: previous step moves to row 1, row 0 is cleared for the next step.
            assert torch.equal(layer.fp8_meta.amax_history[1], history_row)
            assert torch.equal(layer.fp8_meta.amax_history[0], torch.zeros(3))
        used = torch.maximum(*amaxes) if algo == "max" else amaxes[-1]
        fmt_max = torch.tensor([E4M3_MAX, E4M3_MAX, E5M2_MAX])
        assert torch.allclose(layer.fp8_meta.scale, used * 2.0**margin / fmt_max, rtol=1e-6)


def test_history_and_scales_round_trip_through_state_dict():
    recipe = DelayedScaling(amax_history_len=4)
    layer = FP8Linear(64, 32, recipe=recipe)
    for _ in range(2):
        step(layer, torch.randn(16, 64), torch.randn(16, 32))
        update_fp8_scales(layer, recipe)
    state = layer.state_dict()
    assert set(state) == {"weight", "bias", "fp8_meta.amax_history", "fp8_meta.scale"}
    assert all(isinstance(v, torch.Tensor) for v in state.values())  # safetensors-friendly
    restored = FP8Linear(64, 32, recipe=recipe)
    restored.load_state_dict(state)
    assert torch.equal(restored.fp8_meta.amax_history, layer.fp8_meta.amax_history)
    assert torch.equal(restored.fp8_meta.scale, layer.fp8_meta.scale)
    x = torch.randn(16, 64)
    assert torch.equal(restored(x), layer(x))


def test_first_step_quantizes_with_current_scales():
    # Before any update the scales are the initial 1s: E5M2 with s = 1 flushes every gradient
    # below 2^-16 to zero, and a first step's output gradients (about 1/tokens) mostly are.
    # Until its first update a delayed layer therefore scales as tensorwise does, bit for bit.
    torch.manual_seed(0)
    delayed = FP8Linear(64, 32, recipe=DelayedScaling(amax_history_len=4), bias=False)
    current = FP8Linear(64, 32, recipe=TensorwiseScaling(), bias=False)
    current.load_state_dict({"weight": delayed.weight.detach().clone()}, strict=False)
    x = torch.randn(16, 64)
    dy = torch.randn(16, 32) * 1e-7  # every value below E5M2's smallest subnormal at s = 1
    grads = []
    for layer in (delayed, current):
        x_in = x.clone().requires_grad_()
        y = layer(x_in)
        y.backward(dy)
        grads.append((y.detach(), x_in.grad, layer.weight.grad))
    assert not delayed.fp8_meta.scales_ready
    for got, want in zip(grads[0], grads[1], strict=True):
        assert torch.equal(got, want)
    x_grad = grads[0][1]
    reference = dy.double() @ delayed.weight.detach().double()
    # E5M2 dy (2 mantissa bits: relative rounding <= 2^-3) times E4M3 w (<= 2^-4), summed
    # over 32 outputs: the error stays well inside 0.25 of the reference's largest value,
    # while the flushed gradient of s = 1 would be zero (error 1.0).
    assert (x_grad.double() - reference).abs().max() <= 0.25 * reference.abs().max()
    update_fp8_scales(delayed, delayed.recipe)
    assert delayed.fp8_meta.scales_ready  # from now on the history's scales


def test_loading_recorded_history_uses_its_scales():
    recipe = DelayedScaling(amax_history_len=4)
    trained = FP8Linear(64, 32, recipe=recipe)
    step(trained, torch.randn(16, 64), torch.randn(16, 32))
    update_fp8_scales(trained, recipe)
    fresh = FP8Linear(64, 32, recipe=recipe)
    restored = FP8Linear(64, 32, recipe=recipe)
    restored.load_state_dict(trained.state_dict())
    assert restored.fp8_meta.scales_ready
    restored.load_state_dict(fresh.state_dict())  # an untouched history: nothing recorded yet
    assert not restored.fp8_meta.scales_ready


def update_layer_by_layer(metas: list[FP8Meta], recipe: DelayedScaling) -> None:
    """The delayed-scaling update written out for one layer at a time (the reference)."""
    fmt_max = torch.tensor([recipe.formats.for_role(role).max for role in TensorRole])
    for meta in metas:
        history = meta.amax_history
        usable = torch.where(torch.isfinite(history), history, torch.zeros_like(history))
        amax = usable.amax(dim=0) if recipe.amax_compute_algo == "max" else usable[0]
        new_scale = scale_from_amax(amax, fmt_max, margin=recipe.margin)
        meta.scale.copy_(torch.where(amax > 0, new_scale, meta.scale))
        meta.amax_history.copy_(torch.roll(history, 1, dims=0))
        meta.amax_history[0].zero_()


def random_metas(seed: int, device: str) -> nn.ModuleList:
    """FP8Metas of three history lengths with amaxes over fp32's whole range, inf, NaN and 0."""
    generator = torch.Generator().manual_seed(seed)
    metas = nn.ModuleList()
    for length in (4, 1, 4, 7, 4, 1):
        meta = FP8Meta(DelayedScaling(amax_history_len=length), device=device)
        exponent = torch.randint(-149, 128, (length, 3), generator=generator).float()
        history = torch.exp2(exponent) * (1 + torch.rand(length, 3, generator=generator))
        special = torch.tensor([0.0, math.inf, math.nan, FP32_MAX, 2.0**-149, -math.inf])
        pick = torch.randint(0, 2 * len(special), (length, 3), generator=generator)
        history = torch.where(
            pick < len(special), special[pick.clamp(max=len(special) - 1)], history
        )
        meta.amax_history.copy_(history)
        meta.scale.copy_(torch.rand(3, generator=generator) + 0.5)
        metas.append(meta)
    # A role whose whole window is unusable (zero or non-finite) keeps its old scale.
    metas[2].amax_history[:, 1] = torch.tensor([0.0, math.nan, math.inf, 0.0])
    return metas


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("margin", [0, 3])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_batched_update_is_bitwise_the_layer_by_layer_update(algo, margin, device):
    recipe = DelayedScaling(amax_compute_algo=algo, margin=margin)
    batched, reference = random_metas(margin, device), random_metas(margin, device)
    for _ in range(3):  # the rolled histories feed the next update
        versions = [meta.scale_version for meta in batched]
        update_fp8_scales(batched, recipe)
        update_layer_by_layer(list(reference), recipe)
        for meta, expected in zip(batched, reference, strict=True):
            # int32 views: bitwise, NaN included.
            assert torch.equal(meta.scale.view(torch.int32), expected.scale.view(torch.int32))
            assert torch.equal(
                meta.amax_history.view(torch.int32), expected.amax_history.view(torch.int32)
            )
        assert [meta.scale_version for meta in batched] == [v + 1 for v in versions]
        # New amaxes for the next step, as FP8 layers would record them.
        for meta, expected in zip(batched, reference, strict=True):
            row = torch.rand(3) * 100
            meta.amax_history[0] = row
            expected.amax_history[0] = row
