"""mt-train's optimisation equals a plain PyTorch training loop written here.

The plain loop is the shortest obviously-correct Llama training step: ``nn.Embedding``,
``nn.Linear``, ``nn.RMSNorm``, causal ``F.scaled_dot_product_attention`` with GQA, rotate-half
RoPE with Llama 3.1 frequency scaling, ``F.cross_entropy``, ``clip_grad_norm_`` and
``torch.optim.AdamW`` with weight decay on every matrix, the LR set each step from linear
warmup and cosine decay. Its modules carry mt's parameter names, so it starts from the
Trainer's initial weights with ``load_state_dict``, and it trains on the windows mt's
sampler draws. Everything mt does differently (fused ops with explicit backward, gradient
accumulation over two micro-batches, its clipping, schedule and decay groups) must then give
the same per-step losses: in fp32 on the CPU the two differ only by summation order, about
1e-7 relative per op, which 24 steps of training amplify to well under the 1e-5 bound, while
a wrong schedule step, decay group, clipping coefficient or loss scale moves the loss by
1e-3 or more within a few steps.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from train_checks import tiny_overrides

from mt_train import Trainer, compose_config, to_train_config
from mt_train.data.dataset import ResumableSampler
from mt_train.models.build import build_model
from mt_train.models.llama import rope_frequencies

STEPS = 24
LOSS_BOUND = 1e-5


class PlainBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int, eps: float) -> None:
        super().__init__()
        hd = dim // heads
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hd
        self.attention_norm = nn.RMSNorm(dim, eps=eps)
        self.attention = nn.Module()
        self.attention.q_proj = nn.Linear(dim, heads * hd, bias=False)
        self.attention.k_proj = nn.Linear(dim, kv_heads * hd, bias=False)
        self.attention.v_proj = nn.Linear(dim, kv_heads * hd, bias=False)
        self.attention.o_proj = nn.Linear(heads * hd, dim, bias=False)
        self.ffn_norm = nn.RMSNorm(dim, eps=eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(dim, ffn, bias=False)
        self.mlp.up_proj = nn.Linear(dim, ffn, bias=False)
        self.mlp.down_proj = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        att, mlp = self.attention, self.mlp
        n = self.attention_norm(x)

        def heads(proj: nn.Linear, count: int) -> torch.Tensor:
            return proj(n).view(B, T, count, self.head_dim).transpose(1, 2)

        def rope(t: torch.Tensor) -> torch.Tensor:
            t1, t2 = t.chunk(2, dim=-1)
            return t * cos + torch.cat([-t2, t1], dim=-1) * sin

        q, k = rope(heads(att.q_proj, self.heads)), rope(heads(att.k_proj, self.kv_heads))
        v = heads(att.v_proj, self.kv_heads)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = x + att.o_proj(a.transpose(1, 2).reshape(B, T, -1))
        m = self.ffn_norm(h)
        return h + mlp.down_proj(F.silu(mlp.gate_proj(m)) * mlp.up_proj(m))


class PlainLlama(nn.Module):
    def __init__(self, cfg, seq_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(
            PlainBlock(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.norm_eps)
            for _ in range(cfg.n_layers)
        )
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        freqs = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        angles = torch.arange(seq_len, dtype=torch.float64)[:, None] * freqs
        angles = torch.cat([angles, angles], dim=-1)
        self.cos, self.sin = angles.cos().float(), angles.sin().float()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        return self.output(self.norm(x))


def plain_losses(trainer: Trainer, model: PlainLlama, steps: int) -> list[float]:
    """The plain loop on the windows mt's sampler draws (one batch of the global size)."""
    cfg = trainer.cfg
    opt, sched, tr = cfg.optimizer, cfg.scheduler, cfg.trainer
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": opt.weight_decay}, {"params": vectors}],
        lr=opt.lr,
        betas=tuple(opt.betas),
        eps=opt.eps,
        weight_decay=0.0,
    )
    G = tr.global_batch_size
    sampler = ResumableSampler(
        len(trainer.data.train), tr.seed, G, G, independent=trainer.cfg.data.independent_draws
    )
    losses = []
    for step in range(steps):
        batch = trainer.data.train.collate(sampler.next_step()[0])
        logits = model(batch.inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)
        if step < sched.warmup_steps:
            lr = opt.lr * (step + 1) / sched.warmup_steps
        else:
            progress = (step - sched.warmup_steps) / (tr.max_steps - sched.warmup_steps)
            r = sched.min_lr_ratio
            lr = opt.lr * (r + (1 - r) * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("sampling", ["permutation", "random"])
def test_fp32_training_equals_a_plain_pytorch_loop(
    kjv_data: Path, tmp_path: Path, sampling: str
) -> None:
    overrides = tiny_overrides(
        kjv_data,
        **{
            "trainer.max_steps": STEPS,
            "trainer.log_interval": 1,
            "trainer.eval_interval": STEPS,
            "trainer.precision": "fp32",
            "checkpoint.enabled": False,
            "optimizer.lr": 3e-3,
            "scheduler.warmup_steps": 4,
            "data.sampling": sampling,
        },
    )
    trainer = Trainer(to_train_config(compose_config(overrides)), tmp_path)
    plain = PlainLlama(trainer.model_cfg, trainer.cfg.trainer.seq_len)
    plain.load_state_dict(trainer.module.state_dict())
    mt_losses = trainer.fit().losses
    reference = plain_losses(trainer, plain, STEPS)
    assert len(mt_losses) == STEPS
    # The first losses must be far apart from each other for the comparison to mean anything.
    assert reference[0] - reference[-1] > 1.0
    np.testing.assert_allclose(mt_losses, reference, rtol=0, atol=LOSS_BOUND)


@pytest.mark.parametrize("scaled", [False, True])
def test_default_init_draws_every_matrix_at_init_std(scaled: bool) -> None:
    """The init that trains as well as the plain loop: every matrix N(0, init_std), norms 1
    (``model.scaled_residual_init=true`` draws o_proj and down_proj with init_std/sqrt(2L)).
    A drawn std over n ≥ 8,192 values is off by 1/sqrt(2n) < 0.8% relative (one standard
    error), so the 5% bound fails only for a wrong init."""
    cfg = to_train_config(
        compose_config(["model=llama_125m", f"model.scaled_residual_init={scaled}"])
    ).model
    cfg = dataclasses.replace(cfg, n_layers=2, vocab_size=320)
    model = build_model(cfg, "cpu", seed=3)
    residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers) if scaled else cfg.init_std
    for name, param in model.named_parameters():
        if param.dim() == 1:
            assert torch.equal(param, torch.ones_like(param)), name
            continue
        residual = name.endswith(("o_proj.weight", "down_proj.weight"))
        expected = residual_std if residual else cfg.init_std
        assert param.float().std().item() == pytest.approx(expected, rel=0.05), name
