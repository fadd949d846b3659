"""A fake systemd for fast state-machine tests: real sockets, fake processes, a virtual clock.

    world = World(cfg)                          # the config's backends, its port, its unit_dir
    world.install_units()                       # deploytool's own rendered units into cfg.paths.unit_dir
    world.script("llamacpp-tensor.service", NEVER_READY)   # per start: one behaviour each, the last repeats
    with world.running():                       # retry test mode on the world's clock; os.kill(self, SIGKILL) -> Killed
        Switcher(cfg, sd=world.systemd()).switch("llamacpp")

`FakeSystemd` implements every method of deploy_tool.box.systemd.Systemd against the `World`, which records every
call (`world.calls`). What a started unit's process does is scripted by a `Behaviour`: refused by its
ExecStartPre, failing to exec, ready at once / later / never, dying while loading, exiting 0, serving another
model name, dying during the smoke completion, slow or hanging on stop. A started process is a real HTTP server
on 127.0.0.1:serve.port (llama-server: port open at once, /health 503 until ready; ftllm: port closed until
ready), so the gate (health, portwait) runs unchanged against real sockets. Units with `--await-port` in their
ExecStartPre run the real portwait.await_port against the world's processes; Conflicts= stops the other unit;
Restart=on-failure restarts a crashed unit RestartSec later, until StartLimitBurst= starts within
StartLimitIntervalSec= (then the unit fails for good, and one with OnFailure= is noted in `failed_for_good`: a
test runs what systemd would start); TimeoutStopSec= ends a hanging stop with SIGKILL.
A unit with the readiness ExecStartPost (`await-ready`) stays activating/start-post after the exec until its
server is ready (then active/running), fails when its process dies meanwhile (at once, as the real one watches
the process), when it serves another model name, or at TimeoutStartSec=; `start` without no_block waits for
that, as `systemctl start` does. ExecStartPre runs within the start call either way (in virtual time), but a
no_block start reports nothing: the gate finds the failed unit. One simplification: TimeoutStartSec= counts from
the exec, not from the job's start (the ExecStartPre's wait for a slow stop is not in it).

Time is virtual: every retry policy sleeps through `World.sleep` (deploy_tool.retry test mode), which moves the
world's clock and runs what was due (a server becoming ready, a crash, a stop finishing, a restart).

A kill point (DEPLOYTOOL_FAULT=kill:<step>, the process SIGKILLs itself) raises `Killed` instead: the handle of
the killed deploytool is dead from then on (any call through it raises Killed again, so nothing it still runs
changes the world), while the world (units, ports, state.json on disk) stays as the kill left it.
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import itertools
import json
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from deploy_tool import portwait, retry
from deploy_tool.box.systemd import (
    Systemd,
    UnitState,
    _format_entry,
    _indent,
    _invocation_window,
    validate_unit_name,
)
from deploy_tool.errors import InputError, SystemdError

FIRST_PID = 5_000_001  # above the kernel's PID_MAX_LIMIT: never a real process
TIMEOUT_STOP_S = 60.0  # the rendered units' TimeoutStopSec=
RESTART_S = 10.0  # ... and RestartSec=
AWAIT_PORT_S = 90.0  # portwait.await_port's default timeout (the ExecStartPre's)
AWAIT_READY_LAG_S = 0.3  # the ExecStartPost's (await-ready) own start-up before its first probe


class Killed(BaseException):  # noqa: N818 - it is what happened, not an error
    """The deploytool process was SIGKILLed at a fault point (raised in place of the kill)."""


# ------------------------------------------------------------------------------------------------ behaviours

@dataclass(frozen=True)
class Behaviour:
    """What one start of a unit does."""

    name: str = "ok"
    refused: str | None = None  # ExecStartPre fails with this deploytool error line
    exec_fails: bool = False  # ExecStart cannot be executed (203/EXEC): the start job fails
    ready_after: float | None = 0.0  # seconds after the start until ready; None: never
    dies_after: float | None = None  # the process dies this long after the start ...
    exit_status: int = 0  # ... exiting with this status (0: a clean exit, not restarted) ...
    signal: int | None = signal.SIGKILL  # ... or killed by this signal (exit_status then ignored)
    last_words: str = "fatal: out of memory"  # what it prints before dying
    model: str | None = None  # the model name it serves (None: the configured one)
    smoke: str = "ok"  # ok | die (the process dies on the completion) | empty | http-500
    stop_s: float = 0.0  # seconds it takes to exit on SIGTERM; above TimeoutStopSec it is SIGKILLed then


OK = Behaviour()
SLOW = Behaviour("slow", ready_after=4.0)
REFUSED = Behaviour("refused-by-check", refused="llamacpp-tensor: 1 fingerprint(s) differ from the pins: env file")
EXEC_FAILS = Behaviour("crash-at-start", exec_fails=True)
NEVER_READY = Behaviour("never-ready", ready_after=None)
DIES_LOADING = Behaviour("dies-while-loading", ready_after=None, dies_after=1.0)
EXITS_0 = Behaviour("exits-0", ready_after=None, dies_after=0.5, exit_status=0, signal=None,
                    last_words="FastLLM Error: Unsupport graph model type")
WRONG_MODEL = Behaviour("wrong-model", model="some-other-model")
DIES_IN_SMOKE = Behaviour("dies-during-smoke", smoke="die")
EMPTY_SMOKE = Behaviour("empty-completion", smoke="empty")
HANGS_ON_STOP = Behaviour("hangs-on-stop", stop_s=1e9)  # SIGKILLed after TimeoutStopSec
SLOW_STOP = Behaviour("slow-stop", stop_s=30.0)

#: every behaviour by name; FAILING: those a gate must refuse
BEHAVIOURS = {b.name: b for b in (OK, SLOW, REFUSED, EXEC_FAILS, NEVER_READY, DIES_LOADING, EXITS_0, WRONG_MODEL,
                                  DIES_IN_SMOKE, EMPTY_SMOKE, HANGS_ON_STOP, SLOW_STOP)}
FAILING = ("refused-by-check", "crash-at-start", "never-ready", "dies-while-loading", "exits-0", "wrong-model",
           "dies-during-smoke", "empty-completion")


# ------------------------------------------------------------------------------------------------ processes

class _Server:
    """A real listener on 127.0.0.1:port answering HTTP for one fake process (accept loop on a thread)."""

    def __init__(self, port: int, handler: type[BaseHTTPRequestHandler]) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind(("127.0.0.1", port))
        except OSError:
            self.sock.close()
            raise
        self.sock.listen(16)
        self.handler = handler
        self.conns: set[socket.socket] = set()  # closed with the process, as the kernel does at its exit
        # a connection is registered under the lock as it is accepted, so a close() between the accept and its
        # thread's start cannot miss it (such a connection stayed ESTABLISHED, served by nobody, and a later
        # drain on the same port counted it: seen once under make test's load)
        self.lock = threading.Lock()
        self.closed = False
        self.thread = threading.Thread(target=self._accept, daemon=True, name=f"fake-server-{port}")
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, addr = self.sock.accept()
            except OSError:
                return
            with self.lock:
                if self.closed:  # the process exited while this one was accepted
                    conn.close()
                    return
                self.conns.add(conn)
            threading.Thread(target=self._serve, args=(conn, addr), daemon=True).start()

    def _serve(self, conn: socket.socket, addr: Any) -> None:
        try:
            with contextlib.suppress(OSError), conn:
                self.handler(conn, addr, self)  # type: ignore[arg-type]
        finally:
            with self.lock:
                self.conns.discard(conn)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            conns = list(self.conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self.sock.close()
        self.thread.join(5)


@dataclass
class Process:
    pid: int
    unit: str
    kind: str
    behaviour: Behaviour
    started: float  # virtual time
    invocation: str
    server: _Server | None = None
    alive: bool = True
    stopped: bool = False  # SIGSTOPped: answers nothing, uses no CPU (until SIGCONT)
    blocked: bool = False  # busy elsewhere: answers nothing but uses CPU (a long request holding the server)
    cpu_ns: int = 0  # CPU time used (CPUUsageNSec): a running process uses 1 ms between any two looks

    def unresponsive(self) -> bool:
        return self.alive and (self.stopped or self.blocked)

    @property
    def ready_at(self) -> float | None:
        b = self.behaviour.ready_after
        return None if b is None else self.started + b


@dataclass
class Unit:
    name: str
    backend: str
    kind: str
    script: list[Behaviour] = field(default_factory=lambda: [OK])
    starts: int = 0
    enabled: bool = False
    active_state: str = "inactive"
    sub_state: str = "dead"
    result: str = "success"
    exec_main_code: int = 0
    exec_main_status: int = 0
    exec_main_pid: int = 0
    n_restarts: int = 0
    invocation_id: str = ""
    proc: Process | None = None
    restart_token: int = 0  # a scheduled restart runs only if this is unchanged
    start_times: list[float] = field(default_factory=list)  # for StartLimitBurst= (reset by reset-failed)
    stop_done: float = 0.0  # when a queued stop ends (virtual time)

    def next_behaviour(self) -> Behaviour:
        b = self.script[min(self.starts, len(self.script) - 1)]
        self.starts += 1
        return b


@dataclass(frozen=True)
class Call:
    handle: int
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    step: str | None = None  # the step state.json's operation was at when deploytool made the call (None: none)

    def units_changed(self) -> tuple[str, ...]:
        """The units this call changes: started, stopped, killed, enabled or disabled, their files written or
        removed. Queries and `reset-failed` (a counter, no change to what runs or boots) change none."""
        if self.method in ("enable", "disable"):
            return tuple(self.args)
        if self.method in ("start", "restart", "stop", "kill", "install_file", "remove_file"):
            return (self.args[0],)
        return ()


# ------------------------------------------------------------------------------------------------ the world

class World:
    """The machine a fake systemd drives: units, their processes (real listeners), a journal, a virtual clock."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.host = "127.0.0.1"
        self.port = int(cfg.backend_port)  # the backends' own port, behind the front
        self.model_name = cfg.serve.model_name
        self.unit_dir = Path(cfg.paths.unit_dir)
        self.units = {b.unit: Unit(b.unit, b.name, b.kind) for b in cfg.backends.values()}
        # the front's socket and service: units that start and stop, with no process of their own here (the real
        # front is tested on its own, and in the sandbox)
        from deploy_tool.render import FRONT_UNITS

        self.units.update({n: Unit(n, "front", "front") for n in FRONT_UNITS})
        self.lock = threading.RLock()
        self.now = 1000.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._pids = itertools.count(FIRST_PID)
        self._handles = itertools.count(1)
        self.calls: list[Call] = []
        self.entries: list[dict[str, Any]] = []
        self._cursor = itertools.count(1)
        self.current: FakeSystemd | None = None
        self.kills: list[str] = []
        #: (method, unit) -> the error systemctl prints: that driver call fails (e.g. ("enable", "x.service"))
        self.failing: dict[tuple[str, str | None], str] = {}
        #: (when, unit) each time a unit with OnFailure= failed for good (its restarts gave up)
        self.failed_for_good: list[tuple[float, str]] = []
        #: run at a kill point before Killed unwinds the killed deploytool's stack (e.g. to freeze the files as
        #: the kill left them: a SIGKILLed process runs none of its `except` and `finally` blocks)
        self.on_kill: Callable[[str], None] | None = None

    def step_now(self) -> str | None:
        """The step of the operation in progress as state.json journals it (what a kill there would leave)."""
        try:
            op = json.loads((Path(self.cfg.paths.state_dir) / "state.json").read_bytes()).get("operation")
        except (OSError, ValueError):
            return None
        return op.get("step") if isinstance(op, dict) else None

    # ------------------------------------------------------------------ setting up

    def install_units(self, *, await_port: bool = True, conflicts: bool = True) -> None:
        """deploytool's own rendered units for the config's backends; await_port=False drops `--await-port` from
        their ExecStartPre (a unit rendered by an older deploytool), conflicts=False their Conflicts= lines."""
        from deploy_tool.render import render_backend

        self.unit_dir.mkdir(parents=True, exist_ok=True)
        for b in self.cfg.backends.values():
            for f in render_backend(self.cfg, b):
                if f.kind == "unit":
                    text = f.content if await_port else f.content.replace(" --await-port", "")
                    if not conflicts:
                        text = "".join(ln for ln in text.splitlines(True) if not ln.startswith("Conflicts="))
                    (self.unit_dir / f.name).write_text(text)

    def script(self, unit: str, *behaviours: Behaviour) -> None:
        """What the unit's next starts do, one behaviour per start (the last one repeats)."""
        u = self.units[unit]
        u.script = list(behaviours) or [OK]
        u.starts = 0

    def bring_up(self, unit: str, *, enabled: bool = True) -> None:
        """The unit running and ready, as a finished install or switch leaves it (no calls recorded)."""
        with self.lock:
            u = self.units[unit]
            u.enabled = enabled
            self._start(u, wait=False)
            self.advance(max(0.0, u.proc.behaviour.ready_after or 0.0) if u.proc else 0.0)
            while u.sub_state == "start-post" and self._events:  # until its ExecStartPost has seen it ready
                self.advance(max(0.0, self._events[0][0] - self.now))

    def systemd(self) -> FakeSystemd:
        """A new driver handle (one per deploytool process); the newest is the one a kill point kills."""
        h = FakeSystemd(self, next(self._handles))
        self.current = h
        return h

    @contextlib.contextmanager
    def running(self) -> Iterator[World]:
        """Retry policies on the virtual clock, and a SIGKILL of this process at a fault point raising Killed."""
        real_kill = os.kill
        real_raise = signal.raise_signal

        def kill(pid: int, sig: int) -> None:
            if pid == os.getpid() and sig == signal.SIGKILL:
                self._killed()
            if pid == os.getpid() and sig == signal.SIGSTOP:
                return  # a stop point: nothing else runs meanwhile here
            real_kill(pid, sig)

        def raise_signal(sig: int) -> None:
            if sig == signal.SIGKILL:
                self._killed()
            real_raise(sig)

        os.kill = kill  # type: ignore[assignment]
        signal.raise_signal = raise_signal  # type: ignore[assignment]
        try:
            with retry.test_mode(lambda: self.now, self.sleep):
                yield self
        finally:
            os.kill = real_kill
            signal.raise_signal = real_raise

    def _killed(self) -> None:
        with self.lock:
            step = os.environ.get("DEPLOYTOOL_FAULT", "")
            self.kills.append(step)
            if self.current is not None:
                self.current.dead = True
            if self.on_kill is not None:
                self.on_kill(step)
        raise Killed(step)

    def close(self) -> None:
        with self.lock:
            for u in self.units.values():
                if u.proc is not None:
                    self._exit(u.proc)
            self._events.clear()

    # ------------------------------------------------------------------ time

    def sleep(self, seconds: float) -> None:
        """A waiter's sleep: it ends early when something happens in the world meanwhile (as the real waits
        are woken by a process's exit); the waiter looks again and sleeps on if it must."""
        with self.lock:
            nxt = self._events[0][0] - self.now if self._events else seconds
            self.advance(min(seconds, max(0.0, nxt)))

    def advance(self, seconds: float) -> None:
        """Move the clock on by `seconds`, running every event due meanwhile (in order)."""
        with self.lock:
            until = self.now + max(0.0, seconds)
            while self._events and self._events[0][0] <= until:
                t, _, fn = heapq.heappop(self._events)
                self.now = max(self.now, t)
                fn()
            self.now = until

    def at(self, delay: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (self.now + delay, next(self._seq), fn))

    # ------------------------------------------------------------------ journal

    def log(self, unit: Unit, message: str, *, proc: Process | None = None, ident: str | None = None,
            pid: int | None = None) -> None:
        e: dict[str, Any] = {"MESSAGE": message, "__REALTIME_TIMESTAMP": str(int(time.time() * 1e6)),
                             "__CURSOR": f"s=fake;i={next(self._cursor):x};t=0", "_UNIT": unit.name}
        if proc is None and ident is None:  # the manager's message about the unit
            e.update(SYSLOG_IDENTIFIER="systemd", _PID=1, INVOCATION_ID=unit.invocation_id)
        else:
            e.update(SYSLOG_IDENTIFIER=ident or ("llama-server" if unit.kind == "llamacpp" else "ftllm"),
                     _PID=pid or (proc.pid if proc else 0), _SYSTEMD_INVOCATION_ID=unit.invocation_id)
        self.entries.append(e)

    def journal_text(self, unit: str, *, since_cursor: str | None = None, invocation: str | None = None,
                     since: float | None = None, lines: int = 50) -> str:
        with self.lock:
            ents = [e for e in self.entries if e["_UNIT"] == unit]
        if since_cursor:
            after = _cursor_seq(since_cursor)
            ents = [e for e in ents if _cursor_seq(e["__CURSOR"]) > after]
        if since is not None:
            ents = [e for e in ents if int(e["__REALTIME_TIMESTAMP"]) >= since * 1e6]
        if invocation:
            ents = _invocation_window(ents, invocation)
        return "\n".join(_format_entry(e) for e in ents[-max(1, lines):])

    # ------------------------------------------------------------------ the units' lifecycle

    def unit(self, name: str) -> Unit:
        try:
            return self.units[name]
        except KeyError:
            raise SystemdError(f"Unit {name} not found.") from None

    def unit_text(self, u: Unit) -> str:
        try:
            return (self.unit_dir / u.name).read_text()
        except OSError:
            return ""

    def sibling_pids(self, units: list[str]) -> dict[int, str]:
        with self.lock:
            return {u.proc.pid: u.name for u in self.units.values()
                    if u.name in units and u.proc is not None and u.proc.alive}

    def active(self) -> set[str]:
        """The backends' units that are active (the front's socket and service: `front`)."""
        return {u.name for u in self.units.values() if u.active_state == "active" and u.kind != "front"}

    def front(self) -> dict[str, tuple[str, bool]]:
        """The front's units: name -> (ActiveState, enabled)."""
        return {u.name: (u.active_state, u.enabled) for u in self.units.values() if u.kind == "front"}

    def ready(self) -> set[str]:
        """The units whose process is up and ready (serving)."""
        return {u.name for u in self.units.values() if u.active_state == "active" and u.proc and u.proc.alive
                and u.proc.ready_at is not None and u.proc.ready_at <= self.now and u.kind != "front"}

    def healthy(self) -> set[str]:
        """The units that would pass a gate now: ready, serving the configured name, answering completions."""
        return {n for n in self.ready() if (p := self.units[n].proc) is not None and p.behaviour.model is None
                and p.behaviour.smoke == "ok"}

    def enabled(self) -> set[str]:
        """The backends' units enabled for boot (the front's: `front`)."""
        return {u.name for u in self.units.values() if u.enabled and u.kind != "front"}

    def listening(self) -> str | None:
        """The unit whose process holds the port now."""
        return next((u.name for u in self.units.values() if u.proc and u.proc.server), None)

    def _set(self, u: Unit, active: str, sub: str, **kw: Any) -> None:
        u.active_state, u.sub_state = active, sub
        for k, v in kw.items():
            setattr(u, k, v)

    def _start(self, u: Unit, *, wait: bool) -> str | None:
        """One start of `u` (a job: ExecStartPre, then ExecStart); the reason it failed, or None."""
        if not self.unit_text(u):
            return f"Unit {u.name} not found."
        if u.active_state == "deactivating" and wait:  # the start job waits for the stop job
            self.advance(max(0.0, u.stop_done - self.now))
        if u.active_state in ("active", "activating", "deactivating") and u.proc is not None and u.proc.alive:
            return None  # already running (or starting: the job joins the one running): a start job is a no-op
        if u.kind == "front":
            self._set(u, "active", "running" if u.name.endswith(".service") else "listening")
            return None
        text = self.unit_text(u)
        for line in text.splitlines():  # Conflicts=: the other unit is stopped, in parallel (not waited for)
            if line.startswith("Conflicts="):
                for other in line.split("=", 1)[1].split():
                    if other in self.units:
                        self._stop(self.units[other])
        b = u.next_behaviour()
        u.restart_token += 1
        u.start_times.append(self.now)
        u.invocation_id = uuid.uuid4().hex
        u.result = "success"
        u.exec_main_code = u.exec_main_status = 0
        self._set(u, "activating", "start-pre")
        self.log(u, f"Starting {u.name} - {u.backend}...")
        pre_pid = next(self._pids)
        refusal = b.refused
        if refusal is None and " --await-port" in text:
            siblings = [o for o, x in self.units.items() if o != u.name and x.kind != "front"]
            try:
                portwait.await_port(self.host, self.port, siblings=siblings, timeout=AWAIT_PORT_S if wait else 0.0,
                                    sibling_pids=lambda: self.sibling_pids(siblings))
            except portwait.PortTaken as exc:
                refusal = exc.message
        if refusal is not None:
            self.log(u, f"error: {refusal}", ident="deploytool", pid=pre_pid)
            self.log(u, f"{u.name}: Control process exited, code=exited, status=9/n/a")
            self.log(u, f"{u.name}: Failed with result 'exit-code'.")
            self.log(u, f"Failed to start {u.name} - {u.backend}.")
            self._set(u, "failed", "failed", result="exit-code")
            return "Job failed because the control process exited with error code."
        started_at = self.now  # TimeoutStartSec= counts from the exec here (see the module's docstring)
        pid = next(self._pids)
        if b.exec_fails:
            self.log(u, f"{u.name}: Failed to execute /opt/deploytool/current/bin/server: No such file or directory")
            self.log(u, f"{u.name}: Main process exited, code=exited, status=203/EXEC")
            self._failed(u, "exit-code", code=1, status=203, pid=pid)
            return "Job failed because the control process exited with error code."
        proc = Process(pid, u.name, u.kind, b, self.now, u.invocation_id)
        u.proc = proc
        post = " await-ready " in text  # the readiness ExecStartPost: activating until the server serves
        if post:
            self._set(u, "activating", "start-post", exec_main_pid=pid)
            self._await_ready(u, proc, started_at, _timeout_start(text))
        else:
            self._set(u, "active", "running", exec_main_pid=pid)
            self.log(u, f"Started {u.name} - {u.backend}.")
        self.log(u, f"{u.kind} server starting (pid {pid})", proc=proc)
        ready_now = proc.ready_at is not None and proc.ready_at <= self.now
        if u.kind == "llamacpp" or ready_now:  # llama-server opens its port while loading; ftllm once ready
            self._listen(u, proc)
        elif proc.ready_at is not None:
            self.at(proc.ready_at - self.now, lambda: self._listen(u, proc) if proc.alive else None)
        if b.dies_after is not None:
            self.at(b.dies_after, lambda: self._die(u, proc) if proc.alive else None)
        return None

    def _await_ready(self, u: Unit, proc: Process, started_at: float, timeout: float) -> None:
        """The ExecStartPost: the unit turns active once the server is ready (failed if it serves another model
        name); TimeoutStartSec= after the job began, a unit still starting is killed and fails with 'timeout'."""
        def posting() -> bool:
            return u.proc is proc and proc.alive and u.sub_state == "start-post"

        def ready() -> None:
            if not posting():
                return
            if proc.behaviour.model is not None and proc.behaviour.model != self.model_name:
                self.log(u, f"not ready: {u.kind} serves model {proc.behaviour.model!r}, expected "
                            f"{self.model_name!r}", ident="deploytool", pid=next(self._pids))
                self.log(u, f"{u.name}: Control process exited, code=exited, status=9/n/a")
                self._exit(proc)
                self._failed(u, "exit-code", code=2, status=15, pid=proc.pid)
                return
            self._set(u, "active", "running")
            self.log(u, f"Started {u.name} - {u.backend}.")

        def timed_out() -> None:
            if not posting():
                return
            self.log(u, f"{u.name}: start-post operation timed out. Terminating.")
            self._exit(proc)
            self._failed(u, "timeout", code=2, status=15, pid=proc.pid)

        at = None if proc.ready_at is None else max(proc.ready_at, started_at + AWAIT_READY_LAG_S)
        if at is not None and at - started_at < timeout:
            self.at(at - self.now, ready)
        self.at(started_at + timeout - self.now, timed_out)

    def _listen(self, u: Unit, proc: Process) -> None:
        try:
            proc.server = _Server(self.port, _handler(self, u, proc))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            self.log(u, f"error: couldn't bind HTTP server socket, hostname: 127.0.0.1, port: {self.port}",
                     proc=proc)
            self._die(u, proc, status=1, sig=None, words="")

    def _exit(self, proc: Process) -> None:
        proc.alive = False
        if proc.server is not None:
            proc.server.close()
            proc.server = None

    def restart_off(self, u: Unit) -> bool:
        """A drop-in in <unit>.d/ says Restart=no (what liveness places to leave a unit failed)."""
        d = self.unit_dir / f"{u.name}.d"
        return d.is_dir() and any("\nRestart=no" in ("\n" + p.read_text()) for p in sorted(d.glob("*.conf")))

    def _failed(self, u: Unit, result: str, *, code: int, status: int, pid: int) -> None:
        """The main process is gone with a failure: Restart=on-failure restarts it RestartSec later."""
        if self.restart_off(u):
            self._set(u, "failed", "failed", result=result, exec_main_code=code, exec_main_status=status,
                      exec_main_pid=pid, proc=None)
            self.log(u, f"{u.name}: Failed with result '{result}'.")
            return
        self._set(u, "activating", "auto-restart", result=result, exec_main_code=code, exec_main_status=status,
                  exec_main_pid=pid, proc=None)
        self.log(u, f"{u.name}: Failed with result '{result}'.")
        self.log(u, f"{u.name}: Scheduled restart job, restart counter is at {u.n_restarts + 1}.")
        token = u.restart_token

        def restart() -> None:
            if u.restart_token == token and u.sub_state == "auto-restart":
                self.log(u, f"Stopped {u.name} - {u.backend}.")
                if self._start_limit_hit(u):
                    return
                u.n_restarts += 1
                self._start(u, wait=False)

        self.at(RESTART_S, restart)

    def _start_limit_hit(self, u: Unit) -> bool:
        """StartLimitBurst= starts within StartLimitIntervalSec= (from the unit file): the restart is refused, the
        unit fails for good, and systemd would start its OnFailure= unit now (recorded in `failed_for_good`)."""
        burst, interval = 0, 0.0
        for line in self.unit_text(u).splitlines():
            k, _, v = line.partition("=")
            if k == "StartLimitBurst":
                burst = int(v)
            elif k == "StartLimitIntervalSec":
                interval = float(v)
        recent = [t for t in u.start_times if t > self.now - interval]
        if not burst or not interval or len(recent) < burst:
            return False
        self.log(u, f"{u.name}: Start request repeated too quickly.")
        self.log(u, f"{u.name}: Failed with result '{u.result}'.")
        self.log(u, f"Failed to start {u.name} - {u.backend}.")
        self._set(u, "failed", "failed")
        if "OnFailure=" in self.unit_text(u):
            self.log(u, f"{u.name}: Triggering OnFailure= dependencies.")
            self.failed_for_good.append((self.now, u.name))
        return True

    def _die(self, u: Unit, proc: Process, *, status: int | None = None, sig: int | None = -1,
             words: str | None = None) -> None:
        b = proc.behaviour
        sig = b.signal if sig == -1 else sig
        status = b.exit_status if status is None else status
        if words is None:
            words = b.last_words
        if words:
            self.log(u, words, proc=proc)
        self._exit(proc)
        if u.proc is not proc:
            return
        if sig is not None:
            self.log(u, f"{u.name}: Main process exited, code=killed, status={sig}/{signal.Signals(sig).name[3:]}")
            self._failed(u, "signal", code=2, status=int(sig), pid=proc.pid)
        elif status:
            self.log(u, f"{u.name}: Main process exited, code=exited, status={status}/FAILURE")
            self._failed(u, "exit-code", code=1, status=status, pid=proc.pid)
        else:  # a clean exit: not restarted
            self.log(u, f"{u.name}: Deactivated successfully.")
            self._set(u, "inactive", "dead", result="success", exec_main_code=1, exec_main_status=0, proc=None)

    def _stop(self, u: Unit) -> float:
        """Queue the unit's stop; the virtual seconds until it has exited (0: at once)."""
        u.restart_token += 1  # a pending restart is cancelled
        proc = u.proc
        if proc is None or not proc.alive:
            if u.active_state != "failed":
                self._set(u, "inactive", "dead")
            u.proc = None
            return 0.0
        if u.active_state == "deactivating":
            return max(0.0, u.stop_done - self.now)
        self.log(u, f"Stopping {u.name} - {u.backend}...")
        stop_s = proc.behaviour.stop_s
        took = min(stop_s, TIMEOUT_STOP_S)

        def done() -> None:
            if not proc.alive or u.proc is not proc:
                return
            self._exit(proc)
            if stop_s > TIMEOUT_STOP_S:
                self.log(u, f"{u.name}: State 'stop-sigterm' timed out. Killing.")
                self.log(u, f"{u.name}: Failed with result 'timeout'.")
                self._set(u, "failed", "failed", result="timeout", exec_main_code=2, exec_main_status=9, proc=None)
            else:
                self.log(u, f"Stopped {u.name} - {u.backend}.")
                self._set(u, "inactive", "dead", exec_main_code=2, exec_main_status=15, proc=None)

        if took <= 0:
            done()
            return 0.0
        self._set(u, "deactivating", "stop-sigterm")
        u.stop_done = self.now + took
        self.at(took, done)
        return took

    def state(self, u: Unit) -> UnitState:
        return UnitState(unit=u.name, load_state="loaded" if self.unit_text(u) else "not-found",
                         active_state=u.active_state, sub_state=u.sub_state, result=u.result,
                         exec_main_status=u.exec_main_status, exec_main_code=u.exec_main_code,
                         exec_main_pid=u.exec_main_pid, main_pid=u.proc.pid if u.proc and u.proc.alive else 0,
                         n_restarts=u.n_restarts, invocation_id=u.invocation_id,
                         unit_file_state="enabled" if u.enabled else "disabled")


