"""Running a schedule's action lists on ``torch.distributed.pipelining``'s runtime.

Every schedule, GPipe and 1F1B included, runs through torch's ``_PipelineScheduleRuntime``
with the compute-only action lists of :func:`mt_parallel.pipeline.schedule_actions`; torch
lowers them to send/receive actions (``_add_send_recv``) and executes them with its
``PipelineStage`` (activation buffers, p2p, split backward). One executor means one gradient
path and one simulator for all six schedules; why torch's and not our own: docs/architecture.md.

What this module adds around it:

* Static stage shapes (:class:`StageShapes`): the stages are built with example input and
  output tensors on the ``meta`` device, so torch never runs its shape-inference forward and
  backward on uninitialised tensors (which would record FP8 amaxes and queue weight gradients).
* The loss: the last chunk's loss function returns ``loss_m · f_m / M`` (``f_m`` a loss
  factor, ``M`` the micro-batch count) for the backward, as the accumulation loop of a pp=1
  step does, so the runtime's own gradient scaling is off (``scale_grads=False``);
  ``loss_m · f_m`` (what the pp=1 step reports) and the model's extra values are kept per
  micro-batch.
* Split backward (``I``/``W``): layers with a ``wgrad_sink`` attribute can queue their
  weight-gradient GEMMs in an ``mt_fp8.WeightGradSink`` instead of running them in autograd's
  backward (``mt_fp8.FP8Linear`` and ``mt_fp8.FP8GroupedLinear``'s grouped paths, and
  mt-parallel's column- and row-parallel linears, MoE routers and experts' ``GroupedLinear``
  also without FP8; any layer may declare one). A chunk that uses a sink gets one, shared by
  all such layers of the chunk and handed to torch as the stage's ``dw_builder``: ``I`` runs
  the chunk's autograd backward with those GEMMs queued, ``W`` runs the queue. Other
  parameters (norms, embedding) get their gradients in ``I``. A chunk uses a sink when it holds
  a layer whose weight gradient autograd cannot separate (FP8: ``dx`` and ``dW`` come out of
  one autograd node), when it holds a block recomputed whole (``recompute="full"``; below), or
  on an older torch (below). Otherwise, and in particular for
  high-precision chunks on torch >= 2.13, torch's own split runs
  (``stage_backward_input``/``stage_backward_weight``: the weight part of the autograd graph
  is run from the saved intermediate gradients), and the sinks of the layers that declare
  ``wgrad_sink_optional`` stay unset. Why keep torch's split there rather than a sink
  everywhere: it moves every weight gradient to ``W`` (norms and embeddings too, which no sink
  covers), and it is what the activation-memory model of :mod:`mt_parallel.pipeline.memory`
  counts between ``I`` and ``W``.
* Blocks recomputed whole (:func:`mt_parallel.recompute.is_recomputed`) under torch's split:
  the non-reentrant checkpoint keeps a recomputation for one autograd call only, and torch's
  ``stage_backward_weight`` makes one call per parameter group, so ``W`` would run the block's
  forward again (up to the tensor it needs) for each group whose gradient reads a recomputed
  tensor, on top of the recomputation ``I`` runs (``test_pipeline_world2.py`` counts GEMMs). Such chunks take a
  sink: ``I`` runs the backward with its one recomputation and queues the GEMM weight
  gradients, whose closures keep each linear's input and ``dy`` until ``W``; norms and
  embeddings get theirs in ``I``, and the other GEMM weights left there are named in the
  same warning as on an older torch.
* Older torch (before 2.13), where the runtime is wrong or refuses our use; each fix is
  harmless on newer torch. Its ``stage_backward_weight`` counts an intermediate's gradient again
  through descendant intermediates (torch 2.13 clamps the saved gradients), so with
  :data:`TORCH_SPLITS_BACKWARD` false every chunk of a split-backward schedule gets a
  ``dw_builder``: a sink shared by all its layers that have one (the parallel linears with or
  without FP8, the MoE routers and experts), else a no-op. ``I`` runs the chunk's whole
  backward except the queued GEMMs and ``W`` those: correct, and the zero-bubble gain kept for
  the GEMM weights, which hold nearly all of a transformer block's weight-gradient FLOPs. Norm
  weights and biases (elementwise gradients) and embedding tables (a scatter-add) are small and
  stay in ``I``; a warning names the other weights that stay there, once per schedule: those
  whose gradient is a GEMM and whose layer has no sink (a model's own ``nn.Linear``) or says it
  does not use it (``defers_weight_gradient`` false: FP8 MoE experts whose gradient the
  backward sums over TP, under sequence parallelism at ep = 1, or on ``FP8GroupedLinear``'s
  per-expert loop; bf16 experts there defer, the queued work summing over TP). Its stage checks each received or given input's strides, so the
  micro-batch tokens (views of a longer row) are passed contiguous. Its p2p warm-up sends to
  the neighbour stage even when that stage is on the same rank (the V schedules), which gloo
  cannot pair; :class:`_Stage` drops those ops.
* MoE auxiliary losses: chunks that hold MoE layers (``carries_aux_losses``) get each
  micro-batch's :class:`~mt_parallel.moe.AuxLossScale` (``f_m / M``) as the keyword
  ``aux_loss_scale`` and attach their layers' losses to their output
  (:mod:`mt_parallel.moe.carry`); their per-micro-batch records are cleared at each step.
* Data-parallel gradients are never reduced by a DDP wrapper: stages hold plain modules (DDP's
  hooks are skipped by zero-bubble schedules, pytorch#144530). torch's lowering puts a
  ``REDUCE_GRAD`` action after each chunk's last backward (``B`` or ``W``) of the step, whose
  default is FSDP2's post-backward (the reduce-scatter of a chunk sharded by FSDP2); this
  module runs that default and then :attr:`PipelineSchedule.on_chunk_gradients` with the
  chunk, at that point of the schedule: a caller that starts the chunk's dp×cp all-reduce there
  (``data_parallel=ddp``, :mod:`mt_train.pipeline_step`) overlaps it with the rest of the
  schedule (the other chunks' backwards on this rank), and waits for it after
  :meth:`PipelineSchedule.step`. A torch without ``REDUCE_GRAD`` never calls the hook, and the
  caller reduces everything after the step.
* FSDP2 units in more than one of the rank's chunks (the V schedules' first and last chunks
  sharing a module): registered ``REDUCE_GRAD`` and ``RESHARD`` functions reduce each once per
  step, after the last of its chunks' backwards, and keep it gathered while another chunk
  holding it is (:mod:`mt_parallel.pipeline.shared_fsdp`).
* DualPipeV's ``OVERLAP_F_B`` pairs: with MoE layers split over ep > 1 (all-to-all
  dispatcher) the pair's forward and backward run interleaved at the MoE all-to-alls, each
  half's exchanges in flight while the other computes (:mod:`mt_parallel.pipeline.overlap`,
  registered for the action unless ``overlap=False``); otherwise torch runs the halves back
  to back.
* p2p: torch's lowering posts each receive when its sender's action is issued, so between two
  ranks the sends and receives are in the same order (checked in the tests); every operation
  is its own batch of one, so gloo's batched send/receive ordering (pytorch#152938) is never
  exercised with more than one operation per batch.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _ComputationType, _PipelineScheduleRuntime

import mt_fp8
from mt_parallel.layers import VocabParallelEmbedding
from mt_parallel.moe.carry import AuxLossScale
from mt_parallel.pipeline.overlap import overlap_forward_backward, overlaps_all_to_all
from mt_parallel.pipeline.schedules import (
    OVERLAP,
    SCHEDULES,
    chunks_per_rank,
    schedule_actions,
    stage_to_rank,
)
from mt_parallel.pipeline.shared_fsdp import SharedUnits
from mt_parallel.recompute import is_recomputed


@dataclass(frozen=True)
class StageShapes:
    """The tensors crossing stage boundaries, for one micro-batch."""

    tokens: tuple[tuple[int, ...], torch.dtype]
    """The first chunk's input (token ids)."""
    hidden: tuple[tuple[int, ...], torch.dtype]
    """What one chunk passes to the next (the residual stream as the blocks see it)."""
    logits: tuple[tuple[int, ...], torch.dtype]
    """The last chunk's output."""

    def example(self, which: str, requires_grad: bool) -> torch.Tensor:
        shape, dtype = getattr(self, which)
        return torch.empty(shape, dtype=dtype, device="meta", requires_grad=requires_grad)


