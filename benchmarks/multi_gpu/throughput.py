"""Training throughput of one parallel layout on N devices (one ``torchrun``, one configuration).

Model: mt-train's Llama (``mt_train.models.build.build_model``: mt_parallel's layers, Llama 3.1
RoPE) with the Llama 3.1 8B shapes (width 4096, FFN 14336, 32 query / 8 KV heads, vocab 128256)
cut to ``--layers`` blocks; ``--tiny`` shrinks every dimension for a CPU rehearsal. The transforms
are mt_parallel's, in the trainer's order plus context parallel: tensor (+ sequence) parallel →
context parallel → FP8 (``mt_fp8`` recipe on the blocks' linears; the output head stays bf16, as
``fp8=<recipe>`` in mt-train) → recompute → compile → data parallel (DDP, FSDP2 or none with the
ZeRO-1 ``DistributedOptimizer``).

Step (mt-train's): bf16 autocast on accelerators (fp32 on the CPU), ``loss(logits.float())``
(vocab-parallel cross-entropy), backward, global-norm clipping at 1.0
(``mt_parallel.clip_grad_norm_``; ZeRO-1: inside its step), AdamW (fused on CUDA except under
FSDP2; decay on matrices only, mt-train's parameter groups). Tokens are random and made once per
rank before timing (same on the TP/CP ranks of one replica, different across dp ranks), so the
data pipeline is not measured.

Weak scaling: every device gets ``--batch-per-gpu`` sequences' worth of work, so a data-parallel
replica (tp·cp devices) takes ``batch-per-gpu · tp · cp`` sequences of ``--seq`` tokens per step
(``--replica-batch`` overrides). Figures:

* ``tokens_per_s_per_gpu`` = tokens in the global batch / step time / world size (the step time
  is the slowest rank's: timed between barriers after device synchronisation);
* ``mfu`` = tokens/s/GPU · FLOPs per token / the device's dense bf16 peak
  (``mt_core`` capabilities: 989.4 TFLOP/s on the H200), FLOPs per token ``6·N + 12·L·D·T``
  (``mt_train.models.llama.flops_per_token``; FP8 runs are also reported against the bf16 peak);
* ``peak_mem_gib``: the largest ``max_memory_allocated`` over ranks (CUDA only);
* weak-scaling efficiency is computed by ``scaling.py`` from these rows: tokens/s/GPU of a
  layout over that of one device with the same model, precision and data-parallel mode.

``--profile DIR`` profiles ``--profile-steps`` more steps after the timed ones (CPU and CUDA
activity) on rank 0 (``--profile-ranks all``: every rank), writes ``trace_<tag>_rank<r>.json.gz``
(Chrome / Perfetto trace) and adds the communication/computation overlap of the device kernels
(``overlap.py``) to the row.

``--pg device+gloo`` initialises the default process group as ``cpu:gloo,cuda:nccl`` before
mt_comm adopts it, so collectives on CPU tensors have a backend too (``mt_parallel``'s own
collectives, clipping included, run on the device and need none). The default, ``device``, is
mt_comm's own init.

Run (one line of JSON per configuration on rank 0, appended to ``--out``)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --nproc-per-node 8 benchmarks/multi_gpu/throughput.py --layout tp2-sp \\
        --layers 8 --precision bf16 --out results.jsonl
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 benchmarks/multi_gpu/throughput.py \\
        --tiny --device cpu --layout dp2-tp2-sp          # the CPU rehearsal
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: the shared harness
import harness  # noqa: E402

NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
LLAMA3_8B = dict(dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256, seq=8192)
TINY = dict(dim=256, n_heads=8, n_kv_heads=4, ffn_dim=512, vocab_size=1024, seq=128)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layout", default="dp1", help="e.g. dp8, tp2-sp, dp2-cp2-tp2-sp")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--precision", choices=("bf16", "fp8"), default="bf16")
    parser.add_argument("--fp8-recipe", default="tensorwise", help="mt_fp8 recipe for fp8")
    parser.add_argument("--fp8-backend", default="auto")
    parser.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    parser.add_argument("--dp-mode", choices=("ddp", "fsdp", "zero1"), default="ddp")
    parser.add_argument("--cp-attention", choices=("all_gather", "ring"), default="all_gather")
    parser.add_argument("--compile", action="store_true", help="torch.compile every block")
    parser.add_argument("--seq", type=int, default=None, help="default 8192 (tiny: 128)")
    parser.add_argument("--batch-per-gpu", type=int, default=1)
    parser.add_argument("--replica-batch", type=int, default=None, help="override (see doc)")
    parser.add_argument("--micro-batch", type=int, default=None, help="rows per forward")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--no-clip", action="store_true", help="skip gradient clipping")
    parser.add_argument("--tiny", action="store_true", help="toy shapes for a CPU rehearsal")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--pg", choices=("device", "device+gloo"), default="device")
    parser.add_argument("--profile", default=None, help="folder for traces (and overlap)")
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument("--profile-ranks", choices=("0", "all"), default="0")
    parser.add_argument("--tag", default=None, help="name of this configuration in the row")
    parser.add_argument("--timeout-s", type=float, default=240, help="collective timeout")
    parser.add_argument("--out", default=None, help="JSON lines file (rank 0 appends)")
    return parser.parse_args(argv)


def layout_degrees(text: str, world: int) -> dict[str, Any]:
    """The layout grammar of parity.py: ``dp2-cp2-tp2-sp``, dp inferred when absent."""
    sys.path.insert(0, str(HERE))
    from parity import parse_layout

    layout = parse_layout(text, world)
    return {"dp": layout.dp, "cp": layout.cp, "tp": layout.tp, "sp": layout.sp, "name": layout.name}


def init(args: argparse.Namespace) -> Any:
    sys.path.insert(0, str(HERE))
    from parity import init_distributed

    return init_distributed(args.device, args.pg, args.timeout_s)


def build(args: argparse.Namespace, ctx: Any, deg: dict[str, Any], shapes: dict[str, int]):
    """(module, model to run, optimizer, parallel state, model config)."""
    import torch

    import mt_comm
    import mt_fp8
    import mt_parallel as mp
    from mt_train.config.schema import FP8Config
    from mt_train.models.build import build_model, fp8_options
    from mt_train.models.llama import PLAN, LlamaConfig
    from mt_train.optim import param_groups

    cfg = LlamaConfig(
        name="llama3_8b" if not args.tiny else "tiny",
        vocab_size=shapes["vocab_size"],
        dim=shapes["dim"],
        n_layers=args.layers,
        n_heads=shapes["n_heads"],
        n_kv_heads=shapes["n_kv_heads"],
        ffn_dim=shapes["ffn_dim"],
    )
    state = mt_comm.init_parallel_state(dp=deg["dp"], cp=deg["cp"], tp=deg["tp"])
    config = mp.ParallelConfig(
        tp=deg["tp"], cp=deg["cp"], dp=deg["dp"], sequence_parallel=deg["sp"],
        cp_attention=args.cp_attention, data_parallel=args.dp_mode if args.dp_mode != "zero1"
        else "zero1", recompute=args.recompute,
    )  # fmt: skip
    config.validate_model(cfg.n_heads, cfg.n_kv_heads, shapes["vocab_size"], args.seq, cfg.ffn_dim)
    # Same global seed on every rank: each TP layer draws the full matrix and keeps its slice,
    # so every rank must draw the same full weights (mt_parallel.layers docstring).
    torch.manual_seed(1234)
    module = build_model(cfg, ctx.torch_device, seed=None)
    tp_group = state.group("tp")
    mp.apply_tensor_parallel(module, tp_group, deg["sp"])
    if deg["cp"] > 1:
        mp.apply_context_parallel(module, state.group("cp"), args.cp_attention == "ring")
    if args.precision == "fp8":
        fp8 = FP8Config(recipe=args.fp8_recipe, backend=args.fp8_backend)
        mp.apply_fp8(
            module,
            mt_fp8.recipe_from_name(args.fp8_recipe),
            amax_group=tp_group,
            skip=mp.high_precision_linears(module, PLAN, fp8_options(fp8)),
            backend=args.fp8_backend,
        )
    mp.apply_recompute(module, args.recompute, 1, ["attention"], (mp.DecoderBlock,))
    if args.compile:
        for block in module.layers:
            block.compile()
    model = mp.apply_data_parallel(
        module, config.data_parallel, state.group("dp_cp"), ctx.device.type, (mp.DecoderBlock,)
    )
    lr = 1e-5
    if args.dp_mode == "zero1":
        optimizer = mp.DistributedOptimizer(
            module.parameters(), state.group("dp_cp"), tp_group=tp_group, lr=lr
        )
    else:
        fused = ctx.device.type == "cuda" and args.dp_mode != "fsdp"
        optimizer = torch.optim.AdamW(param_groups(module, 0.1), lr=lr, fused=fused)
    return module, model, optimizer, state, cfg


def make_batches(args, ctx, state, deg, shapes, replica_batch: int):
    """This rank's (inputs, targets, positions) micro-batches: its replica's rows, its tokens."""
    import torch

    import mt_parallel as mp

    seq = shapes["seq"]
    generator = torch.Generator().manual_seed(1000 + state.rank("dp"))
    tokens = torch.randint(0, shapes["vocab_size"], (replica_batch, seq + 1), generator=generator)
    cp_group = state.group("cp")
    inputs = mp.shard_sequence(tokens[:, :-1], 1, cp_group).to(ctx.torch_device)
    targets = mp.shard_sequence(tokens[:, 1:], 1, cp_group).to(ctx.torch_device)
    positions = None
    if deg["cp"] > 1:
        positions = mp.load_balanced_positions(seq, deg["cp"], state.rank("cp"))
        positions = positions.to(ctx.torch_device)
    micro = args.micro_batch or replica_batch
    if replica_batch % micro:
        raise ValueError(f"--micro-batch {micro} does not divide the replica batch {replica_batch}")
    return [
        (inputs[i : i + micro], targets[i : i + micro], positions)
        for i in range(0, replica_batch, micro)
    ]


def make_step(args, ctx, module, model, optimizer, state, batches):
    import torch

    import mt_parallel as mp

    autocast = (
        torch.autocast(ctx.device.type, dtype=torch.bfloat16)
        if ctx.device.type != "cpu"
        else contextlib.nullcontext()
    )
    tp_group, dp_cp = state.group("tp"), state.group("dp_cp")
    zero1 = args.dp_mode == "zero1"

    def step() -> torch.Tensor:
        total = torch.zeros((), device=ctx.torch_device)
        for index, (x, y, positions) in enumerate(batches):
            with mp.accumulate(model, is_last=index == len(batches) - 1):
                with autocast:
                    logits = model(x, positions)
                loss = module.loss(logits.float(), y) / len(batches)
                loss.backward()
            total += loss.detach()
        if zero1:
            optimizer.step(max_grad_norm=0.0 if args.no_clip else 1.0)
        else:
            if not args.no_clip:
                params = [p for p in module.parameters() if p.grad is not None]
                mp.clip_grad_norm_(params, 1.0, tp_group=tp_group, dp_cp_group=dp_cp)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    return step


def timed(step, steps: int, ctx) -> float:
    """Seconds for ``steps`` steps on the slowest rank (barriers around, device synchronised)."""
    import torch
    import torch.distributed as dist

    import mt_comm

    ctx.device.synchronize()
    dist.barrier()
    _, seconds = harness.timed_steps(step, warmup=0, steps=steps, sync=ctx.device.synchronize)
    slowest = torch.tensor([seconds], device=ctx.torch_device)
    mt_comm.all_reduce(slowest, op="max")
    return float(slowest.item())


def profile(args, step, ctx, tag: str) -> dict[str, Any]:
    """Profile ``--profile-steps`` steps; write the trace; the overlap summary (rank 0's)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    sys.path.insert(0, str(HERE))
    from overlap import device_kernels, summarize

    folder = Path(args.profile)
    folder.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU]
    if ctx.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    mine = args.profile_ranks == "all" or ctx.rank == 0
    with torch_profile(activities=activities) if mine else contextlib.nullcontext() as prof:
        for _ in range(args.profile_steps):
            step()
        ctx.device.synchronize()
    if not mine:
        return {}
    path = folder / f"trace_{tag}_rank{ctx.rank}.json.gz"
    prof.export_chrome_trace(str(path))
    summary = summarize(device_kernels(prof), steps=args.profile_steps)
    summary["trace"] = str(path)
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for key, value in NO_MULTICAST.items():
        if os.environ.setdefault(key, value) != value:
            print(f"throughput.py: refusing to run with {key}={os.environ[key]} (NVLink "
                  f"multicast must stay off here)", file=sys.stderr)  # fmt: skip
            return 2
    # torch 2.13 deprecates DDP's broadcast_buffers, which mt_parallel passes (reported).
    warnings.filterwarnings("ignore", message=".*broadcast_buffers.*is deprecated")
    import torch

    import mt_comm
    from mt_train.models import get_family
    from mt_train.models.llama import flops_per_token

    num_params = get_family("llama").num_params

    ctx = init(args)
    shapes = dict(TINY if args.tiny else LLAMA3_8B)
    if args.seq:
        shapes["seq"] = args.seq
    args.seq = shapes["seq"]
    deg = layout_degrees(args.layout, ctx.world_size)
    replica_batch = args.replica_batch or args.batch_per_gpu * deg["tp"] * deg["cp"]
    tag = args.tag or (
        f"L{args.layers}-{args.precision}-{deg['name']}-{args.dp_mode}"
        + (f"-rc{args.recompute}" if args.recompute != "none" else "")
        + ("-ring" if args.cp_attention == "ring" else "")
        + ("-compile" if args.compile else "")
    )
    row: dict[str, Any] = {
        "tag": tag, "layout": deg["name"], "world": ctx.world_size, "dp": deg["dp"],
        "cp": deg["cp"], "tp": deg["tp"], "sp": deg["sp"], "layers": args.layers,
        "precision": args.precision if args.precision == "bf16" else f"fp8-{args.fp8_recipe}",
        "recompute": args.recompute, "dp_mode": args.dp_mode, "compile": args.compile,
        "cp_attention": args.cp_attention, "seq": shapes["seq"],
        "batch_per_gpu": args.batch_per_gpu, "replica_batch": replica_batch,
        "device": torch.cuda.get_device_name() if ctx.device.type == "cuda" else ctx.device.name,
        "torch": torch.__version__, "pg": args.pg, "tiny": args.tiny,
        "autocast": "bf16" if ctx.device.type != "cpu" else "none (fp32 on the CPU)",
    }  # fmt: skip
    code = 0
    try:
        if ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        module, model, optimizer, state, cfg = build(args, ctx, deg, shapes)
        batches = make_batches(args, ctx, state, deg, shapes, replica_batch)
        step = make_step(args, ctx, module, model, optimizer, state, batches)
        fpt = flops_per_token(cfg, shapes["seq"])
        row["params_local_m"] = num_params(module) / 1e6
        for _ in range(args.warmup):
            step()
        seconds = timed(step, args.steps, ctx)
        loss = step()  # one more step, for a loss to look at (not timed)
        global_tokens = replica_batch * shapes["seq"] * deg["dp"]
        per_gpu = args.steps * global_tokens / seconds / ctx.world_size
        peak = ctx.device.capabilities().peak_bf16_flops
        row.update(
            steps=args.steps, seconds=seconds, step_s=seconds / args.steps,
            tokens_per_step=global_tokens, tokens_per_s=per_gpu * ctx.world_size,
            tokens_per_s_per_gpu=per_gpu, gflop_per_token=fpt / 1e9,
            mfu=per_gpu * fpt / peak if peak else None, loss=float(loss.item()),
        )  # fmt: skip
        if ctx.device.type == "cuda":
            mem = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
            mt_comm.all_reduce(mem, op="max")
            row["peak_mem_gib"] = float(mem.item())
        if args.profile:
            row["profile"] = profile(args, step, ctx, tag)
    except Exception as error:
        traceback.print_exc()
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        code = 1
    if ctx.rank == 0 or code:
        prefix = "RESULT " if ctx.rank == 0 else f"RANK{ctx.rank} "
        harness.emit(row, args.out if ctx.rank == 0 else None, prefix=prefix)
    if code == 0:
        mt_comm.destroy_parallel_state()
        mt_comm.destroy_distributed()
    return code


if __name__ == "__main__":
    sys.exit(main())
