"""Swap the backend behind the port with a health gate and automatic rollback; finish interrupted switches.

The state machine (intent is written before every step, so a kill at any point is detected next time):

    lock -> intent -> preflight (config checks + fingerprints, the current backend still serving)
         -> draining (wait, bounded, until the current backend has no request in flight; deploy_tool.box.drain)
         -> stopping-current -> starting-target -> gate (unit watched, readiness, smoke completion)
         -> committing (enable target, disable the others, state, history)
    on failure after preflight: rolling-back (target's journal tail kept, target stopped, previous backend
    started through the same gate) -> exit 10 (rolled back) or 11 (rollback failed).

Each operation first builds its plan (`switch_plan`, `recover_plan`: a list of `Step`s from the config, the
state and what systemd reports); `--dry-run` prints it and the run walks it, one handler per step.
`Switcher.recover_locked` finishes an interrupted switch or rollback: one killed while committing is completed
if the target is healthy, anything else is rolled back to the backend that served before. An interrupted
install is finished by whoever hands `finish` in (deploy_tool.box.operations).

Imports: the gate (HTTP client, TLS, retry library: ~30 ms; its performance step included) is imported while
systemctl starts the target; everything else is imported here.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from deploy_tool import checks, strictmodes
from deploy_tool.box import fingerprint
from deploy_tool.box import systemd as systemd_mod
from deploy_tool.box.state import Operation, State, Step, Store, now_iso
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

if TYPE_CHECKING:
    from deploy_tool.box.drain import DrainReport
    from deploy_tool.box.gate import GateReport

STEPS = ("intent", "preflight", "draining", "stopping-current", "starting-target", "gate", "committing", "rolling-back")
# a failure up to here is a refusal, a kill an operation that changed nothing: the current backend kept serving
CHANGES_NOTHING = ("intent", "preflight", "draining")

Log = Callable[[str], None]


def _load_gate() -> None:
    """Import the gate (HTTP client, TLS, retry library: ~30 ms) while systemctl waits for the target to start,
    instead of before the switch starts."""
    import deploy_tool.box.gate  # noqa: F401


def _run_gate(cfg: Config, sd: systemd_mod.Systemd, b: Backend, **kw: Any) -> GateReport:
    from deploy_tool.box.gate import run_gate  # lazy: see the module's docstring

    return run_gate(cfg, sd, b, **kw)


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
    steps: list[dict[str, Any]] = field(default_factory=list)  # the plan's steps as data (--dry-run --json)
    drain: dict[str, Any] | None = None  # how the drain of the stopped backend went (DrainReport)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def planned(st: State, to_backend: str, steps: list[Step]) -> SwitchResult:
    """What --dry-run reports: the plan, as text and as data."""
    return SwitchResult(True, "planned", st.active_backend, to_backend, plan=[s.text() for s in steps],
                        steps=[s.to_json() for s in steps])


def port_owner_answers(host: str, port: int) -> bool:
    """True if something accepts connections on the served port (after the current backend was stopped)."""
    h = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    try:
        with socket.create_connection((h, port), timeout=0.3):
            return True
    except OSError:
        return False


def refused_by_check(exc: DeployError, unit: str, journal: str = "") -> DeployError:
    """A start the unit's own ExecStartPre refused (the port held by another process, drift found by systemd's
    check): that check's error line is the reason, not systemd's "the control process exited" nor the gate's
    "the unit failed". `journal`: the start's journal lines, when read apart from the error."""
    if isinstance(exc, HealthError):
        details = exc.details if isinstance(exc.details, dict) else {}
        if details.get("reason") != "unit-failed":
            return exc
    elif not isinstance(exc, SystemdError):
        return exc
    for line in f"{exc.details or ''}\n{exc.message}\n{journal}".splitlines():
        m = re.search(r"\bdeploytool\[\d+\]: error: (.+)$", line)
        if m:
            why = m.group(1).strip()
            return HealthError(f"{unit} refused to start: {why}", hint=exc.hint,
                               details={"reason": "port-taken" if " is held by " in why else "refused-by-check"})
    return exc


