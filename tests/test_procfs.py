"""What /proc says about processes: start times, PIDs across namespaces, and the sandbox's cgroup name."""

from __future__ import annotations

import os
import subprocess

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
