"""Trainer throughput: mt-train against a plain-PyTorch reference, in one run on one GPU.

Model: the Llama 3.1 8B shapes cut to 8 layers (width 4096, FFN 14336, 32 query / 8 KV heads,
vocab 128256), sequence 8192, batch 1, AdamW (fused), bf16 autocast; ``--seq``, ``--batch``,
``--layers`` and ``--recompute`` (full activation recompute of every block, in both our trainer
and the reference) change the workload for all stacks alike; ``--keep-attention`` makes our
stacks' recomputation reuse the attention output (``parallel.recompute_keep=[attention]``). Stacks, in run order
(ours first; the trainer is freed before the reference models are built):

* ``ours_bf16``: mt-train's :class:`~mt_train.Trainer` (model from mt_parallel's layers, its data
  pipeline on the bundled corpus, its step: accumulation context, clipping, LR schedule, AdamW);
* ``ours_fp8_<recipe>``: the same trainer after ``mt_parallel.apply_fp8`` with each mt_fp8 recipe
  (tensorwise, rowwise, block, delayed, mxfp8) on the blocks' linears, as ``fp8=<recipe>`` does;
* ``ours_compiled_bf16`` / ``ours_compiled_fp8_tensorwise``: the same with ``trainer.compile=true``
  (``torch.compile`` on each decoder block; the FP8 layers inside run eagerly, between graphs);
* ``ours_graphed_bf16`` / ``ours_graphed_fp8_<recipe>``: the eager stacks with
  ``trainer.cuda_graph=true`` (each step's forward and backward replayed as one CUDA graph,
  captured at the second warm-up step; :mod:`mt_train.cuda_graph`);
* ``ours_graphed_fp8_<recipe>_head``: the same with ``fp8.output_head=true`` (the output head
  in FP8 too; ``--head-gemms forward,dgrad`` keeps its weight-gradient GEMM in bf16);
* ``ref_compile_bf16``: a plain-PyTorch Llama (nn.Linear, nn.RMSNorm, SDPA with GQA) with
  ``torch.compile`` on each block;
* ``ref_ao_tensorwise`` / ``ref_ao_rowwise``: the same model converted with torchao's
  ``convert_to_float8_training`` (all block linears; the output head stays bf16), then compiled;
  ``ref_ao_tensorwise_head`` converts and compiles the output head too.

``--model deepseek_v2_lite`` measures DeepSeek-V2-Lite instead (MLA with YaRN, 64 routed experts
of FFN 1408 top-6 plus 2 shared, softmax routing with the Switch auxiliary loss, one dense
first block; vocab 102400), cut to ``--layers`` blocks (default 5: the dense block and four MoE
blocks, what one 80 GB GPU holds with fp32 weights and AdamW state), sequence 4096, with the
stacks :data:`DEEPSEEK_STACKS`: ``ours_bf16``, ``ours_fp8_<recipe>`` for rowwise, block and
MXFP8 (the trainer's ``fp8=<recipe>``: experts through ``FP8GroupedLinear`` with
``fp8.expert_formats=auto``; a linear the recipe cannot tile stays bf16, as mt-train does), and
``ref_compile_bf16``: ``plain_deepseek.py``'s plain-PyTorch MLA + MoE (SDPA, ``torch._grouped_mm``
experts, as torchtitan writes them), each block compiled. Its FLOPs per token are
``6·N_active + 6·L·T·H·(E + V)`` (``N_active`` the parameters one token uses without the input
embedding, E = nope + rope head dims, V the value head dim; QKᵀ and AV forward and backward
without causal halving, as Llama's term: :func:`mt_train.models.deepseek_v3.flops_per_token`).

Each stack runs ``--warmup`` steps (compilation included), then up to ``--steps`` timed steps
(fewer if they pass ``--stack-budget-s``) between two device synchronisations: ``tokens/s = steps · batch · seq / seconds``, ``MFU = tokens/s ·
flops_per_token / 989e12`` with ``flops_per_token = 6·N + 12·L·D·T`` (N without the input
embedding; :func:`mt_train.models.flops_per_token`), and peak memory is
``torch.cuda.max_memory_allocated`` since the stack started (weights, optimizer state and
activations). Each stack runs in its own subprocess under ``--stack-timeout-s`` (``--in-process``
runs them all in this process, as the subprocesses do), so a stack that fails, hangs or runs out of
memory is reported with its error and the run goes on; ``--budget-s`` skips the stacks that would
start after that many seconds. Results go to stdout as a Markdown table
and, one JSON object per stack, to ``--out``.

``--profile`` adds, per stack, ``--profile-steps`` consecutive profiled steps (PyTorch profiler,
after the timed ones): per step, the device time by kernel category (:data:`KERNEL_CATEGORIES`),
the wall time, the device's idle time (between steps included), the top kernels and the largest
gaps; this is where ``docs/benchmarks-log.md`` gets its breakdowns (current figures:
``docs/performance.md``). ``--profile-sources`` adds the self time of each operator per call
site in the repository (the profiler's Python stacks): the line of mt that launched a kernel.

Run: ``python benchmarks/train_throughput.py --out results.jsonl`` (GPU), or
``python benchmarks/train_throughput.py --tiny`` for a CPU smoke test at toy sizes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import harness
import plain_deepseek
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

PEAK_BF16 = 989e12
REF_STACKS = ("ref_compile_bf16", "ref_ao_tensorwise", "ref_ao_rowwise", "ref_ao_tensorwise_head")
OUR_RECIPES = ("tensorwise", "rowwise", "block", "delayed", "mxfp8")
OUR_COMPILED = ("ours_compiled_bf16", "ours_compiled_fp8_tensorwise")
OUR_GRAPHED = (
    "ours_graphed_bf16",
    "ours_graphed_fp8_tensorwise",
    "ours_graphed_fp8_delayed",
    "ours_graphed_fp8_block",
    "ours_graphed_fp8_tensorwise_head",
    "ours_graphed_fp8_delayed_head",
)
DEEPSEEK_STACKS = (
    "ours_bf16", "ours_fp8_rowwise", "ours_fp8_block", "ours_fp8_mxfp8", "ref_compile_bf16",
)  # fmt: skip
MODELS = ("llama3_8b", "deepseek_v2_lite")

# Kernel-name patterns (lower case, first match wins) for the --profile breakdown.
KERNEL_CATEGORIES = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("optimizer", ("adam", "multi_tensor")),
    ("fp8 quantize", ("quantize", "amax", "_to_fp8", "float8")),
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "matmul", "_mm_")),
    ("fused ops (ours)", ("_rmsnorm", "_rope", "_swiglu", "_cross_entropy", "_ce_")),
    ("inductor fusions", ("triton_",)),
    ("communication", ("nccl",)),
)


def shapes(tiny: bool) -> dict[str, Any]:
    if tiny:
        return dict(
            dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=1024, seq=128
        )
    return dict(
        dim=4096, n_layers=8, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256, seq=8192
    )


def deepseek_config(tiny: bool, layers: int | None) -> Any:
    """DeepSeek-V2-Lite cut to ``layers`` blocks (default 5); ``tiny``: the same choices at toy
    widths."""
    from mt_train.models.deepseek_v3 import SIZES

    lite = SIZES["deepseek_v2_lite"]
    if not tiny:
        return dataclasses.replace(lite, n_layers=layers or 5)
    moe = dataclasses.replace(lite.moe, num_experts=8, top_k=2, expert_ffn_dim=64)
    return dataclasses.replace(
        lite, vocab_size=1024, dim=128, n_layers=layers or 3, n_heads=4, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, ffn_dim=256, moe=moe,
    )  # fmt: skip


def config_overrides(cfg: Any, base: Any, prefix: str = "model") -> list[str]:
    """Hydra overrides that turn the named config ``base`` into ``cfg`` (nested dataclasses
    recursively)."""
    overrides = []
    for f in dataclasses.fields(cfg):
        value, default = getattr(cfg, f.name), getattr(base, f.name)
        if dataclasses.is_dataclass(value):
            overrides += config_overrides(value, default, f"{prefix}.{f.name}")
        elif value != default:
            overrides.append(f"{prefix}.{f.name}={'null' if value is None else value}")
    return overrides


# ---------------------------------------------------------------- the reference model
class RefBlock(nn.Module):
    def __init__(self, s: dict[str, int]) -> None:
        super().__init__()
        d, hd = s["dim"], s["dim"] // s["n_heads"]
        self.h, self.kv, self.hd = s["n_heads"], s["n_kv_heads"], hd
        self.attention_norm, self.ffn_norm = nn.RMSNorm(d, eps=1e-5), nn.RMSNorm(d, eps=1e-5)
        self.wq = nn.Linear(d, self.h * hd, bias=False)
        self.wk = nn.Linear(d, self.kv * hd, bias=False)
        self.wv = nn.Linear(d, self.kv * hd, bias=False)
        self.wo = nn.Linear(self.h * hd, d, bias=False)
        self.w1 = nn.Linear(d, s["ffn_dim"], bias=False)
        self.w3 = nn.Linear(d, s["ffn_dim"], bias=False)
        self.w2 = nn.Linear(s["ffn_dim"], d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        n = self.attention_norm(x)
        q = self.wq(n).view(B, T, self.h, self.hd).transpose(1, 2)
        k = self.wk(n).view(B, T, self.kv, self.hd).transpose(1, 2)
        v = self.wv(n).view(B, T, self.kv, self.hd).transpose(1, 2)

        def rope(t: torch.Tensor) -> torch.Tensor:
            t1, t2 = t.chunk(2, dim=-1)
            return t * cos + torch.cat([-t2, t1], dim=-1) * sin

        o = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True, enable_gqa=True)
        h = x + self.wo(o.transpose(1, 2).reshape(B, T, -1))
        m = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(m)) * self.w3(m))


class RefModel(nn.Module):
    def __init__(self, s: dict[str, int]) -> None:
        super().__init__()
        self.embed = nn.Embedding(s["vocab_size"], s["dim"])
        self.layers = nn.ModuleList(RefBlock(s) for _ in range(s["n_layers"]))
        self.norm = nn.RMSNorm(s["dim"], eps=1e-5)
        self.output = nn.Linear(s["dim"], s["vocab_size"], bias=False)
        hd = s["dim"] // s["n_heads"]
        inv = 500000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = torch.outer(torch.arange(s["seq"], dtype=torch.float64), inv)
        ang = torch.cat([ang, ang], dim=-1)
        self.register_buffer("cos", ang.cos().float(), persistent=False)
        self.register_buffer("sin", ang.sin().float(), persistent=False)
        self.recompute = bool(s["recompute"])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        for layer in self.layers:
            if self.recompute:  # full activation recompute of every block
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        return self.output(self.norm(x))


def ref_stack(
    name: str, s: dict[str, Any], device: torch.device, compile_: bool
) -> Callable[[], None]:
    deepseek = s["model"] == "deepseek_v2_lite"
    with torch.device(device):
        model = plain_deepseek.PlainDeepSeek(s["config"], s["seq"]) if deepseek else RefModel(s)
    if deepseek and s["recompute"]:
        raise ValueError("--recompute is not implemented for the plain DeepSeek reference")
    if name != "ref_compile_bf16":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        recipe = name.removeprefix("ref_ao_")
        head = recipe.endswith("_head")
        convert_to_float8_training(
            model,
            config=Float8LinearConfig.from_recipe_name(recipe.removesuffix("_head")),
            module_filter_fn=lambda mod, fqn: head or fqn != "output",
        )
    if compile_:
        for block in model.layers:
            block.compile()
        if name.endswith("_head"):  # torchao's FP8 head quantizes in Inductor kernels too
            model.output.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(0)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def step() -> None:
        shape = (s["batch"], s["seq"] + 1)
        tokens = torch.randint(0, s["vocab_size"], shape, generator=gen).to(device)
        with autocast:
            if deepseek:
                loss = plain_deepseek.loss(model, tokens)
            else:
                logits = model(tokens[:, :-1])
        if not deepseek:
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


# ---------------------------------------------------------------- our trainer
def our_trainer(
    s: dict[str, Any],
    device: str,
    out_dir: str,
    compile_: bool = False,
    optimizer: str = "auto",
    cuda_graph: bool = False,
) -> Any:
    from mt_train import Trainer, compose_config, to_train_config

    if s["model"] == "deepseek_v2_lite":
        from mt_train.models.deepseek_v3 import SIZES

        model = [f"model={s['model']}", *config_overrides(s["config"], SIZES[s["model"]])]
    else:
        model = [
            "model=llama3_8b", f"model.n_layers={s['n_layers']}", f"model.dim={s['dim']}",
            f"model.n_heads={s['n_heads']}", f"model.n_kv_heads={s['n_kv_heads']}",
            f"model.ffn_dim={s['ffn_dim']}", f"model.vocab_size={s['vocab_size']}",
        ]  # fmt: skip
    overrides = [
        *model, f"trainer.seq_len={s['seq']}", f"trainer.global_batch_size={s['batch']}",
        f"trainer.micro_batch_size={s['batch']}",
        f"parallel.recompute={'full' if s['recompute'] else 'none'}",
        f"parallel.recompute_keep=[{'attention' if s.get('keep_attention') else ''}]",
        "trainer.max_steps=100000", "trainer.eval_interval=100000", "trainer.sample_tokens=0",
        "trainer.precision=bf16", f"trainer.device={device}", "checkpoint=disabled",
        "optimizer.lr=1e-4",  # the reference stacks' LR: a stable run, so last_loss means something
        "logging.progress_bar=false", "logging.jsonl=false", "scheduler.warmup_steps=10",
        f"trainer.compile={str(compile_).lower()}", f"optimizer.impl={optimizer}",
        f"trainer.cuda_graph={str(cuda_graph).lower()}",
    ]  # fmt: skip
    return Trainer(to_train_config(compose_config(overrides)), output_dir=out_dir)


def enable_fp8(
    trainer: Any,
    recipe_name: str,
    health: bool = True,
    cache_weight: bool = True,
    output_head: bool = False,
    head_gemms: tuple[str, ...] = ("forward", "dgrad", "wgrad"),
) -> None:
    """``fp8=<recipe>`` on a built trainer; ``health=False`` turns the numerics-health counts
    off in every FP8 layer (to measure what they cost), ``cache_weight=False`` the FP8 weight
    cache (``fp8.cache_weight=false``: less memory, a weight quantization per forward),
    ``output_head=True`` puts the output head in FP8 too (``fp8.output_head=true``) with
    ``head_gemms`` in FP8 (``fp8.output_head_gemms``)."""
    import mt_fp8
    import mt_parallel
    from mt_train.config.schema import FP8Config
    from mt_train.models.build import apply_fp8_config, fp8_layer_count

    fp8 = FP8Config(
        recipe=recipe_name,
        output_head=output_head,
        output_head_gemms=list(head_gemms) if output_head else list(mt_fp8.FP8_GEMMS),
    )
    trainer.fp8_recipe = apply_fp8_config(trainer.module, trainer.model_cfg, fp8, trainer.tp_group)
    # As the trainer counts them at build: steps then watch the FP8 health counters for the
    # fp8_overflow detector, as an fp8= run does.
    trainer.fp8_layers = fp8_layer_count(trainer.module)
    trainer.drop_step_graph()  # a graph captured before holds the high-precision layers
    mt_parallel.set_fp8_weight_cache(trainer.module, cache_weight)
    for module in trainer.module.modules():
        if isinstance(module, mt_fp8.FP8Linear):
            module.track_health = health


# ---------------------------------------------------------------- profiling
def profile_step(
    step: Callable[[], Any],
    device: torch.device,
    steps: int = 2,
    top: int = 50,
    sources: bool = False,
) -> dict[str, Any]:
    """``steps`` consecutive profiled steps, per step: device ms by kernel category, wall ms,
    device idle, the ``top`` kernels and the largest single gaps, and the host's self time by
    operator (the profiler's CPU events: where a host-bound step spends its time). Consecutive steps in one window
    show the device idling between steps too (a step that blocks the host on the previous one's
    kernels leaves the device idle while the host prepares the next), which one profiled step
    starting from an idle device cannot show. ``sources`` records Python stacks and adds
    ``top_sources_ms`` (:func:`top_sources`): which line of the repository launched the time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, with_stack=sources) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
    # Device-side events only (kernels, memcpy/memset), without GPU user annotations (such as
    # "Optimizer.step#AdamW.step"): the CPU-side aten ops and the annotations report the device
    # time of the kernels under them, which would count those kernels twice.
    per_kernel: dict[str, list[float]] = {}
    per_host_op: dict[str, list[float]] = {}
    intervals: list[tuple[float, float, str]] = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CPU:
            entry = per_host_op.setdefault(event.name, [0, 0.0])
            entry[0] += 1
            entry[1] += event.self_cpu_time_total / 1e3
        if event.device_type != torch.autograd.DeviceType.CUDA or event.is_user_annotation:
            continue
        entry = per_kernel.setdefault(event.name, [0, 0.0])
        entry[0] += 1
        entry[1] += event.device_time_total / 1e3
        intervals.append((event.time_range.start, event.time_range.end, event.name))
    by_category: dict[str, float] = {}
    for name, (_, ms) in per_kernel.items():
        category = next(
            (c for c, patterns in KERNEL_CATEGORIES if any(p in name.lower() for p in patterns)),
            "other (elementwise, copies, reductions)",
        )
        by_category[category] = by_category.get(category, 0.0) + ms / steps
    kernels = sorted(per_kernel.items(), key=lambda kv: -kv[1][1])
    idle_ms, idle_before, gaps = device_idle(intervals)
    return {
        "steps": steps,
        "wall_ms": wall_ms,
        "device_ms": sum(by_category.values()),
        "device_idle_ms": idle_ms / steps,
        "device_ms_by_category": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
        "top_kernels_ms": [
            [name[:90], count / steps, ms / steps] for name, (count, ms) in kernels[:top]
        ],
        "idle_before_ms": [[name, n / steps, ms / steps] for name, n, ms in idle_before[:top]],
        "host_ms": sum(ms for _, ms in per_host_op.values()) / steps,
        "top_host_ops_ms": [
            [name[:90], count / steps, ms / steps]
            for name, (count, ms) in sorted(per_host_op.items(), key=lambda kv: -kv[1][1])[:top]
        ],
        "largest_gaps_ms": gaps[:12],
        **({"top_sources_ms": top_sources(prof, device, steps, top)} if sources else {}),
    }