def runs(st: systemd_mod.UnitState) -> bool:
    """The unit's server runs: active, or still in its start with the server executed (its ExecStartPost, the
    readiness wait, not done yet: a switch does not wait for that once its own gate has passed)."""
    return st.is_active or (st.active_state == "activating" and st.sub_state in ("start", "start-post"))


def together(pool: ThreadPoolExecutor, first: Callable[[], object], *others: Callable[[], object]) -> None:
    """Run the calls at the same time (the first on this thread: their waits release the GIL, so two systemctl
    round trips cost about one); once all have finished, raise the first error in argument order."""
    jobs = [pool.submit(fn) for fn in others]
    err: BaseException | None = None
    try:
        first()
    except BaseException as exc:  # noqa: BLE001 - raised below, after the others finished
        err = exc
    wait_all(jobs)
    for e in [err, *(j.exception() for j in jobs)]:
        if e is not None:
            raise e


# ---------------------------------------------------------------------------------------------------- plans

@dataclass(frozen=True)
class SwitchFacts:
    """What a switch's plan depends on besides the config and the state (read from systemd by `Switcher.facts`)."""

    cur: Backend | None  # the backend to stop (and to roll back to): the recorded active one, unless it is the target
    overlap: bool  # the target's unit waits for the port itself: the stop is queued and the start runs meanwhile
    noop: bool  # the target is recorded active and its unit runs


def switch_facts(cfg: Config, st: State, target: Backend, *, target_running: bool, awaits_port: bool) -> SwitchFacts:
    cur = cfg.backends.get(st.active_backend) if st.active_backend else None
    if cur is not None and cur.name == target.name:
        # recorded active but not running (stopped by hand, or by Conflicts= when the other unit was started
        # outside deploytool): start it; there is nothing else to roll back to
        cur = None
    return SwitchFacts(cur=cur, overlap=cur is not None and awaits_port,
                       noop=st.active_backend == target.name and target_running)


def drain_seconds(cfg: Config, drain_s: float | None) -> float:
    """The drain bound of a planned stop: `drain_s` (--drain-timeout; 0 with --no-drain), else the config's."""
    return cfg.supervision.drain_timeout_s if drain_s is None else drain_s


def switch_plan(cfg: Config, st: State, target: Backend, facts: SwitchFacts, *, action: str = "switch",
                drain_s: float | None = None) -> list[Step]:
    """The steps of a switch (or rollback) to `target`, after the lock; run by `Switcher.switch_locked`.
    `drain_s`: how long the current backend may take to finish its requests in flight (None: the config's
    supervision.drain_timeout_s; 0: no draining step, it is stopped at once)."""
    if facts.noop:
        return [Step("noop", f"nothing to do: {target.name} is already active")]
    cur, port, state = facts.cur, cfg.serve.port, str(Store(cfg.paths.state_dir).state_path)
    others = tuple(o.unit for o in cfg.other_backends(target.name))
    steps = [Step("intent", f"record intent: {action} {st.active_backend or '(none)'} -> {target.name}", (state,)),
             Step("preflight", f"preflight {target.name}: config checks, fingerprints "
                               f"(deploytool verify {target.name})")]
    drain = drain_seconds(cfg, drain_s)
    if cur is not None and drain > 0:
        steps.append(Step("draining", f"drain {cur.unit}: wait until no request is in flight on port {port} "
                                      f"(its TCP connections), at most {drain:g}s"))
    if cur is not None:
        steps.append(Step("stopping-current", f"stop {cur.unit} (it serves until here)", (cur.unit,)))
    if facts.overlap:
        start = (f"start {target.unit}: its ExecStartPre checks the fingerprints while the current backend exits, "
                 "then waits until it is gone and the port is free")
    else:
        start = f"start {target.unit} once nothing answers on port {port}"
    steps.append(Step("starting-target", start, (target.unit,)))
    gate = f"health gate: {target.kind} readiness on port {port}, smoke completion as {cfg.serve.model_name!r}"
    if cfg.health.perf_gate_fraction is not None and st.release:
        gate += f", throughput at least {cfg.health.perf_gate_fraction:.0%} of its baseline"
    steps += [Step("gate", gate),
              Step("committing", f"commit: enable {target.unit}, disable the others, write state and history",
                   (target.unit, *others, state))]
    if cur is not None:
        steps.append(Step("rolling-back", f"stop {target.unit}, start {cur.unit} through the same gate, exit 10",
                          (target.unit, cur.unit, state), when="on failure"))
    else:
        steps.append(Step("rolling-back", f"stop {target.unit}, leave no backend running, exit 9",
                          (target.unit, state), when="on failure"))
    return steps


