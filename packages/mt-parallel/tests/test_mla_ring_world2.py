"""Multi-head latent attention under ring context parallelism (``cp_attention=ring``) on 2 gloo
ranks against one process: the ring passes the compressed latent ``[c ; RoPE(k_rot)]`` (C + R
values per token, counted at the p2p) and every rank expands each block it holds with ``kv_b``;
float64, with and without q-lora, on packed documents, with the core recomputed; FP8 in the
expansion: current scaling in the forward, the dgrad and wgrad GEMMs within the FP8 error model,
delayed scaling with ``kv_b``'s input amax agreed over cp (also in a decoder LM under FSDP2 as
the trainer runs it); the expansions in the caller's autocast and ``fp8_autocast`` regions in
both passes. cp=2 × tp=2 (every TP rank expands its heads from the same latent) is in the slow
tier."""

from __future__ import annotations

import mla_ring_checks
import pytest
import torch
from mla_checks import FP8_SHAPES, SHAPES
from parallel_tolerances import FP32_VS_FP64, FP64_VS_FP64, assert_close

from mt_comm.testing import DistributedPool, PoolCache
from mt_parallel.ring_attention import GRAD_TAG, KV_TAG


def check_latent_sends(result: dict, shapes: dict, recomputed: bool = False) -> None:
    """Assert (and drop from ``result``) what crossed the cp group: no floating-point
    collective, and at cp=2 exactly one latent block of the rank's tokens (``tokens·(C + R)``
    values; the expanded K/V would be ``tokens·heads/tp·(E + V)``) per p2p send: forward one
    block (twice with the core recomputed), backward the block again and its gradient on both
    hops home."""
    block = result.pop("tokens") * (shapes["kv_lora_rank"] + shapes["qk_rope_head_dim"])
    assert result.pop("cp") == 2
    assert result.pop("traffic") == {"all_gather": [], "reduce_scatter": []}
    forward = [(KV_TAG, block)] * (2 if recomputed else 1)
    assert result.pop("sends") == [*forward, (KV_TAG, block), (GRAD_TAG, block), (GRAD_TAG, block)]


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=2)


@pytest.mark.parametrize(
    "q_lora_rank,kernel,recompute",
    [(None, None, "none"), (10, None, "none"), (10, "explicit", "selective")],
    ids=["no-q-lora", "q-lora", "documents-recompute-core"],
)
def test_mla_ring_passes_the_latent_and_equals_one_process(
    pool: DistributedPool, q_lora_rank, kernel, recompute
) -> None:
    for result in pool.run(
        mla_ring_checks.ring_cp_parity, q_lora_rank=q_lora_rank, kernel=kernel, recompute=recompute
    ):
        check_latent_sends(result, SHAPES, recomputed=recompute != "none")
        # float64 both sides: the ring changes only summation order (blocks merged by
        # log-sum-exp, kv_b's weight gradient summed over ring steps and cp ranks, the latent
        # gradient summed around the ring), so FP64_VS_FP64 (1e-10) is a wide margin; a block
        # expanded with another rank's positions, a latent gradient not sent home or a kv_b
        # gradient dropped for a step is an O(1) error. With documents the reference runs
        # every document on its own.
        grads = {"kv_a_proj.weight", "kv_a_norm.weight", "kv_b_proj.weight", "o_proj.weight"}
        if q_lora_rank is not None:
            grads |= {"q_a_proj.weight", "q_a_norm.weight", "q_b_proj.weight"}
        assert set(result["grads"]) >= grads
        assert_close(result, FP64_VS_FP64)


@pytest.mark.slow
def test_mla_ring_cp2_tp2_equals_one_process(distributed_pools: PoolCache) -> None:
    pool = distributed_pools.get(world_size=4)
    for result in pool.run(mla_ring_checks.ring_cp_parity, tp=2, q_lora_rank=10, kernel="explicit"):
        # Both TP ranks of a cp group pass the same latent (C + R per token, not their heads'
        # K/V) and expand their own heads; FP64_VS_FP64 as above (a latent gradient not summed
        # over tp is an O(1) error).
        check_latent_sends(result, SHAPES)
        assert_close(result, FP64_VS_FP64)


def test_mla_ring_fp8_expansion(pool: DistributedPool) -> None:
    for result in pool.run(mla_ring_checks.ring_cp_parity, q_lora_rank=16, fp8_gemms=("forward",)):
        check_latent_sends(result, FP8_SHAPES)
        # kv_b's forward GEMM in FP8 (tensorwise current scaling, emulated), fp32 against the
        # same FP8 layer on one process. Each ring block is quantized with its own amax, the
        # one process with the whole sequence's, so an expanded K/V entry may land on the
        # neighbouring E4M3 value: up to E4M3's unit roundoff 2^-4 relative to the largest
        # entry, and the output and gradients (averages over keys) stay below it (observed
        # <= 0.04). A scale applied twice or a block quantized with no scale is O(1).
        assert_close(result, 2.0**-4)


