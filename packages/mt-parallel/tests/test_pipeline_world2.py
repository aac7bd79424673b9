"""Pipeline parallelism on 2 gloo ranks (a pool shared across modules): every schedule's losses and
gradients against one process running the whole model (float64), with even and uneven splits
and micro-batch counts p, 2p and an odd count; FP8 through the deferred weight gradients; MoE
layers' auxiliary losses carried across stages; an input embedding the last stage also runs
(its copy there started from the first stage's, its gradient summed over both) trains as one
process does; the autograd-saved bytes each rank holds peak where its action list says."""

from __future__ import annotations

import pipeline_checks as checks
import pytest
import torch
from parallel_tolerances import FP32_VS_FP64, FP64_VS_FP64, assert_close

from mt_comm.testing import DistributedPool, PoolCache
from mt_parallel.pipeline import (
    SCHEDULES,
    check_microbatches,
    chunks_per_rank,
    predicted_peak_bytes,
    schedule_actions,
    simulate,
)
from mt_parallel.pipeline.schedules import F, leaf_actions
from mt_parallel.pipeline.split import detached


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=2)


def check(
    results: list[dict], microbatches: int, tol: float = FP64_VS_FP64, replicas: int = 1
) -> None:
    """Every gradient compared on some rank and within ``tol``, every loss too, and one rank
    per pipeline replica (``replicas`` = dp·tp) holding the last chunk."""
    names: set[str] = set()
    for result in results:
        assert result["grads"], result
        assert_close({"grads": result["grads"]}, tol)
        assert all(error < tol for error in result["losses"].values()), result["losses"]
        names |= set(result["names"])
        assert result["loss_count"] == (microbatches if result["holds_last"] else 0)
    assert names == set(results[0]["all_names"])  # every gradient was compared somewhere
    assert sum(r["holds_last"] for r in results) == replicas


def chunks_of(schedule: str) -> int:
    return 2 if schedule == "interleaved_1f1b" else 1


def runs(schedule: str, microbatches: int) -> bool:
    try:
        check_microbatches(schedule, 2, microbatches, chunks_of(schedule))
    except ValueError:
        return False
    return True


# p, 2p and the odd counts 3 and 5 where the schedule runs them (dualpipev needs 2p).
CASES = [(name, m) for name in SCHEDULES for m in (2, 3, 4, 5) if runs(name, m)]


@pytest.mark.parametrize(("schedule", "microbatches"), CASES, ids=[f"{s}-m{m}" for s, m in CASES])
def test_schedule_matches_one_process(
    pool: DistributedPool, schedule: str, microbatches: int
) -> None:
    chunks = chunks_of(schedule)
    check(
        pool.run(checks.pipeline_lm, schedule=schedule, microbatches=microbatches, chunks=chunks),
        microbatches,
    )


@pytest.mark.parametrize("schedule", ["zero_bubble", "zbv", "dualpipev"])
def test_whole_backward_at_i_on_older_torch(pool: DistributedPool, schedule: str) -> None:
    """Where torch's split backward is wrong (before 2.13), every chunk of a split-backward
    schedule runs its backward at I except the parallel linears' weight gradients, which its
    sink queues for W: still one process's gradients; every linear of the rank defers once per
    micro-batch, none of their weights has a gradient when its chunk's first W starts (where
    every backward is split: DualPipeV runs some whole, as B), and no warning (embedding and
    norms, all that stays in I, are small)."""
    results = pool.run(
        checks.pipeline_lm, schedule=schedule, microbatches=4, chunks=chunks_of(schedule),
        whole_backward_at_i=True,
    )  # fmt: skip
    check(results, 4)
    for r in results:
        assert r["dw_builders"] == len(r["stages"]) == r["weight_grad_sinks"], r
        assert r["sink_layers"] >= 7 * len(r["stages"]), r  # q, k, v, o, gate, up, down
        assert r["deferred"] == 4 * r["sink_layers"], r
        assert r["graded_before_w"] == 0 or schedule == "dualpipev", r
        assert not r["warned_split"]


