"""The simulated bubble and peak in-flight activations of every pipeline schedule.

For each schedule and (p, m) the action lists of :func:`mt_parallel.pipeline.schedule_actions`
are timed by :func:`mt_parallel.pipeline.simulate` with per-stage forward ``F``, input-gradient
``I`` and weight-gradient ``W`` times (``--costs F I W``, default 1 1 1; a chunk of a schedule
with ``v`` chunks per rank costs ``1/v`` of a stage), next to the closed forms: 1F1B and GPipe
``(p−1)/(m+p−1)``, interleaved ``(p−1)/(v·m+p−1)``, ZB-H1 ``(p−1)(F+B−2W)`` of idle (``B`` the
full backward), and with ``F = I = W``: ZBV ``(p−1)·F`` of a chunk (the fill, ``m ≥ 2p``),
DualPipeV ``(p−1)(F&B + B − 3W)`` (DualPipe's README; ``F&B = F + B`` as torch runs the pair
without an overlap function). Nothing runs on a device: the table is the
model of the schedules, which the gloo rehearsal of ``multi_gpu/pipeline.py --fixed-ms``
measures against.

Run::

    python benchmarks/pipeline_bubbles.py                  # markdown table on stdout
    python benchmarks/pipeline_bubbles.py --costs 1 1 0.5 --shapes 4x8 8x32
"""

from __future__ import annotations

import argparse
import sys

from mt_parallel.pipeline import (
    SCHEDULES,
    ChunkCosts,
    chunks_per_rank,
    minimum_microbatches,
    schedule_actions,
    simulate,
)

DEFAULT_SHAPES = ("4x8", "4x16", "8x16", "8x32")


def closed_form(schedule: str, p: int, m: int, v: int, costs: ChunkCosts) -> str:
    """The published bubble fraction where one applies to these costs, else ``—``."""
    f, b, w = costs.forward, costs.full_backward, costs.weight_grad
    if schedule in ("gpipe", "1f1b"):
        return f"{(p - 1) / (m + p - 1):.4f}"
    if schedule == "interleaved_1f1b":
        return f"{(p - 1) / (v * m + p - 1):.4f}"
    if schedule == "zero_bubble" and v == 1:
        idle = (p - 1) * (f + b - 2 * w)
        return f"{idle / (idle + m * (f + b)):.4f}"
    equal = costs.forward == costs.input_grad == costs.weight_grad
    chunk_f, chunk_b, chunk_w = f / v, b / v, w / v
    busy = v * m * (chunk_f + chunk_b)
    if schedule == "zbv" and equal and m >= 2 * p:  # only the fill: (p−1)·F of a chunk
        idle = (p - 1) * chunk_f
        return f"{idle / (idle + busy):.4f}"
    if schedule == "dualpipev" and equal:  # (p−1)(F&B + B − 3W), F&B = F + B back to back
        idle = (p - 1) * ((chunk_f + chunk_b) + chunk_b - 3 * chunk_w)
        return f"{idle / (idle + busy):.4f}"
    return "—"


def rows(shapes: list[tuple[int, int]], costs: ChunkCosts, chunks: int) -> list[list[str]]:
    out = []
    for schedule in SCHEDULES:
        v = chunks_per_rank(schedule, chunks if schedule == "interleaved_1f1b" else 1)
        chunk_costs = ChunkCosts(costs.forward / v, costs.input_grad / v, costs.weight_grad / v)
        for p, m in shapes:
            if m < minimum_microbatches(schedule, p, v):
                continue
            sim = simulate(schedule_actions(schedule, p, m, v), p * v, chunk_costs, v)
            out.append([
                schedule, str(p), str(m), str(v), f"{sim.bubble_fraction:.4f}",
                closed_form(schedule, p, m, v, costs),
                f"{max(sim.peak_activations.values()):g}",
            ])  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--costs", type=float, nargs=3, default=(1.0, 1.0, 1.0),
                        metavar=("F", "I", "W"), help="per-stage times")  # fmt: skip
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="PxM")
    parser.add_argument("--chunks", type=int, default=2, help="v of interleaved_1f1b")
    args = parser.parse_args(argv)
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes]
    costs = ChunkCosts(*args.costs)
    header = ["schedule", "p", "m", "v", "bubble (simulated)", "closed form",
              "peak activations (stage·micro-batches)"]  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for row in rows(shapes, costs, args.chunks):  # type: ignore[arg-type]
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
