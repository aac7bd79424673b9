"""Pipeline time and in-flight activations from mt-parallel's own schedule action lists.

The planner does not model schedules itself: :func:`pipeline_timing` builds the schedule's
action lists with ``mt_parallel.pipeline.schedule_actions`` (torch's generators, the lists the
runtime executes) and times them with ``mt_parallel.pipeline.simulate``, each of the ``C =
pp·v`` chunks at its own ``F``, ``I``, ``W`` (uneven splits, the embedding on the first chunk
and the head on the last). Both import torch, so this module imports them on first use (pp >
1 only), and caches results: the action lists per ``(schedule, pp, v, m)`` and the timings per
the same key plus each chunk's costs relative to the largest forward, ``F_c/F_max``,
``I_c/F_max``, ``W_c/F_max``, in buckets of about 10%. Every start time in a simulation is a
sum of action costs along a chain of dependencies, so the makespan is the longest chain, ``max
over chains of Σ_c (n_F,c·F_c + n_I,c·I_c + n_W,c·W_c)``: piecewise linear. The cache keeps,
per bucket, the coefficients of the chain that is longest at the bucket's centre (the
simulator's ``critical_path``: each action on it adds one to its chunk's count of its kind, a
full backward to ``I`` and ``W``, an overlapped pair to its forward's and its backward's), and
prices a layout with its own costs: exact while the critical chain is the same, a slight
underestimate where another chain takes over inside the bucket. Beyond ``4·pp`` micro-batches
(``8·pp`` for DualPipeV; ``m`` a multiple of pp) a schedule reaches its steady state, where
each further round of pp micro-batches adds the same to the longest chain (``pp·v·(F + I +
W)`` for equal chunks; for uneven ones what the slowest rank or stage adds, which can take a
few more rounds to settle) and nothing to the peaks held (GPipe's grows by one per
micro-batch). So the simulation runs at ``4·pp`` and one round more at a time until two
successive rounds add the same, and is extended from there; a test holds the extension to
full simulations, equal and uneven chunks. The bubble is then ``1 − m·Σ_c (F_c +
I_c + W_c) / (pp·makespan)``, the idle share of all ranks' time (each rank runs all its
actions), which with uneven chunks includes the idling imbalance causes. pp = 1 layouts never
import torch, and a search imports it once.

Outputs: the makespan, the bubble fraction, and per rank the most micro-batches it holds
activations for, in units of one stage's activations, each chunk counted from its forward to
its weight gradient (``W``, or a full backward ``B``): the simulator's
``peak_activations_until_w``, which the memory model multiplies by one stage's activation
bytes. Under torch's split backward (torch >= 2.13, a chunk without a weight-gradient sink)
a chunk's ``I`` keeps nearly everything it saved for its ``W``
(:mod:`mt_parallel.pipeline.memory`), so zero-bubble ranks hold their chunks to ``W``: ZB-H1
``p`` on every rank, where the count to ``I`` is ``p − r``. Schedules without a separate
``W`` (GPipe, 1F1B, interleaved 1F1B) give the same count as to ``I``. Chunks with a sink
(:mod:`mt_plan.cost`, "Memory per rank") are charged the same way, an upper bound for them. A
peak depends on the action lists only, not on the costs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

BUCKET = 0.1
"""Width of a cost-ratio bucket in natural-log units (about 10%)."""
STEADY_ROUNDS = 4
"""Micro-batch rounds (of pp) simulated before the steady state is extrapolated."""
SMALLEST = 1e-12
"""Cost ratios are floored here before their logarithm (a chunk may be empty)."""


@dataclass(frozen=True)
class PipelineTiming:
    coefficients: tuple[tuple[float, float, float], ...]
    """Per chunk ``(n_F, n_I, n_W)``: the makespan is ``Σ_c n_F·F_c + n_I·I_c + n_W·W_c`` on
    this linear piece."""
    peak_held: tuple[float, ...]
    """Per pipeline rank: the most micro-batch stage activations it holds, each chunk's from
    ``F`` to ``W`` or ``B`` (module docstring)."""


@lru_cache(maxsize=512)
def _actions(schedule: str, pp: int, v: int, m: int):
    from mt_parallel.pipeline.schedules import schedule_actions

    return schedule_actions(schedule, pp, m, v)


@lru_cache(maxsize=512)
def _prepared(schedule: str, pp: int, v: int, m: int):
    from mt_parallel.pipeline.simulate import prepare

    return prepare(_actions(schedule, pp, v, m), pp * v)


def _critical_chain(schedule: str, pp: int, v: int, m: int, costs: tuple[float, ...]):
    """(per-chunk coefficients of the longest chain, per-rank peaks) of a simulation at
    ``costs`` (``F, I, W`` of each chunk in turn)."""
    from mt_parallel.pipeline.schedules import B, F, I, W, leaf_actions
    from mt_parallel.pipeline.simulate import ChunkCosts, simulate

    chunks = pp * v
    stages = [ChunkCosts(*costs[3 * c : 3 * c + 3]) for c in range(chunks)]
    sim = simulate(_prepared(schedule, pp, v, m), chunks, stages, chunks_per_rank=v)
    counts = [[0.0, 0.0, 0.0] for _ in range(chunks)]
    for entry in sim.critical_path:
        for leaf in leaf_actions(entry):
            kind, row = leaf.computation_type, counts[leaf.stage_index]
            row[0] += kind == F
            row[1] += kind in (I, B)  # a full backward costs I + W
            row[2] += kind in (W, B)
    return counts, tuple(sim.peak_activations_until_w[r] for r in range(pp))


@lru_cache(maxsize=65536)
def _timing(schedule: str, pp: int, v: int, m: int, buckets: tuple[int, ...]) -> PipelineTiming:
    costs = tuple(math.exp(k * BUCKET) for k in buckets)
    cap = STEADY_ROUNDS * pp * (2 if schedule == "dualpipev" else 1)
    if m <= cap + pp or m % pp:
        counts, peaks = _critical_chain(schedule, pp, v, m, costs)
        return PipelineTiming(tuple(map(tuple, counts)), peaks)
    # steady state: once two successive rounds of pp micro-batches add the same to the
    # longest chain and the peaks, every further round adds that too
    seen = [_critical_chain(schedule, pp, v, n, costs) for n in (cap, cap + pp, cap + 2 * pp)]
    n = cap + 2 * pp
    while _step(*seen[-2:]) != _step(*seen[-3:-1]) and n < m:
        n += pp
        seen.append(_critical_chain(schedule, pp, v, n, costs))
    (counts, peaks), (step_counts, step_peaks) = seen[-1], _step(*seen[-2:])
    rounds = (m - n) / pp
    counts = [
        [c + d * rounds for c, d in zip(row, step, strict=True)]
        for row, step in zip(counts, step_counts, strict=True)
    ]
    peaks = tuple(p + d * rounds for p, d in zip(peaks, step_peaks, strict=True))
    return PipelineTiming(tuple(map(tuple, counts)), peaks)


def _step(before, after):
    """What a round of micro-batches added to the chain's coefficients and to the peaks."""
    counts = tuple(
        tuple(b - a for a, b in zip(row_a, row_b, strict=True))
        for row_a, row_b in zip(before[0], after[0], strict=True)
    )
    return counts, tuple(q - p for p, q in zip(before[1], after[1], strict=True))