@pytest.mark.parametrize(
    ("schedule", "layers"),
    [("1f1b", [3, 0]), ("zbv", [1, 2, 2, 0]), ("interleaved_1f1b", [0, 2, 1, 1])],
)
def test_uneven_splits(pool: DistributedPool, schedule: str, layers: list[int]) -> None:
    chunks = chunks_of(schedule)
    results = pool.run(
        checks.pipeline_lm, schedule=schedule, microbatches=4, chunks=chunks, layers=layers
    )
    check(results, 4)


@pytest.mark.parametrize("schedule", ["zero_bubble", "dualpipev", "1f1b"])
def test_fp8_split_backward_defers_weight_gradients(pool: DistributedPool, schedule: str) -> None:
    """FP8 (tensorwise, fp32) against the same FP8 model on one process: the zero-bubble
    schedules queue the FP8 weight GEMMs in a sink (run as W), 1F1B runs them in B."""
    results = pool.run(checks.pipeline_lm, schedule=schedule, microbatches=4, fp8=True)
    check(results, 4, FP32_VS_FP64)
    split = schedule != "1f1b"
    assert all((r["weight_grad_sinks"] > 0) == split for r in results)


@pytest.mark.parametrize(
    ("schedule", "layers"),
    [("1f1b", [2, 1]), ("zero_bubble", None), ("dualpipev", [1, 1, 0, 1]),
     ("interleaved_1f1b", None)],
)  # fmt: skip
def test_moe_auxiliary_losses_reach_every_stage(
    pool: DistributedPool, schedule: str, layers: list[int] | None
) -> None:
    """MoE layers with balancing and z-losses on both ranks (and one on a chunk with no MoE
    layer): every gradient, routers included, equals one process's in float64; the step's
    total loss (the last rank's cross-entropy plus the carried losses) to fp32 records."""
    chunks = chunks_of(schedule)
    results = pool.run(
        checks.pipeline_lm, schedule=schedule, microbatches=4, chunks=chunks, layers=layers,
        moe=True,
    )  # fmt: skip
    check(results, 4)
    assert any("router" in name for r in results for name in r["names"])
    # fp32 sums of a few values of size ~6: a few fp32 ulps.
    assert all(r["total_loss_error"] < 1e-6 for r in results)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_moe_experts_and_routers_defer_on_older_torch(
    pool: DistributedPool, recompute: str
) -> None:
    """Where torch's split backward is wrong, ZBV over MoE layers: the routed experts' grouped
    weights (their per-expert loop in float64) and the routers' weights defer to W with the
    linears, also with whole blocks recomputed (the forward runs twice, each weight defers
    once); one process's gradients and total loss still, and no warning: no GEMM weight stays
    at I."""
    results = pool.run(
        checks.pipeline_lm, schedule="zbv", microbatches=4, moe=True, whole_backward_at_i=True,
        recompute=recompute,
    )  # fmt: skip
    check(results, 4)
    assert all(r["total_loss_error"] < 1e-6 for r in results)  # as in the MoE test above
    for r in results:
        # attention q, k, v, o, the router and the three expert projections per block (one
        # block a chunk), and the head on the last chunk
        assert r["sink_layers"] == 8 * len(r["stages"]) + (3 in r["stages"]), r
        assert r["deferred"] == 4 * r["sink_layers"] and r["graded_before_w"] == 0, r
        assert not r["warned_split"], r


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_split_backward_recomputes_each_block_once(pool: DistributedPool, recompute: str) -> None:
    """ZBV runs the same four blocks, head and embedding as interleaved 1F1B with two chunks
    per rank, so over both ranks one step runs the same matrix products, also with every block
    recomputed whole: each block's forward runs again once per micro-batch, in ``I``, and not
    again for each weight group in ``W`` (torch's ``stage_backward_weight`` would, one autograd
    call per group, each recomputing: about 2.5 times the step's count here). One GEMM more per block and
    micro-batch: the recomputation of a block whose last linear queues its weight gradient
    runs that linear's forward GEMM too (a custom autograd function's saved tensors are packed
    after its forward, so the checkpoint's early stop comes after it; autograd's own linear
    saves its input before the product). Gradients and losses are one process's, and no GEMM
    weight of these blocks stays at ``I`` (no warning)."""
    counts = {}
    for schedule in ("zbv", "interleaved_1f1b"):
        results = pool.run(
            checks.pipeline_lm, schedule=schedule, microbatches=4, chunks=chunks_of(schedule),
            recompute=recompute, count_gemms=True,
        )  # fmt: skip
        check(results, 4)
        assert not any(r["warned_split"] for r in results)
        counts[schedule] = sum(r["gemms"] for r in results)
    blocks, microbatches = 4, 4
    extra = blocks * microbatches if recompute == "full" else 0
    assert counts["zbv"] == counts["interleaved_1f1b"] + extra > extra, counts


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_pipeline_module_forward_and_names(pool: DistributedPool, schedule: str) -> None:
    results = pool.run(checks.pipeline_module_forward, schedule=schedule)
    for result in results:
        assert result["logits"] < FP64_VS_FP64 and result["loss"] < FP64_VS_FP64
    keys = [set(r["keys"]) for r in results]
    assert not keys[0] & keys[1]  # each parameter and buffer lives on one pipeline rank
    assert keys[0] | keys[1] == set(results[0]["all_keys"])


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "zbv", "dualpipev"])
def test_shared_embedding_trains_as_one_process(pool: DistributedPool, schedule: str) -> None:
    """Three float64 AdamW steps: the first step's gradients (the embedding's summed over the
    two stages), losses and clipped norm equal one process's, and the two embeddings stay
    equal bit for bit and equal to the reference's (AdamW's normalised update would hide a
    gradient off by a constant factor from that last check, not from the first)."""
    results = pool.run(checks.shared_embedding_step, schedule=schedule, steps=3)
    for result in results:
        assert_close({"grads": result["grads"]}, FP64_VS_FP64)
        assert result["norm"] < FP64_VS_FP64
        assert result["copies_equal"] and result["embedding"] < FP64_VS_FP64
    last = [r for r in results if r["holds_last"]]
    assert len(last) == 1 and last[0]["losses"] and max(last[0]["losses"]) < FP64_VS_FP64
    if schedule in ("zbv", "dualpipev"):  # first and last chunk on rank 0: one embedding, no copy
        assert [r["holds_embedding"] for r in results] == [True, False]
        assert all(r["copy_marked"] == [] for r in results)
    else:
        assert last[0]["copy_marked"] == ["embed.weight"]
        assert [r["copy_marked"] for r in results if not r["holds_last"]] == [[]]


