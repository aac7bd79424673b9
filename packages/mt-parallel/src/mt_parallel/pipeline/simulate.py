"""Simulated time of a schedule's action lists: bubble fraction and in-flight activations.

Model. Each rank executes its list in order, one action at a time. An action starts when its
rank is free and its producers have finished (``F(s, m)`` after ``F(s−1, m)``; ``B``/``I(s, m)``
after ``B``/``I(s+1, m)``, or after ``F(S−1, m)`` on the last stage; ``W(s, m)`` after
``I(s, m)``; for an ``OVERLAP_F_B`` both halves' producers). Transfers take no time. Costs are
per chunk: ``F``, ``I`` (input gradient), ``W`` (weight gradient); a full backward ``B`` costs
``I + W``; an overlapped pair costs ``overlap(F, B)``, by default ``F + I + W``: torch runs the
halves one after the other, and :mod:`.overlap` (MoE with ep > 1) hides only all-to-all time,
which these per-chunk compute costs do not separate. One :class:`ChunkCosts` prices every
stage alike; a sequence (or mapping) of one per stage index prices uneven stages (an uneven
layer split, the embedding on the first stage and the head on the last): an action takes its
own stage's cost, and a pair ``overlap(F_s, B_t)`` of its forward stage ``s`` and backward
stage ``t``, with stage ``s``'s ``overlap``.

Outputs, for a makespan ``T`` (the last action's end, all ranks starting at 0):

* ``bubble_fraction = 1 − Σ_r busy_r / (p · T)``: the idle share of all ranks' time. For 1F1B
  with equal chunks it is ``(p−1)/(m+p−1)``; the idle time per rank is the published bubble
  (1F1B ``(p−1)(F+B)``, ZB-H1 ``(p−1)(F+B−2W)`` with ``B`` the full backward).
* ``peak_activations[r]``: the most micro-batch chunks on rank ``r`` whose forward has run and
  whose input-gradient backward (``B`` or ``I``) has not, in units of one whole stage's
  activations for one micro-batch (a chunk of ``v`` per rank counts ``1/v``). What ``W`` still
  needs (the layer inputs of the weight GEMMs) is not counted; under torch's split backward
  that is nearly everything, and :func:`mt_parallel.pipeline.predicted_peak_bytes` counts it
  (:mod:`.memory`).

If no rank can start its next action the schedule deadlocks and :class:`ValueError` says where.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from mt_parallel.pipeline.schedules import B, F, I, Schedule, W, leaf_actions


@dataclass(frozen=True)
class ChunkCosts:
    """Time of one micro-batch through one chunk (any unit)."""

    forward: float = 1.0
    input_grad: float = 1.0
    weight_grad: float = 1.0
    overlap: Callable[[float, float], float] | None = None
    """Time of an overlapped forward + full backward, given both; None: their sum."""

    @property
    def full_backward(self) -> float:
        return self.input_grad + self.weight_grad

    def of(self, kind: object) -> float:
        return {F: self.forward, B: self.full_backward, I: self.input_grad,
                W: self.weight_grad}[kind]  # fmt: skip

    def pair(self, backward: ChunkCosts | None = None) -> float:
        """An overlapped forward of this chunk and full backward of ``backward`` (None: this
        chunk), with this chunk's ``overlap``."""
        full_backward = (backward or self).full_backward
        if self.overlap is None:
            return self.forward + full_backward
        return self.overlap(self.forward, full_backward)


StageCosts = ChunkCosts | Sequence[ChunkCosts] | Mapping[int, ChunkCosts]
"""One cost for every stage, or one per stage index (module docstring)."""