def check_agreed_scales(ring: dict, one: dict) -> None:
    """The ring rank's delayed-scaling history and scales of ``kv_b``'s input and weight are
    the one process's (fp32 rounding apart: the same tensors' amaxes). Its output gradient's are
    its own partial share's (the mla module docstring), so they are not compared."""
    for key in ("history", "scale"):
        mine, theirs = ring[key][..., :2], one[key][..., :2]
        assert torch.allclose(mine, theirs, rtol=FP32_VS_FP64, atol=0), (key, mine, theirs)


@pytest.mark.parametrize(
    "recipe,gemms",
    [
        ("delayed", ("forward",)),
        ("delayed", ("forward", "dgrad", "wgrad")),
        ("tensorwise", ("dgrad", "wgrad")),
    ],
    ids=["delayed-forward", "delayed-all-gemms", "tensorwise-backward-gemms"],
)
def test_mla_ring_fp8_within_the_error_model(pool: DistributedPool, recipe, gemms) -> None:
    for result in pool.run(mla_ring_checks.ring_fp8_bounds, recipe, gemms):
        assert not result["saturated"]
        assert result["spike_holds_the_amax"]  # which only rank 0 expands whole
        # The compared forwards quantize alike: delayed scaling with one agreed scale (the
        # sequence's latent peaks at a token only rank 0 expands whole; without the agreement
        # rank 1's scale comes from a smaller amax and its K/V differ by E4M3 roundings), current
        # scaling with no FP8 forward GEMM. Both sides then run the same fp32 arithmetic in
        # another order: each is within fp32 rounding of exact (FP32_VS_FP64's reasoning), and
        # so is their difference.
        assert result["y"] < FP32_VS_FP64
        fp8_grads = {"kv_b_proj.weight"} if "wgrad" in gemms else set()
        if "dgrad" in gemms:
            fp8_grads |= {"kv_a_proj.weight", "kv_a_norm.weight"}
        else:
            assert result["x_grad"] < FP32_VS_FP64
        assert_close({k: v for k, v in result["grads"].items() if k not in fp8_grads}, FP32_VS_FP64)
        # The latent's and kv_b's weight gradients: every FP8 GEMM's error on both sides, summed
        # (parallel_checks.fp8_gemm_bound, from the formats' rounding and subnormal floor at
        # the scales used, in float64), bounds their difference; without FP8 backward GEMMs the
        # bound is fp32 rounding (1e-5 of the largest entry) alone.
        assert result["latent_grad_in_bound"] <= 1.0
        assert result["kv_b_grad_in_bound"] <= 1.0
        if recipe == "delayed":
            check_agreed_scales(result["metas"]["ring"], result["metas"]["one"])


@pytest.mark.parametrize(
    "region,fp8",
    [("autocast", False), ("autocast", True), ("fp8_off", True)],
    ids=["bf16-autocast", "bf16-autocast-fp8", "fp8-autocast-off"],
)
def test_mla_ring_expands_in_the_callers_regions(pool: DistributedPool, region, fp8) -> None:
    for result in pool.run(mla_ring_checks.ring_regions, region, fp8):
        # The forward runs inside the region, the backward outside (the trainer's order). The
        # backward expands each block again as its forward did: same dtype and the same bits
        # (not FP8 under fp8_autocast(enabled=False); before, a bf16 block met kv_b's fp32
        # weight outside autocast and raised).
        assert result["expansions"] == 4  # cp=2 blocks in the forward, again in the backward
        dtype = torch.bfloat16 if region == "autocast" else torch.float32
        assert result["dtypes"] == [(dtype, dtype)] * 2
        assert result["same_bits"] == [True, True]
        # The block attention itself runs with autocast off: bf16 inputs give the same bits
        # under bf16 autocast as without.
        assert result["plain_ring_ignores_autocast"]


def test_mla_ring_fsdp_lm_delayed_fp8_equals_one_process(pool: DistributedPool) -> None:
    for result in pool.run(mla_ring_checks.ring_fsdp_lm):
        assert result.pop("fsdp")
        metas = result.pop("metas")
        for ring, one in zip(metas["ring"], metas["one"], strict=True):
            check_agreed_scales(ring, one)
        # The trainer's path (parallelize, FSDP2, scales updated over TP only): with kv_b's
        # input amax agreed over cp, both forwards quantize alike and everything else is fp32
        # in another order (FP32_VS_FP64's reasoning); the first block's latent peaks at a token
        # only rank 0 expands whole, so without the agreement rank 1's K/V differ by E4M3
        # roundings.
        assert_close(result, FP32_VS_FP64)
