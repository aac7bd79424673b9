"""MoE training speed on one GPU: mt's MoE layer and a Mixtral-style model step, bf16 and FP8,
against a plain-PyTorch reference MoE in the same run, with natural and forced-balanced routing.

Run on an H200: ``python benchmarks/moe_throughput.py --out moe_throughput.jsonl`` (a few
minutes; ``--layers`` sets how many Mixtral-8x7B layers the model rows keep, default 2, the
count that fits one H200 with fp32 master weights and AdamW state); ``--smoke`` runs tiny
shapes on whatever device is present (CPU: fp32, no compile, FP8 emulated) to check the script.

Layer rows (``kind: layer``): one MoE feed-forward layer, forward + backward of
``(layer(x) · dy).sum()`` over ``T = seq`` tokens (batch 1, seq 4096), bf16 autocast (weights
fp32, as a trainer holds them), tokens/s from the median of CUDA-event timings. Shapes:
``mixtral`` (width 4096, 8 experts of FFN 14336, top-2) and ``fine_grained`` (DeepSeek-V2-Lite-
like: width 2048, 64 experts of FFN 1408, top-6, 2 shared experts). Stacks:

* ``reference``: a plain-PyTorch MoE written as torchtitan writes it (router GEMM + softmax +
  top-k, stable sort of the assignments, ``torch._grouped_mm`` over experts stored as
  ``[E, out, in]`` tensors with groups padded to 16 rows, index-add combine), compiled with
  ``torch.compile`` on CUDA (``--no-compile`` turns it off);
* ``mt_bf16``: ``mt_parallel.moe.MoE`` (fp32 router with autocast off, grouped experts);
* ``mt_bf16_compiled`` (only when named in ``--stacks``): ``mt_bf16`` with ``module.compile()``
  on CUDA, as ``parallel.compile=true`` compiles each block (graph breaks at the host reads of
  the group sizes);
* ``mt_fp8``: the same with its experts (and shared experts) in FP8 (``--recipe``, default
  ``rowwise``; mt-fp8's ``FP8GroupedLinear``). ``--expert-formats`` is the trainer's
  ``fp8.expert_formats`` (``mt_parallel.expert_recipe``): ``auto`` (default; E4M3 for every
  role of the experts under rowwise, block and MXFP8), ``e4m3`` or ``recipe`` (the recipe's own
  formats: rowwise has E5M2 gradients, so the experts' dgrad and wgrad GEMMs run per expert,
  ``torch._scaled_grouped_mm`` taking E4M3 only). The shared experts keep the recipe's formats.

Routing ``natural`` is the router's own choice from random weights and inputs; ``balanced``
forces token ``t``'s ``j``-th choice to expert ``(t·k + j) mod E`` (every expert exactly
``T·k/E`` tokens: how published MoE throughput numbers are measured), keeping the router's
scores as weights so its backward runs.

Model rows (``kind: model``): a full training step (forward, backward, fused AdamW update) of
mt-train's MoE family at the Mixtral-8x7B shapes cut to ``--layers`` layers (``mixtral_8x7b``)
and of a DeepSeek-V2-Lite-like model (width 2048, 16 heads, 64 experts of 1408, top-6, 2
shared, first layer dense, Llama attention), and of the ``deepseek_v2_lite`` size itself
(multi-head latent attention, YaRN; its first dense layer plus ``--layers`` MoE layers), batch
1, seq 4096, bf16 autocast, ``mt_bf16`` and ``mt_fp8`` (``--recipe block`` cannot run on MLA
yet: ``kv_a_proj``'s 576 outputs are not a multiple of 128).
Peak memory (``torch.cuda.max_memory_allocated``) is in every row.

``--profile`` adds to each layer row two consecutive profiled steps of that stack
(``train_throughput.profile_step``: device ms by kernel category, the top kernels, device idle
time and the kernels the device waited for) and prints them: where mt's layer spends the time
the compiled reference does not. ``--stacks`` and ``--shapes`` run a subset of the layer rows.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import harness
import torch
import torch.nn.functional as F
import train_throughput
from torch import nn

import mt_comm
import mt_fp8
import mt_parallel
from mt_parallel.moe import MoE, MoEConfig, max_violation
from mt_parallel.moe.capacity import expert_counts
from mt_parallel.moe.router import Router, Routing

LAYER_SHAPES = {
    "mixtral": (4096, MoEConfig(num_experts=8, top_k=2, expert_ffn_dim=14336)),
    "fine_grained": (
        2048,
        MoEConfig(num_experts=64, top_k=6, expert_ffn_dim=1408, n_shared_experts=2),
    ),
}
LAYER_STACKS = ("reference", "mt_bf16", "mt_fp8")
OPTIONAL_STACKS = ("mt_bf16_compiled",)
SMOKE_LAYER_SHAPES = {"tiny": (32, MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=32))}
SEQ, SMOKE_SEQ = 4096, 32
ALIGN = 16


# --------------------------------------------------------------------------- reference MoE
class ReferenceMoE(nn.Module):
    """The plain-PyTorch MoE of the module docstring (same weights as an mt layer)."""

    def __init__(self, layer: MoE) -> None:
        super().__init__()
        cfg = layer.cfg
        self.top_k, self.experts, self.balanced = cfg.top_k, cfg.num_experts, False
        self.router = nn.Parameter(layer.router.weight.detach().clone())
        experts = layer.experts
        self.w1 = nn.Parameter(experts.gate_proj.weight.detach().clone())
        self.w3 = nn.Parameter(experts.up_proj.weight.detach().clone())
        self.w2 = nn.Parameter(experts.down_proj.weight.detach().clone())
        self.shared = layer.shared_experts

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x = x_BSD.reshape(-1, x_BSD.shape[-1])
        scores = F.linear(x, self.router).float().softmax(-1)
        if self.balanced:
            idx = balanced_indices(x.shape[0], self.top_k, self.experts, x.device)
            weights = scores.gather(1, idx)
        else:
            weights, idx = scores.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        order = torch.argsort(idx.view(-1), stable=True)
        counts = torch.bincount(idx.view(-1), minlength=self.experts)
        padded = (counts + ALIGN - 1) // ALIGN * ALIGN
        ends = torch.cumsum(padded, 0)
        first = torch.cumsum(counts, 0) - counts
        expert_of = torch.repeat_interleave(torch.arange(self.experts, device=x.device), counts)
        dest = (ends - padded)[expert_of] + torch.arange(order.numel(), device=x.device)
        dest = dest - first[expert_of]
        rows = x.new_zeros(int(ends[-1]), x.shape[1]).index_copy(0, dest, x[order // self.top_k])
        offs = ends.to(torch.int32)
        dtype = rows.dtype  # the autocast dtype when on: the CUDA grouped GEMM takes bf16
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
        rows = rows.to(dtype)
        h = F.silu(torch._grouped_mm(rows, self.w1.to(dtype).transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(rows, self.w3.to(dtype).transpose(-2, -1), offs=offs)
        y = torch._grouped_mm(h, self.w2.to(dtype).transpose(-2, -1), offs=offs)[dest]
        y = y * weights.view(-1)[order, None].to(y.dtype)
        out = torch.zeros_like(x).index_add(0, order // self.top_k, y.to(x.dtype))
        out = out.view(x_BSD.shape)
        return out if self.shared is None else out + self.shared(x_BSD)


def balanced_indices(tokens: int, top_k: int, experts: int, device: Any) -> torch.Tensor:
    """Token ``t``'s ``j``-th expert is ``(t·k + j) mod E`` (module docstring)."""
    return (torch.arange(tokens * top_k, device=device) % experts).view(tokens, top_k)


