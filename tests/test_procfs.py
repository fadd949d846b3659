"""What /proc says about processes: start times, PIDs across namespaces, the sandbox's cgroup name, and the
watch that tells when a process ends."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from deploy_tool import procfs


def test_start_time_tells_a_process_from_a_gone_one():
    child = subprocess.Popen(["sleep", "30"])
    try:
        start = procfs.start_time(child.pid)
        assert isinstance(start, int) and start > 0
        assert procfs.start_time(child.pid) == start  # stable while it lives
    finally:
        child.kill()
        child.wait()
    assert procfs.start_time(child.pid) is None


def test_ns_pids_of_this_process_end_with_its_pid():
    pids = procfs.ns_pids(os.getpid())
    assert pids[0] == os.getpid()  # as this /proc sees it (the first of NSpid)
    assert procfs.ns_pids(2**22 + 17) == []  # beyond pid_max: no such process


def test_read_returns_none_for_what_is_gone(tmp_path):
    assert procfs.read(tmp_path / "missing") is None
    (tmp_path / "f").write_text("x")
    assert procfs.read(tmp_path / "f") == "x"


def test_sandbox_cgroup_is_one_name_per_directory(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    a = procfs.sandbox_cgroup(tmp_path / "real")
    assert a == procfs.sandbox_cgroup(tmp_path / "link")  # the same directory by another path
    assert a != procfs.sandbox_cgroup(tmp_path)
    assert a.startswith("deploytool-sandbox-") and len(a) == len("deploytool-sandbox-") + 12


def test_host_pid_finds_nothing_outside_the_named_cgroup():
    # this process has no nested PID namespace and is in no sandbox's cgroup
    assert procfs.host_pid(1, procfs.sandbox_cgroup("/nonexistent-sandbox")) is None
    assert procfs.in_cgroup(os.getpid(), "deploytool-sandbox-000000000000") is False


# ------------------------------------------------------------------------------------------------ watching

@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "proc"])
def test_a_process_watch_sees_the_exit(monkeypatch: pytest.MonkeyPatch, pidfd: bool) -> None:
    """Alive until it exits; ended once it has (a zombie not yet reaped counts as ended); with a pidfd a long wait
    ends at the exit, without one the watch looks at /proc."""
    if not pidfd:
        monkeypatch.delattr(os, "pidfd_open")
    child = subprocess.Popen(["sleep", "0.3"])
    try:
        with procfs.ProcessWatch(child.pid) as w:
            assert w.pidfd is pidfd and not w.gone()
            t0 = time.monotonic()
            while not w.gone(0.05 if not pidfd else 10):
                assert time.monotonic() - t0 < 5
            assert time.monotonic() - t0 < 5 and w.gone()
            assert os.path.exists(f"/proc/{child.pid}")  # a zombie, not reaped yet: it has ended all the same
    finally:
        child.wait()


def test_a_process_already_gone_has_ended_and_wait_gone_waits_for_all(monkeypatch: pytest.MonkeyPatch) -> None:
    child = subprocess.Popen(["true"])
    child.wait()
    with procfs.ProcessWatch(child.pid) as w:
        assert w.gone()
    quick, slow = subprocess.Popen(["sleep", "0.1"]), subprocess.Popen(["sleep", "0.4"])
    try:
        watches = [procfs.ProcessWatch(quick.pid), procfs.ProcessWatch(slow.pid)]
        assert not procfs.wait_gone(watches, 0.05)  # timed out: both still run
        t0 = time.monotonic()
        assert procfs.wait_gone(watches, 10) and time.monotonic() - t0 < 5
        for w in watches:
            w.close()
        monkeypatch.delattr(os, "pidfd_open")  # the same without pidfds: /proc every LOOK_S
        again = subprocess.Popen(["sleep", "0.1"])
        with procfs.ProcessWatch(again.pid) as w:
            assert not w.pidfd and procfs.wait_gone([w], 10)
        again.wait()
    finally:
        quick.wait()
        slow.wait()
