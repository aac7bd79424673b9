"""Per-step loss and gradient norm of fresh mt-train trainers on the throughput benchmark's model.

``benchmarks/train_throughput.py`` reports one ``last_loss`` per stack after its timed steps; this
script shows the whole trajectory, to tell an FP8 problem from early-training instability. Each
``LAYERS:RECOMPUTE:PRECISION:STEPS`` spec builds a new trainer exactly as the throughput
benchmark does (:func:`train_throughput.our_trainer`, and :func:`train_throughput.enable_fp8`
for an FP8 recipe), runs ``STEPS`` optimizer steps and prints one JSON line: the per-step
``(loss, grad_norm before clipping, anomaly event)``, peak memory and seconds. ``RECOMPUTE`` is
1 for full activation recompute; ``PRECISION`` is ``bf16`` or an mt_fp8 recipe name.

Run: ``python benchmarks/train_losses.py 32:1:bf16:6 32:1:delayed:6`` (CUDA GPU), or
``python benchmarks/train_losses.py --tiny 2:1:bf16:3`` for a CPU smoke test at toy sizes.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time

import torch
import train_throughput as bench


def run(spec: str, tiny: bool) -> dict:
    layers, recompute, precision, steps = spec.split(":")
    device = "cpu" if tiny else "cuda"
    shapes = bench.shapes(tiny)
    shapes.update(n_layers=int(layers), batch=1, recompute=int(recompute == "1"))
    began = time.perf_counter()
    trainer = bench.our_trainer(shapes, device, tempfile.mkdtemp(prefix="mt-losses-"))
    try:
        if precision != "bf16":
            bench.enable_fp8(trainer, precision)
        rows = []
        for _ in range(int(steps)):
            metrics = trainer.train_step()
            rows.append(
                (round(metrics["loss"], 4), round(metrics["grad_norm"], 3), metrics.get("event"))
            )
    finally:
        trainer.close()
    result = {"spec": spec, "steps": rows, "seconds": round(time.perf_counter() - began, 1)}
    if device == "cuda":
        result["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        torch.cuda.reset_peak_memory_stats()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "specs", nargs="+", help="LAYERS:RECOMPUTE:PRECISION:STEPS, e.g. 32:1:delayed:6"
    )
    parser.add_argument("--tiny", action="store_true", help="toy sizes on the CPU")
    args = parser.parse_args()
    for spec in args.specs:
        print(json.dumps(run(spec, args.tiny)), flush=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
