"""Pipeline schedules as per-rank action lists, in ``torch.distributed.pipelining``'s format.

A schedule is ``{rank: [action, ...]}``: each rank's ordered compute actions, each an
``_Action(stage, kind, micro_batch)`` of torch's schedule IR, where ``stage`` is the global chunk
index (``0 … S−1``, ``S = pp·v`` for ``v`` chunks per rank) and ``kind`` one of

* ``F`` forward of one micro-batch through one chunk;
* ``B`` full backward (input and weight gradients);
* ``I`` input gradient only; ``W`` weight gradient only (split-backward schedules);
* ``OVERLAP_F_B`` a forward and a full backward of two chunks issued together (DualPipeV).

This is the list ``torch``'s ``_PipelineScheduleRuntime`` executes; :func:`lower_with_comms`
adds ``SEND_F/RECV_F/SEND_B/RECV_B`` with torch's own lowering, and :mod:`.simulate` times it.

Invariants (:func:`check_actions`, enforced on every generated schedule): every stage runs on
one rank; per (stage, micro-batch) exactly one ``F`` and either one ``B`` or one ``I`` followed
by one ``W``, in the order ``F < B`` and ``F < I < W`` on that rank; and the whole schedule
runs to completion when every action waits for its producers (``F(s, m)`` for ``F(s−1, m)``,
``B/I(s, m)`` for ``B/I(s+1, m)``), which :func:`mt_parallel.pipeline.simulate.simulate`
checks. A schedule with fewer micro-batches than it needs is refused with
:class:`ValueError` (torch's runtime would hang or index missing micro-batches).

Where the lists come from. Interleaved 1F1B, interleaved zero bubble (ZB-H1 at ``v = 1``),
ZBV and DualPipeV are torch 2.13's own generators (``_calculate_single_rank_operations``),
called unchanged; what we change is said at each name in :data:`SCHEDULES`:

* GPipe and 1F1B: torch runs them outside the action runtime (``PipelineScheduleSingle``);
  we run their ``_get_pipeline_order`` lists on the same runtime as the others, so every
  schedule shares one executor, one gradient path and one simulator. The lists are equal to
  torch's (same order, without its ``None`` padding and ``REDUCE_GRAD``), except on 1F1B's last
  rank: torch's drawn list numbers that rank's forwards from 1 (``F1 B0 F2 B1 …`` up to the
  non-existent ``F{m}``, an off-by-one when the rank has no warm-up forward); ours runs
  ``F0 B0 F1 B1 …``.
* Every schedule: torch pads lists with ``None`` to draw them on a common time axis; the runtime
  skips ``None``, so we drop it (the simulator computes time from dependencies instead).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
from torch.distributed.pipelining.schedules import _Action, _ComputationType

Action = _Action
"""One entry of a schedule: torch's ``_Action(stage_index, computation_type, microbatch_index,
sub_actions)``."""
ActionKind = _ComputationType

# torch's IR letters (F forward, B full backward, I input gradient, W weight gradient)
F, B, W = ActionKind.FORWARD, ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_WEIGHT
I = ActionKind.BACKWARD_INPUT  # noqa: E741
OVERLAP = ActionKind.OVERLAP_F_B
Schedule = dict[int, list[Action]]


@dataclass(frozen=True)
class ScheduleSpec:
    """What a schedule needs and how its chunks sit on the ranks."""

    name: str
    chunks_per_rank: int | None
    """Chunks each rank holds (``None``: any ``v ≥ 2``, the interleaved schedules)."""
    style: str
    """Stage-to-rank mapping: ``loop`` (stage ``s`` on rank ``s mod pp``) or ``v`` (rank ``r``
    holds stages ``r`` and ``2·pp−1−r``)."""
    split_backward: bool
    """Whether the schedule separates input and weight gradients (``I``/``W``)."""
    description: str


SCHEDULES: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec("gpipe", 1, "loop", False, "all forwards, then all backwards"),
        ScheduleSpec("1f1b", 1, "loop", False, "p−1−r warm-up forwards, then one F one B"),
        ScheduleSpec(
            "interleaved_1f1b", None, "loop", False, "1F1B over v chunks per rank (Megatron)"
        ),
        ScheduleSpec(
            "zero_bubble", None, "loop", True,
            "ZB-H1 at v=1 (W of micro-batch k deferred by r steps), interleaved ZB at v>1",
        ),
        ScheduleSpec("zbv", 2, "v", True, "zero-bubble V: two chunks per rank in a V"),
        ScheduleSpec(
            "dualpipev", 2, "v", True, "DeepSeek's DualPipeV: overlapped F/B pairs in a V"
        ),
    )
}  # fmt: skip


SPLIT_BACKWARD_REFUSES_COMPILE = tuple(n for n, spec in SCHEDULES.items() if spec.split_backward)
"""Schedules whose torch classes refuse compiled stages (``_check_torch_compile_compatibility``)."""


def spec_of(schedule: str) -> ScheduleSpec:
    """The :class:`ScheduleSpec` named ``schedule``; an unknown name lists the valid ones."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
    return SCHEDULES[schedule]


