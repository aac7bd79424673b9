"""Multi-head latent attention under ring context parallelism (``cp_attention=ring``) on 2 gloo
ranks against one process: the ring passes the compressed latent ``[c ; RoPE(k_rot)]`` (C + R
values per token, counted at the p2p) and every rank expands each block it holds with ``kv_b``;
float64, with and without q-lora, on packed documents, with the core recomputed; FP8 in the
expansion. cp=2 × tp=2 (every TP rank expands its heads from the same latent) is in the slow
tier."""

from __future__ import annotations

import mla_ring_checks
import pytest
from mla_checks import FP8_SHAPES, SHAPES
from parallel_tolerances import FP64_VS_FP64, assert_close

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
