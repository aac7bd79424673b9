"""Expert parallelism under each data-parallel mode on 4 gloo ranks (ep=2, dp=4: each expert
is held by an expert-data-parallel group of 2 ranks), in float64 against one process and
against each other: ``ddp``, ``fsdp`` (experts sharded over the edp mesh) and ``zero1`` (the
experts' optimizer state sharded over edp) reach the same parameters and gradient norms after
clipped AdamW steps with gradient accumulation, also when FSDP2 shards the experts along dim 1
(fewer local experts than edp ranks, at ep=2 and at ep=1), when it cannot split them evenly
along dim 0, or the edp group has one rank (ep = dp), and at tp=2 with sequence parallel
(dp=2, ep=2, edp=1: the experts' gradients must also be summed over TP under every mode, once
per step, not once per micro-batch). The reduced expert gradients of every step are checked
too. FP8 experts (``mt_fp8.FP8GroupedLinear``, tensorwise and rowwise) sharded along dim 1
train as the same FP8 model on one process, their FP8 weights quantized from whole experts.
A pool shared across modules."""

from __future__ import annotations

import moe_data_parallel_checks
import pytest
from parallel_checks import rel_err

from mt_comm.testing import PoolCache
from mt_parallel.data_parallel import expert_shard_dim

# Both sides in float64 with the same experts, tokens and order of micro-batches; only the
# order of the terms of each gradient sum (rows inside the grouped GEMMs, the ranks in a
# collective, AdamW's elementwise math is identical) differs: a few ulps of 1.1e-16, which
# three AdamW steps move by a few more (lr·(g/√v) is smooth in g away from g = 0). 1e-12
# stays far below a wrong expert scaling: dividing the expert gradients by edp = 2 instead of
# dp = 4 (FSDP2's default average, or ZeRO-1's) was measured to move the norms by 2e-5 and the
# parameters by 5e-6 relative (AdamW is nearly scale-free per element, so the change comes
# through the clip coefficient), as do a missing reduction or a gradient counted twice.
FP64_BOUND = 1e-12
# mp.clip_grad_norm_ sums in float64 but returns the norm as float32 (ZeRO-1 returns it in the
# master dtype): one rounding, relative error ≤ 2⁻²⁴ ≈ 6e-8, on top of the fp64 ulps.
NORM_BOUND = 2**-23
MODES = ("ddp", "fsdp", "zero1")
FP8_RECIPES = ("tensorwise", "rowwise")
"""The FP8 experts' recipe in each of the two blocks: both run on the CPU (emulated GEMMs)."""


def assert_one_expert_tp_sum_per_step(result: dict, mode: str) -> None:
    """Under sequence parallel exactly one all-reduce over TP carries expert gradients in each
    step (the micro-batches' backwards none): the local experts' whole gradients under ``ddp``
    (and ``fsdp`` with a one-rank edp group, which leaves them to the same path), this rank's
    1/edp shard of them under ``fsdp`` and ``zero1``, summed after the edp reduce-scatter."""
    share = result["expert_numel"] // (1 if mode == "ddp" else result["edp"])
    steps = moe_data_parallel_checks.STEPS
    assert result["expert_tp_all_reduces"] == [[share]] * steps, result["expert_tp_all_reduces"]


@pytest.fixture(scope="module")
def runs(distributed_pools: PoolCache) -> dict:
    pool = distributed_pools.get(world_size=4)
    out = {mode: pool.run(moe_data_parallel_checks.train_steps, mode=mode) for mode in MODES}
    # 2 experts over ep=2: one local expert for 2 edp ranks, so FSDP2 shards along dim 1
    out["fsdp-dim1"] = pool.run(moe_data_parallel_checks.train_steps, mode="fsdp", num_experts=2)
    # ep=1: the experts sit in the blocks' units over dp×cp = 4 ranks, 2 experts: dim 1 too
    out["fsdp-dim1-ep1"] = pool.run(
        moe_data_parallel_checks.train_steps, mode="fsdp", ep=1, num_experts=2
    )
    # 6 experts over ep=2: 3 local experts over 2 edp ranks, dim 0 unevenly (2 rows and 1)
    out["fsdp-uneven"] = pool.run(moe_data_parallel_checks.train_steps, mode="fsdp", num_experts=6)
    # FP8 experts at ep=1 sharded along dim 1: tensorwise scales in one block, rowwise in the
    # other; two steps, so the second quantizes weights the first AdamW step updated
    out["fsdp-dim1-ep1-fp8"] = pool.run(
        moe_data_parallel_checks.train_steps,
        mode="fsdp", ep=1, num_experts=2, fp8=FP8_RECIPES, steps=2,
    )  # fmt: skip
    # ep = dp = 4: edp groups of one rank (FSDP2 leaves the experts to DDP's reduction)
    out["fsdp-edp1"] = pool.run(moe_data_parallel_checks.train_steps, mode="fsdp", ep=4)
    for mode in MODES:
        out[f"{mode}-sp"] = pool.run(moe_data_parallel_checks.train_steps, mode=mode, tp=2)
    for fp8 in (False, True):
        out[f"ddp-reduced-fp8={fp8}"] = pool.run(
            moe_data_parallel_checks.ddp_reduced_expert_names, fp8
        )
    return out


SP_MODES = tuple(f"{mode}-sp" for mode in MODES)


FSDP_LAYOUTS = ("fsdp-dim1", "fsdp-dim1-ep1", "fsdp-uneven", "fsdp-edp1")


@pytest.mark.parametrize("mode", [*MODES, *FSDP_LAYOUTS, *SP_MODES])
def test_each_mode_equals_one_process(runs: dict, mode: str) -> None:
    for result in runs[mode]:
        assert any(result["clipped"]), result["clipped"]  # clipping is part of the check
        assert max(result["norms"]) < NORM_BOUND, result["norms"]
        assert max(result["params"].values()) < FP64_BOUND, result["params"]
        assert max(result["expert_grads"]) < FP64_BOUND, result["expert_grads"]


