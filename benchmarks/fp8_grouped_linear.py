"""FP8GroupedLinear fwd+bwd time: grouped FP8 GEMMs vs the per-expert loop, and bf16 baselines.

Run on an H200 (or any CUDA GPU): ``python benchmarks/fp8_grouped_linear.py`` (about a minute);
``python benchmarks/fp8_grouped_linear.py --smoke`` runs tiny shapes on whatever device is
present (CPU: every FP8 column is the loop) to check that the script works.

Workload: MoE expert layers with T = 16384 routed tokens, bf16 parameters and activations,
``y = layer(x, group_sizes); y.backward(dy)`` per iteration (gradients cleared before it,
untimed; ``cache_weight=False``: each iteration is one optimizer step's single micro-batch, so
the FP8 weights are re-quantized). Routing is uneven and seeded: group sizes are 16 × a
multinomial draw over experts with softmax(N(0, 1)) probabilities (multiples of 16, the
alignment the grouped wgrad GEMM needs; a size may be 0). Shapes (E, K, N): Mixtral-like
(8, 4096, 14336) and (8, 14336, 4096), fine-grained (64, 2048, 1408).

Columns: "bf16 loop" (``F.linear`` per expert), "bf16 grouped_mm" (``torch._grouped_mm``),
then per FP8 recipe the per-expert loop and the grouped path (backend ``"fast"``, which groups
wherever ``"auto"`` does, and also block and MXFP8 layers of few experts). The
tensorwise and rowwise loops run with backend ``"scaled_mm"`` (cuBLAS per expert); with the
default hybrid formats only their forward GEMM is grouped (``torch._scaled_grouped_mm`` takes
E4M3 only), the ``_e4m3`` recipes (all roles E4M3) group all three GEMMs. Block scaling
(DeepSeek-V3; ``block`` all E4M3, its default, ``block_hybrid`` with E5M2 gradients) groups all
three GEMMs in mt-fp8's Triton kernels (``mt_fp8.grouped_block``); its loop is the one backend
``"auto"`` ran before that path existed (cuBLAS blockwise GEMMs where their rule takes the
operands, the Triton block GEMM otherwise), reached by making ``grouped_gemm_reason`` answer
with a reason (:func:`per_expert_loop`). MXFP8 (``mxfp8``: 1×32 groups with power-of-two scales
for every operand, hybrid formats) groups all three GEMMs in the same kernels with 32-deep
steps; its loop is backend ``"auto"``'s per-expert path (on Hopper, which has no MX tensor
cores, the exact bf16 GEMM of the dequantized operands, ``mt_fp8.gemm``). Times are medians of CUDA-event timings (wall clock on
CPU), in ms (``harness.median_ms``); after the table, each recipe's grouped path against its
loop and against bf16 ``grouped_mm``.

``--tensorwise-requant`` times only the per-step requantization of an fp32 expert stack into
FP8 ``W`` and ``Wᵀ`` under current tensorwise scaling (``mt_fp8.grouped._quantize_weights``,
what each optimizer step costs the grouped path), at the same shapes: the fused path (∞-norm,
then one stack launch; 4 + 4 + 1 + 1 bytes per weight) against the eager one
(``MT_FP8_DISABLE_TRITON=1``: cast, health counts, FP8 transpose copy), with the fused path's
rate in GB/s of those 10 bytes (without Triton both columns are the eager path).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable, Iterator

import harness
import torch
import torch.nn.functional as F

import mt_fp8.linear
from mt_fp8 import (
    BlockScaling,
    FormatConfig,
    FP8GroupedLinear,
    MXFP8Scaling,
    RowwiseScaling,
    TensorwiseScaling,
)
from mt_fp8.grouped import GEMMS, _quantize_weights, gemm_reason, grouped_gemm_reason

TOKENS = 16384
SHAPES = [(8, 4096, 14336), (8, 14336, 4096), (64, 2048, 1408)]  # (E, K, N)
SMOKE_TOKENS, SMOKE_SHAPES = 256, [(4, 128, 256)]  # block scaling needs multiples of 128
E4M3 = FormatConfig.all_e4m3()
RECIPES = [
    ("tensorwise", TensorwiseScaling()),
    ("rowwise", RowwiseScaling()),
    ("tensorwise_e4m3", TensorwiseScaling(formats=E4M3)),
    ("rowwise_e4m3", RowwiseScaling(formats=E4M3)),
    ("block", BlockScaling()),
    ("block_hybrid", BlockScaling(formats=FormatConfig())),
    ("mxfp8", MXFP8Scaling()),
]
LOOP_BACKENDS = {"block": "auto", "block_hybrid": "auto", "mxfp8": "auto"}
"""The loop's backend per recipe where it is not ``"scaled_mm"`` (module docstring)."""


