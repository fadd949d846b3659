"""The ExecStartPre's wait for the served port (deploy_tool/portwait.py), with real sockets and real processes.

A "sibling backend" here is whatever unit/scope this test runs in (the last part of its cgroup path), so a child
process of the test counts as a process of that unit, exactly as the stopping backend's processes do in systemd.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy_tool import portwait
from deploy_tool.portwait import PortTaken
from tests.support.sandbox import free_port


@contextlib.contextmanager
def listener(port: int, *, close_after: float, exit_after: float) -> Iterator[subprocess.Popen[str]]:
    """A child that listens on 127.0.0.1:port, closes the listener after `close_after` s, exits after `exit_after`;
    killed (by its PID) when the block ends."""
    code = ("import socket, sys, time\n"
            "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            f"s.bind(('127.0.0.1', {port})); s.listen(); print('up', flush=True)\n"
            f"time.sleep({close_after}); s.close(); time.sleep({max(0.0, exit_after - close_after)})\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "up"
        yield p
    finally:
        p.kill()
        p.wait()


@pytest.fixture
def port() -> int:
    return free_port()


def test_free_port_returns_at_once(port: int) -> None:
    said: list[str] = []
    assert portwait.await_port("127.0.0.1", port, siblings=[], say=said.append) < 0.5
    assert said == []


def only(p: subprocess.Popen[str]):
    """The real /proc scan for processes of this test's own cgroup, narrowed to the child `p` (the test runner's
    other processes share the cgroup and must not be waited for)."""
    parent, _, unit = portwait.own_cgroup().rstrip("/").rpartition("/")
    return lambda: {pid: u for pid, u in portwait.unit_pids([unit], parent=parent).items()
                    if pid == p.pid and p.poll() is None}


def test_unit_pids_matches_the_units_beside_this_one(tmp_path: Path) -> None:
    """unit_pids reads each process's cgroup: a process of a sibling unit (or a sub-cgroup of it) counts; the same
    unit name under another manager (outside this cgroup namespace: "/../..") or another slice does not."""
    proc = tmp_path / "proc"
    rows = {"self": "/system.slice/llamacpp-tensor.service", "101": "/system.slice/ftllm-dflash.service",
            "102": "/system.slice/ftllm-dflash.service/worker", "103": "/../../sandbox/system.slice/ftllm-dflash.service",
            "104": "/user.slice/ftllm-dflash.service", "105": "/system.slice/other.service", "106": "/"}
    for pid, cg in rows.items():
        (proc / pid).mkdir(parents=True)
        (proc / pid / "cgroup").write_text(f"1:name=systemd:{cg}\n0::{cg}\n")
    assert portwait.own_cgroup(str(proc)) == "/system.slice/llamacpp-tensor.service"
    assert portwait.unit_pids(["ftllm-dflash.service"], str(proc)) == {101: "ftllm-dflash.service",
                                                                      102: "ftllm-dflash.service"}
    assert portwait.siblings_parent("/") == "/system.slice"  # not run by a unit (a shell): where services are
    assert portwait.siblings_parent("/a.slice/x.service") == "/a.slice"


def test_unit_pids_reads_the_real_proc(port: int) -> None:
    """Against the real /proc: a child of this test is found in this test's own cgroup, this process never."""
    own = portwait.own_cgroup()
    parent, _, unit = own.rstrip("/").rpartition("/")
    with listener(port, close_after=30, exit_after=30) as p:
        found = portwait.unit_pids([unit], parent=parent)
        assert found.get(p.pid) == unit and os.getpid() not in found


def test_waits_for_a_sibling_backend_to_exit(port: int) -> None:
    """A process of another backend's unit still runs: wait until it exits (woken by the exit, not a timeout)."""
    with listener(port, close_after=0.6, exit_after=0.6) as p:
        said: list[str] = []
        waited = portwait.await_port("127.0.0.1", port, siblings=["sibling.service"], say=said.append, timeout=30,
                                     sibling_pids=only(p))
        assert 0.3 < waited < 5 and p.poll() is not None
        assert len(said) == 1 and f"pid {p.pid}" in said[0] and "to exit" in said[0]


