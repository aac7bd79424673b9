"""Errors that end a command with one line instead of a traceback.

Every command-line tool of mt-train (``mt-train``, ``mt-prepare-data``, ``mt-convert``) turns
a :class:`UserError` into exactly one line ``<tool>: error: <message>`` on stderr and exit
status 2 (:func:`report`). The message names the offending value (a path, a key, a number)
and, where there is one, what would be valid. Raise a :class:`UserError` for what the user
can fix: a bad data folder, a checkpoint of another model, a run folder that another run holds,
a disk that is full or read-only. Anything else is a bug and keeps its traceback.

Invariant: a command that ends with a :class:`UserError` leaves nothing behind that a later
run mistakes for valid output (data folders are checked before use, checkpoints are published
only whole, :mod:`mt_train.checkpoint.files`).
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

EXIT_USER_ERROR = 2
"""Exit status of a command stopped by a :class:`UserError`."""


class UserError(Exception):
    """Bad input or a bad environment the user can fix; reported in one line."""


class DataError(UserError):
    """A prepared data folder that cannot be trained on."""


class CheckpointError(UserError):
    """A checkpoint that cannot be used for what was asked (wrong model, not a checkpoint)."""


class RankZeroError(UserError):
    """Rank 0's error as the other ranks see it: they stop too, and only rank 0 reports it."""


class RunLockedError(UserError):
    """Another live process holds the run folder."""


class DiskError(UserError):
    """An ``OSError`` while writing: the path and the errno, and what it was writing."""

    def __init__(self, what: str, path: str | Path, err: OSError) -> None:
        code = errno.errorcode.get(err.errno, str(err.errno)) if err.errno else "no errno"
        reason = err.strerror or str(err)
        super().__init__(f"cannot write {what} {str(path)!r}: {reason} ({code})")
        self.path, self.errno = Path(path), err.errno


def one_line(text: str) -> str:
    """``text`` with its lines joined (a message may quote a multi-line reason)."""
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def report(tool: str, err: BaseException | str) -> int:
    """Print ``<tool>: error: <message>`` (one line) to stderr; returns the exit status."""
    print(f"{tool}: error: {one_line(str(err))}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR


def check_writable(path: str | Path, what: str) -> None:
    """Raise :class:`DiskError` unless a file can be created in ``path`` (or, if it does not
    exist yet, in its nearest existing parent, where it would be created)."""
    folder = Path(path).expanduser().absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise DiskError(what, path, NotADirectoryError(errno.ENOTDIR, "not a folder"))
    probe = folder / f".mt-write-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0")
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise DiskError(what, path, err) from None
    finally:
        probe.unlink(missing_ok=True)
