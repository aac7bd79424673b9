"""Pipeline parallelism: schedules as torch action lists, their simulator, model splitting, the
runtime that executes them (``torch.distributed.pipelining``), the activation memory a schedule
holds, measured and predicted (:mod:`.memory`), DualPipeV's overlapped
forward/backward pairs (:mod:`.overlap`) and FSDP2 for a module two chunks of a rank share
(:mod:`.shared_fsdp`)."""

from mt_parallel.pipeline.memory import ActivationMeter, predicted_peak_bytes
from mt_parallel.pipeline.module import PipelineModule
from mt_parallel.pipeline.parallelize import pipeline_chunks, pipeline_module
from mt_parallel.pipeline.runtime import PipelineSchedule, PipelineStepResult, StageShapes
from mt_parallel.pipeline.schedules import (
    SCHEDULES,
    Action,
    ActionKind,
    ScheduleSpec,
    check_actions,
    check_microbatches,
    chunks_per_rank,
    lower_with_comms,
    minimum_microbatches,
    rank_stages,
    schedule_actions,
    stage_to_rank,
)
from mt_parallel.pipeline.simulate import ChunkCosts, Simulation, simulate
from mt_parallel.pipeline.split import PipelineChunk, PipelineLayout, split_layers, split_model

__all__ = [
    "SCHEDULES",
    "Action",
    "ActivationMeter",
    "ActionKind",
    "ChunkCosts",
    "PipelineChunk",
    "PipelineLayout",
    "PipelineModule",
    "PipelineSchedule",
    "PipelineStepResult",
    "ScheduleSpec",
    "Simulation",
    "StageShapes",
    "check_actions",
    "check_microbatches",
    "chunks_per_rank",
    "lower_with_comms",
    "minimum_microbatches",
    "pipeline_chunks",
    "pipeline_module",
    "predicted_peak_bytes",
    "rank_stages",
    "schedule_actions",
    "simulate",
    "split_layers",
    "split_model",
    "stage_to_rank",
]
