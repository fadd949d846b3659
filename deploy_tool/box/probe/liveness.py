"""Liveness of the active backend between switches: one probe per tick, every supervision.liveness.interval_s
(`deploytool liveness --watch`, the rendered deploytool-liveness.service: one process, so the interpreter and its
imports are paid once and a tick costs milliseconds; `deploytool liveness` is one tick), restart when hung, give
up when restarting does not help.

A tick:
  1. skip when liveness is off, an operation (install, switch, ...) holds the lock or is interrupted, or no
     backend is recorded active;
  2. read the active unit (ActiveState, SubState, InvocationID, CPUUsageNSec; one `systemctl show`): a unit that
     is not active/running is not this probe's business (a crash is restarted by Restart=on-failure; a failed
     unit is failover's);
  3. probe it within timeout_s: readiness (llama-server GET /health, ftllm GET /v1/models), and every
     completion_every_s a chat completion of one token;
  4. decide (`decide`, a pure function of the config, the kept state and what was observed):
     ok -> the failure count goes back to 0;
     not ready yet on a start that was never seen ready, within its start timeout -> "starting", not a failure;
     no answer while requests are in flight on the port (deploy_tool.procfs: ESTABLISHED connections, the
     probe's own not counted) and the unit's CPU time advanced during the probe -> "busy", not a failure (a
     stopped or deadlocked server with a client waiting uses no CPU: that is a failure), for at most
     `busy_max_s` in a row: past it each such tick is a failure too (a GPU server's host thread can spin on a
     hung kernel, using CPU for ever);
     anything else -> one failure; `failures` in a row -> restart;
  5. act: restart = SIGKILL to the unit's processes (`systemctl kill`), so that Restart=on-failure starts it again
     after RestartSec= and the start counts against the unit's start limit like any crash. When `restarts`
     liveness restarts within restart_window_s did not help, the next hang gives up: the server is killed with a
     runtime drop-in `Restart=no` in place, so the unit ends up failed (Result=signal) and its OnFailure= runs
     (the failover); the drop-in is removed once the unit is failed. Both act under the state lock (skipped
     when an operation holds it) and only on the backend still recorded active.

History (history.jsonl) gets an event "liveness" with backend, action ("failure", "restart", "gave-up"; "busy"
once per busy streak), failures and detail; ticks that find the server well are not recorded. The count of
failures in a row and the restarts live in STATE_FILE in the state dir (JSON, written atomically, only when they
change).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from deploy_tool import procfs, retry
from deploy_tool.box import packedconfig, runtime
from deploy_tool.box import systemd as systemd_mod
from deploy_tool.box.probe import gate, health
from deploy_tool.box.state import Store
from deploy_tool.config import Backend, Config, LivenessCfg
from deploy_tool.errors import DeployError, HealthError, LockedError
from deploy_tool.fsutil import atomic_write
from deploy_tool.render import LIVENESS_UNIT, visible_gpus

STATE_FILE = "liveness.json"
DROPIN = "zz-deploytool-liveness-gave-up.conf"  # the runtime drop-in of a give-up (removed once the unit failed)
EVENT = "liveness"
PROPS = ("ActiveState", "SubState", "InvocationID", "CPUUsageNSec", "ExecMainStartTimestampMonotonic", "MainPID")

Log = Callable[[str], None]


@dataclass(frozen=True)
class LiveState:
    """What the probe keeps between ticks (STATE_FILE)."""

    backend: str | None = None
    invocation: str = ""  # the unit's InvocationID the counts below are about
    first_seen: float = 0.0  # when this invocation was first seen (epoch seconds)
    seen_ready: bool = False  # it answered a probe at least once
    failures: int = 0  # failed probes in a row
    busy_since: float = 0.0  # when its busy streak began (epoch seconds; 0: none), bounded by busy_max_s
    last_completion: float = 0.0  # when the last tiny completion passed
    restarts: tuple[float, ...] = field(default_factory=tuple)  # liveness restarts of this backend (epoch seconds)

    @property
    def busy(self) -> bool:
        """It is in a busy streak (a "busy" event is recorded once per streak)."""
        return self.busy_since > 0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["restarts"] = list(self.restarts)
        return d


@dataclass(frozen=True)
class Observation:
    """What one tick saw of the active backend."""

    invocation: str
    answered: bool  # the probe got a good answer in time
    detail: str = ""  # why not
    loading: bool = False  # the server said it is still loading (llama-server /health 503)
    in_flight: int = 0  # client connections to the served port (the probe's own not counted)
    cpu_advanced: bool | None = None  # the unit's CPU time grew during the probe; None: not known
    completion_done: bool = False  # a tiny completion passed in this tick
    up_s: float | None = None  # how long ago its main process started (None: not known)
    gated: bool = False  # an operation committed it after this process started: it passed the health gate


@dataclass(frozen=True)
class Verdict:
    state: LiveState
    action: str  # ok | starting | busy | failure | restart | gave-up
    detail: str = ""


def decide(cfg: LivenessCfg, start_timeout_s: float, st: LiveState, obs: Observation, now: float) -> Verdict:
    """The tick's verdict from the kept state and what it observed; the new state to keep."""
    if obs.invocation != st.invocation:  # a new start (by us, by Restart=, by an operator): counts start afresh
        st = replace(st, invocation=obs.invocation, first_seen=now, seen_ready=False, failures=0, busy_since=0.0)
    window = [t for t in st.restarts if now - t < cfg.restart_window_s]
    st = replace(st, restarts=tuple(window))
    if obs.answered:
        st = replace(st, seen_ready=True, failures=0, busy_since=0.0,
                     last_completion=now if obs.completion_done else st.last_completion)
        return Verdict(st, "ok")
    up = obs.up_s if obs.up_s is not None else now - st.first_seen
    if not st.seen_ready and not obs.gated and up < start_timeout_s:
        return Verdict(replace(st, busy_since=0.0), "starting", f"not ready yet ({obs.detail})")
    working = obs.in_flight > 0 and obs.cpu_advanced is not False
    since = (st.busy_since or now) if working else 0.0
    if working and (not cfg.busy_max_s or now - since < cfg.busy_max_s):
        return Verdict(replace(st, busy_since=since), "busy",
                       f"{obs.detail}; {obs.in_flight} request(s) in flight and the server is working")
    # not working, or busy past its bound: the streak's start is kept, so each tick past the bound counts
    st = replace(st, busy_since=since)
    failures = st.failures + 1
    detail = obs.detail
    if working:
        detail += (f"; busy for {now - since:.0f}s without answering a probe (past supervision.liveness.busy_max_s "
                   f"{cfg.busy_max_s:g})")
    elif obs.in_flight > 0:
        detail += f"; {obs.in_flight} request(s) in flight but no CPU time used: stuck"
    if failures < cfg.failures:
        return Verdict(replace(st, failures=failures), "failure", detail)
    if len(window) >= cfg.restarts:
        return Verdict(replace(st, failures=failures), "gave-up",
                       f"{detail}; {len(window)} restart(s) in the last {cfg.restart_window_s:g}s did not help")
    return Verdict(replace(st, failures=0, restarts=(*window, now)), "restart", detail)


