"""Expert GEMMs: mt's grouped GEMM (``torch._grouped_mm``) against one dense GEMM of the same rows
and against a per-expert loop, in bf16 and FP8, under uniform and skewed routing.

Run on an H200: ``python benchmarks/grouped_gemm.py --out grouped_gemm.jsonl`` (a few minutes);
``--smoke`` runs tiny shapes on whatever device is present (CPU: fp32, the FP8 columns run
mt-fp8's emulation) to check that the script works.

Workload per row: one expert projection ``y[group e] = x[group e] · W_eᵀ`` forward and backward
(``y.backward(dy)``, gradients cleared untimed before each call) over ``M = E · tokens_per_expert``
routed rows. Shapes ``(E, K, N)``: DeepSeek-V3 experts (width 7168, expert FFN 2048) with 8, 16
and 32 local experts, and the fine-grained DeepSeek-V2-Lite-like shape (64 experts, width 2048,
FFN 1408). Routing: ``uniform`` (every expert ``tokens_per_expert`` rows) or ``skewed`` (group
sizes a multinomial draw with softmax(2·N(0,1)) probabilities, seeded; some groups may be 0).

Columns (each the median of CUDA-event timings, ms; TFLOP/s = 6·M·K·N / time):

* ``dense``: one ``F.linear`` of all M rows with one ``[N, K]`` weight (the ceiling a grouped
  GEMM is held to: >= 70% of it is the issue's target);
* ``grouped``: ``mt_parallel.moe.GroupedLinear`` (``torch._grouped_mm``, groups padded to 16
  rows on CUDA);
* ``loop``: ``mt_parallel.moe.looped_mm`` (one ``F.linear`` per non-empty expert);
* ``fp8_dense`` / ``fp8_grouped``: the same with FP8 (``mt_fp8.FP8Linear`` /
  ``GroupedLinear.enable_fp8``, rowwise scaling with E4M3 for every role: the only formats
  ``torch._scaled_grouped_mm`` groups in all three GEMMs).

Peak memory (``torch.cuda.max_memory_allocated`` over the row's calls) is reported beside each.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import harness
import torch
import torch.nn.functional as F

from mt_fp8 import FormatConfig, FP8Linear, RowwiseScaling
from mt_parallel.moe import GroupedLinear, looped_mm

SHAPES = [  # (E, K, N, tokens per expert)
    (8, 7168, 2048, 512), (8, 7168, 2048, 2048), (16, 7168, 2048, 512), (16, 7168, 2048, 2048),
    (32, 7168, 2048, 512), (32, 7168, 2048, 1024), (64, 2048, 1408, 512), (64, 2048, 1408, 1024),
]  # fmt: skip
SMOKE_SHAPES = [(4, 64, 32, 16)]
ROUTINGS = ("uniform", "skewed")
COLUMNS = ("dense", "grouped", "loop", "fp8_dense", "fp8_grouped")


def group_sizes(experts: int, per_expert: int, routing: str, seed: int = 0) -> list[int]:
    """Rows per expert summing to ``experts · per_expert`` (module docstring)."""
    if routing == "uniform":
        return [per_expert] * experts
    generator = torch.Generator().manual_seed(seed)
    probs = torch.softmax(2 * torch.randn(experts, generator=generator), 0)
    draws = torch.multinomial(probs, experts * per_expert, replacement=True, generator=generator)
    return torch.bincount(draws, minlength=experts).tolist()


def fp8_recipe() -> RowwiseScaling:
    return RowwiseScaling(formats=FormatConfig.all_e4m3())


def bench(
    experts: int, k: int, n: int, per_expert: int, routing: str, device: str, iters: int
) -> dict:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sizes = group_sizes(experts, per_expert, routing)
    rows = sum(sizes)
    sizes_t = torch.tensor(sizes, device=device)
    x = torch.randn(rows, k, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(rows, n, device=device, dtype=dtype)
    grouped = GroupedLinear(experts, k, n, init_std=k**-0.5).to(device, dtype)
    dense_weight = grouped.weight.detach()[0].clone().requires_grad_()
    params = [x, grouped.weight, dense_weight]
    fp8_dense = FP8Linear(k, n, bias=False, recipe=fp8_recipe(), device=device, dtype=dtype)
    fp8_grouped = GroupedLinear(experts, k, n, init_std=k**-0.5).to(device, dtype)
    fp8_grouped.enable_fp8(fp8_recipe())
    for layer in (fp8_dense, fp8_grouped._fp8):
        layer.cache_weight = False  # one step's single micro-batch: weights quantized each call
    params += [fp8_dense.weight, fp8_grouped.weight]

    def clear() -> None:
        for p in params:
            p.grad = None

    steps: dict[str, Callable[[], None]] = {
        "dense": lambda: F.linear(x, dense_weight).backward(dy),
        "grouped": lambda: grouped(x, sizes_t).backward(dy),
        "loop": lambda: looped_mm(x, grouped.weight, sizes).backward(dy),
        "fp8_dense": lambda: fp8_dense(x).backward(dy),
        "fp8_grouped": lambda: fp8_grouped(x, sizes_t).backward(dy),
    }
    flops = 6.0 * rows * k * n
    row: dict = {"E": experts, "K": k, "N": n, "rows": rows, "routing": routing, "sizes": sizes}
    for name, step in steps.items():
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ms = harness.median_ms(step, repeats=iters, warmup=2, before=clear, device=device)
        row[f"{name}_ms"] = ms
        row[f"{name}_tflops"] = flops / ms / 1e9
        if device == "cuda":
            row[f"{name}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    row["grouped_vs_dense"] = row["dense_ms"] / row["grouped_ms"]
    row["grouped_vs_loop"] = row["loop_ms"] / row["grouped_ms"]
    row["fp8_grouped_vs_dense"] = row["fp8_dense_ms"] / row["fp8_grouped_ms"]
    row["fp8_vs_bf16_grouped"] = row["grouped_ms"] / row["fp8_grouped_ms"]
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on any device")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default=None, help="append result rows (JSON lines) here")
    args = parser.parse_args(argv)
    if args.smoke:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        shapes, iters = SMOKE_SHAPES, 1
    else:
        harness.require_cuda()
        device, shapes, iters = "cuda", SHAPES, args.iters
    name = torch.cuda.get_device_name() if device == "cuda" else device
    print(f"device: {name}, torch {torch.__version__}, fwd+bwd of one expert projection")
    for experts, k, n, per_expert in shapes:
        for routing in ROUTINGS:
            row = bench(experts, k, n, per_expert, routing, device, iters)
            row["device"] = name
            harness.emit(row, args.out)


if __name__ == "__main__":
    main()
