"""Per-rank pipeline checks, run by the gloo tests on every rank of a :class:`DistributedPool`.

Each check cuts the toy decoder LM (``toy_lm``) into pipeline chunks with
:func:`mt_parallel.pipeline_chunks`, runs one step of a schedule through
:class:`mt_parallel.PipelineSchedule` (torch's action runtime) and compares every micro-batch
loss and every gradient this rank holds with one process running the whole model over the same
micro-batches (the accumulation loop of a pp=1 step), in float64 unless FP8 is on.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from unittest import mock

import torch
import torch.distributed as dist
from parallel_checks import DIM, FFN, HEADS, KV_HEADS, VOCAB, _batch, _lm, rel_err
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining._backward import stage_backward, stage_backward_input
from torch.utils._python_dispatch import TorchDispatchMode
from toy_lm import PLAN, SHARED_PLAN, NextTokenLM

import mt_comm
import mt_fp8
import mt_parallel as mp
from mt_comm.testing import whole_tensor
from mt_parallel.pipeline import SCHEDULES, ActivationMeter, StageShapes, chunks_per_rank
from mt_parallel.pipeline import runtime as pipeline_runtime
from mt_parallel.pipeline.shared_fsdp import fsdp_param_groups

BATCH, SEQ = 2, 16


# Two routed experts of four per token, balancing and z-losses on (their gradients cross
# no stage boundary: mt_parallel.moe.carry).
MOE = mp.moe.MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=16, z_loss_coeff=1e-2)


def _reference(
    layers: int, seed: int, dtype: torch.dtype, fp8: bool, moe: bool = False
) -> torch.nn.Module:
    model = _lm(layers=layers, moe=MOE if moe else None)
    mp.init_weights(model, seed)
    model = model.to(dtype)
    if fp8:
        mp.apply_fp8(model, mt_fp8.TensorwiseScaling(), skip=("lm_head",))
    return model


def _count_in_flight(runner: mp.PipelineSchedule, chunks: int) -> list[float]:
    """After every forward, the micro-batch chunks whose activations this rank holds (torch's
    ``fwd_cache`` keeps a chunk's inputs and outputs from its forward to its input-gradient
    backward), in whole-stage units (a chunk is ``1/chunks`` of a stage)."""
    counts: list[float] = [0.0]
    stages = runner.runtime._stages
    for stage in stages:
        forward = stage.forward_one_chunk

        def counted(*args, _forward=forward, **kwargs):
            out = _forward(*args, **kwargs)
            counts.append(sum(len(s.fwd_cache) for s in stages) / chunks)
            return out

        stage.forward_one_chunk = counted
    return counts


def _record_weight_passes(runner: mp.PipelineSchedule) -> dict[str, int]:
    """Count the weight-gradient computations queued in the runner's sinks, the layers holding
    a sink, and the weights of those layers that already had a gradient when their chunk's
    first ``W`` started (none should: their gradients come from ``W``)."""
    record = {"deferred": 0, "sink_layers": 0, "graded_before_w": 0}
    for sink in runner.sinks:

        def counted(compute, holds=(), _defer=sink.defer):
            record["deferred"] += 1
            _defer(compute, holds)

        sink.defer = counted
    for stage in runner.runtime._stages:
        layers = [m for m in stage.submod.modules() if getattr(m, "wgrad_sink", None) is not None]
        record["sink_layers"] += len(layers)
        weights = {id(m.weight): m.weight for m in layers}.values()
        backward_weight, started = stage.backward_weight_one_chunk, []

        def checked(*args, _run=backward_weight, _started=started, _weights=weights, **kwargs):
            if not _started:
                _started.append(True)
                record["graded_before_w"] += sum(w.grad is not None for w in _weights)
            return _run(*args, **kwargs)

        stage.backward_weight_one_chunk = checked
    return record


class _GemmCount(TorchDispatchMode):
    """Counts the matrix products (``aten.mm``, ``aten.addmm``) run under it, the autograd
    engine's backward included (it carries the mode to the backward)."""

    GEMMS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.GEMMS
        return func(*args, **(kwargs or {}))


