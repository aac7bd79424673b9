"""Atomic publication of a prepared data folder (``mt-prepare-data`` and its ``merge``).

A folder is built inside a temporary sibling ``.<name>.partial-<host>-<pid>``, ``meta.json``
written last (fsynced, renamed into place), and then the sibling is renamed to ``out``. An
existing ``out`` is replaced only if it is empty or a prepared folder (it is renamed aside to
``.<name>.old-<pid>`` first and deleted after); any other folder is refused, so a wrong
``--out`` never deletes a user's files. On any error, or an interrupt, the partial sibling is
removed and ``out`` is left as it was.

A run killed outright (SIGKILL, a lost node) cannot remove its partial sibling; the next build
of the same ``out`` on the same host removes every ``.<name>.partial-<host>-<pid>`` whose
process is gone (and says so on stderr). Partial folders of other hosts (a shared file system)
and of live processes are left alone: the host in the name is what makes the pid meaningful.
An ``.old-`` folder is never removed by a later run: if a kill fell between the two renames it
holds the only copy of the previous data.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

from mt_train.errors import DiskError, UserError

PREPARED_FILES = ("meta.json", "train.bin", "train.idx", "val.bin", "val.idx")


def check_replaceable(out: Path) -> None:
    """Refuse an ``out`` that exists and is neither empty nor a prepared folder."""
    if out.exists() and not (
        out.is_dir()
        and (not any(out.iterdir()) or any((out / name).exists() for name in PREPARED_FILES))
    ):
        raise UserError(
            f"--out {str(out)!r} exists and is not a prepared data folder; choose another "
            "--out or delete it"
        )


def write_meta(folder: Path, meta: dict[str, object]) -> None:
    """``folder/meta.json``, written whole or not at all."""
    partial = folder / ".tmp-meta.json"
    with open(partial, "w", encoding="utf-8") as f:
        f.write(json.dumps(meta, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, folder / "meta.json")


def _publish(partial: Path, out: Path) -> None:
    check_replaceable(out)
    if not out.exists():
        os.replace(partial, out)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    os.replace(out, old)
    os.replace(partial, out)
    shutil.rmtree(old, ignore_errors=True)


def _process_is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def remove_stale_partials(out: Path) -> list[Path]:
    """Remove the partial siblings of ``out`` left by killed runs on this host (module
    docstring); returns them."""
    prefix = f".{out.name}.partial-{socket.gethostname()}-"
    removed = []
    for sibling in out.parent.glob(f".{out.name}.partial-*"):
        pid = sibling.name.removeprefix(prefix)
        if sibling.name.startswith(prefix) and pid.isdigit() and _process_is_gone(int(pid)):
            shutil.rmtree(sibling, ignore_errors=True)
            print(f"removed {sibling} (left by process {pid}, no longer running)", file=sys.stderr)
            removed.append(sibling)
    return removed


@contextlib.contextmanager
def building(out: Path) -> Iterator[Path]:
    """The partial folder to fill; published as ``out`` when the block ends without error."""
    check_replaceable(out)
    if out.parent.is_dir():
        remove_stale_partials(out)
    partial = out.parent / f".{out.name}.partial-{socket.gethostname()}-{os.getpid()}"
    try:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
            yield partial
            _publish(partial, out)
        except OSError as err:
            raise DiskError("the prepared data folder", err.filename or out, err) from err
    finally:
        shutil.rmtree(partial, ignore_errors=True)
