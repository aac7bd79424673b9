"""One verdict for all ranks: the detectors' flags (and a stop request) reduced over the world.

Each rank ``r`` turns its findings into flags ``f_r ∈ {0,1}^D`` (``D`` detectors in
:data:`~mt_train.rewind.detectors.PRIORITY` order) plus a stop bit (a SIGTERM/SIGINT arrived);
one all-reduce with MAX gives ``F = max_r f_r`` on every rank, and every rank acts on ``F``
alone. So a fault that only one rank can see (a NaN in its micro-batch before the gradient
all-reduce, an FP8 burst in its activations, a preemption signal that reached it first) makes
all ranks rewind, or stop, at the same step.

Only when ``F`` is not all zero (rare), a second all-reduce (SUM) of a ``(world, D, 2)``
table, row ``r`` filled by rank ``r`` with its flag and headline value, tells every rank who
saw what, for the event log. A single process skips both collectives and makes no device
tensor at all (each is a host-device copy that blocks the host).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import mt_comm
from mt_train.rewind.detectors import PRIORITY, Finding


@dataclass
class Verdict:
    """What every rank does after a step."""

    detectors: list[str] = field(default_factory=list)
    """Detectors that fired on any rank, in priority order (empty: healthy)."""
    ranks: dict[str, list[int]] = field(default_factory=dict)
    """For each fired detector, the ranks that saw it."""
    values: dict[str, dict[str, Any]] = field(default_factory=dict)
    """For each fired detector, the values behind it as this rank saw them, and ``by_rank``:
    the headline value of every rank that saw it."""
    stop: bool = False
    """A stop signal reached some rank: save and exit after this step."""

    @property
    def anomalous(self) -> bool:
        return bool(self.detectors)

    @property
    def detector(self) -> str:
        """The detector that names the event (the first in priority order)."""
        return self.detectors[0]


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def agree(findings: list[Finding], stop: bool, device: torch.device) -> Verdict:
    """Reduce this rank's ``findings`` and ``stop`` over the world (see the module docstring)."""
    rank, world = _world()
    own = {f.detector: f for f in findings}
    if world == 1:
        # Nothing to reduce, so no device tensors: each would cost a blocking copy per step.
        fired = [d for d in PRIORITY if d in own]
        verdict = Verdict(detectors=fired, stop=stop)
        for d in fired:
            verdict.ranks[d] = [0]
            verdict.values[d] = {**own[d].details, "by_rank": {"0": float(own[d].value)}}
        return verdict
    flags = torch.tensor(
        [float(d in own) for d in PRIORITY] + [float(stop)], dtype=torch.float32, device=device
    )
    mt_comm.all_reduce(flags, op="max")
    *detector_flags, stop_flag = flags.tolist()  # the one host sync of a healthy step
    fired = [d for d, flag in zip(PRIORITY, detector_flags, strict=True) if flag > 0]
    verdict = Verdict(stop=stop_flag > 0)
    if not fired:
        return verdict
    table = torch.zeros(world, len(PRIORITY), 2, dtype=torch.float64, device=device)
    for i, d in enumerate(PRIORITY):
        if d in own:
            table[rank, i, 0] = 1.0
            table[rank, i, 1] = own[d].value
    mt_comm.all_reduce(table, op="sum")
    table = table.cpu()
    verdict.detectors = fired
    for d in fired:
        i = PRIORITY.index(d)
        ranks = [r for r in range(world) if table[r, i, 0] > 0]
        verdict.ranks[d] = ranks
        values = dict(own[d].details) if d in own else {}
        values["by_rank"] = {str(r): float(table[r, i, 1]) for r in ranks}
        verdict.values[d] = values
    return verdict


def finite_or_text(value: Any) -> Any:
    """JSON-safe: non-finite floats become ``"nan"``, ``"inf"``, ``"-inf"`` (recursively)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): finite_or_text(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_text(v) for v in value]
    return value
