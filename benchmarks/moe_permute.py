"""MoE permute and unpermute: the PyTorch path against the fused Triton kernels, forward + backward.

Run on a CUDA GPU: ``python benchmarks/moe_permute.py --out moe_permute.jsonl`` (about a
minute); ``--smoke`` runs tiny shapes on whatever device is present (on the CPU without
``TRITON_INTERPRET=1`` both columns run the PyTorch path) to check that the script works.

Workload per row: one rank's routing of ``T`` tokens (top-``K`` of seeded random scores over
``E`` experts; the plan is built once, untimed, by ``mt_parallel.moe.capacity.permute_plan``),
dropless or with capacity factor 1.25 padded to capacity. Two ops, each forward + backward
(``torch.autograd.grad``, so no gradient accumulation is timed), bf16 rows, fp32 weights:

* ``permute``: ``x_TD`` -> ``x_MD`` (the expert-sorted, possibly padded rows);
* ``unpermute``: ``y_MD``, ``w_TK`` -> ``out_TD = Σ_j w_tj · y(row of t, j)``.

Shapes ``(name, T, D, E, K)``: DeepSeek-V3 (hidden 7168, 256 routed experts, top-8) and
Mixtral 8x7B (hidden 4096, 8 experts, top-2) at 4096 and 8192 tokens per rank.

Columns (median of ``harness.median_ms``, ms): ``pytorch`` (``permute_rows_reference`` /
``unpermute_rows_reference``: ``index_select``/``index_copy`` and, for unpermute, the
``[T·K, D]`` temporary), ``fused`` (``mt_fp8.ops.permute_rows`` / ``unpermute_rows``: Triton on
CUDA, inverse maps included), their ratio, and each one's peak memory above the inputs
(``torch.cuda.max_memory_allocated``, CUDA only). ``bytes`` is the least one forward + backward
must move (rows read and written once, bf16), for GB/s.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import harness
import torch

from mt_fp8.ops import permute_rows, unpermute_rows
from mt_fp8.ops.moe_permute import (
    fused_permute_runs,
    permute_rows_reference,
    unpermute_rows_reference,
)
from mt_parallel.moe.capacity import PermutePlan, permute_plan

SHAPES = [  # (name, tokens, hidden, experts, top_k)
    ("deepseek_v3", 4096, 7168, 256, 8),
    ("deepseek_v3", 8192, 7168, 256, 8),
    ("mixtral_8x7b", 4096, 4096, 8, 2),
    ("mixtral_8x7b", 8192, 4096, 8, 2),
]
SMOKE_SHAPES = [("tiny", 32, 24, 8, 2), ("tiny_top4", 16, 40, 6, 4)]
CAPACITIES = (None, 1.25)
"""Dropless, and capacity factor 1.25 padded to capacity."""


def routing(
    tokens: int, experts: int, top_k: int, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded top-k indices and softmax weights (fp32) of random scores."""
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(tokens, experts, generator=generator)
    top = scores.topk(top_k, dim=1)
    return top.indices.to(device), torch.softmax(top.values, dim=1).to(device)


def fwd_bwd(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor]) -> Callable[[], None]:
    upstream: list[torch.Tensor] = []

    def step() -> None:
        out = fn(*inputs)
        if not upstream:
            upstream.append(torch.randn_like(out))
        torch.autograd.grad(out, inputs, upstream[0])

    return step


def timed(step: Callable[[], None], device: str, repeats: int) -> tuple[float, float | None]:
    """``(ms, peak MiB above what was allocated before)``; peak is None off CUDA."""
    on_cuda = device == "cuda"
    if on_cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    ms = harness.median_ms(step, repeats=repeats, device=device)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if on_cuda else None
    return ms, peak


def bench(
    shape: tuple[str, int, int, int, int], capacity: float | None, device: str, repeats: int
) -> list[dict]:
    name, tokens, hidden, experts, top_k = shape
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    indices_TK, weights_TK = routing(tokens, experts, top_k, device)
    plan: PermutePlan = permute_plan(indices_TK, experts, capacity, capacity is not None)
    order_N, rows_N, num_rows = plan.order_N, plan.rows_N, plan.num_rows
    x_TD = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    y_MD = torch.randn(num_rows, hidden, device=device, dtype=dtype, requires_grad=True)
    weights_TK.requires_grad_()
    kept, element = order_N.numel(), torch.finfo(dtype).bits // 8
    ops = {
        # permute: fwd reads kept rows, writes all rows; bwd reads kept rows, writes T rows.
        "permute": (
            lambda x: permute_rows_reference(x, order_N, rows_N, num_rows, top_k),
            lambda x: permute_rows(x, order_N, rows_N, num_rows, top_k),
            [x_TD],
            (kept + num_rows + kept + tokens) * hidden * element,
        ),
        # unpermute: fwd reads kept rows, writes T; bwd reads T and kept rows, writes all rows.
        "unpermute": (
            lambda y, w: unpermute_rows_reference(y, order_N, rows_N, w),
            lambda y, w: unpermute_rows(y, order_N, rows_N, w),
            [y_MD, weights_TK],
            (kept + tokens + tokens + kept + num_rows) * hidden * element,
        ),
    }
    rows = []
    for op, (reference, fused, inputs, nbytes) in ops.items():
        pytorch_ms, pytorch_mib = timed(fwd_bwd(reference, inputs), device, repeats)
        fused_ms, fused_mib = timed(fwd_bwd(fused, inputs), device, repeats)
        rows.append(
            {
                "op": op, "shape": name, "tokens": tokens, "hidden": hidden,
                "experts": experts, "top_k": top_k, "capacity_factor": capacity,
                "rows": num_rows, "dtype": str(dtype).removeprefix("torch."),
                "fused_path": "triton" if fused_permute_runs(x_TD) else "pytorch", "bytes": nbytes,
                "pytorch_ms": pytorch_ms, "fused_ms": fused_ms,
                "speedup": pytorch_ms / fused_ms,
                "pytorch_gbps": nbytes / pytorch_ms / 1e6, "fused_gbps": nbytes / fused_ms / 1e6,
                "pytorch_peak_mib": pytorch_mib, "fused_peak_mib": fused_mib,
            }
        )  # fmt: skip
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any device")
    parser.add_argument("--out", help="append the rows to this JSON-lines file")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if args.smoke:
        device, shapes, repeats = ("cuda" if torch.cuda.is_available() else "cpu"), SMOKE_SHAPES, 2
    else:
        harness.require_cuda()
        device, shapes, repeats = "cuda", SHAPES, args.repeats
    for shape in shapes:
        for capacity in CAPACITIES:
            for row in bench(shape, capacity, device, repeats):
                harness.emit(row, args.out)


if __name__ == "__main__":
    main()
