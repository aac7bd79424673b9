"""The training loop as a class: build everything from a :class:`TrainConfig`, then ``fit()``.

One optimizer step (``A`` micro-batches per rank, ``A = G / (b·dp)``)::

    for m < A:  loss_m = CE(model(x_m), y_m);  backward(loss_m / A)      (autocast if bf16)
    grads ← mean over dp×cp ranks        (DDP / FSDP2 at the last micro-batch, ZeRO-1's
                                          reduce-scatter, or a flat all-reduce with ``none``)
    n = ‖grads‖₂ (every element once: TP shards summed, FSDP2 / ZeRO-1 pieces summed over dp×cp)
    if clip > 0: grads ← grads · min(1, clip / n)    (fused AdamW and ZeRO-1: inside the update)
    verdict = detectors(loss, n, FP8 health) agreed over all ranks          (mt_train.rewind)
    if healthy:  lr = peak · schedule(step) · cooldown(step);  AdamW step
                 MoE aux-loss-free biases moved from the step's global expert counts
    zero grads

The loss, the local loss, ``n`` and the model's extra values reach the host in one
synchronisation per step. With fused AdamW (the default on accelerators) the clip is the
kernel's ``grad_scale`` divisor ``max(1, (n + 1e-6) / clip)`` rather than a separate pass over
every gradient (:mod:`mt_train.update`).

The trainer composes parts through narrow interfaces and knows no model family:

* data: :func:`~mt_train.data.setup.open_training_data` (a data module and this rank's
  sampler); MoE expert load: :class:`~mt_train.expert_load.ExpertLoadLog`;
* model and parallelism: the config's family builds the plain model
  (:mod:`mt_train.models`), :func:`mt_parallel.parallelize` applies the family's plan;
* the step: :class:`~mt_train.step.EagerStep`, :class:`~mt_train.cuda_graph.GraphedStep` or,
  with ``parallel.pp > 1``, :class:`~mt_train.pipeline_step.PipelineStep` (``run(batches,
  ...) -> StepResult``), over a :class:`~mt_train.step.BatchRunner`;
* the update policy (:mod:`mt_train.update`): ZeRO-1's split step, the clip folded into a
  fused AdamW, or clip then step;
* state: :class:`~mt_train.run_state.RunState` (checkpoints, resume, rewind); anomaly
  judgement: :class:`~mt_train.rewind.manager.RewindManager`; fault drills:
  :func:`~mt_train.rewind.faults.fault_injector`; metrics: :class:`~mt_train.metrics.MetricsLogger`.

RNG: ``mt_parallel.manual_seed(seed, tp_rank, cp_rank)`` seeds the default generators (the
same on every TP rank, different per CP rank) and the tracker stream that TP-sharded regions
(attention dropout, sequence-parallel residual dropout) draw from; checkpoints and snapshots
hold both, so a resumed run draws the same dropout masks.

Start-up refuses, with one :class:`~mt_train.errors.UserError` line, what would fail later:
a run folder that cannot be written or that another live run holds (:mod:`mt_train.run_lock`),
a data folder that does not match its ``meta.json`` or the model's vocabulary
(:mod:`mt_train.data.checks`), a checkpoint that does not fit the model.

The reported loss is the mean over the global batch (over its trained targets when the data
masks some, :mod:`mt_train.loss_weights`, whatever the micro-batch size, dp or pp). An anomalous step is never applied:
with ``rewind`` off a non-finite loss or norm stops the run with the report rewind's bound
gives (:class:`~mt_train.rewind.manager.RewindLimitError`); with it on the trainer restores
the newest stable checkpoint (from memory or disk), skips data, cools the LR and carries on
(:mod:`mt_train.rewind.manager`). A SIGTERM/SIGINT ends the run after the step in progress
with a checkpoint (:mod:`mt_train.rewind.preemption`).

Invariant for exact resume: the full state (:mod:`mt_train.run_state`) is checkpointed, and
nothing else carries information between steps, so on the CPU a resumed run (same layout)
repeats the uninterrupted loss curve bit for bit.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch

import mt_comm
import mt_fp8
import mt_parallel
from mt_train import fault_points, ranks
from mt_train.checkpoint.checkpointer import TPLayout, resolve_resume
from mt_train.checkpoint.files import step_dir
from mt_train.config.schema import TrainConfig
from mt_train.cuda_graph import GraphedStep
from mt_train.data.blend import BlendedSampler
from mt_train.data.dataset import Batch
from mt_train.data.setup import data_label, open_training_data
from mt_train.errors import UserError
from mt_train.evaluation import Evaluator
from mt_train.expert_load import ExpertLoadLog
from mt_train.loggers import run_info, write_run_record
from mt_train.loss_weights import token_weights
from mt_train.metrics import MetricsLogger, Throughput
from mt_train.models import build_model, family_of, parallelize, resolve_vocab
from mt_train.models.build import fp8_layer_count, warn_if_fp8_emulated
from mt_train.observer import RunObserver
from mt_train.optim import build_optimizer, lr_multiplier
from mt_train.pipeline_step import pipeline_step
from mt_train.rewind.consensus import Verdict
from mt_train.rewind.detectors import StepSignals
from mt_train.rewind.events import EVENTS_FILE, EventLog
from mt_train.rewind.faults import fault_injector
from mt_train.rewind.manager import RewindManager
from mt_train.rewind.preemption import StopRequest
from mt_train.rewind.recovery import fired_faults
from mt_train.run_lock import RunLock, open_run_folder
from mt_train.run_state import RunState
from mt_train.step import BatchRunner, EagerStep, read_step_numbers
from mt_train.summary import TrainSummary
from mt_train.update import update_policy
from mt_train.watchdog import flight_recorder_dump_path, flight_recorder_env


class Trainer:
    """Builds the run (distributed init, data, model, optimizer, checkpoints) and trains it."""

    def __init__(self, cfg: TrainConfig, output_dir: str | Path | None = None) -> None:
        self.lock: RunLock | None = None
        fault = cfg.fault
        fault_points.arm(fault.disk_error, fault.disk_errno, fault.kill_in_save, fault.save_step)
        try:
            self._build(cfg, output_dir)
        except BaseException:  # a refused start leaves no lock and no armed fault behind
            if self.lock is not None:
                self.lock.release()
            fault_points.arm()
            raise

    def _build(self, cfg: TrainConfig, output_dir: str | Path | None) -> None:
        self.cfg = cfg
        tr, p = cfg.trainer, cfg.parallel
        flight_recorder_env(cfg.comm)
        self.ctx = mt_comm.init_distributed(
            device=tr.device, timeout=datetime.timedelta(seconds=cfg.comm.timeout_s)
        )
        self.rank, self.world_size = self.ctx.rank, self.ctx.world_size
        self.device = self.ctx.torch_device
        self.dp = cfg.check_world(self.world_size)
        with contextlib.suppress(RuntimeError):
            mt_comm.destroy_parallel_state()
        self.pstate = mt_comm.init_parallel_state(dp=self.dp, cp=p.cp, tp=p.tp, pp=p.pp, ep=p.ep)
        self.tp_group, self.cp_group = self.pstate.group("tp"), self.pstate.group("cp")
        self.dp_cp_group = self.pstate.group("dp_cp")
        self.dp_rank, self.dp_size = self.pstate.rank("dp"), self.pstate.size("dp")
        self.seed_rng(tr.seed)

        out = str(output_dir or tr.output_dir or Path.cwd() / "outputs" / cfg.model.name)
        self.output_dir = Path(ranks.broadcast_str(str(Path(out).resolve()), self.device))
        run_id = ranks.broadcast_str(uuid.uuid4().hex, self.device)
        ck = cfg.checkpoint
        self.ckpt_dir = Path(ck.dir).expanduser() if ck.dir else self.output_dir / "checkpoints"

        def take_run_folder() -> None:
            self.lock = open_run_folder(self.output_dir, self.ckpt_dir)

        ranks.on_rank0(take_run_folder, self.rank, self.device)

        self.data, self.sampler = open_training_data(
            cfg, self.output_dir, self.rank, self.device, self.dp_rank, self.dp_size
        )

        # Observability: step timer, profiler, watchdog (mt_train.observer), flight recorder.
        self.run_id = run_id
        flight_recorder_dump_path(cfg.comm, self.output_dir)
        self.observer = RunObserver(cfg, self.output_dir, self.rank, self.ctx.device)
        self.timer = self.observer.timer
        self.checkpoints_written = 0

        # Model and parallelism: the family builds, mt_parallel's one path parallelizes.
        self.model_cfg = resolve_vocab(cfg.model, self.data.vocab_size)
        self.model_cfg.check_parallel(p)
        self.family = family_of(self.model_cfg)
        self.module = build_model(self.model_cfg, self.device, tr.seed)
        routers = {
            name: m.cfg.num_experts
            for name, m in self.module.named_modules()
            if isinstance(m, mt_parallel.moe.Router)
        }
        # Per-step model settings (e.g. DeepSeek-V3's MTP weight switch): modules with a
        # ``set_train_step(completed_steps) -> changed`` hook, found on the whole model (under
        # pp the model object itself is outside this rank's chunks, its hooks are not).
        self.step_hooks = [
            m.set_train_step for m in self.module.modules() if hasattr(m, "set_train_step")
        ]
        sequence_inputs = getattr(self.module, "sequence_inputs", None)
        # Image-text batches padded to a fixed image count (a captured step's fixed shapes):
        # modules that check images against placeholders accept the trailing padding.
        if getattr(self.data.train, "pad_images", False):
            for m in self.module.modules():
                if hasattr(m, "set_image_padding"):
                    m.set_image_padding(True)
        self.model = parallelize(self.module, self.model_cfg, p, self.pstate, cfg.fp8, tr.compile)
        if p.pp > 1:  # this rank's chunks, under the whole model's names
            self.module = self.model
        self.document_mask_kernel = self.apply_document_mask_kernel()
        self.fp8_layers = fp8_layer_count(self.module)
        self.fp8_recipe = (
            mt_fp8.recipe_from_name(cfg.fp8.recipe, **dict(cfg.fp8.recipe_args))
            if cfg.fp8.enabled
            else None
        )
        mp_group = self.pstate.group("mp") if p.pp > 1 else None
        self.optimizer = build_optimizer(
            self.module, cfg.optimizer, self.device.type, p.data_parallel, self.dp_cp_group,
            self.tp_group, mp_group,
        )  # fmt: skip
        self.update = update_policy(
            self.optimizer, cfg.optimizer.grad_clip, self.tp_group, self.dp_cp_group, mp_group
        )
        bf16 = tr.precision == "bf16" or (tr.precision == "auto" and self.device.type != "cpu")
        self.autocast_dtype = torch.bfloat16 if bf16 else None
        self.runner = BatchRunner(
            self.model, self.module, self.device, self.cp_group, p.cp, self.pstate.rank("cp"),
            self.autocast_dtype,
        )  # fmt: skip
        self.step_runner = (
            GraphedStep.for_run(self.runner, p, self.model_cfg.dropout, self.pstate.size("dp_cp"))
            if tr.cuda_graph
            else pipeline_step(
                self.runner, cfg, self.model_cfg, self.pstate, self.dp, sequence_inputs
            )
            if p.pp > 1
            else EagerStep(self.runner)
        )
        self.flops_per_token = self.family.flops_per_token(self.model_cfg, tr.seq_len)
        self.evaluator = Evaluator(
            self.runner, self.data, cfg, self.pstate, self.collate, self.tp_group, self.cp_group
        )
        self.stopped: str | None = None
        self.verdict = Verdict()
        self._stop = StopRequest()
        self.events = EventLog(self.output_dir / EVENTS_FILE if self.rank == 0 else None)
        self.expert_load = (
            ExpertLoadLog(self.events, self.pstate.group("pp"), routers, self.device)
            if p.pp > 1
            else ExpertLoadLog(self.events)
        )
        self.guard = RewindManager(cfg.rewind, self.events, self.device)
        self.faults = fault_injector(
            cfg.fault, self.rank, fired_faults(self.output_dir, self.rank, self.device),
            len(self.data.train), tr.seed, tr.global_batch_size, cfg.data.independent_draws,
            self.events, self.module,
        )  # fmt: skip

        fault_points.enable_kill(
            self.faults.fired, lambda phase, step: self._record_kill_in_save(phase, step)
        )

        # State: checkpoints, resume (or init_from), rewind targets.
        tp_layout = TPLayout(
            mt_parallel.tp_shard_plan(self.module), self.pstate.rank("tp"), self.pstate.size("tp")
        )
        self.state = RunState(
            cfg, self.model_cfg, self.module, self.optimizer, self.sampler, self.guard,
            self.events, self.ckpt_dir, run_id,
            (self.rank, self.world_size, self.pstate.rank("dp_cp")), self.layout(),
            self.ctx.device, tp_layout, {"folder": str(self.data.folder), **self.data.train.meta},
            self.pstate.group("pp") if p.pp > 1 else None,
        )  # fmt: skip
        self.checkpointer = self.state.checkpointer
        self.step = self.state.start(self.faults, self.seed_rng)
        self.logger: MetricsLogger | None = None
        if self.rank == 0:
            warn_if_fp8_emulated(cfg.fp8, self.device, self.ctx.device.name)

    # ------------------------------------------------------------------ state
    def _record_kill_in_save(self, phase: str, step: int) -> None:
        """The ``fault`` event of ``fault.kill_in_save`` (written before the kill)."""
        self.events.emit(
            "fault", self.step, fault=fault_points.KILL_IN_SAVE, at_step=step, phase=phase
        )

    def seed_rng(self, seed: int) -> None:
        """Seed the default generators and mt_parallel's RNG tracker for this rank's TP and CP
        coordinates (``mt_parallel.manual_seed``), and the device's generator alike."""
        mt_parallel.manual_seed(seed, self.pstate.rank("tp"), self.pstate.rank("cp"))
        self.ctx.device.manual_seed(torch.initial_seed())

    def layout(self) -> dict[str, int]:
        """What RNG states depend on: the world size and the tp, cp, dp (and pp) degrees."""
        p = self.cfg.parallel
        layout = {"world_size": self.world_size, "tp": p.tp, "cp": p.cp, "dp": self.dp}
        return {**layout, "pp": p.pp} if p.pp > 1 else layout

    def load(self, folder: Path) -> None:
        """Restore a checkpoint (any layout; :meth:`mt_train.run_state.RunState.load`)."""
        self.step = self.state.load(folder, self.seed_rng)
        self.drop_step_graph()  # the graph holds the replaced state's addresses

    def save(self) -> None:
        """Checkpoint the current step (a rewind target too when rewind is on)."""
        self.state.save(self.step)
        self.checkpoints_written += 1

    @property
    def step_graph(self) -> Any:
        """The captured CUDA graph of the step (:mod:`mt_train.cuda_graph`), or None."""
        return self.step_runner.graph

    def drop_step_graph(self) -> None:
        """Forget the captured step (after the model or its state was replaced or reloaded);
        the next step captures again."""
        self.step_runner.reset()

    # ------------------------------------------------------------------ steps
    def collate(self, dataset: Any, indices: Any) -> Batch:
        """A micro-batch on this rank's device (with document ids if masking is on)."""
        return dataset.collate(indices, self.cfg.data.document_masking).to(self.device)

    @property
    def watch_fp8(self) -> bool:
        """Whether steps read the FP8 health counters (for the ``fp8_overflow`` detector)."""
        rewind = self.cfg.rewind
        return self.fp8_layers > 0 and rewind.enabled and "fp8_overflow" in rewind.detectors

    def train_step(self) -> dict[str, Any]:
        """One optimizer step, or an anomalous one that is not applied (``self.verdict`` and
        ``metrics["event"]`` say why)."""
        self.observer.begin_step(self.step + 1)
        if any([hook(self.step) for hook in self.step_hooks]):  # every hook runs
            self.drop_step_graph()
        faults = self.faults.begin_step(self.step + 1)
        if self.watch_fp8:
            mt_fp8.reset_fp8_health(self.module)
        micro = self.sampler.next_step()
        batches = [self.collate(self.data.train, indices) for indices in micro]
        factors = [faults.loss * self.faults.micro_loss_factor(indices) for indices in micro]
        weights = token_weights(self.data.train, self.sampler)
        if weights is not None:  # masked targets: the loss is the global batch's masked mean
            factors = [f * w for f, w in zip(factors, weights, strict=True)]
        # A captured step reads the loss factors as inputs; the FP8 input fault adds kernels.
        eager = faults.fp8_inputs != 1.0
        # The norm joins a captured step when nothing runs between the backward and it.
        capture_norm = self.update.graph_norm if self.pstate.size("dp_cp") == 1 else None
        self.timer.start("forward_backward")
        result = self.step_runner.run(batches, factors, capture_norm, eager=eager)
        self.timer.start("grad_sync")
        params = [p for p in self.module.parameters() if p.grad is not None]
        if self.cfg.parallel.data_parallel == "none":  # expert ones: reduced by accumulate
            dense = [p for p in params if not mt_parallel.is_expert_parameter(p)]
            mt_parallel.all_reduce_gradients(dense, self.dp_cp_group)
        norm_t = result.norm
        if faults.grads != 1.0:
            norm_t = None  # the fault changes the gradients after a captured norm
            for p in params:
                p.grad.mul_(faults.grads)
        if norm_t is None:
            norm_t = self.update.norm(params)
        self.timer.start("optimizer")
        numbers = read_step_numbers(
            result, len(micro), norm_t, self.dp_cp_group, self.module if self.watch_fp8 else None
        )
        loss, norm = numbers.loss, numbers.grad_norm
        lr = self.cfg.optimizer.lr * lr_multiplier(
            self.step, self.cfg.trainer.max_steps, self.cfg.scheduler
        )
        lr *= self.guard.lr_factor(self.step)
        metrics: dict[str, Any] = {"loss": loss, "grad_norm": norm, "lr": lr, **numbers.extras}
        if isinstance(self.sampler, BlendedSampler):
            consumed = self.sampler.trained_draws() * self.cfg.trainer.seq_len
            names = self.data.names  # type: ignore[attr-defined]
            metrics.update({f"tokens/{n}": int(t) for n, t in zip(names, consumed, strict=True)})
        signals = StepSignals(loss, norm, numbers.local_loss)
        if numbers.fp8_saturation is not None:
            signals.fp8_saturation, signals.fp8_worst = numbers.fp8_saturation, numbers.fp8_worst
            metrics["fp8_saturated"] = numbers.fp8_saturation
        self.signals = signals
        self.verdict = self.guard.judge(self.step, signals, self._stop.requested)
        if not self.verdict.anomalous:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.update.apply(norm_t)
            if isinstance(self.fp8_recipe, mt_fp8.DelayedScaling):
                mt_fp8.update_fp8_scales(self.module, self.fp8_recipe, self.tp_group)
            self.step += 1
            self.guard.accept(self.step, signals)
        else:
            metrics["event"] = self.verdict.detector
        self.expert_load.update(self.module, applied=not self.verdict.anomalous)
        self.optimizer.zero_grad(set_to_none=True)
        return metrics

    def rewind(self, verdict: Verdict) -> None:
        """Go back to the newest stable target and skip data (:mod:`mt_train.rewind.manager`);
        with rewind off, stop with the report rewind's bound gives."""
        if not self.cfg.rewind.enabled:
            raise self.guard.give_up(
                self.step,
                verdict,
                "rewind is off (rewind=disabled), so the run stops; rewind=default would have "
                "restored the newest stable checkpoint and skipped the data that led here",
            )
        self.step = self.state.rewind(self.step, verdict)
        self.drop_step_graph()
        if self.logger is not None:
            self.logger.set_step(self.step)

    def _preempt(self, signal_name: str | None) -> None:
        """A stop signal reached some rank: checkpoint this step (if checkpoints are on)."""
        saved = None
        if self.cfg.checkpoint.enabled or self.cfg.rewind.enabled:
            if self.state.last_save != self.step:
                self.save()
            self.checkpointer.wait()
            saved = str(step_dir(self.ckpt_dir, self.step))
        self.stopped = signal_name or "a signal on another rank"
        self.events.emit("preempted", self.step, signal=self.stopped, checkpoint=saved)

    def evaluate(self) -> float:
        """Mean loss over ``eval_batches`` fixed validation micro-batches per rank."""
        return self.evaluator.loss()

    def generate(self, prompt: str, max_new_tokens: int) -> str:
        """Greedy continuation of ``prompt``, the same on every rank."""
        return self.evaluator.generate(prompt, max_new_tokens)

    # ------------------------------------------------------------------ loop
    def fit(self) -> TrainSummary:
        """Train to ``trainer.max_steps``; evaluate, checkpoint and log on their intervals,
        rewind on anomalies, stop early (with a checkpoint) on SIGTERM/SIGINT."""
        tr, ck = self.cfg.trainer, self.cfg.checkpoint
        is_main = self.rank == 0
        if is_main:
            print(self.describe(), file=sys.stderr, flush=True)
        run = run_info(self.cfg, self.output_dir, self.run_id) if is_main else None
        if run is not None:
            write_run_record(run, self.world_size, self.step)
        self.logger = MetricsLogger(
            self.cfg.logging, self.output_dir, tr.max_steps, self.step, is_main, run
        )
        self.events.echo = self.logger.write
        self.state.start_targets(self.step)
        tokens_per_step = tr.global_batch_size * tr.seq_len
        losses: list[float] = []
        self._val_loss = train_loss = float("nan")
        start = time.perf_counter()
        tokens_total = 0
        self.throughput = Throughput(
            self.ctx.device, tokens_per_step, self.flops_per_token, self.world_size,
            self.observer.at_log_point,
        )  # fmt: skip
        with self._stop:
            while self.step < tr.max_steps:
                metrics = self.train_step()
                if self.verdict.anomalous:
                    self.logger.log(self.step, metrics, kind="anomaly")
                    self.timer.start("rewind")
                    self.rewind(self.verdict)
                    self.logger.log(
                        self.step, {"event": f"rewound to step {self.step}"}, kind="rewind"
                    )
                else:
                    losses.append(metrics["loss"])
                    train_loss = metrics["loss"]
                    tokens_total += tokens_per_step
                    self._after_step(metrics)
                if self.verdict.stop:
                    self._preempt(self._stop.signal_name)
                    break
        graph_warning = (
            self.step_runner.never_replayed() if isinstance(self.step_runner, GraphedStep) else None
        )
        if graph_warning and is_main:
            print(f"mt-train: warning: {graph_warning}", file=sys.stderr, flush=True)
        self.checkpointer.wait()
        self.observer.end_run()
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
        stats = self.observer.stats
        tokens_per_s = tokens_total / wall if wall > 0 else 0.0
        peak = self.throughput.peak_flops
        return TrainSummary(
            steps=self.step,
            train_loss=train_loss,
            val_loss=val_loss,
            wall_s=wall,
            tokens_per_s=tokens_per_s,
            output_dir=str(self.output_dir),
            checkpoint=str(latest) if latest else None,
            losses=losses,
            rewinds=self.guard.rewinds,
            sample=sample,
            stopped=self.stopped,
            tokens=tokens_total,
            best_tokens_per_s=stats.best_tokens_per_s,
            mfu=self.flops_per_token * tokens_per_s / (peak * self.world_size) if peak else None,
            best_mfu=stats.best_mfu,
            peak_memory_gib=stats.peak_memory_gib,
            checkpoints_written=self.checkpoints_written,
            traces=stats.traces,
        )

    def _after_step(self, metrics: dict[str, Any]) -> None:
        """Log, evaluate and checkpoint on their intervals after a healthy step."""
        assert self.logger is not None
        tr, step = self.cfg.trainer, self.step
        self.checkpointer.check()  # a background save that failed stops the run now
        self.throughput.steps += 1
        self.logger.advance()
        if step % tr.log_interval == 0 or step == tr.max_steps:
            self.expert_load.log(metrics, step)
            self.logger.log(step, {**metrics, **self.throughput.measure()})
        if step % tr.eval_interval == 0 or step == tr.max_steps:
            self.timer.start("eval")
            self._val_loss = self.evaluate()
            per_source = {f"val_loss/{n}": v for n, v in self.evaluator.source_losses.items()}
            self.logger.log(step, {"val_loss": self._val_loss, **per_source}, kind="eval")
        if (self.cfg.checkpoint.enabled or self.cfg.rewind.enabled) and (
            step % tr.checkpoint_interval == 0 or step == tr.max_steps
        ):
            self.timer.start("checkpoint")
            self.save()

    def apply_document_mask_kernel(self) -> str | None:
        """The kernel that applies the document masks of ``data.document_masking`` or
        ``data.pack_samples`` on this device (None when both are off), given to the attention
        cores (:mod:`mt_parallel.document_attention`)."""
        data, p = self.cfg.data, self.cfg.parallel
        if not (data.document_masking or data.pack_samples):
            return None
        try:
            kernel = mt_parallel.resolve_document_mask_kernel(
                data.document_masking_kernel, self.device.type, p.cp, self.model_cfg.dropout,
                ring=p.cp_attention == "ring",
            )  # fmt: skip
        except ValueError as err:
            raise UserError(f"data.{err}") from err
        mt_parallel.apply_document_mask_kernel(self.model, kernel)
        return kernel

    def describe(self) -> str:
        c, tr, p = self.model_cfg, self.cfg.trainer, self.cfg.parallel
        precision = "bf16 autocast" if self.autocast_dtype else "fp32"
        fp8 = f", fp8 {self.cfg.fp8.recipe} ({self.fp8_layers} linears)" if self.fp8_layers else ""
        sp = "+sp" if p.sequence_parallel else ""
        if p.pp > 1:
            sp += f" pp={p.pp} {p.pp_schedule}"
        ep = f" ep={p.ep}" if p.ep > 1 else ""
        cp_attention = f", cp {p.cp_attention}" if p.cp > 1 else ""
        docs = (
            f", document masking ({self.document_mask_kernel})" if self.document_mask_kernel else ""
        )
        params = self.family.num_params(self.module) / 1e6
        held = " on this pipeline rank" if p.pp > 1 else ""
        return (
            f"mt-train: {c.name} {self.family.label}, {params:.2f}M params{held} ({c.summary()}) on "
            f"{self.world_size}x {self.ctx.device.name} [dp={self.dp} cp={p.cp} tp={p.tp}{sp}{ep}, "
            f"{p.data_parallel}{cp_attention}], {precision}{fp8}{docs}; "
            f"{tr.max_steps} steps of {tr.global_batch_size}x{tr.seq_len} tokens; "
            f"data {data_label(self.data)} ({len(self.data.train)} train / {len(self.data.val)} val "
            f"sequences); output {self.output_dir}"
            + (f"; resumed at step {self.step}" if self.step else "")
        )

    def close(self) -> None:
        """Finish pending saves and release the parallel groups (the process group stays)."""
        self.observer.close()
        self.drop_step_graph()
        try:
            self.checkpointer.close()
        finally:
            if self.logger is not None:
                self.logger.close()
            if self.lock is not None:
                self.lock.release()
            fault_points.arm()
            with contextlib.suppress(RuntimeError):
                mt_comm.destroy_parallel_state()
