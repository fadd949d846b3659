"""Swap the backend behind the port with a health gate and automatic rollback; finish interrupted switches.

The state machine (intent is written before every step, so a kill at any point is detected next time):

    lock -> intent -> preflight (config checks + fingerprints, the current backend still serving)
         -> stopping-current -> starting-target -> gate (unit watched, readiness, smoke completion)
         -> committing (enable target, disable the others, state, history)
    on failure after preflight: rolling-back (target's journal tail kept, target stopped, previous backend
    started through the same gate) -> exit 10 (rolled back) or 11 (rollback failed).

`recover()` finishes an interrupted operation: a switch killed while committing is completed if the target is
healthy, anything else is rolled back to the backend that served before.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from deploy_tool import systemd as systemd_mod
from deploy_tool.background import Background, together
from deploy_tool.config import Backend, Config
from deploy_tool.errors import (
    CheckFailed,
    DeployError,
    DriftError,
    HealthError,
    PerformanceError,
    RollbackFailed,
    RolledBack,
    StateError,
    SystemdError,
)
from deploy_tool.state import Operation, State, Store, now_iso

if TYPE_CHECKING:
    from deploy_tool.gate import GateReport

FAULT_ENV = "DEPLOYTOOL_FAULT"  # fault injection for crash tests: "kill:<step>" sends SIGKILL to ourselves
STEPS = ("intent", "preflight", "stopping-current", "starting-target", "gate", "committing", "rolling-back")

Log = Callable[[str], None]


def _load_gate() -> None:
    """Import the gate (HTTP client, TLS, retry library: ~50 ms) while systemctl waits for the target to start,
    instead of before the switch starts."""
    import deploy_tool.gate  # noqa: F401


@dataclass
class SwitchResult:
    ok: bool
    action: str  # "switched" | "noop" | "rolled-back" | "planned" | "recovered"
    from_backend: str | None
    to_backend: str
    seconds: float = 0.0
    gate: dict[str, Any] | None = None
    plan: list[str] = field(default_factory=list)
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _fault(step: str) -> None:
    if os.environ.get(FAULT_ENV) == f"kill:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def port_owner_answers(host: str, port: int) -> bool:
    """True if something accepts connections on the served port (after the current backend was stopped)."""
    h = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    try:
        with socket.create_connection((h, port), timeout=0.3):
            return True
    except OSError:
        return False


def refused_by_check(exc: DeployError, unit: str) -> DeployError:
    """A start the unit's own ExecStartPre refused (the port held by another process, drift found by systemd's
    check): that check's error line is the reason, not systemd's "the control process exited"."""
    if not isinstance(exc, SystemdError):
        return exc
    for line in f"{exc.details or ''}\n{exc.message}".splitlines():
        m = re.search(r"\bdeploytool\[\d+\]: error: (.+)$", line)
        if m:
            why = m.group(1).strip()
            return HealthError(f"{unit} refused to start: {why}", hint=exc.hint,
                               details={"reason": "port-taken" if " is held by " in why else "refused-by-check"})
    return exc


def plan(cfg: Config, st: State, target: Backend) -> list[str]:
    cur = st.active_backend
    steps = [f"lock {cfg.paths.state_dir}/lock", f"record intent: switch {cur or '(none)'} -> {target.name}",
             f"preflight {target.name}: config checks, fingerprints (deploytool verify {target.name})"]
    if cur:
        steps.append(f"stop {cur}.service (it serves until here)")
    steps += [f"start {target.unit}" + (": its ExecStartPre checks the fingerprints while the current backend "
                                        "exits, then waits until it is gone and the port is free" if cur else ""),
              f"health gate: {target.kind} readiness on port {cfg.serve.port}, smoke completion as "
              f"{cfg.serve.model_name!r}",
              f"commit: enable {target.unit}, disable the others, write state and history"]
    if cur:
        steps.append(f"on failure: stop {target.unit}, start {cur}.service through the same gate, exit 10")
    return steps


class Switcher:
    def __init__(self, cfg: Config, *, log: Log = lambda s: None, sd: systemd_mod.Systemd | None = None) -> None:
        self.cfg = cfg
        self.log = log
        self.sd = sd or systemd_mod.for_config(cfg)
        self.store = Store(cfg.paths.state_dir)

    # ------------------------------------------------------------------ helpers
    def _step(self, st: State, step: str) -> State:
        assert st.operation is not None
        st = self.store.save(replace(st, operation=replace(st.operation, step=step)))
        _fault(step)
        return st

    def _preflight(self, target: Backend) -> None:
        from deploy_tool import checks

        errs = [f for f in checks.run_checks(self.cfg) if f.severity == "error" and f.backend in (None, target.name)]
        if errs:
            raise CheckFailed(f"preflight of {target.name}: {errs[0].id}: {errs[0].message}",
                              hint=errs[0].fix, details=[f.to_json() for f in errs])
        try:
            from deploy_tool import fingerprint
        except ImportError:
            return
        rep = fingerprint.verify(self.cfg, target)
        if not rep.ok:
            rows = "; ".join(f"{r.item.label} ({r.item.path}): expected {r.expected[:16]}, actual {r.actual[:16]}"
                             for r in rep.rows[:5])
            raise DriftError(f"preflight of {target.name}: fingerprints drifted: {rows}",
                             hint=f"restore the files, or re-pin on purpose: deploytool pin {target.name} --reason ...")

    def _perf_gate(self, target: Backend, release: str | None) -> None:
        frac = self.cfg.health.perf_gate_fraction
        if frac is None or not release:
            return
        from deploy_tool.gate import perf_gate

        ok, figures, message = perf_gate(self.cfg, target.name, release, fraction=frac, on_event=self.log)
        self.log(f"{target.name}: performance gate: {message}")
        if not ok:
            raise PerformanceError(f"{target.name} is below {frac:.0%} of its baseline: {message}",
                                   details={"reason": "performance", "figures": figures})

    def _start_and_gate(self, b: Backend) -> GateReport:
        self.sd.reset_failed(b.unit)
        since = time.time()
        self.sd.start(b.unit, past_start_limit=True)
        inv = self.sd.show(b.unit).invocation_id
        from deploy_tool.gate import run_gate

        return run_gate(self.cfg, self.sd, b, invocation=inv or None, since=since, on_event=self.log)

    # ------------------------------------------------------------------ switch
    def switch(self, name: str, *, dry_run: bool = False, wait: float = 0.0, reason: str | None = None,
               action: str = "switch") -> SwitchResult:
        target = self.cfg.backend(name)
        st0 = self.store.load()
        if dry_run:
            return SwitchResult(True, "planned", st0.active_backend, target.name, plan=plan(self.cfg, st0, target))
        with self.store.lock(wait=wait, what=f"{action} to {target.name}"):
            st = self.store.load()
            if st.operation is not None:
                self.log(f"an interrupted {st.operation.kind} (step {st.operation.step}) was found; finishing it first")
                self._recover_locked(st)
                st = self.store.load()
            cur_name = st.active_backend
            if cur_name == target.name and self.sd.show(target.unit).is_active:
                return SwitchResult(True, "noop", cur_name, target.name,
                                    message=f"{target.name} is already active; nothing to do")
            cur = self.cfg.backends.get(cur_name) if cur_name else None
            if cur is not None and cur.name == target.name:
                # recorded active but not running (stopped by hand, or by Conflicts= when the other unit was
                # started outside deploytool): start it; there is nothing else to roll back to
                self.log(f"{target.name} is recorded active but {target.unit} is not running: starting it")
                cur = None
            t0 = time.monotonic()
            op = Operation(kind=action, op_id=uuid.uuid4().hex[:12], started=now_iso(), step="intent",
                           from_backend=cur_name, to_backend=target.name, release=st.release, pid=os.getpid())
            # the preflight only reads: it runs while the intent and its step are written (and fsynced)
            preflight = Background(lambda: self._preflight(target), name="preflight")
            st = self.store.save(replace(st, operation=op))
            _fault("intent")
            try:
                st = self._step(st, "preflight")
                preflight.result()
            except DeployError as exc:  # nothing was changed yet: the current backend keeps serving
                self.store.save(replace(st, operation=None))
                self.store.record(action, ok=False, from_backend=cur_name, to_backend=target.name,
                                  outcome="refused", reason=exc.message, release=st.release)
                raise
            inv = None
            since: float | None = None
            enabling: Background | None = None
            try:
                overlap = cur is not None and self._awaits_port(target)
                if cur is not None:
                    st = self._step(st, "stopping-current")
                    self.log(f"stopping {cur.unit}")
                    # with the target's unit waiting for the other backends itself (verify --await-port), the stop
                    # is only queued: the target's start below runs its fingerprint check while the current backend
                    # exits, and its server execs the moment the last process of the current one is gone (GPU
                    # memory and port free). Meanwhile: clear the target's failed state and start-limit counter
                    # (a refused start and its retry would cost more than this round trip).
                    together(lambda: self.sd.stop(cur.unit, no_block=overlap),
                             lambda: self._quiet_reset(target.unit))
                if not overlap and port_owner_answers(self.cfg.serve.host, self.cfg.serve.port):
                    raise HealthError(f"port {self.cfg.serve.port} is taken by another process after stopping "
                                      f"{cur_name or 'the backends'}; {target.name} cannot bind it",
                                      hint=f"find it with `ss -ltnp 'sport = :{self.cfg.serve.port}'` and stop it",
                                      details={"reason": "port-taken"})
                st = self._step(st, "starting-target")
                self.log(f"starting {target.unit}" + (f" (it takes the port once {cur.name} has exited)"
                                                      if overlap and cur is not None else ""))
                # a failed unit starts again as is, a start-limit-hit one after a reset
                since = time.time()
                together(lambda: self.sd.start(target.unit, past_start_limit=True), _load_gate)
                st = self._step(st, "gate")
                # the boot-time enablement (symlinks only) is flipped while the gate waits; a rollback, or a
                # recover after a crash, flips it back
                enabling = Background(lambda: self._set_enabled(target))
                from deploy_tool.gate import run_gate

                gate = run_gate(self.cfg, self.sd, target, invocation=inv, since=since, on_event=self.log)
                self._perf_gate(target, st.release)
                st = self._step(st, "committing")
                enabling.result()
                self._commit_state(st, target)
            except DeployError as exc:
                if enabling is not None:
                    enabling.wait()
                if since is not None:  # it was started: its journal tail is that invocation's
                    with contextlib.suppress(DeployError):
                        inv = self.sd.show(target.unit).invocation_id or None
                return self._rollback(st, target, cur, refused_by_check(exc, target.unit), inv, action, since,
                                      restore_enablement=enabling is not None)
            secs = time.monotonic() - t0
            self.store.record(action, ok=True, from_backend=cur_name, to_backend=target.name, outcome="switched",
                              seconds=round(secs, 3), release=st.release, reason=reason,
                              ready_s=round(gate.ready_s, 3))
            return SwitchResult(True, "switched", cur_name, target.name, seconds=secs, gate=gate.to_json(),
                                message=f"{target.name} is serving {self.cfg.serve.model_name!r} on port "
                                        f"{self.cfg.serve.port} ({secs:.1f}s)")

    def _awaits_port(self, b: Backend) -> bool:
        """Whether b's installed unit waits for the served port in its ExecStartPre (units rendered by this
        deploytool do); a unit without it gets the stop and the start one after the other."""
        try:
            text = self.sd.unit_path(b.unit).read_text("utf-8", errors="replace")
        except OSError:
            return False
        return any(ln.startswith("ExecStartPre=") and " verify " in ln and "--await-port" in ln
                   for ln in text.splitlines())

    def _quiet_reset(self, unit: str) -> None:
        with contextlib.suppress(DeployError):  # only an optimisation: start() gets past a start limit anyway
            self.sd.reset_failed(unit)

    def _set_enabled(self, b: Backend) -> None:
        """Enable `b` for boot and disable the other backends (idempotent)."""
        # --no-reload: enabling only places [Install] symlinks; no need to reload the manager for that
        # one `disable` for the others whose unit files are installed (a no-op for a disabled one): cheaper
        # than asking `is-enabled` about each first; it runs alongside the `enable` (different symlinks)
        others = [o.unit for o in self.cfg.other_backends(b.name) if self.sd.unit_path(o.unit).exists()]
        together(lambda: self.sd.enable(b.unit, reload=False),
                 *([lambda: self.sd.disable(*others, reload=False)] if others else []))

    def _commit(self, st: State, target: Backend) -> None:
        self._set_enabled(target)
        self._commit_state(st, target)

    def _commit_state(self, st: State, target: Backend) -> None:
        prev = st.active_backend if st.active_backend != target.name else st.previous_backend
        self.store.save(replace(st, active_backend=target.name, previous_backend=prev, operation=None))

    def _rollback(self, st: State, target: Backend, cur: Backend | None, exc: DeployError, inv: str | None,
                  action: str, since: float | None = None, *, restore_enablement: bool = False) -> SwitchResult:
        reason = exc.message.splitlines()[0]
        try:
            journal = self.sd.journal(target.unit, invocation=inv, lines=30, since=since if inv else None)
        except DeployError:
            journal = ""
        self.log(f"{target.name} failed: {reason}; rolling back")
        st = self._step(st, "rolling-back")
        try:
            self.sd.stop(target.unit)
            self.sd.reset_failed(target.unit)
        except DeployError:
            pass
        if cur is None:
            if restore_enablement:
                with contextlib.suppress(DeployError):
                    self.sd.disable(target.unit, reload=False)
            self.store.save(replace(st, operation=None, active_backend=None))
            self.store.record(action, ok=False, from_backend=None, to_backend=target.name, outcome="failed",
                              reason=reason, journal_tail=journal[-4000:])
            raise HealthError(f"{target.name} did not become healthy: {exc.message}", hint=exc.hint)
        # the previous backend is enabled for boot again whether or not it comes back: it is what served
        restoring = Background(lambda: self._set_enabled(cur)) if restore_enablement else None
        try:
            self._start_and_gate(cur)
        except DeployError as exc2:
            if restoring is not None:
                restoring.wait()
            self.store.save(replace(st, operation=None, active_backend=None))
            self.store.record(action, ok=False, from_backend=cur.name, to_backend=target.name,
                              outcome="rollback-failed", reason=reason, rollback_error=exc2.message.splitlines()[0],
                              journal_tail=journal[-4000:])
            raise RollbackFailed(f"{target.name} failed ({reason}) and the rollback to {cur.name} failed too: "
                                 f"{exc2.message}", hint="the box has no working backend: read `deploytool status` "
                                 f"and `journalctl -u {cur.unit}`") from None
        if restoring is not None:
            with contextlib.suppress(DeployError):  # boot-time only: the rollback itself succeeded
                restoring.result()
        self.store.save(replace(st, operation=None, active_backend=cur.name))
        self.store.record(action, ok=False, from_backend=cur.name, to_backend=target.name, outcome="rolled-back",
                          reason=reason, journal_tail=journal[-4000:], release=st.release)
        tail = "\n  ".join(journal.splitlines()[-8:])
        raise RolledBack(f"switch to {target.name} failed: {exc.message}\n{cur.name} was restored and is serving "
                         f"again" + (f"\n  {target.name} journal tail:\n  {tail}" if tail else ""),
                         hint=f"see `deploytool history` and `journalctl -u {target.unit}`",
                         details={"reason": reason, "restored": cur.name})

    # ------------------------------------------------------------------ recover
    def recover(self, *, wait: float = 0.0) -> SwitchResult:
        with self.store.lock(wait=wait, what="recover"):
            st = self.store.load()
            if st.operation is None:
                return SwitchResult(True, "noop", st.active_backend, st.active_backend or "",
                                    message="no interrupted operation; nothing to recover")
            return self._recover_locked(st)

    def _recover_locked(self, st: State) -> SwitchResult:
        op = st.operation
        assert op is not None
        if op.kind == "install":
            from deploy_tool import install

            install.recover_install(self.cfg, self.store, st, sd=self.sd, log=self.log)
            return SwitchResult(True, "recovered", None, op.to_backend or "", message="interrupted install undone")
        target = self.cfg.backends.get(op.to_backend or "")
        prev = self.cfg.backends.get(op.from_backend or "")
        if target is None:
            raise StateError(f"interrupted {op.kind} names an unknown backend {op.to_backend!r}",
                             hint="fix the config or remove the operation from state.json")
        if op.step in ("intent", "preflight"):  # nothing changed yet
            self.store.save(replace(st, operation=None))
            self.store.record("recover", ok=True, interrupted=op.kind, step=op.step, outcome="nothing-changed")
            return SwitchResult(True, "recovered", op.from_backend, target.name,
                                message=f"interrupted {op.kind} had changed nothing")
        if op.step == "committing" and self.sd.show(target.unit).is_active:
            try:
                from deploy_tool.gate import run_gate

                run_gate(self.cfg, self.sd, target, on_event=self.log)
                self._commit(st, target)
                self.store.record("recover", ok=True, interrupted=op.kind, step=op.step, outcome="committed",
                                  to_backend=target.name)
                return SwitchResult(True, "recovered", op.from_backend, target.name,
                                    message=f"finished the interrupted {op.kind}: {target.name} is serving")
            except DeployError:
                pass
        # roll back to what served before
        try:
            self.sd.stop(target.unit)
            self.sd.reset_failed(target.unit)
        except DeployError:
            pass
        if prev is None:
            self.store.save(replace(st, operation=None, active_backend=None))
            self.store.record("recover", ok=True, interrupted=op.kind, step=op.step, outcome="stopped")
            return SwitchResult(True, "recovered", None, target.name, message="stopped the half-started target")
        # a switch flips the boot-time enablement during its gate: flip it back
        restoring = Background(lambda: self._set_enabled(prev))
        try:
            self._start_and_gate(prev)
        except DeployError as exc:
            restoring.wait()
            self.store.save(replace(st, operation=None, active_backend=None))
            self.store.record("recover", ok=False, interrupted=op.kind, step=op.step, outcome="rollback-failed",
                              reason=exc.message.splitlines()[0])
            raise RollbackFailed(f"recovering the interrupted {op.kind}: {prev.name} did not come back: "
                                 f"{exc.message}") from None
        with contextlib.suppress(DeployError):
            restoring.result()
        self.store.save(replace(st, operation=None, active_backend=prev.name))
        self.store.record("recover", ok=True, interrupted=op.kind, step=op.step, outcome="rolled-back",
                          to_backend=prev.name)
        return SwitchResult(True, "recovered", op.from_backend, prev.name,
                            message=f"rolled the interrupted {op.kind} back: {prev.name} is serving")

    # ------------------------------------------------------------------ rollback
    def rollback(self, *, dry_run: bool = False, wait: float = 0.0) -> SwitchResult:
        st = self.store.load()
        prev = st.previous_backend
        if not prev:
            others = [b.name for b in self.cfg.other_backends(st.active_backend or "")]
            if st.active_backend and len(others) == 1:
                prev = others[0]
            else:
                raise StateError("no previous backend to roll back to", hint="name one: deploytool switch BACKEND")
        return self.switch(prev, dry_run=dry_run, wait=wait, reason="rollback", action="rollback")
