"""MoE expert load at the trainer's log steps: global-batch MaxVio and dead experts.

After every step the routers' aux-loss-free biases move from the step's global expert counts
(``mt_parallel.moe.update_expert_biases``; a step that is not applied only resets the counts,
and a dense model has none). At log steps :meth:`ExpertLoadLog.log` adds the worst layer's
``MaxVio = max_e load_e / mean_e load_e − 1`` over the global batch as ``moe_max_vio_global``
(and each router's as ``moe_max_vio_global/<router>``) and emits a ``moe_dead_experts`` event
when the set of experts that got no token of the whole global batch changes (and is not empty).
"""

from __future__ import annotations

from typing import Any

import torch

import mt_parallel
from mt_train.rewind.events import EventLog


class ExpertLoadLog:
    """The last step's global expert counts per router and the dead experts last reported."""

    def __init__(self, events: EventLog) -> None:
        self.events = events
        self.counts: dict[str, torch.Tensor] = {}
        self._dead: dict[str, list[int]] = {}

    def update(self, module: torch.nn.Module, applied: bool) -> None:
        """Move the routers' biases from this step's counts (only reset them if not applied)."""
        self.counts = mt_parallel.moe.update_expert_biases(module, apply=applied)

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