@contextmanager
def forced_balance(enabled: bool):
    """Route every mt Router's tokens by :func:`balanced_indices`, keeping its scores."""
    if not enabled:
        yield
        return
    original = Router.forward

    def balanced(self: Router, x_BSD: torch.Tensor) -> Routing:
        # The router's own steps with the top-k choice replaced, not its forward and then these
        # (the router would run twice in the mt rows, once in the reference's). Both losses are
        # zero under "none" and "aux_free" balancing without z-loss (the aux-free bias only
        # steers the top-k replaced here).
        if self.cfg.balancing not in ("none", "aux_free") or self.cfg.z_loss_coeff:
            raise ValueError(
                f"forced balance drops the balancing and z-losses: got balancing="
                f"{self.cfg.balancing!r}, z_loss_coeff={self.cfg.z_loss_coeff}; use "
                "balancing none or aux_free and no z-loss"
            )
        tokens = x_BSD.shape[0] * x_BSD.shape[1]
        idx = balanced_indices(tokens, self.cfg.top_k, self.cfg.num_experts, x_BSD.device)
        with torch.autocast(x_BSD.device.type, enabled=False):
            logits = F.linear(x_BSD.reshape(tokens, -1).float(), self.weight.float())
        weights = self.scores(logits).gather(1, idx)
        weights = weights / weights.sum(-1, keepdim=True)
        counts = expert_counts(idx, self.cfg.num_experts)
        zero = logits.new_zeros(())
        return Routing(idx, weights, counts, zero, zero)

    Router.forward = balanced  # type: ignore[method-assign]
    try:
        yield
    finally:
        Router.forward = original  # type: ignore[method-assign]