@dataclass
class PipelineStepResult:
    """What one pipelined step leaves on this rank."""

    losses: list[torch.Tensor] = field(default_factory=list)
    """Each micro-batch's loss times its factor (not divided by ``M``), on the rank holding the
    last chunk (else empty)."""
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    """The model's extra values summed over micro-batches (last chunk's rank)."""


def _registers_reduce_grad(runtime: _PipelineScheduleRuntime, function: Callable) -> bool:
    """Register ``function`` for the runtime's ``REDUCE_GRAD`` action, where the installed
    torch has that action and accepts a custom function for it."""
    reduce_grad = getattr(_ComputationType, "REDUCE_GRAD", None)
    register = getattr(runtime, "register_custom_function", None)
    if reduce_grad is None or register is None:
        return False
    try:
        register(reduce_grad, function)
    except ValueError:  # a torch that knows the action but not custom functions for it
        return False
    return True


TORCH_SPLITS_BACKWARD = torch.__version__ >= (2, 13)
"""Whether torch's own split backward (``stage_backward_weight``) gives each weight its
gradient once (module docstring, "Older torch")."""


def _no_weight_pass() -> Callable[[], None]:
    """A ``dw_builder`` for a chunk whose ``I`` ran the whole backward: its ``W`` does nothing."""
    return lambda: None


