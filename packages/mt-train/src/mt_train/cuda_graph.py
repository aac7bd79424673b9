"""CUDA-graph replay of a training step's forward and backward passes (``trainer.cuda_graph``).

An eager step launches every kernel from Python. When the kernels are short (FP8 GEMMs, the
quantizers and fused ops around them) the device waits for the host (docs/performance.md,
"dense Llama slice"). A CUDA graph records the kernels once and replays them with one launch.
:class:`GraphedStep` is the step object (:mod:`mt_train.step`) that does this.

What is captured, for the ``A`` micro-batches of one optimizer step::

    total = 0
    for m < A:  loss_m = micro_loss(batch_m);  backward(loss_m / A);  total += loss_m

i.e. everything from the batches being on the device to the gradients being complete, and,
when nothing has to happen between the backward and the norm (one data-parallel rank, no
ZeRO-1), the global gradient norm (``mt_parallel.clip_grad_norm_``, as the eager step calls it):
its multi-tensor kernels then replay with the rest. What follows (the gradient all-reduce of ``data_parallel=none`` or
ZeRO-1's reduce-scatter and the norm when they are not captured, the one host synchronisation
the anomaly detectors need, the optimizer, the delayed-scaling update) runs eagerly after the
replay, as in the eager step, so a step judged anomalous is still never applied. A step with an
injected gradient fault computes the norm eagerly after the fault.

Invariants a replay relies on:

* Fixed addresses. Each micro-batch (tokens, targets, document ids, images) is copied into an
  input buffer allocated at capture;
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
step replays the graph once to do its work. A step with an injected fault (``fault.*``: a loss
or input factor that changes the kernels) runs eagerly.
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


class StepGraph:
    """A captured forward + backward of one step's micro-batches (module docstring)."""

    def __init__(
        self,
        graph: torch.cuda.CUDAGraph,
        inputs: list[Batch],
        result: StepResult,
        grads: list[tuple[nn.Parameter, torch.Tensor]],
    ) -> None:
        self.graph = graph
        self.inputs = inputs
        self.result = result
        """The captured loss, extras and norm (tensors each replay overwrites)."""
        self.grads = grads

    @property
    def norm(self) -> torch.Tensor | None:
        """The captured gradient norm, or None when it is computed after the replay."""
        return self.result.norm

    @classmethod
    def capture(
        cls,
        micro_batches: Callable[[list[Batch]], StepResult],
        batches: list[Batch],
        params: list[nn.Parameter],
        grad_norm: GradNorm | None = None,
    ) -> StepGraph:
        """Record ``micro_batches(inputs)`` (forward and backward of every micro-batch, returning
        the summed loss and extras) on input buffers shaped like ``batches``, then
        ``grad_norm(parameters with a gradient)`` if given (module docstring); computes
        nothing."""
        inputs = [
            Batch(
                b.inputs.clone(),
                b.targets.clone(),
                None if b.document_ids is None else b.document_ids.clone(),
                None if b.images is None else b.images.clone(),
            )
            for b in batches
        ]
        for p in params:
            p.grad = None  # the capture allocates the gradients in the graph's pool
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                result = micro_batches(inputs)
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
        return cls(graph, inputs, result, grads)

    def run(self, batches: list[Batch]) -> StepResult:
        """Copy ``batches`` into the input buffers, replay, re-attach the gradients; returns
        the captured result (tensors the next replay overwrites)."""
        if len(batches) != len(self.inputs):
            raise ValueError(
                f"the step graph was captured for {len(self.inputs)} micro-batches, "
                f"got {len(batches)}"
            )
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
        self.graph.replay()
        for p, grad in self.grads:
            p.grad = grad
        return self.result


class GraphedStep:
    """The step by CUDA-graph replay (module docstring): eager the first time (warm-up) and
    for fault steps, captured the next, replayed after; :meth:`reset` drops the graph (after
    a load or a rewind) so the next step captures again."""

    def __init__(self, runner: BatchRunner) -> None:
        self.runner = runner
        self.graph: StepGraph | None = None
        self._warm = False

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
        """Forward and backward (and ``grad_norm``, captured with them when given)."""
        if eager:
            return self.runner.forward_backward(batches, loss_factors)
        if not self._warm:
            self._warm = True
            return self.runner.forward_backward(batches)
        if self.graph is None:
            params = [p for p in self.runner.module.parameters() if p.requires_grad]
            self.graph = StepGraph.capture(self.runner.forward_backward, batches, params, grad_norm)
        return self.graph.run(batches)

    def reset(self) -> None:
        self.graph = None


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
