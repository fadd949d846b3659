"""Progress bars on stderr for long byte-counting work (hashing, archiving, extracting).

Library code never prints: it takes an optional `progress` callback `(phase, done, total) -> None` with byte
counts. The CLI makes one with `progress_for(json_mode=...)`, which returns None (no bar) when stderr is not a
terminal or when output is JSON, so machine output and logs stay clean.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

ProgressFn = Callable[[str, int, int], None]


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


class ProgressBar:
    """A one-line, thread-safe, rate-limited bar; call it as `bar(phase, done, total)`, then `bar.close()`."""

    def __init__(self, stream: TextIO, *, width: int = 30, interval: float = 0.1) -> None:
        self.stream = stream
        self.width = width
        self.interval = interval
        self._lock = threading.Lock()
        self._last = 0.0
        self._phase: str | None = None
        self._start = time.monotonic()
        self._drawn = False
        self._finished: str | None = None

    def __call__(self, phase: str, done: int, total: int) -> None:
        with self._lock:
            now = time.monotonic()
            if phase != self._phase:
                if self._drawn:
                    self.stream.write("\n")
                self._phase = phase
                self._start = now
                self._last = 0.0
            finished = total > 0 and done >= total
            if finished and self._finished == phase:
                return
            if not finished and now - self._last < self.interval:
                return
            self._last = now
            frac = min(1.0, done / total) if total > 0 else 0.0
            fill = int(frac * self.width)
            rate = done / max(now - self._start, 1e-6)
            line = (f"\r{phase:<12} [{'#' * fill}{'.' * (self.width - fill)}] {frac * 100:5.1f}% "
                    f"{_human(done)}/{_human(total)} {_human(rate)}/s")
            if finished:  # the phase is done: end its line, so no close() is needed
                line += "\n"
                self._finished = phase
            self.stream.write(line)
            self.stream.flush()
            self._drawn = not finished

    def close(self) -> None:
        with self._lock:
            if self._drawn:
                self.stream.write("\n")
                self.stream.flush()
            self._drawn = False


def progress_for(*, json_mode: bool = False, stream: TextIO | None = None) -> ProgressBar | None:
    """A bar on stderr, or None when stderr is not a terminal or output is JSON."""
    stream = stream if stream is not None else sys.stderr
    if json_mode:
        return None
    try:
        if not stream.isatty():
            return None
    except (AttributeError, ValueError):
        return None
    return ProgressBar(stream)


def make_progress(*, enabled: bool = True, stream: TextIO | None = None) -> ProgressBar | None:
    """Like progress_for: a bar when `enabled` and stderr is a terminal, else None."""
    return progress_for(json_mode=not enabled, stream=stream)


class ByteCounter:
    """Adds byte counts from many threads and reports the running total to a progress callback."""

    def __init__(self, progress: ProgressFn | None, phase: str, total: int) -> None:
        self.progress = progress
        self.phase = phase
        self.total = total
        self.done = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        if self.progress is None:
            return
        with self._lock:
            self.done += n
            done = self.done
        self.progress(self.phase, done, self.total)