# ------------------------------------------------------------------------------------------------ the tick

@dataclass(frozen=True)
class TickResult:
    action: str  # off | skipped | not-running | ok | starting | busy | failure | restart | gave-up
    backend: str | None
    detail: str = ""
    failures: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def load_state(path: Path) -> LiveState:
    try:
        d = json.loads(path.read_bytes())
        return LiveState(backend=d.get("backend"), invocation=str(d.get("invocation") or ""),
                         first_seen=float(d.get("first_seen") or 0.0), seen_ready=bool(d.get("seen_ready")),
                         failures=int(d.get("failures") or 0), busy_since=float(d.get("busy_since") or 0.0),
                         last_completion=float(d.get("last_completion") or 0.0),
                         restarts=tuple(float(t) for t in d.get("restarts") or ()))
    except (OSError, ValueError, TypeError, AttributeError):
        return LiveState()  # none yet, or damaged: start counting afresh


def save_state(path: Path, st: LiveState) -> None:
    atomic_write(path, (json.dumps(st.to_json(), sort_keys=True) + "\n").encode(), 0o644)


class Prober:
    """One tick against the box of `cfg` (`now` and `sd` injectable for tests)."""

    def __init__(self, cfg: Config, *, sd: systemd_mod.Systemd | None = None, log: Log = lambda s: None,
                 now: Callable[[], float] = time.time, mono: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.lcfg = cfg.supervision.liveness
        self.store = Store(cfg.paths.state_dir)
        self.path = self.store.dir / STATE_FILE
        self._sd = sd
        self.log = log
        self.now = now
        self.mono = mono  # CLOCK_MONOTONIC, as systemd's *TimestampMonotonic properties count

    @property
    def sd(self) -> systemd_mod.Systemd:
        if self._sd is None:
            self._sd = systemd_mod.for_config(self.cfg)
        return self._sd

    def tick(self) -> TickResult:
        t0 = time.monotonic()
        res = self._tick()
        return replace(res, seconds=round(time.monotonic() - t0, 3))

    def _tick(self) -> TickResult:
        if not self.lcfg.enabled:
            return TickResult("off", None, "supervision.liveness.enabled is false")
        st = self.store.load()
        if st.operation is not None:
            return TickResult("skipped", st.active_backend, f"an interrupted {st.operation.kind} is pending")
        holder = self.store.holder()
        if holder is not None:
            return TickResult("skipped", st.active_backend,
                              f"{holder.get('operation') or 'an operation'} holds the lock (pid {holder.get('pid')})")
        name = st.active_backend
        if not name or name not in self.cfg.backends:
            return TickResult("skipped", name, "no backend is recorded active")
        diffs = packedconfig.installed_differences(self.cfg)
        if diffs:  # it would probe what no unit serves, and kill a healthy server for not answering there
            return TickResult("skipped", name, "the config differs from the one the installed release was packed "
                              f"with, which its units run: {packedconfig.describe(diffs, 'release')}")
        b = self.cfg.backends[name]
        kept = load_state(self.path)
        if kept.backend != name:
            kept = LiveState(backend=name)
        self._clear_stale_dropin(b)
        props = self.sd.properties(b.unit, *PROPS)
        if (props.get("ActiveState"), props.get("SubState")) != ("active", "running"):
            return TickResult("not-running", name, f"{b.unit} is {props.get('ActiveState')}/{props.get('SubState')}")
        obs = self.observe(b, props, kept, committed=_epoch(st.updated))
        v = decide(self.lcfg, b.start_timeout_s or self.cfg.health.start_timeout_s, kept, obs, self.now())
        result, keep = self.act(b, v)
        if keep and v.state != kept:
            save_state(self.path, v.state)
        return result

    # ------------------------------------------------------------------ observing
    def observe(self, b: Backend, props: dict[str, str], kept: LiveState, *,
                committed: float | None = None) -> Observation:
        """Probe `b`; `committed`: when state.json was last written (epoch seconds): after this process
        started, an operation (switch, install, recover) committed it behind its health gate, so it has no
        start-up grace left (only a start by Restart= or by hand has)."""
        inv = props.get("InvocationID", "")
        cpu0 = _cpu_ns(props)
        started = props.get("ExecMainStartTimestampMonotonic", "")
        up = self.mono() - int(started) / 1e6 if started.isdigit() and int(started) > 0 else None
        gated = up is not None and committed is not None and committed >= time.time() - up
        due = self.lcfg.completion_every_s > 0 and self.now() - kept.last_completion >= self.lcfg.completion_every_s
        try:
            loading = self._probe(b, completion=due)
        except HealthError as exc:
            # requests the server took (accepted) count as its work; the front's tries waiting in a hung
            # server's backlog do not
            n = procfs.connections_in(self.cfg.backend_port, accepted=True)
            cpu1 = _cpu_ns(self.sd.properties(b.unit, "CPUUsageNSec")) if n else None
            advanced = None if cpu0 is None or cpu1 is None else cpu1 > cpu0
            return Observation(inv, False, exc.message.splitlines()[0], in_flight=n, cpu_advanced=advanced, up_s=up,
                               gated=gated)
        if loading:
            return Observation(inv, False, "still loading (/health 503)", loading=True, up_s=up, gated=gated)
        lost = self._gpus_lost(b, props.get("MainPID", ""))
        if lost:  # it answers, but from the CPU: a failure like no answer (nothing in flight excuses it)
            return Observation(inv, False, lost, up_s=up, gated=gated)
        return Observation(inv, True, completion_done=due, up_s=up, gated=gated)

    def _gpus_lost(self, b: Backend, main_pid: str) -> str | None:
        """Why a cuda backend that answers does not count as alive: its server holds none of, or not all, its
        GPUs' nodes (deploy_tool.gpu); None when it holds them, for a cpu backend, or when it cannot be read."""
        if b.device != "cuda" or not main_pid.isdigit() or int(main_pid) <= 0:
            return None

        try:
            res = runtime.gpu_residency(gate.host_pid(self.cfg, int(main_pid)), visible_gpus(self.cfg, b))
        except DeployError:
            return None
        return res.describe(b.name) if res.known and not res.ok else None

    def _probe(self, b: Backend, *, completion: bool) -> bool:
        """One readiness probe within timeout_s (and a 1-token completion when due); True when the server says
        it is still loading; HealthError when it does not answer as it should."""
        base = health.base_url(self.cfg)
        t = self.lcfg.timeout_s
        key = health.api_key(self.cfg)
        try:
            health._probe(b.kind, base, self.cfg.serve.model_name, api_key=key, timeout=t, on_unreachable=_nothing)
        except health._NotReady as exc:
            if exc.observed.startswith("/health 503"):
                return True
            raise HealthError(f"no answer within {t:g}s: {exc.observed}") from None
        if completion:
            health.smoke_completion(base, self.cfg.serve.model_name, api_key=key, timeout=t, max_tokens=1,
                                    prompt="Hi")
        return False

    # ------------------------------------------------------------------ acting
    def act(self, b: Backend, v: Verdict) -> tuple[TickResult, bool]:
        """Record and carry out the verdict; the result, and whether to keep the verdict's state."""
        name, st = b.name, v.state
        if v.action in ("ok", "starting"):
            return TickResult(v.action, name, v.detail, st.failures), True
        if v.action == "busy":
            if not load_state(self.path).busy:  # once per streak
                self.record(name, "busy", st.failures, v.detail)
            return TickResult("busy", name, v.detail, st.failures), True
        k = self.lcfg.failures
        if v.action == "failure":
            self.record(name, "failure", st.failures, v.detail)
            self.log(f"{b.unit}: liveness probe failed ({st.failures}/{k}): {v.detail}")
            return TickResult("failure", name, v.detail, st.failures), True
        try:
            with self.store.lock(wait=0.0, what=f"liveness {v.action} of {name}"):
                now_st = self.store.load()
                if now_st.active_backend != name or now_st.operation is not None:
                    return TickResult("skipped", name, "the active backend changed meanwhile"), False
                self.record(name, "failure", k, v.detail)
                if v.action == "restart":
                    self.sd.kill(b.unit, "SIGKILL", who="all")
                else:
                    self.give_up(b)
                self.record(name, v.action, k, v.detail, restarts=len(st.restarts))
        except LockedError:  # an operation began meanwhile: it decides; this tick counted nothing
            return TickResult("skipped", name, "an operation took the lock meanwhile"), False
        self.log(f"{b.unit}: liveness {v.action}: {v.detail}")
        return TickResult(v.action, name, v.detail, k), True

    def give_up(self, b: Backend) -> None:
        """Kill the server with restarting off for this once, so that its unit ends failed and OnFailure= runs."""
        path = self._dropin(b)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, b"# deploytool liveness gave up on this backend: the kill below must leave it failed\n"
                           b"[Service]\nRestart=no\n", 0o644)
        try:
            self.sd.daemon_reload()
            self.sd.kill(b.unit, "SIGKILL", who="all")

            clock, sleep = retry.clock_for(), retry.sleep_for()
            deadline = clock() + 10.0
            while clock() < deadline and self.sd.properties(b.unit, "ActiveState").get("ActiveState") != "failed":
                sleep(0.05)
        finally:
            path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                path.parent.rmdir()  # only when empty: an operator's drop-ins stay
            with contextlib.suppress(DeployError):
                self.sd.daemon_reload()

    def _dropin(self, b: Backend) -> Path:
        return Path(self.cfg.paths.unit_dir) / f"{b.unit}.d" / DROPIN

    def _clear_stale_dropin(self, b: Backend) -> None:
        """A give-up killed before removing its drop-in: remove it (the unit must restart on failure again)."""
        path = self._dropin(b)
        if path.exists():
            path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                path.parent.rmdir()
            self.sd.daemon_reload()

    def record(self, backend: str, action: str, failures: int, detail: str, **extra: Any) -> None:
        self.store.record(EVENT, backend=backend, action=action, failures=failures, detail=detail, **extra)


