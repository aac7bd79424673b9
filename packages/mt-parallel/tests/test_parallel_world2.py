"""mt-parallel on 2 gloo ranks (a pool shared across modules): TP/SP, CE (and the whole sequence's
mean under CP), CP, block, DP, ZeRO-1, clipping, recompute, FP8, document masking, dropout
regions and bad input, each against a single-process fp64 reference."""

from __future__ import annotations

import parallel_checks as checks
import pytest
import sequence_checks
import torch
from parallel_tolerances import FP32_VS_FP64, FP64_VS_FP64, assert_close

from mt_comm.testing import DistributedPool, PoolCache


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=2)


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_tp_layers_and_vocab_parallel_ce(pool: DistributedPool, sp: bool) -> None:
    for result in pool.run(checks.tp_layers, sp=sp):
        assert result["init"] == 0.0  # same full weights at tp=1 and tp=2
        assert result["ce_vs_torch"] < FP64_VS_FP64
        assert_close(result)


def test_sequence_mean_ce_cp2(pool: DistributedPool) -> None:
    for result in pool.run(checks.cp_sequence_mean_ce):
        count, expected = result.pop("count")
        assert count == expected  # the cp group's unignored targets
        assert_close(result, FP64_VS_FP64)  # fp64 on both sides


def test_cp_attention_cp2(pool: DistributedPool) -> None:
    for result in pool.run(checks.cp_attention):
        assert_close(result)


@pytest.mark.parametrize(
    "degrees",
    [{"tp": 2, "sp": True}, {"cp": 2}, {"cp": 2, "cp_attention": "ring"}],
    ids=["tp2-sp", "cp2", "cp2-ring"],
)
def test_decoder_block(pool: DistributedPool, degrees: dict) -> None:
    for result in pool.run(checks.decoder_lm, **degrees):
        assert_close(result)


def test_dp_accumulation_equals_one_large_batch(pool: DistributedPool) -> None:
    for result in pool.run(checks.dp_accumulation, micro_batches=4):
        assert result["unreduced"], "gradients were reduced before the last micro-batch"
        assert_close(result)


def test_distributed_optimizer_matches_adamw(pool: DistributedPool) -> None:
    for result in pool.run(checks.zero1_steps, steps=3):
        assert result["clipped"]  # clipping is active, so it is tested too
        assert result["master_numel"] * 2 >= result["total_numel"] > result["master_numel"]
        assert result["params"] < FP64_VS_FP64
        assert max(result["norms"]) < FP64_VS_FP64


def test_global_norm_clipping_tp2_sp(pool: DistributedPool) -> None:
    for result in pool.run(checks.clip_norm, tp=2, sp=True):
        assert result["clipped"]
        assert_close(result)


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_recompute_changes_no_gradient_bit_under_tp_sp(pool: DistributedPool, policy: str) -> None:
    # Dropout on: the residual dropouts (SP shards) and the attention-probability dropout (head
    # shards) draw from the TP-offset tracker stream, which recompute must replay.
    results = pool.run(checks.recompute_bits, policy=policy, tp=2, sp=True)
    assert [r["identical"] for r in results] == [True, True], results


def test_dropout_masks_differ_on_shards_and_agree_on_replicas(pool: DistributedPool) -> None:
    first, second = pool.run(sequence_checks.dropout_masks)
    for result in (first, second):
        assert "needs mt_parallel.manual_seed" in result["unseeded"]
        assert not result["block_sharded_sp=False"] and result["block_sharded_sp=True"]
    for key in ("replicated_before", "replicated_after", "default_state"):
        assert torch.equal(first[key], second[key]), key
    for key in ("sharded", "sequence_parallel", "attention_output"):
        assert not torch.equal(first[key], second[key]), key
    for key in ("replicated_before", "sharded", "sequence_parallel"):
        assert 0.3 < first[key].float().mean() < 0.7, key  # p=0.5: a real mask


