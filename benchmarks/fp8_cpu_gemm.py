"""FP8 GEMMs on the CPU: ``torch._scaled_mm`` against mt-fp8's emulation of the same GEMM.

Why it exists: ``mt_fp8.gemm.fp8_gemm(backend="auto")`` emulates tensorwise and rowwise GEMMs
on the CPU instead of calling ``torch._scaled_mm`` there; this script is the measurement that
choice rests on. Both sides compute ``(q_a · s_a)(q_b · s_b)ᵀ`` from the same FP8 operands
with fp32 accumulation (products of two FP8 values are exact in fp32); they differ in summation
order and in where the scales are applied, so the table also prints the largest difference
relative to ``Σ|a||b|``.

Run: ``python benchmarks/fp8_cpu_gemm.py [--threads N] [--out rows.jsonl]``. Shapes ``(M, K, N)``
are the GEMMs of the tests' tiny models (a micro-batch of 4×64 tokens through width-64 and
width-128 layers) and one of a debug-sized Llama (width 256).

Columns: ``scaled_mm_ms`` (``torch._scaled_mm``), ``emulate_ms`` (``fp8_gemm(backend=
"emulate")``, dequantize both operands to fp32 and ``@``), ``speedup`` (their ratio), and
``max_rel_diff``. Times are medians of wall-clock calls (``harness.median_ms``).
"""

from __future__ import annotations

import argparse

import harness
import torch

from mt_fp8 import FP8Format, RowwiseScaling, TensorRole, TensorwiseScaling, fp8_gemm, quantize

SHAPES = ((256, 64, 128), (256, 128, 64), (256, 64, 320), (1024, 256, 768))
RECIPES = {"tensorwise": TensorwiseScaling(), "rowwise": RowwiseScaling()}


def measure(m: int, k: int, n: int, recipe: str, repeats: int) -> dict:
    generator = torch.Generator().manual_seed(m * k + n)
    a = torch.randn(m, k, generator=generator)
    b = torch.randn(n, k, generator=generator)
    scaling = RECIPES[recipe]
    qa = quantize(a, FP8Format.E4M3, scaling.layout(TensorRole.INPUT))
    qb = quantize(b, FP8Format.E4M3, scaling.layout(TensorRole.WEIGHT))
    fast = fp8_gemm(qa, qb, torch.float32, backend="scaled_mm")
    slow = fp8_gemm(qa, qb, torch.float32, backend="emulate")
    magnitude = qa.dequantize().abs() @ qb.dequantize().abs().t()
    row = {
        "shape": [m, k, n],
        "recipe": recipe,
        "threads": torch.get_num_threads(),
        "scaled_mm_ms": harness.median_ms(
            lambda: fp8_gemm(qa, qb, torch.float32, backend="scaled_mm"),
            repeats=repeats,
            device="cpu",
        ),
        "emulate_ms": harness.median_ms(
            lambda: fp8_gemm(qa, qb, torch.float32, backend="emulate"),
            repeats=repeats,
            device="cpu",
        ),
        "max_rel_diff": float(((fast - slow).abs() / magnitude.clamp_min(1e-30)).max()),
    }
    row["speedup"] = round(row["scaled_mm_ms"] / row["emulate_ms"], 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="the first shape only")
    parser.add_argument("--out", default=None, help="append JSON lines here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for m, k, n in SHAPES[:1] if args.smoke else SHAPES:
        for recipe in RECIPES:
            harness.emit(measure(m, k, n, recipe, args.repeats), args.out)


if __name__ == "__main__":
    main()
