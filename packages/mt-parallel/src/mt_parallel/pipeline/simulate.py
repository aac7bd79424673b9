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

Computation. Whether an action can run depends on which others have run, never on when, so
:func:`prepare` orders the entries once (each after its rank's previous entry and its
producers) and works out the peaks and the deadlock check, which do not depend on the costs;
:func:`simulate` is then one pass over that order, each entry ending at its cost plus the
latest end among its rank's previous entry and its producers. The timeline and the critical
path are read back from the ends and from which entry each waited for.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

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


_CODE = {F: 0, B: 1, I: 2, W: 3}
_GRAD = 4
"""Code of a backward's input gradient (what ``B``/``I`` of the stage before waits for)."""


def _result(stage: int, code: int, micro_batch: int, num_stages: int) -> int:
    """A result an entry makes or waits for, as one integer (cheaper to hash and to collect
    than a tuple): ``(micro_batch·S + stage)·5 + code``."""
    return (micro_batch * num_stages + stage) * 5 + code


def _producers(action: Action, num_stages: int) -> tuple[int, ...]:
    s, kind, k = action.stage_index, action.computation_type, action.microbatch_index
    if kind == F:
        return () if s == 0 else (_result(s - 1, _CODE[F], k, num_stages),)
    if kind in (B, I):
        if s == num_stages - 1:
            return (_result(s, _CODE[F], k, num_stages),)
        return (_result(s + 1, _GRAD, k, num_stages),)
    return (_result(s, _CODE[I], k, num_stages),)


def _results(action: Action, num_stages: int) -> tuple[int, ...]:
    """What ``action`` makes (a backward also its input gradient)."""
    s, kind, k = action.stage_index, action.computation_type, action.microbatch_index
    made = _result(s, _CODE[kind], k, num_stages)
    return (made, _result(s, _GRAD, k, num_stages)) if kind in (B, I) else (made,)


def _price(entry: Action) -> tuple[int, object, int | None]:
    """``(stage, kind, None)``, or for a pair ``(forward stage, F, backward stage)``."""
    if entry.sub_actions is None:
        return entry.stage_index, entry.computation_type, None
    fwd, bwd = sorted(entry.sub_actions, key=lambda a: a.computation_type != F)
    return fwd.stage_index, F, bwd.stage_index


def _peaks(actions: Sequence[Action]) -> tuple[int, int]:
    """The most micro-batch chunks a rank running ``actions`` holds from ``F`` to ``I`` or
    ``B``, and from ``F`` to ``W`` or ``B`` (each count is highest right after a forward)."""
    to_i = to_w = peak_i = peak_w = 0
    for entry in actions:
        for a in leaf_actions(entry):
            kind = a.computation_type
            if kind == F:
                to_i, to_w = to_i + 1, to_w + 1
                peak_i, peak_w = max(peak_i, to_i), max(peak_w, to_w)
            else:
                to_i -= kind in (B, I)
                to_w -= kind in (B, W)
    return peak_i, peak_w


@dataclass(frozen=True)
class PreparedSchedule:
    """A schedule's action lists in an order where every entry comes after its rank's previous
    entry and its producers, for timing the same lists under many costs (:func:`prepare`).
    Entries are numbered ``1…n`` in that order; number 0 stands for the start (time 0)."""

    order: Schedule
    num_stages: int
    entries: tuple[Action | None, ...]
    """Entry ``k`` at index ``k`` (index 0: None, the start)."""
    previous: tuple[int, ...]
    """Per entry ``1…n`` (at index ``k − 1``): its rank's previous entry, 0 for a rank's first."""
    producers: tuple[tuple[int, ...], ...]
    """Per entry ``1…n``: the entries whose results it waits for, in its leaves' order."""
    price_of: tuple[int, ...]
    """Per entry ``1…n``: its index in :attr:`prices`."""
    prices: tuple[tuple[int, object, int | None], ...]
    """The distinct ``(stage, kind, None)`` or ``(forward stage, F, backward stage)`` priced."""
    by_rank: dict[int, tuple[int, ...]]
    """Per rank: its entries' numbers in execution order."""
    peak: dict[int, int]
    """Per rank: the most micro-batch chunks held from ``F`` to ``I`` or ``B``."""
    peak_until_w: dict[int, int]
    """Per rank: the most micro-batch chunks held from ``F`` to ``W`` or ``B``."""