def recover_plan(cfg: Config, st: State, *, target_running: bool) -> list[Step]:
    """The steps that finish an interrupted switch or rollback (`target_running`: its target's unit is active);
    run by `Switcher.recover_locked`."""
    op = st.operation
    assert op is not None and op.kind != "install"
    target = _recover_target(cfg, op)
    # a failover's from_backend had failed for good: it is not started again, whatever the fallback does
    prev = None if op.kind == "failover" else cfg.backends.get(op.from_backend or "")
    state = str(Store(cfg.paths.state_dir).state_path)
    if op.step in CHANGES_NOTHING:
        return [Step("nothing-changed", f"clear the interrupted {op.kind} (step {op.step}): it had changed nothing",
                     (state,))]
    steps, when = [], ""
    if op.step == "committing" and target_running:
        steps.append(Step("finish-commit", f"health gate of {target.name}; if it passes, commit: enable "
                          f"{target.unit}, disable the others, write state", (target.unit, state)))
        when = "if the gate fails"
    steps.append(Step("stop-target", f"stop {target.unit}", (target.unit,), when=when))
    if prev is None:
        why = f"{op.from_backend} had failed" if op.kind == "failover" else "no backend served before"
        steps.append(Step("leave-stopped", f"{why}: leave none running", (state,), when=when))
    else:
        steps.append(Step("restart-previous", f"start {prev.unit} through the health gate, enable it for boot "
                          "(the others disabled), write state", (prev.unit, state), when=when))
    return steps


def _recover_target(cfg: Config, op: Operation) -> Backend:
    target = cfg.backends.get(op.to_backend or "")
    if target is None:
        raise StateError(f"interrupted {op.kind} names an unknown backend {op.to_backend!r}",
                         hint="fix the config or remove the operation from state.json")
    return target


def rollback_target(cfg: Config, st: State) -> str:
    """The backend `rollback` switches to: the previous one, else the only other one."""
    prev = st.previous_backend
    if not prev:
        others = [b.name for b in cfg.other_backends(st.active_backend or "")]
        if st.active_backend and len(others) == 1:
            prev = others[0]
        elif st.operation is not None:  # what ran before it is in the interrupted operation: finish that first
            raise StateError(f"no previous backend to roll back to while an interrupted {st.operation.kind} is "
                             f"pending (step {st.operation.step})",
                             hint="finish it first: deploytool recover; then roll back or switch")
        else:
            raise StateError("no previous backend to roll back to", hint="name one: deploytool switch BACKEND")
    return prev


# ---------------------------------------------------------------------------------------------------- runs

