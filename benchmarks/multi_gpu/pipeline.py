"""Pipeline-parallel throughput and measured bubble on N devices (one ``torchrun``).

Two kinds of stage:

* ``--model llama3_8b|llama3_70b|tiny``: mt-train's Llama (``mt_train.models.build``) with that
  size's shapes (``--layers`` overrides the block count; ``tiny`` is the CPU rehearsal), cut
  into ``pp·v`` chunks by :func:`mt_parallel.pipeline_module` (TP/SP inside each chunk with
  ``--tp``, FP8 with ``--fp8 <recipe>``), run by :class:`mt_parallel.PipelineSchedule`
  (torch's action runtime) with bf16 autocast on accelerators, AdamW after each step.
* ``--fixed-ms F I W``: every chunk is a stand-in whose forward sleeps ``F`` ms, whose input
  gradient sleeps ``I`` ms and whose weight gradient (deferred through a ``wgrad_sink``, as
  FP8 layers defer theirs) sleeps ``W`` ms: known costs, so the measured bubble can be held to
  the simulator's (:func:`mt_parallel.pipeline.simulate`) with the same costs.

Measured per step, on every rank, then reduced: the step time ``T`` (barrier, step, the slowest
rank's end) and the busy time (the sum of this rank's chunk actions ``forward_one_chunk``,
``backward_one_chunk``, ``backward_weight_one_chunk``, each timed between device
synchronisations). Reported:

* ``tokens_per_s_per_gpu`` = tokens per step / ``T`` / world size;
* ``mfu`` = tokens/s/GPU · FLOPs per token (``6·N + 12·L·D·T``) / the device's dense bf16 peak;
* ``bubble_measured`` = ``1 − Σ busy / (p · T)`` over the pipeline ranks, ``bubble_simulated``
  the simulator's for the measured mean action times (the ratio of F, B, W taken from the run);
* ``saved_peak_bytes``: per rank (global rank order), the most bytes of autograd-saved
  activations it held during one more, untimed step run under
  :class:`mt_parallel.pipeline.ActivationMeter` (what it counts and what not: its docstring;
  with the tensors the runner's weight-gradient sinks keep for ``W``), next to
  ``in_flight_simulated``, the simulator's peak micro-batch chunks from ``F`` to ``I`` per
  pipeline rank.

Runs (one JSON row per configuration on rank 0, appended to ``--out``)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --nproc-per-node 8 benchmarks/multi_gpu/pipeline.py --model llama3_8b \\
        --pp 8 --schedule 1f1b --microbatches 16 --out pipeline.jsonl
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 benchmarks/multi_gpu/pipeline.py \\
        --fixed-ms 40 40 40 --pp 4 --schedule zero_bubble --microbatches 8 --device cpu
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: the shared harness
import harness  # noqa: E402

import mt_comm  # noqa: E402
import mt_fp8  # noqa: E402
import mt_parallel  # noqa: E402
from mt_parallel.pipeline import (  # noqa: E402
    ActivationMeter,
    ChunkCosts,
    chunks_per_rank,
    schedule_actions,
    simulate,
)

TINY = {"dim": 64, "n_layers": 8, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
        "vocab_size": 256}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help="llama3_8b, llama3_70b or tiny")
    parser.add_argument("--fixed-ms", type=float, nargs=3, metavar=("F", "I", "W"))
    parser.add_argument("--layers", type=int, help="decoder blocks (default: the size's)")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--chunks", type=int, default=1, help="chunks per rank (interleaved)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=None, help="default: 8192, tiny 64")
    parser.add_argument("--fp8", default=None, help="an mt_fp8 recipe name (default bf16)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


class _SleepFn(torch.autograd.Function):
    """``y = x·w``: forward sleeps F ms; backward sleeps I ms for ``dx`` and defers ``dw``
    (sleeping W ms) to the layer's sink, or computes it at once without one."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, layer: SleepLayer) -> torch.Tensor:
        time.sleep(layer.ms[0] / 1e3)
        ctx.save_for_backward(x, w)
        ctx.layer = layer
        return x * w

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        x, w = ctx.saved_tensors
        layer = ctx.layer
        time.sleep(layer.ms[1] / 1e3)

        def weight_grad() -> torch.Tensor:
            time.sleep(layer.ms[2] / 1e3)
            return (dy * x).sum().reshape(1)

        if layer.wgrad_sink is None:
            return dy * w, weight_grad(), None

        def deferred() -> None:
            mt_fp8.wgrad.accumulate_grad(w, weight_grad())

        layer.wgrad_sink.defer(deferred)
        return dy * w, None, None