def _splits_through_sinks(chunk: nn.Module) -> bool:
    """Whether a split-backward schedule runs ``chunk``'s weight gradients through a sink
    whatever its layers need: on a torch whose split is wrong, or where it holds a block
    recomputed whole (module docstring)."""
    return not TORCH_SPLITS_BACKWARD or any(is_recomputed(m) for m in chunk.modules())


def _gemm_weights_outside_sinks(chunk: nn.Module) -> list[str]:
    """The chunk's trainable weights whose gradient is a GEMM and stays in ``I`` where the
    chunk splits through sinks (:func:`_splits_through_sinks`): at least 2-D, not embedding tables, and not held by a layer with a
    sink, or held by one that does not defer it (``defers_weight_gradient`` false; module
    docstring, "Older torch")."""
    sink_layers = [m for m in chunk.modules() if hasattr(m, "wgrad_sink")]
    tables = [m for m in chunk.modules() if isinstance(m, (nn.Embedding, VocabParallelEmbedding))]
    covered = {id(p) for m in [*sink_layers, *tables] for p in m.parameters()}
    undeferred = {
        id(p)
        for m in sink_layers
        if not getattr(m, "defers_weight_gradient", True)
        for p in m.parameters()
    }
    return [
        name
        for name, p in chunk.named_parameters()
        if p.requires_grad and p.dim() >= 2 and (id(p) not in covered or id(p) in undeferred)
    ]


class _Stage(PipelineStage):
    """torch's stage without p2p warm-up ops to itself (module docstring, "Older torch"), which
    says while it runs its last backward of the step (:attr:`in_last_backward`)."""

    in_last_backward = False
    """True while the stage runs its last backward action of the step (torch's
    ``last_backward``: its last full ``B``, or its last ``W``), after which its gradients are
    final (:meth:`PipelineSchedule.in_last_backward`)."""

    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        ops = super()._get_init_p2p_neighbors_ops()
        return [op for op in ops if op.group_peer != self.group_rank]

    def backward_one_chunk(self, *args: Any, last_backward: bool = False, **kwargs: Any) -> Any:
        self.in_last_backward = last_backward
        try:
            return super().backward_one_chunk(*args, last_backward=last_backward, **kwargs)
        finally:
            self.in_last_backward = False

    def backward_weight_one_chunk(
        self, *args: Any, last_backward: bool = False, **kwargs: Any
    ) -> Any:
        self.in_last_backward = last_backward
        try:
            return super().backward_weight_one_chunk(*args, last_backward=last_backward, **kwargs)
        finally:
            self.in_last_backward = False


