"""MoE auxiliary losses under pipeline parallelism: carried on the activations, logged per stage.

At ``pp = 1`` the model adds ``Σ_layers (aux + z)`` to its loss (:func:`collect_aux_losses`).
Under a pipeline the layers of stage ``s`` run where no loss exists, so each pipeline chunk
attaches its layers' sum ``a_m`` of micro-batch ``m`` to its output ``h`` (Megatron's
``MoEAuxLossAutoScaler``)::

    forward:   h' = h                       (identity; nothing crosses stages but h)
    backward:  ∂/∂h = ∂/∂h',   ∂/∂a_m = c_m,   c_m = f_m / M

``c_m`` is the weight the micro-batch's loss carries in the step's backward (``f_m`` its loss
factor, ``M`` the micro-batch count), so every router receives exactly the gradient of
``Σ_m f_m·(CE_m + a_m) / M``, the ``pp = 1`` accumulation loop's objective, with no value sent
between stages. The chunk passes ``c_m`` and ``m`` in as :class:`AuxLossScale`; without one
(evaluation, sampling) the losses are only released.

Logging: each chunk keeps one record per micro-batch, ``[Σ aux, Σ z, max MaxVio, Σ dropped
fraction, MoE layer count]`` over its layers; :func:`pipeline_aux_summary` combines a rank's
chunks and reduces over the pipeline group (sums, and max for MaxVio), giving every pipeline
rank the step's ``moe_aux_loss``, ``moe_z_loss``, ``moe_max_vio`` and ``moe_dropped`` summed
over micro-batches exactly as the ``pp = 1`` step reports them, and ``Σ_m f_m·a_m`` for the
reported loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

import mt_comm
from mt_parallel.moe.layer import MoE

AUX_NAMES = ("moe_aux_loss", "moe_z_loss")
"""The auxiliary losses an MoE layer keeps (:attr:`MoE.aux_losses`), in record order."""
_VIO, _DROPPED, _LAYERS = 2, 3, 4
_RECORD = 5


@dataclass(frozen=True)
class AuxLossScale:
    """The micro-batch a chunk's forward belongs to and its loss weight ``c_m = f_m / M``."""

    microbatch: int
    scale: float


class CarryAuxLoss(torch.autograd.Function):
    """``h' = h``; in backward ``a`` receives ``scale`` (module docstring)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.aux_dtype, ctx.aux_device = scale, aux.dtype, aux.device
        # NOTE: the same storage as a new non-view tensor (not ``h`` or ``h.view_as(h)``, which
        # autograd tracks as a view): torch's split backward detaches stage outputs in place.
        return h.detach()

    @staticmethod
    def backward(ctx: Any, grad_h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        grad_aux = torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=ctx.aux_device)
        return grad_h, grad_aux, None


def carry_aux_losses(
    layers: Sequence[MoE], h: torch.Tensor, scale: AuxLossScale | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``h`` with ``layers``' last auxiliary losses attached (module docstring) and their
    record; ``(h, None)`` without a scale. Releases the layers' losses and load statistics."""
    losses = [layer.aux_losses for layer in layers if layer.aux_losses]
    stats = [layer.load_stats for layer in layers if layer.load_stats is not None]
    for layer in layers:
        layer.aux_losses, layer.load_stats = {}, None
    if scale is None or not losses:
        return h, None
    sums = [torch.stack([loss[name] for loss in losses]).sum() for name in AUX_NAMES]
    if torch.is_grad_enabled():
        h = CarryAuxLoss.apply(h, sums[0] + sums[1], scale.scale)
    record = torch.stack(
        [
            *(s.detach().float() for s in sums),
            torch.stack([s.max_violation for s in stats]).max(),
            torch.stack([s.dropped_fraction for s in stats]).sum(),
            torch.full((), float(len(stats)), device=h.device),
        ]
    )
    return h, record


def pipeline_aux_summary(
    records: Sequence[dict[int, torch.Tensor]],
    factors: Sequence[float],
    group: Any,
    device: torch.device,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(Σ_m f_m·a_m, logged)`` over the whole pipeline from each of this rank's chunks'
    records by micro-batch (module docstring). Every pipeline rank calls it (a rank without
    MoE layers passes empty records)."""
    microbatches = len(factors)
    rows = torch.zeros(microbatches, _RECORD, device=device)
    for chunk_records in records:
        for m, record in chunk_records.items():
            vio = torch.maximum(rows[m, _VIO], record[_VIO])
            rows[m] += record
            rows[m, _VIO] = vio
    sums, vio_M = rows.clone(), rows[:, _VIO].contiguous()
    sums[:, _VIO] = 0
    mt_comm.all_reduce(sums, group=group)
    mt_comm.all_reduce(vio_M, op="max", group=group)
    aux_M = sums[:, 0] + sums[:, 1]
    weights_M = torch.ones_like(aux_M)  # filled on the device: no host-to-device copy
    for m, factor in enumerate(factors):
        if factor != 1.0:
            weights_M[m] = factor
    layers_M = sums[:, _LAYERS].clamp(min=1)
    logged = {
        AUX_NAMES[0]: sums[:, 0].sum(),
        AUX_NAMES[1]: sums[:, 1].sum(),
        "moe_max_vio": vio_M.sum(),
        "moe_dropped": (sums[:, _DROPPED] / layers_M).sum(),
    }
    return (weights_M * aux_M).sum(), logged
