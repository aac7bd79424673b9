"""Predicted communication equals what the runtime sends, counted on two gloo ranks.

One training step of mt-train per layout (``plan_comm_checks.count_one_step`` wraps every
collective the runtime reaches); the bytes handed to collectives on the rank pair are compared
with :class:`mt_plan.CostModel`'s payload per group. Scalars of 64 bytes or less (the loss, the
gradient norm, the anomaly verdict, the pipeline's loss hand-over) are bookkeeping the model
prices by latency only and are left out. At two ranks every group is the pair, so each layout
exercises one group.
"""

from __future__ import annotations

from pathlib import Path

import plan_comm_checks
import pytest

from mt_comm.testing import DistributedPool, PoolCache
from mt_plan.calibration import load_table
from mt_plan.cluster import load_cluster
from mt_plan.cost import CostModel, Workload
from mt_plan.layout import Layout
from mt_plan.models import resolve, shape_of

SCALAR_BYTES = 64
TINY = {
    "model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2,
    "model.ffn_dim": 128, "trainer.seq_len": 64, "trainer.global_batch_size": 8,
    "trainer.micro_batch_size": 4, "trainer.max_steps": 4, "scheduler.warmup_steps": 1,
    "trainer.sample_tokens": 0, "logging.progress_bar": False, "checkpoint.async_save": False,
}  # fmt: skip


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=2)


def overrides(data: Path, **extra: object) -> list[str]:
    return [f"{k}={v}" for k, v in {"data.path": str(data), **TINY, **extra}.items()]


def predicted(extra: dict, layout: Layout) -> dict[str, float]:
    tiny = {
        k: v for k, v in {**TINY, **extra}.items() if k.startswith(("model", "trainer", "sched"))
    }
    config = resolve([f"{k}={v}" for k, v in tiny.items()] + ["model.vocab_size=320"])
    cost = CostModel(
        shape_of(config.model), load_cluster("h200_nodes").with_gpus(2), load_table("h200"),
        Workload(seq_len=64, global_batch=8, act_bytes=4),  # fp32 on the CPU
    )  # fmt: skip
    return {g: c.payload_bytes for g, c in cost.estimate(layout).comm.items()}


def counted(pool, data: Path, tmp_path: Path, extra: dict) -> list[float]:
    per_rank = pool.run(plan_comm_checks.count_one_step, overrides(data, **extra), tmp_path)
    return [
        sum(b for items in groups.values() for _, b in items if b > SCALAR_BYTES)
        for groups in per_rank
    ]


CASES = [
    ({"parallel.tp": 2}, Layout(tp=2, micro_batch=4), "tp"),
    ({"parallel.tp": 2, "parallel.sequence_parallel": "true"},
     Layout(tp=2, sp=True, micro_batch=4), "tp"),
    ({"parallel.tp": 2, "parallel.recompute": "full"},
     Layout(tp=2, micro_batch=4, recompute="full"), "tp"),
    ({"parallel.cp": 2}, Layout(cp=2, micro_batch=4), "cp+dp"),
    # ring: one K|V message forward, again backward, and the two gradient hops home
    ({"parallel.cp": 2, "parallel.cp_attention": "ring"},
     Layout(cp=2, cp_attention="ring", micro_batch=4), "cp+dp"),
    ({"parallel.data_parallel": "ddp"}, Layout(dp=2, micro_batch=4), "dp"),
    ({"parallel.data_parallel": "zero1"}, Layout(dp=2, dp_mode="zero1", micro_batch=4), "dp"),
    ({"parallel.pp": 2}, Layout(pp=2, micro_batch=4), "pp"),
    ({"parallel.pp": 2, "parallel.pp_schedule": "zbv", "model.n_layers": 4},
     Layout(pp=2, schedule="zbv", micro_batch=4), "pp"),
    ({"model": "mixtral_tiny", "parallel.tp": 2}, Layout(tp=2, micro_batch=4), "tp"),
    ({"model": "mixtral_tiny", "parallel": "tp2"}, Layout(tp=2, sp=True, micro_batch=4), "tp"),
    # the experts' gradients and parameters too (over the expert-data group, dp at ep=1)
    ({"model": "mixtral_tiny", "parallel.data_parallel": "zero1"},
     Layout(dp=2, dp_mode="zero1", micro_batch=4), "dp"),
]  # fmt: skip


@pytest.mark.parametrize(
    "extra,layout,groups", CASES, ids=[c[2] + str(i) for i, c in enumerate(CASES)]
)
def test_predicted_bytes_equal_the_runtime_bytes(pool, kjv_data, tmp_path, extra, layout, groups):
    model_extra = {k: v for k, v in extra.items() if k.startswith("model")}
    prediction = sum(predicted(model_extra, layout).values())
    for bytes_sent in counted(pool, kjv_data, tmp_path, extra):
        assert bytes_sent == prediction


def test_expert_parallel_bytes_match_up_to_the_routing(pool, kjv_data, tmp_path) -> None:
    """ep=2 (dp=2): dispatch and the combine's gradient send all ``T·k`` rows (exact); the
    combine and the dispatch's gradient send back what each rank received, which depends on
    the routing (and capacity drops): the mean over ranks is within 2% of the balanced count."""
    extra = {"model": "mixtral_tiny", "parallel.ep": 2}
    prediction = predicted({"model": "mixtral_tiny"}, Layout(dp=2, ep=2, micro_batch=4))
    per_rank = counted(pool, kjv_data, tmp_path, extra)
    assert sum(per_rank) / 2 == pytest.approx(sum(prediction.values()), rel=0.02)


