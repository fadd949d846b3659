"""deploytool's own events in the systemd journal: every operation's start, steps and result, beside the units' lines.

Sent with the journal's native protocol (one datagram per entry to journald's socket, stdlib `socket`, no
dependency), under SYSLOG_IDENTIFIER=deploytool with fields of its own (DEPLOYTOOL_OPERATION, DEPLOYTOOL_PHASE:
start, step or result, DEPLOYTOOL_BACKEND, DEPLOYTOOL_OK), so `journalctl -t deploytool` and `deploytool logs` find
them. Best effort: no socket (a box without journald, a container, a test) sends nothing and says nothing; an
operation never fails because its journal line could not be written.

Which journal: a config pointing at a sandbox (`systemd.sandbox`) writes into that sandbox's journald (its socket
through /proc/PID/root of the sandbox's systemd, or directly from a process inside it); otherwise this machine's
/run/systemd/journal/socket, when the config drives this machine's own systemctl. DEPLOYTOOL_JOURNAL_SOCKET names
another socket (tests), or turns it off when empty.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from deploy_tool.errors import DeployError

IDENTIFIER = "deploytool"
HOST_SOCKET = "/run/systemd/journal/socket"
ENV_SOCKET = "DEPLOYTOOL_JOURNAL_SOCKET"
# syslog priorities
ERR, WARNING, NOTICE, INFO = 3, 4, 5, 6

Log = Callable[[str], None]


def encode(fields: dict[str, str]) -> bytes:
    """The native protocol's datagram: `KEY=value\\n`, or for a value with a newline `KEY\\n<u64 le len>value\\n`."""
    out = bytearray()
    for key, value in fields.items():
        k = key.upper().encode()
        v = value.encode("utf-8", "replace")
        if b"\n" in v:
            out += k + b"\n" + struct.pack("<Q", len(v)) + v + b"\n"
        else:
            out += k + b"=" + v + b"\n"
    return bytes(out)


def socket_for(cfg: Any) -> str | None:
    """The journald socket deploytool's events for this config go to, or None (nowhere)."""
    env = os.environ.get(ENV_SOCKET)
    if env is not None:
        return env or None
    scfg = getattr(cfg, "systemd", None)
    sandbox = getattr(scfg, "sandbox", None)
    if sandbox:
        if Path("/proc/1/comm").exists() and _inside_sandbox(sandbox):
            return HOST_SOCKET  # a unit of the sandbox (failover, liveness): its /run is the sandbox's
        try:
            from deploy_tool.box.sandbox_handle import SandboxHandle

            return f"/proc/{SandboxHandle(sandbox).pid}/root{HOST_SOCKET}"
        except Exception:  # not up, not a sandbox: nothing to write to
            return None
    systemctl = tuple(getattr(scfg, "systemctl", ("systemctl",)) or ("systemctl",))
    if os.path.basename(str(systemctl[0])) != "systemctl" or len(systemctl) > 1:
        return None  # a fake or remote systemctl: this machine's journal is not the box's
    return HOST_SOCKET


def _inside_sandbox(sandbox: str) -> bool:
    try:
        from deploy_tool.box.sandbox_handle import SandboxHandle

        return SandboxHandle(sandbox).contains_self()
    except Exception:
        return False


class Journal:
    """Sends entries to one journald socket; `path` None (or a socket that is not there) sends nothing."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._sock: socket.socket | None = None
        self._dead = path is None

    @classmethod
    def for_config(cls, cfg: Any) -> Journal:
        try:
            return cls(socket_for(cfg))
        except Exception:
            return cls(None)

    def send(self, message: str, *, priority: int = INFO, **fields: object) -> bool:
        """One entry; True when journald took it."""
        if self._dead or self.path is None:
            return False
        data = {"MESSAGE": message, "PRIORITY": str(priority), "SYSLOG_IDENTIFIER": IDENTIFIER}
        data.update({k: str(v) for k, v in fields.items() if v is not None})
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.sendto(encode(data), self.path)
            return True
        except OSError:  # no journald here, or it refused: silently nothing, and no retry per step
            self._dead = True
            self.close()
            return False

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None


class Events:
    """One operation's events: `start`, each `step` (the operation's log lines), its `result`."""

    def __init__(self, journal: Journal, operation: str, backend: str | None = None) -> None:
        self.journal = journal
        self.operation = operation
        self.backend = backend
        self.done = False

    def _send(self, phase: str, message: str, priority: int, **fields: object) -> None:
        self.journal.send(f"{self.operation}: {message}", priority=priority, DEPLOYTOOL_OPERATION=self.operation,
                          DEPLOYTOOL_PHASE=phase, DEPLOYTOOL_BACKEND=self.backend, **fields)

    def start(self, what: str) -> None:
        self._send("start", f"start {what}", NOTICE)

    def step(self, message: str) -> None:
        self._send("step", message.strip(), INFO)

    def result(self, ok: bool, message: str, *, exit_code: int | None = None) -> None:
        self.done = True
        self._send("result", message, NOTICE if ok else ERR, DEPLOYTOOL_OK=int(ok), DEPLOYTOOL_EXIT_CODE=exit_code)

    def tee(self, log: Log) -> Log:
        """`log`, each line also sent as a step."""

        def both(msg: str) -> None:
            self.step(msg)
            log(msg)

        return both


@contextlib.contextmanager
def operation(cfg: Any, name: str, what: str, *, backend: str | None = None,
              dry_run: bool = False) -> Iterator[Events]:
    """Journal one operation: its start now, its result when the block ends (an error's message and exit code
    too). A dry run changes nothing and journals nothing."""
    ev = Events(Journal(None) if dry_run else Journal.for_config(cfg), name, backend)
    ev.start(what)
    try:
        yield ev
    except BaseException as exc:
        if ev.done:
            pass
        elif isinstance(exc, DeployError):
            ev.result(False, f"failed: {exc.message}", exit_code=int(exc.exit_code))
        elif isinstance(exc, KeyboardInterrupt):
            ev.result(False, "interrupted", exit_code=130)
        elif not isinstance(exc, GeneratorExit):
            ev.result(False, f"failed: {type(exc).__name__}: {exc}", exit_code=70)
        ev.journal.close()
        raise
    if not ev.done:
        ev.result(True, "done")
    ev.journal.close()
