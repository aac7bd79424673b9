"""Named points where drills make writes fail or kill a checkpoint save between its phases.

The code that writes calls :func:`disk_write` before a write at a named site and
:func:`save_phase` after each phase of a checkpoint save. Nothing happens unless a run armed
them (:func:`arm`, from its ``fault`` config): a full or read-only disk and a SIGKILL inside a
save are then real events at a known point, which tests cannot get from tmpfs or from a
random kill.

* ``fault.disk_error=<site>``: the first write at ``site`` (for the checkpoint sites, in the
  save of ``fault.save_step``, or the first save) raises ``OSError(fault.disk_errno)`` with
  the path it was about to write. Sites: :data:`DISK_SITES`.
* ``fault.kill_in_save=<phase>``: after ``phase`` of the save of ``fault.save_step`` (or the
  first save), the process records a ``fault`` event and sends itself SIGKILL. Phases, in
  the order a save runs them: :data:`SAVE_PHASES`. One-shot per run folder like
  ``fault.kill_at_step``: a restart that finds the event leaves it disarmed.

State is per process (the background save thread reaches the same points); :func:`arm`
replaces all of it, so every trainer starts from its own config.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

DISK_SITES = {
    "run_dir": "the run folder, at start-up",
    "data": "the prepared data folder, while mt-train prepares the bundled corpus",
    "checkpoint": "a rank's shard of a checkpoint",
    "manifest": "a checkpoint's manifest.json",
    "publish": "the rename that publishes a checkpoint",
    "events": "events.jsonl",
    "metrics": "metrics.jsonl",
    "decisions": "the rewind decisions file",
}
"""Where ``fault.disk_error`` can strike, and what is written there."""

SAVE_PHASES = {
    "shard": "this rank's shard and sidecar are written in the .tmp-step-* folder",
    "manifest": "manifest.json is written and fsynced in the .tmp-step-* folder",
    "replace": "a checkpoint of the same step was moved to .old-step-* (after a rewind)",
    "publish": "the .tmp-step-* folder was renamed to step-*",
    "prune": "an old checkpoint was renamed to .del-step-*, before it is deleted",
}
"""The phases of a checkpoint save, in order, after which ``fault.kill_in_save`` can kill."""

DISK_ERRNOS = ("ENOSPC", "EROFS", "EACCES", "EIO", "EDQUOT")
"""The errors ``fault.disk_errno`` can name."""

KILL_IN_SAVE = "kill_in_save"
"""The name of the one-shot fault in ``events.jsonl``."""


@dataclass
class _Armed:
    disk_site: str | None = None
    disk_errno: int = errno.ENOSPC
    save_step: int | None = None
    kill_phase: str | None = None
    record: Callable[[str, int], None] | None = None
    fired: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)


_armed = _Armed()


def arm(
    disk_site: str | None = None,
    disk_errno: str = "ENOSPC",
    kill_phase: str | None = None,
    save_step: int | None = None,
) -> None:
    """Arm this process's fault points (all off by default); replaces the previous arming.
    The kill stays off until :func:`enable_kill` says how to record it."""
    global _armed
    _armed = _Armed(disk_site, getattr(errno, disk_errno), save_step, kill_phase)


def enable_kill(already_fired: Iterable[str], record: Callable[[str, int], None]) -> None:
    """Let ``kill_in_save`` fire unless ``already_fired`` holds it; ``record(phase, step)``
    writes its event before the kill."""
    _armed.record = record
    if KILL_IN_SAVE in set(already_fired):
        _armed.fired.add(KILL_IN_SAVE)


def _hits(step: int | None) -> bool:
    """Whether a save fault aimed at ``fault.save_step`` hits the save of ``step``."""
    return step is None or _armed.save_step is None or _armed.save_step == step


def disk_write(site: str, path: str | Path, step: int | None = None) -> None:
    """Raise the armed ``OSError`` if ``fault.disk_error`` names ``site`` (once per process)."""
    armed = _armed
    if armed.disk_site != site or not _hits(step):
        return
    with armed.lock:
        if "disk" in armed.fired:
            return
        armed.fired.add("disk")
    raise OSError(armed.disk_errno, os.strerror(armed.disk_errno), str(path))


def save_phase(phase: str, step: int) -> None:
    """SIGKILL this process after ``phase`` of the save of ``step`` if so armed."""
    armed = _armed
    if armed.kill_phase != phase or armed.record is None or not _hits(step):
        return
    with armed.lock:
        if KILL_IN_SAVE in armed.fired:
            return
        armed.fired.add(KILL_IN_SAVE)
    armed.record(phase, step)
    os.kill(os.getpid(), signal.SIGKILL)