class Switcher:
    """Switch, rollback and recover of one box. `finish` finishes an operation found interrupted under the lock
    (default: `recover_locked`, which knows switches and rollbacks only)."""

    def __init__(self, cfg: Config, *, log: Log = lambda s: None, sd: systemd_mod.Systemd | None = None,
                 finish: Callable[[State], object] | None = None) -> None:
        self.cfg = cfg
        self.log = log
        self.sd = sd or systemd_mod.for_config(cfg)
        self.store = Store(cfg.paths.state_dir)
        self.finish = finish or self.recover_locked

    # ------------------------------------------------------------------ the operations, each under the lock
    def switch(self, name: str, *, dry_run: bool = False, wait: float = 0.0, reason: str | None = None,
               action: str = "switch", drain_s: float | None = None) -> SwitchResult:
        target = self.cfg.backend(name)
        if dry_run:
            st = self.store.load()
            return planned(st, target.name, self.store.lock_steps(st) + self.plan(st, target, action=action,
                                                                                  drain_s=drain_s))
        with self.store.locked(what=f"{action} to {target.name}", wait=wait, finish=self.finish,
                               log=self.log) as st:
            return self.switch_locked(st, target, reason=reason, action=action, drain_s=drain_s)

    def rollback(self, *, dry_run: bool = False, wait: float = 0.0, drain_s: float | None = None) -> SwitchResult:
        prev = rollback_target(self.cfg, self.store.load())
        return self.switch(prev, dry_run=dry_run, wait=wait, reason="rollback", action="rollback", drain_s=drain_s)

    def recover(self, *, wait: float = 0.0) -> SwitchResult:
        with self.store.lock(wait=wait, what="recover"):
            st = self.store.load()
            if st.operation is None:
                return SwitchResult(True, "noop", st.active_backend, st.active_backend or "",
                                    message="no interrupted operation; nothing to recover")
            res = self.finish(st)
            assert isinstance(res, SwitchResult)
            return res

    # ------------------------------------------------------------------ plans, from what systemd reports
    def facts(self, st: State, target: Backend) -> SwitchFacts:
        # `show` only when the target is recorded active (the one round trip a plain switch does not need)
        running = st.active_backend == target.name and runs(self.sd.show(target.unit))
        return switch_facts(self.cfg, st, target, target_running=running, awaits_port=self._awaits_port(target))

    def plan(self, st: State, target: Backend, *, action: str = "switch", drain_s: float | None = None) -> list[Step]:
        return switch_plan(self.cfg, st, target, self.facts(st, target), action=action, drain_s=drain_s)

    def recover_steps(self, st: State) -> list[Step]:
        op = st.operation
        assert op is not None
        running = op.step == "committing" and runs(self.sd.show(_recover_target(self.cfg, op).unit))
        return recover_plan(self.cfg, st, target_running=running)

    # ------------------------------------------------------------------ switch
    def switch_locked(self, st: State, target: Backend, *, reason: str | None = None,
                      action: str = "switch", drain_s: float | None = None) -> SwitchResult:
        """Switch to `target` along its plan; the caller holds the lock and nothing is left interrupted."""
        facts = self.facts(st, target)
        drain = drain_seconds(self.cfg, drain_s)
        steps = switch_plan(self.cfg, st, target, facts, action=action, drain_s=drain)
        if steps[0].name == "noop":
            return SwitchResult(True, "noop", st.active_backend, target.name,
                                message=f"{target.name} is already active; nothing to do")
        if st.active_backend == target.name:
            self.log(f"{target.name} is recorded active but {target.unit} is not running: starting it")
        with ThreadPoolExecutor(max_workers=4, thread_name_prefix="switch") as pool:
            return _SwitchRun(self, pool, st, target, facts, action=action, reason=reason,
                              drain_s=drain).run(steps)

    def _preflight(self, target: Backend) -> None:
        strictmodes.require(self.cfg, [target], f"preflight of {target.name}")  # its ExecStartPre would refuse
        errs = [f for f in checks.run_checks(self.cfg) if f.severity == "error" and f.backend in (None, target.name)]
        if errs:
            raise CheckFailed(f"preflight of {target.name}: {errs[0].id}: {errs[0].message}",
                              hint=errs[0].fix, details=[f.to_json() for f in errs])
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
        from deploy_tool.box.gate import await_start_job, perf_gate  # lazy: see the module's docstring

        # the unit's own readiness wait ends moments after the gate: not measured alongside it
        await_start_job(self.sd, target.unit, timeout=10.0, interval=self.cfg.health.interval_s)
        ok, figures, message = perf_gate(self.cfg, target.name, release, fraction=frac, on_event=self.log)
        self.log(f"{target.name}: performance gate: {message}")
        if not ok:
            raise PerformanceError(f"{target.name} is below {frac:.0%} of its baseline: {message}",
                                   details={"reason": "performance", "figures": figures})

    def _start_and_gate(self, b: Backend) -> GateReport:
        self.sd.reset_failed(b.unit)
        since = time.time()
        # queued, not waited for: the job ends when the unit's ExecStartPost sees the server ready, while the gate
        # watches the unit itself (a crash is seen at once, its own diagnostics kept); the gate takes the
        # invocation it first sees run
        self.sd.start(b.unit, no_block=True, past_start_limit=True)
        return _run_gate(self.cfg, self.sd, b, invocation=None, since=since, on_event=self.log)

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

    def _set_enabled(self, b: Backend, pool: ThreadPoolExecutor) -> None:
        """Enable `b` for boot and disable the other backends (idempotent)."""
        # --no-reload: enabling only places [Install] symlinks; no need to reload the manager for that
        # one `disable` for the others whose unit files are installed (a no-op for a disabled one): cheaper
        # than asking `is-enabled` about each first; it runs alongside the `enable` (different symlinks)
        others = [o.unit for o in self.cfg.other_backends(b.name) if self.sd.unit_path(o.unit).exists()]
        together(pool, lambda: self.sd.enable(b.unit, reload=False),
                 *([lambda: self.sd.disable(*others, reload=False)] if others else []))

    def _commit_state(self, st: State, target: Backend) -> None:
        prev = st.active_backend if st.active_backend != target.name else st.previous_backend
        self.store.save(replace(st, active_backend=target.name, previous_backend=prev, operation=None))

    def _restore(self, st: State, prev: Backend, pool: ThreadPoolExecutor, *, enable: bool = True) -> DeployError | None:
        """Start `prev` through the gate, with `enable` its boot-time enablement flipped back meanwhile (it is
        what served, whether or not it comes back); the error if it did not come back. The state says which."""
        restoring = pool.submit(self._set_enabled, prev, pool) if enable else None
        try:
            self._start_and_gate(prev)
        except DeployError as exc:
            if restoring is not None:
                wait_all([restoring])
            self.store.save(replace(st, operation=None, active_backend=None))
            return exc
        if restoring is not None:
            with contextlib.suppress(DeployError):  # boot-time only: the backend itself is back
                restoring.result()
        self.store.save(replace(st, operation=None, active_backend=prev.name))
        return None

    # ------------------------------------------------------------------ recover
    def recover_locked(self, st: State) -> SwitchResult:
        """Finish the interrupted switch or rollback in `st` along its plan; the caller holds the lock."""
        op = st.operation
        assert op is not None
        if op.kind == "install":
            raise StateError("an interrupted install is found: it is finished by `deploytool recover`",
                             hint="run deploytool recover")
        with ThreadPoolExecutor(max_workers=4, thread_name_prefix="recover") as pool:
            run = _RecoverRun(self, pool, st)
            for step in self.recover_steps(st):
                res = getattr(run, run.HANDLERS[step.name])()
                if res is not None:
                    return res
        raise AssertionError(f"the plan to recover {op.kind} at {op.step} has no final step")