def test_shared_embedding_without_the_gradient_sum_diverges(pool: DistributedPool) -> None:
    """Each stage's embedding gradient alone is not the whole model's: the check above fails."""
    results = pool.run(checks.shared_embedding_step, schedule="1f1b", steps=1, exchange=False)
    assert all(r["grads"]["embed.weight"] > 1e-3 for r in results)


def test_shared_embedding_under_fsdp2_at_dp1(pool: DistributedPool) -> None:
    """ZBV under FSDP2 at dp=1 (FSDP2 over one rank): the first and last chunks on rank 0 hold
    the one embedding, an FSDP2 unit of its own. Two float64 AdamW steps equal one process
    (the first step's gradients, losses and clipped norm; the final embedding), and each step
    gathers it once and reduces its gradient, summed over both chunks, once."""
    results = pool.run(checks.shared_embedding_step, schedule="zbv", steps=2, data_parallel="fsdp")
    for result in results:
        assert_close({"grads": result["grads"]}, FP64_VS_FP64)
        assert result["norm"] < FP64_VS_FP64 and result["embedding"] < FP64_VS_FP64
    assert [r["holds_embedding"] for r in results] == [True, False]
    assert results[0]["holds_last"] and max(results[0]["losses"]) < FP64_VS_FP64
    assert results[0]["shared_units"] == ["FSDPVocabParallelEmbedding"]
    assert results[0]["shared_unit_work"] == [{"gathers": 1, "reductions": 1}] * 2
    assert results[1]["shared_units"] == []


