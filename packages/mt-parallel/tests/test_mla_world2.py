"""Multi-head latent attention on 2 gloo ranks against one process (the shared 2-rank pool),
YaRN on. tp=2: heads split, compressed projections replicated; in float64, and in float32 with
sequence parallel (latents all-gathered along the sequence). cp=2: the all-gather path moves
the compressed latent (counted) and expands it on each rank, in float64, with document masking
(both kernels) and with FP8 in the expansion; ring attention, which passes the latent around
the ring, is test_mla_ring_world2.py. cp=2 × tp=2 (with and without SP) is test_mla_world4.py
(slow)."""

from __future__ import annotations

import mla_checks
import pytest
from mla_checks import FP8_SHAPES, SHAPES
from parallel_tolerances import FP32_VS_FP64, FP64_VS_FP64, assert_close

from mt_comm.testing import DistributedPool, PoolCache


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=2)


@pytest.mark.parametrize("q_lora_rank", [None, 10], ids=["no-q-lora", "q-lora"])
def test_mla_tensor_parallel_equals_one_process(pool: DistributedPool, q_lora_rank) -> None:
    for result in pool.run(mla_checks.tp_parity, tp=2, q_lora_rank=q_lora_rank):
        # The replicated q_a/kv_a weights and the input need the TP sum of their gradients
        # (a missing reduction is an O(1) error; FP64_VS_FP64 is 1e-10).
        assert set(result["grads"]) >= {"kv_a_proj.weight", "kv_b_proj.weight", "o_proj.weight"}
        assert_close(result, FP64_VS_FP64)


@pytest.mark.parametrize("q_lora_rank", [None, 10], ids=["no-q-lora", "q-lora"])
def test_mla_sequence_parallel_equals_one_process_and_tp(pool: DistributedPool, q_lora_rank):
    for result in pool.run(mla_checks.sp_parity, tp=2, q_lora_rank=q_lora_rank):
        # fp32 against fp64 and against fp32 tp=2 without SP: FP32_VS_FP64 (1e-5) is fp32
        # rounding of these O(1) sums; an unsummed gradient of the replicated q_a/kv_a/latent
        # norm weights (each rank sees half the tokens), a wrong token slice or a missing
        # reduce-scatter of the latents' gradient is an O(1) error.
        replicated = {"kv_a_proj.weight", "kv_a_norm.weight"}
        if q_lora_rank is not None:
            replicated |= {"q_a_proj.weight", "q_a_norm.weight"}
        assert set(result["grads"]) >= replicated | {"kv_b_proj.weight", "o_proj.weight"}
        assert_close(result, FP32_VS_FP64)


@pytest.mark.parametrize("q_lora_rank", [None, 16], ids=["no-q-lora", "q-lora"])
def test_mla_sequence_parallel_fp8_equals_fp8_on_one_process(pool: DistributedPool, q_lora_rank):
    for result in pool.run(mla_checks.fp8_sp_parity, tp=2, q_lora_rank=q_lora_rank):
        assert result.pop("fp8"), "the replicated compressions did not run in FP8"
        # The sharded tensors' amaxes (the replicated compressions' sequence-shard inputs and
        # output gradients included) are reduced over TP, so every rank quantizes with the
        # one-process scales and SP changes only the fp32 summation order (FP32_VS_FP64); a
        # rank-local scale moves values by an FP8 step (2^-4 relative, E4M3).
        assert_close(result, FP32_VS_FP64)


@pytest.mark.parametrize("q_lora_rank", [None, 10], ids=["no-q-lora", "q-lora"])
def test_mla_context_parallel_gathers_the_latent_and_equals_one_process(
    pool: DistributedPool, q_lora_rank
) -> None:
    for result in pool.run(mla_checks.cp_parity, q_lora_rank=q_lora_rank):
        mla_checks.check_latent_traffic(result, SHAPES)
        # float64 against float64: cp=2 changes only summation order (the reduce-scattered
        # latent gradient, kv_b's weight gradient summed over the cp ranks' query shares), so
        # FP64_VS_FP64 (1e-10) is a wide margin; a latent gradient kept unsummed, a key rotated
        # at a wrong position or chunks out of order are O(1) errors.
        assert set(result["grads"]) >= {"kv_a_proj.weight", "kv_b_proj.weight", "o_proj.weight"}
        assert_close(result, FP64_VS_FP64)


@pytest.mark.parametrize(
    "kernel,recompute",
    [("explicit", "none"), ("flex", "none"), ("explicit", "selective")],
    ids=["explicit", "flex", "explicit-recompute-core"],
)
def test_mla_context_parallel_with_document_masking(
    pool: DistributedPool, kernel: str, recompute: str
) -> None:
    for result in pool.run(
        mla_checks.cp_parity, q_lora_rank=10, kernel=kernel, recompute=recompute
    ):
        # Against every document run on its own. The document ids (integers) are gathered
        # besides the latent, the keys' documents ordered like the gathered latent; with the
        # core recomputed the latent is still gathered once (outside the core, whose
        # checkpoint keeps the gathered K/V). FP64_VS_FP64 as above (a query seeing another
        # document's keys is an O(1) error).
        mla_checks.check_latent_traffic(result, SHAPES)
        assert_close(result, FP64_VS_FP64)


@pytest.mark.parametrize("all_gemms", [False, True], ids=["fp8-forward", "fp8-all-gemms"])
def test_mla_context_parallel_fp8_expansion(pool: DistributedPool, all_gemms: bool) -> None:
    gemms = ("forward", "dgrad", "wgrad") if all_gemms else ("forward",)
    for result in pool.run(mla_checks.cp_parity, q_lora_rank=16, fp8_gemms=gemms):
        mla_checks.check_latent_traffic(result, FP8_SHAPES)
        # kv_b_proj in FP8 (tensorwise current scaling, emulated) on both sides, fp32. Its
        # input is the gathered latent of the whole sequence, so its amax and every FP8 byte
        # are the one process's: the output (and, with FP8 only in the forward GEMM, every
        # gradient) differs by fp32 rounding alone (FP32_VS_FP64), unless an input lies within
        # that rounding of an FP8 rounding boundary; a rank-local scale moves values by an FP8
        # step (2^-4 relative).
        if all_gemms:
            # kv_b's output gradient on a cp rank is its queries' share of every key's
            # gradient, quantized to E5M2 (2 mantissa bits) with that rank's scale before the
            # cp sum, so what flows back through kv_b (the latent's, kv_a's and the input's
            # gradients, kv_b's weight gradient) is rounded differently from the one
            # process's (observed ~0.1 relative). The rest depends on the forward only.
            for name in ("kv_a_proj.weight", "kv_a_norm.weight", "kv_b_proj.weight"):
                result["grads"].pop(name)
            result.pop("x_grad")
        assert_close(result, FP32_VS_FP64)