def _timeout_start(unit_text: str) -> float:
    """TimeoutStartSec= of a rendered unit (seconds; systemd's default 90 s without one)."""
    for line in unit_text.splitlines():
        if line.startswith("TimeoutStartSec="):
            return float(line.split("=", 1)[1])
    return 90.0


def _cursor_seq(cursor: str) -> int:
    return int(dict(p.split("=", 1) for p in cursor.split(";"))["i"], 16)


def _handler(world: World, u: Unit, proc: Process) -> type[BaseHTTPRequestHandler]:
    """HTTP as the two servers answer it (see deploy_tool.box.probe.health), scripted by the process's behaviour."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _send(self, status: int, payload: object) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _ready(self) -> bool:
            with world.lock:
                return proc.ready_at is not None and world.now >= proc.ready_at

        def _hang(self) -> bool:
            """A stopped or blocked process answers nothing: the request waits (real time, as a client's
            timeout does) until it is continued, or gives up; True when it should not answer at all."""
            deadline, nap = time.monotonic() + 30.0, threading.Event()  # (a test may stub time.sleep)
            while proc.unresponsive() and time.monotonic() < deadline:
                nap.wait(0.01)
            return proc.unresponsive() or not proc.alive

        def do_GET(self) -> None:  # noqa: N802
            if self._hang():
                self.close_connection = True
                return
            name = proc.behaviour.model or world.model_name
            if self.path == "/health" and u.kind == "llamacpp":
                if self._ready():
                    self._send(200, {"status": "ok"})
                else:
                    self._send(503, {"error": {"message": "Loading model", "code": 503}})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": name, "object": "model", "aliases": [name]}]})
            else:
                self._send(404, {"detail": "Not Found"})

        def do_POST(self) -> None:  # noqa: N802
            if self._hang():
                self.close_connection = True
                return
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n) or b"{}")
            smoke = proc.behaviour.smoke
            if smoke == "die":
                with world.lock:
                    world._die(u, proc)  # the connection closes unanswered
                self.close_connection = True
                return
            if smoke == "http-500":
                self._send(500, {"error": "internal"})
                return
            content = "" if smoke == "empty" else "Hello."
            self._send(200, {"object": "chat.completion", "model": proc.behaviour.model or body.get("model"),
                             "choices": [{"index": 0, "finish_reason": "length",
                                          "message": {"role": "assistant", "content": content}}],
                             "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}})

    return Handler


# ------------------------------------------------------------------------------------------------ the driver

signal_of = signal.Signals  # FakeSystemd.kill's argument `signal` hides the module


class FakeSystemd(Systemd):
    """deploy_tool.box.systemd.Systemd against a World: every method recorded, units scripted."""

    def __init__(self, world: World, handle: int) -> None:  # no super().__init__: no systemctl to find
        self.world = world
        self.handle = handle
        self.dead = False
        self.systemctl = ["fake-systemctl"]
        self.journalctl = ["fake-journalctl"]
        self.unit_dir = world.unit_dir
        self.timeout = 300.0

    def __repr__(self) -> str:
        return f"FakeSystemd(handle={self.handle}, unit_dir={str(self.unit_dir)!r})"

    def _call(self, method: str, *args: Any, **kwargs: Any) -> None:
        if self.dead:
            raise Killed(f"{method} after the kill")
        self.world.calls.append(Call(self.handle, method, args, kwargs, self.world.step_now()))
        why = self.world.failing.get((method, args[0] if args else None))
        if why is not None:
            raise SystemdError(f"systemctl {method} {' '.join(map(str, args))} failed (exit 1): {why}")

    # manager
    def daemon_reload(self) -> None:
        self._call("daemon_reload")

    def reset_failed(self, unit: str | None = None) -> None:
        self._call("reset_failed", unit)
        w = self.world
        with w.lock:
            for u in ([w.unit(validate_unit_name(unit))] if unit else list(w.units.values())):
                u.start_times.clear()  # reset-failed resets the start-limit counter too
                if u.active_state == "failed":
                    w._set(u, "inactive", "dead", result="success")

    # lifecycle
    def start(self, unit: str, *, no_block: bool = False, past_start_limit: bool = False) -> None:
        self._call("start", unit, no_block=no_block, past_start_limit=past_start_limit)
        self._run_job("start", unit, no_block)

    def restart(self, unit: str, *, no_block: bool = False, past_start_limit: bool = False) -> None:
        self._call("restart", unit, no_block=no_block, past_start_limit=past_start_limit)
        w = self.world
        with w.lock:
            w.advance(w._stop(w.unit(validate_unit_name(unit))))
        self._run_job("restart", unit, no_block)

    def _run_job(self, verb: str, unit: str, no_block: bool = False) -> None:
        validate_unit_name(unit)
        w = self.world
        with w.lock:
            u = w.unit(unit)
            why = w._start(u, wait=True)
            if no_block:
                return  # queued: what became of it is the unit's state
            if why is None:
                while u.sub_state == "start-post" and w._events:  # the job ends with the ExecStartPost
                    w.advance(max(0.0, w._events[0][0] - w.now))
                if u.active_state != "failed" and u.sub_state != "auto-restart":
                    return
                why = "Job failed. See the journal for details."
            st = w.state(u)
            tail = w.journal_text(unit, invocation=u.invocation_id, lines=20)
        raise SystemdError(f"{verb} of {unit} failed (ActiveState={st.active_state}, Result={st.result}, "
                           f"ExecMainStatus={st.exec_main_status}): Job for {unit} failed: {why}"
                           + (("\n" + _indent(tail)) if tail else ""),
                           hint=f"see the full log: journalctl -u {unit}", details=tail)

    def stop(self, unit: str, *, no_block: bool = False) -> None:
        self._call("stop", unit, no_block=no_block)
        validate_unit_name(unit)
        w = self.world
        with w.lock:
            if unit not in w.units:
                return  # not loaded: nothing to stop
            took = w._stop(w.units[unit])
            if not no_block:
                w.advance(took)  # systemctl stop waits for the job

    def kill(self, unit: str, signal: str = "SIGTERM", *, who: str = "all") -> None:
        self._call("kill", unit, signal, who=who)
        w = self.world
        with w.lock:
            u = w.unit(validate_unit_name(unit))
            if u.proc is not None and u.proc.alive:
                name = signal if signal.startswith("SIG") else "SIG" + signal
                if name in ("SIGSTOP", "SIGCONT"):
                    u.proc.stopped = name == "SIGSTOP"
                    return
                w._die(u, u.proc, sig=int(signal_of[name]), words="")

    def journal_settled(self, unit: str, *, invocation: str | None = None, lines: int = 30) -> str:
        self._call("journal_settled", unit, invocation=invocation, lines=lines)
        with self.world.lock:
            inv = invocation or self.world.unit(validate_unit_name(unit)).invocation_id
        return self.world.journal_text(unit, invocation=inv or None, lines=lines)

    # state
    def show(self, unit: str) -> UnitState:
        self._call("show", unit)
        w = self.world
        with w.lock:
            return w.state(w.unit(validate_unit_name(unit)))

    def properties(self, unit: str, *names: str) -> dict[str, str]:
        self._call("properties", unit, *names)
        w = self.world
        with w.lock:
            u = w.unit(validate_unit_name(unit))
            p = u.proc if u.proc is not None and u.proc.alive else None
            if p is not None and not p.stopped:
                p.cpu_ns += 1_000_000
            have = {"ActiveState": u.active_state, "SubState": u.sub_state, "InvocationID": u.invocation_id,
                    "MainPID": str(p.pid if p else 0), "Result": u.result,
                    "CPUUsageNSec": str(p.cpu_ns) if p else "[not set]",
                    "ExecMainStartTimestampMonotonic": str(int(p.started * 1e6)) if p else "0"}
        return {n: have[n] for n in names if n in have}

    def is_active(self, unit: str) -> bool:
        self._call("is_active", unit)
        with self.world.lock:
            return self.world.unit(validate_unit_name(unit)).active_state == "active"

    def is_failed(self, unit: str) -> bool:
        self._call("is_failed", unit)
        with self.world.lock:
            return self.world.unit(validate_unit_name(unit)).active_state == "failed"

    # install state
    def enable(self, unit: str, *, reload: bool = True) -> None:
        self._call("enable", unit, reload=reload)
        w = self.world
        with w.lock:
            u = w.unit(validate_unit_name(unit))
            if not w.unit_text(u):
                raise SystemdError(f"systemctl enable {unit} failed (exit 1): Unit file {unit} does not exist.")
            u.enabled = True

    def disable(self, *units: str, reload: bool = True) -> None:
        self._call("disable", *units, reload=reload)
        w = self.world
        with w.lock:
            for name in units:
                w.unit(validate_unit_name(name)).enabled = False

    def is_enabled(self, unit: str) -> str:
        self._call("is_enabled", unit)
        w = self.world
        with w.lock:
            u = w.unit(validate_unit_name(unit))
            if not w.unit_text(u):
                return "not-found"
            return "enabled" if u.enabled else "disabled"

    # unit files: real files in the world's unit dir
    def unit_path(self, name: str) -> Path:
        self._call("unit_path", name)
        return super().unit_path(name)

    def install_file(self, name: str, content: bytes, mode: int = 0o644) -> Path:
        self._call("install_file", name, len(content))
        return super().install_file(name, content, mode)

    def remove_file(self, name: str) -> bool:
        self._call("remove_file", name)
        return super().remove_file(name)

    # journal
    def sync_journal(self) -> None:
        self._call("sync_journal")

    def journal_cursor(self) -> str:
        self._call("journal_cursor")
        with self.world.lock:
            return self.world.entries[-1]["__CURSOR"] if self.world.entries else ""

    def journal(self, unit: str, since_cursor: str | None = None, invocation: str | None = None,
                lines: int = 50, since: float | None = None) -> str:
        self._call("journal", unit, since_cursor=since_cursor, invocation=invocation, lines=lines, since=since)
        validate_unit_name(unit)
        if invocation is not None and len(invocation) != 32:
            raise InputError(f"invocation id {invocation!r} is not 32 hex digits")
        return self.world.journal_text(unit, since_cursor=since_cursor, invocation=invocation, since=since,
                                       lines=lines)


#: the public methods of Systemd the fake implements (a test checks none is left to the real driver)
FAKED = tuple(n for n, v in vars(FakeSystemd).items() if callable(v) and not n.startswith("_"))

