"""Pipeline time and in-flight activations from mt-parallel's own schedule action lists.

The planner does not model schedules itself: :func:`pipeline_timing` builds the schedule's
action lists with ``mt_parallel.pipeline.schedule_actions`` (torch's generators, the lists the
runtime executes) and times them with ``mt_parallel.pipeline.simulate``. Both import torch, so
this module imports them on first use (pp > 1 only), and caches results: the action lists per
``(schedule, pp, v, m)`` and the timings per the same key plus the chunk cost ratios ``I/F``,
``W/F`` in buckets of about 10%. Every start time in a simulation is a sum of action costs
along a chain of dependencies, so the makespan is the longest chain, ``max over chains of
n_F·F + n_I·I + n_W·W``: piecewise linear. The cache keeps, per bucket, the chain's
coefficients at the bucket's centre (found by perturbing ``I`` and ``W`` by 1e-6 in two more
runs of the same simulator; ``n_F`` from homogeneity), and prices a layout with its own costs:
exact while the critical chain is the same, a slight underestimate where another chain takes
over inside the bucket. Beyond ``4·pp`` micro-batches (``8·pp`` for DualPipeV; ``m`` a
multiple of pp) every schedule is in its steady state, where each further micro-batch adds
``v·(F + I + W)`` to the makespan and nothing to the in-flight peak (GPipe's grows by one per
micro-batch), so the simulation runs at ``4·pp`` and is extended; a test holds the extension to
full simulations. The bubble is then ``1 − m·v·(F + I + W) / makespan`` (each rank runs
all its actions). pp = 1 layouts never import torch, and a search imports it once.

Outputs: the makespan, the bubble fraction, and the peak in-flight
micro-batches of any rank in units of one stage's activations (the simulator's
``peak_activations``), which the memory model multiplies by one stage's activation bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

BUCKET = 0.1
"""Width of a cost-ratio bucket in natural-log units (about 10%)."""
STEADY_ROUNDS = 4
"""Micro-batch rounds (of pp) simulated before the steady state is extrapolated."""


@dataclass(frozen=True)
class PipelineTiming:
    coefficients: tuple[float, float, float]
    """``(n_F, n_I, n_W)``: the makespan is ``n_F·F + n_I·I + n_W·W`` on this linear piece."""
    peak_inflight: tuple[float, ...]
    """Per pipeline rank: the most micro-batch stage activations it holds."""


@lru_cache(maxsize=512)
def _actions(schedule: str, pp: int, v: int, m: int):
    from mt_parallel.pipeline.schedules import schedule_actions

    return schedule_actions(schedule, pp, m, v)


def _makespan(schedule: str, pp: int, v: int, m: int, costs: tuple[float, float, float]):
    from mt_parallel.pipeline.simulate import ChunkCosts, simulate

    sim = simulate(_actions(schedule, pp, v, m), pp * v, ChunkCosts(*costs), chunks_per_rank=v)
    return sim


def _coefficients(schedule: str, pp: int, v: int, m: int, igrad: float, wgrad: float):
    """(n_F, n_I, n_W) of the critical chain at these costs, and the per-rank peaks."""
    base = _makespan(schedule, pp, v, m, (1.0, igrad, wgrad))
    step = 1e-6
    d_i = (
        _makespan(schedule, pp, v, m, (1.0, igrad * (1 + step), wgrad)).makespan - base.makespan
    ) / (igrad * step)
    d_w = (_makespan(schedule, pp, v, m, (1.0, igrad, wgrad * (1 + step))).makespan
           - base.makespan) / (wgrad * step)  # fmt: skip
    d_f = base.makespan - d_i * igrad - d_w * wgrad
    return (d_f, d_i, d_w), tuple(base.peak_activations[r] for r in range(pp))


@lru_cache(maxsize=8192)
def _timing(schedule: str, pp: int, v: int, m: int, i_bucket: int, w_bucket: int) -> PipelineTiming:
    igrad, wgrad = math.exp(i_bucket * BUCKET), math.exp(w_bucket * BUCKET)
    cap = STEADY_ROUNDS * pp * (2 if schedule == "dualpipev" else 1)
    if m <= cap + pp or m % pp:
        coefficients, peaks = _coefficients(schedule, pp, v, m, igrad, wgrad)
        return PipelineTiming(coefficients, peaks)
    # steady state: each further micro-batch adds v·(F + I + W) to the makespan
    (n_f, n_i, n_w), peaks = _coefficients(schedule, pp, v, cap, igrad, wgrad)
    extra = (m - cap) * v
    if schedule == "gpipe":  # all forwards first: the in-flight count grows with m
        _, more = _coefficients(schedule, pp, v, cap + pp, igrad, wgrad)
        peaks = tuple(p + (q - p) * (m - cap) / pp for p, q in zip(peaks, more, strict=True))
    return PipelineTiming((n_f + extra, n_i + extra, n_w + extra), peaks)


def pipeline_timing(
    schedule: str, pp: int, v: int, m: int, forward: float, input_grad: float, weight_grad: float
) -> tuple[float, float, tuple[float, ...]]:
    """(makespan seconds, bubble fraction, per-rank peak in-flight stage activations) for
    chunk costs in seconds (``forward > 0``, ``v`` chunks per rank)."""
    i_bucket = round(math.log(max(input_grad, 1e-12) / forward) / BUCKET)
    w_bucket = round(math.log(max(weight_grad, 1e-12) / forward) / BUCKET)
    t = _timing(schedule, pp, v, m, i_bucket, w_bucket)
    n_f, n_i, n_w = t.coefficients
    makespan = n_f * forward + n_i * input_grad + n_w * weight_grad
    busy = m * v * (forward + input_grad + weight_grad)
    return makespan, max(0.0, 1.0 - busy / makespan), t.peak_inflight
