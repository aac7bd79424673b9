"""Hang diagnostics: a step watchdog, collective-timeout reports and the NCCL flight recorder.

Three tools, each for a different way a multi-rank job stops making progress:

* :class:`StepWatchdog` (``trainer.step_timeout_s``): a daemon thread per rank. The trainer
  calls :meth:`StepWatchdog.beat` as every step begins; if ``step_timeout_s`` pass without the
  next beat, the thread writes every Python thread's stack of its rank (``faulthandler``) to
  ``<run>/hang/rank<r>.txt`` (with the flight recorder's buffer when that is on), prints one
  line and ends the process with :data:`EXIT_HANG`. A rank stuck outside a collective and the
  ranks waiting for it in one all miss their beat, so every rank leaves its stacks. The thread
  needs the GIL; should a C call block while holding it, ``faulthandler``'s own C watchdog
  (re-armed at every beat for ``step_timeout_s + BACKSTOP_GRACE_S``) dumps the stacks to
  stderr and exits with status 1 instead.
* :func:`collective_timeout_message` (``comm.timeout_s``, passed to ``init_process_group``): a
  collective that waits longer raises on backends that report timeouts as exceptions (gloo);
  ``mt-train`` turns that into one line naming the rank, the ``torch.distributed`` call that
  timed out and the mt frame it was called from, read off the exception's traceback.
* PyTorch's flight recorder (``comm.trace_buffer_size``): :func:`flight_recorder_env` sets
  ``TORCH_FR_BUFFER_SIZE`` / ``TORCH_NCCL_TRACE_BUFFER_SIZE`` and ``TORCH_NCCL_DUMP_ON_TIMEOUT``
  before the process group exists, and :func:`flight_recorder_dump_path` points
  ``TORCH_FR_DUMP_TEMP_FILE`` at ``<run>/flight_recorder/rank_`` once the run folder is agreed
  (the dump file is opened only when a dump happens). NCCL's own watchdog then dumps every
  rank's recent collectives on a timeout; ``torchfrtrace <run>/flight_recorder -p rank_``
  reports which collective which ranks never joined. Variables already set in the environment
  are left alone. The watchdog, and ``mt-train`` on a collective timeout, also write their
  rank's buffer there themselves (:func:`dump_flight_recorder`); on gloo (torch 2.13) the
  buffer holds the collectives but not the process-group table ``torchfrtrace`` needs, so
  there it is read with ``torch.distributed.flight_recorder.components.loader.read_dump``.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import re
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from mt_train.config.observability import CommConfig

EXIT_HANG = 4
"""Exit status of a rank whose step outlived ``trainer.step_timeout_s``."""
EXIT_COLLECTIVE_TIMEOUT = 5
"""Exit status of ``mt-train`` when a collective timed out (``comm.timeout_s``)."""
FLIGHT_RECORDER_DIR = "flight_recorder"
FLIGHT_RECORDER_PREFIX = "rank_"
HANG_DIR = "hang"
BACKSTOP_GRACE_S = 30.0
"""How long after the watchdog's deadline faulthandler's GIL-free backstop fires."""


def flight_recorder_env(cfg: CommConfig) -> None:
    """Turn the flight recorder on for process groups created after this call."""
    if cfg.trace_buffer_size <= 0:
        return
    size = str(cfg.trace_buffer_size)
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", size)
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", size)
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")


def flight_recorder_dump_path(cfg: CommConfig, run_dir: Path) -> Path | None:
    """Point the flight recorder's dumps into ``run_dir`` (the folder, or None when off)."""
    if cfg.trace_buffer_size <= 0:
        return None
    folder = run_dir / FLIGHT_RECORDER_DIR
    folder.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(folder / FLIGHT_RECORDER_PREFIX))
    return folder


def _flight_recorder_bytes() -> bytes | None:
    """This rank's flight-recorder buffer of the default group's backend, pickled as the
    timeout dumps write it (NCCL keeps its own recorder; gloo and others share the generic
    one); None when this torch build has no recorder for it."""
    if not torch.distributed.is_initialized():
        return None
    nccl = torch.distributed.get_backend() == "nccl"
    dump = getattr(
        torch._C._distributed_c10d, "_dump_nccl_trace" if nccl else "_dump_fr_trace", None
    )
    return dump() if dump is not None else None


@dataclass
class FlightRecorderDump:
    """A rank's flight-recorder buffer written to the run folder."""

    path: Path
    last_collective: str | None
    """The newest recorded collective: its name, sequence number and state."""


def dump_flight_recorder(run_dir: Path, rank: int) -> FlightRecorderDump | None:
    """Write this rank's flight-recorder buffer to ``<run>/flight_recorder/rank_<rank>`` (what
    ``torchfrtrace`` reads); None when there is none to write."""
    data = _flight_recorder_bytes()
    if data is None:
        return None
    folder = run_dir / FLIGHT_RECORDER_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{FLIGHT_RECORDER_PREFIX}{rank}"
    path.write_bytes(data)
    # NOTE: the dump is PyTorch's own pickle (torchfrtrace unpickles it too); it was just made
    # by this process, so reading it back trusts nothing from outside.
    entries = pickle.loads(data).get("entries", [])
    last = entries[-1] if entries else None
    name = (
        f"{last['profiling_name']} #{last['collective_seq_id']} ({last['state']})"
        if last is not None
        else None
    )
    return FlightRecorderDump(path, name)


