"""``FusedAdamW``: ``torch.optim.AdamW`` whose update is one Triton pass per parameter.

The math is AdamW's (decoupled weight decay ``λ``, step ``t`` counted per parameter)::

    g = grad / grad_scale                      (when ``optimizer.grad_scale`` is set)
    θ ← θ·(1 - lr·λ)
    m ← β₁·m + (1 - β₁)·g,   v ← β₂·v + (1 - β₂)·g²
    θ ← θ - lr/(1 - β₁ᵗ) · m / (√v / √(1 - β₂ᵗ) + ε)

in the order of PyTorch's fused CUDA kernel; :mod:`mt_fp8.kernels.adamw` states the per-element
pass. The bias corrections are computed on the host in float64 from the per-parameter step,
which lives on the CPU (as in PyTorch's non-fused, non-capturable AdamW), so a step never
synchronises with the device. ``grad_scale`` is the hook PyTorch's fused optimizers offer
(the gradient is divided by this device scalar inside the pass): a trainer clips by setting it
to ``max(1, ‖g‖ / clip)`` instead of rescaling every gradient in a pass of its own. Unlike
PyTorch's fused kernel, the pass does not write the divided gradient back: ``p.grad`` keeps the
undivided values.

State and ``state_dict`` are ``torch.optim.AdamW``'s (``step``, ``exp_avg``, ``exp_avg_sq``),
so checkpoints move between the two. Parameters the kernel cannot take (not on a CUDA device
with Triton installed, non-contiguous, sparse gradients, or ``MT_FP8_DISABLE_TRITON=1``) make
the whole step fall back to ``torch.optim.AdamW.step`` (gradients divided by ``grad_scale``
first, in place). ``amsgrad``, ``maximize`` and tensor learning rates are refused.
Why: PyTorch's fused AdamW moves its bytes at a lower rate than a plain streaming pass on the
H200 (docs/performance.md, "AdamW").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from mt_fp8.ops.dispatch import triton_runs_on

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed support has no DTensor
    DTensor = ()  # type: ignore[assignment,misc]

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class FusedAdamW(torch.optim.AdamW):
    """AdamW with a Triton update (module docstring); arguments as ``torch.optim.AdamW``'s."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        if isinstance(lr, torch.Tensor):
            raise TypeError("FusedAdamW takes a float learning rate, got a tensor")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def kernel_takes(self, param: torch.Tensor) -> bool:
        """Whether the Triton pass can update ``param`` (module docstring)."""
        return self._kernel_takes_all([param])

    @staticmethod
    def _kernel_takes_all(params: list[torch.Tensor]) -> bool:
        """:meth:`kernel_takes` for every parameter. Whether Triton runs on a device type is read
        once per type (it reads environment variables), not once per tensor: the check runs
        after the trainer's host sync, while the device waits for the first launch; per
        tensor it was a visible part of the step's host time (``benchmarks/adamw_host.py``;
        docs/performance.md, "AdamW")."""
        runs_on: dict[str, bool] = {}
        for param in params:
            grad = param.grad
            if grad is None or grad.is_sparse:
                return False
            for device_type in (param.device.type, grad.device.type):
                if device_type not in runs_on:
                    runs_on[device_type] = triton_runs_on(device_type)
                if not runs_on[device_type]:
                    return False
            if not (
                param.dtype in KERNEL_DTYPES
                and param.is_contiguous()
                and grad.is_contiguous()
                and grad.shape == param.shape
                and not isinstance(param, DTensor)
            ):
                return False
        return True

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not self._kernel_takes_all(params):
            if grad_scale is None:
                super().step()
                return loss
            for p in params:
                p.grad.div_(grad_scale.to(p.grad.device))
            # PyTorch's non-fused step refuses a set grad_scale: hide it for the call.
            del self.grad_scale
            try:
                super().step()
            finally:
                self.grad_scale = grad_scale
            return loss
        from mt_fp8.kernels.adamw import adamw_update_

        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"]:
                raise ValueError("FusedAdamW supports neither amsgrad nor maximize")
            lr, (beta1, beta2) = float(group["lr"]), group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                if state["step"].device.type != "cpu":  # e.g. loaded from a fused checkpoint
                    state["step"] = state["step"].cpu()
                state["step"] += 1
                t = float(state["step"])
                adamw_update_(
                    param,
                    param.grad,
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    grad_scale,
                    decay=1.0 - lr * group["weight_decay"],
                    beta1=beta1,
                    beta2=beta2,
                    step_size=lr / (1.0 - beta1**t),
                    bc2_sqrt=math.sqrt(1.0 - beta2**t),
                    eps=group["eps"],
                )
        return loss
