"""The step object for ``parallel.pp > 1``: one schedule run per optimizer step.

:class:`PipelineStep` shares ``run(batches, loss_factors, grad_norm, eager) -> StepResult`` and
``reset()`` with :class:`~mt_train.step.EagerStep`, so the trainer's step, update, rewind and
checkpoint code is the same at every ``pp``. A run:

1. takes this rank's part of each micro-batch (:meth:`BatchRunner.local_batch`: under CP the
   load-balanced tokens, targets, document ids and positions) and, on the rank holding the
   first chunk, the batch's model inputs (a VLM's images, which its first chunk merges into
   the embeddings: later stages receive hidden states only); on every rank, the inputs the
   model derives from the whole sequence (its ``sequence_inputs`` hook, cut like the tokens
   under CP: DeepSeek-V3's shifted MTP tokens and targets, which its last chunk reads; a
   VLM's per-sample RoPE positions of packed rows, which every chunk's blocks read);
2. runs the schedule (:class:`mt_parallel.PipelineSchedule`, torch's action runtime) with
   ``M`` = the step's micro-batch count: the backward of micro-batch ``m`` starts from
   ``loss_m · f_m / M``, as the pp=1 accumulation loop's; forward chunks run under autocast
   when the run is bf16 (a pre/post hook pair per chunk; the loss upcasts outside it, as the
   pp=1 step does);
3. averages the gradients over dp×cp (``data_parallel=ddp``; the trainer itself does it for
   ``none``, ZeRO-1's reduce-scatter for ``zero1``, FSDP2's for ``fsdp``): no DDP hooks run
   inside the schedule (pytorch#144530); instead each chunk's dense gradients are averaged in
   buckets of about :data:`BUCKET_BYTES` (in reverse parameter order, roughly the order the
   backward finishes them), each a flat all-reduce started as soon as its gradients are final:
   during the chunk's last backward action of the step
   (:meth:`mt_parallel.PipelineSchedule.in_last_backward`), once autograd has accumulated every
   gradient of the bucket, so the reduction of the first buckets overlaps the rest of that
   backward (Megatron-Core's ``overlap_grad_reduce``); buckets start in their order only, the
   same on every rank of the dp×cp group. Gradients that autograd does not accumulate there
   (a split backward's ``W``, the weight-gradient sinks) start at the chunk's ``REDUCE_GRAD``
   action (:attr:`mt_parallel.PipelineSchedule.on_chunk_gradients`), right after its last
   backward, so a rank holding several chunks (interleaved, zero-bubble V and DualPipeV
   schedules) also averages one chunk's gradients while it computes the others' backwards;
   the step waits for them after the schedule (and averages anything left: a torch without
   ``REDUCE_GRAD``). Each element's average depends only on the ranks' values of that
   element, so the buckets give the bits one flat all-reduce gives. Experts
   split over ``ep`` are summed over their expert-data-parallel group and divided by dp×cp
   instead, for ``ddp`` and ``none`` (:func:`mt_parallel.moe.reduce_expert_gradients`, as at
   ``pp = 1``; ZeRO-1 reduces them at its step, FSDP2 in the backward unless the edp group
   has one rank). Then the gradients of modules both the first and last chunks run
   (DeepSeek-V3's input embedding under MTP) are summed over the two copies
   (:meth:`mt_parallel.PipelineModule.reduce_shared_gradients`; both averages are linear, so
   averaging each copy over dp×cp first gives their dp×cp average of the sum). Where one rank
   holds both chunks (``zbv``, ``dualpipev``) there is one module and no copy: ``ddp``
   averages it after the schedule, once, below; under ``fsdp`` it is an FSDP2 unit of its own
   that the schedule reduces once, after both chunks' backwards
   (:mod:`mt_parallel.pipeline.shared_fsdp`);
4. makes the loss known on every pipeline rank: the rank holding the head sums its
   micro-batch losses, the others contribute 0, and a SUM all-reduce over the pp group gives
   every rank the step's total; the model's extra values (a VLM's token counts) are summed
   over the pp group the same way (their names, which only the head's rank sees, are
   broadcast over the group once).
   MoE models (``carries_aux_losses``): every chunk attached its layers' auxiliary losses to
   its activations (:mod:`mt_parallel.moe.carry`); every rank adds the whole pipeline's
   ``Σ_m f_m·a_m`` (reduced over the pp group) to that sum, so the total is the ``pp = 1`` step's ``Σ_m f_m·(CE_m + a_m)``, and the
   MoE metrics (``moe_aux_loss``, ``moe_z_loss``, ``moe_max_vio``, ``moe_dropped``) and
   ``ce_loss`` are reduced over the pipeline group, so every rank reports the whole model's;
   the head's other extras (``mtp_loss_{k}``) reach every rank as in step 4.

The gradient norm then sums over the model-parallel group (tp×pp, :mod:`mt_train.update`), since
each pipeline rank holds different parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

import mt_comm
import mt_parallel
from mt_comm import ParallelState
from mt_train import ranks
from mt_train.data.dataset import Batch
from mt_train.step import BatchRunner, GradNorm, StepResult

BUCKET_BYTES = 25 * 2**20
"""Gradient bytes per bucket of a chunk's ``ddp`` average (module docstring, step 3; torch
DDP's default bucket size)."""


