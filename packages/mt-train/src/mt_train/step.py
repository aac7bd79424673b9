"""The forward and backward of one optimizer step's micro-batches, as objects the trainer calls.

:class:`BatchRunner` is the model side: one micro-batch's loss on the parallel model (under CP,
this rank's load-balanced part of the tokens and their global positions; autocast if asked)
and the accumulation loop over a step's micro-batches::

    for m < A:  loss_m, extras_m = model.loss(model(x_m), y_m);  backward(loss_m · f_m / A)

(``f_m`` a fault drill's loss factor times, for data with masked targets, the weight that makes
the step's loss the global batch's masked mean, :mod:`mt_train.loss_weights`; 1 otherwise; gradients reduced over dp×cp only at the
last micro-batch, :func:`mt_parallel.accumulate`). A step object runs it and returns a
:class:`StepResult`: :class:`EagerStep` launches every kernel from Python;
:class:`mt_train.cuda_graph.GraphedStep` replays a captured CUDA graph. Both share
``run(batches, loss_factors, grad_norm, eager) -> StepResult`` and ``reset()``, so the trainer
does not know which one it calls (a pipeline-parallel schedule is a third,
:class:`mt_train.pipeline_step.PipelineStep`). ``extras`` are the
model's named extra values (:mod:`mt_train.models.family`), summed over micro-batches like
the loss; none of this synchronises with the host.

Context parallelism (``parallel.cp > 1``). The ``cp`` ranks of one dp index draw the same
samples; each keeps its load-balanced part of the inputs, targets and document ids
(``mt_parallel.shard_sequence``: chunks ``r`` and ``2·cp−1−r`` of ``2·cp``) and passes the
global positions of those tokens to the model. Every rank holds ``T/cp`` tokens of each
sample, so its mean loss averaged over dp×cp is the mean over the global batch, and DDP /
FSDP2 / ZeRO-1 averaging gradients over dp×cp gives that loss's gradient. A model whose
inputs reach across the cut (DeepSeek-V3's multi-token prediction reads token ``t+k`` at
position ``t``) has a ``sequence_inputs(tokens, targets, document_ids) -> {name: (B, T,
...)}`` hook: the runner calls it on the whole micro-batch, cuts each tensor like the tokens
and passes them as keyword inputs, so nothing shifted crosses ranks; a loss over targets that
the ranks hold in unequal numbers is that model's to normalise
(``mt_parallel.sequence_mean_cross_entropy``).

Document masking (``data.document_masking``, or image-text samples packed by
``data.pack_samples``): batches carry per-token document ids and
attention stays inside each packed document (:mod:`mt_train.data.dataset`), by the kernel the
trainer gave the attention cores (``data.document_masking_kernel``,
:mod:`mt_parallel.document_attention`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import mt_fp8
import mt_parallel
from mt_train import ranks
from mt_train.data.dataset import Batch

GradNorm = Callable[[list[nn.Parameter]], torch.Tensor]


@dataclass
class StepResult:
    """What a step's forward and backward leave on the device."""

    total: torch.Tensor
    """Sum of the micro-batches' losses (0-d)."""
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    """Sum over the micro-batches of each extra value the model reports."""
    norm: torch.Tensor | None = None
    """The gradient norm, when the step computed it (captured with a CUDA graph)."""


@dataclass
class StepNumbers:
    """A step's numbers on the host (what the detectors judge and the logs show)."""

    local_loss: float
    """This rank's mean micro-batch loss."""
    loss: float
    """The mean over dp×cp ranks: the global batch's loss."""
    grad_norm: float
    extras: dict[str, float]
    """The model's extra values, averaged over the micro-batches."""
    fp8_saturation: float | None = None
    """The worst saturated fraction of any FP8 tensor (when FP8 health is watched)."""
    fp8_worst: str = ""
    """Where it happened (empty when nothing saturated)."""


def read_step_numbers(
    result: StepResult,
    micro_batches: int,
    norm: torch.Tensor,
    dp_cp_group: Any,
    fp8_model: nn.Module | None = None,
) -> StepNumbers:
    """Everything a step reports, moved to the host in one synchronisation: the losses, the
    gradient norm, the model's extras and (with ``fp8_model``) the FP8 saturation summary
    (``mt_fp8.fp8_saturation_summary``, reduced on the device)."""
    local = result.total / micro_batches
    names = sorted(result.extras)
    judged = [local.double(), ranks.mean_scalar(local, dp_cp_group).double(), norm.double()]
    judged += [(result.extras[n] / micro_batches).double() for n in names]
    places: list[str] = []
    if fp8_model is not None:
        saturation, places = mt_fp8.fp8_saturation_summary(fp8_model)
        judged += saturation.unbind()
    values = torch.stack(judged).tolist()
    numbers = StepNumbers(*values[:3], dict(zip(names, values[3 : 3 + len(names)], strict=True)))
    if fp8_model is not None:
        worst, place = values[3 + len(names) :]
        numbers.fp8_saturation = worst
        numbers.fp8_worst = places[int(place)] if worst > 0 else ""
    return numbers


