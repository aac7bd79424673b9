"""How many layouts ``mt-plan``'s search scores per minute (one process, the CPU).

The search of :func:`mt_plan.search` runs over the full default space (every tp, cp, pp, vpp,
schedule, data-parallel mode, micro-batch, recompute policy and FP8 recipe the trainer's rules
allow) for a model shape and a GPU count, with the H200 calibration table. Reported: layouts
enumerated, how many the trainer's rules and the memory check removed, wall seconds and layouts
per minute (enumerated / seconds; every enumerated layout is at least checked against the
rules, every valid one priced). The first pipeline layout imports torch for mt-parallel's
simulator; that import is inside the timing.

Run: ``python benchmarks/plan_search_speed.py`` (Llama3-70B, 64 GPUs, sequence 8192, 512
sequences), ``--model llama3_8b --gpus 8`` for another case, ``--tiny`` for a CPU smoke run.
The requirement it checks: at least 10,000 layouts a minute on two cores.
"""

from __future__ import annotations

import argparse
import json
import time

REQUIRED_PER_MINUTE = 10_000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3_70b")
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument(
        "--tiny", action="store_true", help="4 GPUs, llama3_1b, 4 sequences: a smoke run"
    )
    parser.add_argument("--out", help="append the result as a JSON line")
    args = parser.parse_args(argv)
    if args.tiny:
        # Every tp, cp, pp, vpp and schedule of 4 GPUs; a global batch of 4 (not 16) leaves
        # out the micro-batches of 8 and 16 sequences: 8,820 layouts instead of 15,600.
        args.model, args.gpus, args.seq, args.global_batch = "llama3_1b", 4, 2048, 4

    from mt_plan import CostModel, Workload, load_cluster, load_table, search
    from mt_plan.models import resolve, shape_of

    config = resolve([f"model={args.model}", f"trainer.seq_len={args.seq}",
                      f"trainer.global_batch_size={args.global_batch}",
                      "trainer.micro_batch_size=1"])  # fmt: skip
    cost = CostModel(
        shape_of(config.model), load_cluster("h200_nodes").with_gpus(args.gpus),
        load_table("h200"), Workload(seq_len=args.seq, global_batch=args.global_batch),
    )  # fmt: skip
    start = time.perf_counter()
    result = search(cost, args.gpus)
    seconds = time.perf_counter() - start
    per_minute = result.counts["enumerated"] / seconds * 60
    row = {"model": args.model, "gpus": args.gpus, "seq": args.seq,
           "global_batch": args.global_batch, **result.counts, "seconds": round(seconds, 2),
           "layouts_per_minute": round(per_minute)}  # fmt: skip
    print(json.dumps(row))
    verdict = "meets" if per_minute >= REQUIRED_PER_MINUTE else "misses"
    print(f"{per_minute:,.0f} layouts/min: {verdict} the {REQUIRED_PER_MINUTE:,}/min requirement")
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
