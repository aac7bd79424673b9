"""What a finished :meth:`mt_train.Trainer.fit` returns: losses, throughput, memory, files."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainSummary:
    """What a finished :meth:`Trainer.fit` reports."""

    steps: int
    train_loss: float
    val_loss: float
    wall_s: float
    tokens_per_s: float
    output_dir: str
    checkpoint: str | None
    losses: list[float]
    rewinds: int
    sample: str
    stopped: str | None = None
    """The signal that ended the run early (preemption), or None."""
    tokens: int = 0
    """Tokens trained on in healthy steps of this process."""
    best_tokens_per_s: float = 0.0
    """The best log interval's tokens/s."""
    mfu: float | None = None
    """Model FLOPs utilisation of ``tokens_per_s`` (None where the device's peak is unknown)."""
    best_mfu: float | None = None
    peak_memory_gib: float = 0.0
    """The largest ``mem_gib`` (peak allocated memory) rank 0 logged."""
    checkpoints_written: int = 0
    traces: list[str] = field(default_factory=list)
    """Profiler traces and memory snapshots written by rank 0."""
