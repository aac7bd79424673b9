"""CUDA-graph replay of a training step's forward and backward passes (``trainer.cuda_graph``).

An eager step launches every kernel from Python. When the kernels are short (FP8 GEMMs, the
quantizers and fused ops around them) the device waits for the host (docs/performance.md,
"dense Llama slice"). A CUDA graph records the kernels once and replays them with one launch.
:class:`GraphedStep` is the step object (:mod:`mt_train.step`) that does this.

What is captured, for the ``A`` micro-batches of one optimizer step::

    total = 0
    for m < A:  loss_m = micro_loss(batch_m) · f[m];  backward(loss_m / A);  total += loss_m

with ``f`` a device tensor of the step's ``A`` loss factors (:mod:`mt_train.step`: the
masked-target weights of :mod:`mt_train.loss_weights` times a fault drill's loss factor):
everything from the batches being on the device to the gradients being complete, and,
when nothing has to happen between the backward and the norm (one data-parallel rank, no
ZeRO-1), the global gradient norm (``mt_parallel.clip_grad_norm_``, as the eager step calls it):
its multi-tensor kernels then replay with the rest. What follows (the gradient all-reduce of ``data_parallel=none`` or
ZeRO-1's reduce-scatter and the norm when they are not captured, the one host synchronisation
the anomaly detectors need, the optimizer, the delayed-scaling update) runs eagerly after the
replay, as in the eager step, so a step judged anomalous is still never applied. A step with an
injected gradient fault computes the norm eagerly after the fault.

Invariants a replay relies on:

* Fixed addresses. Each micro-batch (tokens, targets, document ids, images) and the step's
  loss factors are copied into input buffers allocated at capture (the factors as float32,
  the number an eager step's ``loss * f_m`` multiplies the fp32 loss by, so a replay and an
  eager step compute the same products);
  parameters are updated in place and never replaced (the trainer drops the graph whenever it
  loads or restores state, and recaptures at the next step); the gradients are the tensors the
  capture allocated, re-attached to ``p.grad`` after every replay (the step's
  ``zero_grad(set_to_none=True)`` only drops the references; the graph keeps writing the same
  memory, and the first micro-batch's gradient overwrites rather than adds, as in the capture).
* No host synchronisation or host-side decision on device values inside the forward/backward.
  FP8 scales, amax histories and health counters are device tensors updated in place. The FP8
  layers' weight cache is Python state, but it does not change which kernels run: the capture
  happens at a step's first forward after an optimizer step, so it records the weight
  quantization, and every replay quantizes the new weights.
* Same shapes every step (fixed ``seq_len`` and micro-batch size, and for image-text data the
  same number of images in every micro-batch: with ``trainer.cuda_graph`` the data pads each
  batch to a fixed count, :mod:`mt_train.data.image_text`; another number is refused in one
  line).
* No collectives inside the forward/backward: ``parallel.tp = cp = pp = 1`` and no DDP/FSDP
  wrapper (``data_parallel`` none or zero1, or a single data-parallel rank).
* No dropout: its random streams would have to be registered with the graph.

The first step of a run (or after a resume) runs eagerly: it compiles the Triton kernels and
initialises cuBLAS, none of which may happen during capture. The capture then happens at the
next step, after ``torch.cuda.empty_cache()`` so that the eager step's cached blocks do not sit
beside the graph's private memory pool. A capture records without computing, so the capturing
step replays the graph once to do its work. Loss factors are inputs, so data with masked
targets (unequal weights every step) and the loss faults (``fault.nan_at_step``,
``spike_at_step``, ``bad_batch_at_step``) replay the graph; only a step whose kernels differ
runs eagerly: ``fault.fp8_overflow_at_step``'s hooks scale the FP8 layers' inputs on a host
decision, extra kernels the graph did not record (``GraphedStep.run(eager=True)``).
:attr:`GraphedStep.replays` counts replays, and a run whose steps all ran eagerly says so
(:meth:`GraphedStep.never_replayed`), so a run that asked for the graph cannot lose it
silently.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import mt_parallel
from mt_train.data.dataset import Batch
from mt_train.step import BatchRunner, GradNorm, StepResult

StepFunction = Callable[[list[Batch], torch.Tensor], StepResult]
"""``micro_batches(batches, factors)``: a step's forward and backward with each micro-batch's
loss times its factor (``BatchRunner.forward_backward``)."""


class StepGraph:
    """A captured forward + backward of one step's micro-batches (module docstring)."""

    def __init__(
        self,
        graph: Any,
        inputs: list[Batch],
        factors: torch.Tensor,
        result: StepResult,
        grads: list[tuple[nn.Parameter, torch.Tensor]],
    ) -> None:
        self.graph = graph
        """What ``run`` replays (a ``torch.cuda.CUDAGraph``: anything with ``replay()``)."""
        self.inputs = inputs
        self.factors = factors
        """The loss factors the graph reads, one per micro-batch (float32, on the device)."""
        self.result = result
        """The captured loss, extras and norm (tensors each replay overwrites)."""
        self.grads = grads

    @property
    def norm(self) -> torch.Tensor | None:
        """The captured gradient norm, or None when it is computed after the replay."""
        return self.result.norm

    @staticmethod
    def input_buffers(
        batches: list[Batch], loss_factors: list[float] | None = None
    ) -> tuple[list[Batch], torch.Tensor]:
        """Buffers for a replay's inputs: copies of ``batches`` and a float32 tensor of the
        loss factors (ones when None) on the batches' device."""
        inputs = [
            Batch(
                b.inputs.clone(),
                b.targets.clone(),
                None if b.document_ids is None else b.document_ids.clone(),
                None if b.images is None else b.images.clone(),
            )
            for b in batches
        ]
        return inputs, factor_tensor(loss_factors, len(batches), batches[0].inputs.device)

    @classmethod
    def capture(
        cls,
        micro_batches: StepFunction,
        batches: list[Batch],
        params: list[nn.Parameter],
        grad_norm: GradNorm | None = None,
    ) -> StepGraph:
        """Record ``micro_batches(inputs, factors)`` (forward and backward of every micro-batch,
        each loss times its factor, returning the summed loss and extras) on input buffers
        shaped like ``batches``, then ``grad_norm(parameters with a gradient)`` if given
        (module docstring); computes nothing."""
        inputs, factors = cls.input_buffers(batches)
        for p in params:
            p.grad = None  # the capture allocates the gradients in the graph's pool
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                result = micro_batches(inputs, factors)
                if grad_norm is not None:
                    result.norm = grad_norm([p for p in params if p.grad is not None])
        except torch.cuda.OutOfMemoryError as err:
            # A capture can fail on fragmentation alone where the eager step fits, and expandable
            # segments fixed it (docs/performance.md, "32 layers").
            raise RuntimeError(
                "trainer.cuda_graph=true: the captured step needs its own memory pool beside the "
                f"weights and optimizer state, and it did not fit ({err}); start the run with "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less fragmentation) or set "
                "trainer.cuda_graph=false (eager steps share the allocator's cached blocks)"
            ) from err
        except Exception as err:
            raise RuntimeError(
                "trainer.cuda_graph=true: capturing the forward/backward failed "
                f"({type(err).__name__}: {err}); something in the model synchronises with the "
                "host or varies between steps; set trainer.cuda_graph=false"
            ) from err
        grads = [(p, p.grad) for p in params if p.grad is not None]
        return cls(graph, inputs, factors, result, grads)

    def run(self, batches: list[Batch], loss_factors: list[float] | None = None) -> StepResult:
        """Copy ``batches`` and ``loss_factors`` (ones when None) into the input buffers,
        replay, re-attach the gradients; returns the captured result (tensors the next replay
        overwrites)."""
        if len(batches) != len(self.inputs):
            raise ValueError(
                f"the step graph was captured for {len(self.inputs)} micro-batches, "
                f"got {len(batches)}"
            )
        # Pinned, so the copy does not wait for the device; the allocator keeps the block
        # until the copy has read it.
        factors = factor_tensor(loss_factors, len(batches), pin_memory=self.factors.is_cuda)
        for static, batch in zip(self.inputs, batches, strict=True):
            if (batch.document_ids is None) != (static.document_ids is None):
                raise ValueError("document ids present in some steps and not in others")
            if (batch.images is None) != (static.images is None) or (
                batch.images is not None and batch.images.shape != static.images.shape
            ):
                raise ValueError(
                    "trainer.cuda_graph=true replays a step captured with images of shape "
                    f"{None if static.images is None else tuple(static.images.shape)}, got "
                    f"{None if batch.images is None else tuple(batch.images.shape)}: every "
                    "micro-batch needs the same number of images; set trainer.cuda_graph=false"
                )
            static.inputs.copy_(batch.inputs, non_blocking=True)
            static.targets.copy_(batch.targets, non_blocking=True)
            if batch.document_ids is not None:
                static.document_ids.copy_(batch.document_ids, non_blocking=True)
            if batch.images is not None:
                static.images.copy_(batch.images, non_blocking=True)
        self.factors.copy_(factors, non_blocking=True)
        self.graph.replay()
        for p, grad in self.grads:
            p.grad = grad
        return self.result