def chunks_per_rank(schedule: str, chunks: int) -> int:
    """The number of model chunks per rank ``schedule`` runs, given ``chunks`` asked for;
    raises when the schedule cannot use that many."""
    spec = spec_of(schedule)
    if spec.chunks_per_rank is None:
        if chunks < 1:
            raise ValueError(f"{schedule} needs pp_chunks ≥ 1, got {chunks}")
        if schedule == "interleaved_1f1b" and chunks < 2:
            raise ValueError(
                f"interleaved_1f1b needs pp_chunks ≥ 2 chunks per rank, got {chunks} "
                "(with one chunk per rank it is 1f1b)"
            )
        return chunks
    if chunks not in (1, spec.chunks_per_rank):
        raise ValueError(
            f"{schedule} holds exactly {spec.chunks_per_rank} chunk(s) per rank, got "
            f"pp_chunks={chunks}"
        )
    return spec.chunks_per_rank


def stage_to_rank(schedule: str, pp: int, chunks: int) -> dict[int, int]:
    """Global chunk (stage) index → pipeline rank."""
    v = chunks_per_rank(schedule, chunks)
    return generate_stage_to_rank_mapping(pp, pp * v, style=spec_of(schedule).style)


def rank_stages(schedule: str, pp: int, chunks: int, rank: int) -> list[int]:
    """The global chunk indices ``rank`` holds, ascending."""
    return sorted(s for s, r in stage_to_rank(schedule, pp, chunks).items() if r == rank)


def minimum_microbatches(schedule: str, pp: int, chunks: int = 1) -> int:
    """The fewest micro-batches ``schedule`` runs at ``pp`` ranks.

    GPipe runs any count. The others need ``m ≥ pp`` (1F1B's warm-up alone issues ``pp−1``
    forwards; torch's interleaved schedules hang below it, torchtitan#775); DualPipeV needs
    ``m ≥ 2·pp`` (its warm-up fills both legs of the V, as torch's constructor demands).
    """
    v = chunks_per_rank(schedule, chunks)
    if schedule == "gpipe" or pp == 1:
        return 1
    if schedule == "dualpipev":
        return pp * v
    return pp


def check_microbatches(schedule: str, pp: int, microbatches: int, chunks: int = 1) -> None:
    """Raise a :class:`ValueError` naming the values when ``microbatches`` cannot run."""
    need = minimum_microbatches(schedule, pp, chunks)
    if microbatches < need:
        raise ValueError(
            f"pipeline schedule {schedule} at pp={pp} needs at least {need} micro-batches per "
            f"step, got {microbatches} (torch's runtime would hang): raise the micro-batch "
            "count (global_batch_size / (micro_batch_size · dp)) or use gpipe"
        )
    v = chunks_per_rank(schedule, chunks)
    if schedule in ("interleaved_1f1b", "zero_bubble") and pp > 1 and v > 1:
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise ValueError(
                f"{schedule} with {v} chunks per rank runs micro-batches in rounds of "
                f"{microbatches // rounds}: {microbatches} micro-batches is not a multiple of "
                f"{rounds} rounds (use a multiple of pp={pp})"
            )


def _torch_rank_ops(
    generator: Callable[[object, int], list], state: SimpleNamespace, pp: int
) -> Schedule:
    return {rank: [a for a in generator(state, rank) if a is not None] for rank in range(pp)}


def _gpipe(pp: int, m: int) -> Schedule:
    return {r: [Action(r, F, k) for k in range(m)] + [Action(r, B, k) for k in range(m)]
            for r in range(pp)}  # fmt: skip