def pipeline_lm(
    schedule: str,
    microbatches: int,
    chunks: int = 1,
    layers: list[int] | None = None,
    tp: int = 1,
    dp: int = 1,
    sp: bool = False,
    fp8: bool = False,
    recompute: str = "none",
    seed: int = 0,
    moe: bool = False,
    whole_backward_at_i: bool = False,
    count_gemms: bool = False,
) -> dict[str, object]:
    """One pipelined step against the whole model on one process (module docstring); with
    ``count_gemms`` the matrix products the step ran on this rank (``gemms``, else None); with
    ``moe`` MoE layers whose auxiliary losses the chunks carry, and the step's total loss
    (cross-entropy on the last rank plus every stage's carried losses) compared instead of
    each micro-batch's; with ``whole_backward_at_i`` the schedule built as on a torch whose
    split backward is wrong (``mt_parallel.pipeline.runtime.TORCH_SPLITS_BACKWARD`` false)."""
    world = dist.get_world_size()
    pp = world // (tp * dp)
    config = mp.ParallelConfig(
        tp=tp, dp=dp, pp=pp, sequence_parallel=sp, data_parallel="none", recompute=recompute,
        pp_schedule=schedule, pp_chunks=chunks, pp_layers=layers or [],
        pp_microbatches=microbatches,
    )  # fmt: skip
    state = mt_comm.init_parallel_state(dp=dp, tp=tp, pp=pp)
    v = chunks_per_rank(schedule, chunks)
    num_layers = sum(layers) if layers else pp * v
    dtype = torch.float32 if fp8 else torch.float64
    reference = _reference(num_layers, seed, dtype, fp8, moe)
    model = _reference(num_layers, seed, dtype, False, moe)
    options = mp.FP8Options(mt_fp8.TensorwiseScaling()) if fp8 else None
    chunk_modules = mp.pipeline_chunks(model, config, state, PLAN, options)

    tokens, targets = _batch(seed + 1, dp * microbatches * BATCH, SEQ)
    rows = [slice((d * microbatches + k) * BATCH, (d * microbatches + k + 1) * BATCH)
            for d in range(dp) for k in range(microbatches)]  # fmt: skip
    ref_losses = []
    for row in rows:
        loss = reference.loss(reference(tokens[row]), targets[row])
        (loss / len(rows)).backward()
        ref_losses.append(loss.detach())

    vocab_local = reference.lm_head.weight.shape[0] // tp
    hidden_seq = SEQ // tp if sp else SEQ
    shapes = StageShapes(
        tokens=((BATCH, SEQ), torch.long),
        hidden=((BATCH, hidden_seq, reference.embed.weight.shape[1]), dtype),
        logits=((BATCH, SEQ, vocab_local), dtype),
    )
    splits = pipeline_runtime.TORCH_SPLITS_BACKWARD and not whole_backward_at_i
    with (
        mock.patch.object(pipeline_runtime, "TORCH_SPLITS_BACKWARD", splits),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        runner = mp.PipelineSchedule(
            chunk_modules, schedule, pp, state.rank("pp"), microbatches, chunks, shapes,
            torch.device("cpu"), state.group("pp"), model.loss,
        )  # fmt: skip
    in_flight = _count_in_flight(runner, v)
    weight_passes = _record_weight_passes(runner)
    mine = rows[state.rank("dp") * microbatches : (state.rank("dp") + 1) * microbatches]
    gemms = _GemmCount()
    with gemms if count_gemms else contextlib.nullcontext():
        result = runner.step([tokens[r] for r in mine], [targets[r] for r in mine])
    params = [p for c in chunk_modules for p in c.parameters()]
    mp.all_reduce_gradients(params, state.group("dp"))

    full = {name: p.grad for name, p in reference.named_parameters()}
    expected = mp.shard_state_dict(full, mp.tp_shard_plan(reference), state.rank("tp"), tp)
    grads = {}
    for chunk in chunk_modules:
        for name, param in chunk.named_parameters():
            grads[name] = rel_err(param.grad, expected[name])
    dp_rank = state.rank("dp")
    mine_ref = ref_losses[dp_rank * microbatches : (dp_rank + 1) * microbatches]
    computed = dict(enumerate(result.losses))  # only the rank holding the last chunk has them
    loss_errors = {str(k): rel_err(loss, mine_ref[k]) for k, loss in computed.items()}
    total_error = 0.0
    if moe:
        ce = torch.stack(result.losses).sum() if result.losses else torch.zeros((), dtype=dtype)
        mt_comm.all_reduce(ce, group=state.group("pp"))
        records = [c.aux_records for c in chunk_modules]
        assert all(len(r) == microbatches for r in records if r), records
        aux, _ = mp.moe.pipeline_aux_summary(
            records, [1.0] * microbatches, state.group("pp"), torch.device("cpu")
        )
        # Per micro-batch the last rank sees only the cross-entropy; the step's total is
        # compared instead (in fp32: the records are kept at logging precision).
        loss_errors = {}
        total_error = rel_err(ce.float() + aux, torch.stack(mine_ref).sum().float())
    return {
        "grads": grads,
        "losses": loss_errors,
        "total_loss_error": total_error,
        "holds_last": any(c.last for c in chunk_modules),
        "loss_count": len(result.losses),
        "stages": runner.stage_ids,
        "weight_grad_sinks": len(runner.sinks),
        **weight_passes,
        "warned_split": any("split backward" in str(w.message) for w in caught),
        "gemms": gemms.count if count_gemms else None,
        "dw_builders": sum(stage.dw_builder is not None for stage in runner.runtime._stages),
        "peak_in_flight": max(in_flight),
        "pp_rank": state.rank("pp"),
        "names": sorted(grads),
        "all_names": sorted(expected),
    }


def pipeline_module_forward(schedule: str, seed: int = 0) -> dict[str, object]:
    """:class:`mt_parallel.PipelineModule`'s forward-only pipeline: every rank gets the whole
    model's logits and loss; its state dict keys are the whole model's for its chunks."""
    pp = dist.get_world_size()
    config = mp.ParallelConfig(pp=pp, pp_schedule=schedule, data_parallel="none")
    state = mt_comm.init_parallel_state(pp=pp)
    layers = pp * chunks_per_rank(schedule, 1)
    reference = _reference(layers, seed, torch.float64, False)
    module = mp.pipeline_module(_reference(layers, seed, torch.float64, False), config, state, PLAN)
    tokens, targets = _batch(seed + 1, BATCH, SEQ)
    with torch.no_grad():
        logits = module(tokens)
        loss = module.loss(logits, targets)
        expected = reference(tokens)
        expected_loss = reference.loss(expected, targets)
    return {
        "logits": rel_err(logits, expected),
        "loss": rel_err(loss, expected_loss),
        "keys": sorted(module.state_dict()),
        "all_keys": sorted(reference.state_dict()),
    }


def _count_shared_unit_work(unit: torch.nn.Module, counts: dict[str, int]) -> None:
    """Count the all-gathers and the gradient reductions of the FSDP2 unit ``unit`` (its
    parameter group's ``unshard`` finding it sharded, ``post_backward`` told to reduce)."""
    (group,) = fsdp_param_groups(fully_shard.state(unit))
    unshard, post_backward = group.unshard, group.post_backward

    def counted_unshard(*args, **kwargs):
        counts["gathers"] += not group.is_unsharded and group._all_gather_result is None
        return unshard(*args, **kwargs)

    def counted_post_backward(*args, **kwargs):
        counts["reductions"] += group.reduce_grads
        return post_backward(*args, **kwargs)

    group.unshard, group.post_backward = counted_unshard, counted_post_backward


def shared_embedding_step(
    schedule: str,
    steps: int,
    exchange: bool = True,
    seed: int = 0,
    data_parallel: str = "none",
    dp: int = 1,
) -> dict[str, object]:
    """``steps`` AdamW steps of :class:`toy_lm.NextTokenLM` at pp = world/dp, whose last stage
    embeds the next tokens with the first stage's embedding (a copy on another rank), against
    one process in float64 running the dp·M micro-batches: the first step's losses, gradients
    (the embedding's summed over both stages, averaged over dp) and clipped norm, and at the
    end whether both stages' embeddings are equal bit for bit and equal to the reference's.
    The copy is perturbed before the split: the pipeline must start it from the first
    stage's. ``exchange=False`` skips the gradient sum. Under ``fsdp`` with the first and
    last chunks on one rank, each step's all-gathers and reductions of the embedding's own
    FSDP2 unit are counted."""
    pp, layers = dist.get_world_size() // dp, 4
    microbatches = 2 * pp if schedule == "dualpipev" else 2  # DualPipeV's minimum: 2·pp
    config = mp.ParallelConfig(
        pp=pp, dp=dp, pp_schedule=schedule, data_parallel=data_parallel,
        pp_microbatches=microbatches,
        pp_chunks=chunks_per_rank(schedule, 2 if schedule == "interleaved_1f1b" else 1),
    )  # fmt: skip
    state = mt_comm.init_parallel_state(dp=dp, pp=pp)

    def build() -> NextTokenLM:
        lm = NextTokenLM(VOCAB, DIM, layers, HEADS, KV_HEADS, FFN)
        mp.init_weights(lm, seed)
        return lm.double()

    reference, model = build(), build()
    if state.rank("pp") == pp - 1:
        with torch.no_grad():
            model.embed.weight.add_(1.0)
    module = mp.pipeline_module(model, config, state, SHARED_PLAN)
    holds_last = module.last_chunk is not None
    runner = mp.PipelineSchedule(
        module.pipeline_chunks, schedule, pp, state.rank("pp"), microbatches, config.pp_chunks,
        StageShapes(((BATCH, SEQ), torch.long), ((BATCH, SEQ, DIM), torch.float64),
                    ((BATCH, SEQ, VOCAB), torch.float64)),
        torch.device("cpu"), state.group("pp"), module.local_loss,
    )  # fmt: skip
    counts = {"gathers": 0, "reductions": 0}
    shared_unit = runner.shared_units.holders
    for unit in shared_unit:
        _count_shared_unit_work(unit, counts)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, module)]
    first: dict[str, object] = {}
    per_step = []
    for step in range(steps):
        tokens, targets = _batch(seed + 1 + step, dp * microbatches * BATCH, SEQ)
        rows = [slice(m * BATCH, (m + 1) * BATCH) for m in range(dp * microbatches)]
        nexts = [tokens[r].roll(-1, dims=1) for r in rows]
        ref_losses = []
        for row, next_tokens in zip(rows, nexts, strict=True):
            loss = reference.loss(reference(tokens[row], next_tokens_BT=next_tokens), targets[row])
            (loss / len(rows)).backward()
            ref_losses.append(loss.detach())
        mine = range(state.rank("dp") * microbatches, (state.rank("dp") + 1) * microbatches)
        kwargs = [{"next_tokens_BT": nexts[m]} if holds_last else {} for m in mine]
        counts.update(gathers=0, reductions=0)
        result = runner.step(
            [tokens[rows[m]] for m in mine], [targets[rows[m]] for m in mine], kwargs
        )
        per_step.append(dict(counts))
        if exchange:
            module.reduce_shared_gradients()
        # A clip below the norm: the coefficient depends on the norm counting each parameter once.
        ref_norm = mp.clip_grad_norm_(reference.parameters(), 0.5)
        norm = mp.clip_grad_norm_(
            list(module.parameters()), 0.5, mp_group=state.group("pp"),
            dp_cp_group=state.group("dp_cp"),
        )  # fmt: skip
        if step == 0:
            expected = dict(reference.named_parameters())
            first = {
                "grads": {
                    n: rel_err(whole_tensor(p.grad, state.group("dp_cp")), expected[n].grad)
                    for n, p in module.named_parameters()
                },
                "losses": [
                    rel_err(a, ref_losses[m]) for a, m in zip(result.losses, mine, strict=False)
                ],
                "norm": rel_err(norm, ref_norm),
            }
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    # Under the V schedules the first and last chunks (and the one embedding) share rank 0.
    embedding = None
    if hasattr(module, "embed"):
        embedding = whole_tensor(module.embed.weight.detach(), state.group("dp_cp"))
    peer = embedding
    if module.shared_peer is not None:
        peer = module._exchange(embedding.contiguous())
    return {
        **first,
        "holds_last": holds_last,
        "holds_embedding": embedding is not None,
        "copy_marked": [n for n, p in module.named_parameters() if getattr(p, "pipeline_copy", 0)],
        "copies_equal": embedding is None or bool(torch.equal(embedding, peer)),
        "embedding": 0.0 if embedding is None else rel_err(embedding, reference.embed.weight),
        "shared_units": [type(u).__name__ for u in shared_unit],
        "shared_unit_work": per_step if shared_unit else [],
    }


