"""Host time of one ``mt_fp8.FusedAdamW.step`` without its kernels: what the CPU spends per step.

In a training step the optimizer runs right after the trainer's one host synchronisation, so
the device waits for everything the host does before the first AdamW launch. This times the
step's Python side (the kernel check, the per-parameter CPU step counters and bias corrections,
the launch calls) with the Triton launch replaced by a stub that only counts, on small CPU
tensors (``TRITON_INTERPRET=1`` lets the Triton path take them). Parameters: the 8-layer
Llama3-8B trainer model's 75 tensors (56 matrices, 17 norm gains, embedding and head), shrunk.

Run: ``python benchmarks/adamw_host.py [--reps 200]`` (any machine; no GPU needed). The host of
a GPU machine may be faster or slower than the one it runs on.
"""

from __future__ import annotations

import argparse
import os

os.environ["TRITON_INTERPRET"] = "1"  # before mt_fp8 reads it: CPU tensors take the kernel path

import harness
import torch

import mt_fp8.kernels.adamw as kernels
from mt_fp8 import FusedAdamW


class _CountingLaunch:
    """Stands in for the Triton kernel: ``_adamw[grid](...)`` only counts the call."""

    def __init__(self) -> None:
        self.calls = 0

    def __getitem__(self, grid: tuple[int, ...]):
        def launch(*args: object, **kwargs: object) -> None:
            self.calls += 1

        return launch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    stub = _CountingLaunch()
    kernels._adamw = stub  # type: ignore[assignment]
    shapes = [(16, 16)] * 56 + [(16,)] * 17 + [(32, 16)] * 2
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer = FusedAdamW(params, lr=1e-4, weight_decay=0.1)
    optimizer.grad_scale = torch.tensor(1.0)
    ms = harness.median_ms(optimizer.step, repeats=args.reps, warmup=10, device="cpu")
    print(
        f"FusedAdamW.step host time, {len(params)} parameters, launches stubbed "
        f"({stub.calls // (args.reps + 10)} per step): median {ms:.3f} ms"
    )


if __name__ == "__main__":
    main()