@contextlib.contextmanager
def per_expert_loop(forced: bool) -> Iterator[None]:
    """With ``forced``, FP8GroupedLinear takes its per-expert loop whatever the backend."""
    original = mt_fp8.linear.grouped_gemm_reason
    if forced:
        mt_fp8.linear.grouped_gemm_reason = lambda *args: "the benchmark's per-expert loop"
    try:
        yield
    finally:
        mt_fp8.linear.grouped_gemm_reason = original


def routing(tokens: int, experts: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(experts, generator=generator), 0)
    chunks = torch.multinomial(probs, tokens // 16, replacement=True, generator=generator)
    return (torch.bincount(chunks, minlength=experts) * 16).tolist()


def time_ms(step: Callable[[], None], clear: Callable[[], None], device: str, iters: int) -> float:
    return harness.median_ms(step, repeats=iters, warmup=2, before=clear, device=device)


def bench_shape(experts: int, k: int, n: int, tokens: int, device: str, iters: int) -> dict:
    dtype = torch.bfloat16
    sizes = routing(tokens, experts)
    x = torch.randn(tokens, k, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(tokens, n, device=device, dtype=dtype)
    torch.manual_seed(0)
    weight = (torch.randn(experts, n, k, device=device, dtype=dtype) * k**-0.5).requires_grad_()
    params = [x, weight]

    def clear() -> None:
        for p in params:
            p.grad = None
        with torch.no_grad():
            x.add_(0)  # a new input each step: no FP8 copy of the last one is reused

    def bf16_loop() -> None:
        parts = [F.linear(x_e, weight[e]) for e, x_e in enumerate(torch.split(x, sizes))]
        torch.cat(parts).backward(dy)

    offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)

    def bf16_grouped() -> None:
        torch._grouped_mm(x, weight.transpose(1, 2), offs=offs).backward(dy)

    row = {"sizes": sizes, "bf16 loop": time_ms(bf16_loop, clear, device, iters)}
    try:
        row["bf16 grouped_mm"] = time_ms(bf16_grouped, clear, device, iters)
    except (AttributeError, RuntimeError, NotImplementedError):
        row["bf16 grouped_mm"] = None
    for name, recipe in RECIPES:
        loop_backend = LOOP_BACKENDS.get(name, "scaled_mm")
        for path, backend in (("loop", loop_backend), ("grouped", "fast")):
            layer = FP8GroupedLinear(
                experts,
                k,
                n,
                bias=False,
                recipe=recipe,
                backend=backend,
                device=device,
                dtype=dtype,
            )
            layer.cache_weight = False
            with torch.no_grad():
                layer.weight.copy_(weight)
            params[1:] = [layer.weight]
            reason = grouped_gemm_reason(x, layer.weight, sizes, recipe, backend, dtype)
            label = f"{name} {path}"
            if path == "grouped" and reason is not None:
                row[label] = None
                row.setdefault("notes", []).append(f"{label}: loop ({reason})")
                continue

            def fp8_step(layer: FP8GroupedLinear = layer, forced: bool = path == "loop") -> None:
                with per_expert_loop(forced):
                    layer(x, sizes).backward(dy)

            row[label] = time_ms(fp8_step, clear, device, iters)
        params[1:] = [weight]
    return row


@contextlib.contextmanager
def triton_disabled(disabled: bool) -> Iterator[None]:
    """``MT_FP8_DISABLE_TRITON`` set to ``disabled`` inside, restored after."""
    original = os.environ.get("MT_FP8_DISABLE_TRITON")
    os.environ["MT_FP8_DISABLE_TRITON"] = "1" if disabled else "0"
    try:
        yield
    finally:
        if original is None:
            del os.environ["MT_FP8_DISABLE_TRITON"]
        else:
            os.environ["MT_FP8_DISABLE_TRITON"] = original


def bench_requant(experts: int, k: int, n: int, device: str, iters: int) -> dict:
    """ms of one tensorwise requantization of an fp32 [E, N, K] stack into ``W`` and ``Wᵀ``,
    fused and eager (module docstring)."""
    layer = FP8GroupedLinear(experts, k, n, bias=False, recipe=TensorwiseScaling(), device=device)
    plan = layer.linear_plan(torch.empty(0, k, device=device), None)
    weight = layer.weight.detach()
    row = {}
    for path in ("fused", "eager"):
        with triton_disabled(path == "eager"):
            row[path] = time_ms(
                lambda: _quantize_weights(plan, weight, need_transpose=True),
                lambda: None,
                device,
                iters,
            )
    row["fused GB/s"] = 10 * weight.numel() / (row["fused"] * 1e-3) / 1e9
    return row


def speedups(shape: str, row: dict) -> list[str]:
    """Each recipe's grouped path against its loop and against bf16 grouped_mm (time ratios)."""
    lines = []
    for name, _ in RECIPES:
        grouped = row.get(f"{name} grouped")
        if grouped is None:
            continue
        parts = [f"{row[f'{name} loop'] / grouped:.2f}x its loop"]
        if row["bf16 grouped_mm"] is not None:
            parts.append(f"{row['bf16 grouped_mm'] / grouped:.2f}x bf16 grouped_mm")
        lines.append(f"{shape}: {name} grouped is {', '.join(parts)}")
    return lines


def main(argv: list[str] | None = None) -> dict[str, dict]:
    """Print the table and notes; returns each shape's row (keyed ``"E, K, N"``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on any device")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument(
        "--tensorwise-requant",
        action="store_true",
        help="time only the fp32 expert stack's tensorwise requantization, fused and eager",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        shapes, tokens, iters = SMOKE_SHAPES, SMOKE_TOKENS, 1
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA GPU (use --smoke for a CPU check)")
        device, shapes, tokens, iters = "cuda", SHAPES, TOKENS, args.iters
    if args.tensorwise_requant:
        return requant_table(shapes, device, iters)
    columns = ["bf16 loop", "bf16 grouped_mm"] + [
        f"{name} {path}" for name, _ in RECIPES for path in ("loop", "grouped")
    ]
    print(
        f"device: {torch.cuda.get_device_name() if device == 'cuda' else device}, "
        f"torch {torch.__version__}, T = {tokens}, bf16, fwd+bwd ms (median of {iters})\n"
    )
    for name, recipe in RECIPES:
        if isinstance(recipe, (BlockScaling, MXFP8Scaling)):
            grouped = list(GEMMS)  # mt_fp8.grouped_block: all three, any formats
        else:
            grouped = [g for g in GEMMS if gemm_reason(g, recipe, [16], torch.bfloat16) is None]
        print(f"- {name}: grouped GEMMs {', '.join(grouped) or 'none'}")
    print()
    print("| E, K, N | " + " | ".join(columns) + " |")
    print("| --- | " + " | ".join("---" for _ in columns) + " |")
    notes, rows = [], {}
    for experts, k, n in shapes:
        row = bench_shape(experts, k, n, tokens, device, iters)
        rows[f"{experts}, {k}, {n}"] = row
        cells = ["n/a" if row[c] is None else f"{row[c]:.2f}" for c in columns]
        print(f"| {experts}, {k}, {n} | " + " | ".join(cells) + " |")
        notes.append(f"{experts}, {k}, {n}: group sizes {row['sizes']}")
        notes += row.get("notes", [])
        notes += speedups(f"{experts}, {k}, {n}", row)
    print()
    for note in notes:
        print(f"- {note}")
    return rows


def requant_table(shapes: list[tuple[int, int, int]], device: str, iters: int) -> dict[str, dict]:
    """Print and return :func:`bench_requant`'s row per shape."""
    print(
        f"device: {torch.cuda.get_device_name() if device == 'cuda' else device}, "
        f"torch {torch.__version__}, fp32 [E, N, K] stack -> FP8 W and Wᵀ, tensorwise, "
        f"ms (median of {iters})\n"
    )
    print("| E, K, N | fused | eager | eager / fused | fused GB/s (10 B/weight) |")
    print("| --- | --- | --- | --- | --- |")
    rows = {}
    for experts, k, n in shapes:
        row = bench_requant(experts, k, n, device, iters)
        rows[f"{experts}, {k}, {n}"] = row
        print(
            f"| {experts}, {k}, {n} | {row['fused']:.3f} | {row['eager']:.3f} | "
            f"{row['eager'] / row['fused']:.2f} | {row['fused GB/s']:.0f} |"
        )
    return rows


if __name__ == "__main__":
    main()