def shared_fsdp_without_custom_reduce_grad(schedule: str) -> dict[str, object]:
    """:func:`shared_embedding_step`'s setup (no step) under ``fsdp`` on a torch whose runtime
    takes no custom ``REDUCE_GRAD`` function (``_registers_reduce_grad`` answers False)."""
    registers = pipeline_runtime._registers_reduce_grad
    pipeline_runtime._registers_reduce_grad = lambda runtime, function: False
    try:
        return shared_embedding_step(schedule, steps=0, data_parallel="fsdp")
    finally:
        pipeline_runtime._registers_reduce_grad = registers


def _chunk_bytes(
    chunk: torch.nn.Module, stage: int, num_stages: int, loss_fn: Callable, split: bool
) -> tuple[int, int]:
    """One micro-batch through ``chunk`` alone under a fresh meter: the bytes its forward saves
    (with the loss, on the last chunk), and what torch's split backward keeps from ``I`` to
    ``W`` (its ``stage_backward_input``, as the stage runs it; on the first chunk the stage
    skips ``I``, so everything). Gradients it leaves are cleared."""
    tokens, targets = _batch(99, BATCH, SEQ)
    if stage == 0:
        inp = tokens.contiguous()
    else:
        inp = torch.randn(BATCH, SEQ, DIM, dtype=torch.float64, requires_grad=True)
    meter = ActivationMeter([*chunk.parameters(), *chunk.buffers()])
    with meter:
        out = chunk(inp)
        if stage == num_stages - 1:
            out = loss_fn(out, targets.contiguous())
    saved = kept = meter.bytes
    if split and stage > 0:
        grads = None if stage == num_stages - 1 else [torch.randn_like(out)]
        _, param_groups = stage_backward_input([out], grads, [inp], chunk.parameters())
        kept = meter.bytes  # the param groups hold the graph W runs
        del param_groups
    for param in chunk.parameters():
        param.grad = None
    return saved, kept


