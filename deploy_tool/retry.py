"""Every wait of deploytool that polls or retries, as named tenacity policies in one place, with a test mode
that never sleeps.

    ready(timeout, interval)       health.wait_ready: a probe every health.interval_s until the start timeout,
                                   the last sleep cut to the deadline; retried while the server is not ready yet
    journal_settle()               Systemd's failure tail: re-read every 0.1 s, at most 2 s, until the unit's own
                                   lines are in and nothing new arrived
    siblings_exit(timeout, ...)    portwait.await_port: until the other backends' processes are gone (90 s by
                                   default), woken by their exits (pidfds), not by a period
    start_job(timeout, step)       the health gate, after its checks: until the unit's start job has ended (its
                                   ExecStartPost exited), woken by that process's exit (a pidfd)
    port_recheck()                 portwait.await_port: a port that nobody visible holds is tried once more
                                   0.05 s later

Each policy reads the time from `clock_for()` and waits through `sleep_for()` of this module: the clock, sleep
or event wait its caller hands in, else time.monotonic and time.sleep. Inside `test_mode(clock, sleep)`
every policy reads the given clock and waits through the given sleep instead, also where a caller handed in
its own: a test walks through minutes of timeouts without waiting for real time.

A policy is a `Poll`: iterate it like tenacity.Retrying (`for attempt in poll: with attempt: ...`) or call it
with the function to retry; `left()` and `elapsed()` read its own clock.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import tenacity

T = TypeVar("T")
Clock = Callable[[], float]
Sleep = Callable[[float], None]

JOURNAL_SETTLE_S = 2.0  # the longest a failure tail waits for the unit's own last words
JOURNAL_SETTLE_EVERY_S = 0.1  # ... and how long nothing new must arrive
PORT_RECHECK_S = 0.05  # a listener closing right now is gone by then

_lock = threading.Lock()
_test: tuple[Clock, Sleep] | None = None


@contextlib.contextmanager
def test_mode(clock: Clock, sleep: Sleep) -> Iterator[None]:
    """Within: every policy reads `clock` and waits through `sleep` (a fake clock's advance), whatever its caller
    handed in. For tests only; nests (the inner mode wins until it ends)."""
    global _test
    with _lock:
        prev, _test = _test, (clock, sleep)
    try:
        yield
    finally:
        with _lock:
            _test = prev


def clock_for(given: Clock | None = None) -> Clock:
    """The clock a policy reads: the test mode's, else `given`, else time.monotonic."""
    mode = _test
    return mode[0] if mode is not None else (given or time.monotonic)


def sleep_for(given: Sleep | None = None) -> Sleep:
    """How a policy waits: the test mode's sleep, else `given` (e.g. an event wait), else time.sleep."""
    mode = _test
    return mode[1] if mode is not None else (given or time.sleep)


class _Deadline(tenacity.stop.stop_base):
    """Stop once the policy's clock reaches the deadline (tenacity's own stops read time.monotonic)."""

    def __init__(self, clk: Clock, deadline: float) -> None:
        self.clock = clk
        self.deadline = deadline

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        return self.clock() >= self.deadline


class Poll:
    """One run of a policy with a deadline: tenacity.Retrying plus the clock it reads."""

    def __init__(self, name: str, timeout: float, *, clk: Clock, nap: Sleep,
                 wait: Callable[[Poll], float], **retrying: Any) -> None:
        self.name = name
        self.clock = clk
        self.start = clk()
        self.deadline = self.start + timeout
        self.retrying = tenacity.Retrying(stop=_Deadline(clk, self.deadline), wait=lambda _: wait(self), sleep=nap,
                                          name=name, **retrying)

    def left(self) -> float:
        return self.deadline - self.clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def __iter__(self) -> Iterator[tenacity.AttemptManager]:
        return iter(self.retrying)

    def __call__(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return self.retrying(fn, *args, **kwargs)


def _last_result(retry_state: tenacity.RetryCallState) -> Any:
    """At the deadline, give the last attempt's result back instead of raising tenacity.RetryError."""
    assert retry_state.outcome is not None
    return retry_state.outcome.result()


# ------------------------------------------------------------------------------------------------ the policies

def ready(timeout: float, interval: float, *, retry_on: type[BaseException], clock: Clock | None = None,
          sleep: Sleep | None = None) -> Poll:
    """health.wait_ready: retry while `retry_on` is raised, every `interval`, never sleeping past the deadline
    `timeout` seconds from now; at the deadline the last `retry_on` is raised."""
    return Poll("ready", timeout, clk=clock_for(clock), nap=sleep_for(sleep),
                wait=lambda p: max(0.0, min(interval, p.left())),
                retry=tenacity.retry_if_exception_type(retry_on), reraise=True)


def journal_settle() -> Poll:
    """Systemd's failure tail: call the read until it returns True (settled), every JOURNAL_SETTLE_EVERY_S, at
    most JOURNAL_SETTLE_S; at the deadline the last result (False) is returned."""
    return Poll("journal-settle", JOURNAL_SETTLE_S, clk=clock_for(), nap=sleep_for(),
                wait=lambda p: JOURNAL_SETTLE_EVERY_S,
                retry=tenacity.retry_if_result(lambda settled: not settled), retry_error_callback=_last_result)


def siblings_exit(timeout: float, *, retry_on: type[BaseException], wait_for: Sleep) -> Poll:
    """portwait.await_port: retry while `retry_on` is raised (other backends still running); between attempts
    `wait_for(seconds_left)` returns when one of them exits (or at the deadline); at the deadline the last
    `retry_on` is raised."""
    return Poll("siblings-exit", timeout, clk=clock_for(), nap=sleep_for(wait_for), wait=lambda p: max(0.0, p.left()),
                retry=tenacity.retry_if_exception_type(retry_on), reraise=True)


def start_job(timeout: float, step: Callable[[], float], *, retry_on: type[BaseException], wait_for: Sleep) -> Poll:
    """gate.UnitWatch.started: retry while `retry_on` is raised (the unit's start job has not ended); between
    attempts at most `step()` seconds through `wait_for`, which returns early when the job's control process
    exits; at the deadline the last `retry_on` is raised."""
    return Poll("start-job", timeout, clk=clock_for(), nap=sleep_for(wait_for),
                wait=lambda p: max(0.0, min(step(), p.left())),
                retry=tenacity.retry_if_exception_type(retry_on), reraise=True)


def port_recheck() -> tenacity.Retrying:
    """portwait.await_port: call the bind test once more PORT_RECHECK_S later if it returned False; returns the
    last result."""
    return tenacity.Retrying(stop=tenacity.stop_after_attempt(2), wait=tenacity.wait_fixed(PORT_RECHECK_S),
                             sleep=sleep_for(), retry=tenacity.retry_if_result(lambda ok: not ok),
                             retry_error_callback=_last_result, name="port-recheck")
