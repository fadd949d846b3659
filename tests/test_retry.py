"""deploytool's poll and retry policies (deploy_tool.retry): production timings, and the test mode in which no
policy waits for real time."""

from __future__ import annotations

import time

import pytest

from deploy_tool import retry
from deploy_tool.box.systemd import _settled


class Clock:
    def __init__(self) -> None:
        self.now = 50.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class Again(Exception):
    pass


def test_ready_cuts_the_last_sleep_to_the_deadline() -> None:
    c = Clock()
    poll = retry.ready(1.0, 0.3, retry_on=Again, clock=c, sleep=c.sleep)
    n = 0
    with pytest.raises(Again):
        for attempt in poll:
            with attempt:
                n += 1
                raise Again
    assert c.sleeps == pytest.approx([0.3, 0.3, 0.3, 0.1]) and n == 5
    assert poll.elapsed() == pytest.approx(1.0) and poll.left() == pytest.approx(0.0)


def test_test_mode_overrides_what_a_caller_hands_in() -> None:
    """Inside test_mode even a caller's own sleep (the gate's pidfd wait) is replaced: nothing waits for real."""
    c = Clock()

    def real_sleep(seconds: float) -> None:
        raise AssertionError("slept for real")

    t0 = time.monotonic()
    with retry.test_mode(c, c.sleep):
        poll = retry.ready(600, 1.0, retry_on=Again, clock=time.monotonic, sleep=real_sleep)
        with pytest.raises(Again):
            poll(lambda: (_ for _ in ()).throw(Again()))
        assert retry.clock_for() is c and retry.sleep_for(real_sleep) == c.sleep
    assert sum(c.sleeps) == pytest.approx(600) and len(c.sleeps) == 600
    assert time.monotonic() - t0 < 5
    assert retry.clock_for() is time.monotonic and retry.sleep_for() is time.sleep  # mode ended


def test_journal_settle_waits_for_own_lines_and_quiet() -> None:
    """The failure tail is read every 0.1 s until the unit's own line is in and nothing new came; at most 2 s."""
    c = Clock()
    reads = iter(["a systemd[1]: Starting", "a systemd[1]: Starting\nb srv[7]: boom", "a systemd[1]: Starting\nb srv[7]: boom"])
    with retry.test_mode(c, c.sleep):
        assert _settled(lambda: next(reads)).endswith("boom")
    assert c.sleeps == pytest.approx([0.1, 0.1])
    c2 = Clock()
    with retry.test_mode(c2, c2.sleep):  # only the manager's lines, ever: the last read after ~2 s
        assert _settled(lambda: "x systemd[1]: Failed") == "x systemd[1]: Failed"
    assert sum(c2.sleeps) == pytest.approx(retry.JOURNAL_SETTLE_S)


def test_port_recheck_tries_once_more_after_a_pause() -> None:
    c = Clock()
    answers = iter([False, True])
    with retry.test_mode(c, c.sleep):
        assert retry.port_recheck()(lambda: next(answers)) is True
        assert retry.port_recheck()(lambda: False) is False
    assert c.sleeps == [retry.PORT_RECHECK_S, retry.PORT_RECHECK_S]


def test_siblings_exit_waits_through_the_event_wait() -> None:
    """Between looks, the caller's event wait gets all the time left (it returns when a process exits)."""
    waits: list[float] = []
    looks = iter([{1: "a.service"}, {}])
    poll = retry.siblings_exit(90, retry_on=Again, wait_for=waits.append)  # returns at once: "it exited"
    for attempt in poll:
        with attempt:
            if next(looks):
                raise Again
    assert len(waits) == 1 and 89 < waits[0] <= 90