class _ChunkBuckets:
    """One chunk's ``ddp`` gradient average in buckets started as their gradients become final
    (module docstring, step 3)."""

    def __init__(
        self,
        chunk: torch.nn.Module,
        params: list[torch.nn.Parameter],
        schedule: mt_parallel.PipelineSchedule,
        group: Any,
    ) -> None:
        self.chunk, self.schedule, self.group = chunk, schedule, group
        self.buckets: list[list[torch.nn.Parameter]] = [[]]
        size = 0
        for param in reversed(params):
            if size >= BUCKET_BYTES:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(param)
            size += param.numel() * param.element_size()
        self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        for param in params:
            param.register_post_accumulate_grad_hook(self._accumulated)
        self.reset()

    def reset(self) -> None:
        """Forget the last step's buckets."""
        self.final: list[set[int]] = [set() for _ in self.buckets]
        self.pending: list[Any] = []

    def _accumulated(self, param: torch.nn.Parameter) -> None:
        if not self.schedule.in_last_backward(self.chunk):
            return
        self.final[self.bucket_of[id(param)]].add(id(param))
        while len(self.pending) < len(self.buckets):
            index = len(self.pending)
            if len(self.final[index]) < len(self.buckets[index]):
                return
            self._start_next()

    def _start_next(self) -> None:
        bucket = self.buckets[len(self.pending)]
        self.pending.append(mt_parallel.start_gradient_average(bucket, self.group))

    def start_rest(self) -> None:
        """Start the buckets not started yet, in order (the chunk's ``REDUCE_GRAD``)."""
        while len(self.pending) < len(self.buckets):
            self._start_next()

    def finish(self) -> list[torch.nn.Parameter]:
        """Wait for the started buckets, write their averages; the parameters they held."""
        for pending in self.pending:
            pending.finish()
        done = [p for bucket in self.buckets[: len(self.pending)] for p in bucket]
        self.reset()
        return done


