"""Multi-head latent attention at tp=2 on 2 gloo ranks against one process (one pool for the
module): heads split, compressed projections replicated, YaRN on; in float64, and in float32 with
sequence parallel (latents all-gathered along the sequence)."""

from __future__ import annotations

import mla_checks
import pytest
from parallel_tolerances import FP32_VS_FP64, FP64_VS_FP64, assert_close

from mt_comm.testing import DistributedPool


@pytest.fixture(scope="module")
def pool():
    with DistributedPool(world_size=2) as pool:
        yield pool


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
