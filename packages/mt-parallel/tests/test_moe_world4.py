"""Expert parallelism on 4 gloo ranks against one process in float64 (a pool shared across modules):
ep=2 and ep=4, all-to-all and all-gather dispatch, dropless and capacity dropping (the same
assignments dropped), shared experts, ep×tp, ep×tp with sequence parallel, ep×dp, FP8, the
global aux-loss-free bias, and the shared experts overlapped with the count exchange."""

from __future__ import annotations

import moe_checks
import pytest
import torch
from parallel_tolerances import FP32_VS_FP64, assert_close

from mt_comm.testing import DistributedPool, PoolCache

# Both sides in float64 (the same experts, weights and tokens; only the order of rows inside
# each grouped GEMM and of the gradient sums differs): a few ulps of 1.1e-16. 1e-12 is far
# below a wrong expert, weight, split or missing reduction (errors of 1e-2..1).
FP64_BOUND = 1e-12


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=4)


CASES = {
    "ep2-dp2-dropless": {"ep": 2},
    "ep4-dropless": {"ep": 4},
    "ep4-all-gather": {"ep": 4, "dispatcher": "all_gather"},
    "ep2-capacity": {"ep": 2, "capacity_factor": 0.75},
    "ep4-capacity-padded": {"ep": 4, "capacity_factor": 0.75, "pad_to_capacity": True},
    "ep2-tp2-shared-sigmoid": {
        "ep": 2, "tp": 2, "n_shared_experts": 2, "score_function": "sigmoid",
        "n_group": 4, "topk_group": 2, "balancing": "seq_aux_loss",
    },
    "ep4-z-loss": {"ep": 4, "z_loss_coeff": 1e-2},
}  # fmt: skip


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_expert_parallel_equals_one_process(pool: DistributedPool, case: dict) -> None:
    results = pool.run(moe_checks.ep_parity, **case)
    for result in results:
        dropped = result.pop("dropped")
        assert (dropped > 0) == ("capacity_factor" in case), dropped
        assert_close(result, FP64_BOUND)


SP_CASES = {
    "softmax-aux": {"balancing": "aux_loss", "z_loss_coeff": 1e-2},
    "sigmoid-aux-free-shared": {
        "score_function": "sigmoid", "n_group": 4, "topk_group": 2, "balancing": "aux_free",
        "n_shared_experts": 2,
    },
    "sigmoid-seq-aux-all-gather": {
        "score_function": "sigmoid", "n_group": 4, "topk_group": 2, "balancing": "seq_aux_loss",
        "dispatcher": "all_gather",
    },
}  # fmt: skip


@pytest.mark.parametrize("case", SP_CASES.values(), ids=SP_CASES.keys())
def test_expert_parallel_with_sequence_parallel_equals_one_process(
    pool: DistributedPool, case: dict
) -> None:
    # tp=2 with SP × ep=2: each TP rank dispatches its half of the sequences over its own ep
    # group; the expert gradients are summed over TP in the backward and over edp after it.
    for result in pool.run(moe_checks.sp_parity, tp=2, ep=2, **case):
        assert result.pop("counts_equal") and result.pop("step_counts_equal")
        assert result.pop("bias_equal")
        assert result.pop("bias_moved") == (case["balancing"] == "aux_free")
        result.pop("losses")
        assert_close(result, FP64_BOUND)


def test_expert_parallel_fp8_equals_fp8_on_one_process(pool: DistributedPool) -> None:
    # fp32 compute with FP8 GEMMs on both sides, the reference on all ranks' tokens at once:
    # identical FP8 operands per expert (rowwise scales per token row and weight row; the
    # wgrad's per-expert column scales over the same rows), so only fp32 accumulation order
    # differs (FP32_VS_FP64 bound).
    for result in pool.run(moe_checks.ep_parity, ep=4, fp8="rowwise", balancing="none"):
        result.pop("dropped")
        assert_close(result, FP32_VS_FP64)


def test_aux_free_bias_moves_from_the_global_counts(pool: DistributedPool) -> None:
    results = pool.run(moe_checks.bias_update_is_global, ep=2)
    for result in results:
        assert torch.equal(result["counts"], result["summed"])
        assert torch.equal(result["bias"], results[0]["bias"])
    assert results[0]["bias"].abs().sum() > 0


@pytest.mark.parametrize("tp", [1, 2], ids=["ep2-dp2", "ep2-tp2-sp"])
def test_shared_experts_overlap_the_count_exchange(pool: DistributedPool, tp: int) -> None:
    # On: the shared experts run after the counts are sent and before the host reads them
    # (on an accelerator: while they travel), also with the row all-to-alls in flight (DualPipeV);
    # off: after the routed part. Each part computes the same values: the same bits.
    forward = ["counts sent", "shared experts", "counts read"]
    expected = {
        "off": ["counts sent", "counts read", "rows sent", "rows sent", "shared experts",
                "rows sent", "rows sent"],
        "on": [*forward, "rows sent", "rows sent", "rows sent", "rows sent"],
        "on, rows in flight": [*forward, *["rows in flight"] * 4],
    }  # fmt: skip
    for result in pool.run(moe_checks.shared_expert_overlap, ep=2, tp=tp):
        assert {setting: run["events"] for setting, run in result.items()} == expected
        off = result.pop("off")["values"]
        for run in result.values():
            assert run["values"].keys() == off.keys()
            for name, value in off.items():
                assert torch.equal(run["values"][name], value), name
