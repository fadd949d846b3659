"""What /proc says about a process: its start time (which tells it from a later process that reuses its PID),
its PIDs in nested PID namespaces, and whether it runs in a given cgroup.

A rehearsal runs systemd as PID 1 of a PID namespace of its own (the sandbox), so the MainPID it reports for a
unit is not the PID this process sees: host_pid() finds the host's PID of it, among the processes that run in
the sandbox's cgroups (named by sandbox_cgroup(), so the gate needs no part of the sandbox to look).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def read(path: str | os.PathLike[str]) -> str | None:
    """A /proc (or any) text file; None when it, or the process it belongs to, is gone."""
    try:
        return Path(path).read_text()
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return None


def start_time(pid: int) -> int | None:
    """Clock ticks since boot when `pid` started (field 22 of /proc/PID/stat); None when gone or a zombie."""
    stat = read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    # fields[0] is field 3 (state); the start time is field 22; a zombie is as good as gone
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def ns_pids(pid: int) -> list[int]:
    """The PIDs of `pid` from the host's PID namespace down to its own (NSpid:); [] when it is gone."""
    status = read(f"/proc/{pid}/status") or ""
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            return [int(x) for x in line.split()[1:]]
    return []


def in_cgroup(pid: int, name: str) -> bool:
    """True when a cgroup of `pid` (in any hierarchy) lies under one named `name`."""
    text = read(f"/proc/{pid}/cgroup") or ""
    return any(f"/{name}" in line for line in text.splitlines())


def sandbox_cgroup(sandbox_dir: str | os.PathLike[str]) -> str:
    """The name of the cgroups the sandbox at `sandbox_dir` runs its processes in (unique per directory)."""
    path = os.path.realpath(os.fspath(sandbox_dir))
    return "deploytool-sandbox-" + hashlib.sha256(path.encode()).hexdigest()[:12]


def host_pid(ns_pid: int, cgroup: str) -> int | None:
    """The host PID of the process that has PID `ns_pid` in a nested PID namespace and runs in cgroup `cgroup`
    (sandbox_cgroup()); None when there is none."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        nspids = ns_pids(pid)
        if len(nspids) > 1 and nspids[-1] == ns_pid and in_cgroup(pid, cgroup):
            return pid
    return None
