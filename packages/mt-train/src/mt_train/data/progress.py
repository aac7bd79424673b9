"""Progress of ``mt-prepare-data``: documents, tokens, MB/s of input and an ETA from input bytes.

On a terminal one line is redrawn in place (carriage return) at most ``refresh_s`` apart; on
anything else (a log file, a pipe) a plain line is printed every ``every_s`` seconds, so a
job log shows progress without control characters. ``quiet`` prints nothing. The ETA is
``(total - read) / rate`` with ``rate = read / elapsed`` in input bytes (compressed bytes
for ``.gz`` inputs, whose size on disk is what is known in advance).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


class Progress:
    """Call :meth:`update` as work completes and :meth:`close` at the end."""

    def __init__(
        self,
        total_bytes: int,
        quiet: bool = False,
        every_s: float = 30.0,
        refresh_s: float = 0.2,
        stream: TextIO | None = None,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.total_bytes, self.quiet = total_bytes, quiet
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = refresh_s if self.tty else every_s
        self.start = self._last = time.monotonic()
        self.lines = 0

    def line(self, documents: int, tokens: int, bytes_read: int) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = bytes_read / elapsed
        done = min(bytes_read / self.total_bytes, 1.0) if self.total_bytes else 1.0
        eta = (self.total_bytes - bytes_read) / rate if rate > 0 else 0.0
        return (
            f"{100 * done:5.1f}% | {documents:,} documents | {tokens:,} tokens | "
            f"{rate / 1e6:.1f} MB/s | elapsed {_duration(elapsed)} | ETA {_duration(max(eta, 0))}"
        )

    def update(self, documents: int, tokens: int, bytes_read: int) -> None:
        now = time.monotonic()
        if self.quiet or now - self._last < self.interval:
            return
        self._last = now
        self._emit(self.line(documents, tokens, bytes_read))

    def close(self, documents: int, tokens: int, bytes_read: int) -> None:
        if self.quiet:
            return
        self._emit(self.line(documents, tokens, bytes_read))
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def _emit(self, text: str) -> None:
        self.lines += 1
        self.stream.write(f"\r{text}\x1b[K" if self.tty else f"mt-prepare-data: {text}\n")
        self.stream.flush()