SOURCE_FRAMES = 3
"""Frames of the repository kept per operator in :func:`top_sources` (innermost first)."""
REPOSITORY_MODULES = ("mt_core/", "mt_comm/", "mt_fp8/", "mt_parallel/", "mt_train/", "mt_plan/")
PYTHON_FRAME = re.compile(r"^(?P<path>[^<(][^(]*)\((?P<line>\d+)\): (?P<function>.+)$")


def _repository_frames(event: Any) -> list[str]:
    """The :data:`SOURCE_FRAMES` innermost Python frames of the repository above ``event``
    (the profiler's Python-function events, its CPU parents under ``with_stack``)."""
    frames, parent = [], event.cpu_parent
    while parent is not None and len(frames) < SOURCE_FRAMES:
        match = PYTHON_FRAME.match(parent.name)
        if match and (
            match["path"].startswith(REPOSITORY_MODULES) or "benchmarks/" in match["path"]
        ):
            frames.append(parent.name)
        parent = parent.cpu_parent
    return frames


def top_sources(prof: Any, device: torch.device, steps: int, top: int) -> list[list[Any]]:
    """Per step, the ``top`` (operator, call site) pairs by self time on the device (on a CPU,
    the host's): ``[ms, count, operator, frames]``, the operator an ATen op or, for a kernel
    launched from Python (Triton), the kernel's name, and ``frames`` the innermost
    :data:`SOURCE_FRAMES` frames inside this repository (``path(line): function``): the line
    of mt that launched the time."""
    rows: dict[tuple[str, tuple[str, ...]], list[float]] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CPU or PYTHON_FRAME.match(event.name):
            continue
        if device.type == "cuda":
            us = event.self_device_time_total
            name = (
                event.kernels[0].name
                if event.kernels and not event.name.startswith("aten::")
                else event.name
            )
        else:
            us, name = (0 if event.name.startswith("<") else event.self_cpu_time_total), event.name
        frames = tuple(_repository_frames(event)) if us > 0 else ()
        if not frames:
            continue
        entry = rows.setdefault((name[:60], frames), [0.0, 0.0])
        entry[0] += us / 1e3 / steps
        entry[1] += 1 / steps
    ranked = sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]
    return [[ms, count, name, list(frames)] for (name, frames), (ms, count) in ranked]