def activation_bytes(schedule: str, microbatches: int, chunks: int = 1) -> dict[str, object]:
    """One float64 step of ``schedule`` at pp = world under an :class:`ActivationMeter` (each
    chunk one toy-LM block): the most autograd-saved bytes this rank held, the bytes still
    held after the step, each of its chunks' bytes measured alone (:func:`_chunk_bytes`) and
    the action list the runtime ran."""
    pp = dist.get_world_size()
    v = chunks_per_rank(schedule, chunks)
    config = mp.ParallelConfig(
        pp=pp, data_parallel="none", pp_schedule=schedule, pp_chunks=chunks,
        pp_microbatches=microbatches,
    )  # fmt: skip
    state = mt_comm.init_parallel_state(pp=pp)
    model = _reference(pp * v, 0, torch.float64, False)
    chunk_modules = mp.pipeline_chunks(model, config, state, PLAN)
    shapes = StageShapes(((BATCH, SEQ), torch.long), ((BATCH, SEQ, DIM), torch.float64),
                         ((BATCH, SEQ, VOCAB), torch.float64))  # fmt: skip
    runner = mp.PipelineSchedule(
        chunk_modules, schedule, pp, state.rank("pp"), microbatches, chunks, shapes,
        torch.device("cpu"), state.group("pp"), model.loss,
    )  # fmt: skip
    split = SCHEDULES[schedule].split_backward
    per_chunk = {
        s: _chunk_bytes(c, s, pp * v, lambda x, y: model.loss(x, y) / microbatches, split)
        for s, c in zip(runner.stage_ids, chunk_modules, strict=True)
    }
    tokens, targets = _batch(1, microbatches * BATCH, SEQ)
    rows = [slice(k * BATCH, (k + 1) * BATCH) for k in range(microbatches)]
    meter = ActivationMeter([t for c in chunk_modules for t in (*c.parameters(), *c.buffers())])
    with meter:
        runner.step([tokens[r] for r in rows], [targets[r] for r in rows])
    return {
        "pp_rank": state.rank("pp"),
        "measured_peak": meter.peak,
        "left": meter.bytes,
        "chunk_bytes": per_chunk,
        "actions": [str(a) for a in runner.actions[state.rank("pp")]],
    }


