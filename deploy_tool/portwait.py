"""Wait, in a backend's ExecStartPre (`deploytool verify BACKEND --await-port`), until the other backends are gone
and the served port can be bound.

Both backends serve one port and, on the real box, fill the same two GPUs. A start must not exec its server while
any process of the other backend still runs: not only for the port (a server may close its listener long before
it exits) but for its GPU memory, freed only when the process is gone. A switch queues the current backend's stop
and starts the target at once: the target's fingerprint check runs while the current one exits, and this wait
lets the server exec the moment the last process of the other backend has exited (instead of the whole start
beginning only then). A plain `systemctl start` of one backend while the other runs gets the same guarantee
(Conflicts= stops the other, but without an ordering: in parallel).

Then the port: free, go; held by anything (a foreign server, a process this check cannot see), fail at once,
naming it, so a switch rolls back in a second instead of waiting out a timeout.

The waits go through deploytool's retry policies (deploy_tool.retry).
"""

from __future__ import annotations

import errno
import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from deploy_tool import procfs, retry
from deploy_tool.errors import DeployError, ExitCode


class PortTaken(DeployError):
    """The served port is held by a process that is not one of the backends (or not released in time)."""

    exit_code = ExitCode.HEALTH


@dataclass(frozen=True)
class Holder:
    pid: int
    comm: str
    cgroup: str  # the unified-hierarchy path as this process sees it ("/system.slice/ftllm-dflash.service")

    def describe(self) -> str:
        return f"pid {self.pid} ({self.comm}, cgroup {self.cgroup or '?'})"


def can_bind(host: str, port: int) -> bool:
    """Whether a server could bind host:port now (SO_REUSEADDR, as llama-server and uvicorn bind)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise PortTaken(f"cannot bind {host}:{port}: {exc.strerror or exc}",
                            hint="serve.host must be an address of this machine (or 0.0.0.0)") from None
    return True


def listening_inodes(port: int, proc: str = "/proc") -> set[int]:
    """Socket inodes of TCP listeners on `port` (any address), from /proc/net/tcp and tcp6."""
    out: set[int] = set()
    for name in ("tcp", "tcp6"):
        try:
            with open(f"{proc}/net/{name}", encoding="ascii") as f:
                next(f, None)  # header
                for line in f:
                    fields = line.split()
                    # local_address is ADDR:PORT in hex; st "0A" is LISTEN; field 9 is the inode
                    if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        out.add(int(fields[9]))
        except (OSError, ValueError):
            continue
    return out


def holders(inodes: set[int], proc: str = "/proc") -> list[Holder]:
    """The processes (visible here) with an open descriptor on one of the sockets."""
    if not inodes:
        return []
    wanted = {f"socket:[{i}]" for i in inodes}
    found: list[Holder] = []
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        fd_dir = f"{proc}/{entry.name}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"{fd_dir}/{fd}") in wanted:
                    found.append(_holder(int(entry.name), proc))
                    break
            except OSError:
                continue
    return found


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def cgroup_of(pid: int | str, proc: str = "/proc") -> str:
    """The cgroup (unified hierarchy) of process `pid` ("self": this one) as this process sees it, e.g.
    "/system.slice/llamacpp-tensor.service"; "" when it cannot be read."""
    text = _read(f"{proc}/{pid}/cgroup")
    return next((ln[3:].strip() for ln in text.splitlines() if ln.startswith("0::")), "")


def _holder(pid: int, proc: str) -> Holder:
    return Holder(pid, _read(f"{proc}/{pid}/comm").strip() or "?", cgroup_of(pid, proc))


def own_cgroup(proc: str = "/proc") -> str:
    """This process's cgroup (unified hierarchy), as it sees it: "/system.slice/llamacpp-tensor.service"."""
    return cgroup_of("self", proc) or "/"


def siblings_parent(own: str) -> str:
    """Where the other backends' cgroups are: beside this unit's (an ExecStartPre runs in its unit's cgroup),
    else in /system.slice, where system services run."""
    last = own.rstrip("/").rsplit("/", 1)[-1]
    return own.rstrip("/").rsplit("/", 1)[0] if last.endswith(".service") else "/system.slice"


