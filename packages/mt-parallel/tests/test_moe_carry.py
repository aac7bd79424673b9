"""MoE auxiliary losses carried on activations (pipeline parallelism), on one process in
float64: two MoE layers whose losses are attached to their output with weight ``c`` give every
parameter the gradient of ``c·(y.sum() + Σ aux)``, the loss the pp=1 model backpropagates, and
the record sums what :func:`collect_aux_losses` reports."""

from __future__ import annotations

import pytest
import torch

from mt_parallel.moe import (
    AuxLossScale,
    MoE,
    MoEConfig,
    carry_aux_losses,
    collect_aux_losses,
    pipeline_aux_summary,
)

# Both sides run the same float64 operations; only the order in which autograd adds the
# auxiliary gradient to the router's differs (a few ulps of values of size ~1).
TOL = 1e-12
# fp32 records of a few sums of values of size <= 4: a few fp32 ulps.
FP32 = 1e-6


def two_layers() -> torch.nn.Sequential:
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=8, z_loss_coeff=1e-2)
    return torch.nn.Sequential(MoE(16, cfg), MoE(16, cfg)).double()


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_carried_losses_give_the_gradient_of_the_loss_they_join() -> None:
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    scale = 0.25
    model = two_layers()
    y = model(x)
    aux, logged = collect_aux_losses(model)
    assert aux is not None
    (scale * (y.sum() + aux)).backward()
    expected = grads(model)
    model.zero_grad()
    y = model(x)
    carried, record = carry_aux_losses(list(model), y, AuxLossScale(0, scale))
    (scale * carried.sum()).backward()
    carried.detach_()  # torch's split backward detaches stage outputs in place (not a view)
    assert set(grads(model)) == set(expected)
    for name, grad in grads(model).items():
        torch.testing.assert_close(grad, expected[name], rtol=TOL, atol=TOL)
    assert record is not None
    assert torch.allclose(record[0].double(), logged["moe_aux_loss"])
    assert torch.allclose(record[1].double(), logged["moe_z_loss"])
    assert all(not layer.aux_losses and layer.load_stats is None for layer in model)


def test_summary_of_two_chunks_equals_the_whole_model_report() -> None:
    """One rank holding both layers as two chunks reports what the pp=1 model does."""
    model = two_layers()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    records: list[dict[int, torch.Tensor]] = [{}, {}]
    expected = {"moe_aux_loss": 0.0, "moe_z_loss": 0.0, "moe_max_vio": 0.0, "moe_dropped": 0.0}
    factors = [1.0, 0.5]
    weighted = 0.0
    for m, factor in enumerate(factors):
        with torch.no_grad():
            model(x + m)
        aux, logged = collect_aux_losses(model)
        weighted += factor * float(aux)
        for name in expected:
            expected[name] += float(logged[name])
        with torch.no_grad():
            model(x + m)
        for chunk, layer in enumerate(model):
            _, record = carry_aux_losses([layer], x, AuxLossScale(m, factor / 2))
            assert record is not None
            records[chunk][m] = record
    total, summary = pipeline_aux_summary(records, factors, None, x.device)
    # The records are fp32 (logging precision): values agree to fp32 rounding.
    assert float(total) == pytest.approx(weighted, rel=FP32)
    assert {n: float(v) for n, v in summary.items()} == pytest.approx(expected, rel=FP32)