def _chunk_bytes_through_sink(
    chunk: torch.nn.Module, stage: int, num_stages: int, loss_fn: Callable, **kwargs: object
) -> tuple[int, int, int]:
    """:func:`_chunk_bytes` where the chunk's layers queue their weight gradients in their
    sink (the runtime's): the bytes the forward saves, what the sink's closures hold after the
    chunk's whole backward (torch's ``stage_backward``, as ``I`` runs it then), and the most
    that backward rose above its start. The closures are then run and freed, as ``W`` does.
    ``kwargs`` go to the chunk's forward."""
    (sink,) = {id(m.wgrad_sink): m.wgrad_sink for m in chunk.modules()
               if getattr(m, "wgrad_sink", None) is not None}.values()  # fmt: skip
    tokens, targets = _batch(99, BATCH, SEQ)
    if stage == 0:
        inp = tokens.contiguous()
    else:
        inp = torch.randn(BATCH, SEQ, DIM, dtype=torch.float64, requires_grad=True)
    meter = ActivationMeter([*chunk.parameters(), *chunk.buffers()], [sink])
    with meter:
        out = chunk(inp, **kwargs)
        if stage == num_stages - 1:
            out = loss_fn(out, targets.contiguous())
        saved = meter.bytes
        meter.reset_peak()
        grads = None if stage == num_stages - 1 else torch.randn_like(out)
        stage_backward(out, grads, [inp] if stage > 0 else [])
        del out, grads, inp
        kept, rise = meter.bytes, meter.peak - saved
        sink.take()()
        assert meter.bytes == 0, meter.bytes
    for param in chunk.parameters():
        param.grad = None
    return saved, kept, rise