def test_cp_attention_with_documents_cp2(pool: DistributedPool) -> None:
    for result in pool.run(sequence_checks.cp_attention_documents):
        assert_close(result)


def test_decoder_block_with_documents_cp2(pool: DistributedPool) -> None:
    for result in pool.run(sequence_checks.decoder_lm_documents, cp=2):
        assert_close(result)


@pytest.mark.parametrize(
    "degrees", [{"tp": 2}, {"tp": 2, "sp": True}, {"cp": 2}], ids=["tp2", "tp2-sp", "cp2"]
)
def test_flex_document_masking_under_tp_and_cp(pool: DistributedPool, degrees: dict) -> None:
    for result in pool.run(sequence_checks.decoder_lm_documents, kernel="flex", **degrees):
        assert_close(result)


def test_fp8_under_tp_is_the_same_on_every_rank_and_within_the_fp8_bound(
    pool: DistributedPool,
) -> None:
    results = pool.run(checks.fp8_tp)
    for result in results:
        assert result["fp8"]
        for name in ("col", "row"):
            layer = result[name]
            assert layer["not_exact"], "the FP8 path did not run"
            for key in ("y", "dx", "dw"):
                assert layer[key] <= 1.0, (name, key, layer[key])  # fraction of the bound
            assert layer["db"] < FP32_VS_FP64  # bias gradients stay in high precision
            # Shared scales: TP differs from FP8 at tp=1 only by fp32 summation order.
            assert_close(layer["vs_tp1_fp8"])
    for name in ("col", "row"):
        for key in ("y_bytes", "dx_bytes"):
            assert torch.equal(results[0][name][key], results[1][name][key]), (name, key)
        for rank_result in results[1:]:
            assert torch.equal(
                rank_result["delayed_scales"][name], results[0]["delayed_scales"][name]
            )


def test_bad_input_is_named(pool: DistributedPool) -> None:
    messages = pool.run(checks.errors_at_tp2)[0]
    assert "tp=2 does not divide num_heads=3" in messages["heads"]
    assert "tp=2 does not divide num_kv_heads=1" in messages["kv_heads"]
    assert "tp=2 does not divide vocab_size=33" in messages["vocab"]
    assert "tp=2 does not divide vocab_size=33" in messages["vocab_layer"]
    assert "sequence length 6 to be divisible by 2·cp = 4" in messages["cp_sequence"]


def test_fsdp2_gradients_and_clipping_dp2(pool: DistributedPool) -> None:
    for result in pool.run(checks.clip_norm, tp=1, dp=2, data_parallel="fsdp"):
        assert result["clipped"]
        assert_close(result)


@pytest.mark.parametrize("value_dim", [8, 6], ids=["v8", "v6"])
def test_ring_flash_blocks_equal_the_plain_formulas(pool: DistributedPool, value_dim: int) -> None:
    """The ring's flash blocks (PyTorch's CPU flash kernel here; CUDA's on a GPU) against its
    plain fp64 formulas, GQA folded into the rows or expanded on the causal step, a value dim
    below the key dim padded: equal to fp64 rounding (1e-12: the same sums in another order).
    Each of the cp = 2 steps ran one flash block forward and one backward, on every rank."""
    for result in pool.run(sequence_checks.ring_flash_vs_plain, value_dim=value_dim):
        assert result["calls"] == {"forward": 2, "backward": 2}, result["calls"]
        assert all(e < 1e-12 for e in result["errors"].values()), result["errors"]


@pytest.mark.parametrize(
    ("documents", "value_dim"),
    [(False, 8), (False, 6), (True, 8), (True, 12)],
    ids=["causal", "causal-v6", "documents", "documents-mla-v12"],
)
def test_ring_attention_cp2_equals_all_gather(
    pool: DistributedPool, documents: bool, value_dim: int
) -> None:
    for result in pool.run(
        sequence_checks.ring_attention, documents=documents, value_dim=value_dim
    ):
        assert_close(result)
