"""Tensorwise quantize + transpose + amax (current and delayed scaling) at the trainer's shapes.

Run on a CUDA GPU: ``python benchmarks/quantize_transpose.py`` (``--sweep`` also times other
tiles of :mod:`mt_fp8.kernels.quantize`: ``WRITE_TILE`` with a given scale, ``AMAX_TILE`` with
a computed one). Each row is one call of
:func:`~mt_fp8.kernels.quantize.quantize_transpose_amax_triton` as the FP8 linear layers make it,
with health counts on:

* ``given scale`` (delayed scaling): one launch reads ``x`` once and writes ``q``, ``qᵀ`` and
  the amax;
* ``current scale`` (tensorwise): an amax-only launch reads ``x`` first, so ``x`` is read twice.

Bytes counted: ``x`` read once per launch and each FP8 operand written once; GB/s is that over
the device time of one call, beside the GB/s of a device-to-device copy of the same input, all
timed as replays of a CUDA graph of ``--iters`` calls (``harness.graph_ms``: kernel time, no
launch cost). In the 8-layer Llama3-8B trainer these calls are a sizeable share of a step's
kernel time (the step profiles in ``docs/benchmarks-log.md``; current timings in
``docs/performance.md``, "Quantizers").
"""

from __future__ import annotations

import argparse

import harness
import torch

from mt_fp8.formats import FP8Format
from mt_fp8.kernels import quantize as kernels

TOKENS = 8192
CASES = [
    # (label, shape, dtype, format)
    ("activation 8192x4096", (TOKENS, 4096), torch.bfloat16, FP8Format.E4M3),
    ("gradient 8192x14336", (TOKENS, 14336), torch.bfloat16, FP8Format.E5M2),
    ("gradient 8192x1024", (TOKENS, 1024), torch.bfloat16, FP8Format.E5M2),
    ("weight 14336x4096 fp32", (14336, 4096), torch.float32, FP8Format.E4M3),
]
SWEEP_WRITE = [
    (32, 64, 4), (64, 64, 4), (64, 64, 8), (32, 128, 4), (64, 128, 4), (64, 128, 8),
    (128, 64, 4), (128, 64, 8), (128, 128, 8),
]  # fmt: skip
SWEEP_AMAX = [(64, 64, 4), (64, 128, 4), (32, 256, 4), (64, 256, 8), (128, 256, 8), (16, 512, 4)]


def time_us(fn, iters: int) -> float:
    return harness.graph_ms(fn, calls=iters) * 1e3


def quantize_call(x: torch.Tensor, fmt: FP8Format, given_scale: bool):
    stats = torch.zeros(3, dtype=torch.int64, device=x.device)
    scale = (x.abs().amax().float() / fmt.max).reshape(()) if given_scale else None
    return lambda: kernels.quantize_transpose_amax_triton(x, fmt, scale, stats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--sweep", action="store_true", help="time other tiles")
    args = parser.parse_args()
    harness.require_cuda()
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}, µs per call")
    print(
        "| call | given scale µs | GB/s | current scale µs | GB/s | copy GB/s |\n"
        "| --- | --- | --- | --- | --- | --- |"
    )
    for label, shape, dtype, fmt in CASES:
        x = torch.randn(*shape, device="cuda", dtype=dtype)
        copy = torch.empty_like(x)
        copy_us = time_us(lambda x=x, copy=copy: copy.copy_(x), args.iters)
        given_us = time_us(quantize_call(x, fmt, True), args.iters)
        current_us = time_us(quantize_call(x, fmt, False), args.iters)
        one_pass = x.numel() * (x.element_size() + 2)  # read x, write q and qᵀ
        two_pass = one_pass + x.numel() * x.element_size()  # and the amax launch's read
        print(
            f"| {label} | {given_us:.1f} | {one_pass / given_us / 1e3:.0f} | {current_us:.1f} | "
            f"{two_pass / current_us / 1e3:.0f} | "
            f"{2 * x.numel() * x.element_size() / copy_us / 1e3:.0f} |"
        )
    if not args.sweep:
        return
    defaults = kernels.WRITE_TILE, kernels.AMAX_TILE
    print("\n| call | write tile (given scale) | µs |\n| --- | --- | --- |")
    for label, shape, dtype, fmt in CASES:
        x = torch.randn(*shape, device="cuda", dtype=dtype)
        for tile in SWEEP_WRITE:
            kernels.WRITE_TILE = tile
            print(f"| {label} | {tile} | {time_us(quantize_call(x, fmt, True), args.iters):.1f} |")
    kernels.WRITE_TILE = defaults[0]
    print(
        f"\n| call | amax tile (current scale, write tile {defaults[0]}) | µs |\n| --- | --- | --- |"
    )
    for label, shape, dtype, fmt in CASES:
        x = torch.randn(*shape, device="cuda", dtype=dtype)
        for tile in SWEEP_AMAX:
            kernels.AMAX_TILE = tile
            print(f"| {label} | {tile} | {time_us(quantize_call(x, fmt, False), args.iters):.1f} |")
    kernels.WRITE_TILE, kernels.AMAX_TILE = defaults


if __name__ == "__main__":
    main()