def test_shared_fsdp_unit_needs_a_runtime_taking_a_custom_reduce_grad(
    pool: DistributedPool,
) -> None:
    """Without a custom REDUCE_GRAD function torch's would reduce the embedding with each
    chunk's: the schedule refuses to be built, naming what is missing."""
    message = "need a torch whose pipeline runtime takes a custom REDUCE_GRAD function"
    with pytest.raises(Exception, match=message):
        pool.run(checks.shared_fsdp_without_custom_reduce_grad, schedule="zbv")


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble", "zbv"])
def test_saved_activation_bytes_peak_where_the_schedule_says(
    pool: DistributedPool, schedule: str
) -> None:
    """One step at pp=2, m=4 under an ``ActivationMeter``: each rank's peak of autograd-saved
    bytes equals, byte for byte, the peak of its action list (``schedule_actions``, generated
    here, not taken from the runtime) with each chunk's bytes measured by running that chunk
    alone: ``F`` adds its forward's bytes, ``B`` frees them, ``I`` frees all but what torch's
    split backward keeps for ``W``. Exact, not within a bound: both sides count the same
    float64 tensors of the same shapes, and the meter counts each storage once. Everything is
    released by the end of the step. A schedule holding one more micro-batch chunk than its
    list (or a list predicting one fewer) is off by at least the smallest chunk's bytes."""
    microbatches, v = 4, chunks_per_rank(schedule, 1)
    order = schedule_actions(schedule, 2, microbatches, v)
    in_flight = simulate(order, 2 * v, chunks_per_rank=v).peak_activations
    results = pool.run(checks.activation_bytes, schedule=schedule, microbatches=microbatches)
    for result in results:
        rank, chunk_bytes = result["pp_rank"], result["chunk_bytes"]
        assert result["actions"] == [str(a) for a in order[rank]]
        saved = {s: a for s, (a, _) in chunk_bytes.items()}
        kept = {s: k for s, (_, k) in chunk_bytes.items()}
        assert result["measured_peak"] == predicted_peak_bytes(order[rank], saved, kept), result
        assert result["left"] == 0
        if v == 1:  # the simulator's count of chunks between F and I, times one chunk's bytes
            (chunk,) = saved.values()
            if SCHEDULES[schedule].split_backward:  # torch's I keeps more until W
                assert result["measured_peak"] >= in_flight[rank] * chunk
            else:
                assert result["measured_peak"] == in_flight[rank] * chunk
    # torch's split backward keeps the whole first chunk until W (its I does nothing there)
    # and, on the others, what the weight gradients need: in these blocks every saved tensor
    # (each feeds some weight's gradient) but the loss's, on the last chunk.
    if SCHEDULES[schedule].split_backward:
        for result in results:
            for stage, (a, k) in result["chunk_bytes"].items():
                assert (0 < k < a) if stage == 2 * v - 1 else k == a, (stage, a, k)


def overlapped_forwards(actions: list) -> set[tuple[int, int]]:
    """The (chunk, micro-batch) pairs whose forward runs in an overlapped pair."""
    return {(a.stage_index, a.microbatch_index) for entry in actions
            for a in (entry.sub_actions or ()) if a.computation_type == F}  # fmt: skip


DEFERRED_CASES = [("zero_bubble", True, False, False), ("zbv", True, False, False),
                  ("dualpipev", False, True, False), ("dualpipev", True, True, False),
                  ("dualpipev", True, True, True)]  # fmt: skip