def device_idle(
    intervals: list[tuple[float, float, str]],
) -> tuple[float, list[list[Any]], list[list[Any]]]:
    """Idle device time between the first and the last kernel (µs intervals, any stream): the
    total in ms; per kernel name the idle time right before its launches (``[name, gaps, ms]``,
    largest first): the kernels the device waited for the host to launch; and the single gaps,
    largest first, as ``[ms, kernel before, kernel after]``."""
    idle_us, before, gaps = 0.0, {}, []
    busy_until, last_name = None, ""
    for start, end, name in sorted(intervals):
        if busy_until is not None and start > busy_until:
            gap = start - busy_until
            idle_us += gap
            entry = before.setdefault(name[:90], [0, 0.0])
            entry[0] += 1
            entry[1] += gap / 1e3
            gaps.append([gap / 1e3, last_name[:60], name[:60]])
        if busy_until is None or end >= busy_until:
            busy_until, last_name = end, name
    ranked = sorted(before.items(), key=lambda kv: -kv[1][1])
    gaps.sort(key=lambda g: -g[0])
    return idle_us / 1e3, [[name, count, ms] for name, (count, ms) in ranked], gaps


def run_isolated(
    stacks: list[str], argv: list[str], args: argparse.Namespace, began: float
) -> list[dict[str, Any]]:
    """Each stack in a subprocess of this script (``--in-process --only <stack>``)."""
    passthrough, skip_next = [], False
    for arg in argv:
        if skip_next:
            skip_next = False
        elif arg in ("--only", "--out"):
            skip_next = True
        elif not arg.startswith(("--only=", "--out=")):
            passthrough.append(arg)
    results = []
    for name in stacks:
        row: dict[str, Any] = {"stack": name}
        if time.perf_counter() - began > args.budget_s:
            row["error"] = "skipped: time budget"
        else:
            cmd = [sys.executable, __file__, *passthrough, "--in-process", f"--only={name}"]
            run = harness.run_isolated(cmd, timeout_s=args.stack_timeout_s, marker='{"stack"')
            if run.result is not None:
                row = run.result
            else:
                row["error"] = run.error
        row["elapsed_s"] = time.perf_counter() - began
        results.append(row)
        harness.emit(row, args.out)
    return results