class SleepLayer(nn.Module):
    """A chunk with known action times (module docstring)."""

    wgrad_sink: Any = None

    def __init__(self, ms: tuple[float, float, float], first: bool, last: bool) -> None:
        super().__init__()
        self.ms, self.first, self.last = ms, first, last
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor, positions: Any = None, document_ids: Any = None) -> Any:
        if self.first:
            x = x.float()
        return _SleepFn.apply(x, self.weight, self)


def time_actions(runner: mt_parallel.PipelineSchedule, device: Any) -> dict[str, list[float]]:
    """Wrap this rank's stages' compute calls to record their durations (module docstring)."""
    durations: dict[str, list[float]] = {"F": [], "B": [], "I": [], "W": []}
    for stage in runner.runtime._stages:
        for method, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"),
                             ("backward_weight_one_chunk", "W")):  # fmt: skip
            original = getattr(stage, method)

            def timed(*args: Any, _original=original, _kind=kind, **kwargs: Any) -> Any:
                harness.synchronize(device)
                start = time.perf_counter()
                out = _original(*args, **kwargs)
                harness.synchronize(device)
                key = "I" if _kind == "B" and kwargs.get("full_backward") is False else _kind
                durations[key].append(time.perf_counter() - start)
                return out

            setattr(stage, method, timed)
    return durations


