"""A 2-layer MLP trained with each recipe ends within 2% of the bf16 run's held-out loss.

The default tier trains 50 steps (the held-out loss falls by more than 10%, which the test
checks); the full tier (``slow``, ``nox -s tests-full``) trains 200 steps. Both compare every
recipe with one shared bf16 run of the same length.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from torch import nn

from mt_fp8 import (
    BlockScaling,
    DelayedScaling,
    FP8Linear,
    MXFP8Scaling,
    RowwiseScaling,
    TensorwiseScaling,
    convert_to_fp8,
    update_fp8_scales,
)

SHORT_STEPS, STEPS, BATCH, DIM, HIDDEN, CLASSES, HELD_OUT = 50, 200, 128, 128, 256, 128, 2048
RECIPES = [DelayedScaling(), TensorwiseScaling(), RowwiseScaling(), BlockScaling(), MXFP8Scaling()]


@functools.cache
def make_data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * BATCH + HELD_OUT, DIM, generator=generator)
    teacher = torch.randn(DIM, CLASSES, generator=generator) / DIM**0.5 * 3
    # Labels sampled from the teacher's softmax: the loss floor is the (nonzero) label entropy,
    # so the comparison is not of two numbers near zero.
    labels = torch.multinomial(torch.softmax(x @ teacher, -1), 1, generator=generator).squeeze(1)
    return x, labels


def train(recipe, steps: int) -> float:
    """Held-out loss after ``steps`` fresh batches (no sample is seen twice)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, CLASSES))
    if recipe is not None:
        converted = convert_to_fp8(model, recipe)
        assert converted == ["0", "2"]  # both layers run in FP8 with every recipe
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, labels = make_data()
    for step in range(steps):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x[rows]).float(), labels[rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if isinstance(recipe, DelayedScaling):
            update_fp8_scales(model, recipe)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        held_out = slice(STEPS * BATCH, None)
        return nn.functional.cross_entropy(model(x[held_out]).float(), labels[held_out]).item()


@functools.cache
def bf16_loss(steps: int) -> float:
    """The shared bf16 reference run of ``steps`` steps."""
    return train(None, steps)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_mlp_short_run_within_two_percent_of_bf16(recipe):
    reference = bf16_loss(SHORT_STEPS)
    assert reference < 0.9 * train(None, 0)  # the short run learns: the comparison means something
    fp8_loss = train(recipe, SHORT_STEPS)
    assert abs(fp8_loss - reference) <= 0.02 * reference, (fp8_loss, reference)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_mlp_loss_within_two_percent_of_bf16(recipe):
    reference = bf16_loss(STEPS)
    fp8_loss = train(recipe, STEPS)
    assert abs(fp8_loss - reference) <= 0.02 * reference, (fp8_loss, reference)


def test_convert_skips_small_layers_with_a_logged_reason(caplog):
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 10), nn.Linear(10, 64))
    weight = model[0].weight
    with caplog.at_level(logging.INFO, logger="mt_fp8"):
        converted = convert_to_fp8(
            model, TensorwiseScaling(), module_filter=lambda name, _: name != "2"
        )
    assert converted == ["0"]
    assert isinstance(model[0], FP8Linear) and model[0].weight is weight
    assert "keeping 1 in high precision: in_features=48 and out_features=10" in caplog.text
    assert "keeping 2 in high precision (module_filter)" in caplog.text
