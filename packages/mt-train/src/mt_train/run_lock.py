"""One writer per run folder: a lock file that a crashed run's successor can take over.

Two ``mt-train`` processes on the same run folder would interleave their checkpoints,
events and metrics. Rank 0 therefore holds ``<folder>/mt-train.lock`` (the run folder, and
the checkpoint folder when ``checkpoint.dir`` puts it elsewhere) while it runs: a JSON
object ``{pid, host, start, command}``, where ``start`` is the process start time from
``/proc/<pid>/stat`` (absent where there is no ``/proc``), so a recycled pid is not taken for
the holder.

Taking the lock: create the file exclusively (``O_CREAT | O_EXCL``). If it exists, read it:

* held by a live process (same host, the pid exists with the recorded start time) other than
  this one: refuse with :class:`~mt_train.errors.RunLockedError` naming the pid, host and
  command;
* held on another host: refuse too (its liveness cannot be checked from here); the message
  says to delete the file once that run is gone;
* held by a dead process, or unreadable (a crash while writing it): take it over (write ours
  under a temporary name, rename over it) and report the takeover.

Releasing deletes the file if it is still ours. A SIGKILL leaves it behind, which is what the
takeover rule is for.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

from mt_train import fault_points
from mt_train.errors import DiskError, RunLockedError, check_writable

LOCK_FILE = "mt-train.lock"


def process_start(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot (``/proc``), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(holder: dict[str, Any]) -> bool:
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by another user
    start = holder.get("start")
    return start is None or process_start(pid) in (None, start)


def _me() -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "start": process_start(os.getpid()),
        "command": " ".join(sys.argv)[:300],
    }


class RunLock:
    """Holds the lock files of ``folders`` (module docstring); :meth:`release` lets go."""

    def __init__(self, folders: list[Path]) -> None:
        self.paths: list[Path] = []
        self.took_over: list[tuple[Path, dict[str, Any]]] = []
        try:
            for folder in dict.fromkeys(Path(f) for f in folders):
                self._take(folder / LOCK_FILE)
        except BaseException:
            self.release()
            raise

    def _take(self, path: Path) -> None:
        mine = _me()
        text = json.dumps(mine).encode()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            self._take_over(path, mine, text)
            return
        except OSError as err:
            raise DiskError("the run lock", path, err) from err
        with os.fdopen(fd, "wb") as f:
            f.write(text)
        self.paths.append(path)

    def _take_over(self, path: Path, mine: dict[str, Any], text: bytes) -> None:
        try:
            holder = json.loads(path.read_text())
        except (OSError, ValueError):
            holder = {}
        if not isinstance(holder, dict):
            holder = {}
        same_host = holder.get("host") == mine["host"]
        ours = same_host and holder.get("pid") == mine["pid"]
        if holder and not ours and not same_host:
            raise RunLockedError(
                f"{path.parent} is in use by pid {holder.get('pid')} on host "
                f"{holder.get('host')} ({holder.get('command', '?')}); use another run folder, "
                f"or delete {path} once that run is gone"
            )
        if holder and not ours and _alive(holder):
            raise RunLockedError(
                f"{path.parent} is in use by a running mt-train (pid {holder['pid']}: "
                f"{holder.get('command', '?')}); wait for it to finish or use another run "
                "folder (hydra.run.dir / trainer.output_dir)"
            )
        partial = path.with_name(f".tmp-{path.name}-{mine['pid']}")
        try:
            partial.write_bytes(text)
            os.replace(partial, path)
            won = path.read_bytes() == text  # two successors: the last rename wins
        except OSError as err:
            raise DiskError("the run lock", path, err) from err
        if not won:
            raise RunLockedError(f"{path.parent} was just taken over by another mt-train")
        if not ours:
            self.took_over.append((path, holder))
        self.paths.append(path)

    def release(self) -> None:
        """Delete the lock files that are still ours."""
        for path in self.paths:
            try:
                holder = json.loads(path.read_text())
                if isinstance(holder, dict) and holder.get("pid") == os.getpid():
                    path.unlink()
            except (OSError, ValueError):
                continue
        self.paths = []


def open_run_folder(output_dir: Path, checkpoint_dir: Path) -> RunLock:
    """Rank 0 at start-up: create the run folder, check it can be written and take its lock
    (and the checkpoint folder's, when that lies elsewhere); report a takeover on stderr."""
    try:
        fault_points.disk_write("run_dir", output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DiskError("the run folder", output_dir, err) from err
    check_writable(output_dir, "the run folder")
    inside = checkpoint_dir.resolve().is_relative_to(output_dir)
    lock = RunLock([output_dir] if inside else [output_dir, checkpoint_dir])
    for path, holder in lock.took_over:
        print(
            f"mt-train: took over {path} from pid {holder.get('pid')}, which is gone "
            "(a crashed or killed run)",
            file=sys.stderr,
            flush=True,
        )
    return lock