class PipelineStep:
    """A step of ``parallel.pp > 1`` (module docstring)."""

    def __init__(
        self,
        runner: BatchRunner,
        parallel: mt_parallel.ParallelConfig,
        pstate: ParallelState,
        microbatches: int,
        micro_batch_size: int,
        seq_len: int,
        dim: int,
        vocab_size: int,
        carries_aux_losses: bool = False,
        sequence_inputs: Callable[..., dict[str, torch.Tensor]] | None = None,
    ) -> None:
        module = runner.module
        if not isinstance(module, mt_parallel.PipelineModule):
            raise TypeError(f"a pipeline step needs an mt_parallel.PipelineModule, got {module!r}")
        self.runner, self.module, self.parallel = runner, module, parallel
        self.carries_aux_losses = carries_aux_losses
        self.pp_group, self.dp_cp_group = pstate.group("pp"), pstate.group("dp_cp")
        self.holds_first = any(c.first for c in module.pipeline_chunks)
        self.sequence_inputs = sequence_inputs
        """The model's inputs derived from the whole sequence (module docstring, step 1)."""
        self.head_rank = module.pp_ranks[module.placement[module.num_stages - 1]]
        self.extra_names: list[str] | None = None
        """The names of the model's extra values, agreed over the pp group at the first step."""
        local_seq = seq_len // parallel.cp
        hidden_seq = local_seq // parallel.tp if parallel.sequence_parallel else local_seq
        param_dtype = next(module.parameters()).dtype
        self.loss_dtype = torch.promote_types(param_dtype, torch.float32)
        """The losses' dtype (at least fp32), for the ranks without the head."""
        logits_dtype = runner.autocast_dtype or param_dtype
        shapes = mt_parallel.StageShapes(
            tokens=((micro_batch_size, local_seq), torch.long),
            hidden=((micro_batch_size, hidden_seq, dim), param_dtype),
            logits=((micro_batch_size, local_seq, vocab_size // parallel.tp), logits_dtype),
        )
        self.schedule = mt_parallel.PipelineSchedule(
            module.pipeline_chunks, parallel.pp_schedule, parallel.pp, pstate.rank("pp"),
            microbatches, parallel.pp_chunks, shapes, runner.device, self.pp_group,
            module.local_loss, overlap=parallel.pp_overlap,
        )  # fmt: skip
        if runner.autocast_dtype is not None:
            for chunk in module.pipeline_chunks:
                self._autocast_forward(chunk)
        seen: set[int] = set()
        self._in_several_chunks: set[int] = set()
        """Parameters of more than one local chunk (the V schedules' embedding, which the
        first and last chunks share under MTP): averaged after the schedule, once (``ddp``;
        FSDP2 reduces its own unit of them once in the schedule)."""
        for chunk in module.pipeline_chunks:
            for param in chunk.parameters():
                if id(param) in seen:
                    self._in_several_chunks.add(id(param))
                seen.add(id(param))
        self._buckets: dict[int, _ChunkBuckets] = {}
        """Per chunk (by id), its ``ddp`` average's buckets (module docstring, step 3)."""
        if parallel.data_parallel == "ddp" and mt_comm.group_size(self.dp_cp_group) > 1:
            for chunk in module.pipeline_chunks:
                params = [
                    p
                    for p in chunk.parameters()
                    if p.requires_grad
                    and not mt_parallel.is_expert_parameter(p)
                    and id(p) not in self._in_several_chunks
                ]
                if params:
                    self._buckets[id(chunk)] = _ChunkBuckets(
                        chunk, params, self.schedule, self.dp_cp_group
                    )
            self.schedule.on_chunk_gradients = self._start_average

    def _dense_gradients(self, module: torch.nn.Module) -> list[torch.nn.Parameter]:
        """The parameters with a gradient that ``ddp`` averages over dp×cp (experts aside)."""
        return [
            p
            for p in module.parameters()
            if p.grad is not None and not mt_parallel.is_expert_parameter(p)
        ]

    def _start_average(self, chunk: torch.nn.Module) -> None:
        if id(chunk) in self._buckets:
            self._buckets[id(chunk)].start_rest()

    def _autocast_forward(self, chunk: torch.nn.Module) -> None:
        regions: list[contextlib.AbstractContextManager] = []

        def enter(module: Any, args: Any) -> None:
            region = self.runner.autocast()
            region.__enter__()
            regions.append(region)

        def leave(module: Any, args: Any, output: Any) -> None:
            regions.pop().__exit__(None, None, None)

        chunk.register_forward_pre_hook(enter)
        chunk.register_forward_hook(leave)

    @property
    def graph(self) -> None:
        return None

    def run(
        self,
        batches: list[Batch],
        loss_factors: list[float] | None = None,
        grad_norm: GradNorm | None = None,
        eager: bool = False,
    ) -> StepResult:
        """Forward and backward through the schedule (module docstring); ``grad_norm`` is
        left to the caller."""
        tokens, targets, kwargs = [], [], []
        for batch in batches:
            inputs, target, docs, positions = self.runner.local_batch(batch)
            tokens.append(inputs)
            targets.append(target)
            first_inputs = batch.model_inputs() if self.holds_first else {}
            derived = self.runner.derived_inputs(batch, self.sequence_inputs)
            kwargs.append({"positions": positions, "document_ids": docs, **first_inputs, **derived})
        self.reset()  # a step cut short (a raised error) leaves no bucket behind
        result = self.schedule.step(tokens, targets, kwargs, loss_factors)
        if self.parallel.data_parallel == "ddp":
            done = {id(p) for buckets in self._buckets.values() for p in buckets.finish()}
            rest = [p for p in self._dense_gradients(self.module) if id(p) not in done]
            mt_parallel.all_reduce_gradients(rest, self.dp_cp_group)
        self.module.reduce_shared_gradients()
        # FSDP2's expert shards arrive reduced over edp (only their TP sum is left); ZeRO-1's
        # are left to its optimizer step.
        mt_parallel.moe.reduce_expert_gradients(self.module)
        device = self.runner.device
        total = (
            torch.stack(result.losses).sum()
            if result.losses
            else torch.zeros((), dtype=self.loss_dtype, device=device)
        )
        mt_comm.all_reduce(total, group=self.pp_group)
        extras = self._pipeline_extras(result.extras)
        if self.carries_aux_losses:
            factors = loss_factors or [1.0] * len(batches)
            aux_total, aux_extras = mt_parallel.moe.pipeline_aux_summary(
                [c.aux_records for c in self.module.pipeline_chunks], factors, self.pp_group,
                device,
            )  # fmt: skip
            total = total + aux_total  # already summed over the pipeline
            extras.update(aux_extras)  # the whole pipeline's MoE metrics, not the head chunk's
        return StepResult(total, extras)

    def _pipeline_extras(self, extras: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The head's rank's ``extras`` on every pipeline rank (module docstring, step 4)."""
        if self.extra_names is None:
            names = ranks.broadcast_str(
                "\n".join(sorted(extras)), self.runner.device, self.head_rank, self.pp_group
            )
            self.extra_names = names.split("\n") if names else []
        if not self.extra_names:
            return {}
        zero = torch.zeros((), device=self.runner.device)
        values = torch.stack([extras.get(n, zero).float() for n in self.extra_names])
        mt_comm.all_reduce(values, group=self.pp_group)
        return dict(zip(self.extra_names, values.unbind(), strict=True))

    def reset(self) -> None:
        """Forget the ``ddp`` buckets of a step that did not finish (nothing else is cached
        between steps)."""
        for buckets in self._buckets.values():
            buckets.reset()


def pipeline_step(
    runner: BatchRunner,
    cfg: Any,
    model_cfg: Any,
    pstate: ParallelState,
    dp: int,
    sequence_inputs: Callable[..., dict[str, torch.Tensor]] | None = None,
) -> PipelineStep:
    """The run's :class:`PipelineStep`: the step's micro-batches (checked against the
    schedule), the micro-batch and stage shapes from the trainer and model configs;
    ``sequence_inputs`` is the whole model's hook of that name, if it has one."""
    tr = cfg.trainer
    microbatches = cfg.parallel.pipeline_microbatches(
        tr.global_batch_size // (tr.micro_batch_size * dp)
    )
    return PipelineStep(
        runner, cfg.parallel, pstate, microbatches, tr.micro_batch_size, tr.seq_len,
        model_cfg.dim, model_cfg.vocab_size, getattr(model_cfg, "moe", None) is not None,
        sequence_inputs,
    )  # fmt: skip
