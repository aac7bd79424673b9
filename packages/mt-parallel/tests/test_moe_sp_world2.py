"""MoE layers at tp=2 with sequence parallel on 2 gloo ranks against one process, in float64
(a pool shared across modules): each rank routes its half of every sequence; outputs, input and
parameter gradients (router, routed and shared experts), auxiliary losses, z-loss, load
statistics and the aux-loss-free bias equal the unsplit layer's on the whole sequences."""

from __future__ import annotations

import moe_checks
import pytest
from parallel_tolerances import assert_close

from mt_comm.testing import DistributedPool, PoolCache

# Both sides in float64 (same weights and tokens; only the order of the gradient sums and of
# the TP sums of the statistics differs): a few ulps of 1.1e-16. 1e-12 is far below what an
# unsummed router or expert gradient (each rank sees half the tokens: an O(1) error), a
# per-shard statistic (the aux loss of half a sequence) or a wrong token slice produces.
FP64_BOUND = 1e-12


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=2)


CASES = {
    "mixtral-softmax-aux-z": {"balancing": "aux_loss", "z_loss_coeff": 1e-2},
    "deepseek-sigmoid-seq-aux-shared": {
        "score_function": "sigmoid", "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
        "balancing": "seq_aux_loss", "n_shared_experts": 2,
    },
    "deepseek-sigmoid-aux-free-shared": {
        "score_function": "sigmoid", "n_group": 4, "topk_group": 2, "balancing": "aux_free",
        "n_shared_experts": 1, "z_loss_coeff": 1e-3,
    },
}  # fmt: skip


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_sequence_parallel_moe_equals_one_process(pool: DistributedPool, case: dict) -> None:
    for result in pool.run(moe_checks.sp_parity, tp=2, **case):
        assert result.pop("counts_equal") and result.pop("step_counts_equal")
        assert result.pop("bias_equal")
        assert result.pop("bias_moved") == (case["balancing"] == "aux_free")
        assert {"router.weight", "experts.gate_proj.weight"} <= set(result["grads"])
        assert {"moe_aux_loss", "moe_z_loss", "moe_max_vio"} <= set(result["stats"])
        losses = result.pop("losses")  # the values compared are not both zero
        assert (losses["moe_aux_loss"] > 0) == (case["balancing"] != "aux_free")
        assert (losses["moe_z_loss"] > 0) == ("z_loss_coeff" in case)
        assert_close(result, FP64_BOUND)


def test_deferred_router_gradient_is_summed_over_tp_once(pool: DistributedPool) -> None:
    """Under sequence parallel a deferred router weight gradient (zero-bubble pipelines) is
    summed over TP when the queue runs, not before: bit for bit the plain backward's, and one
    process's on the whole sequences (a second TP sum would double it)."""
    for result in pool.run(moe_checks.deferred_router_sp, tp=2):
        assert result["equal"] and not result["graded_before_w"] and result["queued"] == 1
        assert result["error"] < FP64_BOUND, result


def test_deferred_expert_gradients_are_summed_over_tp_once(pool: DistributedPool) -> None:
    """Under sequence parallel at ep = 1 the bf16/fp32 experts defer their weight gradients
    too: nothing before the queue runs, then the plain backward's gradients bit for bit (the
    queued work sums over TP in place of copy_to_group; a second or missing sum would differ)."""
    for result in pool.run(moe_checks.deferred_experts_sp, tp=2):
        assert result["defers"] and not result["graded_before_w"], result
        assert result["queued"] == result["experts"] + 1, result  # and the router's
        assert result["equal"], result


def test_sequence_parallel_fp8_expert_scales_agree_over_tp(pool: DistributedPool) -> None:
    # Each TP rank's experts quantize other tokens, so their recorded amaxes differ; the
    # delayed-scaling update MAX-reduces them over TP (the experts' amax group), so the scales
    # every rank uses next are the same (those of all the tokens, as on one process). The
    # weight gradients through FP8GroupedLinear's weight view are summed over TP.
    for result in pool.run(moe_checks.fp8_delayed_sp_scales, tp=2):
        for name, flags in result.items():
            assert flags["amaxes_differed"], name
            assert flags["scales_agree"], name
            assert flags["grads_summed"], name


def test_sequence_parallel_capacity_is_counted_per_rank(pool: DistributedPool) -> None:
    # The documented semantics (Megatron-Core's): each TP rank's experts take at most
    # ceil(c·T_rank·K/E) of the rank's own assignments, so the output is the one-process
    # layer's on the shard alone; the logged dropped fraction is the whole sequences'.
    for result in pool.run(moe_checks.sp_capacity, tp=2, capacity_factor=0.75):
        assert result.pop("dropped_fraction") > 0
        assert_close(result, FP64_BOUND)