@pytest.mark.parametrize(
    "extra,layout",
    [
        ({"parallel.tp": 2}, Layout(tp=2, micro_batch=4)),
        ({"parallel.pp": 2, "model.n_layers": 3}, Layout(pp=2, micro_batch=4)),
        ({"model": "mixtral_tiny", "parallel.ep": 2}, Layout(dp=2, ep=2, micro_batch=4)),
    ],
    ids=["tp2", "pp2", "ep2"],
)
def test_parameters_per_rank_equal_the_parallelised_model(pool, kjv_data, tmp_path, extra, layout):
    """The memory model's weights per rank (4 bytes per parameter) start from these counts."""
    model_extra = {k: v for k, v in extra.items() if k.startswith("model")}
    tiny = {
        k: v
        for k, v in {**TINY, **model_extra}.items()
        if k.startswith(("model", "trainer", "sched"))
    }
    config = resolve([f"{k}={v}" for k, v in tiny.items()] + ["model.vocab_size=320"])
    cost = CostModel(shape_of(config.model), load_cluster("h200_nodes").with_gpus(2),
                     load_table("h200"), Workload(seq_len=64, global_batch=8, act_bytes=4))  # fmt: skip
    chunks, placement = cost.chunk_layers(layout), cost.rank_chunks(layout)
    per_rank = pool.run(plan_comm_checks.local_parameters, overrides(kjv_data, **extra), tmp_path)
    for rank, counted_params in enumerate(per_rank):
        stage = rank * layout.pp // 2  # pp is the slowest dimension: ranks 0, 1 are stages 0, 1
        dense, experts, _ = cost.rank_params(layout, placement[stage], chunks)
        assert dense + experts == counted_params


DEEPSEEK = {
    "model": "deepseek_v3_tiny", "model.dim": 64, "model.n_layers": 2, "model.n_heads": 4,
    "model.ffn_dim": 128, "model.q_lora_rank": 32, "model.kv_lora_rank": 32,
    "model.qk_nope_head_dim": 16, "model.qk_rope_head_dim": 8, "model.v_head_dim": 16,
    "model.moe.expert_ffn_dim": 32, "model.moe.num_experts": 8, "model.mtp_depth": 0,
}  # fmt: skip


MLA_CASES = [
    ({"parallel.tp": 2}, Layout(tp=2, micro_batch=4)),
    (
        {"parallel.tp": 2, "parallel.sequence_parallel": "true"},
        Layout(tp=2, sp=True, micro_batch=4),
    ),
    ({"parallel.cp": 2}, Layout(cp=2, micro_batch=4)),
    ({"parallel.cp": 2, "parallel.cp_attention": "ring"},
     Layout(cp=2, cp_attention="ring", micro_batch=4)),
]  # fmt: skip


@pytest.mark.parametrize("parallel,layout", MLA_CASES, ids=["tp2", "tp2-sp", "cp2", "cp2-ring"])
def test_mla_moe_bytes_equal_the_runtime_bytes(pool, kjv_data, tmp_path, parallel, layout) -> None:
    """DeepSeek-V3 (MLA, MoE with a shared expert) at tp=2, and with sequence parallel: the
    latents' gather, the replicated compressions', norms', router's and experts' gradient sums.
    8 experts: the router's per-micro-batch expert counts (8 int64, 64 bytes) stay a scalar;
    kv_lora_rank 32: the latent norm's gain gradient (4·32 bytes) is not one. At cp=2 (the
    pair is also the dp×cp gradient group, one MoE layer): MLA's compressed latent
    ``[c ; k_rot]`` gathered per layer and micro-batch, not the expanded K/V, and DDP's
    gradient all-reduce; with the ring, the latent blocks and their gradients sent around."""
    trainer = {k: v for k, v in TINY.items() if not k.startswith("model")}
    extra = {**DEEPSEEK, **parallel}
    composed = {**trainer, **DEEPSEEK}
    keys = [f"{k}={v}" for k, v in composed.items() if k.startswith(("model", "trainer", "sched"))]
    config = resolve([*keys, "model.vocab_size=320"])
    cost = CostModel(shape_of(config.model), load_cluster("h200_nodes").with_gpus(2),
                     load_table("h200"), Workload(seq_len=64, global_batch=8, act_bytes=4))  # fmt: skip
    prediction = sum(c.payload_bytes for c in cost.estimate(layout).comm.values())
    if layout.cp > 1:  # the step's expert counts (int64) summed over dp×cp, a scalar here
        counts = 8 * cost.model.num_experts * cost.model.moe_layers
        assert counts <= SCALAR_BYTES
        prediction -= counts
    per_rank = pool.run(
        plan_comm_checks.count_one_step,
        [f"{k}={v}" for k, v in {"data.path": str(kjv_data), **trainer, **extra}.items()],
        tmp_path,
    )
    for groups in per_rank:
        assert (
            sum(b for items in groups.values() for _, b in items if b > SCALAR_BYTES) == prediction
        )
