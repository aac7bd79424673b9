"""AdamW parameter groups, the ZeRO-1 variant, and learning-rate schedules.

AdamW (Loshchilov & Hutter) with decoupled weight decay: ``θ ← θ - lr·(m̂/(√v̂+ε) + λ·θ)``.
Only matrices are decayed (``p.dim() >= 2``: linear weights and embeddings); norm gains and
biases (1-D) are not, since shrinking them toward zero changes the function, not its scale.
``optimizer.embedding_weight_decay=false`` leaves the input embedding undecayed too.

ZeRO-1 (``parallel.data_parallel=zero1``): :class:`Zero1AdamW` is mt_parallel's
:class:`~mt_parallel.DistributedOptimizer` (flat fp32 master shard and AdamW moments for
``1/W`` of the elements on each of the ``W`` dp×cp ranks) with decay on matrices only (its
``decay`` filter: the same elements as the per-parameter groups above), used split: the trainer
calls :meth:`~mt_parallel.DistributedOptimizer.reduce_gradients` (reduce-scatter, global norm),
lets the anomaly detectors judge the step, then
:meth:`~mt_parallel.DistributedOptimizer.apply_update` (clip, decay, AdamW, all-gather) or
drops it. This class adds the parameter names and the shard views checkpoints need.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import mt_fp8
import mt_fp8.ops.dispatch
import mt_parallel
from mt_train.config.schema import OptimizerConfig, SchedulerConfig
from mt_train.models.build import canonical_key


def decay_filter(model: nn.Module, embedding_weight_decay: bool) -> Callable[[nn.Parameter], bool]:
    """Whether a parameter of ``model`` is decayed: matrices, without the input embedding's
    table unless ``embedding_weight_decay``."""
    embeddings = set()
    if not embedding_weight_decay:
        embeddings = {
            id(p)
            for m in model.modules()
            if isinstance(m, (nn.Embedding, mt_parallel.VocabParallelEmbedding))
            for p in m.parameters()
        }
    return lambda param: param.dim() >= 2 and id(param) not in embeddings


def param_groups(
    model: nn.Module, weight_decay: float, embedding_weight_decay: bool = True
) -> list[dict]:
    """Two groups: decayed matrices and undecayed vectors (names kept for checkpoints)."""
    decayed = decay_filter(model, embedding_weight_decay)
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if decayed(param) else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(
    model: nn.Module,
    cfg: OptimizerConfig,
    device_type: str,
    data_parallel: str = "ddp",
    dp_cp_group: Any = None,
    tp_group: Any = None,
    mp_group: Any = None,
) -> torch.optim.AdamW | Zero1AdamW:
    """AdamW (per parameter, FSDP2 DTensors included) or, for ``zero1``, :class:`Zero1AdamW`
    over ``dp_cp_group`` (its norm summed over ``mp_group``, tp×pp, default the tp group), with
    the kernel :func:`optimizer_impl` picks."""
    impl = optimizer_impl(cfg.impl, device_type, data_parallel)
    hyper = {"lr": cfg.lr, "betas": (cfg.betas[0], cfg.betas[1]), "eps": cfg.eps}
    if data_parallel == "zero1":
        named = [(canonical_key(n), p) for n, p in model.named_parameters() if p.requires_grad]
        return Zero1AdamW(
            named, cfg.weight_decay, dp_cp_group, tp_group, fused=impl == "fused",
            decay=decay_filter(model, cfg.embedding_weight_decay), mp_group=mp_group, **hyper,
        )  # fmt: skip
    groups = param_groups(model, cfg.weight_decay, cfg.embedding_weight_decay)
    if impl == "triton":
        return mt_fp8.FusedAdamW(groups, **hyper)
    return torch.optim.AdamW(groups, fused=impl == "fused", **hyper)


def optimizer_impl(requested: str, device_type: str, data_parallel: str) -> str:
    """``optimizer.impl`` resolved: ``auto`` becomes triton, fused or foreach (config docs);
    ``triton`` where its kernel cannot run is refused with the reason."""
    triton_ok = mt_fp8.ops.dispatch.triton_runs_on(device_type)
    if requested == "auto":
        if data_parallel == "fsdp" or device_type == "cpu":
            return "foreach"
        return "triton" if triton_ok and data_parallel != "zero1" else "fused"
    if requested == "triton" and (data_parallel in ("fsdp", "zero1") or not triton_ok):
        raise ValueError(
            f"optimizer.impl=triton needs CUDA parameters, Triton installed and data_parallel "
            f"ddp or none (got device {device_type}, data_parallel={data_parallel}); "
            "use impl=fused or impl=foreach"
        )
    return requested


@dataclass(frozen=True)
class ShardView:
    """The elements of one parameter that lie in this rank's ZeRO-1 shard."""

    name: str
    param: nn.Parameter
    start: int
    """First element (of the flattened parameter) in the shard."""
    local: slice
    """Where those elements sit in the shard."""


class Zero1AdamW(mt_parallel.DistributedOptimizer):
    """ZeRO-1 AdamW over ``group`` (dp×cp) with matrix-only decay (module docstring; ``decay``
    narrows it, see :func:`decay_filter`). ``named`` lists ``(name, parameter)`` in the flat
    layout's order."""

    def __init__(
        self,
        named: list[tuple[str, nn.Parameter]],
        weight_decay: float,
        group: Any,
        tp_group: Any,
        decay: Callable[[nn.Parameter], bool] | None = None,
        mp_group: Any = None,
        **adamw: Any,
    ) -> None:
        super().__init__(
            [p for _, p in named], group, tp_group, mp_group, optimizer_cls=torch.optim.AdamW,
            decay=decay or (lambda param: param.dim() >= 2), weight_decay=weight_decay, **adamw,
        )  # fmt: skip
        self.names = [name for name, _ in named]
        wrong = sorted({str(p.dtype) for p in self.params if p.dtype != self.master_dtype})
        if wrong:
            raise ValueError(
                f"ZeRO-1 needs parameters in the master dtype {self.master_dtype} (checkpoints "
                f"rebuild the master weights from them), got {', '.join(wrong)}"
            )

    def views(self) -> list[ShardView]:
        """Every parameter that overlaps this rank's shard ``[lo, lo + shard)``."""
        name_of = {id(param): name for name, param in zip(self.names, self.params, strict=True)}
        return [
            ShardView(name_of[id(param)], param, start, local)
            for param, start, local in self.shard_slices()
        ]

    @torch.no_grad()
    def sync_master(self) -> None:
        """Master shard ← the parameters (after loading them: they are equal after a step)."""
        for view in self.views():
            flat = view.param.detach().reshape(-1)
            size = view.local.stop - view.local.start
            self.master[view.local] = flat[view.start : view.start + size]


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