def _nothing() -> None:
    pass


def _epoch(iso: str | None) -> float | None:
    """state.json's `updated` (clock.iso_utc(micro=True): 2026-12-01T13:00:00.123456Z) as epoch seconds."""
    if not iso:
        return None
    try:
        return dt.datetime.strptime(iso, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=dt.UTC).timestamp()
    except ValueError:
        return None


def _cpu_ns(props: dict[str, str]) -> int | None:
    v = props.get("CPUUsageNSec", "")
    return int(v) if v.isdigit() and int(v) < (1 << 63) else None  # [not set] / UINT64_MAX: no accounting


def arm(cfg: Config, sd: systemd_mod.Systemd, *, log: Log = lambda s: None) -> None:
    """After an install started a backend: the liveness probe's unit enabled and (re)started when
    supervision.liveness is on (the release's deploytool and config take effect), stopped and disabled when off
    (an installed box only; a failure here is logged, the install stands)."""
    if not sd.unit_path(LIVENESS_UNIT).exists():
        return
    try:
        if cfg.supervision.liveness.enabled:
            sd.enable(LIVENESS_UNIT, reload=False)
            sd.restart(LIVENESS_UNIT, past_start_limit=True)
        else:
            sd.stop(LIVENESS_UNIT)
            sd.disable(LIVENESS_UNIT, reload=False)
    except DeployError as exc:
        log(f"warning: the liveness probe's unit: {exc.message.splitlines()[0]}")


