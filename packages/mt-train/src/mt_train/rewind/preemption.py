"""SIGTERM / SIGINT as a request to stop at the next step boundary (preemption).

The handler only sets a flag; the trainer finishes the step in progress, folds the flag into
the per-step verdict (so every rank stops after the same step, even if the signal reached
only one of them, or reached them a step apart), saves a checkpoint, waits until it is on disk,
and returns. The previous handlers come back once the first signal is caught, so a second
Ctrl-C interrupts at once. Handlers can only be installed from the main thread; elsewhere
(a trainer driven from a worker thread) signals keep their usual effect.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Installs the handlers while active (a context manager); ``signal_name`` once caught."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.signal_name = signal.Signals(signum).name
        self._restore()

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        self._previous = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()
