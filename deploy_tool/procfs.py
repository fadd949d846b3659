"""What /proc says about a process: its start time (which tells it from a later process that reuses its PID),
its PIDs in nested PID namespaces, and whether it runs in a given cgroup; and a watch that tells when a process
ends (ProcessWatch: a pidfd where the kernel has them, a look at /proc otherwise).

A rehearsal runs systemd as PID 1 of a PID namespace of its own (the sandbox), so the MainPID it reports for a
unit is not the PID this process sees: host_pid() finds the host's PID of it, among the processes that run in
the sandbox's cgroups (named by sandbox_cgroup(), so the gate needs no part of the sandbox to look).
"""

from __future__ import annotations

import hashlib
import os
import select
import time
from collections.abc import Iterable
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


# ------------------------------------------------------------------------------------------------ watching

#: Without a pidfd, how often wait_gone looks at /proc for the processes it waits on.
LOOK_S = 0.02


class ProcessWatch:
    """One process watched until it ends (exits, or is a zombie: it has ended, only its parent has not reaped it).

    Through a pidfd where the kernel and Python have them (`pidfd` True; `fileno()` is it, for poll()): a wait
    wakes the moment the process exits, and a later process with the same PID is never taken for it. Otherwise
    /proc/PID is looked at when asked, its start time telling the process from a later one with its PID. A
    process already gone when the watch begins counts as ended. Close it (or use it as a context manager)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd: int | None = None
        self._start: int | None = None
        self._ended = False
        try:
            self._fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._ended = True  # it ended before we looked
        except (AttributeError, OSError):  # no pidfd here: look at /proc instead
            self._start = start_time(pid)
            self._ended = self._start is None

    @property
    def pidfd(self) -> bool:
        """True when the process is watched through a pidfd (an exit wakes a wait at once)."""
        return self._fd is not None

    def fileno(self) -> int:
        """The pidfd (readable once the process has ended); ValueError without one."""
        if self._fd is None:
            raise ValueError(f"process {self.pid} is not watched through a pidfd")
        return self._fd

    def gone(self, timeout: float = 0.0) -> bool:
        """True once the process has ended, waiting for that up to `timeout` seconds: with a pidfd the wait ends
        at its exit; without one, it sleeps `timeout`, then looks."""
        if self._ended:
            return True
        if self._fd is not None:
            p = select.poll()
            p.register(self._fd, select.POLLIN)
            self._ended = bool(p.poll(max(0, int(timeout * 1000))))
            return self._ended
        if timeout > 0:
            time.sleep(timeout)
        self._ended = start_time(self.pid) != self._start  # gone, a zombie, or another process with its PID
        return self._ended

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ProcessWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_gone(watches: Iterable[ProcessWatch], timeout: float) -> bool:
    """Until every one of `watches` has ended (True) or `timeout` seconds have passed (False): woken by each exit
    where they have pidfds, else looking at /proc every LOOK_S."""
    deadline = time.monotonic() + timeout
    left = [w for w in watches if not w.gone()]
    while left:
        now = time.monotonic()
        if now >= deadline:
            return False
        fds = [w.fileno() for w in left if w.pidfd]
        step = deadline - now if len(fds) == len(left) else min(LOOK_S, deadline - now)
        if fds:
            p = select.poll()
            for fd in fds:
                p.register(fd, select.POLLIN)
            p.poll(max(1, int(step * 1000)))
        else:
            time.sleep(step)
        left = [w for w in left if not w.gone()]
    return True


# ------------------------------------------------------------------------------------------------ TCP

TCP_ESTABLISHED = "01"
TCP_LISTEN = "0A"


Row = tuple[str, int, str, int, str, int, int]


def tcp_table(pid: int | str = "self") -> list[Row]:
    """The TCP sockets of the network namespace `pid` runs in, from /proc/PID/net/tcp and tcp6: (local address,
    local port, remote address, remote port, state, inode, bytes queued to send and not yet acknowledged) per
    socket; addresses as the kernel prints them (hex), states as two hex digits (01 ESTABLISHED, 0A LISTEN,
    08 CLOSE_WAIT, ...)."""
    out = []
    for name in ("tcp", "tcp6"):
        text = read(f"/proc/{pid}/net/{name}") or ""
        for line in text.splitlines()[1:]:
            f = line.split()
            if len(f) < 10:
                continue
            try:
                la, lp = f[1].split(":")
                ra, rp = f[2].split(":")
                out.append((la, int(lp, 16), ra, int(rp, 16), f[3], int(f[9]), int(f[4].split(":")[0], 16)))
            except ValueError:
                continue
    return out


def own_socket_inodes(pid: int | str = "self") -> set[int]:
    """The inodes of the sockets process `pid` holds open (its fds that read `socket:[N]`)."""
    out: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def connections_in(port: int, *, exclude_pid: int | str | None = "self", table: list[Row] | None = None,
                   sending: bool = False, accepted: bool = False) -> int:
    """How many clients are connected to the server on `port`: ESTABLISHED sockets whose local port is `port`
    (the server's ends; a client that went away leaves CLOSE_WAIT, not counted), minus the connections whose
    client end belongs to process `exclude_pid` (the prober itself). Independent of the server's API; an idle
    keep-alive connection counts like a request in flight (see deploy_tool.box.probe.drain). `sending`: only those
    whose server end still has bytes to deliver (an answer on its way to a slow reader). `accepted`: only those the
    server has accepted (a connection still in the listen backlog has no socket file yet: inode 0), so a hung
    server's backlog, which the front keeps filling while it retries, is not taken for its work."""
    rows = tcp_table() if table is None else table
    mine = own_socket_inodes(exclude_pid) if exclude_pid is not None else set()
    own_ends = {(la, lp) for la, lp, _ra, _rp, st, ino, _q in rows if ino in mine and st == TCP_ESTABLISHED}
    return sum(1 for la, lp, ra, rp, st, ino, txq in rows
               if lp == port and st == TCP_ESTABLISHED and (ra, rp) not in own_ends and (txq > 0 or not sending)
               and (ino != 0 or not accepted))


def cpu_ticks(pid: int) -> int | None:
    """utime + stime of `pid` in clock ticks (fields 14 and 15 of /proc/PID/stat); None when gone."""
    stat = read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    f = stat.rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12])
