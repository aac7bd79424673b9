"""Vision-language training throughput: mt's VLM in bf16 and FP8 against a plain-PyTorch
reference of the same model, in one run on one GPU.

Model: LLaVA-1.5-7B shapes (``model=llava_1_5_7b``: CLIP ViT-L/14 at 336 px, 576 image tokens,
a 1024→4096→4096 GELU projector, Llama-2-7B) cut to ``--vision-layers`` encoder blocks (all of
them run: the features are read after the last) and ``--text-layers`` decoder blocks;
sequence ``--seq`` (4096) holding ``--images`` images per sample (each 576 placeholders)
followed by random text tokens; batch ``--batch``; loss on the text targets only; AdamW
(fused), bf16 autocast. Stacks:

* ``reference``: :class:`PlainVLM`, the same model in plain PyTorch (``nn.Linear``,
  ``F.layer_norm``, ``F.rms_norm``, SDPA, ``F.cross_entropy``) with ``torch.compile`` on each
  block of both towers; it loads mt's initial weights (its parameter names are mt's), so both
  start from the same model;
* ``mt_bf16``: ``build_model`` + ``mt_train.models.parallelize`` (compiled blocks);
* ``mt_fp8``: the same with ``fp8=<--recipe>`` on the decoder's linears, the encoder and
  projector in bf16 as mt-train's default ``model.fp8_vision=false`` keeps them
  (``--fp8-vision true``: on both towers' linears);
* ``mt_bf16_graphed``, ``mt_fp8_graphed`` (CUDA only): those stacks with the forward and
  backward captured once as a CUDA graph and replayed every step by
  :class:`mt_train.cuda_graph.StepGraph`, as ``trainer.cuda_graph=true`` runs them (the first
  step eager, the optimizer eager after each replay).

Per stack: ``--warmup`` steps (compilation included), then ``--steps`` timed steps between two
synchronisations: ``tokens/s = steps·batch·seq / s``, MFU from the family's FLOPs per token
(:func:`mt_train.models.vlm.model.flops_per_token`) over the device's dense bf16 peak, peak
memory; and the encoder's share of the step: the median time of the encoder + projector's
forward and backward alone (on the stack's own modules) over the median step time.

GPU: ``python benchmarks/vlm_throughput.py --out vlm.jsonl``. CPU smoke test: ``--tiny``
(toy shapes, fp32, no compile).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import sys
import time
from collections.abc import Callable
from typing import Any

import harness
import torch
import torch.nn.functional as F
from torch import nn

import mt_comm
import mt_parallel
from mt_train.config.schema import FP8Config
from mt_train.models import build_model, model_sizes, parallelize
from mt_train.models.vlm import VLMConfig
from mt_train.models.vlm.model import IGNORE_INDEX, flops_per_token
from mt_train.models.vlm.vision import activation

GRAPHED = "_graphed"
"""Suffix of a stack replayed as a CUDA graph (module docstring)."""
H200_BF16_PEAK = 989e12
"""Dense bf16 FLOP/s of an H200 (the MFU denominator on that card)."""


# ----------------------------------------------------------------------------- reference
class PlainVisionBlock(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int, act: str, eps: float) -> None:
        super().__init__()
        self.heads, self.act, self.eps = heads, act, eps
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps), nn.LayerNorm(dim, eps)
        self.attention = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self.attention, name, nn.Linear(dim, dim))
        self.mlp = nn.Module()
        self.mlp.fc1, self.mlp.fc2 = nn.Linear(dim, ffn), nn.Linear(ffn, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        N, L, D = x.shape
        n, a = self.norm1(x), self.attention

        def heads(linear: nn.Linear) -> torch.Tensor:
            return linear(n).view(N, L, self.heads, -1).transpose(1, 2)

        o = F.scaled_dot_product_attention(heads(a.q_proj), heads(a.k_proj), heads(a.v_proj))
        h = x + a.o_proj(o.transpose(1, 2).reshape(N, L, D))
        return h + self.mlp.fc2(activation(self.act, self.mlp.fc1(self.norm2(h))))


class PlainDecoderBlock(nn.Module):
    def __init__(self, cfg: VLMConfig) -> None:
        super().__init__()
        D, hd = cfg.dim, cfg.head_dim
        self.cfg = cfg
        self.attention_norm = nn.RMSNorm(D, cfg.norm_eps)
        self.ffn_norm = nn.RMSNorm(D, cfg.norm_eps)
        self.attention = nn.Module()
        self.attention.q_proj = nn.Linear(D, cfg.n_heads * hd, bias=False)
        self.attention.k_proj = nn.Linear(D, cfg.n_kv_heads * hd, bias=False)
        self.attention.v_proj = nn.Linear(D, cfg.n_kv_heads * hd, bias=False)
        self.attention.o_proj = nn.Linear(cfg.n_heads * hd, D, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(D, cfg.ffn_dim, bias=False)
        self.mlp.up_proj = nn.Linear(D, cfg.ffn_dim, bias=False)
        self.mlp.down_proj = nn.Linear(cfg.ffn_dim, D, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        a, c = self.attention, self.cfg
        n = self.attention_norm(x)

        def rope(t: torch.Tensor) -> torch.Tensor:
            t1, t2 = t.chunk(2, dim=-1)
            return (t * cos + torch.cat([-t2, t1], dim=-1) * sin).to(t.dtype)

        q = rope(a.q_proj(n).view(B, T, c.n_heads, -1).transpose(1, 2))
        k = rope(a.k_proj(n).view(B, T, c.n_kv_heads, -1).transpose(1, 2))
        v = a.v_proj(n).view(B, T, c.n_kv_heads, -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = x + a.o_proj(o.transpose(1, 2).reshape(B, T, -1))
        m = self.ffn_norm(h)
        return h + self.mlp.down_proj(F.silu(self.mlp.gate_proj(m)) * self.mlp.up_proj(m))


class PlainVLM(nn.Module):
    """The VLM in plain PyTorch, with mt's parameter names (module docstring)."""

    def __init__(self, cfg: VLMConfig) -> None:
        super().__init__()
        v = cfg.vision
        self.cfg = cfg
        self.vision = nn.Module()
        self.vision.embeddings = nn.Module()
        p = v.patch_size
        self.vision.embeddings.patch = nn.Parameter(torch.empty(v.dim, v.channels, p, p))
        self.vision.embeddings.cls = nn.Parameter(torch.empty(v.dim)) if v.cls_token else None
        self.vision.embeddings.positions = nn.Parameter(
            torch.empty(v.num_patches + int(v.cls_token), v.dim)
        )
        self.vision.pre_norm = nn.LayerNorm(v.dim, v.norm_eps) if v.pre_norm else None
        block = (v.dim, v.n_heads, v.ffn_dim, v.act, v.norm_eps)
        self.vision.layers = nn.ModuleList(PlainVisionBlock(*block) for _ in range(v.n_layers))
        self.vision.post_norm = nn.LayerNorm(v.dim, v.norm_eps) if v.post_norm else None
        self.projector = nn.Module()
        self.projector.linear_1 = nn.Linear(v.dim, cfg.dim, bias=cfg.projector_bias)
        self.projector.linear_2 = nn.Linear(cfg.dim, cfg.dim, bias=cfg.projector_bias)
        self.language = nn.Module()
        self.language.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.language.layers = nn.ModuleList(PlainDecoderBlock(cfg) for _ in range(cfg.n_layers))
        self.language.norm = nn.RMSNorm(cfg.dim, cfg.norm_eps)
        self.language.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        inv_freq = cfg.rope_theta ** (-torch.arange(0, cfg.head_dim, 2).double() / cfg.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        v, e = self.cfg.vision, self.vision.embeddings
        x = F.conv2d(images.to(e.patch.dtype), e.patch, stride=v.patch_size).flatten(2)
        x = x.transpose(1, 2)
        if e.cls is not None:
            x = torch.cat([e.cls.expand(x.shape[0], 1, -1), x], dim=1)
        x = x + e.positions
        if self.vision.pre_norm is not None:
            x = self.vision.pre_norm(x)
        for layer in self.vision.layers[: v.feature_blocks]:
            x = layer(x)
        if v.cls_token and v.feature_select == "patch":
            x = x[:, 1:]
        return self.projector.linear_2(F.gelu(self.projector.linear_1(x)))

    def forward(self, tokens: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        x = self.language.embed(tokens)
        mask = (tokens == self.cfg.image_token_id).unsqueeze(-1)
        x = x.masked_scatter(mask, self.features(images).to(x.dtype))
        angles = torch.arange(tokens.shape[1], device=tokens.device).double()[:, None]
        angles = torch.cat([angles * self.inv_freq] * 2, dim=-1)
        cos, sin = angles.cos().float(), angles.sin().float()
        for layer in self.language.layers:
            x = layer(x, cos, sin)
        return self.language.output(self.language.norm(x))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX
        )


# ----------------------------------------------------------------------------- workload
def model_config(args: argparse.Namespace) -> VLMConfig:
    base = model_sizes()["llava_1_5_7b"]
    if args.tiny:
        vision = dataclasses.replace(
            base.vision, image_size=28, dim=64, n_heads=4, ffn_dim=128, n_layers=args.vision_layers
        )
        return dataclasses.replace(
            base, vocab_size=512, dim=64, n_heads=4, n_kv_heads=4, ffn_dim=128,
            n_layers=args.text_layers, image_token_id=500, vision=vision,
            fp8_vision=args.fp8_vision,
        )  # fmt: skip
    vision = dataclasses.replace(base.vision, n_layers=args.vision_layers, feature_layer=-1)
    return dataclasses.replace(
        base, n_layers=args.text_layers, vision=vision, fp8_vision=args.fp8_vision
    )


def make_batch(cfg: VLMConfig, args: argparse.Namespace, device: torch.device) -> dict:
    """Random text with ``--images`` runs of image placeholders per sample; loss on text."""
    g = torch.Generator().manual_seed(0)
    L = cfg.image_tokens
    if args.images * L >= args.seq:
        raise SystemExit(f"--images {args.images} x {L} tokens do not fit --seq {args.seq}")
    tokens = torch.randint(0, cfg.image_token_id, (args.batch, args.seq + 1), generator=g)
    for k in range(args.images):
        tokens[:, 1 + k * L : 1 + (k + 1) * L] = cfg.image_token_id
    targets = tokens[:, 1:].clone()
    targets[targets == cfg.image_token_id] = IGNORE_INDEX
    v = cfg.vision
    images = torch.randn(
        args.batch * args.images, v.channels, v.image_size, v.image_size, generator=g
    )
    return {
        "tokens": tokens[:, :-1].to(device),
        "targets": targets.to(device),
        "images": images.to(device),
    }


def build_stack(name: str, cfg: VLMConfig, args: argparse.Namespace, device: torch.device):
    """``(model, loss_fn, encoder_fn)`` of one stack (module docstring)."""
    mt_model = build_model(cfg, device, seed=0)
    if name == "reference":
        ref = PlainVLM(cfg).to(device)
        ref.load_state_dict(mt_model.state_dict())
        del mt_model
        if not args.no_compile:
            for layer in [*ref.vision.layers, *ref.language.layers]:
                layer.compile()
        return ref, lambda b: ref.loss(ref(b["tokens"], b["images"]), b["targets"]), ref.features
    recipe = args.recipe if name == "mt_fp8" else "none"
    state = mt_comm.init_parallel_state(dp=1)
    parallel = mt_parallel.ParallelConfig(compile=not args.no_compile)
    model = parallelize(mt_model, cfg, parallel, state, FP8Config(recipe=recipe))

    def loss(b: dict) -> torch.Tensor:
        return mt_model.loss(model(b["tokens"], images=b["images"]), b["targets"])[0]

    def encoder(images: torch.Tensor) -> torch.Tensor:
        return mt_model.projector(mt_model.vision(images))

    return mt_model, loss, encoder


def graphed_forward_backward(
    loss_fn: Callable[[dict], torch.Tensor],
    params: list[nn.Parameter],
    batch: dict,
    autocast: contextlib.AbstractContextManager,
) -> Callable[[], torch.Tensor]:
    """A function running the step's forward and backward on ``batch`` by CUDA-graph replay
    (:class:`mt_train.cuda_graph.StepGraph`: one eager warm-up, then the capture) and returning
    the loss; the gradients are the graph's, re-attached to ``params`` after each replay."""
    from mt_train.cuda_graph import StepGraph
    from mt_train.data.dataset import Batch
    from mt_train.step import StepResult

    def forward_backward(batches: list[Batch], factors: torch.Tensor | None = None) -> StepResult:
        (b,) = batches
        with autocast:
            loss = loss_fn({"tokens": b.inputs, "targets": b.targets, "images": b.images})
        if factors is not None:  # the captured step's loss factor, as the trainer's reads it
            loss = loss * factors[0]
        loss.backward()
        return StepResult(loss.detach())

    step_batch = Batch(batch["tokens"], batch["targets"], images=batch["images"])
    forward_backward([step_batch])
    graph = StepGraph.capture(forward_backward, [step_batch], params)
    return lambda: graph.run([step_batch]).total


def run_stack(name: str, cfg: VLMConfig, args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    batch = make_batch(cfg, args, device)
    graphed = name.endswith(GRAPHED)
    if graphed and device.type != "cuda":
        raise SystemExit(f"stack {name!r} captures a CUDA graph; it needs --device cuda")
    model, loss_fn, encoder = build_stack(name.removesuffix(GRAPHED), cfg, args, device)
    params = [p for p in model.parameters() if p.requires_grad]
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=fused or None, foreach=None)
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=not args.tiny)
    losses: list[float] = []

    def eager_forward_backward() -> torch.Tensor:
        with autocast:
            loss = loss_fn(batch)
        loss.backward()
        return loss.detach()

    forward_backward = (
        graphed_forward_backward(loss_fn, params, batch, autocast)
        if graphed
        else eager_forward_backward
    )

    def step() -> None:
        loss = forward_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.clone())

    def encoder_only() -> None:
        with autocast:
            features = encoder(batch["images"])
        features.float().square().mean().backward()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync = lambda: harness.synchronize(device)  # noqa: E731
    done, seconds = harness.timed_steps(step, warmup=args.warmup, steps=args.steps, sync=sync)
    step_ms = harness.median_ms(step, repeats=args.repeats, warmup=0, device=device)
    encoder_ms = harness.median_ms(
        encoder_only, repeats=args.repeats, warmup=1, device=device,
        before=lambda: optimizer.zero_grad(set_to_none=True),
    )  # fmt: skip
    optimizer.zero_grad(set_to_none=True)
    tokens_per_s = done * args.batch * args.seq / seconds
    flops = flops_per_token(cfg, args.seq)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {
        "stack": name,
        "vision_layers": cfg.vision.n_layers,
        "text_layers": cfg.n_layers,
        "seq": args.seq,
        "batch": args.batch,
        "images_per_sample": args.images,
        "recipe": args.recipe if name.startswith("mt_fp8") else None,
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops / H200_BF16_PEAK,
        "step_ms": step_ms,
        "encoder_ms": encoder_ms,
        "encoder_share": encoder_ms / step_ms,
        "peak_gib": peak,
        "first_loss": float(losses[0]),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vision-layers", type=int, default=6)
    parser.add_argument("--text-layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--images", type=int, default=1, help="images per sample")
    parser.add_argument("--recipe", default="tensorwise", help="the mt_fp8 stack's fp8 recipe")
    parser.add_argument("--fp8-vision", type=lambda s: s.lower() == "true", default=False)
    parser.add_argument(
        "--stacks",
        default="reference,mt_bf16,mt_fp8",
        help="comma-separated: reference, mt_bf16, mt_fp8, mt_bf16_graphed, mt_fp8_graphed",
    )
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5, help="median step/encoder timings")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: toy shapes, fp32")
    parser.add_argument("--out", default=None, help="append result rows (JSON lines)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.seq, args.warmup, args.steps, args.repeats = 64, 1, 2, 1
    mt_comm.init_distributed(device=args.device)
    cfg = model_config(args)
    rows = []
    for name in args.stacks.split(","):
        torch.manual_seed(0)
        row = run_stack(name, cfg, args)
        harness.emit(row, args.out)
        rows.append(row)
        with contextlib.suppress(RuntimeError):
            mt_comm.destroy_parallel_state()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    by_name = {r["stack"]: r["tokens_per_s"] for r in rows}
    for suffix in ("", GRAPHED):
        bf16, fp8 = by_name.get("mt_bf16" + suffix), by_name.get("mt_fp8" + suffix)
        ref = by_name.get("reference")
        if ref and bf16:
            print(f"mt_bf16{suffix} / reference = {bf16 / ref:.3f}", file=sys.stderr)
        if bf16 and fp8:
            print(f"mt_fp8{suffix} / mt_bf16{suffix} = {fp8 / bf16:.3f}", file=sys.stderr)
    return rows


if __name__ == "__main__":
    began = time.perf_counter()
    main()
    print(f"total {time.perf_counter() - began:.0f} s", file=sys.stderr)