def pipeline_timing(
    schedule: str,
    pp: int,
    v: int,
    m: int,
    forward: float | Sequence[float],
    input_grad: float | Sequence[float],
    weight_grad: float | Sequence[float],
) -> tuple[float, float, tuple[float, ...]]:
    """(makespan seconds, bubble fraction, per-rank peak stage activations held from ``F`` to
    ``W``, module docstring) for chunk costs in seconds: one value for every chunk, or one per
    chunk in stage order (``pp·v`` of them, ``v`` chunks per rank; the largest forward > 0)."""
    chunks = pp * v
    per_chunk = []
    for name, values in (("forward", forward), ("input_grad", input_grad),
                         ("weight_grad", weight_grad)):  # fmt: skip
        listed = [values] * chunks if isinstance(values, (int, float)) else list(values)
        if len(listed) != chunks:
            raise ValueError(f"{len(listed)} {name} costs for {chunks} chunks (pp·v)")
        per_chunk.append(listed)
    scale = max(per_chunk[0])
    costs = [x for c in range(chunks) for x in (per_chunk[0][c], per_chunk[1][c], per_chunk[2][c])]
    buckets = tuple(round(math.log(max(x / scale, SMALLEST)) / BUCKET) for x in costs)
    t = _timing(schedule, pp, v, m, buckets)
    makespan = sum(
        n * x for counts, c in zip(t.coefficients, range(chunks), strict=True)
        for n, x in zip(counts, costs[3 * c : 3 * c + 3], strict=True)
    )  # fmt: skip
    busy = m * sum(costs)
    return makespan, max(0.0, 1.0 - busy / (pp * makespan)), t.peak_held
