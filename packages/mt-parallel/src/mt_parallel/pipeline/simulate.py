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
* ``critical_path``: a chain of entries, each starting when the one before it ends (on its rank,
  or as its producer), from one starting at 0 to the one ending at ``T``: their costs sum to
  ``T``, so ``T`` is linear in the costs of the chain's actions for as long as this chain stays
  the longest (where several tie, the rank's own previous entry is taken).
* ``peak_activations[r]``: the most micro-batch chunks on rank ``r`` whose forward has run and
  whose input-gradient backward (``B`` or ``I``) has not, in units of one whole stage's
  activations for one micro-batch (a chunk of ``v`` per rank counts ``1/v``). What ``W`` still
  needs (the layer inputs of the weight GEMMs) is not counted.
* ``peak_activations_until_w[r]``: the same count with each chunk held from its forward to its
  weight gradient (``W``, or a full backward ``B``). Under torch's split backward a chunk
  without a weight-gradient sink keeps nearly everything from ``I`` to ``W`` (:mod:`.memory`),
  so this is what such a rank holds: ZB-H1 ``p`` chunks on every rank where the first count
  is ``p − r``. Schedules without ``I``/``W`` (GPipe, 1F1B, interleaved 1F1B) give both counts
  alike. :func:`mt_parallel.pipeline.predicted_peak_bytes` with ``k_s = a_s`` is ``a`` times
  this count, with ``k_s = 0`` ``a`` times the first.

If no rank can start its next action the schedule deadlocks and :class:`ValueError` says where.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from mt_parallel.pipeline.schedules import Action, B, F, I, Schedule, W, leaf_actions


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
    """Per rank: the most chunks held from ``F`` to ``I`` or ``B`` (module docstring)."""
    peak_activations_until_w: dict[int, float]
    """Per rank: the most chunks held from ``F`` to ``W`` or ``B`` (module docstring)."""
    timeline: dict[int, list[tuple[float, float, str]]]
    """Per rank: (start, end, action) in execution order."""
    critical_path: list[Action]
    """Entries whose costs sum to the makespan, in execution order (module docstring)."""


def _producers(action, num_stages: int) -> list[tuple[int, object, int]]:
    s, kind, k = action.stage_index, action.computation_type, action.microbatch_index
    if kind == F:
        return [] if s == 0 else [(s - 1, F, k)]
    if kind in (B, I):
        return [(s, F, k)] if s == num_stages - 1 else [(s + 1, "grad", k)]
    return [(s, I, k)]


@dataclass(frozen=True)
class _Step:
    """One entry of a rank's list with what timing it needs, worked out once."""

    entry: Action
    label: str
    needs: tuple[tuple[int, object, int], ...]
    """The (stage, kind, micro-batch) results it waits for."""
    done: tuple[tuple[int, object, int], ...]
    """The results it produces (a backward also its input gradient, ``"grad"``)."""
    live: tuple[int, int]
    """Change of the rank's in-flight micro-batch chunks, counted to ``I`` and to ``W``."""
    rise: tuple[int, int] | None
    """The most those changes reach right after one of its forwards (None: no forward)."""
    price: tuple[int, object, int | None]
    """``(stage, kind, None)``, or for a pair ``(forward stage, F, backward stage)``."""


@dataclass(frozen=True)
class PreparedSchedule:
    """A schedule's action lists with each entry's producers, results and label worked out,
    for timing the same lists under many costs (:func:`prepare`)."""

    order: Schedule
    num_stages: int
    steps: dict[int, tuple[_Step, ...]]


def prepare(order: Schedule, num_stages: int) -> PreparedSchedule:
    """``order`` ready to be simulated repeatedly (:func:`simulate` accepts either)."""
    steps: dict[int, tuple[_Step, ...]] = {}
    for rank, actions in order.items():
        prepared = []
        for entry in actions:
            leaves = leaf_actions(entry)
            needs = tuple(p for a in leaves for p in _producers(a, num_stages))
            done: list[tuple[int, object, int]] = []
            to_i = to_w = 0
            rise: tuple[int, int] | None = None
            for a in leaves:
                s, kind, k = a.stage_index, a.computation_type, a.microbatch_index
                done.append((s, kind, k))
                if kind in (B, I):
                    done.append((s, "grad", k))
                    to_i -= 1
                if kind in (B, W):
                    to_w -= 1
                elif kind == F:
                    to_i, to_w = to_i + 1, to_w + 1
                    low_i, low_w = rise or (to_i, to_w)
                    rise = (max(low_i, to_i), max(low_w, to_w))
            if len(leaves) > 1:  # the forward half's stage, then the backward half's
                fwd, bwd = sorted(leaves, key=lambda a: a.computation_type != F)
                price = (fwd.stage_index, F, bwd.stage_index)
            else:
                price = (entry.stage_index, entry.computation_type, None)
            prepared.append(_Step(entry, str(entry), needs, tuple(done), (to_i, to_w), rise, price))
        steps[rank] = tuple(prepared)
    return PreparedSchedule(order, num_stages, steps)


def simulate(
    order: Schedule | PreparedSchedule,
    num_stages: int,
    costs: StageCosts | None = None,
    chunks_per_rank: int = 1,
) -> Simulation:
    """Time ``order`` (compute actions per rank, :mod:`.schedules`, or :func:`prepare`'s form
    of them) under ``costs``: one :class:`ChunkCosts` for every stage (None: unit costs) or
    one per stage index."""
    stage_costs = per_stage_costs(costs, num_stages)
    if not isinstance(order, PreparedSchedule):
        order = prepare(order, num_stages)
    elif order.num_stages != num_stages:
        raise ValueError(
            f"the schedule was prepared for {order.num_stages} stages, not {num_stages}"
        )
    steps = order.steps
    prices = [{kind: c.of(kind) for kind in (F, B, I, W)} for c in stage_costs]
    finished: dict[tuple[int, object, int], float] = {}
    position = dict.fromkeys(steps, 0)
    clock = dict.fromkeys(steps, 0.0)
    busy = dict.fromkeys(steps, 0.0)
    live = dict.fromkeys(steps, 0)
    peak = dict.fromkeys(steps, 0)
    live_w = dict.fromkeys(steps, 0)  # chunks held to W
    peak_w = dict.fromkeys(steps, 0)
    timeline: dict[int, list[tuple[float, float, str]]] = {r: [] for r in steps}
    made_by: dict[tuple[int, object, int], tuple[int, int]] = {}  # (rank, position) that ran it
    after: dict[tuple[int, int], tuple[int, int] | None] = {}  # the entry an entry waited for
    remaining = sum(len(a) for a in steps.values())
    while remaining:
        progressed = False
        for rank, ranks_steps in steps.items():
            while position[rank] < len(ranks_steps):
                step = ranks_steps[position[rank]]
                if any(n not in finished for n in step.needs):
                    break
                here = (rank, position[rank])
                start = clock[rank]
                after[here] = (rank, here[1] - 1) if here[1] else None
                for n in step.needs:  # the rank's own previous entry wins a tie
                    if finished[n] > start:
                        start, after[here] = finished[n], made_by[n]
                stage, kind, backward = step.price
                if backward is None:
                    cost = prices[stage][kind]
                else:
                    cost = stage_costs[stage].pair(stage_costs[backward])
                end = start + cost
                for key in step.done:
                    finished[key] = end
                    made_by[key] = here
                if step.rise is not None:
                    peak[rank] = max(peak[rank], live[rank] + step.rise[0])
                    peak_w[rank] = max(peak_w[rank], live_w[rank] + step.rise[1])
                live[rank] += step.live[0]
                live_w[rank] += step.live[1]
                clock[rank], busy[rank] = end, busy[rank] + cost
                timeline[rank].append((start, end, step.label))
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {
                r: ranks_steps[position[r]].label
                for r, ranks_steps in steps.items()
                if position[r] < len(ranks_steps)
            }
            raise ValueError(f"schedule deadlocks: each rank waits at {stuck}")
    makespan = max(clock.values())
    total_busy = sum(busy.values())
    last = max(steps, key=clock.__getitem__)
    chain: list[Action] = []
    link = (last, len(steps[last]) - 1) if steps[last] else None
    while link is not None:
        chain.append(steps[link[0]][link[1]].entry)
        link = after[link]
    return Simulation(
        makespan=makespan,
        busy=busy,
        bubble_fraction=1.0 - total_busy / (len(steps) * makespan),
        idle={r: makespan - b for r, b in busy.items()},
        peak_activations={r: n / chunks_per_rank for r, n in peak.items()},
        peak_activations_until_w={r: n / chunks_per_rank for r, n in peak_w.items()},
        timeline=timeline,
        critical_path=chain[::-1],
    )
