"""AdamW parameter groups and learning-rate schedules.

AdamW (Loshchilov & Hutter) with decoupled weight decay: ``θ ← θ - lr·(m̂/(√v̂+ε) + λ·θ)``.
Only matrices are decayed (``p.dim() >= 2``: linear weights and embeddings); norm gains and
biases (1-D) are not, since shrinking them toward zero changes the function, not its scale.

Schedules give the LR multiplier at step ``s`` (0-based, the step about to be taken) for
``S = max_steps`` and warmup ``W``:

* warmup (all): ``(s+1)/W`` for ``s < W``;
* cosine: ``r + (1-r)·½(1 + cos(π·p))`` with ``p = (s-W)/(S-W)`` and ``r = min_lr_ratio``;
* wsd (warmup-stable-decay): 1 until the last ``D = ceil(decay_fraction·S)`` steps, then
  linear from 1 to ``r`` over them;
* constant: 1.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mt_train.config.schema import OptimizerConfig, SchedulerConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: decayed matrices and undecayed vectors (names kept for checkpoints)."""
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if param.dim() >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, device_type: str) -> torch.optim.AdamW:
    """AdamW; fused on accelerators unless ``cfg.fused`` says otherwise."""
    fused = cfg.fused if cfg.fused is not None else device_type != "cpu"
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.betas[0], cfg.betas[1]),
        eps=cfg.eps,
        fused=fused,
    )


def lr_multiplier(step: int, max_steps: int, cfg: SchedulerConfig) -> float:
    """The schedule's factor on the peak LR at ``step`` (see the module docstring)."""
    warmup = cfg.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    ratio = cfg.min_lr_ratio
    if cfg.name == "constant":
        return 1.0
    if cfg.name == "cosine":
        span = max(max_steps - warmup, 1)
        progress = min((step - warmup) / span, 1.0)
        return ratio + (1.0 - ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if cfg.name == "wsd":
        decay_steps = max(math.ceil(cfg.decay_fraction * max_steps), 1)
        decay_start = max_steps - decay_steps
        if step < decay_start:
            return 1.0
        progress = min((step - decay_start + 1) / decay_steps, 1.0)
        return 1.0 - (1.0 - ratio) * progress
    raise ValueError(f"unknown schedule {cfg.name!r}; valid: cosine, wsd, constant")