def per_stage_costs(costs: StageCosts | None, num_stages: int) -> list[ChunkCosts]:
    """``costs`` as one :class:`ChunkCosts` per stage ``0..num_stages−1``."""
    if costs is None or isinstance(costs, ChunkCosts):
        return [costs or ChunkCosts()] * num_stages
    if isinstance(costs, Mapping):
        if sorted(costs) != list(range(num_stages)):
            raise ValueError(
                f"per-stage costs are given for stages {sorted(costs)}; the schedule has "
                f"stages 0..{num_stages - 1} (one ChunkCosts each)"
            )
        listed = [costs[s] for s in range(num_stages)]
    else:
        listed = list(costs)
        if len(listed) != num_stages:
            raise ValueError(
                f"{len(listed)} per-stage costs for a schedule of {num_stages} stages "
                "(one ChunkCosts each)"
            )
    wrong = [type(c).__name__ for c in listed if not isinstance(c, ChunkCosts)]
    if wrong:
        raise ValueError(f"per-stage costs must be ChunkCosts, got {', '.join(wrong)}")
    return listed


@dataclass
class Simulation:
    """The timed run of a schedule (module docstring)."""

    makespan: float
    busy: dict[int, float]
    bubble_fraction: float
    idle: dict[int, float]
    """``T − busy_r`` per rank."""
    peak_activations: dict[int, float]
    timeline: dict[int, list[tuple[float, float, str]]]
    """Per rank: (start, end, action) in execution order."""


def _producers(action, num_stages: int) -> list[tuple[int, object, int]]:
    s, kind, k = action.stage_index, action.computation_type, action.microbatch_index
    if kind == F:
        return [] if s == 0 else [(s - 1, F, k)]
    if kind in (B, I):
        return [(s, F, k)] if s == num_stages - 1 else [(s + 1, "grad", k)]
    return [(s, I, k)]


def simulate(
    order: Schedule, num_stages: int, costs: StageCosts | None = None, chunks_per_rank: int = 1
) -> Simulation:
    """Time ``order`` (compute actions per rank, :mod:`.schedules`) under ``costs``: one
    :class:`ChunkCosts` for every stage (None: unit costs) or one per stage index."""
    stage_costs = per_stage_costs(costs, num_stages)
    finished: dict[tuple[int, object, int], float] = {}
    position = dict.fromkeys(order, 0)
    clock = dict.fromkeys(order, 0.0)
    busy = dict.fromkeys(order, 0.0)
    live = dict.fromkeys(order, 0)
    peak = dict.fromkeys(order, 0)
    timeline: dict[int, list[tuple[float, float, str]]] = {r: [] for r in order}
    remaining = sum(len(a) for a in order.values())
    while remaining:
        progressed = False
        for rank, actions in order.items():
            while position[rank] < len(actions):
                entry = actions[position[rank]]
                leaves = leaf_actions(entry)
                needs = [p for a in leaves for p in _producers(a, num_stages)]
                if any(n not in finished for n in needs):
                    break
                start = max([clock[rank], *(finished[n] for n in needs)])
                if len(leaves) > 1:  # the forward half's stage, then the backward half's
                    fwd, bwd = sorted(leaves, key=lambda a: a.computation_type != F)
                    cost = stage_costs[fwd.stage_index].pair(stage_costs[bwd.stage_index])
                else:
                    cost = stage_costs[entry.stage_index].of(entry.computation_type)
                end = start + cost
                for a in leaves:
                    s, kind, k = a.stage_index, a.computation_type, a.microbatch_index
                    finished[(s, kind, k)] = end
                    if kind in (B, I):
                        finished[(s, "grad", k)] = end
                        live[rank] -= 1
                    elif kind == F:
                        live[rank] += 1
                        peak[rank] = max(peak[rank], live[rank])
                clock[rank], busy[rank] = end, busy[rank] + cost
                timeline[rank].append((start, end, str(entry)))
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(a[position[r]]) for r, a in order.items() if position[r] < len(a)}
            raise ValueError(f"schedule deadlocks: each rank waits at {stuck}")
    makespan = max(clock.values())
    total_busy = sum(busy.values())
    return Simulation(
        makespan=makespan,
        busy=busy,
        bubble_fraction=1.0 - total_busy / (len(order) * makespan),
        idle={r: makespan - b for r, b in busy.items()},
        peak_activations={r: n / chunks_per_rank for r, n in peak.items()},
        timeline=timeline,
    )
