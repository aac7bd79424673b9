"""AdamW update kernels on the parameters of the 8-layer Llama3-8B-shaped trainer model.

Parameters: the embedding and output head (128256 × 4096), per layer q/k/v/o (4096×4096,
1024×4096 twice, 4096×4096), gate/up/down (14336×4096 twice, 4096×14336) and two norm gains,
plus the final norm: 2.796 B fp32 elements in 75 tensors, with random gradients and moments.
An update moves 28 bytes per element (reads θ, g, m, v; writes θ, m, v). Times are CUDA events
around one whole step, the median of ``--reps`` (``harness.median_ms``); the copy bandwidth is a
4 GiB → 4 GiB ``copy_``.

Rows: ``torch.optim.AdamW(fused=True)`` with and without a ``grad_scale`` (the trainer folds
its gradient clip into it), ``torch._foreach_norm`` of the gradients (the clip's norm), and
:class:`mt_fp8.FusedAdamW`'s Triton pass for each ``(elements, warps)`` per program in
``--sweep`` (default: the shipped setting).

Run: ``python benchmarks/adamw.py`` (CUDA GPU with Triton; about 40 GB of device memory).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import harness
import torch
import triton

from mt_fp8.kernels import adamw as kernels

DIM, KV, FFN, VOCAB, LAYERS = 4096, 1024, 14336, 128256, 8


def shapes() -> list[tuple[int, ...]]:
    layer = [(DIM, DIM), (KV, DIM), (KV, DIM), (DIM, DIM), (FFN, DIM), (FFN, DIM), (DIM, FFN)]
    block = [*layer, (DIM,), (DIM,)]
    return [(VOCAB, DIM), *(block * LAYERS), (DIM,), (VOCAB, DIM)]


def median_ms(fn: Callable[[], object], reps: int) -> float:
    return harness.median_ms(fn, repeats=reps, warmup=1)


def copy_ms(reps: int) -> float:
    src = torch.empty(2**30, device="cuda")
    dst = torch.empty_like(src)
    return median_ms(lambda: dst.copy_(src), reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument(
        "--sweep",
        default=f"{kernels.BLOCK}x{kernels.WARPS}",
        help="comma-separated ELEMENTSxWARPS per program, e.g. 1024x4,4096x8",
    )
    args = parser.parse_args()
    harness.require_cuda()
    torch.manual_seed(0)
    params = [torch.randn(s, device="cuda") * 0.02 for s in shapes()]
    grads = [torch.randn_like(p) * 1e-3 for p in params]
    exp_avgs = [torch.randn_like(p) * 1e-4 for p in params]
    exp_avg_sqs = [torch.rand_like(p) * 1e-6 for p in params]
    n = sum(p.numel() for p in params)
    moved = 28 * n

    rows: list[tuple[str, float, float]] = []
    ms = copy_ms(args.reps)
    rows.append(("copy 4 GiB → 4 GiB (bandwidth reference)", ms, 8 * 2**30 / ms / 1e9))

    leaves = [torch.nn.Parameter(p.clone()) for p in params]
    for leaf, grad in zip(leaves, grads, strict=True):
        leaf.grad = grad.clone()
    fused = torch.optim.AdamW(leaves, lr=1e-4, weight_decay=0.1, fused=True)
    fused.grad_scale = torch.tensor(1.3, device="cuda")
    ms = median_ms(fused.step, args.reps)
    rows.append(("torch.optim.AdamW(fused=True), grad_scale", ms, moved / ms / 1e9))
    del fused.grad_scale
    ms = median_ms(fused.step, args.reps)
    rows.append(("torch.optim.AdamW(fused=True)", ms, moved / ms / 1e9))
    del fused, leaves
    ms = median_ms(lambda: torch._foreach_norm(grads), args.reps)
    rows.append(("torch._foreach_norm (the clip's norm)", ms, 4 * n / ms / 1e9))

    scale = torch.tensor(1.3, device="cuda")
    for setting in args.sweep.split(","):
        block, warps = (int(v) for v in setting.split("x"))

        def step(block: int = block, warps: int = warps) -> None:
            for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
                kernels._adamw[(triton.cdiv(p.numel(), block),)](
                    p, g, m, v, scale, p.numel(), 1 - 1e-5, 0.9, 0.95, 1e-3, 0.3, 1e-8,
                    HAS_GRAD_SCALE=True, BLOCK=block, num_warps=warps,
                )  # fmt: skip

        ms = median_ms(step, args.reps)
        rows.append(
            (f"mt_fp8 Triton AdamW, {block} elements × {warps} warps", ms, moved / ms / 1e9)
        )

    print(f"# {torch.cuda.get_device_name()}, {n / 1e9:.3f} B parameters, {moved / 1e9:.1f} GB")
    print("\n| kernel | ms | TB/s |\n| --- | --- | --- |")
    for name, ms, gbps in rows:
        print(f"| {name} | {ms:.2f} | {gbps / 1e3:.2f} |")


if __name__ == "__main__":
    main()
