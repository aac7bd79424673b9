"""Deferred weight gradients: the weight-gradient GEMMs of a backward, run later on demand.

Zero-bubble pipeline schedules (ZB-H1, ZBV, DualPipeV) split a chunk's backward into ``I``
(input gradients, which the previous stage waits for) and ``W`` (weight gradients, which only
the optimizer needs) and fill pipeline bubbles with ``W``. For an FP8 linear both come out of
one autograd node, so autograd cannot run one without the other. A :class:`WeightGradSink`
set on a layer (``FP8Linear.wgrad_sink``, ``FP8GroupedLinear.wgrad_sink``) separates them: the
layer's backward computes ``dx`` and hands the sink a closure for ``dw = dyᵀ·x`` (and
``db = Σ dy``) instead of returning them (:func:`weight_gradients_or_deferred`);
:meth:`WeightGradSink.take` returns the closures queued since the last call as one function,
which later adds ``dw``/``db`` into ``weight.grad``/``bias.grad`` as autograd would (assigned
when None, added otherwise), with grad mode off as in autograd's backward: the operands a
closure reads (saved inputs, unpacked) may require grad, and a gradient built with grad mode
on would carry a graph holding them.

Invariant: the deferred closure runs the same quantized operands through the same GEMM as the
fused backward (the quantization of ``dy`` and its transpose happen once, in the ``I`` part),
so a deferred weight gradient equals the fused one bit for bit.

What a queued closure holds. Autograd releases a node's saved tensors once its backward has
run, but a closure queued there keeps what it reads (the layer's input, ``dy``, their
quantized forms) alive until it has run and been dropped. Each caller passes those tensors as
``defer(compute, holds=...)``: every tensor ``compute`` reads other than the parameters
(Nones are skipped). A sink stores no more than the closure itself; ``holds`` is what it
reports to its :attr:`WeightGradSink.observers` (an activation meter,
:class:`mt_parallel.pipeline.memory.ActivationMeter`, counts those bytes until the closure is
freed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Holds = Sequence[torch.Tensor | None]
"""The tensors a queued computation reads, besides the parameters (module docstring)."""


class WeightGradSink:
    """A queue of deferred weight-gradient computations (module docstring)."""

    def __init__(self) -> None:
        self._pending: list[Callable[[], None]] = []
        self.observers: list[Callable[[Callable[[], None], list[torch.Tensor]], None]] = []
        """Called with each queued computation and the tensors it holds (module docstring)."""

    def __len__(self) -> int:
        return len(self._pending)

    def defer(self, compute: Callable[[], None], holds: Holds = ()) -> None:
        """Queue ``compute`` (it adds its gradients into the parameters when called), which
        reads ``holds`` (module docstring)."""
        self._pending.append(compute)
        held = [t for t in holds if t is not None]
        for observe in self.observers:
            observe(compute, held)

    def take(self) -> Callable[[], None]:
        """One function running every computation queued since the last ``take``."""
        pending, self._pending = self._pending, []

        def run() -> None:
            with torch.no_grad():
                for compute in pending:
                    compute()

        return run


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor | None) -> None:
    """``param.grad += grad`` as autograd's accumulation does (assigned when None)."""
    if grad is None:
        return
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


def weight_gradients_or_deferred(
    sink: WeightGradSink | None,
    params: Sequence[torch.Tensor | None],
    compute: Callable[[], Sequence[torch.Tensor | None]],
    holds: Holds = (),
) -> tuple[torch.Tensor | None, ...]:
    """``compute()``, the gradients of ``params`` (weight, bias), for a backward to return; with
    a ``sink``, ``compute`` (reading ``holds``) is queued there instead, accumulating them into
    the parameters when run, and the backward returns Nones (module docstring)."""
    if sink is None:
        return tuple(compute())

    def deferred() -> None:
        for param, grad in zip(params, compute(), strict=True):
            if param is not None:
                accumulate_grad(param, grad)

    sink.defer(deferred, holds)
    return (None,) * len(params)