class _RecoverRun:
    """Finishing one interrupted switch or rollback, walking its plan: a handler per step; the first that
    returns a result ends it (a failed gate at finish-commit goes on to the steps "if the gate fails")."""

    HANDLERS = {"nothing-changed": "nothing_changed", "finish-commit": "finish_commit", "stop-target": "stop_target",
                "leave-stopped": "leave_stopped", "restart-previous": "restart_previous"}

    def __init__(self, sw: Switcher, pool: ThreadPoolExecutor, st: State) -> None:
        assert st.operation is not None
        self.sw, self.pool, self.st, self.op = sw, pool, st, st.operation
        self.store = sw.store
        self.target = _recover_target(sw.cfg, self.op)

    def record(self, ok: bool, outcome: str, **kw: Any) -> None:
        self.store.record("recover", ok=ok, interrupted=self.op.kind, step=self.op.step, outcome=outcome, **kw)

    def nothing_changed(self) -> SwitchResult:
        self.store.save(replace(self.st, operation=None))
        self.record(True, "nothing-changed")
        return SwitchResult(True, "recovered", self.op.from_backend, self.target.name,
                            message=f"interrupted {self.op.kind} had changed nothing")

    def finish_commit(self) -> SwitchResult | None:
        try:
            _run_gate(self.sw.cfg, self.sw.sd, self.target, on_event=self.sw.log)
            self.sw._set_enabled(self.target, self.pool)
            self.sw._commit_state(self.st, self.target)
        except DeployError:
            return None  # roll back to what served before
        self.record(True, "committed", to_backend=self.target.name)
        return SwitchResult(True, "recovered", self.op.from_backend, self.target.name,
                            message=f"finished the interrupted {self.op.kind}: {self.target.name} is serving")

    def stop_target(self) -> None:
        try:
            self.sw.sd.stop(self.target.unit)
            self.sw.sd.reset_failed(self.target.unit)
        except DeployError:
            pass

    def leave_stopped(self) -> SwitchResult:
        self.store.save(replace(self.st, operation=None, active_backend=None))
        self.record(True, "stopped")
        return SwitchResult(True, "recovered", None, self.target.name, message="stopped the half-started target")

    def restart_previous(self) -> SwitchResult:
        prev = self.sw.cfg.backends[str(self.op.from_backend)]
        exc = self.sw._restore(self.st, prev, self.pool)  # a switch flips the enablement during its gate: back
        if exc is not None:
            self.record(False, "rollback-failed", reason=exc.message.splitlines()[0])
            raise RollbackFailed(f"recovering the interrupted {self.op.kind}: {prev.name} did not come back: "
                                 f"{exc.message}") from None
        self.record(True, "rolled-back", to_backend=prev.name)
        return SwitchResult(True, "recovered", self.op.from_backend, prev.name,
                            message=f"rolled the interrupted {self.op.kind} back: {prev.name} is serving")