def activation_bytes_deferred(
    schedule: str,
    microbatches: int,
    sinks: bool,
    overlap: bool,
    moe: bool = False,
    recompute: str = "none",
) -> dict[str, object]:
    """:func:`activation_bytes` for the split-backward schedules where the meter counts what
    it did not before: with ``sinks`` the runtime built as on a torch whose split backward is
    wrong (every linear queues its weight gradient in a sink, watched by the meter), with
    ``overlap`` DualPipeV's overlap function registered (its forward half on a thread of its
    own; no all-to-all to interleave at here, so the forward runs whole, then the backward).
    With ``moe`` (and ``sinks``) the blocks' MLPs are MoE layers, their routers and experts
    deferring too, their auxiliary losses carried. With ``recompute="full"`` (and ``sinks``)
    the blocks are recomputed whole and the runtime's own reason for sinks is the one taken
    (torch's split left as this torch has it). Each chunk's bytes are measured alone
    (``saved``, ``kept``, ``rise``); a second step runs under the meter as it was before (no
    sink watched, no hooks on the overlap thread)."""
    pp = dist.get_world_size()
    v = chunks_per_rank(schedule, 1)
    config = mp.ParallelConfig(
        pp=pp, data_parallel="none", pp_schedule=schedule, pp_microbatches=microbatches,
        recompute=recompute,
    )  # fmt: skip
    state = mt_comm.init_parallel_state(pp=pp)
    model = _reference(pp * v, 0, torch.float64, False, moe)
    chunk_modules = mp.pipeline_chunks(model, config, state, PLAN)
    shapes = StageShapes(((BATCH, SEQ), torch.long), ((BATCH, SEQ, DIM), torch.float64),
                         ((BATCH, SEQ, VOCAB), torch.float64))  # fmt: skip
    with (
        mock.patch.object(
            pipeline_runtime,
            "TORCH_SPLITS_BACKWARD",
            pipeline_runtime.TORCH_SPLITS_BACKWARD if recompute == "full" else not sinks,
        ),
        mock.patch.object(pipeline_runtime, "overlaps_all_to_all", lambda chunks: overlap),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")  # the older-torch warning: the embedding stays at I
        runner = mp.PipelineSchedule(
            chunk_modules, schedule, pp, state.rank("pp"), microbatches, 1, shapes,
            torch.device("cpu"), state.group("pp"), model.loss,
        )  # fmt: skip
    assert runner.overlaps == overlap and (len(runner.sinks) == len(chunk_modules)) == sinks

    def loss_fn(x, y):
        return model.loss(x, y) / microbatches

    per_chunk = {}
    for s, chunk in zip(runner.stage_ids, chunk_modules, strict=True):
        if sinks:
            aux = {"aux_loss_scale": mp.moe.AuxLossScale(0, 1 / microbatches)} if moe else {}
            per_chunk[s] = _chunk_bytes_through_sink(chunk, s, pp * v, loss_fn, **aux)
        else:
            per_chunk[s] = (*_chunk_bytes(chunk, s, pp * v, loss_fn, True), 0)
    tokens, targets = _batch(1, microbatches * BATCH, SEQ)
    rows = [slice(k * BATCH, (k + 1) * BATCH) for k in range(microbatches)]
    exclude = [t for c in chunk_modules for t in (*c.parameters(), *c.buffers())]
    meter = ActivationMeter(exclude, runner.sinks)
    with meter:
        runner.step([tokens[r] for r in rows], [targets[r] for r in rows])
    before = ActivationMeter(exclude)
    no_hooks_on_other_threads = mock.patch.object(
        torch._C._autograd, "_top_saved_tensors_default_hooks", lambda ignore_tracing: None
    )
    with before, no_hooks_on_other_threads:
        runner.step([tokens[r] for r in rows], [targets[r] for r in rows])
    return {
        "pp_rank": state.rank("pp"),
        "measured_peak": meter.peak,
        "peak_before": before.peak,
        "left": meter.bytes,
        "chunk_bytes": per_chunk,
        "actions": [str(a) for a in runner.actions[state.rank("pp")]],
    }