def unit_pids(units: Iterable[str], proc: str = "/proc", parent: str | None = None) -> dict[int, str]:
    """The processes visible here in the cgroup of one of `units` (or below it), as {pid: unit}; not this one.

    The units' cgroups are `parent`/UNIT (default: siblings_parent of this process's cgroup), so the same unit
    names of another manager (another cgroup namespace's "/../.." paths) never match."""
    base = (siblings_parent(own_cgroup(proc)) if parent is None else parent).rstrip("/")
    want = {f"{base}/{u}": u for u in units}
    me = os.getpid()
    out: dict[int, str] = {}
    for entry in os.scandir(proc):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        path = cgroup_of(entry.name, proc)
        for prefix, unit in want.items():
            if path == prefix or path.startswith(prefix + "/"):
                out[int(entry.name)] = unit
    return out


def _wait_exit(pids: Iterable[int], timeout: float) -> None:
    """Until all `pids` have exited or `timeout` passed: one procfs.ProcessWatch each, woken by each exit."""
    watches = [procfs.ProcessWatch(pid) for pid in pids]
    try:
        procfs.wait_gone(watches, timeout)
    finally:
        for w in watches:
            w.close()


class _StillRunning(Exception):
    """Processes of the other backends still run: {pid: unit}."""

    def __init__(self, running: dict[int, str]) -> None:
        super().__init__(running)
        self.running = running


def _who(running: dict[int, str]) -> str:
    return ", ".join(f"{u} (pid {', '.join(str(p) for p in sorted(running) if running[p] == u)})"
                     for u in sorted(set(running.values())))


def _await_siblings(running: dict[int, str], find: Callable[[], dict[int, str]], *, port: int, timeout: float,
                    say: Callable[[str], None]) -> float:
    """Until `find()` finds no process of the other backends (`running`: what it found first), woken by their
    exits; seconds waited. PortTaken if they still run after `timeout`."""
    last = running
    if timeout > 0:
        say(f"waiting for {_who(running)} to exit")
    poll = retry.siblings_exit(timeout, retry_on=_StillRunning, wait_for=lambda left: _wait_exit(last, left))
    first = True
    try:
        for attempt in poll:
            with attempt:
                if not first:
                    last = find()
                first = False
                if last:
                    raise _StillRunning(last)
    except _StillRunning as exc:
        raise PortTaken(f"{_who(exc.running)} still running after {timeout:g}s; "
                        f"{'its' if len(exc.running) == 1 else 'their'} GPU memory and port {port} "
                        f"are not free", hint="see `systemctl status` of that unit: its stop may be stuck") from None
    return poll.elapsed()


def await_port(host: str, port: int, *, siblings: Iterable[str], timeout: float = 90.0,
               say: Callable[[str], None] = lambda s: None, proc: str = "/proc",
               sibling_pids: Callable[[], dict[int, str]] | None = None) -> float:
    """Return once no process of the `siblings` units runs and host:port can be bound (seconds waited); raise
    PortTaken if they are still running after `timeout` or if anything else holds the port.

    `host`: the address the server binds (serve.host). `siblings`: the unit names of the other backends.
    `sibling_pids`: how to find their processes (default: unit_pids over /proc)."""
    host = host or "0.0.0.0"
    units = list(siblings)
    find = sibling_pids or (lambda: unit_pids(units, proc))
    t0 = time.monotonic()
    running = find()
    waited = _await_siblings(running, find, port=port, timeout=timeout, say=say) if running else 0.0
    if can_bind(host, port):
        return waited or time.monotonic() - t0
    held = holders(listening_inodes(port, proc), proc)
    # no holder seen: a listener closing right now, or one this check cannot see (another PID namespace)
    if not held and retry.port_recheck()(lambda: can_bind(host, port)):
        return waited or time.monotonic() - t0
    who = (", ".join(h.describe() for h in held) if held
           else "a process this check cannot see (not one of this manager's backends)")
    raise PortTaken(f"port {port} is held by {who}; the server cannot bind it",
                    hint=f"find it with `ss -ltnp 'sport = :{port}'` and stop it, or move serve.internal_port")


def await_for_backend(cfg: Any, b: Any) -> str:
    """await_port for backend `b` of config `cfg` (the backends' internal address behind the front, the other
    backends' units as siblings); returns the line `verify --await-port` prints."""
    lines: list[str] = []
    port = cfg.backend_port
    waited = await_port(cfg.backend_host, port, siblings=[o.unit for o in cfg.other_backends(b.name)],
                        say=lines.append)
    if lines:
        return f"{lines[0]}: done after {waited:.2f}s; port {port}: free"
    return f"port {port}: free"