def run_in_process(
    stacks: list[str],
    args: argparse.Namespace,
    s: dict[str, int],
    device: torch.device,
    fpt: float,
    began: float,
) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    trainer, variant = None, None
    out_dir = tempfile.mkdtemp(prefix="mt-bench-")
    for name in stacks:
        row: dict[str, Any] = {"stack": name, "model": s["model"]}
        if time.perf_counter() - began > args.budget_s:
            row["error"] = "skipped: time budget"
        else:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            try:
                if name.startswith("ref_"):
                    if trainer is not None:
                        trainer.close()
                        trainer = None
                        gc.collect()
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                            torch.cuda.reset_peak_memory_stats()
                    step = ref_stack(name, s, device, compile_=not args.tiny)
                else:
                    compiled = name.startswith("ours_compiled_")
                    graphed = name.startswith("ours_graphed_")
                    if trainer is not None and variant != (compiled, graphed):
                        trainer.close()
                        trainer = None
                        gc.collect()
                    if trainer is None:
                        trainer = our_trainer(
                            s, device.type, out_dir, compiled, args.optimizer_impl, graphed
                        )
                        variant = (compiled, graphed)
                    recipe = name.removeprefix("ours_").removeprefix("compiled_")
                    recipe = recipe.removeprefix("graphed_")
                    if recipe.startswith("fp8_"):
                        enable_fp8(
                            trainer,
                            recipe.removeprefix("fp8_").removesuffix("_head"),
                            not args.no_fp8_health,
                            not args.no_fp8_weight_cache,
                            output_head=recipe.endswith("_head"),
                            head_gemms=tuple(args.head_gemms.split(",")),
                        )
                    step = trainer.train_step
                done, seconds = harness.timed_steps(
                    step,
                    warmup=args.warmup,
                    steps=args.steps,
                    budget_s=args.stack_budget_s,
                    sync=lambda: harness.synchronize(device),
                )
                tps = done * s["batch"] * s["seq"] / seconds
                row.update(tokens_per_s=tps, mfu=tps * fpt / PEAK_BF16, timed_steps=done)
                if trainer is not None and not name.startswith("ref_"):
                    # A step the trainer judged anomalous skips its update (and would rewind
                    # under fit()): its time is not a training step's. Show the last loss too.
                    metrics = trainer.train_step()
                    row["last_loss"] = metrics["loss"]
                    if "event" in metrics:
                        row["error"] = (
                            f"anomalous step ({metrics['event']}), loss {metrics['loss']}"
                        )
                if device.type == "cuda":
                    row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
                    # Allocations that had to free cached blocks first (cudaFree synchronises).
                    row["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0)
                if args.profile:
                    row["profile"] = profile_step(
                        step, device, args.profile_steps, sources=args.profile_sources
                    )
            except Exception as err:  # report and go on: one broken stack must not hide the rest
                # 600 characters: enough for an out-of-memory message's allocator figures.
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:600]}"
            step = None  # type: ignore[assignment]
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        row["elapsed_s"] = time.perf_counter() - began
        results.append(row)
        harness.emit(row, args.out)
    if trainer is not None:
        with contextlib.suppress(Exception):
            trainer.close()
    return results