# --------------------------------------------------------------------------- measurements
def _peak(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None


def _time(step: Callable[[], None], device: str, iters: int) -> float:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    return harness.median_ms(step, repeats=iters, warmup=2, device=device)


def bench_layers(shapes: dict, seq: int, device: str, iters: int, args: Any) -> list[dict]:
    rows = []
    autocast = device == "cuda"
    for shape, (dim, cfg) in shapes.items():
        torch.manual_seed(0)
        layer = MoE(dim, dataclasses.replace(cfg, balancing="none")).to(device)
        mt_parallel.init_weights(layer, seed=0)
        reference = ReferenceMoE(layer).to(device)
        if device == "cuda" and args.compile:
            reference = torch.compile(reference)
        fp8_layer = MoE(dim, dataclasses.replace(cfg, balancing="none")).to(device)
        fp8_layer.load_state_dict(layer.state_dict())
        mt_parallel.apply_fp8(
            fp8_layer, mt_fp8.recipe_from_name(args.recipe), expert_formats=args.expert_formats
        )
        x = torch.randn(1, seq, dim, device=device, requires_grad=True)
        dy = torch.randn(1, seq, dim, device=device)
        stacks = {"reference": reference, "mt_bf16": layer, "mt_fp8": fp8_layer}
        if "mt_bf16_compiled" in args.stacks:
            compiled = MoE(dim, dataclasses.replace(cfg, balancing="none")).to(device)
            compiled.load_state_dict(layer.state_dict())
            if device == "cuda" and args.compile:
                compiled.compile()
            stacks["mt_bf16_compiled"] = compiled
        stacks = {name: stacks[name] for name in args.stacks}
        for routing in ("natural", "balanced"):
            for stack, module in stacks.items():

                def step(module: nn.Module = module, x: Any = x, dy: Any = dy) -> None:
                    for p in [x, *module.parameters()]:
                        p.grad = None
                    with torch.autocast(device, torch.bfloat16, enabled=autocast):
                        y = module(x)
                    (y.float() * dy).sum().backward()

                target = getattr(module, "_orig_mod", module)
                if isinstance(target, ReferenceMoE):
                    target.balanced = routing == "balanced"
                with forced_balance(routing == "balanced"):
                    ms = _time(step, device, iters)
                    max_vio = None
                    if isinstance(module, MoE):
                        module(x)
                        max_vio = float(max_violation(module.load_stats.counts_E))
                    profiled = None
                    if args.profile:
                        profiled = train_throughput.profile_step(
                            step, torch.device(device), steps=2, top=25,
                            sources=args.profile_sources,
                        )  # fmt: skip
                rows.append({
                    "kind": "layer", "shape": shape, "stack": stack, "routing": routing,
                    "tokens": seq, "ms": ms, "tokens_per_s": seq / ms * 1e3,
                    "max_vio": max_vio, "peak_gib": _peak(device),
                })  # fmt: skip
                if profiled is not None:
                    rows[-1]["profile"] = profiled
                    print_profile(f"{shape} {routing} {stack}", profiled)
    return rows


def print_profile(title: str, prof: dict[str, Any]) -> None:
    """The per-step breakdown of :func:`train_throughput.profile_step`, as text."""
    parts = ", ".join(f"{c} {ms:.2f}" for c, ms in prof["device_ms_by_category"].items())
    print(
        f"{title}: wall {prof['wall_ms']:.2f} ms, kernels {prof['device_ms']:.2f} ms ({parts}), "
        f"device idle {prof['device_idle_ms']:.2f} ms"
    )
    for kernel, count, ms in prof["top_kernels_ms"]:
        print(f"    {ms:8.3f} ms  x{count:<5g} {kernel}")
    print(f"  host self time {prof['host_ms']:.2f} ms, by operator:")
    for op, count, ms in prof["top_host_ops_ms"]:
        print(f"    {ms:8.3f} ms  x{count:<5g} {op}")
    train_throughput.print_sources(prof)


def model_configs(smoke: bool, layers: int) -> dict[str, Any]:
    from mt_train.models.deepseek_v3 import SIZES as DEEPSEEK_SIZES
    from mt_train.models.moe import SIZES

    if smoke:
        tiny = dataclasses.replace(SIZES["mixtral_tiny"], vocab_size=320, n_layers=1, dim=64)
        mla = dataclasses.replace(DEEPSEEK_SIZES["deepseek_v3_tiny"], vocab_size=320, n_layers=2)
        return {"mixtral_tiny": tiny, "deepseek_v3_tiny": mla}
    mixtral = dataclasses.replace(SIZES["mixtral_8x7b"], n_layers=layers)
    lite = dataclasses.replace(
        SIZES["deepseek_moe_tiny"], name="deepseek_v2_lite_like", vocab_size=102400, dim=2048,
        n_layers=layers + 1, n_heads=16, n_kv_heads=16, ffn_dim=10944, first_k_dense=1,
        moe=MoEConfig(num_experts=64, top_k=6, expert_ffn_dim=1408, n_shared_experts=2,
                      balancing="aux_free"),
    )  # fmt: skip
    mla_lite = dataclasses.replace(DEEPSEEK_SIZES["deepseek_v2_lite"], n_layers=layers + 1)
    return {"mixtral_8x7b": mixtral, "deepseek_v2_lite_like": lite, "deepseek_v2_lite": mla_lite}


def bench_models(configs: dict, seq: int, device: str, iters: int, args: Any) -> list[dict]:
    from mt_train.config.schema import FP8Config
    from mt_train.models import build_model
    from mt_train.models.build import parallelize

    rows = []
    state = mt_comm.init_parallel_state()
    try:
        for name, cfg in configs.items():
            for stack in ("mt_bf16", "mt_fp8"):
                torch.manual_seed(0)
                model = build_model(cfg, device, seed=0)
                fp8 = (
                    FP8Config(recipe=args.recipe, expert_formats=args.expert_formats)
                    if stack == "mt_fp8"
                    else FP8Config(recipe="none")
                )
                model = parallelize(model, cfg, mt_parallel.ParallelConfig(), state, fp8)
                if device == "cuda":
                    optimizer: torch.optim.Optimizer = mt_fp8.FusedAdamW(model.parameters())
                else:
                    optimizer = torch.optim.AdamW(model.parameters())
                tokens = torch.randint(0, cfg.vocab_size, (1, seq + 1), device=device)

                def step(
                    model: nn.Module = model, opt: Any = optimizer, tokens: Any = tokens
                ) -> None:
                    with torch.autocast(device, torch.bfloat16, enabled=device == "cuda"):
                        logits = model(tokens[:, :-1])
                    loss = model.loss(logits, tokens[:, 1:])[0]
                    loss.backward()
                    opt.step()
                    mt_parallel.moe.update_expert_biases(model)
                    opt.zero_grad(set_to_none=True)

                ms = _time(step, device, iters)
                rows.append({
                    "kind": "model", "model": name, "layers": cfg.n_layers, "stack": stack,
                    "routing": "natural", "tokens": seq, "ms": ms,
                    "tokens_per_s": seq / ms * 1e3, "peak_gib": _peak(device),
                })  # fmt: skip
                del model, optimizer
                if device == "cuda":
                    torch.cuda.empty_cache()
    finally:
        mt_comm.destroy_parallel_state()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on any device")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--layers", type=int, default=2, help="MoE layers in the model rows")
    parser.add_argument("--recipe", default="rowwise", help="mt-fp8 recipe of the FP8 rows")
    parser.add_argument(
        "--expert-formats", choices=mt_parallel.EXPERT_FORMATS, default="auto",
        help="the FP8 experts' formats (the trainer's fp8.expert_formats)",
    )  # fmt: skip
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--skip-models", action="store_true", help="layer rows only")
    parser.add_argument("--profile", action="store_true", help="profile each layer stack")
    parser.add_argument(
        "--profile-sources",
        action="store_true",
        help="with --profile: attribute each operator's time to the repository's source lines",
    )
    parser.add_argument(
        "--stacks", type=lambda text: text.split(","), default=list(LAYER_STACKS),
        help=f"comma-separated layer stacks (default {','.join(LAYER_STACKS)}; also "
        f"{','.join(OPTIONAL_STACKS)})",
    )  # fmt: skip
    parser.add_argument(
        "--shapes", type=lambda text: text.split(","), default=list(LAYER_SHAPES),
        help=f"comma-separated layer shapes (default all: {','.join(LAYER_SHAPES)})",
    )  # fmt: skip
    parser.add_argument("--out", default=None, help="append result rows (JSON lines) here")
    args = parser.parse_args(argv)
    for name in args.stacks:
        if name not in LAYER_STACKS + OPTIONAL_STACKS:
            valid = ", ".join(LAYER_STACKS + OPTIONAL_STACKS)
            parser.error(f"--stacks: unknown stack {name!r}; valid: {valid}")
    for name in args.shapes:
        if name not in LAYER_SHAPES:
            parser.error(f"--shapes: unknown shape {name!r}; valid: {', '.join(LAYER_SHAPES)}")
    if args.smoke:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        shapes, seq, iters = SMOKE_LAYER_SHAPES, SMOKE_SEQ, 1
    else:
        harness.require_cuda()
        shapes = {name: LAYER_SHAPES[name] for name in args.shapes}
        device, seq, iters = "cuda", SEQ, args.iters
    name = torch.cuda.get_device_name() if device == "cuda" else device
    print(
        f"device: {name}, torch {torch.__version__}, recipe {args.recipe}, "
        f"experts {args.expert_formats}"
    )
    meta = {"device": name, "recipe": args.recipe, "expert_formats": args.expert_formats}
    # Each phase's rows are written as soon as it ends, so a run cut short keeps the layer rows.
    for row in bench_layers(shapes, seq, device, iters, args):
        harness.emit({**row, **meta}, args.out)
    if not args.skip_models:
        for row in bench_models(model_configs(args.smoke, args.layers), seq, device, iters, args):
            harness.emit({**row, **meta}, args.out)


if __name__ == "__main__":
    main()