class PipelineSchedule:
    """One rank's chunks and a schedule, run by torch's action runtime (module docstring)."""

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        schedule: str,
        pp: int,
        pp_rank: int,
        microbatches: int,
        chunks_asked: int,
        shapes: StageShapes,
        device: torch.device,
        pp_group: dist.ProcessGroup | None,
        loss_fn: Callable[..., Any],
        overlap: bool = True,
    ) -> None:
        v = chunks_per_rank(schedule, chunks_asked)
        placement = stage_to_rank(schedule, pp, v)
        self.stage_ids = sorted(s for s, r in placement.items() if r == pp_rank)
        if len(chunks) != len(self.stage_ids):
            raise ValueError(
                f"rank {pp_rank} of a {schedule} pipeline holds chunks {self.stage_ids}, "
                f"got {len(chunks)} modules"
            )
        self.schedule, self.microbatches, self.num_stages = schedule, microbatches, pp * v
        self.actions = schedule_actions(schedule, pp, microbatches, v)
        split = SCHEDULES[schedule].split_backward
        left_at_i = []
        if split:
            left_at_i = [
                name
                for chunk in chunks
                if _splits_through_sinks(chunk)
                for name in _gemm_weights_outside_sinks(chunk)
            ]
        if left_at_i:
            why = (
                f"torch {torch.__version__}'s split backward counts some weight gradients twice"
                if not TORCH_SPLITS_BACKWARD
                else "torch's split backward would recompute the blocks recomputed whole once "
                "per weight group"
            )
            warnings.warn(
                f"{why}, so pp_schedule={schedule} runs those chunks' backward at their I step "
                "except the weight gradients of layers with a wgrad_sink (the parallel "
                "linears, MoE routers and experts); "
                f"{len(left_at_i)} weights whose gradient is a GEMM get it at I, without the "
                f"zero-bubble gain ({', '.join(left_at_i[:4])}"
                f"{', ...' if len(left_at_i) > 4 else ''}: layers without a sink, FP8 MoE experts "
                "summed over TP in the backward or on the per-expert loop)",
                stacklevel=2,
            )
        self.sinks: list[mt_fp8.WeightGradSink] = []
        stages = []
        for chunk, s in zip(chunks, self.stage_ids, strict=True):
            first, last = s == 0, s == self.num_stages - 1
            stages.append(
                _Stage(
                    chunk, s, self.num_stages, device,
                    input_args=shapes.example("tokens", False) if first
                    else shapes.example("hidden", True),
                    output_args=shapes.example("logits" if last else "hidden", True),
                    group=pp_group,
                    dw_builder=self._weight_grad_sink(chunk, split),
                )
            )  # fmt: skip
        self._loss_fn = loss_fn
        self._result = PipelineStepResult()
        self.runtime = _PipelineScheduleRuntime(
            stages, microbatches, loss_fn=self._scaled_loss, scale_grads=False
        )
        self.runtime._prepare_schedule_with_comms(self.actions)
        self._stage_of = {s.stage_index: s for s in stages}
        self.on_chunk_gradients: Callable[[nn.Module], None] | None = None
        """Called with each chunk once its gradients of the step are complete (module
        docstring); None: nothing."""
        self.reports_chunks = _registers_reduce_grad(self.runtime, self._chunk_done)
        """Whether :attr:`on_chunk_gradients` is called (a torch whose runtime has a
        ``REDUCE_GRAD`` action that takes a custom function)."""
        self.shared_units = SharedUnits(chunks, self.stage_ids)
        """FSDP2 units in more than one of this rank's chunks, reduced once per step
        (:mod:`mt_parallel.pipeline.shared_fsdp`)."""
        if self.shared_units:
            if not self.reports_chunks:
                raise ValueError(
                    f"FSDP2 modules shared by two chunks of a rank need a torch whose pipeline "
                    f"runtime takes a custom REDUCE_GRAD function; torch {torch.__version__} "
                    "does not: use data_parallel ddp, zero1 or none, or a newer torch"
                )
            self.runtime.register_custom_function(
                _ComputationType.RESHARD, self.shared_units.reshard
            )
        pairs = any(a.computation_type == OVERLAP for a in self.actions[pp_rank])
        self.overlaps = overlap and pairs and overlaps_all_to_all(chunks)
        """Whether the ``OVERLAP_F_B`` pairs run their halves interleaved at the MoE
        all-to-alls (:mod:`mt_parallel.pipeline.overlap`); else torch runs them back to back."""
        if self.overlaps:
            self.runtime.register_custom_function(OVERLAP, overlap_forward_backward)

    def in_last_backward(self, chunk: nn.Module) -> bool:
        """Whether ``chunk``'s stage is running its last backward action of the step: a
        gradient that autograd accumulates into one of its parameters now is final for the
        step (a caller can start reducing it; ``W`` actions of torch's split and sinks set
        theirs without autograd's accumulation)."""
        return any(s.in_last_backward for s in self._stage_of.values() if s.submod is chunk)

    def _chunk_done(self, action: Any, ctx: Any) -> None:
        """``REDUCE_GRAD``: torch's own action (FSDP2's post-backward; the runtime's gradient
        scaling is off), then :attr:`on_chunk_gradients`."""
        stage = self._stage_of[action.stage_index]
        stage.perform_reduce_grad(1)
        self.shared_units.chunk_reduced(action.stage_index)
        if self.on_chunk_gradients is not None:
            self.on_chunk_gradients(stage.submod)

    def _weight_grad_sink(
        self, chunk: nn.Module, split: bool
    ) -> Callable[[], Callable[[], None]] | None:
        """A sink shared by the chunk's layers that have one, as torch's ``dw_builder``; None
        without a split backward, or where torch splits it and no layer needs a sink; a no-op
        where the chunk splits through sinks and no layer has one (module docstring: split
        backward). A sink left by an earlier schedule on the same layers is cleared first."""
        deferring = [m for m in chunk.modules() if hasattr(m, "wgrad_sink")]
        for layer in deferring:
            layer.wgrad_sink = None
        optional = all(getattr(m, "wgrad_sink_optional", False) for m in deferring)
        if not split or (optional and not _splits_through_sinks(chunk)):
            return None
        if not deferring:
            return _no_weight_pass
        sink = mt_fp8.WeightGradSink()
        for layer in deferring:
            layer.wgrad_sink = sink
        self.sinks.append(sink)
        return sink.take

    def _scaled_loss(
        self, logits: torch.Tensor, target: tuple[torch.Tensor, float]
    ) -> torch.Tensor:
        targets, factor = target
        value = self._loss_fn(logits, targets)
        loss, extras = value if isinstance(value, tuple) else (value, {})
        if factor != 1.0:
            loss = loss * factor
        self._result.losses.append(loss.detach())
        for name, extra in extras.items():
            self._result.extras[name] = self._result.extras.get(name, 0) + extra.detach().float()
        return loss / self.microbatches

    def step(
        self,
        tokens: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor],
        kwargs: Sequence[dict[str, Any]] | None = None,
        loss_factors: Sequence[float] | None = None,
    ) -> PipelineStepResult:
        """Forward and backward of ``M`` micro-batches; gradients accumulate into ``.grad``
        (not reduced over data-parallel ranks). Every rank passes the same micro-batches."""
        if len(tokens) != self.microbatches or len(targets) != self.microbatches:
            raise ValueError(
                f"the {self.schedule} pipeline runs {self.microbatches} micro-batches per step, "
                f"got {len(tokens)} inputs and {len(targets)} targets"
            )
        factors = list(loss_factors) if loss_factors is not None else [1.0] * self.microbatches
        self._result = PipelineStepResult()
        for stage in self.runtime._stages:
            stage.has_backward = True
            stage.clear_runtime_states()
        chunk_kwargs = [dict(k) for k in kwargs] if kwargs is not None else None
        carrying = [
            s.submod for s in self.runtime._stages if getattr(s.submod, "carries_aux_losses", False)
        ]
        if carrying:
            for chunk in carrying:
                chunk.aux_records = {}
            chunk_kwargs = chunk_kwargs or [{} for _ in range(self.microbatches)]
            for m, k in enumerate(chunk_kwargs):
                k["aux_loss_scale"] = AuxLossScale(m, factors[m] / self.microbatches)
        self.shared_units.start_step()
        self.runtime._step_microbatches(
            [(t.contiguous(),) for t in tokens],
            chunk_kwargs,
            [(y, f) for y, f in zip(targets, factors, strict=True)],
            return_outputs=False,
        )
        self.shared_units.finish_step()
        if any(len(sink) for sink in self.sinks):
            raise RuntimeError("weight gradients were queued but never run (a W is missing)")
        return self._result