class GraphedStep:
    """The step by CUDA-graph replay (module docstring): eager the first time (warm-up) and
    when ``eager`` is asked, captured the next, replayed after; :meth:`reset` drops the graph
    (after a load or a rewind) so the next step captures again."""

    def __init__(self, runner: BatchRunner) -> None:
        self.runner = runner
        self.graph: StepGraph | None = None
        self._warm = False
        self.replays = 0
        """Steps that replayed the graph (the capturing one included)."""
        self.eager_steps = 0
        """Steps that ran eagerly (the warm-up included)."""

    @classmethod
    def for_run(
        cls, runner: BatchRunner, parallel: Any, dropout: float, dp_cp_size: int
    ) -> GraphedStep:
        """The graphed step of a run, or a ValueError naming every reason it cannot capture."""
        blockers = cuda_graph_blockers(
            runner.device.type, parallel.tp, parallel.cp, parallel.pp, dropout,
            parallel.data_parallel, dp_cp_size,
        )  # fmt: skip
        if mt_parallel.moe.moe_layers(runner.module):
            blockers.append("MoE layers read their routing's group sizes on the host")
        if blockers:
            raise ValueError(
                "trainer.cuda_graph=true cannot capture this run's step: "
                + "; ".join(blockers)
                + " (mt_train.cuda_graph lists what a captured step needs)"
            )
        return cls(runner)

    def run(
        self,
        batches: list[Batch],
        loss_factors: list[float] | None = None,
        grad_norm: GradNorm | None = None,
        eager: bool = False,
    ) -> StepResult:
        """Forward and backward (and ``grad_norm``, captured with them when given); ``eager``:
        a step whose kernels the graph did not record (module docstring)."""
        if not self._warm:
            self._warm = True
            self.eager_steps += 1
            # The kernels the capture will record, the multiply by a device factor included.
            factors = factor_tensor(loss_factors, len(batches), self.runner.device)
            return self.runner.forward_backward(batches, factors)
        if eager:
            self.eager_steps += 1
            return self.runner.forward_backward(batches, loss_factors)
        if self.graph is None:
            params = [p for p in self.runner.module.parameters() if p.requires_grad]
            self.graph = StepGraph.capture(self.runner.forward_backward, batches, params, grad_norm)
        self.replays += 1
        return self.graph.run(batches, loss_factors)

    def reset(self) -> None:
        self.graph = None

    def never_replayed(self) -> str | None:
        """A warning when more than the warm-up step ran and none replayed the graph (every
        step ran eagerly, so ``trainer.cuda_graph`` bought nothing); None otherwise."""
        if self.replays > 0 or self.eager_steps < 2:
            return None
        return (
            f"trainer.cuda_graph=true, but all {self.eager_steps} steps of this run ran eagerly "
            "and none replayed the captured step graph (mt_train.cuda_graph lists what runs "
            "eagerly)"
        )


