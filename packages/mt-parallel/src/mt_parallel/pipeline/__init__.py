"""Pipeline parallelism: schedules as torch action lists, their simulator, model splitting and
the runtime that executes them (``torch.distributed.pipelining``)."""

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

__all__ = [
    "SCHEDULES",
    "Action",
    "ActionKind",
    "ChunkCosts",
    "ScheduleSpec",
    "Simulation",
    "check_actions",
    "check_microbatches",
    "chunks_per_rank",
    "lower_with_comms",
    "minimum_microbatches",
    "rank_stages",
    "schedule_actions",
    "simulate",
    "stage_to_rank",
]