def _one_f_one_b(pp: int, m: int) -> Schedule:
    order: Schedule = {}
    for r in range(pp):
        warmup = min(pp - 1 - r, m)
        actions = [Action(r, F, k) for k in range(warmup)]
        for k in range(m - warmup):
            actions += [Action(r, F, warmup + k), Action(r, B, k)]
        actions += [Action(r, B, k) for k in range(m - warmup, m)]
        order[r] = actions
    return order


def schedule_actions(schedule: str, pp: int, microbatches: int, chunks: int = 1) -> Schedule:
    """Each rank's compute actions for ``schedule`` (module docstring), checked."""
    v = chunks_per_rank(schedule, chunks)
    if pp < 1:
        raise ValueError(f"pp={pp} must be a positive integer")
    check_microbatches(schedule, pp, microbatches, chunks)
    m, stages = microbatches, pp * v
    rounds = max(1, m // pp)
    if schedule == "gpipe":
        order = _gpipe(pp, m)
    elif schedule == "1f1b":
        order = _one_f_one_b(pp, m)
    elif schedule in ("interleaved_1f1b", "zero_bubble"):
        cls = (
            torch_schedules.ScheduleInterleaved1F1B
            if schedule == "interleaved_1f1b"
            else torch_schedules.ScheduleInterleavedZeroBubble
        )
        state = SimpleNamespace(
            n_local_stages=v, pp_group_size=pp, _n_microbatches=m,
            microbatches_per_round=m // rounds,
        )  # fmt: skip
        order = _torch_rank_ops(cls._calculate_single_rank_operations, state, pp)
    elif schedule == "zbv":
        state = SimpleNamespace(pp_group_size=pp, _n_microbatches=m, num_stages=stages)
        order = _torch_rank_ops(
            torch_schedules.ScheduleZBVZeroBubble._calculate_single_rank_operations, state, pp
        )
    else:
        state = SimpleNamespace(pp_group_size=pp, _n_microbatches=m, num_stages=stages)
        order = _torch_rank_ops(
            torch_schedules.ScheduleDualPipeV._calculate_single_rank_operations, state, pp
        )
    check_actions(order, stage_to_rank(schedule, pp, chunks), m)
    return order


def leaf_actions(action: Action) -> tuple[Action, ...]:
    """The compute actions an entry stands for (the two halves of an ``OVERLAP_F_B``)."""
    return action.sub_actions if action.sub_actions is not None else (action,)


def check_actions(order: Schedule, placement: dict[int, int], microbatches: int) -> None:
    """Raise :class:`ValueError` unless every (stage, micro-batch) runs ``F`` then ``B``, or
    ``F`` then ``I`` then ``W``, exactly once each, on the rank that holds the stage."""
    done: dict[tuple[int, int], list[ActionKind]] = {}
    follows = {F: [], B: [F], I: [F], W: [F, I]}
    for rank, actions in order.items():
        for position, entry in enumerate(actions):
            for a in leaf_actions(entry):
                kind = a.computation_type
                expected = follows.get(kind)
                problem = None
                if placement.get(a.stage_index) != rank:
                    problem = f"stage {a.stage_index} is not on rank {rank}"
                elif a.microbatch_index is None or not 0 <= a.microbatch_index < microbatches:
                    problem = f"micro-batch outside 0..{microbatches - 1}"
                elif expected is None:
                    problem = f"{kind.value} is not a compute action"
                else:
                    seen = done.setdefault((a.stage_index, a.microbatch_index), [])
                    if seen != expected:
                        problem = f"follows {[k.value for k in seen]}"
                if problem is not None:  # the message is built only for a bad list
                    raise ValueError(f"rank {rank} action {position} ({a}): {problem}")
                seen.append(kind)
    for stage in placement:
        for k in range(microbatches):
            seen = done.get((stage, k), [])
            if seen not in ([F, B], [F, I, W]):
                raise ValueError(
                    f"stage {stage} micro-batch {k} ran {[x.value for x in seen]}, "
                    "expected F,B or F,I,W"
                )


def lower_with_comms(order: Schedule, placement: dict[int, int]) -> Schedule:
    """``order`` with torch's send/receive actions added (``_add_send_recv``: a receive is
    placed on the receiving rank when its sender's action is issued, so every pair of ranks
    posts matching operations in the same order)."""
    copy = {rank: list(actions) for rank, actions in order.items()}
    return torch_schedules._add_send_recv(
        copy, stage_to_rank=lambda s: placement[s], num_stages=len(placement)
    )
