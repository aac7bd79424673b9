"""What a run trusts on disk: verified checkpoints, rejected ones, and the rewind decisions file.

Every rank must reach the same answer, so rank 0 reads the disk and broadcasts the result (a
path, a reason, a JSON text) as a string; nothing is pickled.

* :meth:`Recovery.find_resume` — ``checkpoint.resume``: ``none``; ``auto``, the newest
  checkpoint that :func:`~mt_train.checkpoint.files.verify_checkpoint` accepts (manifest,
  every shard's size and sha256), newer ones that fail are renamed ``rejected-step-*`` and
  logged (``checkpoint_rejected``); or a folder, which must verify.
* :meth:`Recovery.save_decisions` / :meth:`Recovery.load_decisions` — a rewind decides things
  (skipped draws, its place in the history, the LR cool-down) that the checkpoint it restored
  predates. Rank 0 writes them atomically to ``<checkpoints>/rewind-decisions.json`` right
  after the rewind; loading a checkpoint merges them back (skipped ranges by union, the longer
  history with its cool-down), so a crash before the next checkpoint loses no decision. A run
  that starts fresh removes an old file, which belongs to another run.
* :func:`fired_faults` — the one-shot faults this run folder's events log has recorded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mt_train import ranks
from mt_train.checkpoint.files import (
    checkpoint_step,
    newest_valid_checkpoint,
    quarantine,
    verify_checkpoint,
    write_json_atomic,
)
from mt_train.data.dataset import ResumableSampler
from mt_train.rewind.events import EventLog, read_events
from mt_train.rewind.manager import RewindManager

DECISIONS_FILE = "rewind-decisions.json"


def fired_faults(output_dir: Path, rank: int, device: torch.device) -> list[str]:
    """Faults recorded in ``output_dir``'s events log (rank 0 reads, everyone gets them)."""
    fired = ""
    if rank == 0:
        fired = ",".join(r["fault"] for r in read_events(output_dir) if r["event"] == "fault")
    return [f for f in ranks.broadcast_str(fired, device).split(",") if f]


class Recovery:
    """Disk-side decisions of one run (see the module docstring)."""

    def __init__(self, ckpt_dir: Path, rank: int, device: torch.device, events: EventLog) -> None:
        self.ckpt_dir, self.rank, self.device, self.events = ckpt_dir, rank, device, events

    @property
    def decisions_path(self) -> Path:
        return self.ckpt_dir / DECISIONS_FILE

    def verify(self, folder: Path) -> str | None:
        """Why ``folder`` cannot be trusted, or None (rank 0 checks; every rank gets it)."""
        reason = (verify_checkpoint(folder) or "") if self.rank == 0 else ""
        return ranks.broadcast_str(reason, self.device) or None

    def reject(self, folder: Path, reason: str) -> None:
        """Move ``folder`` out of the way (rank 0) and log why."""
        moved = quarantine(folder) if self.rank == 0 and folder.exists() else None
        self.events.emit(
            "checkpoint_rejected",
            checkpoint_step(folder),
            path=str(folder),
            reason=reason,
            moved_to=str(moved) if moved else None,
        )

    def find_resume(self, mode: str) -> Path | None:
        """The checkpoint ``checkpoint.resume=mode`` names, verified (module docstring)."""
        if mode == "none":
            self.forget_decisions()
            return None
        if mode != "auto":
            reason = self.verify(Path(mode))
            if reason is not None:
                raise ValueError(f"checkpoint.resume={mode!r} cannot be used: {reason}")
            return Path(mode)
        chosen = ""
        if self.rank == 0:
            folder, rejected = newest_valid_checkpoint(self.ckpt_dir)
            for bad, reason in rejected:
                self.reject(bad, reason)
            chosen = str(folder) if folder is not None else ""
        chosen = ranks.broadcast_str(chosen, self.device)
        if not chosen:
            self.forget_decisions()
        return Path(chosen) if chosen else None

    def forget_decisions(self) -> None:
        if self.rank == 0:
            self.decisions_path.unlink(missing_ok=True)

    def save_decisions(self, sampler: ResumableSampler, guard: RewindManager) -> None:
        if self.rank == 0:
            state: dict[str, Any] = {"skipped": sampler.skipped, **guard.decisions()}
            write_json_atomic(self.decisions_path, state)

    def load_decisions(self, sampler: ResumableSampler, guard: RewindManager) -> None:
        text = ""
        if self.rank == 0 and self.decisions_path.is_file():
            text = self.decisions_path.read_text()
        text = ranks.broadcast_str(text, self.device)
        if text:
            state = json.loads(text)
            for start, end in state["skipped"]:
                sampler.skip(start, end)
            guard.merge_decisions(state)
