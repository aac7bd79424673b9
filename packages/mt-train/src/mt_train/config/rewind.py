"""Schemas of the ``rewind`` and ``fault`` config groups (see :mod:`mt_train.rewind`).

``rewind`` says what counts as an anomaly, which checkpoint is safe to go back to, what data
to skip afterwards, how to cool the learning rate and when to give up. ``fault`` injects
faults on purpose (tests, drills); every field is off by default. Steps are 1-based and name
the optimizer step being computed: ``nan_at_step=6`` poisons the step that would make the
step counter 6.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mt_train.fault_points import DISK_ERRNOS, DISK_SITES, SAVE_PHASES

DETECTORS = ("non_finite", "loss_spike", "grad_norm_spike", "fp8_overflow")
SKIP_POLICIES = ("window", "batches", "none")


def _check_int(owner: str, name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an integer >= {minimum}, got {value!r}")


@dataclass
class RewindConfig:
    """Detect anomalies, agree on them over all ranks, restore the newest stable checkpoint."""

    enabled: bool = False
    """Watch every step; off: a non-finite loss or gradient norm stops the run with an error."""
    detectors: list[str] = field(default_factory=lambda: list(DETECTORS))
    """Which detectors run: non_finite, loss_spike, grad_norm_spike, fp8_overflow."""
    warmup_steps: int = 50
    """No spike or FP8 checks until this many steps are done (non-finite checks always run)."""
    window: int = 50
    """Healthy steps in the running baseline (median and MAD) of the loss and gradient norm."""
    min_samples: int = 10
    """Spike checks also wait until the baseline holds this many steps."""
    loss_spike_factor: float = 1.5
    """A loss is a spike above ``max(factor·median, median + k·1.4826·MAD)``: this is factor."""
    loss_spike_k: float = 6.0
    """... and this is k, the robust z-score a spike must also exceed."""
    grad_norm_spike_factor: float = 10.0
    """The same rule for the (pre-clip) global gradient norm: the factor."""
    grad_norm_spike_k: float = 10.0
    """The gradient-norm rule's k."""
    fp8_saturation: float = 0.01
    """An FP8 overflow burst: the largest saturated fraction over FP8 layers and roles in one
    step (mt_fp8's health counts) above this."""
    stable_after: int = 20
    """A checkpoint becomes stable once this many healthy steps follow it."""
    memory_snapshots: bool = True
    """Keep a host-memory copy of every checkpoint until a newer one is stable (fast rewind);
    false: rewind reads the checkpoint from disk."""
    skip: str = "window"
    """Data skipped after a rewind: window (every batch between the checkpoint and the
    anomaly), batches (only the step that tripped the detector) or none (replay all)."""
    lr_cooldown_factor: float = 0.5
    """The LR is multiplied by this right after a rewind, rising linearly back to 1 ..."""
    lr_cooldown_steps: int = 20
    """... over this many steps (0: no cool-down)."""
    max_rewinds: int = 3
    """Stop the run (with a report) at the anomaly that would be rewind number max_rewinds + 1
    within ``max_rewinds_window`` steps."""
    max_rewinds_window: int = 500
    """The span of steps in which ``max_rewinds`` are counted."""

    def __post_init__(self) -> None:
        unknown = [d for d in self.detectors if d not in DETECTORS]
        if unknown:
            raise ValueError(
                f"rewind.detectors has unknown {unknown}; valid: {', '.join(DETECTORS)}"
            )
        if self.skip not in SKIP_POLICIES:
            raise ValueError(
                f"rewind.skip={self.skip!r} is unknown; valid: {', '.join(SKIP_POLICIES)}"
            )
        for name in ("warmup_steps", "lr_cooldown_steps", "max_rewinds"):
            _check_int("rewind", name, getattr(self, name), 0)
        for name in ("window", "min_samples", "stable_after", "max_rewinds_window"):
            _check_int("rewind", name, getattr(self, name), 1)
        if self.min_samples > self.window:
            raise ValueError(
                f"rewind.min_samples={self.min_samples} exceeds rewind.window={self.window}"
            )
        for name in ("loss_spike_factor", "grad_norm_spike_factor"):
            if not getattr(self, name) > 1:
                raise ValueError(f"rewind.{name} must be > 1, got {getattr(self, name)}")
        for name in ("loss_spike_k", "grad_norm_spike_k"):
            if not getattr(self, name) > 0:
                raise ValueError(f"rewind.{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.fp8_saturation < 1:
            raise ValueError(f"rewind.fp8_saturation must be in (0, 1), got {self.fp8_saturation}")
        if not 0 < self.lr_cooldown_factor <= 1:
            raise ValueError(
                f"rewind.lr_cooldown_factor must be in (0, 1], got {self.lr_cooldown_factor}"
            )


@dataclass
class FaultConfig:
    """Faults injected on purpose. One-shot faults fire once per run folder (they are
    recorded in ``events.jsonl`` before they act); ``bad_batch_at_step`` fires every time its
    batch is drawn."""

    nan_at_step: int | None = None
    """The loss of this step is NaN (so are its gradients)."""
    spike_at_step: int | None = None
    """The loss and the gradients of this step are multiplied by ``spike_factor``."""
    grad_spike_at_step: int | None = None
    """Only the gradients of this step are multiplied by ``spike_factor``."""
    fp8_overflow_at_step: int | None = None
    """The inputs of every FP8 linear are multiplied by ``spike_factor`` in this step (with
    delayed scaling they saturate)."""
    bad_batch_at_step: int | None = None
    """The samples drawn for this step (in the fault-free order) spike the loss and gradients
    by ``spike_factor`` whenever they are trained on: only skipping them gets past it."""
    spike_factor: float = 10.0
    """How much the faults above scale what they scale."""
    kill_at_step: int | None = None
    """The process SIGKILLs itself as this step begins (an async save may be in flight)."""
    sigterm_at_step: int | None = None
    """The process sends itself SIGTERM as this step begins (a preemption drill)."""
    hang_at_step: int | None = None
    """This step sleeps ``hang_s`` seconds before it starts (a hang drill for
    ``trainer.step_timeout_s`` and ``comm.timeout_s``)."""
    hang_s: float = 3600.0
    """How long ``hang_at_step`` sleeps."""
    corrupt_latest_checkpoint: bool = False
    """At start-up, flip bytes in the newest checkpoint's first shard (before resuming)."""
    disk_error: str | None = None
    """The first write at this site fails with ``disk_errno`` (a full or read-only disk):
    run_dir, data, checkpoint, manifest, publish, events, metrics, decisions
    (:mod:`mt_train.fault_points`)."""
    disk_errno: str = "ENOSPC"
    """The error of ``disk_error``: ENOSPC, EROFS, EACCES, EIO or EDQUOT."""
    kill_in_save: str | None = None
    """The process SIGKILLs itself after this phase of a checkpoint save: shard, manifest,
    replace, publish or prune (one-shot per run folder, like ``kill_at_step``)."""
    save_step: int | None = None
    """The checkpoint step whose save ``kill_in_save`` and the checkpoint sites of
    ``disk_error`` hit; null: the first save."""
    rank: int | None = None
    """Only this rank injects the step faults; null: every rank."""

    def __post_init__(self) -> None:
        for name in (
            "nan_at_step", "spike_at_step", "grad_spike_at_step", "fp8_overflow_at_step",
            "bad_batch_at_step", "kill_at_step", "sigterm_at_step", "hang_at_step",
        ):  # fmt: skip
            value = getattr(self, name)
            if value is not None:
                _check_int("fault", name, value, 1)
        if not self.hang_s > 0:
            raise ValueError(f"fault.hang_s must be > 0 seconds, got {self.hang_s}")
        if self.rank is not None:
            _check_int("fault", "rank", self.rank, 0)
        if self.save_step is not None:
            _check_int("fault", "save_step", self.save_step, 1)
        choices = (
            ("disk_error", self.disk_error, DISK_SITES),
            ("disk_errno", self.disk_errno, DISK_ERRNOS),
            ("kill_in_save", self.kill_in_save, SAVE_PHASES),
        )
        for name, value, valid in choices:
            if value is not None and value not in valid:
                raise ValueError(f"fault.{name}={value!r} is unknown; valid: {', '.join(valid)}")
        if not self.spike_factor > 1:
            raise ValueError(f"fault.spike_factor must be > 1, got {self.spike_factor}")

    @property
    def step_faults(self) -> dict[str, int]:
        """The one-shot step faults that are set, by name."""
        names = ("nan", "spike", "grad_spike", "fp8_overflow", "kill", "sigterm", "hang")
        return {
            n: getattr(self, f"{n}_at_step")
            for n in names
            if getattr(self, f"{n}_at_step") is not None
        }
