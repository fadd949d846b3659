"""The operation lock: a refused caller is told the holder's operation and pid (exit 12), read from a record
the holder writes into the lock file once it holds the flock; real second processes hold it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from deploy_tool.box.state import Store
from deploy_tool.errors import ExitCode, LockedError

# a second deploytool process: takes the lock for OP, says so, holds it until stdin closes (or for HOLD seconds)
HOLDER = """
import sys, time
from deploy_tool.box.state import Store
state_dir, op, hold = sys.argv[1], sys.argv[2], float(sys.argv[3])
with Store(state_dir).lock(what=op, wait=30):
    print("held", flush=True)
    if hold < 0:
        sys.stdin.read()
    else:
        time.sleep(hold)
"""

# many short holders in a row, each with its own operation name: OP-<n>
CHURN = """
import sys, time
from deploy_tool.box.state import Store
state_dir, op, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
end = time.monotonic() + seconds
n = 0
while time.monotonic() < end:
    with Store(state_dir).lock(what=f"{op}-{n}", wait=30):
        time.sleep(0.002)
    n += 1
"""


@contextmanager
def holding(state_dir: Path, op: str) -> Iterator[subprocess.Popen[str]]:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(state_dir), op, "-1"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "held"
        yield p
    finally:
        if p.stdin:
            p.stdin.close()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_lock_error_names_the_holders_operation_and_pid(tmp_path: Path) -> None:
    """Another process holds the lock for a switch: the caller (an install) is refused with exit 12 and the
    message names the switch and that process's pid, not the caller's own operation as the holder."""
    with holding(tmp_path, "switch to llamacpp-tensor") as p, pytest.raises(LockedError) as ei, \
            Store(tmp_path).lock(what="install"):
        pass
    exc = ei.value
    assert exc.exit_code == ExitCode.LOCKED == 12
    assert f"another deploytool (switch to llamacpp-tensor, pid {p.pid}, since " in exc.message
    assert exc.message.startswith("cannot install: ")
    assert isinstance(exc.details, dict) and exc.details["holder"]["pid"] == p.pid


def test_lock_is_free_again_after_the_holder_exits_and_wait_takes_it(tmp_path: Path) -> None:
    """--wait: a holder that finishes within the wait lets the caller through; the record is then the caller's."""
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), "pin a", "0.5"], stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    t0 = time.monotonic()
    store = Store(tmp_path)
    with store.lock(what="recover", wait=20):
        waited = time.monotonic() - t0
        assert store.holder() == {"operation": "recover", "pid": os.getpid(), "since": store.holder()["since"]}
    p.wait(timeout=10)
    assert 0.1 < waited < 15
    assert store.holder() is None  # released: nobody holds it, whatever the last record says


def test_killed_holder_releases_the_lock(tmp_path: Path) -> None:
    """kill -9 of the holder frees the lock at once (the kernel drops the flock with the process)."""
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), "switch to x", "-1"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    with pytest.raises(LockedError), Store(tmp_path).lock(what="install"):
        pass
    p.kill()
    p.wait(timeout=10)
    with Store(tmp_path).lock(what="install"):
        pass


def test_record_names_the_holder_under_contention(tmp_path: Path) -> None:
    """Two processes take and release the lock hundreds of times while this one keeps trying: every refusal
    that names a holder names an operation together with the pid of the process that took the lock for it
    (never a mix of two records), and the lock file read at any moment is empty (free, or taken a moment ago)
    or one whole record."""
    procs = {subprocess.Popen([sys.executable, "-c", CHURN, str(tmp_path), f"op{i}", "2.5"]): f"op{i}"
             for i in range(2)}
    by_pid = {p.pid: op for p, op in procs.items()}
    refusals = 0
    unknown = 0
    deadline = time.monotonic() + 2.5
    while not (tmp_path / "lock").is_file():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        while time.monotonic() < deadline:
            raw = (tmp_path / "lock").read_bytes()
            if raw:
                rec = json.loads(raw)
                assert rec["operation"].rsplit("-", 1)[0] == {**by_pid, os.getpid(): "probe"}[rec["pid"]], rec
            try:
                with Store(tmp_path).lock(what="probe"):
                    pass
            except LockedError as exc:
                h = exc.details["holder"] if isinstance(exc.details, dict) else None
                if h is None:
                    unknown += 1  # released (or not yet recorded) between the refusal and the look
                    assert "cannot probe: another deploytool holds" in exc.message
                    continue
                refusals += 1
                assert h["pid"] in by_pid, h
                assert h["operation"].rsplit("-", 1)[0] == by_pid[h["pid"]], (h, by_pid)
                assert f"({h['operation']}, pid {h['pid']}, since " in exc.message
    finally:
        for p in procs:
            assert p.wait(timeout=30) == 0
    assert refusals > 20, (refusals, unknown)


def test_a_killed_holders_record_names_nobody(tmp_path: Path) -> None:
    """kill -9 leaves the holder's record in the lock file: it is not taken for a live holder (status and the
    liveness probe ask), and the next holder writes its own."""
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), "switch to x", "-1"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    store = Store(tmp_path)
    assert (store.holder() or {}).get("pid") == p.pid
    p.kill()
    p.wait(timeout=10)
    assert json.loads((tmp_path / "lock").read_bytes())["pid"] == p.pid  # left behind
    assert store.holder() is None
    with store.lock(what="install"):
        assert (store.holder() or {}).get("operation") == "install"


def test_a_dry_run_previews_the_lock_refusal(tmp_path: Path) -> None:
    """refuse_if_held: free (or no lock file yet) passes and creates nothing; held by another process, with or
    without a record (a bare `flock` too), the run's own refusal (exit 12); free again once the holder exits."""
    store = Store(tmp_path / "state")
    store.refuse_if_held("switch to x")  # nothing there
    assert not (tmp_path / "state").exists()
    with holding(tmp_path / "state", "install") as p, pytest.raises(LockedError) as ei:
        store.refuse_if_held("switch to x")
    assert ei.value.exit_code == ExitCode.LOCKED and f"pid {p.pid}" in ei.value.message
    bare = subprocess.Popen(["flock", str(store.lock_path), "sleep", "30"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while True:  # until flock holds it
            try:
                store.refuse_if_held("switch to x")
            except LockedError:
                break
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        os.killpg(bare.pid, signal.SIGKILL)  # flock and its sleep, which holds the lock too: the group we started
        bare.wait()
    deadline = time.monotonic() + 10
    while True:  # free again once the sleep is gone too (its death, not flock's, lets go of the lock)
        try:
            store.refuse_if_held("switch to x")
            break
        except LockedError:
            assert time.monotonic() < deadline, "the lock was still held 10 s after its holders were killed"
            time.sleep(0.02)
