"""MoE token dispatch + combine over the expert-parallel group against the raw all-to-all.

One ``torchrun``, ``ep`` = the world. Each rank holds ``--tokens`` tokens of width ``--dim``
(bf16 on GPUs, fp32 on the CPU) routed top-``k`` over ``--experts`` experts (``uniform``: token
``t`` picks experts ``(t·k + j) mod E``, every rank sends the same to everyone; ``skewed``:
softmax(2·N(0,1)) expert popularity, seeded). Rows (JSON, rank 0, appended to ``--out``):

* ``raw``: ``torch.distributed.all_to_all_single`` of the same number of rows a dispatch moves
  (``T·k`` rows of ``dim`` values, equal splits), forward only;
* ``dispatch_combine``: :class:`mt_parallel.moe.AllToAllDispatcher` around an identity expert
  (the count exchange, the uneven all-to-all there, the regrouping by local expert, and the way
  back), preceded by the local permutation and followed by the weighted unpermute
  (:func:`mt_parallel.moe.dispatch_and_combine`): what an MoE layer pays outside its GEMMs.

Bus bandwidth, NCCL-tests' convention for all-to-all: ``bytes · (P−1)/P / time`` per
all-to-all (``bytes`` one rank's send buffer); ``dispatch_combine`` counts its two all-to-alls
(``busbw = 2 · bytes · (P−1)/P / time``), so ``busbw_fraction = busbw / raw busbw`` is the share
of the machine's all-to-all bandwidth MoE dispatch achieves (the issue's target: >= 0.8).
Times are medians over ``--iters`` calls between barriers, the slowest rank's.

Run on 8 GPUs (NVLink multicast off, docs/multi_gpu.md)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --nproc-per-node 8 benchmarks/multi_gpu/moe_alltoall.py --out a2a.jsonl
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 benchmarks/multi_gpu/moe_alltoall.py \\
        --device cpu --tiny                                    # the CPU rehearsal on gloo
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))  # the shared harness
import harness  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import mt_comm  # noqa: E402
from mt_parallel.moe import AllToAllDispatcher, dispatch_and_combine  # noqa: E402


def routing(tokens: int, top_k: int, experts: int, kind: str, rank: int) -> torch.Tensor:
    if kind == "uniform":
        return (torch.arange(tokens * top_k) % experts).view(tokens, top_k)
    generator = torch.Generator().manual_seed(rank)
    popularity = torch.softmax(
        2 * torch.randn(experts, generator=torch.Generator().manual_seed(0)), 0
    )
    scores = (
        popularity.log() + torch.rand(tokens, experts, generator=generator).log().neg().log().neg()
    )
    return scores.topk(top_k, dim=-1).indices


def timed(fn, device: torch.device, iters: int) -> float:
    """The slowest rank's median ms of ``fn`` (each call between barriers)."""
    times = []
    for i in range(iters + 2):
        harness.synchronize(device)
        dist.barrier()
        began = time.perf_counter()
        fn()
        harness.synchronize(device)
        if i >= 2:
            times.append((time.perf_counter() - began) * 1e3)
    ms = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return float(ms)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    parser.add_argument("--dim", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="small shapes for a CPU rehearsal")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.tiny:
        args.tokens, args.dim, args.experts, args.top_k, args.iters = 64, 32, 8, 2, 3
    ctx = mt_comm.init_distributed(device=args.device)
    device, world, rank = ctx.torch_device, ctx.world_size, ctx.rank
    if args.experts % world:
        raise SystemExit(f"--experts {args.experts} is not divisible by the world {world}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    group = dist.group.WORLD
    x = torch.randn(args.tokens, args.dim, device=device, dtype=dtype)
    weights = torch.full((args.tokens, args.top_k), 1.0 / args.top_k, device=device)
    rows = args.tokens * args.top_k
    send_bytes = rows * args.dim * x.element_size()
    raw_in = torch.randn(rows, args.dim, device=device, dtype=dtype)
    raw_out = torch.empty_like(raw_in)
    raw_ms = timed(lambda: dist.all_to_all_single(raw_out, raw_in, group=group), device, args.iters)
    fraction = (world - 1) / world
    raw_busbw = send_bytes * fraction / raw_ms / 1e6  # GB/s
    dispatcher = AllToAllDispatcher(args.experts, group)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    for kind in ("uniform", "skewed"):
        indices = routing(args.tokens, args.top_k, args.experts, kind, rank).to(device)
        with torch.no_grad():
            out, _ = dispatch_and_combine(
                dispatcher, x, indices, weights, lambda rows_, sizes: rows_, None, False
            )
        # Identity experts: combining the k copies with weights summing to 1 returns x.
        if not torch.allclose(
            out.float(), x.float(), atol=1e-2 if dtype == torch.bfloat16 else 1e-6
        ):
            raise SystemExit(f"dispatch + combine did not return the tokens ({kind} routing)")

        def step(indices: torch.Tensor = indices) -> None:
            with torch.no_grad():
                dispatch_and_combine(
                    dispatcher, x, indices, weights, lambda rows_, sizes: rows_, None, False
                )

        ms = timed(step, device, args.iters)
        busbw = 2 * send_bytes * fraction / ms / 1e6
        row = {
            "device": name, "world": world, "tokens": args.tokens, "dim": args.dim,
            "experts": args.experts, "top_k": args.top_k, "routing": kind,
            "raw_ms": raw_ms, "raw_busbw_gbps": raw_busbw, "dispatch_combine_ms": ms,
            "busbw_gbps": busbw, "busbw_fraction": busbw / raw_busbw,
        }  # fmt: skip
        if rank == 0:
            harness.emit(row, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