def print_sources(prof: dict[str, Any]) -> None:
    """The ``top_sources_ms`` of :func:`profile_step`, where present, as text."""
    if "top_sources_ms" not in prof:
        return
    print("  self time by operator and call site (innermost repository frames):")
    for ms, count, op, frames in prof["top_sources_ms"]:
        print(f"    {ms:8.2f} ms  x{count:<6g} {op}  <- {' <- '.join(frames)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="toy shapes on the CPU, no compile")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--budget-s", type=float, default=1e9, help="start no stack after this")
    parser.add_argument("--stack-budget-s", type=float, default=1e9, help="timed seconds per stack")
    parser.add_argument(
        "--stack-timeout-s", type=float, default=150, help="kill a stack after this"
    )
    parser.add_argument("--in-process", action="store_true", help="no subprocess per stack")
    parser.add_argument("--only", default="", help="comma-separated stack names")
    parser.add_argument("--out", default=None, help="JSON lines file for the results")
    parser.add_argument("--profile", action="store_true", help="add profiled steps per stack")
    parser.add_argument(
        "--profile-steps", type=int, default=2, help="consecutive steps in the profile window"
    )
    parser.add_argument(
        "--profile-sources",
        action="store_true",
        help="with --profile: attribute device time to the repository's source lines",
    )
    parser.add_argument(
        "--optimizer-impl", default="auto", help="our trainer's optimizer.impl (auto, triton, ...)"
    )
    parser.add_argument(
        "--no-fp8-health", action="store_true", help="FP8 layers skip their health counts"
    )
    parser.add_argument(
        "--no-fp8-weight-cache",
        action="store_true",
        help="FP8 layers re-quantize their weight in every forward (fp8.cache_weight=false)",
    )
    parser.add_argument(
        "--model", choices=MODELS, default="llama3_8b", help="the workload (module docstring)"
    )
    parser.add_argument(
        "--seq", type=int, default=None, help="sequence length (default 8192; DeepSeek 4096)"
    )
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument(
        "--layers", type=int, default=None, help="decoder blocks (default 8; DeepSeek 5)"
    )
    parser.add_argument(
        "--recompute", action="store_true", help="full activation recompute of every block"
    )
    parser.add_argument(
        "--keep-attention",
        action="store_true",
        help="with --recompute, our stacks keep the attention output (parallel.recompute_keep)",
    )
    parser.add_argument(
        "--head-gemms",
        default="forward,dgrad,wgrad",
        help="the output head's GEMMs in FP8 for the _head stacks (fp8.output_head_gemms)",
    )
    parser.add_argument(
        "--alloc-conf",
        default=None,
        help="PYTORCH_CUDA_ALLOC_CONF for every stack (e.g. expandable_segments:True)",
    )
    args = parser.parse_args(argv)
    if args.alloc_conf is not None:  # before the first CUDA allocation; subprocesses inherit it
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = args.alloc_conf

    from mt_train.models import deepseek_v3, llama

    if args.model == "deepseek_v2_lite":
        cfg = deepseek_config(args.tiny, args.layers)
        s: dict[str, Any] = dict(config=cfg, n_layers=cfg.n_layers, vocab_size=cfg.vocab_size)
        s["seq"] = args.seq or (128 if args.tiny else 4096)
        fpt = deepseek_v3.flops_per_token(cfg, s["seq"])
        stacks = list(DEEPSEEK_STACKS)
    else:
        s = shapes(args.tiny)
        s["seq"] = args.seq or s["seq"]
        s["n_layers"] = args.layers or s["n_layers"]
        fields = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")
        fpt = llama.flops_per_token(llama.LlamaConfig(**{k: s[k] for k in fields}), s["seq"])
        stacks = [
            "ours_bf16",
            *(f"ours_fp8_{r}" for r in OUR_RECIPES),
            *OUR_COMPILED,
            *OUR_GRAPHED,
            *REF_STACKS,
        ]
    s.update(model=args.model, batch=args.batch, recompute=int(args.recompute))
    if args.keep_attention:
        s["keep_attention"] = 1
    device = torch.device("cpu" if args.tiny else "cuda")
    if args.only:
        stacks = [n for n in args.only.split(",") if n in stacks]  # in the order given
    hw = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    shown = {k: v for k, v in s.items() if k != "config"}
    print(
        f"# {hw}, torch {torch.__version__}, shapes {shown}, {fpt / 1e9:.2f} GFLOP/token",
        flush=True,
    )
    began = time.perf_counter()
    if args.in_process:
        results = run_in_process(stacks, args, s, device, fpt, began)
    else:
        results = run_isolated(stacks, argv if argv is not None else sys.argv[1:], args, began)
    print(
        "\n| stack | tokens/s | MFU | peak memory (GiB) | allocator retries |"
        "\n| --- | --- | --- | --- | --- |"
    )
    for r in results:
        if "error" in r:
            print(f"| {r['stack']} | — | — | {r['error']} | |")
        else:
            mem = f"{r['peak_mem_gib']:.1f}" if "peak_mem_gib" in r else "—"
            tps, mfu, retries = r["tokens_per_s"], 100 * r["mfu"], r.get("alloc_retries", "—")
            print(f"| {r['stack']} | {tps:,.0f} | {mfu:.1f}% | {mem} | {retries} |")
    for r in results:
        if "profile" in r:
            prof = r["profile"]
            parts = ", ".join(f"{c} {ms:.1f}" for c, ms in prof["device_ms_by_category"].items())
            print(
                f"\n{r['stack']}, per step of {prof['steps']} profiled: wall "
                f"{prof['wall_ms']:.1f} ms, kernels {prof['device_ms']:.1f} ms ({parts}), "
                f"device idle {prof['device_idle_ms']:.1f} ms"
            )
            for kernel, count, ms in prof["top_kernels_ms"]:
                print(f"    {ms:8.2f} ms  x{count:<6g} {kernel}")
            print("  idle time before (the kernels the device waited for):")
            for kernel, count, ms in prof["idle_before_ms"][:20]:
                print(f"    {ms:8.2f} ms  x{count:<6g} {kernel}")
            print("  largest single gaps (kernel before -> kernel after):")
            for ms, previous, following in prof["largest_gaps_ms"]:
                print(f"    {ms:8.3f} ms  {previous} -> {following}")
            print_sources(prof)
    return 0 if any("error" not in r for r in results) and not math.isnan(fpt) else 1


if __name__ == "__main__":
    sys.exit(main())
