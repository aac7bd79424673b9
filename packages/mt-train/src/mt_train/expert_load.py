"""MoE expert load at the trainer's log steps: global-batch MaxVio and dead experts.

After every step the routers' aux-loss-free biases move from the step's global expert counts
(``mt_parallel.moe.update_expert_biases``; a step that is not applied only resets the counts,
and a dense model has none). At log steps :meth:`ExpertLoadLog.log` adds the worst layer's
``MaxVio = max_e load_e / mean_e load_e − 1`` over the global batch as ``moe_max_vio_global``
(and each router's as ``moe_max_vio_global/<router>``) and emits a ``moe_dead_experts`` event
when the set of experts that got no token of the whole global batch changes (and is not empty).

Under pipeline parallelism each stage moves the biases of the routers it holds (counts summed
over its own dp×cp group); the counts of every router then meet on every pipeline rank (one
SUM all-reduce over the pp group of a vector laid out by the whole model's routers, zeros for
those held elsewhere), so the logged MaxVio and dead experts cover the whole model.
"""

from __future__ import annotations

from typing import Any

import torch

import mt_comm
import mt_parallel
from mt_train.rewind.events import EventLog


class ExpertLoadLog:
    """The last step's global expert counts per router and the dead experts last reported."""

    def __init__(
        self,
        events: EventLog,
        pp_group: Any = None,
        routers: dict[str, int] | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.events = events
        self.pp_group, self.device = pp_group, device
        self.routers = routers or {}
        """Every router of the whole model (name -> expert count), for ``pp > 1``."""
        self.counts: dict[str, torch.Tensor] = {}
        self._dead: dict[str, list[int]] = {}

    def update(self, module: torch.nn.Module, applied: bool) -> None:
        """Move the routers' biases from this step's counts (only reset them if not applied)."""
        self.counts = mt_parallel.moe.update_expert_biases(module, apply=applied)
        if applied and self.pp_group is not None and self.routers:
            self.counts = self._pipeline_counts(self.counts)

    def _pipeline_counts(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every router's counts on every pipeline rank (module docstring)."""
        rows = [
            local[name]
            if name in local
            else torch.zeros(experts, dtype=torch.long, device=self.device)
            for name, experts in self.routers.items()
        ]
        flat = mt_comm.all_reduce(torch.cat(rows).long(), group=self.pp_group)
        return dict(zip(self.routers, flat.split(list(self.routers.values())), strict=True))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Add the MaxVio values to ``metrics``; emit the dead-expert event on a change."""
        if not self.counts:
            return
        load = mt_parallel.moe.global_load_summary(self.counts)
        metrics["moe_max_vio_global"] = load["max_vio"]
        for layer, vio in load["per_layer"].items():
            metrics[f"moe_max_vio_global/{layer}"] = vio
        if load["dead"] and load["dead"] != self._dead:
            self.events.emit("moe_dead_experts", step, experts=load["dead"])
        self._dead = load["dead"]