def watch(cfg: Config, *, sd: systemd_mod.Systemd | None = None, log: Log = lambda s: None,
          ticks: int | None = None, now: Callable[[], float] = time.time,
          mono: Callable[[], float] = time.monotonic) -> None:
    """`deploytool liveness --watch`: a tick every interval_s (from the start of one to the next), `ticks` of them
    or for ever. A tick that fails (systemd unreachable, the state dir unwritable) is logged and the next one
    runs; with liveness off, it returns at once (its unit is stopped then anyway)."""
    p = Prober(cfg, sd=sd, log=log, now=now, mono=mono)
    every = cfg.supervision.liveness.interval_s
    clock, sleep = retry.clock_for(), retry.sleep_for()
    n = 0
    while ticks is None or n < ticks:
        t0 = clock()
        try:
            res = p.tick()
        except DeployError as exc:
            log(f"liveness tick failed: {exc.message.splitlines()[0]}")
        else:
            if res.action == "off":
                log("liveness is off (supervision.liveness.enabled: false)")
                return
        n += 1
        if ticks is None or n < ticks:
            sleep(max(0.0, every - (clock() - t0)))


def tick(cfg: Config, *, sd: systemd_mod.Systemd | None = None, log: Log = lambda s: None) -> TickResult:
    """`deploytool liveness`: one tick."""
    return Prober(cfg, sd=sd, log=log).tick()

