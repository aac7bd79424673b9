"""``mt-plan``: search parallel layouts, explain one, or calibrate the cost model.

    mt-plan search  [options] <mt-train overrides>   # the ranked table and the launch line
    mt-plan explain [options] <mt-train overrides>   # the breakdown of the layout they give
    mt-plan calibrate --out table.json [--tiny]      # measure op rates on this device

The overrides are mt-train's own (``model=llama3_70b trainer.seq_len=8192
trainer.global_batch_size=512``; for ``explain`` also ``parallel.*`` and ``fp8=``), composed
and validated by mt-train, so the planner prices exactly the run they describe. A bad value is
one line ``mt-plan: error: ...`` and exit status 2, as every mt command.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from mt_plan.calibration import load_table
from mt_plan.cluster import ClusterError, edit_cluster, load_cluster
from mt_plan.cost import CostModel, Workload
from mt_plan.layout import Layout, layout_problem
from mt_plan.report import explain, launch_line, table
from mt_plan.search import SearchSpace, search, smallest_world_that_fits

EXIT_USER_ERROR = 2
FP8_OPTION = {"block": "blockwise"}
"""mt-fp8 recipe names whose ``fp8=`` config option is spelled differently."""
SEARCHED_OVERRIDES = ("parallel.", "fp8=", "fp8.recipe", "trainer.micro_batch_size")
"""Overrides ``search`` chooses itself (ignored when given)."""


class PlanError(Exception):
    """A bad request, reported as one line."""


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def _words(text: str) -> list[str]:
    return text.split(",")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mt-plan", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("search", "explain"):
        p = sub.add_parser(name)
        p.add_argument("overrides", nargs="*", help="mt-train overrides (model=..., trainer.*)")
        p.add_argument("--cluster", default="h200_nodes", help="shipped name or JSON path")
        p.add_argument("--gpus", type=int, help="GPU count (a partial node or whole nodes)")
        p.add_argument("--nodes", type=int, help="node count (keeps gpus_per_node)")
        p.add_argument("--gpus-per-node", type=int)
        p.add_argument("--calibration", default="h200", help="shipped table name or JSON path")
        p.add_argument("--headroom", type=float, default=0.05, help="memory left unused")
        p.add_argument("--allocator-overhead", type=float, default=0.05)
        p.add_argument("--json", help="write the estimates as JSON lines here")
    s = sub.choices["search"]
    s.add_argument("--top", type=int, default=10)
    s.add_argument("--explain", type=int, metavar="N", help="also break down row N of the table")
    s.add_argument("--tp", type=_ints)
    s.add_argument("--cp", type=_ints)
    s.add_argument("--pp", type=_ints)
    s.add_argument("--vpp", type=_ints, default=[1, 2, 4])
    s.add_argument("--ep", type=_ints)
    s.add_argument("--micro-batch", type=_ints)
    s.add_argument("--max-micro-batch", type=int, default=16)
    s.add_argument("--schedules", type=_words)
    s.add_argument("--dp-modes", type=_words)
    s.add_argument("--recompute", type=_words)
    s.add_argument(
        "--recompute-every", type=_ints, default=[1, 2, 4],
        help="parallel.recompute_every values tried with full recompute (default 1,2,4)",
    )  # fmt: skip
    s.add_argument(
        "--fp8", type=_words, help="recipes to try (default none,tensorwise,rowwise,blockwise)"
    )
    s.add_argument("--sp", type=_words, help="true,false")
    s.add_argument(
        "--end-layers-off", type=_ints, default=[0],
        help="also try pipeline splits with this many blocks moved off the last chunk (and "
        "the first where it holds a vision tower), as parallel.pp_layers (default 0: off)",
    )  # fmt: skip
    s.add_argument(
        "--cp-attention", type=_words,
        help="parallel.cp_attention values tried at cp > 1 (default all_gather,ring)",
    )  # fmt: skip
    c = sub.add_parser("calibrate")
    c.add_argument("--out", required=True)
    c.add_argument("--device", default="auto")
    c.add_argument("--tiny", action="store_true", help="small shapes (a CPU smoke run)")
    c.add_argument("--fp8", type=_words, default=None, help="FP8 recipes to measure")
    return parser


def _setup(args: argparse.Namespace) -> tuple[Any, CostModel, list[str]]:
    from mt_plan.models import resolve, shape_of

    base = edit_cluster(load_cluster(args.cluster), args.nodes, args.gpus_per_node)
    cluster = base.with_gpus(args.gpus) if args.gpus is not None else base
    args.node_shape = base
    overrides = list(args.overrides)
    if args.command == "search":  # the search sets the micro-batch and the layout itself
        overrides = [o for o in overrides if not o.startswith(SEARCHED_OVERRIDES)]
        overrides.append("trainer.micro_batch_size=1")
    try:
        train = resolve(overrides)
        model = shape_of(train.model)
    except Exception as error:  # Hydra and the config dataclasses raise several kinds
        from mt_train.cli import one_line

        raise PlanError(one_line(error)) from None
    tr = train.trainer
    work = Workload(
        seq_len=tr.seq_len, global_batch=tr.global_batch_size,
        act_bytes=4 if tr.precision == "fp32" else 2,
        allocator_overhead=args.allocator_overhead, headroom=args.headroom,
    )  # fmt: skip
    user = [o for o in args.overrides if not o.startswith(SEARCHED_OVERRIDES)]
    return train, CostModel(model, cluster, load_table(args.calibration), work), user


def layout_of(train: Any, world: int) -> Layout:
    """The :class:`Layout` an mt-train config runs at ``world`` GPUs."""
    par, tr = train.parallel, train.trainer
    if par.recompute == "selective":
        recompute = "selective_mlp" if "mlp" in par.recompute_targets else "selective"
    elif par.recompute == "full":
        recompute = "full_keep" if par.recompute_keep else "full"
    else:
        recompute = "none"
    dp = par.dp or world // (par.tp * par.cp * par.pp)
    return Layout(
        tp=par.tp, cp=par.cp, cp_attention=par.cp_attention, pp=par.pp, dp=dp, ep=par.ep,
        sp=par.sequence_parallel, vpp=par.pp_chunks if par.pp_schedule in ("interleaved_1f1b", "zero_bubble") else 1,
        schedule=par.pp_schedule if par.pp > 1 else "1f1b", dp_mode=par.data_parallel,
        micro_batch=tr.micro_batch_size, recompute=recompute,
        # the runtime reads recompute_every under full recompute only (ParallelConfig checked it)
        recompute_every=par.recompute_every if par.recompute == "full" else 1,
        fp8=FP8_OPTION.get(train.fp8.recipe, train.fp8.recipe),
        pp_layers=tuple(par.pp_layers),
    )  # fmt: skip


def _space(args: argparse.Namespace) -> SearchSpace:
    defaults = SearchSpace()
    sp = [v.lower() == "true" for v in args.sp] if args.sp else defaults.sp
    return SearchSpace(
        tp=args.tp, cp=args.cp, pp=args.pp, vpp=args.vpp, ep=args.ep,
        micro_batches=args.micro_batch, max_micro_batch=args.max_micro_batch,
        schedules=args.schedules or defaults.schedules, sp=sp,
        dp_modes=args.dp_modes or defaults.dp_modes,
        recompute=args.recompute or defaults.recompute,
        recompute_every=args.recompute_every, fp8=args.fp8,
        cp_attention=args.cp_attention or defaults.cp_attention,
        end_layers_off=args.end_layers_off,
    )  # fmt: skip


def _write_json(path: str, estimates: list) -> None:
    with open(path, "w") as f:
        for e in estimates:
            row = {
                "layout": e.layout.__dict__, "step_time_s": e.step_time,
                "tokens_per_s_per_gpu": e.tokens_per_s_per_gpu, "mfu": e.mfu,
                "peak_memory_bytes": e.peak_memory, "fits": e.fits,
                "bubble_fraction": e.bubble_fraction, "exposed_comm_s": e.exposed_comm,
                "memory": e.memory, "compute": e.compute,
                "comm": {g: c.__dict__ for g, c in e.comm.items()},
            }  # fmt: skip
            f.write(json.dumps(row) + "\n")


def run_search(args: argparse.Namespace) -> str:
    _, cost, overrides = _setup(args)
    world = cost.cluster.world_size
    result = search(cost, world, _space(args))
    if args.json:
        _write_json(args.json, result.ranked)
    counts = result.counts
    summary = (
        f"{cost.model.name} on {world}× {cost.cluster.gpu.name}: {counts['enumerated']} layouts, "
        f"{counts['rule']} break the trainer's rules, {counts['memory']} do not fit, "
        f"{counts['fits']} ranked"
    )
    if not result.ranked:
        node_shaped = CostModel(cost.model, args.node_shape, cost.table, cost.work)
        smallest = smallest_world_that_fits(node_shaped, world + 1, 1 << 16)
        need = (
            f"the smallest GPU count that fits is {smallest[0]} "
            f"({smallest[1].layout.label()}, {smallest[1].peak_memory / 2**30:.1f} GiB per GPU)"
            if smallest
            else "no power-of-two GPU count up to 65536 fits with global batch "
            f"{cost.work.global_batch} (it bounds dp and the pipeline's micro-batches)"
        )
        closest = (
            f"; the leanest layout here needs {result.too_big[0].peak_memory / 2**30:.1f} GiB per "
            f"GPU of {cost.cluster.gpu.memory_bytes / 2**30:.1f}"
            if result.too_big
            else ""
        )
        raise PlanError(f"model={cost.model.name} fits no layout on {world} GPUs{closest}: {need}")
    best = result.ranked[0]
    lines = [
        summary, "", table(result.ranked, args.top), "",
        "best layout's launch line:",
        launch_line(best, cost.cluster, overrides, cost.work.global_batch),
    ]  # fmt: skip
    if args.explain is not None:
        if not 1 <= args.explain <= len(result.ranked):
            raise PlanError(
                f"--explain={args.explain}: the table has rows 1 to {len(result.ranked)}"
            )
        lines += ["", explain(result.ranked[args.explain - 1])]
    return "\n".join(lines)


def run_explain(args: argparse.Namespace) -> str:
    train, cost, _ = _setup(args)
    world = cost.cluster.world_size
    layout = layout_of(train, world)
    problem = layout_problem(layout, cost.model, world, cost.work.global_batch, cost.work.seq_len)
    if problem:
        raise PlanError(f"the trainer would refuse this layout on {world} GPUs: {problem}")
    estimate = cost.estimate(layout)
    if args.json:
        _write_json(args.json, [estimate])
    fits = "fits" if estimate.fits else "does NOT fit"
    return explain(estimate) + f"\n{fits} in {cost.cluster.gpu.memory_bytes / 2**30:.1f} GiB"


def run_calibrate(args: argparse.Namespace) -> str:
    from mt_plan.measure import calibrate

    table = calibrate(args.device, tiny=args.tiny, fp8_recipes=args.fp8)
    with open(args.out, "w") as f:
        json.dump(table.to_dict(), f, indent=1)
    return f"wrote {len(table.entries)} measurements on {table.device} to {args.out}"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        handler = {"search": run_search, "explain": run_explain, "calibrate": run_calibrate}
        print(handler[args.command](args))
    except (PlanError, ClusterError, ValueError) as error:
        print(f"mt-plan: error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