def prepare(order: Schedule, num_stages: int) -> PreparedSchedule:
    """``order`` ready to be simulated repeatedly (:func:`simulate` accepts either). When an
    entry starts depends on its rank's previous entry and its producers only, so any order that
    runs each after those gives the same times: this one runs a rank until it waits for a
    result not yet made, and resumes it when that result is made. Also works out the peaks
    (each rank's list alone decides them) and whether the lists deadlock."""
    made_by: dict[int, int] = {}  # result → number of the entry that made it
    waiting: dict[int, int] = {}  # result → the rank stopped for it
    entries: list[Action | None] = [None]
    previous: list[int] = []
    producers: list[tuple[int, ...]] = []
    price_of: list[int] = []
    price_ids: dict[tuple[int, object, int | None], int] = {}
    by_rank: dict[int, list[int]] = {rank: [] for rank in order}
    ready = deque(order)
    while ready:
        rank = ready.popleft()
        actions, ran = order[rank], by_rank[rank]
        for position in range(len(ran), len(actions)):
            entry = actions[position]
            leaves = leaf_actions(entry)
            needs = [n for a in leaves for n in _producers(a, num_stages)]
            missing = [n for n in needs if n not in made_by]
            if missing:
                waiting[missing[0]] = rank
                break
            number = len(entries)
            entries.append(entry)
            previous.append(ran[-1] if ran else 0)
            producers.append(tuple([made_by[n] for n in needs]))
            price_of.append(price_ids.setdefault(_price(entry), len(price_ids)))
            ran.append(number)
            for a in leaves:
                for result in _results(a, num_stages):
                    made_by[result] = number
                    if result in waiting:
                        ready.append(waiting.pop(result))
    if len(entries) <= sum(len(a) for a in order.values()):
        stuck = {r: str(order[r][len(by_rank[r])]) for r in order
                 if len(by_rank[r]) < len(order[r])}  # fmt: skip
        raise ValueError(f"schedule deadlocks: each rank waits at {stuck}")
    peaks = {rank: _peaks(actions) for rank, actions in order.items()}
    return PreparedSchedule(
        order, num_stages, tuple(entries), tuple(previous), tuple(producers), tuple(price_of),
        tuple(price_ids), {r: tuple(ran) for r, ran in by_rank.items()},
        {r: p[0] for r, p in peaks.items()}, {r: p[1] for r, p in peaks.items()},
    )  # fmt: skip


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
    schedule: PreparedSchedule = field(repr=False)
    ends: list[float] = field(repr=False)
    """Per entry number (:class:`PreparedSchedule`): when it ends; index 0 the start, 0."""
    waited_for: list[int] = field(repr=False)
    """Per entry number: the entry whose end it started at (0: it started at 0)."""

    @property
    def timeline(self) -> dict[int, list[tuple[float, float, str]]]:
        """Per rank: (start, end, action) in execution order."""
        ends, waited_for, entries = self.ends, self.waited_for, self.schedule.entries
        return {
            rank: [(ends[waited_for[k]], ends[k], str(entries[k])) for k in numbers]
            for rank, numbers in self.schedule.by_rank.items()
        }

    @property
    def critical_path(self) -> list[Action]:
        """Entries whose costs sum to the makespan, in execution order (module docstring)."""
        by_rank = self.schedule.by_rank
        last = max(by_rank, key=lambda r: self.ends[by_rank[r][-1]] if by_rank[r] else 0.0)
        chain: list[Action] = []
        link = by_rank[last][-1] if by_rank[last] else 0
        while link:
            chain.append(self.schedule.entries[link])
            link = self.waited_for[link]
        return chain[::-1]


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
    priced = [
        stage_costs[stage].of(kind) if backward is None
        else stage_costs[stage].pair(stage_costs[backward])
        for stage, kind, backward in order.prices
    ]  # fmt: skip
    entry_costs = [priced[i] for i in order.price_of]
    ends = [0.0]
    waited_for = [0]
    # each entry starts at the latest end of its rank's previous entry and its producers; the
    # rank's own previous entry wins a tie, so the critical path stays on a rank where it can
    timed = zip(order.previous, order.producers, entry_costs, strict=True)
    for previous, producers, cost in timed:
        start, after = ends[previous], previous
        for p in producers:
            if ends[p] > start:
                start, after = ends[p], p
        ends.append(start + cost)
        waited_for.append(after)
    busy: dict[int, float] = {}
    clock: dict[int, float] = {}
    for rank, numbers in order.by_rank.items():
        total = 0.0
        for k in numbers:  # one at a time in the rank's order (sum() compensates from 3.12)
            total += entry_costs[k - 1]
        busy[rank], clock[rank] = total, ends[numbers[-1]] if numbers else 0.0
    makespan = max(clock.values())
    return Simulation(
        makespan=makespan,
        busy=busy,
        bubble_fraction=1.0 - sum(busy.values()) / (len(busy) * makespan),
        idle={r: makespan - b for r, b in busy.items()},
        peak_activations={r: n / chunks_per_rank for r, n in order.peak.items()},
        peak_activations_until_w={r: n / chunks_per_rank for r, n in order.peak_until_w.items()},
        schedule=order,
        ends=ends,
        waited_for=waited_for,
    )
