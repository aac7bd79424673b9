"""mt-parallel on 4 gloo ranks (a pool shared across modules): tp=4 layers, cp=4 attention, the
block at dp=2×tp=2, ZeRO-1 with TP and in bf16, clipping with DDP, document masking at cp=4 and
at cp=2×tp=2 with SP."""

from __future__ import annotations

import parallel_checks as checks
import pytest
import sequence_checks
from parallel_tolerances import FP64_VS_FP64, assert_close

from mt_comm.testing import DistributedPool, PoolCache


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=4)


@pytest.mark.parametrize("sp", [False, True], ids=["tp4", "tp4-sp"])
def test_tp_layers_and_vocab_parallel_ce(pool: DistributedPool, sp: bool) -> None:
    for result in pool.run(checks.tp_layers, sp=sp):
        assert result["init"] == 0.0
        assert_close(result)


def test_cp_attention_cp4(pool: DistributedPool) -> None:
    for result in pool.run(checks.cp_attention):
        assert_close(result)


def test_decoder_block_dp2_tp2(pool: DistributedPool) -> None:
    for result in pool.run(checks.decoder_lm, dp=2, tp=2):
        assert_close(result)


def test_distributed_optimizer_with_tp(pool: DistributedPool) -> None:
    for result in pool.run(checks.zero1_steps, steps=3, tp=2):
        assert result["clipped"]
        assert result["params"] < FP64_VS_FP64
        assert max(result["norms"]) < FP64_VS_FP64


def test_distributed_optimizer_bf16_params_fp32_master(pool: DistributedPool) -> None:
    for result in pool.run(checks.zero1_steps, steps=3, dtype="bfloat16"):
        assert (result["param_dtype"], result["master_dtype"]) == (
            "torch.bfloat16",
            "torch.float32",
        )
        assert result["master_numel"] * 4 >= result["total_numel"]
        assert result["params_are_cast_masters"]
        # The algorithm is checked exactly in fp64 above; in bf16, AdamW's g/√v turns the
        # gradients' bf16 rounding (u = 2⁻⁹) into O(lr) differences for near-zero gradients, so
        # the trajectories may differ by up to ~lr per step, plus the bf16 rounding of the start.
        bound = 2.0**-8 * result["max_param"] + 2 * 3 * result["lr"]
        assert result["abs_err"] < bound
        assert max(result["norms"]) < 2e-2  # the global norm itself: a bf16-rounded sum


def test_global_norm_clipping_dp2_tp2(pool: DistributedPool) -> None:
    for result in pool.run(checks.clip_norm, tp=2, dp=2):
        assert result["clipped"]
        assert_close(result)


def test_fsdp2_composes_with_tp_dp2_tp2(pool: DistributedPool) -> None:
    for result in pool.run(checks.clip_norm, tp=2, dp=2, data_parallel="fsdp"):
        assert result["clipped"]
        assert_close(result)


def test_cp_attention_with_documents_cp4(pool: DistributedPool) -> None:
    for result in pool.run(sequence_checks.cp_attention_documents):
        assert_close(result)


@pytest.mark.parametrize("kernel", ["explicit", "flex"])
def test_decoder_block_with_documents_cp2_tp2_sp(pool: DistributedPool, kernel: str) -> None:
    for result in pool.run(
        sequence_checks.decoder_lm_documents, cp=2, tp=2, sp=True, kernel=kernel
    ):
        assert_close(result)


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_ring_attention_cp4_equals_all_gather(pool: DistributedPool, documents: bool) -> None:
    for result in pool.run(sequence_checks.ring_attention, documents=documents):
        assert_close(result)
