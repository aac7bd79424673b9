"""How a step's gradients become a norm and, once the step is judged healthy, an update.

Three policies, chosen once from the optimizer (:func:`update_policy`):

* :class:`Zero1Update` (``parallel.data_parallel=zero1``): ``norm`` reduce-scatters the
  gradients and returns the global norm (:meth:`mt_parallel.DistributedOptimizer.reduce_gradients`);
  ``apply`` clips, decays, updates this rank's shard and all-gathers the parameters.
* :class:`FusedClipUpdate` (fused AdamW kernels: PyTorch's ``fused=True`` and
  :class:`mt_fp8.FusedAdamW`): the kernels divide the gradients by ``optimizer.grad_scale``
  inside their pass (the hook GradScaler uses), so the clip is that divisor,
  ``max(1, (n + 1e-6) / clip)`` (the reciprocal of ``torch.nn.utils.clip_grad_norm_``'s
  coefficient), and costs no pass of its own over the gradients.
* :class:`ClipThenStep` (everything else): ``norm`` clips the gradients in place
  (:func:`mt_parallel.clip_grad_norm_`), ``apply`` is ``optimizer.step()``.

``graph_norm`` is the norm computation when it may be captured in the step's CUDA graph with
the backward (nothing has to run between them), else None. Nothing here synchronises with the
host: the norm stays a device tensor until the step's one synchronisation.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import mt_fp8
import mt_parallel
from mt_train.optim import Zero1AdamW


class ClipThenStep:
    """Clip the gradients in place while measuring their norm; then ``optimizer.step()``."""

    def __init__(
        self, optimizer: Any, clip: float, tp_group: Any, dp_cp_group: Any, mp_group: Any = None
    ) -> None:
        self.optimizer, self.clip = optimizer, clip
        self.tp_group, self.dp_cp_group, self.mp_group = tp_group, dp_cp_group, mp_group

    @property
    def graph_norm(self) -> Any:
        return self.norm

    def norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        return mt_parallel.clip_grad_norm_(
            params, self.clip, self.tp_group, self.mp_group, self.dp_cp_group
        )

    def apply(self, norm: torch.Tensor) -> None:
        self.optimizer.step()


class FusedClipUpdate(ClipThenStep):
    """Measure the norm only; the fused AdamW applies the clip as its ``grad_scale``."""

    def norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        return mt_parallel.clip_grad_norm_(
            params, 0.0, self.tp_group, self.mp_group, self.dp_cp_group
        )

    def apply(self, norm: torch.Tensor) -> None:
        self.optimizer.grad_scale = torch.clamp((norm + 1e-6) / self.clip, min=1.0)
        self.optimizer.step()
        del self.optimizer.grad_scale


class Zero1Update:
    """ZeRO-1's split step: reduce-scatter and norm now, clip and update once judged."""

    graph_norm = None

    def __init__(self, optimizer: Zero1AdamW, clip: float) -> None:
        self.optimizer, self.clip = optimizer, clip

    def norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        return self.optimizer.reduce_gradients()

    def apply(self, norm: torch.Tensor) -> None:
        self.optimizer.apply_update(self.clip)


UpdatePolicy = ClipThenStep | Zero1Update


def update_policy(
    optimizer: Any, clip: float, tp_group: Any, dp_cp_group: Any, mp_group: Any = None
) -> UpdatePolicy:
    """The policy for ``optimizer`` with gradient clip ``clip`` (0: none) (module docstring).
    ``mp_group`` (tp×pp, default the tp group) is where the squared norms of different
    parameters are summed: under pipeline parallelism each stage holds its own."""
    if isinstance(optimizer, Zero1AdamW):
        return Zero1Update(optimizer, clip)
    fused = isinstance(optimizer, mt_fp8.FusedAdamW) or bool(optimizer.defaults.get("fused"))
    if fused and clip > 0:
        return FusedClipUpdate(optimizer, clip, tp_group, dp_cp_group, mp_group)
    return ClipThenStep(optimizer, clip, tp_group, dp_cp_group, mp_group)