@pytest.mark.parametrize("mode", MODES)
def test_sequence_parallel_sums_expert_gradients_over_tp_once_per_step(
    runs: dict, mode: str
) -> None:
    for result in runs[f"{mode}-sp"]:
        assert_one_expert_tp_sum_per_step(result, mode)


@pytest.mark.parametrize("mode", ["fsdp", "zero1", "fsdp-sp", "zero1-sp"])
def test_sharded_modes_equal_ddp(runs: dict, mode: str) -> None:
    baseline = "ddp-sp" if mode.endswith("-sp") else "ddp"
    for ours, ddp in zip(runs[mode], runs[baseline], strict=True):
        for name, value in ddp["final"].items():
            assert rel_err(ours["final"][name], value) < FP64_BOUND, name


def _shards(runs: list[dict]) -> list[tuple]:
    """(FSDP2's shard dims, the local shape) of every rank's gate_proj weight."""
    return sorted((tuple(r["expert_shard_dims"]), tuple(r["expert_local_shape"])) for r in runs)


def test_experts_are_sharded_over_the_expert_data_parallel_group(runs: dict) -> None:
    # gate_proj [L, 16, 16]. 8 experts over ep=2: 4 per rank, split along dim 0 over 2 edp ranks.
    assert _shards(runs["ddp"]) == [((), (4, 16, 16))] * 4
    assert _shards(runs["fsdp"]) == [((0,), (2, 16, 16))] * 4
    # Fewer local experts than FSDP2 ranks: dim 1, an equal share on every rank (not one rank
    # holding the expert and the other an empty shard padded to a whole one).
    assert _shards(runs["fsdp-dim1"]) == [((1,), (1, 8, 16))] * 4
    assert _shards(runs["fsdp-dim1-ep1"]) == [((1,), (2, 4, 16))] * 4
    assert _shards(runs["fsdp-dim1-ep1-fp8"]) == [((1,), (2, 4, 16))] * 4
    assert _shards(runs["fsdp-uneven"]) == [((0,), (1, 16, 16))] * 2 + [((0,), (2, 16, 16))] * 2
    assert _shards(runs["fsdp-edp1"]) == [((), (2, 16, 16))] * 4  # 8 over ep=4, unsharded
    # ZeRO-1: the dense partition over dp×cp (4 ranks), the expert one over edp (2).
    assert {tuple(r["partition_groups"]) for r in runs["zero1"]} == {(4, 2)}


def test_fp8_experts_sharded_along_dim_1_equal_fp8_on_one_process(runs: dict) -> None:
    # ep=1: experts [2, 16, 16] over the 4 dp ranks, shards [2, 4, 16]. Each rank's FP8 GEMMs
    # quantize the rows the reference's call on that rank's tokens quantizes (at ep=2 the
    # all-to-all would put two ranks' tokens under one expert's tensorwise and column scales),
    # and the weight FSDP2 all-gathers is the reference's to fp64 ulps. Quantizing is a step
    # function: inputs that agree to fp64 ulps give the same FP8 bytes and fp32 scales unless
    # a value lies within ~1e-16 (relative) of a rounding boundary, a chance of order 1e-15 per
    # element; the rank's dy is the reference's times ranks = 4, a power of two, which scales
    # the scales exactly and leaves the bytes. Equal operands give equal (emulated, fp32)
    # GEMMs, so all that differs is the float64 rest: FP64_BOUND, as without FP8. The scales
    # are fp32 roundings of amaxes that agree to fp64 ulps: equal, or one fp32 ulp apart. A
    # scale taken from a dim-1 shard (a quarter of an expert's rows) misses the other rows'
    # maxima (tensorwise, rowwise wᵀ) or has another shape (rowwise w): far beyond that ulp.
    for result in runs["fsdp-dim1-ep1-fp8"]:
        assert result["fp8_weight_shapes"] == [(16, 16)]  # whole experts, never [4, 16] shards
        # FSDP2 re-materialises the unsharded weight with its version counter preserved, which
        # the weight cache keys on: every forward quantizes it afresh.
        assert result["fp8_weight_cached"] == [False]
        assert result["fp8_scales"] < 2**-23, result["fp8_scales"]  # one fp32 ulp
        assert any(result["clipped"]), result["clipped"]
        assert max(result["norms"]) < NORM_BOUND, result["norms"]
        assert max(result["params"].values()) < FP64_BOUND, result["params"]


@pytest.mark.parametrize("fp8", [False, True])
def test_ddp_never_reduces_an_expert_weight(runs: dict, fp8: bool) -> None:
    # The experts' gradients are summed over their edp group by reduce_expert_gradients; DDP
    # must not also average them over dp×cp, where other ranks hold other experts. An FP8
    # expert layer's second name for the weight (``..._fp8.weight``) once slipped through.
    assert runs[f"ddp-reduced-fp8={fp8}"] == [[]] * 4


def test_expert_shard_dim_follows_torchtitans_rule() -> None:
    # [L, N, K] over W ranks: dim 1 only when W > L (dim 0 would leave ranks without an
    # expert) and W divides N (FSDP2 refuses uneven shards on a non-zero dim).
    assert expert_shard_dim((4, 16, 8), 8) == 1  # DeepSeek-V3-like: 4 local experts, edp 8
    assert expert_shard_dim((4, 12, 8), 8) == 0  # 12 rows do not split over 8
    assert expert_shard_dim((4, 16, 8), 4) == 0  # one whole expert per rank
    assert expert_shard_dim((8, 16, 8), 2) == 0