@pytest.mark.parametrize(
    ("schedule", "sinks", "overlap", "moe"),
    DEFERRED_CASES,
    ids=[f"{s}{'-sinks' if k else ''}{'-overlap' if o else ''}{'-moe' if e else ''}"
         for s, k, o, e in DEFERRED_CASES],
)  # fmt: skip
def test_saved_bytes_count_sinks_and_the_overlap_thread(
    pool: DistributedPool, schedule: str, sinks: bool, overlap: bool, moe: bool
) -> None:
    """The check above where the meter now sees more: with every linear's weight gradient
    queued in a sink (torch < 2.13 emulated) the closures hold each linear's input and ``dy``
    from ``I`` to ``W``, and with DualPipeV's overlap function the pairs' forwards save on a
    thread of their own. Each rank's peak equals its action list's byte for byte, ``kept``
    being what the closures hold and ``rise`` the most a chunk's backward climbs above its
    start (its closures hold ``dy`` before the saved tensors of later nodes are released), all
    measured by running the chunk alone. Exact for the reasons given above; the step's own
    closures and saved tensors are all released at its end. The same step under the meter as
    it was (no sink watched, no hooks on the overlap thread) peaks where the list does with
    those bytes left out (``kept`` and ``rise`` zero, the overlapped forwards' chunks never
    counted), lower on at least one rank of each case."""
    microbatches, v = 4, chunks_per_rank(schedule, 1)
    order = schedule_actions(schedule, 2, microbatches, v)
    results = pool.run(
        checks.activation_bytes_deferred, schedule=schedule, microbatches=microbatches,
        sinks=sinks, overlap=overlap, moe=moe,
    )  # fmt: skip
    for result in results:
        rank, chunk_bytes = result["pp_rank"], result["chunk_bytes"]
        assert result["actions"] == [str(a) for a in order[rank]]
        saved, kept, rise = ({s: b[i] for s, b in chunk_bytes.items()} for i in range(3))
        predicted = predicted_peak_bytes(order[rank], saved, kept, rise)
        assert result["measured_peak"] == predicted, result
        assert result["left"] == 0
        # The meter as it was: no closure held anything (with sinks, autograd keeps nothing
        # from I to W: kept 0; no rise) and the overlapped forwards' chunks were never counted.
        unseen = overlapped_forwards(order[rank]) if overlap else set()
        seen = [a for e in order[rank] for a in leaf_actions(e)
                if (a.stage_index, a.microbatch_index) not in unseen]  # fmt: skip
        kept_before = dict.fromkeys(kept, 0) if sinks else kept
        assert result["peak_before"] == predicted_peak_bytes(seen, saved, kept_before)
        if sinks:  # the closures hold every chunk's linear inputs and dy: more than nothing
            assert all(k > 0 for k in kept.values()), chunk_bytes
        else:
            assert not any(rise.values()), chunk_bytes
    assert any(r["measured_peak"] > r["peak_before"] for r in results), results


@pytest.mark.parametrize("schedule", ["zero_bubble", "zbv"])
def test_saved_bytes_under_full_recompute_peak_where_the_schedule_says(
    pool: DistributedPool, schedule: str
) -> None:
    """Blocks recomputed whole under a split-backward schedule (their chunks take sinks,
    whatever the torch): ``F`` saves each block's input only, ``I`` recomputes and runs the
    backward once, the closures hold each linear's recomputed input and ``dy`` until ``W``.
    Each rank's peak equals its action list's, byte for byte, with each chunk's bytes measured
    alone; a chunk keeps more from ``I`` to ``W`` than its forward saved (the recomputed
    inputs), which is what a memory model must charge there."""
    microbatches, v = 4, chunks_per_rank(schedule, 1)
    order = schedule_actions(schedule, 2, microbatches, v)
    results = pool.run(
        checks.activation_bytes_deferred, schedule=schedule, microbatches=microbatches,
        sinks=True, overlap=False, recompute="full",
    )  # fmt: skip
    for result in results:
        rank, chunk_bytes = result["pp_rank"], result["chunk_bytes"]
        assert result["actions"] == [str(a) for a in order[rank]]
        saved, kept, rise = ({s: b[i] for s, b in chunk_bytes.items()} for i in range(3))
        assert result["measured_peak"] == predicted_peak_bytes(order[rank], saved, kept, rise)
        assert result["left"] == 0
        assert all(kept[s] > saved[s] for s in saved), chunk_bytes


def test_detached_puts_the_module_back_among_the_current_children() -> None:
    """A module detached while a transform replaces a sibling (FP8's linears) comes back at
    its own position, and the replacement stays."""
    root = torch.nn.Module()
    root.inner = torch.nn.Module()
    root.inner.a, root.inner.embed = torch.nn.Linear(2, 2), torch.nn.Embedding(4, 2)
    root.inner.b = torch.nn.Linear(2, 2)
    embed, replacement = root.inner.embed, torch.nn.Linear(2, 2)
    with detached(root, ["inner.embed"]):
        assert list(root.inner._modules) == ["a", "b"]
        root.inner.a = replacement
    assert list(root.inner._modules) == ["a", "embed", "b"]
    assert root.inner.a is replacement and root.inner.embed is embed