def build_llama(args: argparse.Namespace, config: Any, state: Any, device: torch.device):
    from mt_train.config.schema import FP8Config
    from mt_train.models import build_model, family_of
    from mt_train.models.build import fp8_options
    from mt_train.models.llama import LlamaConfig
    from mt_train.models.llama.sizes import SIZES

    shape = dict(TINY) if args.model == "tiny" else {}
    base = LlamaConfig(name="tiny", **shape) if args.model == "tiny" else SIZES[args.model]
    if args.layers:
        base = dataclasses.replace(base, n_layers=args.layers)
    model = build_model(base, device, seed=0)
    options = fp8_options(FP8Config(recipe=args.fp8)) if args.fp8 else None
    module = mt_parallel.pipeline_module(model, config, state, family_of(base).plan(base), options)
    return base, module


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ctx = mt_comm.init_distributed(device=args.device)
    device = ctx.torch_device
    world = ctx.world_size
    dp = world // (args.pp * args.tp)
    config = mt_parallel.ParallelConfig(
        pp=args.pp, tp=args.tp, dp=dp, sequence_parallel=args.tp > 1, data_parallel="none",
        pp_schedule=args.schedule, pp_chunks=args.chunks, pp_microbatches=args.microbatches,
    )  # fmt: skip
    state = mt_comm.init_parallel_state(dp=dp, tp=args.tp, pp=args.pp)
    v = chunks_per_rank(args.schedule, args.chunks)
    seq = args.seq or (64 if args.model == "tiny" or args.fixed_ms else 8192)
    b = args.micro_batch
    autocast = device.type != "cpu"
    if args.fixed_ms:
        stages = mt_parallel.pipeline.rank_stages(args.schedule, args.pp, v, state.rank("pp"))
        chunks = [SleepLayer(tuple(args.fixed_ms), s == 0, s == args.pp * v - 1) for s in stages]
        shapes = mt_parallel.StageShapes(((b, seq), torch.long), ((b, seq), torch.float32),
                                         ((b, seq), torch.float32))  # fmt: skip

        def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return out.mean()

        flops_per_token, dims = 0.0, {"dim": 0, "vocab_size": 0}
    else:
        from mt_train.models.llama.model import flops_per_token as llama_flops

        cfg, module = build_llama(args, config, state, device)
        chunks = module.pipeline_chunks
        dtype = torch.bfloat16 if autocast else torch.float32
        hidden_seq = seq // args.tp if args.tp > 1 else seq
        shapes = mt_parallel.StageShapes(
            ((b, seq), torch.long), ((b, hidden_seq, cfg.dim), torch.float32),
            ((b, seq, cfg.vocab_size // args.tp), dtype),
        )  # fmt: skip
        loss_fn = module.local_loss
        flops_per_token = llama_flops(cfg, seq)
        dims = {"dim": cfg.dim, "vocab_size": cfg.vocab_size}
        if autocast:
            for chunk in chunks:
                chunk.register_forward_pre_hook(lambda m, a: _enter_autocast(device))
                chunk.register_forward_hook(lambda m, a, o: _exit_autocast())
    runner = mt_parallel.PipelineSchedule(
        chunks, args.schedule, args.pp, state.rank("pp"), args.microbatches, args.chunks,
        shapes, device, state.group("pp"), loss_fn,
    )  # fmt: skip
    params = [p for c in chunks for p in c.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-4) if not args.fixed_ms else None
    vocab = dims["vocab_size"] or 2
    generator = torch.Generator().manual_seed(state.rank("dp"))
    tokens = [torch.randint(0, vocab, (b, seq), generator=generator).to(device)
              for _ in range(args.microbatches)]  # fmt: skip
    targets = [torch.randint(0, vocab, (b, seq), generator=generator).to(device)
               for _ in range(args.microbatches)]  # fmt: skip
    durations = time_actions(runner, device)

    def step() -> None:
        runner.step(tokens, targets)
        mt_parallel.all_reduce_gradients(params, state.group("dp"))
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            for p in params:
                p.grad = None

    for _ in range(args.warmup):
        step()
    for values in durations.values():
        values.clear()
    step_times = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        harness.synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        step_times.append(float(elapsed))
    step_s = sum(step_times) / len(step_times)
    busy = torch.tensor([sum(sum(v) for v in durations.values()) / args.steps], dtype=torch.float64)
    dist.all_reduce(busy, op=dist.ReduceOp.SUM)
    means = torch.tensor([sum(durations[k]) / max(len(durations[k]), 1) for k in "FIWB"],
                         dtype=torch.float64)  # fmt: skip
    dist.all_reduce(means, op=dist.ReduceOp.AVG)
    forward, input_grad, weight_grad, full = means.tolist()
    exclude = [t for c in chunks for t in (*c.parameters(), *c.buffers())]
    meter = ActivationMeter(exclude, runner.sinks)
    with meter:
        step()  # after the timed steps' action times were read
    saved_peaks = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(world)]
    dist.all_gather(saved_peaks, torch.tensor([float(meter.peak)], dtype=torch.float64,
                                              device=device))  # fmt: skip
    if input_grad == 0.0:  # no split backward in this schedule: B is the whole backward
        input_grad, weight_grad = full, 0.0
    order = schedule_actions(args.schedule, args.pp, args.microbatches, v)
    simulated = simulate(order, args.pp * v, ChunkCosts(forward, input_grad, weight_grad), v)
    tokens_per_step = b * seq * args.microbatches * dp
    per_gpu = tokens_per_step / step_s / world
    peak = ctx.device.capabilities().peak_bf16_flops if device.type != "cpu" else None
    row = {
        "bench": "pipeline", "model": "fixed" if args.fixed_ms else args.model,
        "schedule": args.schedule, "pp": args.pp, "tp": args.tp, "dp": dp, "chunks": v,
        "microbatches": args.microbatches, "seq": seq, "step_s": step_s,
        "tokens_per_s_per_gpu": per_gpu,
        "mfu": per_gpu * flops_per_token / peak if peak and flops_per_token else None,
        "bubble_measured": 1.0 - float(busy) / (world * step_s),
        "bubble_simulated": simulated.bubble_fraction,
        "action_ms": {"F": forward * 1e3, "I": input_grad * 1e3, "W": weight_grad * 1e3},
        "saved_peak_bytes": [int(t.item()) for t in saved_peaks],
        "in_flight_simulated": [simulated.peak_activations[r] for r in range(args.pp)],
        "device": ctx.device.name, "world": world,
    }  # fmt: skip
    if ctx.rank == 0:
        harness.emit(row, args.out)
    dist.barrier()
    mt_comm.destroy_parallel_state()
    mt_comm.destroy_distributed()
    return 0


_AUTOCAST: list[Any] = []


def _enter_autocast(device: torch.device) -> None:
    region = torch.autocast(device.type, dtype=torch.bfloat16)
    region.__enter__()
    _AUTOCAST.append(region)


def _exit_autocast() -> None:
    _AUTOCAST.pop().__exit__(None, None, None)


if __name__ == "__main__":
    sys.exit(main())
