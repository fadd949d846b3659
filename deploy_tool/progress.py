"""Progress on stderr: bars for long byte-counting work (hashing, archiving, extracting), and a line for every
wait over 2 s (see `waiting`).

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
            global _bar_drawn_at
            _bar_drawn_at = now  # a wait's line keeps off the bar's

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


# ---------------------------------------------------------------------------------------------------------- waits
#
# A wait (pip's downloads, packing, unpacking, pinning, the health gate, the readiness wait) shows one line on the
# terminal once it has lasted WAIT_SHOW_AFTER_S: what is awaited, the time so far and the limit, redrawn every
# WAIT_INTERVAL_S, erased when the wait ends. Library code only says what it waits for (`with waiting(...)`); the
# CLI turns the line on (`enable_waits`) when stderr is a terminal and the output is not JSON. Nothing is drawn
# otherwise: not under systemd (the units' ExecStartPre/Post), not in a pipe, not with --json.

WAIT_SHOW_AFTER_S = 2.0
WAIT_INTERVAL_S = 0.5

_wait_stream: TextIO | None = None
_wait_enabled: Callable[[], bool] = lambda: False  # noqa: E731
_wait_lock = threading.Lock()
_wait_stack: list[Wait] = []
_bar_drawn_at = 0.0  # when a ProgressBar last drew: a wait's line stays off it for a second


def enable_waits(stream: TextIO | None = None, *, when: Callable[[], bool] = lambda: True) -> None:
    """Show waits on `stream` (default stderr) when it is a terminal and `when()` holds as each wait starts (the
    CLI passes `not --json`, which may be given after the command name)."""
    global _wait_stream, _wait_enabled
    _wait_stream = stream if stream is not None else sys.stderr
    _wait_enabled = when


def disable_waits() -> None:
    global _wait_stream, _wait_enabled
    _wait_stream = None
    _wait_enabled = lambda: False  # noqa: E731


def _fmt_s(s: float) -> str:
    return f"{s:.0f}s" if s < 60 else f"{int(s // 60)}m{int(s % 60):02d}s"


class Wait:
    """One wait's line (see `waiting`); `note(text)` adds what it is at (an attempt, a state) to the line."""

    def __init__(self, what: str, limit: float | None, stream: TextIO | None, *,
                 show_after: float = WAIT_SHOW_AFTER_S, interval: float = WAIT_INTERVAL_S) -> None:
        self.what = what
        self.limit = limit
        self.stream = stream
        self.show_after = show_after
        self.interval = interval
        self.start = time.monotonic()
        self.detail = ""
        self.drawn = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def note(self, detail: str) -> None:
        self.detail = detail

    def line(self, now: float | None = None) -> str:
        elapsed = (now if now is not None else time.monotonic()) - self.start
        limit = f" (limit {_fmt_s(self.limit)})" if self.limit else ""
        detail = f": {self.detail}" if self.detail else ""
        return f"waiting for {self.what}{detail}: {_fmt_s(elapsed)}{limit}"

    def _draw(self) -> None:
        if self.stream is None:
            return
        with _wait_lock:
            if _wait_stack and _wait_stack[-1] is not self:
                return  # an inner wait draws
            if time.monotonic() - _bar_drawn_at < 1.0:
                return  # a byte-counting bar shows this wait's progress already
            self.stream.write("\r\x1b[K" + self.line())
            self.stream.flush()
            self.drawn = True

    def _run(self) -> None:
        if self._stop.wait(self.show_after):
            return
        while True:
            self._draw()
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> Wait:
        if self.stream is not None:
            with _wait_lock:
                _wait_stack.append(self)
            self._thread = threading.Thread(target=self._run, name="progress-wait", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.stream is not None:
            with _wait_lock:
                if self in _wait_stack:
                    _wait_stack.remove(self)
                if self.drawn:
                    self.stream.write("\r\x1b[K")
                    self.stream.flush()
                    self.drawn = False


def waiting(what: str, *, limit: float | None = None) -> Wait:
    """`with waiting("the health gate of llamacpp-tensor", limit=900):` shows, after 2 s on a terminal,
    `waiting for the health gate of llamacpp-tensor: 14s (limit 15m00s)`; elsewhere it does nothing."""
    stream = _wait_stream
    if stream is not None:
        try:
            if not (_wait_enabled() and stream.isatty()):
                stream = None
        except (AttributeError, ValueError):
            stream = None
    return Wait(what, limit, stream)