def test_a_closed_listener_is_not_enough(port: int) -> None:
    """A sibling that closed its listener but still runs (a server finishing its shutdown, its GPU memory still
    held) is waited for all the same."""
    with listener(port, close_after=0.1, exit_after=1.0) as p:
        waited = portwait.await_port("127.0.0.1", port, siblings=["sibling.service"], timeout=30, sibling_pids=only(p))
        assert waited > 0.6 and p.poll() is not None


def test_foreign_holder_fails_at_once_naming_it(port: int) -> None:
    """Held by anything that is not a sibling backend: PortTaken at once, naming the PID, exit code 9."""
    with listener(port, close_after=30, exit_after=30) as p:
        t0 = time.monotonic()
        with pytest.raises(PortTaken) as ei:
            portwait.await_port("127.0.0.1", port, siblings=["llamacpp-tensor.service"], timeout=30)
        assert time.monotonic() - t0 < 2
        assert f"pid {p.pid}" in ei.value.message and str(port) in ei.value.message
        assert int(ei.value.exit_code) == 9 and "ss -ltnp" in (ei.value.hint or "")


def test_holder_this_check_cannot_see_is_foreign(port: int, tmp_path: Path) -> None:
    """A listener whose process is not visible (another PID namespace; here: an empty /proc) fails too."""
    (tmp_path / "net").mkdir()
    with listener(port, close_after=30, exit_after=30), pytest.raises(PortTaken, match="cannot see"):
        portwait.await_port("127.0.0.1", port, siblings=["x.service"], proc=str(tmp_path), timeout=30)


def test_sibling_that_never_exits_times_out(port: int) -> None:
    with listener(port, close_after=30, exit_after=30) as p:
        t0 = time.monotonic()
        with pytest.raises(PortTaken, match="still running after"):
            portwait.await_port("127.0.0.1", port, siblings=["sibling.service"], timeout=0.5, sibling_pids=only(p))
        assert time.monotonic() - t0 < 3


def test_listening_inodes_and_holders_find_the_listener(port: int) -> None:
    with listener(port, close_after=30, exit_after=30) as p:
        inodes = portwait.listening_inodes(port)
        assert len(inodes) == 1
        found = portwait.holders(inodes)
        assert [h.pid for h in found] == [p.pid] and found[0].cgroup == portwait.own_cgroup() and found[0].comm.startswith("py")


def test_unbindable_host_is_one_clear_error(port: int) -> None:
    with pytest.raises(PortTaken, match="cannot bind 192.0.2.1"):
        portwait.await_port("192.0.2.1", port, siblings=[])


def test_a_start_refused_by_the_check_is_reported_in_its_words() -> None:
    """A switch whose target start fails in the ExecStartPre reports that check's own error line (from the
    journal tail systemd's failure carries), not "the control process exited with error code"."""
    from deploy_tool.box.switch import refused_by_check
    from deploy_tool.errors import HealthError, SystemdError

    tail = ("Nov 29 15:16:34 vm systemd[1]: Starting llamacpp-tensor.service - llama.cpp...\n"
            "Nov 29 15:16:34 vm deploytool[182]: error: port 8082 is held by pid 4242 (python3, cgroup /x); the "
            "server cannot bind it\n"
            "Nov 29 15:16:34 vm systemd[1]: llamacpp-tensor.service: Control process exited, code=exited, status=9")
    exc = SystemdError("start of llamacpp-tensor.service failed (ActiveState=failed): Job failed", details=tail)
    out = refused_by_check(exc, "llamacpp-tensor.service")
    assert isinstance(out, HealthError) and out.details["reason"] == "port-taken"
    assert out.message.startswith("llamacpp-tensor.service refused to start: port 8082 is held by pid 4242")
    drift = SystemdError("start failed", details="x deploytool[9]: error: llamacpp-tensor: 1 of 83 fingerprints drifted")
    assert refused_by_check(drift, "u").details["reason"] == "refused-by-check"
    other = SystemdError("start failed", details="x systemd[1]: something else")
    assert refused_by_check(other, "u") is other