class StepWatchdog:
    """Dumps this rank's stacks and exits when a step outlives ``timeout_s`` (module docstring)."""

    def __init__(
        self, timeout_s: float, run_dir: Path, rank: int, flight_recorder: bool = False
    ) -> None:
        self.timeout_s, self.run_dir, self.rank = timeout_s, run_dir, rank
        self.flight_recorder = flight_recorder
        self._deadline: float | None = None
        self._step = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="mt-step-watchdog", daemon=True)
        self._thread.start()

    def beat(self, step: int) -> None:
        """Step ``step`` begins: it has ``timeout_s`` seconds until the next beat."""
        self._step = step
        self._deadline = time.monotonic() + self.timeout_s
        faulthandler.dump_traceback_later(self.timeout_s + BACKSTOP_GRACE_S, exit=True)

    def pause(self) -> None:
        """No step is running (after the loop): stop watching until the next beat."""
        self._deadline = None
        faulthandler.cancel_dump_traceback_later()

    def _watch(self) -> None:
        poll_s = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(poll_s):
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                self._fire()

    def _fire(self) -> None:
        folder = self.run_dir / HANG_DIR
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}.txt"
        with open(path, "w", encoding="utf-8") as out:
            out.write(
                f"rank {self.rank}: step {self._step} ran longer than trainer.step_timeout_s="
                f"{self.timeout_s:g} s; Python stacks of every thread, most recent call first:\n"
            )
            out.flush()
            faulthandler.dump_traceback(out, all_threads=True)
        if self.flight_recorder:
            self._dump_flight_recorder()
        print(
            f"mt-train: rank {self.rank}: step {self._step} exceeded trainer.step_timeout_s="
            f"{self.timeout_s:g} s; every thread's Python stack is in {path}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_HANG)

    def _dump_flight_recorder(self) -> None:
        try:
            dump = dump_flight_recorder(self.run_dir, self.rank)
        except RuntimeError as err:  # the process is about to exit: report, do not raise
            print(f"mt-train: rank {self.rank}: no flight recorder dump: {err}", file=sys.stderr)
            return
        if dump is None:
            print(
                f"mt-train: rank {self.rank}: no flight recorder dump: no process group, or "
                "no recorder for its backend in this torch build",
                file=sys.stderr,
            )

    def close(self) -> None:
        """Stop the thread (and the backstop)."""
        faulthandler.cancel_dump_traceback_later()
        self._stop.set()
        self._thread.join()


TIMEOUT_WORDS = ("timed out", "timeout")
COLLECTIVE_NAMES = re.compile(
    r"\b(all_?reduce|all_?gather\w*|reduce_?scatter\w*|broadcast|barrier|all_?to_?all\w*|"
    r"send|recv)\b"
)


def is_collective_timeout(err: BaseException) -> bool:
    """Whether ``err`` reads as a timed-out collective (the backend's message says so)."""
    return isinstance(err, RuntimeError) and any(w in str(err).lower() for w in TIMEOUT_WORDS)


def collective_timeout_message(
    err: BaseException, rank: int, timeout_s: float, recorded: FlightRecorderDump | None = None
) -> str | None:
    """One line naming the rank, the collective and where mt called it, if ``err`` is a
    collective timeout; None for any other error. With this rank's flight-recorder dump
    (``recorded``) the collective is the newest one it recorded."""
    if not is_collective_timeout(err):
        return None
    frames = traceback.extract_tb(err.__traceback__)
    collective = caller = None
    for frame in frames:
        if frame.filename.endswith(os.path.join("distributed", "distributed_c10d.py")):
            collective = collective or frame.name
        elif f"{os.sep}mt_" in frame.filename:
            caller = frame
    where = (
        f"called from {Path(caller.filename).name}:{caller.lineno} ({caller.name})"
        if caller is not None
        else "called outside mt's code"
    )
    if recorded is not None and recorded.last_collective is not None:
        what = f"collective {recorded.last_collective}"
    elif collective is not None:
        what = f"collective {collective}"
    else:  # raised inside a torch engine (DDP's reducer): the backend's text names its operation
        named = COLLECTIVE_NAMES.search(str(err).lower())
        what = (
            f"a collective ({named.group(0)}, in the backend's error)" if named else "a collective"
        )
    help_ = (
        f"this rank's flight recorder: {recorded.path}"
        if recorded is not None
        else "comm.trace_buffer_size records every rank's collectives"
    )
    return (
        f"rank {rank}: {what} {where} timed out after comm.timeout_s={timeout_s:g} s: another "
        f"rank never joined it ({help_}; trainer.step_timeout_s dumps stacks to <run>/hang/)"
    )
