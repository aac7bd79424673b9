"""The training loop as a class: build everything from a :class:`TrainConfig`, then ``fit()``.

One optimizer step (``A`` micro-batches per rank, ``A = G / (b·dp)``)::

    for m < A:  loss_m = CE(model(x_m), y_m);  backward(loss_m / A)      (autocast if bf16)
    grads ← mean over dp ranks                      (DDP at the last micro-batch, or a flat all-reduce)
    n = ‖grads‖₂ (global over TP shards); if clip > 0: grads ← grads · min(1, clip / n)
    lr = peak · schedule(step) · lr_scale;  AdamW step;  zero grads

The reported loss is the mean over the global batch. The step is skipped (never applied)
when the loss or ``n`` is not finite, or, with rewind on, when the loss spikes above
``spike_factor`` × its running mean: rewind then restores the newest checkpoint, keeps the
data position (so the batches since that checkpoint, the offending one included, are
skipped), multiplies ``lr_scale`` by ``lr_cooldown`` and counts the rewind. All ranks see the
same reduced loss and norm, so they agree on anomalies without another collective.

Invariant for exact resume: the full state is (parameters, AdamW state, sampler ``consumed``,
step, lr_scale, RNG); all of it is checkpointed, and nothing else carries information
between steps, so on the CPU a resumed run repeats the uninterrupted loss curve bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import mt_comm
import mt_fp8
import mt_parallel
from mt_train import distributed as D
from mt_train.checkpoint.checkpointer import (
    Checkpointer,
    TPLayout,
    load_into,
    model_state,
    optimizer_state,
    resolve_resume,
    rng_state,
)
from mt_train.checkpoint.files import CheckpointReader
from mt_train.config.schema import TrainConfig
from mt_train.convert import checkpoint_folder
from mt_train.data.dataset import Batch, DataModule, ResumableSampler
from mt_train.data.prepare import prepare_bundled
from mt_train.metrics import MetricsLogger
from mt_train.models import build as B
from mt_train.models.llama import flops_per_token, num_params
from mt_train.optim import build_optimizer, lr_multiplier
from mt_train.sample import greedy_generate


@dataclass
class TrainSummary:
    """What a finished :meth:`Trainer.fit` reports."""

    steps: int
    train_loss: float
    val_loss: float
    wall_s: float
    tokens_per_s: float
    output_dir: str
    checkpoint: str | None
    losses: list[float]
    rewinds: int
    sample: str


class Trainer:
    """Builds the run (distributed init, data, model, optimizer, checkpoints) and trains it."""

    def __init__(self, cfg: TrainConfig, output_dir: str | Path | None = None) -> None:
        self.cfg = cfg
        tr = cfg.trainer
        self.ctx = mt_comm.init_distributed(device=tr.device)
        self.rank, self.world_size = self.ctx.rank, self.ctx.world_size
        self.device = self.ctx.torch_device
        self.dp = cfg.check_world(self.world_size)
        # Per-rank RNG streams (dropout, sampling) start from the seed: runs are repeatable.
        torch.manual_seed(tr.seed + self.rank)
        self.ctx.device.manual_seed(tr.seed + self.rank)
        p = cfg.parallel
        with contextlib.suppress(RuntimeError):
            mt_comm.destroy_parallel_state()
        self.pstate = mt_comm.init_parallel_state(dp=self.dp, cp=p.cp, tp=p.tp, pp=p.pp, ep=p.ep)
        self.dp_group, self.tp_group = self.pstate.group("dp"), self.pstate.group("tp")
        self.dp_rank, self.dp_size = self.pstate.rank("dp"), self.pstate.size("dp")

        out = str(output_dir or tr.output_dir or Path.cwd() / "outputs" / cfg.model.name)
        self.output_dir = Path(D.broadcast_str(str(Path(out).resolve()), self.device))
        self.run_id = D.broadcast_str(uuid.uuid4().hex, self.device)
        if self.rank == 0:
            self.output_dir.mkdir(parents=True, exist_ok=True)

        data_dir = Path(cfg.data.path).expanduser() if cfg.data.path else self.output_dir / "data"
        if cfg.data.path is None and self.rank == 0:
            prepare_bundled(data_dir, cfg.data.val_every)
        D.barrier()
        self.data = DataModule(data_dir, tr.seq_len)
        self.model_cfg = B.resolve_vocab(cfg.model, self.data.vocab_size)
        p.validate_model(
            self.model_cfg.n_heads, self.model_cfg.n_kv_heads, self.model_cfg.vocab_size or 1
        )

        self.module = B.build_model(self.model_cfg, self.device, tr.seed)
        self.model = B.parallelize(self.module, p, self.pstate, cfg.fp8, tr.compile)
        self.tp_layout = TPLayout(
            mt_parallel.tp_shard_plan(self.module), self.pstate.rank("tp"), self.pstate.size("tp")
        )
        self.fp8_layers = B.fp8_layer_count(self.module)
        self.fp8_recipe = (
            mt_fp8.recipe_from_name(cfg.fp8.recipe, **dict(cfg.fp8.recipe_args))
            if cfg.fp8.enabled
            else None
        )
        self.optimizer = build_optimizer(self.module, cfg.optimizer, self.device.type)

        bf16 = tr.precision == "bf16" or (tr.precision == "auto" and self.device.type != "cpu")
        self.autocast_dtype = torch.bfloat16 if bf16 else None
        self.sampler = ResumableSampler(
            len(self.data.train), tr.seed, tr.global_batch_size, tr.micro_batch_size,
            self.dp_rank, self.dp_size,
        )  # fmt: skip
        self.flops_per_token = flops_per_token(self.model_cfg, tr.seq_len)
        self.peak_flops = self.ctx.device.capabilities().peak_bf16_flops
        self.step = 0
        self.lr_scale = 1.0
        self.rewinds = 0
        self._loss_ema: float | None = None

        ck = cfg.checkpoint
        self.ckpt_dir = Path(ck.dir).expanduser() if ck.dir else self.output_dir / "checkpoints"
        self.checkpointer = Checkpointer(
            self.ckpt_dir, self.rank, self.world_size, self.run_id, ck.keep_last, ck.async_save
        )
        resume = resolve_resume(ck.resume, self.ckpt_dir)
        if resume is not None:
            self.load(resume)
        elif ck.init_from is not None:
            reader = CheckpointReader(checkpoint_folder(Path(ck.init_from)))
            load_into(reader, self.module, None, self.rank, self.ctx.device, self.tp_layout)
        D.barrier()
        if ck.enabled or cfg.rewind.enabled:
            self.checkpointer.prepare()
        self.logger: MetricsLogger | None = None

    # ------------------------------------------------------------------ state
    def load(self, folder: Path) -> None:
        """Restore a checkpoint (any dp degree; see :mod:`mt_train.checkpoint.checkpointer`)."""
        reader = CheckpointReader(folder)
        load_into(reader, self.module, self.optimizer, self.rank, self.ctx.device, self.tp_layout)
        manifest = reader.manifest
        self.sampler.load_state_dict(manifest["data"])
        self.step = int(manifest["step"])
        self.lr_scale = float(manifest.get("lr_scale", 1.0))
        self.rewinds = int(manifest.get("rewinds", 0))

    def save(self) -> None:
        tensors = model_state(self.module, self.tp_layout)
        tensors.update(optimizer_state(self.module, self.optimizer, self.tp_layout))
        if self.dp_rank != 0:
            tensors = {}
        tensors.update(rng_state(self.rank, self.ctx.device))
        manifest = {
            "step": self.step,
            "config": dataclasses.asdict(self.cfg),
            "model": dataclasses.asdict(self.model_cfg),
            "data": self.sampler.state_dict(),
            "world_size": self.world_size,
            "parallel": {**dataclasses.asdict(self.cfg.parallel), "dp": self.dp},
            "tp_plan": self.tp_layout.plan,
            "lr_scale": self.lr_scale,
            "rewinds": self.rewinds,
            "fp8_state": sorted(k for k in self.module.state_dict() if "fp8" in k.lower()),
            "tokenizer": {"folder": str(self.data.folder), **self.data.train.meta},
        }
        self.checkpointer.save(self.step, tensors, manifest)

    # ------------------------------------------------------------------ steps
    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def micro_loss(self, batch: Batch) -> torch.Tensor:
        """Mean next-token cross-entropy of one micro-batch (fp32)."""
        with self._autocast():
            logits = self.model(batch.inputs)
        return self.module.loss(logits.float(), batch.targets)

    def train_step(self) -> dict[str, Any]:
        """One optimizer step (or a skipped one: ``metrics["event"]`` says why)."""
        micro = self.sampler.next_step()
        total = torch.zeros((), device=self.device)
        for m, indices in enumerate(micro):
            batch = self.data.train.collate(indices).to(self.device)
            with mt_parallel.accumulate(self.model, is_last=m == len(micro) - 1):
                loss = self.micro_loss(batch)
                (loss / len(micro)).backward()
            total += loss.detach()
        params = [p for p in self.module.parameters() if p.grad is not None]
        if self.cfg.parallel.data_parallel == "none":
            mt_parallel.all_reduce_gradients(params, self.dp_group)
        loss = D.mean_scalar(total / len(micro), self.dp_group).item()
        clip = self.cfg.optimizer.grad_clip
        norm = mt_parallel.clip_grad_norm_(params, clip, tp_group=self.tp_group).item()
        lr = self.cfg.optimizer.lr * lr_multiplier(
            self.step, self.cfg.trainer.max_steps, self.cfg.scheduler
        )
        lr *= self.lr_scale
        metrics: dict[str, Any] = {"loss": loss, "grad_norm": norm, "lr": lr}
        anomaly = self._anomaly(loss, norm)
        if anomaly is None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            if isinstance(self.fp8_recipe, mt_fp8.DelayedScaling):
                mt_fp8.update_fp8_scales(self.module, self.fp8_recipe, self.tp_group)
            self.step += 1
        else:
            metrics["event"] = anomaly
        self.optimizer.zero_grad(set_to_none=True)
        return metrics

    def _anomaly(self, loss: float, norm: float) -> str | None:
        if not (math.isfinite(loss) and math.isfinite(norm)):
            return f"non-finite loss {loss} or grad norm {norm}"
        rw, ema = self.cfg.rewind, self._loss_ema
        warm = self.step > self.cfg.scheduler.warmup_steps
        if rw.enabled and ema is not None and warm and loss > rw.spike_factor * ema:
            return f"loss spike {loss:.4f} > {rw.spike_factor} x running mean {ema:.4f}"
        self._loss_ema = loss if self._loss_ema is None else 0.9 * self._loss_ema + 0.1 * loss
        return None

    def rewind(self, reason: str) -> None:
        """Restore the newest checkpoint, keep the data position, cool the LR (see docstring)."""
        rw = self.cfg.rewind
        if not rw.enabled:
            raise FloatingPointError(f"step {self.step}: {reason} (rewind is off: rewind=default)")
        if self.rewinds >= rw.max_rewinds:
            raise FloatingPointError(
                f"step {self.step}: {reason}; gave up after {self.rewinds} rewinds"
            )
        self.checkpointer.wait()
        D.barrier()
        latest = resolve_resume("auto", self.ckpt_dir)
        if latest is None:
            raise FloatingPointError(f"step {self.step}: {reason}; no checkpoint to rewind to")
        consumed, rewinds = self.sampler.consumed, self.rewinds
        self.load(latest)
        self.sampler.consumed = consumed
        self.rewinds = rewinds + 1
        self.lr_scale *= rw.lr_cooldown
        self._loss_ema = None

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over ``eval_batches`` fixed validation micro-batches per rank."""
        tr = self.cfg.trainer
        sampler = ResumableSampler(
            len(self.data.val), tr.seed, tr.micro_batch_size * self.dp_size * tr.eval_batches,
            tr.micro_batch_size, self.dp_rank, self.dp_size, shuffle=False,
        )  # fmt: skip
        self.model.eval()
        total = torch.zeros((), device=self.device)
        micro = sampler.next_step()
        for indices in micro:
            total += self.micro_loss(self.data.val.collate(indices).to(self.device))
        self.model.train()
        return D.mean_scalar(total / len(micro), self.dp_group).item()

    def generate(self, prompt: str, max_new_tokens: int) -> str:
        """Greedy continuation of ``prompt`` (tp=1 only: sampling has no TP path yet)."""
        if self.tp_layout.size > 1:
            return ""
        ids = self.data.tokenizer.encode(prompt)
        with self._autocast():
            out = greedy_generate(
                self.module, ids, max_new_tokens, self.cfg.trainer.seq_len, self.device
            )
        return self.data.tokenizer.decode(out)

    # ------------------------------------------------------------------ loop
    def fit(self) -> TrainSummary:
        """Train to ``trainer.max_steps``; evaluate, checkpoint and log on their intervals."""
        tr, ck = self.cfg.trainer, self.cfg.checkpoint
        is_main = self.rank == 0
        if is_main:
            print(self.describe(), file=sys.stderr, flush=True)
        self.logger = MetricsLogger(
            self.cfg.logging, self.output_dir, tr.max_steps, self.step, is_main
        )
        tokens_per_step = tr.global_batch_size * tr.seq_len
        losses: list[float] = []
        train_loss = val_loss = float("nan")
        start = last_log = time.perf_counter()
        steps_since_log = tokens_total = 0
        while self.step < tr.max_steps:
            metrics = self.train_step()
            if "event" in metrics:
                self.logger.log(self.step, metrics, kind="anomaly")
                self.rewind(metrics["event"])
                self.logger.log(self.step, {"event": f"rewound to step {self.step}"}, kind="rewind")
                continue
            losses.append(metrics["loss"])
            train_loss = metrics["loss"]
            steps_since_log += 1
            tokens_total += tokens_per_step
            self.logger.advance()
            step = self.step
            if step % tr.log_interval == 0 or step == tr.max_steps:
                self.ctx.device.synchronize()
                now = time.perf_counter()
                tps = steps_since_log * tokens_per_step / (now - last_log)
                metrics["tok/s"] = tps
                if self.peak_flops:
                    metrics["mfu"] = (
                        self.flops_per_token * tps / (self.peak_flops * self.world_size)
                    )
                mem = self.ctx.device.memory_stats().get("peak_allocated", 0)
                metrics["mem_gib"] = mem / 2**30
                self.logger.log(step, metrics)
                last_log, steps_since_log = now, 0
            if step % tr.eval_interval == 0 or step == tr.max_steps:
                val_loss = self.evaluate()
                self.logger.log(step, {"val_loss": val_loss}, kind="eval")
            if (ck.enabled or self.cfg.rewind.enabled) and (
                step % tr.checkpoint_interval == 0 or step == tr.max_steps
            ):
                self.save()
        self.checkpointer.wait()
        wall = time.perf_counter() - start
        if math.isnan(val_loss):
            val_loss = self.evaluate()
        sample = self.generate(tr.sample_prompt, tr.sample_tokens) if tr.sample_tokens > 0 else ""
        self.logger.close()
        latest = resolve_resume("auto", self.ckpt_dir) if ck.enabled else None
        return TrainSummary(
            steps=self.step,
            train_loss=train_loss,
            val_loss=val_loss,
            wall_s=wall,
            tokens_per_s=tokens_total / wall if wall > 0 else 0.0,
            output_dir=str(self.output_dir),
            checkpoint=str(latest) if latest else None,
            losses=losses,
            rewinds=self.rewinds,
            sample=sample,
        )

    def describe(self) -> str:
        c, tr, p = self.model_cfg, self.cfg.trainer, self.cfg.parallel
        precision = "bf16 autocast" if self.autocast_dtype else "fp32"
        fp8 = f", fp8 {self.cfg.fp8.recipe} ({self.fp8_layers} linears)" if self.fp8_layers else ""
        return (
            f"mt-train: {c.name} Llama, {num_params(self.module) / 1e6:.2f}M params "
            f"({c.n_layers} layers, width {c.dim}, vocab {c.vocab_size}) on {self.world_size}x "
            f"{self.ctx.device.name} [dp={self.dp} tp={p.tp}], {precision}{fp8}; "
            f"{tr.max_steps} steps of {tr.global_batch_size}x{tr.seq_len} tokens; "
            f"data {self.data.folder} ({len(self.data.train)} train / {len(self.data.val)} val "
            f"sequences); output {self.output_dir}"
            + (f"; resumed at step {self.step}" if self.step else "")
        )

    def close(self) -> None:
        """Finish pending saves and release the parallel groups (the process group stays)."""
        self.checkpointer.close()
        if self.logger is not None:
            self.logger.close()
        with contextlib.suppress(RuntimeError):
            mt_comm.destroy_parallel_state()
