"""Multi-head latent attention on one CUDA GPU with DeepSeek-V3's head dims (nope 128, rope 64,
value 128; SDPA with a value head dim unlike the query/key one) and YaRN, under bf16 autocast,
against the float64 CPU layer. Skipped without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch

import mt_parallel as mp
from mt_parallel.mla import MultiLatentAttention
from mt_parallel.yarn import YarnConfig

pytestmark = pytest.mark.gpu


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.detach().double().cpu()
    return float((actual.detach().double().cpu() - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("q_lora_rank", [None, 384], ids=["no-q-lora", "q-lora"])
def test_mla_bf16_on_cuda_matches_fp64(q_lora_rank: int | None) -> None:
    yarn = YarnConfig(factor=40.0, original_max_position=256, mscale=1.0, mscale_all_dim=1.0)
    layer = MultiLatentAttention(
        512, 4, q_lora_rank, 256, 128, 64, 128, yarn=yarn, num_layers=2
    ).double()
    mp.init_weights(layer, seed=0)
    gpu = copy.deepcopy(layer).float().cuda()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 512, 512, generator=gen, dtype=torch.float64)
    positions = torch.arange(512) + 1000
    x_ref = x.clone().requires_grad_()
    y_ref = layer(x_ref, positions)
    y_ref.square().sum().backward()
    x_gpu = x.float().cuda().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = gpu(x_gpu, positions.cuda())
    y.float().square().sum().backward()
    # bf16 GEMM operands (8 mantissa bits, u = 2^-9 ≈ 2e-3) through ~4 GEMMs and a softmax:
    # a few times 2e-3 relative to the largest value; a wrong scale or RoPE order is O(1).
    assert _rel(y, y_ref) < 2e-2
    assert _rel(x_gpu.grad, x_ref.grad) < 3e-2
    assert _rel(gpu.kv_a_proj.weight.grad, layer.kv_a_proj.weight.grad) < 3e-2
