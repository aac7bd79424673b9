"""What a run trusts on disk: verified checkpoints, rejected ones, and the rewind decisions file.

Every rank must reach the same answer, so rank 0 reads the disk and broadcasts the result (a
path, a reason, a JSON text) as a string; nothing is pickled.

* :meth:`Recovery.find_resume` — ``checkpoint.resume``: ``none``; ``auto``, the newest
  checkpoint that :func:`~mt_train.checkpoint.files.verify_checkpoint` accepts (manifest of
  the right shape, every shard's size and sha256); newer ``step-*`` folders that fail (a
  missing manifest included) are renamed ``rejected-step-*`` and logged
  (``checkpoint_rejected``, console and events), and when none is left the run says that it
  starts fresh (``fresh_start``); ``must``, the same but a run with nothing to resume from
  stops (:class:`~mt_train.errors.CheckpointError`) instead of starting fresh; or a path: a
  ``step-*`` folder, which must verify, or a checkpoint root, searched as ``must`` searches.
* :meth:`Recovery.save_decisions` / :meth:`Recovery.load_decisions` — a rewind decides things
  (skipped draws, its place in the history, the LR cool-down) that the checkpoint it restored
  predates. Rank 0 writes them atomically to ``<checkpoints>/rewind-decisions.json`` right
  after the rewind; loading a checkpoint merges them back (skipped ranges by union, the longer
  history with its cool-down), so a crash before the next checkpoint loses no decision. A run
  that starts fresh removes an old file, which belongs to another run. A file that does not
  parse or has the wrong shape is renamed ``rejected-rewind-decisions.json`` and logged
  (``decisions_rejected``); the resume goes on with the checkpoint's own state.
* :func:`fired_faults` — the one-shot faults this run folder's events log has recorded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from mt_train import fault_points, ranks
from mt_train.checkpoint.files import (
    STEP_DIR,
    checkpoint_step,
    newest_valid_checkpoint,
    quarantine,
    verify_checkpoint,
    write_json_atomic,
)
from mt_train.data.dataset import ResumableSampler
from mt_train.errors import CheckpointError, DiskError
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
        if mode not in ("auto", "must"):
            path = Path(mode).expanduser()
            if (path / "manifest.json").is_file() or STEP_DIR.match(path.name):
                reason = self.verify(path)
                if reason is not None:
                    raise CheckpointError(
                        f"checkpoint.resume={mode!r} cannot be used: {reason}; pass a "
                        "step-<8 digits> checkpoint folder or a folder of them"
                    )
                return path
            return self._newest(path, f"checkpoint.resume={mode!r}", must=True)
        return self._newest(self.ckpt_dir, f"checkpoint.resume={mode}", must=mode == "must")

    def _newest(self, root: Path, option: str, must: bool) -> Path | None:
        """The newest checkpoint under ``root`` that verifies (rank 0 searches and rejects);
        without one, stop (``must``) or say that the run starts fresh."""
        chosen, summary = "", ""
        if self.rank == 0:
            folder, rejected = newest_valid_checkpoint(root)
            for bad, reason in rejected:
                self.reject(bad, reason)
            chosen = str(folder) if folder is not None else ""
            summary = (
                f"every checkpoint in {root} was rejected ({len(rejected)}, see above)"
                if rejected
                else f"no checkpoint in {root}"
            )
        chosen = ranks.broadcast_str(chosen, self.device)
        if chosen:
            return Path(chosen)
        summary = ranks.broadcast_str(summary, self.device)
        if must:
            raise CheckpointError(
                f"{option}: {summary}, and it refuses to start fresh; pass a step-<8 digits> "
                "checkpoint folder or a folder of them, or checkpoint.resume=auto"
            )
        self.events.emit(
            "fresh_start",
            0,
            reason=f"{option}: {summary}; starting from step 0 "
            "(checkpoint.resume=must refuses to start fresh)",
        )
        self.forget_decisions()
        return None

    def forget_decisions(self) -> None:
        if self.rank == 0:
            self.decisions_path.unlink(missing_ok=True)

    def save_decisions(self, sampler: ResumableSampler, guard: RewindManager) -> None:
        if self.rank == 0:
            state: dict[str, Any] = {"skipped": sampler.skipped, **guard.decisions()}
            try:
                fault_points.disk_write("decisions", self.decisions_path)
                write_json_atomic(self.decisions_path, state)
            except OSError as err:
                raise DiskError("the rewind decisions file", self.decisions_path, err) from err

    def load_decisions(self, sampler: ResumableSampler, guard: RewindManager) -> None:
        """Merge the decisions file into the loaded state; a damaged one is set aside."""
        text, problem = "", ""
        if self.rank == 0 and self.decisions_path.is_file():
            text = self.decisions_path.read_text(errors="replace")
            problem = decisions_problem(text) or ""
            if problem:
                moved = self.decisions_path.with_name(f"rejected-{DECISIONS_FILE}")
                os.replace(self.decisions_path, moved)
                self.events.emit(
                    "decisions_rejected", 0, path=str(self.decisions_path), reason=problem,
                    moved_to=str(moved),
                )  # fmt: skip
                text = ""
        text = ranks.broadcast_str(text, self.device)
        if text:
            state = json.loads(text)
            for start, end in state["skipped"]:
                sampler.skip(start, end)
            guard.merge_decisions(state)


def decisions_problem(text: str) -> str | None:
    """Why ``text`` is not a decisions file :meth:`Recovery.save_decisions` wrote, or None."""
    try:
        state = json.loads(text)
    except ValueError as err:
        return f"not JSON: {err}"
    if not isinstance(state, dict):
        return f"a JSON {type(state).__name__}, not an object"
    skipped, history = state.get("skipped"), state.get("history", [])
    ranges_ok = isinstance(skipped, list) and all(
        isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r) for r in skipped
    )
    if not ranges_ok:
        return f"skipped is {skipped!r}, not a list of [start, end] integer pairs"
    if not isinstance(history, list) or not all(isinstance(h, dict) for h in history):
        return f"history is {history!r}, not a list of objects"
    cooldown = state.get("cooldown")
    if cooldown is not None and not isinstance(cooldown, dict):
        return f"cooldown is {cooldown!r}, not an object or null"
    return None
