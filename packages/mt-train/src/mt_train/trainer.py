"""The training loop as a class: build everything from a :class:`TrainConfig`, then ``fit()``.

One optimizer step (``A`` micro-batches per rank, ``A = G / (b·dp)``)::

    for m < A:  loss_m = CE(model(x_m), y_m);  backward(loss_m / A)      (autocast if bf16)
    grads ← mean over dp×cp ranks        (DDP / FSDP2 at the last micro-batch, ZeRO-1's
                                          reduce-scatter, or a flat all-reduce with ``none``)
    n = ‖grads‖₂ (every element once: TP shards summed, FSDP2 / ZeRO-1 pieces summed over dp×cp)
    if clip > 0: grads ← grads · min(1, clip / n)    (fused AdamW and ZeRO-1: inside the update)
    verdict = detectors(loss, n, FP8 health) agreed over all ranks          (mt_train.rewind)
    if healthy:  lr = peak · schedule(step) · cooldown(step);  AdamW step
    zero grads

The loss, the local loss and ``n`` reach the host in one synchronisation per step. With fused
AdamW (the default on accelerators) the clip is the kernel's ``grad_scale`` divisor
``max(1, (n + 1e-6) / clip)`` rather than a separate pass over every gradient.

Context parallelism (``parallel.cp > 1``). The ``cp`` ranks of one dp index draw the same
samples; each keeps its load-balanced part of the inputs, targets and document ids
(``mt_parallel.shard_sequence``: chunks ``r`` and ``2·cp−1−r`` of ``2·cp``) and passes the
global positions of those tokens to the model. Every rank holds ``T/cp`` tokens of each
sample, so its mean loss averaged over dp×cp is the mean over the global batch, and DDP /
FSDP2 / ZeRO-1 averaging gradients over dp×cp gives that loss's gradient.

Document masking (``data.document_masking``): batches carry per-token document ids and
attention stays inside each packed document (:mod:`mt_train.data.dataset`).

RNG: ``mt_parallel.manual_seed(seed, tp_rank, cp_rank)`` seeds the default generators (the
same on every TP rank, different per CP rank) and the tracker stream that TP-sharded regions
(attention dropout, sequence-parallel residual dropout) draw from; checkpoints and snapshots
hold both, so a resumed run draws the same dropout masks.

The reported loss is the mean over the global batch. An anomalous step is never applied:
with ``rewind`` off a non-finite loss or norm stops the run; with it on the trainer restores
the newest stable checkpoint (from memory or disk), skips data, cools the LR and carries on
(:mod:`mt_train.rewind.manager`). A SIGTERM/SIGINT ends the run after the step in progress
with a checkpoint (:mod:`mt_train.rewind.preemption`).

Invariant for exact resume: the full state is (parameters, AdamW state — this rank's pieces
under FSDP2 / ZeRO-1 —, FP8 scaling state, sampler ``consumed`` and skipped ranges, step, RNG
generators and tracker, and the rewind policy's state: baselines, history, cool-down); all of
it is checkpointed, and nothing else carries information between steps, so on the CPU a
resumed run (same layout) repeats the uninterrupted loss curve bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import mt_comm
import mt_fp8
import mt_parallel
from mt_train import distributed as D
from mt_train.checkpoint.checkpointer import (
    Checkpointer,
    TPLayout,
    load_into,
    resolve_resume,
    shard_tensors,
)
from mt_train.checkpoint.files import CheckpointReader, discard, step_dir
from mt_train.checkpoint.state import StateLayout, live_state
from mt_train.config.schema import TrainConfig
from mt_train.convert import checkpoint_folder
from mt_train.cuda_graph import StepGraph, cuda_graph_blockers
from mt_train.data.dataset import Batch, DataModule, ResumableSampler
from mt_train.data.prepare import prepare_bundled
from mt_train.metrics import MetricsLogger
from mt_train.models import build as B
from mt_train.models.llama import flops_per_token, num_params
from mt_train.optim import Zero1AdamW, build_optimizer, lr_multiplier
from mt_train.rewind import snapshot as snap
from mt_train.rewind.consensus import Verdict
from mt_train.rewind.detectors import StepSignals
from mt_train.rewind.events import EVENTS_FILE, EventLog
from mt_train.rewind.faults import FaultInjector
from mt_train.rewind.manager import RewindManager
from mt_train.rewind.preemption import StopRequest
from mt_train.rewind.recovery import Recovery, fired_faults
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
    stopped: str | None = None
    """The signal that ended the run early (preemption), or None."""


class Trainer:
    """Builds the run (distributed init, data, model, optimizer, checkpoints) and trains it."""

    def __init__(self, cfg: TrainConfig, output_dir: str | Path | None = None) -> None:
        self.cfg = cfg
        tr = cfg.trainer
        self.ctx = mt_comm.init_distributed(device=tr.device)
        self.rank, self.world_size = self.ctx.rank, self.ctx.world_size
        self.device = self.ctx.torch_device
        self.dp = cfg.check_world(self.world_size)
        p = cfg.parallel
        with contextlib.suppress(RuntimeError):
            mt_comm.destroy_parallel_state()
        self.pstate = mt_comm.init_parallel_state(dp=self.dp, cp=p.cp, tp=p.tp, pp=p.pp, ep=p.ep)
        self.tp_group, self.cp_group = self.pstate.group("tp"), self.pstate.group("cp")
        self.dp_cp_group = self.pstate.group("dp_cp")
        self.dp_rank, self.dp_size = self.pstate.rank("dp"), self.pstate.size("dp")
        self.dp_cp_rank = self.pstate.rank("dp_cp")
        self.seed_rng(tr.seed)

        out = str(output_dir or tr.output_dir or Path.cwd() / "outputs" / cfg.model.name)
        self.output_dir = Path(D.broadcast_str(str(Path(out).resolve()), self.device))
        self.run_id = D.broadcast_str(uuid.uuid4().hex, self.device)
        if self.rank == 0:
            self.output_dir.mkdir(parents=True, exist_ok=True)

        data_dir = Path(cfg.data.path).expanduser() if cfg.data.path else self.output_dir / "data"
        if cfg.data.path is None and self.rank == 0:
            prepare_bundled(data_dir, cfg.data.val_every)
        D.barrier()
        self.data = DataModule(data_dir, tr.seq_len, train_stride=self.train_stride)
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
        self.optimizer = build_optimizer(
            self.module, cfg.optimizer, self.device.type, p.data_parallel, self.dp_cp_group,
            self.tp_group,
        )  # fmt: skip
        self.state_layout = StateLayout.of(self.module, self.optimizer)

        bf16 = tr.precision == "bf16" or (tr.precision == "auto" and self.device.type != "cpu")
        self.autocast_dtype = torch.bfloat16 if bf16 else None
        self.sampler = ResumableSampler(
            len(self.data.train), tr.seed, tr.global_batch_size, tr.micro_batch_size,
            self.dp_rank, self.dp_size, independent=self.independent_draws,
        )  # fmt: skip
        self.flops_per_token = flops_per_token(self.model_cfg, tr.seq_len)
        self.peak_flops = self.ctx.device.capabilities().peak_bf16_flops
        self.step = 0
        self.stopped: str | None = None
        self.verdict = Verdict()
        self._stop = StopRequest()
        self._last_save: int | None = None
        self._resumed_from: Path | None = None
        self.events = EventLog(self.output_dir / EVENTS_FILE if self.rank == 0 else None)
        self.guard = RewindManager(cfg.rewind, self.events, self.device)
        self.faults = self._build_faults()

        ck = cfg.checkpoint
        self.ckpt_dir = Path(ck.dir).expanduser() if ck.dir else self.output_dir / "checkpoints"
        self.checkpointer = Checkpointer(
            self.ckpt_dir, self.rank, self.world_size, self.run_id, ck.keep_last, ck.async_save
        )
        self.recovery = Recovery(self.ckpt_dir, self.rank, self.device, self.events)
        self.faults.corrupt_at_start(self.ckpt_dir)
        self.checkpointer.restore_replaced()
        D.barrier()
        resume = self.recovery.find_resume(ck.resume)
        if resume is not None:
            self.load(resume)
        elif ck.init_from is not None:
            reader = CheckpointReader(checkpoint_folder(Path(ck.init_from)))
            load_into(reader, self.module, None, self.state_layout, self.tp_layout, self.ctx.device)
            if isinstance(self.optimizer, Zero1AdamW):
                self.optimizer.sync_master()
        D.barrier()
        if ck.enabled or cfg.rewind.enabled:
            self.checkpointer.prepare()
        self.logger: MetricsLogger | None = None
        self.step_graph: StepGraph | None = None
        self._graph_warm = False
        if tr.cuda_graph:
            blockers = cuda_graph_blockers(
                self.device.type, p.tp, p.cp, p.pp, self.model_cfg.dropout, p.data_parallel,
                self.pstate.size("dp_cp"),
            )  # fmt: skip
            if blockers:
                raise ValueError(
                    "trainer.cuda_graph=true cannot capture this run's step: "
                    + "; ".join(blockers)
                    + " (mt_train.cuda_graph lists what a captured step needs)"
                )

    def _build_faults(self) -> FaultInjector:
        """The fault injector, with the one-shot faults already recorded in this run disarmed."""
        fault = self.cfg.fault
        fired = fired_faults(self.output_dir, self.rank, self.device)
        bad: list[int] = []
        if fault.bad_batch_at_step is not None:
            G = self.cfg.trainer.global_batch_size
            order = ResumableSampler(
                len(self.data.train), self.cfg.trainer.seed, G, G,
                independent=self.independent_draws,
            )  # fmt: skip
            order.consumed = (fault.bad_batch_at_step - 1) * G
            bad = order.next_step()[0].tolist()
        injector = FaultInjector(fault, self.rank, fired, bad, self.events)
        if fault.fp8_overflow_at_step is not None:
            injector.install_fp8_hooks(self.module)
        return injector

    @property
    def independent_draws(self) -> bool:
        """``data.sampling=random``: independent draws over windows at every token."""
        return self.cfg.data.sampling == "random"

    @property
    def train_stride(self) -> int | None:
        """Token stride between training windows: 1 for ``data.sampling=random``, else the
        sequence length (non-overlapping windows)."""
        return 1 if self.independent_draws else None

    # ------------------------------------------------------------------ state
    def seed_rng(self, seed: int) -> None:
        """Seed the default generators and mt_parallel's RNG tracker for this rank's TP and CP
        coordinates (``mt_parallel.manual_seed``), and the device's generator alike."""
        mt_parallel.manual_seed(seed, self.pstate.rank("tp"), self.pstate.rank("cp"))
        self.ctx.device.manual_seed(torch.initial_seed())

    def layout(self) -> dict[str, int]:
        """What RNG states depend on: the world size and the tp, cp, dp degrees."""
        p = self.cfg.parallel
        return {"world_size": self.world_size, "tp": p.tp, "cp": p.cp, "dp": self.dp}

    def load(self, folder: Path) -> None:
        """Restore a checkpoint (any layout; see :mod:`mt_train.checkpoint.checkpointer`).

        RNG states come back only into the layout that saved them; at another layout each
        rank re-seeds from (seed + step) with its own TP and CP coordinates."""
        reader = CheckpointReader(folder)
        manifest = reader.manifest
        saved = {"world_size": manifest["world_size"], **manifest["parallel"]}
        same = all(saved.get(k) == v for k, v in self.layout().items())
        load_into(
            reader, self.module, self.optimizer, self.state_layout, self.tp_layout,
            self.ctx.device, self.rank if same else None,
        )  # fmt: skip
        if not same:
            self.seed_rng(self.cfg.trainer.seed + int(manifest["step"]))
        snap.after_load(self.module)
        self.sampler.load_state_dict(manifest["data"])
        self.step = int(manifest["step"])
        self.guard.load_state_dict(manifest.get("rewind", {}))
        self.recovery.load_decisions(self.sampler, self.guard)
        self._resumed_from = folder
        self.drop_step_graph()
        self.events.emit("resume", self.step, path=str(folder))

    def save(self) -> None:
        """Checkpoint the current step; with rewind on it also becomes a rewind target (held
        in memory too with ``rewind.memory_snapshots``)."""
        rw = self.cfg.rewind
        hold = rw.enabled and rw.memory_snapshots
        local = (
            snap.capture(self.module, self.optimizer, self.ctx.device)
            if hold
            else live_state(self.module, self.optimizer, self.ctx.device)
        )
        tensors = shard_tensors(
            local, self.state_layout, self.tp_layout, self.rank, self.dp_cp_rank
        )
        manifest = {
            "step": self.step,
            "config": dataclasses.asdict(self.cfg),
            "model": dataclasses.asdict(self.model_cfg),
            "data": self.sampler.state_dict(),
            "world_size": self.world_size,
            "parallel": {**dataclasses.asdict(self.cfg.parallel), "dp": self.dp},
            "tp_plan": self.tp_layout.plan,
            "sharded_shapes": self.state_layout.shapes,
            "rewind": self.guard.state_dict(),
            "fp8_state": sorted(k for k in self.module.state_dict() if "fp8" in k.lower()),
            "tokenizer": {"folder": str(self.data.folder), **self.data.train.meta},
        }
        protect = frozenset(self.guard.targets.protected | {self.step})
        self.checkpointer.save(self.step, tensors, manifest, copy=not hold, protect=protect)
        self._last_save = self.step
        self.guard.add_target(
            snap.Target(
                self.step,
                self.sampler.consumed,
                path=step_dir(self.ckpt_dir, self.step),
                host=local if hold else None,
            )
        )

    def _start_targets(self) -> None:
        """Rewind targets a fit starts with: its starting state, and after a resume the
        older checkpoints that manifest knew to be stable."""
        rw = self.cfg.rewind
        if not rw.enabled or self.guard.targets.items:
            return
        if self._resumed_from is not None:
            manifest = CheckpointReader(self._resumed_from).manifest
            for step in manifest.get("rewind", {}).get("stable", []):
                folder = step_dir(self.ckpt_dir, step)
                if step < self.step and (folder / "manifest.json").is_file():
                    self.guard.add_target(snap.Target(step, -1, path=folder, stable=True))
        host = (
            snap.capture(self.module, self.optimizer, self.ctx.device)
            if rw.memory_snapshots
            else None
        )
        self.guard.add_target(
            snap.Target(self.step, self.sampler.consumed, path=self._resumed_from, host=host)
        )

    # ------------------------------------------------------------------ steps
    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def micro_loss(self, batch: Batch) -> torch.Tensor:
        """Mean next-token cross-entropy over this rank's tokens of one micro-batch (fp32):
        all of them, or under CP its load-balanced part (module docstring)."""
        inputs, targets, docs = batch.inputs, batch.targets, batch.document_ids
        positions = None
        cp = self.cfg.parallel.cp
        if cp > 1:
            seq_len = inputs.shape[1]
            inputs, targets, docs = (
                None if x is None else mt_parallel.shard_sequence(x, 1, self.cp_group)
                for x in (inputs, targets, docs)
            )
            cp_rank = self.pstate.rank("cp")
            positions = mt_parallel.load_balanced_positions(seq_len, cp, cp_rank).to(self.device)
        with self._autocast():
            logits = self.model(inputs, positions, docs)
        # The loss upcasts the (bf16) logits to fp32 a chunk at a time and returns their gradient
        # in their dtype: no fp32 copy of the (tokens × vocab) logits is ever materialised.
        return self.module.loss(logits, targets)

    def collate(self, dataset: Any, indices: Any) -> Batch:
        """A micro-batch on this rank's device (with document ids if masking is on)."""
        return dataset.collate(indices, self.cfg.data.document_masking).to(self.device)

    def forward_backward(
        self, batches: list[Batch], loss_factors: list[float] | None = None
    ) -> torch.Tensor:
        """Forward and backward of one step's micro-batches (gradients accumulate, each loss
        divided by their count, times its fault factor if any); returns the summed loss."""
        total = torch.zeros((), device=self.device)
        for m, batch in enumerate(batches):
            with mt_parallel.accumulate(self.model, is_last=m == len(batches) - 1):
                loss = self.micro_loss(batch)
                if loss_factors is not None and loss_factors[m] != 1.0:
                    loss = loss * loss_factors[m]
                (loss / len(batches)).backward()
            total += loss.detach()
        return total

    def _graphed_forward_backward(
        self, batches: list[Batch], grad_norm: Callable[[list[nn.Parameter]], torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward_backward` by CUDA-graph replay (:mod:`mt_train.cuda_graph`): eager
        the first time (warm-up), captured the next, replayed after. Returns the summed loss and
        the captured ``grad_norm`` of the gradients (None when not captured, or eager)."""
        if not self._graph_warm:
            self._graph_warm = True
            return self.forward_backward(batches), None
        if self.step_graph is None:
            params = [p for p in self.module.parameters() if p.requires_grad]
            self.step_graph = StepGraph.capture(self.forward_backward, batches, params, grad_norm)
        return self.step_graph.run(batches), self.step_graph.norm

    @property
    def watch_fp8(self) -> bool:
        """Whether steps read the FP8 health counters (for the ``fp8_overflow`` detector)."""
        rewind = self.cfg.rewind
        return self.fp8_layers > 0 and rewind.enabled and "fp8_overflow" in rewind.detectors

    def drop_step_graph(self) -> None:
        """Forget the captured step (after the model or its state was replaced or reloaded);
        the next step captures again."""
        self.step_graph = None

    def train_step(self) -> dict[str, Any]:
        """One optimizer step, or an anomalous one that is not applied (``self.verdict`` and
        ``metrics["event"]`` say why)."""
        faults = self.faults.begin_step(self.step + 1)
        if self.watch_fp8:
            mt_fp8.reset_fp8_health(self.module)
        micro = self.sampler.next_step()
        batches = [self.collate(self.data.train, indices) for indices in micro]
        factors = [faults.loss * self.faults.micro_loss_factor(indices) for indices in micro]
        clean = all(f == 1.0 for f in factors) and faults.fp8_inputs == 1.0
        clip = self.cfg.optimizer.grad_clip
        zero1 = isinstance(self.optimizer, Zero1AdamW)
        # The fused AdamW kernels (PyTorch's and mt_fp8.FusedAdamW) divide the gradients by
        # ``optimizer.grad_scale`` inside their pass (the hook GradScaler uses), so clipping
        # costs no pass of its own over the gradients.
        clip_in_update = (
            not zero1
            and clip > 0
            and (
                isinstance(self.optimizer, mt_fp8.FusedAdamW)
                or bool(self.optimizer.defaults.get("fused"))
            )
        )

        def grad_norm(params: list[nn.Parameter]) -> torch.Tensor:
            return mt_parallel.clip_grad_norm_(
                params,
                0.0 if clip_in_update else clip,
                tp_group=self.tp_group,
                dp_cp_group=self.dp_cp_group,
            )

        graph_norm = None
        if self.cfg.trainer.cuda_graph and clean:
            # The norm joins the graph when nothing runs between the backward and it.
            capturable = not zero1 and self.pstate.size("dp_cp") == 1
            total, graph_norm = self._graphed_forward_backward(
                batches, grad_norm if capturable else None
            )
        else:
            total = self.forward_backward(batches, factors)
        params = [p for p in self.module.parameters() if p.grad is not None]
        if self.cfg.parallel.data_parallel == "none":
            mt_parallel.all_reduce_gradients(params, self.dp_cp_group)
        if faults.grads != 1.0:
            graph_norm = None  # the fault changed the gradients after the graph's norm
            for p in params:
                p.grad.mul_(faults.grads)
        if zero1:  # reduce-scatter now; clip and update in apply_update() once judged healthy
            norm_t = self.optimizer.reduce_gradients()
        elif graph_norm is not None:
            norm_t = graph_norm
        else:
            norm_t = grad_norm(params)
        mean_loss = D.mean_scalar(total / len(micro), self.dp_cp_group)
        # One host synchronisation per step for the numbers the detectors judge (with FP8 health
        # watched, also the worst saturated fraction and its place, summarised on the device).
        judged = [(total / len(micro)).double(), mean_loss.double(), norm_t.double()]
        places: list[str] = []
        if self.watch_fp8:
            saturation, places = mt_fp8.fp8_saturation_summary(self.module)
            judged += saturation.unbind()
        local_loss, loss, norm, *fp8_worst = torch.stack(judged).tolist()
        lr = self.cfg.optimizer.lr * lr_multiplier(
            self.step, self.cfg.trainer.max_steps, self.cfg.scheduler
        )
        lr *= self.guard.lr_factor(self.step)
        metrics: dict[str, Any] = {"loss": loss, "grad_norm": norm, "lr": lr}
        signals = StepSignals(loss, norm, local_loss)
        if self.watch_fp8:
            worst, place = fp8_worst
            signals.fp8_saturation = worst
            signals.fp8_worst = places[int(place)] if worst > 0 else ""
            metrics["fp8_saturated"] = worst
        self.signals = signals
        self.verdict = self.guard.judge(self.step, signals, self._stop.requested)
        if not self.verdict.anomalous:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            if zero1:
                self.optimizer.apply_update(clip)
            elif clip_in_update:
                # torch.nn.utils.clip_grad_norm_'s coefficient min(1, clip / (norm + 1e-6)),
                # applied as its reciprocal divisor.
                self.optimizer.grad_scale = torch.clamp((norm_t + 1e-6) / clip, min=1.0)
                self.optimizer.step()
                del self.optimizer.grad_scale
            else:
                self.optimizer.step()
            if isinstance(self.fp8_recipe, mt_fp8.DelayedScaling):
                mt_fp8.update_fp8_scales(self.module, self.fp8_recipe, self.tp_group)
            self.step += 1
            self.guard.accept(self.step, signals)
        else:
            metrics["event"] = self.verdict.detector
        self.optimizer.zero_grad(set_to_none=True)
        return metrics

    def rewind(self, verdict: Verdict) -> None:
        """Go back to the newest stable target and skip data (:mod:`mt_train.rewind.manager`)."""
        if not self.cfg.rewind.enabled:
            s = self.signals
            raise FloatingPointError(
                f"step {self.step}: non-finite loss {s.loss} or grad norm {s.grad_norm} "
                "(rewind is off: rewind=default turns it on)"
            )
        self.checkpointer.wait()
        anomaly_at = self.step
        draws = self.sampler.last_draws
        for target in self.guard.plan(anomaly_at, verdict):
            source = self._restore(target)
            if source is not None:
                break
        else:
            raise self.guard.give_up(anomaly_at, verdict, "no readable checkpoint to rewind to")
        self.drop_step_graph()
        skipped = self.guard.skip_range(target, draws)
        self.sampler.consumed = target.consumed
        if skipped is not None:
            self.sampler.skip(*skipped)
        self.step = target.step
        # The restored state is on disk already (if the target has a folder); what the rewind
        # decided goes to the decisions file below, so a stop right now need not save again.
        self._last_save = target.step if target.path is not None else None
        dropped = self.guard.commit(
            anomaly_at, verdict, target, source, skipped, self.cfg.trainer.global_batch_size
        )
        if self.rank == 0:
            discard(self.ckpt_dir, [t.step for t in dropped if t.path is not None])
        self.recovery.save_decisions(self.sampler, self.guard)
        if self.logger is not None:
            self.logger.set_step(self.step)

    def _restore(self, target: snap.Target) -> str | None:
        """Load ``target`` (memory if held, else disk after verifying); its source, or None
        when its disk copy is rejected."""
        if target.host is not None:
            snap.restore(target.host, self.module, self.optimizer, self.ctx.device)
            return "memory"
        if target.path is None:
            return None
        reason = self.recovery.verify(target.path)
        if reason is not None:
            self.recovery.reject(target.path, reason)
            self.guard.targets.drop(target)
            return None
        reader = CheckpointReader(target.path)
        load_into(
            reader, self.module, self.optimizer, self.state_layout, self.tp_layout,
            self.ctx.device, self.rank,
        )  # fmt: skip
        snap.after_load(self.module)
        target.consumed = int(reader.manifest["data"]["consumed"])
        return "disk"

    def _preempt(self, signal_name: str | None) -> None:
        """A stop signal reached some rank: checkpoint this step (if checkpoints are on)."""
        saved = None
        if self.cfg.checkpoint.enabled or self.cfg.rewind.enabled:
            if self._last_save != self.step:
                self.save()
            self.checkpointer.wait()
            saved = str(step_dir(self.ckpt_dir, self.step))
        self.stopped = signal_name or "a signal on another rank"
        self.events.emit("preempted", self.step, signal=self.stopped, checkpoint=saved)

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
            total += self.micro_loss(self.collate(self.data.val, indices))
        self.model.train()
        # The FP8 weights quantized here would otherwise stay cached until the next eager
        # forward, i.e. for the whole run when the steps are replayed CUDA graphs.
        mt_fp8.clear_fp8_weight_caches(self.module)
        return D.mean_scalar(total / len(micro), self.dp_cp_group).item()

    def generate(self, prompt: str, max_new_tokens: int) -> str:
        """Greedy continuation of ``prompt``, the same on every rank (all ranks run the
        forward: TP, CP and FSDP2 layers communicate; see :mod:`mt_train.sample`)."""
        p = self.cfg.parallel
        ids = self.data.tokenizer.encode(prompt)
        with self._autocast():
            out = greedy_generate(
                self.module, ids, max_new_tokens, self.cfg.trainer.seq_len, self.device,
                tp_group=self.tp_group, cp_group=self.cp_group,
                sequence_parallel=p.sequence_parallel,
            )  # fmt: skip
        return self.data.tokenizer.decode(out)

    # ------------------------------------------------------------------ loop
    def fit(self) -> TrainSummary:
        """Train to ``trainer.max_steps``; evaluate, checkpoint and log on their intervals,
        rewind on anomalies, stop early (with a checkpoint) on SIGTERM/SIGINT."""
        tr, ck = self.cfg.trainer, self.cfg.checkpoint
        is_main = self.rank == 0
        if is_main:
            print(self.describe(), file=sys.stderr, flush=True)
        self.logger = MetricsLogger(
            self.cfg.logging, self.output_dir, tr.max_steps, self.step, is_main
        )
        self.events.echo = self.logger.write
        self._start_targets()
        tokens_per_step = tr.global_batch_size * tr.seq_len
        losses: list[float] = []
        self._val_loss = float("nan")
        train_loss = float("nan")
        start = self._last_log = time.perf_counter()
        self._steps_since_log = tokens_total = 0
        with self._stop:
            while self.step < tr.max_steps:
                metrics = self.train_step()
                if self.verdict.anomalous:
                    self.logger.log(self.step, metrics, kind="anomaly")
                    self.rewind(self.verdict)
                    self.logger.log(
                        self.step, {"event": f"rewound to step {self.step}"}, kind="rewind"
                    )
                else:
                    losses.append(metrics["loss"])
                    train_loss = metrics["loss"]
                    tokens_total += tokens_per_step
                    self._after_step(metrics, tokens_per_step)
                if self.verdict.stop:
                    self._preempt(self._stop.signal_name)
                    break
        self.checkpointer.wait()
        wall = time.perf_counter() - start
        val_loss = self._val_loss
        if math.isnan(val_loss) and self.stopped is None:
            val_loss = self.evaluate()
        sample = (
            self.generate(tr.sample_prompt, tr.sample_tokens)
            if tr.sample_tokens > 0 and self.stopped is None
            else ""
        )
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
            rewinds=self.guard.rewinds,
            sample=sample,
            stopped=self.stopped,
        )

    def _after_step(self, metrics: dict[str, Any], tokens_per_step: int) -> None:
        """Log, evaluate and checkpoint on their intervals after a healthy step."""
        assert self.logger is not None
        tr, step = self.cfg.trainer, self.step
        self._steps_since_log += 1
        self.logger.advance()
        if step % tr.log_interval == 0 or step == tr.max_steps:
            self.ctx.device.synchronize()
            now = time.perf_counter()
            tps = self._steps_since_log * tokens_per_step / (now - self._last_log)
            metrics["tok/s"] = tps
            if self.peak_flops:
                metrics["mfu"] = self.flops_per_token * tps / (self.peak_flops * self.world_size)
            mem = self.ctx.device.memory_stats().get("peak_allocated", 0)
            metrics["mem_gib"] = mem / 2**30
            self.logger.log(step, metrics)
            self._last_log, self._steps_since_log = now, 0
        if step % tr.eval_interval == 0 or step == tr.max_steps:
            self._val_loss = self.evaluate()
            self.logger.log(step, {"val_loss": self._val_loss}, kind="eval")
        if (self.cfg.checkpoint.enabled or self.cfg.rewind.enabled) and (
            step % tr.checkpoint_interval == 0 or step == tr.max_steps
        ):
            self.save()

    def describe(self) -> str:
        c, tr, p = self.model_cfg, self.cfg.trainer, self.cfg.parallel
        precision = "bf16 autocast" if self.autocast_dtype else "fp32"
        fp8 = f", fp8 {self.cfg.fp8.recipe} ({self.fp8_layers} linears)" if self.fp8_layers else ""
        sp = "+sp" if p.sequence_parallel else ""
        cp_attention = f", cp {p.cp_attention}" if p.cp > 1 else ""
        docs = ", document masking" if self.cfg.data.document_masking else ""
        return (
            f"mt-train: {c.name} Llama, {num_params(self.module) / 1e6:.2f}M params "
            f"({c.n_layers} layers, width {c.dim}, vocab {c.vocab_size}) on {self.world_size}x "
            f"{self.ctx.device.name} [dp={self.dp} cp={p.cp} tp={p.tp}{sp}, "
            f"{p.data_parallel}{cp_attention}], {precision}{fp8}{docs}; "
            f"{tr.max_steps} steps of {tr.global_batch_size}x{tr.seq_len} tokens; "
            f"data {self.data.folder} ({len(self.data.train)} train / {len(self.data.val)} val "
            f"sequences); output {self.output_dir}"
            + (f"; resumed at step {self.step}" if self.step else "")
        )

    def close(self) -> None:
        """Finish pending saves and release the parallel groups (the process group stays)."""
        self.drop_step_graph()
        self.checkpointer.close()
        if self.logger is not None:
            self.logger.close()
        with contextlib.suppress(RuntimeError):
            mt_comm.destroy_parallel_state()
