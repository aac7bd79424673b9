"""A plain-PyTorch Llama training loop: the reference that ``mt-train``'s loss is held to.

Nothing of mt is imported: ``nn.Embedding``, ``nn.Linear``, ``nn.RMSNorm``,
``F.scaled_dot_product_attention``, ``F.cross_entropy`` on fp32 logits and
``torch.optim.AdamW`` (fused on CUDA), in the shortest form that is obviously correct, so
that a difference between the two is mt's to explain. It reads the same prepared folder
(``meta.json``, ``train.bin``, ``val.bin``) and writes the same ``metrics.jsonl`` rows
(``{"kind": "train", "step", "loss", "tok/s"}``, ``{"kind": "eval", "step", "val_loss"}``)
as ``mt-train``, so ``benchmarks/fp8_quality.py`` collects both alike.

Model (pre-norm Llama 3, untied embeddings)::

    h = x + o(attn(rope(q(n1(x))), rope(k(n1(x))), v(n1(x))))     causal SDPA, GQA
    y = h + down(silu(gate(n2(h))) * up(n2(h)))

RoPE is rotate-half with base ``--rope-theta`` and Llama 3.1 frequency scaling (factor 8,
low/high frequency factors 1 and 4, original context 8192: ``llama_125m``'s), angles in fp64.
bf16 autocast on CUDA (fp32 master weights), fp32 on the CPU; logits cast to fp32 before the
loss. ``--float8 tensorwise|rowwise`` converts every block linear (not the output head) with
torchao's ``convert_to_float8_training`` and that recipe name; ``--compile`` compiles each
block (torchao's float8 is meant to run compiled: eager, its scaling is host-bound).

Training (defaults = ``benchmarks/fp8_quality.py``'s): AdamW β (0.9, 0.95), ε 1e-8, decay 0.1
on every matrix (``p.dim() >= 2``: the embedding and the head included; ``--decay
no_embedding`` spares the embedding), ``clip_grad_norm_(1.0)``, LR ``peak·m(s)`` at step
``s`` with ``m = (s+1)/W`` for ``s < W`` then ``r + (1-r)·½(1 + cos(π(s-W)/(S-W)))``,
``r = 0.1``. Init: every matrix N(0, 0.02) (GPT-2's), ``--init scaled`` draws ``o`` and
``down`` with ``0.02/sqrt(2L)``, norms 1; ``--init-from FILE`` loads initial weights saved in
mt-train's names instead (the quality harness passes mt's own initial weights of the seed, so a
pair of runs differs only in the training code). Batches (``--sampler``): ``permutation`` (default)
visits the non-overlapping windows ``i·T`` in the order
``numpy.random.default_rng([seed, epoch]).permutation``, mt-train's default sampler, so that
both train on the same windows in the same order and a difference between them is the
training code's; ``random`` draws each window's start uniformly from the whole split with a
torch generator seeded by ``--seed`` (nanoGPT's ``get_batch``).
Validation: the first ``eval_batches · batch`` non-overlapping windows of the val split, the
mean of the per-batch mean losses (mt-train's evaluation).

Run (repository root)::

    python benchmarks/plain_llama.py --data DIR --out DIR [--float8 tensorwise] [--steps 2000]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True, help="folder written by mt-prepare-data")
    p.add_argument("--out", type=Path, required=True, help="folder for metrics.jsonl")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=int, default=None, help="default: 5%% of the steps")
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-interval", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=21)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--vocab-size", type=int, default=320)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--layers", type=int, default=14)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn-dim", type=int, default=3072)
    p.add_argument("--rope-theta", type=float, default=500000.0)
    p.add_argument("--rope-factor", type=float, default=8.0, help="1 turns Llama 3.1 scaling off")
    p.add_argument("--norm-eps", type=float, default=1e-5)
    p.add_argument("--init", choices=("normal", "scaled"), default="normal")
    p.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="safetensors file of initial weights in mt-train's names (replaces --init)",
    )
    p.add_argument("--sampler", choices=("permutation", "random"), default="permutation")
    p.add_argument("--decay", choices=("matrices", "no_embedding"), default="matrices")
    p.add_argument("--float8", choices=("none", "tensorwise", "rowwise"), default="none")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    args = p.parse_args(argv)
    if args.warmup is None:
        args.warmup = max(1, args.steps // 20)
    return args


def rope_frequencies(head_dim: int, theta: float, factor: float) -> torch.Tensor:
    """Llama 3.1 scaled RoPE frequencies (fp64), as in transformers' ``llama3`` rope type."""
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if factor == 1.0:
        return freqs
    low, high, original = 1.0, 4.0, 8192
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    scaled = torch.where(
        wavelen > original / low, freqs / factor, (1 - smooth) * freqs / factor + smooth * freqs
    )
    return torch.where(wavelen < original / high, freqs, scaled)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Block(nn.Module):
    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = a.heads, a.kv_heads, a.dim // a.heads
        self.attn_norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.q = nn.Linear(a.dim, a.heads * self.head_dim, bias=False)
        self.k = nn.Linear(a.dim, a.kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(a.dim, a.kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(a.heads * self.head_dim, a.dim, bias=False)
        self.mlp_norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.gate = nn.Linear(a.dim, a.ffn_dim, bias=False)
        self.up = nn.Linear(a.dim, a.ffn_dim, bias=False)
        self.down = nn.Linear(a.ffn_dim, a.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        n = self.attn_norm(x)
        q = self.q(n).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(n).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(n).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin).to(v.dtype), rotate(k, cos, sin).to(v.dtype)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = x + self.o(a.transpose(1, 2).reshape(B, T, -1))
        m = self.mlp_norm(h)
        return h + self.down(F.silu(self.gate(m)) * self.up(m))


class Llama(nn.Module):
    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__()
        self.embed = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.layers))
        self.norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)
        freqs = rope_frequencies(a.dim // a.heads, a.rope_theta, a.rope_factor)
        angles = torch.arange(a.seq_len, dtype=torch.float64)[:, None] * freqs
        full = torch.cat([angles, angles], dim=-1)  # rotate-half: pair (i, i + d/2) shares f_i
        self.register_buffer("cos", full.cos().float(), persistent=False)
        self.register_buffer("sin", full.sin().float(), persistent=False)
        residual_std = 0.02 / math.sqrt(2 * a.layers) if a.init == "scaled" else 0.02
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = residual_std if name.endswith((".o.weight", ".down.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        T = tokens.shape[1]
        for layer in self.layers:
            x = layer(x, self.cos[:T], self.sin[:T])
        return self.output(self.norm(x))


MT_NAMES = {
    "attention_norm": "attn_norm",
    "attention.q_proj": "q",
    "attention.k_proj": "k",
    "attention.v_proj": "v",
    "attention.o_proj": "o",
    "ffn_norm": "mlp_norm",
    "mlp.gate_proj": "gate",
    "mlp.up_proj": "up",
    "mlp.down_proj": "down",
}
"""mt-train's module names inside a block -> this model's."""


def plain_name(mt_name: str) -> str:
    """``layers.3.attention.q_proj.weight`` -> ``layers.3.q.weight``; top-level names agree."""
    for mt, plain in MT_NAMES.items():
        mt_name = mt_name.replace(f".{mt}.", f".{plain}.")
    return mt_name


def load_mt_weights(model: nn.Module, path: Path) -> None:
    """Start from mt-train's initial weights (so a same-seed pair differs only in its code)."""
    from safetensors.torch import load_file

    state = {plain_name(name): tensor for name, tensor in load_file(path).items()}
    model.load_state_dict(state, strict=True)


def load_split(folder: Path, split: str) -> np.ndarray:
    meta = json.loads((folder / "meta.json").read_text())
    return np.memmap(folder / f"{split}.bin", dtype=meta["dtype"], mode="r")


def windows(tokens: np.ndarray, starts: np.ndarray, T: int, device: torch.device):
    rows = np.stack([np.asarray(tokens[s : s + T + 1], dtype=np.int64) for s in starts])
    batch = torch.from_numpy(rows).to(device)
    return batch[:, :-1], batch[:, 1:]


class Batches:
    """Window starts for each step (module docstring, ``--sampler``)."""

    def __init__(self, a: argparse.Namespace, num_tokens: int) -> None:
        self.a, self.T = a, a.seq_len
        self.last_start = num_tokens - self.T - 1  # the last window's target ends at the end
        self.num_windows = (num_tokens - 1) // self.T
        self.generator = torch.Generator().manual_seed(a.seed)
        self.drawn, self.epoch, self.order = 0, -1, np.arange(0)

    def next(self) -> np.ndarray:
        b = self.a.batch
        if self.a.sampler == "random":
            return torch.randint(0, self.last_start + 1, (b,), generator=self.generator).numpy()
        draws = self.drawn + np.arange(b)
        self.drawn += b
        out = np.empty(b, dtype=np.int64)
        for i, g in enumerate(draws):
            epoch = int(g) // self.num_windows
            if epoch != self.epoch:
                rng = np.random.default_rng([self.a.seed, epoch])
                self.epoch, self.order = epoch, rng.permutation(self.num_windows)
            out[i] = self.order[int(g) % self.num_windows] * self.T
        return out


def lr_at(a: argparse.Namespace, step: int) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    progress = min((step - a.warmup) / max(a.steps - a.warmup, 1), 1.0)
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(a.seed)
    model = Llama(a)
    if a.init_from is not None:
        load_mt_weights(model, a.init_from)
    model = model.to(device)
    if a.float8 != "none":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(
            model,
            config=Float8LinearConfig.from_recipe_name(a.float8),
            module_filter_fn=lambda module, fqn: fqn != "output",
        )
    if a.compile:
        for layer in model.layers:
            layer.compile()
    spared = {id(model.embed.weight)} if a.decay == "no_embedding" else set()
    decayed = [p for p in model.parameters() if p.dim() >= 2 and id(p) not in spared]
    others = [p for p in model.parameters() if p.dim() < 2 or id(p) in spared]
    optimizer = torch.optim.AdamW(
        [
            {"params": decayed, "weight_decay": a.weight_decay},
            {"params": others, "weight_decay": 0.0},
        ],
        lr=a.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=device.type == "cuda",
    )
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda")
    train, val = load_split(a.data, "train"), load_split(a.data, "val")
    batches = Batches(a, len(train))
    val_starts = np.arange(a.eval_batches * a.batch) * a.seq_len

    def loss_of(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with autocast:
            logits = model(inputs)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    @torch.no_grad()
    def evaluate() -> float:
        model.eval()
        losses = [
            loss_of(*windows(val, val_starts[i : i + a.batch], a.seq_len, device))
            for i in range(0, len(val_starts), a.batch)
        ]
        model.train()
        return torch.stack(losses).mean().item()

    a.out.mkdir(parents=True, exist_ok=True)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"plain_llama: {n_params:,} parameters, float8={a.float8}, on {device}", flush=True)
    began = time.perf_counter()
    window_began, window_tokens = began, 0
    with open(a.out / "metrics.jsonl", "w") as metrics:
        for step in range(a.steps):
            inputs, targets = windows(train, batches.next(), a.seq_len, device)
            loss = loss_of(inputs, targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(a, step)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            done = step + 1
            window_tokens += inputs.numel()
            if done % a.log_interval == 0 or done == a.steps:
                now = time.perf_counter()
                row = {"kind": "train", "step": done, "loss": loss.item()}
                row["tok/s"] = window_tokens / (now - window_began)
                window_began, window_tokens = now, 0
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
            if done % a.eval_interval == 0 or done == a.steps:
                row = {"kind": "eval", "step": done, "val_loss": evaluate()}
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
    wall = time.perf_counter() - began
    print(f"done: {a.steps} steps in {wall:.0f} s; validation loss {row['val_loss']:.4f}")


if __name__ == "__main__":
    main()