def factor_tensor(
    loss_factors: list[float] | None,
    count: int,
    device: torch.device | None = None,
    pin_memory: bool = False,
) -> torch.Tensor:
    """The step's ``count`` loss factors (ones when None) as a float32 tensor: the number an
    eager step's ``loss * f_m`` multiplies the fp32 loss by (module docstring)."""
    if loss_factors is not None and len(loss_factors) != count:
        raise ValueError(
            f"got {len(loss_factors)} loss factors for {count} micro-batches; "
            "give one per micro-batch"
        )
    values = [1.0] * count if loss_factors is None else loss_factors
    return torch.tensor(values, dtype=torch.float32, device=device, pin_memory=pin_memory)


def cuda_graph_blockers(
    device_type: str,
    tp: int,
    cp: int,
    pp: int,
    dropout: float,
    data_parallel: str,
    dp_cp_size: int,
) -> list[str]:
    """Why a step of this run cannot be captured (module docstring: invariants); empty if it can."""
    reasons = []
    if device_type != "cuda":
        reasons.append(f"device {device_type!r} is not cuda")
    for name, degree in (("tp", tp), ("cp", cp), ("pp", pp)):
        if degree > 1:
            reasons.append(f"parallel.{name}={degree} puts collectives inside the backward")
    if data_parallel in ("ddp", "fsdp") and dp_cp_size > 1:
        reasons.append(
            f"parallel.data_parallel={data_parallel} over {dp_cp_size} ranks reduces gradients "
            "inside the backward (none and zero1 reduce after it)"
        )
    if dropout > 0:
        reasons.append(f"model.dropout={dropout} draws random numbers the graph would repeat")
    return reasons
