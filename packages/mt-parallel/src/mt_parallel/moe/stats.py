"""Per-layer load statistics of an MoE forward, for logging.

``n_E`` tokens-per-expert (top-k assignments), ``MaxVio = max_e n_e / mean_e n_e − 1``
(DeepSeek's load-imbalance measure: 0 is perfectly balanced, ``E/K − 1`` is every token on the
same ``K`` experts), and the fraction of assignments dropped by capacity. Values are 0-d device
tensors (no host synchronisation); the trainer reads them with the step's other numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def max_violation(counts_E: torch.Tensor) -> torch.Tensor:
    """``max(n) / mean(n) − 1`` in fp32 (0 when no token was routed)."""
    load = counts_E.float()
    mean = load.mean()
    return torch.where(mean > 0, load.max() / mean.clamp(min=1e-12) - 1, torch.zeros_like(mean))


@dataclass
class LoadStats:
    """One MoE layer's last forward (module docstring)."""

    counts_E: torch.Tensor
    """Assignments per expert (int64) of this rank's tokens."""
    dropped_fraction: torch.Tensor
    """Dropped assignments / all assignments (fp32, 0-d)."""

    @property
    def max_violation(self) -> torch.Tensor:
        return max_violation(self.counts_E)


def summarize(stats: list[LoadStats]) -> dict[str, torch.Tensor]:
    """Model-level extras: the worst layer's MaxVio and the mean dropped fraction."""
    if not stats:
        return {}
    return {
        "moe_max_vio": torch.stack([s.max_violation for s in stats]).max(),
        "moe_dropped": torch.stack([s.dropped_fraction for s in stats]).mean(),
    }


def global_load_summary(counts_by_layer: dict[str, torch.Tensor]) -> dict:
    """From one step's global per-layer counts (:func:`~mt_parallel.moe.update_expert_biases`):
    ``max_vio`` (the worst layer's global-batch MaxVio) and ``dead`` (layer -> experts that
    received no token in the whole global batch, a sign of expert collapse). Reads the counts on
    the host (one synchronisation). ``per_layer``: each layer's global-batch MaxVio."""
    names = list(counts_by_layer)
    stacked = [counts_by_layer[n] for n in names]
    vios = torch.stack([max_violation(c) for c in stacked]).tolist()
    dead = {n: (c == 0).nonzero().flatten().tolist() for n, c in zip(names, stacked, strict=True)}
    return {
        "max_vio": max(vios),
        "per_layer": dict(zip(names, vios, strict=True)),
        "dead": {n: e for n, e in dead.items() if e},
    }