class _SwitchRun:
    """One switch or rollback under the lock, walking its plan: a handler per step, the failure step last."""

    def __init__(self, sw: Switcher, pool: ThreadPoolExecutor, st: State, target: Backend, facts: SwitchFacts, *,
                 action: str, reason: str | None, drain_s: float = 0.0) -> None:
        self.sw, self.pool, self.st, self.target, self.facts = sw, pool, st, target, facts
        self.drain_s = drain_s
        self.drained: DrainReport | None = None
        self.cfg, self.sd, self.store, self.log = sw.cfg, sw.sd, sw.store, sw.log
        self.action, self.reason = action, reason
        self.cur = facts.cur
        self.cur_name = st.active_backend
        self.since: float | None = None  # set once the target was started: its journal tail is that invocation's
        self.preflight: Future[None] | None = None
        self.enabling: Future[None] | None = None
        self.gate: GateReport | None = None
        self.t0 = time.monotonic()

    # the plan's steps (the failure step aside) and the method that runs each
    HANDLERS = {"intent": "intent", "preflight": "check", "draining": "drain", "stopping-current": "stop_current",
                "starting-target": "start_target", "gate": "run_gate", "committing": "commit"}

    def run(self, steps: list[Step]) -> SwitchResult:
        changed = False
        try:
            for step in steps:
                if step.when:
                    continue  # the failure step: below
                changed = changed or step.name not in CHANGES_NOTHING
                if step.name != "intent":  # the intent journals the operation itself
                    self.st = self.store.advance(self.st, step.name)
                getattr(self, self.HANDLERS[step.name])()
        except DeployError as exc:
            if self.preflight is not None:
                wait_all([self.preflight])
            if not changed:  # nothing was changed yet: the current backend keeps serving
                self.store.save(replace(self.st, operation=None))
                self.record(ok=False, from_backend=self.cur_name, to_backend=self.target.name,
                            outcome="refused", reason=exc.message, release=self.st.release)
                raise
            return self.roll_back(refused_by_check(exc, self.target.unit))  # a blocking start's error: its own tail
        assert self.gate is not None
        secs = time.monotonic() - self.t0
        self.record(ok=True, from_backend=self.cur_name, to_backend=self.target.name,
                    outcome="switched", seconds=round(secs, 3), release=self.st.release, reason=self.reason,
                    ready_s=round(self.gate.ready_s, 3), **self._drain_fields())
        return SwitchResult(True, "switched", self.cur_name, self.target.name, seconds=secs,
                            gate=self.gate.to_json(), message=f"{self.target.name} is serving "
                            f"{self.cfg.serve.model_name!r} on port {self.cfg.serve.port} ({secs:.1f}s)",
                            drain=self.drained.to_json() if self.drained else None)

    def _drain_fields(self) -> dict[str, Any]:
        return {"drain": self.drained.to_json()} if self.drained is not None else {}

    def record(self, **fields: Any) -> None:
        """The operation's one history event (a failover writes its own: see deploy_tool.box.failover)."""
        self.store.record(self.action, **fields)

    def intent(self) -> None:
        op = Operation(kind=self.action, op_id=uuid.uuid4().hex[:12], started=now_iso(), step="intent",
                       from_backend=self.cur_name, to_backend=self.target.name, release=self.st.release,
                       pid=os.getpid())
        # the preflight only reads: it runs while the intent and its step are written (and fsynced), unless the
        # caller started it earlier still (a failover, while it reads the failed unit's journal)
        if self.preflight is None:
            self.preflight = self.pool.submit(self.sw._preflight, self.target)
        self.st = self.store.begin(self.st, op)

    def check(self) -> None:
        assert self.preflight is not None
        self.preflight.result()

    def drain(self) -> None:
        assert self.cur is not None
        from deploy_tool.box.drain import drain  # lazy: urllib for /slots (the gate loads it anyway)

        self.drained = drain(self.cfg, self.cur, self.drain_s, log=self.log)

    def stop_current(self) -> None:
        assert self.cur is not None
        cur = self.cur
        self.log(f"stopping {cur.unit}")
        # with the target's unit waiting for the other backends itself (verify --await-port), the stop is only
        # queued: the target's start below runs its fingerprint check while the current backend exits, and its
        # server execs the moment the last process of the current one is gone (GPU memory and port free).
        # Meanwhile: clear the target's failed state and start-limit counter (a refused start and its retry
        # would cost more than this round trip).
        together(self.pool, lambda: self.sd.stop(cur.unit, no_block=self.facts.overlap),
                 lambda: self.sw._quiet_reset(self.target.unit))

    def start_target(self) -> None:
        port = self.cfg.serve.port
        if not self.facts.overlap and port_owner_answers(self.cfg.serve.host, port):
            raise HealthError(f"port {port} is taken by another process after stopping "
                              f"{self.cur_name or 'the backends'}; {self.target.name} cannot bind it",
                              hint=f"find it with `ss -ltnp 'sport = :{port}'` and stop it",
                              details={"reason": "port-taken"})
        self.log(f"starting {self.target.unit}" + (f" (it takes the port once {self.cur.name} has exited)"
                                                   if self.facts.overlap and self.cur is not None else ""))
        if self.cur is None:  # else reset while the current backend was stopped
            self.sw._quiet_reset(self.target.unit)
        self.since = time.time()
        # queued, not waited for: the start job lasts until the unit's ExecStartPost sees the server ready; the gate
        # watches the unit meanwhile (its ExecStartPre, then the server's process through a pidfd)
        together(self.pool, lambda: self.sd.start(self.target.unit, no_block=True, past_start_limit=True),
                 _load_gate)

    def run_gate(self) -> None:
        # the boot-time enablement (symlinks only) is flipped while the gate waits; a rollback, or a recover
        # after a crash, flips it back
        self.enabling = self.pool.submit(self.sw._set_enabled, self.target, self.pool)
        self.gate = _run_gate(self.cfg, self.sd, self.target, invocation=None, since=self.since, on_event=self.log)
        self.sw._perf_gate(self.target, self.st.release)

    def commit(self) -> None:
        assert self.enabling is not None
        self.enabling.result()
        self.sw._commit_state(self.st, self.target)

    def refused(self, exc: DeployError, inv: str | None, journal: str) -> DeployError:
        """The ExecStartPre's own error line for a start it refused, read again once the journal has settled
        when it is not in yet (journald takes a short-lived process's output asynchronously)."""
        out = refused_by_check(exc, self.target.unit, journal)
        if out is exc and isinstance(exc, HealthError) and isinstance(exc.details, dict) \
                and exc.details.get("reason") == "unit-failed" and not exc.details.get("exec_main"):
            # no main process ran (else a crash: its rollback is not delayed for this)
            with contextlib.suppress(DeployError):
                out = refused_by_check(exc, self.target.unit, self.sd.journal_settled(self.target.unit, invocation=inv))
        return out

    def roll_back(self, exc: DeployError) -> SwitchResult:
        """The failure step: the target's journal tail kept, the target stopped, the previous backend started
        through the same gate (exit 10), or none when none served (exit 9); exit 11 when it does not come back."""
        target, cur, st = self.target, self.cur, self.st
        restore_enablement = self.enabling is not None
        if self.enabling is not None:
            wait_all([self.enabling])
        inv = None
        if self.since is not None:  # it was started: its journal tail is that invocation's
            with contextlib.suppress(DeployError):
                inv = self.sd.show(target.unit).invocation_id or None
        try:
            journal = self.sd.journal(target.unit, invocation=inv, lines=30, since=self.since if inv else None)
        except DeployError:
            journal = ""
        exc = self.refused(exc, inv, journal)
        reason = exc.message.splitlines()[0]
        self.log(f"{target.name} failed: {reason}; rolling back")
        st = self.store.advance(st, "rolling-back")
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
            self.record(ok=False, from_backend=None, to_backend=target.name, outcome="failed",
                        reason=reason, journal_tail=journal[-4000:])
            raise HealthError(f"{target.name} did not become healthy: {exc.message}", hint=exc.hint)
        # the previous backend is enabled for boot again (if the gate had flipped it): it is what served
        exc2 = self.sw._restore(st, cur, self.pool, enable=restore_enablement)
        if exc2 is not None:
            self.record(ok=False, from_backend=cur.name, to_backend=target.name,
                        outcome="rollback-failed", reason=reason, rollback_error=exc2.message.splitlines()[0],
                        journal_tail=journal[-4000:])
            raise RollbackFailed(f"{target.name} failed ({reason}) and the rollback to {cur.name} failed too: "
                                 f"{exc2.message}", hint="the box has no working backend: read `deploytool status` "
                                 f"and `journalctl -u {cur.unit}`") from None
        self.record(ok=False, from_backend=cur.name, to_backend=target.name,
                    outcome="rolled-back", reason=reason, journal_tail=journal[-4000:], release=st.release,
                    **self._drain_fields())
        # the gate's message may carry the target's journal tail already: the same lines are not printed twice
        lines = journal.splitlines()[-8:]
        tail = "" if not lines or lines[-1] in exc.message else "\n  ".join(lines)
        raise RolledBack(f"switch to {target.name} failed: {exc.message}"
                         + (f"\n  {target.name} journal tail:\n  {tail}" if tail else "")
                         + f"\n{cur.name} was restored and is serving again",
                         hint=f"see `deploytool history` and `journalctl -u {target.unit}`",
                         details={"reason": reason, "restored": cur.name})