class BatchRunner:
    """One micro-batch's loss and a step's forward/backward on the parallel model."""

    def __init__(
        self,
        model: nn.Module,
        module: nn.Module,
        device: torch.device,
        cp_group: Any,
        cp: int,
        cp_rank: int,
        autocast_dtype: torch.dtype | None,
    ) -> None:
        self.model, self.module, self.device = model, module, device
        self.cp_group, self.cp, self.cp_rank = cp_group, cp, cp_rank
        self.autocast_dtype = autocast_dtype

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def local_batch(
        self, batch: Batch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """This rank's inputs, targets, document ids and positions of one micro-batch: all
        tokens, or under CP its load-balanced part and their global positions."""
        inputs, targets, docs = batch.inputs, batch.targets, batch.document_ids
        positions = None
        if self.cp > 1:
            seq_len = inputs.shape[1]
            inputs, targets, docs = (
                None if x is None else mt_parallel.shard_sequence(x, 1, self.cp_group)
                for x in (inputs, targets, docs)
            )
            positions = mt_parallel.load_balanced_positions(seq_len, self.cp, self.cp_rank)
            positions = positions.to(self.device)
        return inputs, targets, docs, positions  # type: ignore[return-value]

    def model_inputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The model's keyword inputs beyond tokens, positions and document ids: the batch's
        (images) and the per-token inputs the model derives from the whole sequence (its
        ``sequence_inputs`` hook, module docstring), under CP cut like the tokens."""
        derived = self.derived_inputs(batch, getattr(self.module, "sequence_inputs", None))
        return {**batch.model_inputs(), **derived}

    def derived_inputs(
        self, batch: Batch, derive: Callable[..., dict[str, torch.Tensor]] | None
    ) -> dict[str, torch.Tensor]:
        """``derive(tokens, targets, document_ids)`` on the whole micro-batch (a model's
        ``sequence_inputs`` hook), under CP each tensor cut like the tokens; empty without."""
        if derive is None:
            return {}
        derived = derive(batch.inputs, batch.targets, batch.document_ids)
        if self.cp > 1:
            derived = {
                k: mt_parallel.shard_sequence(v, 1, self.cp_group) for k, v in derived.items()
            }
        return derived

    def micro_loss(self, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Mean next-token cross-entropy over this rank's tokens of one micro-batch (fp32):
        all of them, or under CP its load-balanced part; and the model's extra values."""
        inputs, targets, docs, positions = self.local_batch(batch)
        with self.autocast():
            logits = self.model(inputs, positions, docs, **self.model_inputs(batch))
        # The loss upcasts the (bf16) logits to fp32 a chunk at a time and returns their gradient
        # in their dtype: no fp32 copy of the (tokens × vocab) logits is ever materialised.
        loss = self.module.loss(logits, targets)
        return loss if isinstance(loss, tuple) else (loss, {})

    def forward_backward(
        self, batches: list[Batch], loss_factors: list[float] | torch.Tensor | None = None
    ) -> StepResult:
        """Forward and backward of one step's micro-batches (module docstring); the factors
        ``f_m`` as host numbers, or as a device tensor of ``A`` values that every micro-batch's
        loss is multiplied by (a captured step's input, :mod:`mt_train.cuda_graph`)."""
        total = torch.zeros((), device=self.device)
        extras: dict[str, torch.Tensor] = {}
        for m, batch in enumerate(batches):
            with mt_parallel.accumulate(self.model, is_last=m == len(batches) - 1):
                loss, values = self.micro_loss(batch)
                factor = None if loss_factors is None else loss_factors[m]
                # A device factor is always applied: comparing it on the host would synchronise.
                if isinstance(factor, torch.Tensor) or (factor is not None and factor != 1.0):
                    loss = loss * factor
                (loss / len(batches)).backward()
            total += loss.detach()
            for name, value in values.items():
                extras[name] = extras.get(name, 0) + value.detach().float()
        return StepResult(total, extras)


class EagerStep:
    """The step as plain PyTorch calls (module docstring)."""

    def __init__(self, runner: BatchRunner) -> None:
        self.runner = runner

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
        """Forward and backward; ``grad_norm`` is left to the caller (computed after)."""
        return self.runner.forward_backward(batches, loss_factors)

    def reset(self) -> None:
        """Nothing is cached between steps."""
