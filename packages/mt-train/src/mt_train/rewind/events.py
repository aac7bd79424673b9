"""The events log: one JSON object per line in ``<run>/events.jsonl``, plus a console line.

Every rank keeps the records in memory (tests and the multi-rank agreement read them); rank 0
appends them to the file, flushed and fsynced per record (events are rare, and a record must
survive the crash that may follow it). A crash in the middle of a write leaves a torn last
line: :class:`EventLog` cuts it off when it opens the file (logging ``events_repaired``), and
:func:`read_events` skips any line that does not parse, so a half-written record never
blocks a restart. Records share ``event``, ``step`` and ``time`` (UTC,
ISO 8601); the rest depends on the event:

* ``rewind``: ``detector`` (the one that names it), ``detectors``, ``ranks`` (who saw each),
  ``values`` (the numbers behind each), ``restored`` (step, path, source ``memory``/``disk``,
  ``stable``), ``skipped`` (policy, global draw ranges ``[a, b)``, steps), ``lr_cooldown``,
  ``rewinds_in_window``;
* ``give_up``: the anomaly as above, the rewinds counted and the bound;
* ``stable``: a checkpoint became stable (``checkpoint``, ``healthy_steps``);
* ``checkpoint_rejected``: a corrupt or partial checkpoint (``path``, ``reason``, ``moved_to``);
* ``fresh_start``: ``checkpoint.resume=auto`` found nothing to resume from (``reason``);
* ``decisions_rejected``: a damaged rewind decisions file (``path``, ``reason``, ``moved_to``);
* ``events_repaired``: a torn last line was cut off this file (``bytes``, ``text``);
* ``resume``: the checkpoint a run resumed from;
* ``preempted``: a stop signal (``signal``, ``checkpoint``);
* ``fault``: an injected fault fired (``fault``, its settings).

``step`` is the number of completed steps when the event happened (for ``rewind``, the
anomalous step is ``step + 1``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mt_train import fault_points
from mt_train.errors import DiskError
from mt_train.rewind.consensus import finite_or_text

EVENTS_FILE = "events.jsonl"


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """The records of an events file (``[]`` if there is none)."""
    path = Path(path)
    if path.is_dir():
        path = path / EVENTS_FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a torn or damaged line
            continue
        if isinstance(record, dict) and "event" in record:
            records.append(record)
    return records


def cut_torn_tail(path: Path) -> bytes:
    """Cut ``path`` back to its last complete line; returns what was cut (empty if nothing)."""
    if not path.is_file():
        return b""
    with open(path, "rb+") as f:
        data = f.read()
        if not data or data.endswith(b"\n"):
            return b""
        keep = data.rfind(b"\n") + 1
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    return data[keep:]


def _print(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class EventLog:
    """Records events; rank 0 (``path`` set) writes them; ``echo`` shows the console line."""

    def __init__(self, path: Path | None, echo: Callable[[str], None] | None = _print) -> None:
        self.path = path
        self.echo = echo
        self.records: list[dict[str, Any]] = []
        if path is not None:
            try:
                torn = cut_torn_tail(path)
            except OSError as err:
                raise DiskError("the events log", path, err) from err
            if torn:
                text = torn[:80].decode(errors="replace")
                self.emit("events_repaired", 0, bytes=len(torn), text=text)

    def emit(self, event: str, step: int, quiet: bool = False, **fields: Any) -> dict[str, Any]:
        """Record (and on rank 0 write) an event; ``quiet``: no console line."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        record = finite_or_text({"event": event, "step": step, "time": stamp, **fields})
        self.records.append(record)
        if self.path is not None:
            try:
                fault_points.disk_write("events", self.path)
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(record, sort_keys=False) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as err:
                raise DiskError("the events log", self.path, err) from err
            if self.echo is not None and not quiet:
                self.echo(console_line(record))
        return record

    def of(self, event: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["event"] == event]


def _num(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def describe_anomaly(record: dict[str, Any]) -> str:
    """``loss_spike (loss 25.1 > threshold 3.7: median 2.46, MAD 0.05) on ranks [0, 1]``."""
    det = record["detector"]
    values = record.get("values", {}).get(det, {})
    shown = {k: v for k, v in values.items() if k not in ("by_rank", "threshold")}
    text = det
    if "threshold" in values:
        head = next(iter(shown.items()), None)
        rest = ", ".join(f"{k} {_num(v)}" for k, v in list(shown.items())[1:])
        if head is not None:
            text += f" ({head[0]} {_num(head[1])} > threshold {_num(values['threshold'])}"
            text += f": {rest})" if rest else ")"
    elif shown:
        text += " (" + ", ".join(f"{k} {_num(v)}" for k, v in shown.items()) + ")"
    elif values.get("by_rank"):  # seen by other ranks only: their headline values
        text += " (" + ", ".join(f"rank {r}: {_num(v)}" for r, v in values["by_rank"].items()) + ")"
    ranks = record.get("ranks", {}).get(det)
    if ranks is not None:
        text += f" on rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}"
    others = [d for d in record.get("detectors", []) if d != det]
    if others:
        text += f" [also {', '.join(others)}]"
    return text


def console_line(record: dict[str, Any]) -> str:
    """The one line shown for ``record`` (see the module docstring for the fields)."""
    event, step = record["event"], record["step"]
    if event == "rewind":
        restored, skipped = record["restored"], record["skipped"]
        where = f"step {restored['step']} from {restored['source']}"
        if not restored["stable"]:
            where += " (not yet stable: no stable checkpoint)"
        skip = (
            f"skipped {skipped['steps']} step(s) of data ({skipped['policy']})"
            if skipped["steps"]
            else "no data skipped"
        )
        cool = record.get("lr_cooldown")
        cool_text = f", LR x{cool['factor']} back to 1 over {cool['steps']} steps" if cool else ""
        return (
            f"rewind: step {step + 1}: {describe_anomaly(record)}; restored {where}, {skip}"
            f"{cool_text} [{record['rewinds_in_window']}/{record['max_rewinds']} within "
            f"{record['window']} steps]"
        )
    if event == "give_up":
        return f"rewind: step {step + 1}: {describe_anomaly(record)}; {record['reason']}"
    if event == "stable":
        return f"rewind: checkpoint step {record['checkpoint']} is stable"
    if event == "checkpoint_rejected":
        return f"checkpoint rejected: {record['path']}: {record['reason']}"
    if event == "resume":
        return f"resume: from {record['path']} (step {step})"
    if event == "fresh_start":
        return f"resume: {record['reason']}"
    if event == "decisions_rejected":
        return (
            f"rewind decisions rejected: {record['path']}: {record['reason']} (moved to "
            f"{record['moved_to']}; resuming with the checkpoint's own rewind state)"
        )
    if event == "events_repaired":
        return (
            f"events: cut a torn last line ({record['bytes']} bytes, a write interrupted by a "
            "crash) off the events log"
        )
    if event == "preempted":
        saved = record.get("checkpoint") or "no checkpoint (checkpoints are off)"
        return f"preempted by {record['signal']} at step {step}: saved {saved}; exiting"
    if event == "fault":
        return f"fault injected: {record['fault']} at step {record['at_step']}"
    return f"{event} at step {step}"
