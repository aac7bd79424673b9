"""Block-scaled quantizers (DeepSeek-V3 recipe) at the trainer's shapes, as µs and GB/s.

Run on a CUDA GPU: ``python benchmarks/block_quantize.py`` (``--sweep`` also times the tile
configurations of :mod:`mt_fp8.kernels.block_quantize`'s two group kernels). Each row is one
call as the FP8 linear layers make it, with health counts on:

* activations and output gradients (bf16, ``tokens × features``): 1×128 groups along the
  features plus the wgrad GEMM's transposed 1×128 groups along the tokens
  (:func:`~mt_fp8.kernels.block_quantize.quantize_groups_with_transpose`);
* fp32 master weights: 128×128 blocks plus their exact transpose
  (:func:`~mt_fp8.kernels.block_quantize.quantize_square_blocks`).

Bytes counted: the input read once and each FP8 operand written once (the minimum); GB/s is
that over the device time of one call (mean over ``--iters`` calls), beside the
GB/s of a device-to-device copy of the same input (read + write), both timed as replays of a
CUDA graph of ``--iters`` calls (``harness.graph_ms``: kernel time, no launch cost, as in the
trainer's graphed step; timed call by call, the smaller calls are launch-bound).
"""

from __future__ import annotations

import argparse

import harness
import torch

from mt_fp8.formats import FP8Format
from mt_fp8.kernels import block_quantize

TOKENS = 8192
CASES = [
    # (label, shape, dtype, format, square weight blocks)
    ("activation 8192x4096", (TOKENS, 4096), torch.bfloat16, FP8Format.E4M3, False),
    ("activation 8192x14336", (TOKENS, 14336), torch.bfloat16, FP8Format.E4M3, False),
    ("gradient 8192x1024", (TOKENS, 1024), torch.bfloat16, FP8Format.E4M3, False),
    ("weight 4096x4096 fp32", (4096, 4096), torch.float32, FP8Format.E4M3, True),
    ("weight 14336x4096 fp32", (14336, 4096), torch.float32, FP8Format.E4M3, True),
    ("weight 4096x14336 fp32", (4096, 14336), torch.float32, FP8Format.E4M3, True),
]
SWEEP_ROWS = [(16, 128, 2), (32, 128, 4), (64, 128, 4), (64, 128, 8)]
SWEEP_COLUMNS = [(128, 32, 2), (128, 32, 4), (128, 64, 4), (128, 64, 8)]


def time_us(fn, iters: int) -> float:
    """Device µs per call, from a CUDA graph of ``iters`` calls (module docstring)."""
    return harness.graph_ms(fn, calls=iters) * 1e3


def quantize_call(x: torch.Tensor, fmt: FP8Format, square: bool):
    stats = torch.zeros(3, dtype=torch.int64, device=x.device)
    if square:
        return lambda: block_quantize.quantize_square_blocks(x, fmt, stats, transpose=True)
    return lambda: block_quantize.quantize_groups_with_transpose(x, fmt, stats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--sweep", action="store_true", help="time the group kernels' tiles")
    args = parser.parse_args()
    harness.require_cuda()
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}, µs per call")
    print("| call | µs | GB/s | copy GB/s |\n| --- | --- | --- | --- |")
    for label, shape, dtype, fmt, square in CASES:
        x = torch.randn(*shape, device="cuda", dtype=dtype)
        copy = torch.empty_like(x)
        copy_us = time_us(lambda x=x, copy=copy: copy.copy_(x), args.iters)
        us = time_us(quantize_call(x, fmt, square), args.iters)
        moved = x.numel() * (x.element_size() + 2)  # read x, write the operand and its transpose
        print(
            f"| {label} | {us:.1f} | {moved / us / 1e3:.0f} | "
            f"{2 * x.numel() * x.element_size() / copy_us / 1e3:.0f} |"
        )
    if not args.sweep:
        return
    defaults = block_quantize.ROWS_TILE, block_quantize.COLUMNS_TILE
    print("\n| call | rows tile | columns tile | µs |\n| --- | --- | --- | --- |")
    for label, shape, dtype, fmt, square in CASES:
        if square:
            continue
        x = torch.randn(*shape, device="cuda", dtype=dtype)
        for rows_tile in SWEEP_ROWS:
            for columns_tile in SWEEP_COLUMNS:
                block_quantize.ROWS_TILE, block_quantize.COLUMNS_TILE = rows_tile, columns_tile
                us = time_us(quantize_call(x, fmt, square), args.iters)
                print(f"| {label} | {rows_tile} | {columns_tile} | {us:.1f} |")
    block_quantize.ROWS_TILE, block_quantize.COLUMNS_TILE = defaults


if __name__ == "__main__":
    main()
