"""The pipeline-parallel form of a model: this rank's chunks, each made parallel.

``pipeline_chunks(model, config, state, plan, fp8)`` is :func:`mt_parallel.parallelize` for
``config.pp > 1``: it cuts the plain model into ``pp·v`` chunks by the plan's
:class:`~mt_parallel.pipeline.split.PipelineLayout` (:func:`split_model`; ``v`` chunks per
rank from the schedule), keeps this pipeline rank's (loop placement ``s mod pp``, or the V of
``zbv``/``dualpipev``: rank ``r`` holds ``r`` and ``2·pp−1−r``), and runs the usual transform
path on each (TP/SP → EP → CP → FP8 → recompute → compile). No DDP wrapper: the caller
reduces gradients over dp×cp after the schedule (all-reduce for ``ddp``/``none``, the experts
split over ``ep`` over their expert-data-parallel group instead, ZeRO-1's reduce-scatter for
``zero1``; torch's zero-bubble schedules skip DDP's hooks, pytorch#144530). Under ``fsdp``
each chunk is its own FSDP2 root (blocks, expert units and the chunk, as at ``pp = 1``) with
``reshard_after_forward=False``, as torchtitan shards its pipeline stages; torch's pipeline
runtime drives it: it all-gathers a chunk's parameters before its first action of the step
(``UNSHARD``), accumulates the micro-batches' gradients unreduced, and reduce-scatters them
after the chunk's last backward (``REDUCE_GRAD``; a torch without that action is refused in one
line). A module two chunks of this rank hold (the V schedules put the first and last chunks
on one rank, and a layout's ``last_shared`` modules are in both) is transformed once, with the
first of them, and under ``fsdp`` is an FSDP2 unit of its own, reduced once per step after
both chunks' backwards (:mod:`mt_parallel.pipeline.shared_fsdp`). The output head is named in
the plan only on the last chunk.
:func:`pipeline_module` wraps the chunks in a :class:`PipelineModule` (the whole model's
parameter names; a forward-only pipelined ``forward`` for evaluation and sampling).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.pipelining.schedules import _ComputationType

from mt_comm import ParallelState
from mt_parallel.config import ParallelConfig
from mt_parallel.parallelize import FP8Options, ParallelizePlan, parallelize
from mt_parallel.pipeline.module import PipelineModule
from mt_parallel.pipeline.schedules import chunks_per_rank, rank_stages, stage_to_rank
from mt_parallel.pipeline.shared_fsdp import shard_chunks
from mt_parallel.pipeline.split import PipelineChunk, detached, split_model


def pipeline_chunks(
    model: nn.Module,
    config: ParallelConfig,
    state: ParallelState,
    plan: ParallelizePlan,
    fp8: FP8Options | None = None,
) -> list[PipelineChunk]:
    """This pipeline rank's chunks of ``model``, parallelized (module docstring)."""
    if plan.pipeline is None:
        raise ValueError(
            f"{type(model).__name__}'s ParallelizePlan has no pipeline layout "
            "(plan.pipeline): it cannot be cut into pipeline stages"
        )
    v = chunks_per_rank(config.pp_schedule, config.pp_chunks)
    stage_ids = rank_stages(config.pp_schedule, config.pp, v, state.rank("pp"))
    if config.data_parallel == "fsdp" and not hasattr(_ComputationType, "REDUCE_GRAD"):
        raise ValueError(
            f"parallel.data_parallel=fsdp with pp > 1 needs a torch whose pipeline runtime "
            f"reduces FSDP2 gradients with its REDUCE_GRAD action; torch {torch.__version__} "
            f"has none: use ddp, zero1 or none, or a newer torch"
        )
    chunks = split_model(model, plan.pipeline, stage_ids, config.pp * v, config.pp_layers or None)
    transformed: set[int] = set()
    for chunk in chunks:
        chunk_plan = plan if chunk.last else dataclasses.replace(plan, output_head=None)
        # A module an earlier chunk of this rank holds too is already parallel (TP would cut
        # its shard again).
        again = [p for p in chunk.held_paths if id(chunk.get_submodule(p)) in transformed]
        with detached(chunk, again):
            parallelize(chunk, config, state, chunk_plan, fp8, data_parallel="none")
        transformed.update(id(chunk.get_submodule(p)) for p in chunk.held_paths)
    if config.data_parallel == "fsdp":
        shard_chunks(chunks, state.group("dp_cp"), state.device_type, plan.block_types)
    return chunks


def pipeline_module(
    model: nn.Module,
    config: ParallelConfig,
    state: ParallelState,
    plan: ParallelizePlan,
    fp8: FP8Options | None = None,
) -> PipelineModule:
    """:func:`pipeline_chunks` as one :class:`PipelineModule` (the whole model's names)."""
    chunks = pipeline_chunks(model, config, state, plan, fp8)
    v = chunks_per_rank(config.pp_schedule, config.pp_chunks)
    assert plan.pipeline is not None
    return PipelineModule(
        chunks, plan.pipeline, rank_stages(config.pp_schedule, config.pp, v, state.rank("pp")),
        stage_to_rank(config.pp_schedule, config.pp, v), state.ranks("pp"), state.group("pp"),
    )  # fmt: skip
