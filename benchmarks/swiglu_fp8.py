"""SwiGLU into FP8: the down projection's input quantized straight from gate and up, against
SwiGLU then quantize, on one GPU.

The tensor is the SwiGLU product of the Llama3-8B MLP at 8192 tokens (R×F = 8192×14336 bf16),
as the FP8 down projection needs it: FP8 ``x`` and ``xᵀ`` with one tensorwise scale, plus the
amax. Four rows, each the summed kernel time of one call (PyTorch profiler, mean of 10 calls,
``harness.kernel_ms``):

* ``separate, delayed``: ``swiglu(g, u)`` (reads g and u, writes x), then
  ``quantize_transpose_amax(x, scale=s)`` (reads x, writes x and xᵀ in FP8 and the amax):
  ``2·2 + 2 + 2 + 1 + 1 = 10`` bytes per element.
* ``fused, delayed``: ``swiglu_quantize_transpose_amax(g, u, scale=s)``: 2·2 + 1 + 1 = 6 bytes.
* ``separate, current`` / ``fused, current``: no scale given, so an amax pass runs first (reads x,
  or g and u): 12 and 10 bytes per element.

``GB/s`` is those bytes over the time; ``% copy`` relates it to a device-to-device copy.

Run: ``python benchmarks/swiglu_fp8.py [--rows 8192 --cols 14336]`` (CUDA GPU).
"""

from __future__ import annotations

import argparse

import harness
import torch

from mt_fp8 import FP8Format
from mt_fp8.ops import quantize_transpose_amax, swiglu, swiglu_quantize_transpose_amax


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=14336)
    args = parser.parse_args()
    harness.require_cuda()
    shape = (args.rows, args.cols)
    gate, up = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    fmt = FP8Format.E4M3
    scale = torch.tensor(0.01, device="cuda")
    elements = gate.numel()
    cases = {
        ("separate", "delayed"): (
            lambda: quantize_transpose_amax(swiglu(gate, up), fmt, scale=scale),
            10,
        ),
        ("fused", "delayed"): (
            lambda: swiglu_quantize_transpose_amax(gate, up, fmt, scale=scale),
            6,
        ),
        ("separate", "current"): (lambda: quantize_transpose_amax(swiglu(gate, up), fmt), 12),
        ("fused", "current"): (lambda: swiglu_quantize_transpose_amax(gate, up, fmt), 10),
    }
    copy = harness.copy_gbps(2**31) * 1e9
    print(f"SwiGLU into FP8, {args.rows}×{args.cols} bf16, {torch.cuda.get_device_name()}")
    print(f"copy bandwidth {copy / 1e9:.0f} GB/s\n")
    print("| path | scaling | µs | bytes/element | GB/s | % copy |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for (path, scaling), (fn, bytes_per_element) in cases.items():
        seconds = harness.kernel_ms(fn) / 1e3
        rate = bytes_per_element * elements / seconds
        print(
            f"| {path} | {scaling} | {seconds * 1e6:.1f} | {bytes_per_element} | "
            f"{rate / 1e9:.0f} | {100 * rate / copy:.0f}% |"
        )


if __name__ == "__main__":
    main()
