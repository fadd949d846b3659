"""Swap the backend behind the port with a health gate and automatic rollback; finish interrupted switches.

The state machine (intent is written before every step, so a kill at any point is detected next time):

    lock -> intent -> preflight (config checks + fingerprints, the current backend still serving)
         -> draining (wait, bounded, until the current backend has no request in flight; deploy_tool.box.probe.drain)
         -> stopping-current -> starting-target -> gate (unit watched, readiness, smoke completion)
         -> committing (enable target, disable the others, state, history)
    on failure after preflight: rolling-back (target's journal tail kept, target stopped, previous backend
    started through the same gate) -> exit 10 (rolled back) or 11 (rollback failed).

Each operation first builds its plan (`switch_plan`, `recover_plan`: a list of `Step`s from the config, the
state and what systemd reports); `--dry-run` prints it; built for running, each step carries what it runs (a
method of the run object: `SwitchRun`, `_RecoverRun`) and the run walks it.
`Switcher.recover_locked` finishes an interrupted switch or rollback: one killed while committing is completed
if the target is healthy, anything else is rolled back to the backend that served before. An interrupted
install is finished by whoever hands `finish` in (deploy_tool.box.operations).

Every systemctl call is made in turn: a start is queued (--no-block) and systemd runs it while the gate waits,
which is the overlap that matters.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from deploy_tool import checks, strictmodes
from deploy_tool.box import fingerprint, frontctl, packedconfig
from deploy_tool.box import systemd as systemd_mod
from deploy_tool.box.probe.drain import DrainReport, drain
from deploy_tool.box.probe.gate import GateReport, perf_gate, run_gate
from deploy_tool.box.state import Operation, State, Step, Store
from deploy_tool.clock import iso_utc
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

STEPS = ("intent", "preflight", "draining", "stopping-current", "starting-target", "gate", "committing", "rolling-back")
# a failure up to here is a refusal, a kill an operation that changed nothing: the current backend kept serving
CHANGES_NOTHING = ("intent", "preflight", "draining")

Log = Callable[[str], None]


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


# ---------------------------------------------------------------------------------------------------- plans

@dataclass(frozen=True)
class SwitchFacts:
    """What a switch's plan depends on besides the config and the state (read from systemd by `Switcher.facts`)."""

    cur: Backend | None  # the backend to stop (and to roll back to): the recorded active one, unless it is the target
    overlap: bool  # the target's unit waits for the port itself: the stop is queued and the start runs meanwhile
    noop: bool  # the target is recorded active and its unit runs
    adopt: bool = False  # nothing is recorded active and the target's unit runs: gated as it runs, not restarted


def switch_facts(cfg: Config, st: State, target: Backend, *, target_running: bool, awaits_port: bool,
                 unrecorded: Backend | None = None) -> SwitchFacts:
    """`unrecorded`: with no backend recorded active, the one whose unit runs all the same (a failed rollback or
    failover left none recorded, then systemd or a person started one): it is the current backend (drained,
    stopped, rolled back to), or, when it is the target, gated as it runs and recorded."""
    cur = cfg.backends.get(st.active_backend) if st.active_backend else None
    if cur is not None and cur.name == target.name:
        # recorded active but not running (stopped by hand, or by Conflicts= when the other unit was started
        # outside deploytool): start it; there is nothing else to roll back to
        cur = None
    adopt = False
    if st.active_backend is None and unrecorded is not None:
        adopt = unrecorded.name == target.name
        cur = None if adopt else unrecorded
    return SwitchFacts(cur=cur, overlap=cur is not None and awaits_port,
                       noop=st.active_backend == target.name and target_running, adopt=adopt)


def drain_seconds(cfg: Config, drain_s: float | None) -> float:
    """The drain bound of a planned stop: `drain_s` (--drain-timeout; 0 with --no-drain), else the config's."""
    return cfg.supervision.drain_timeout_s if drain_s is None else drain_s


def switch_plan(cfg: Config, st: State, target: Backend, facts: SwitchFacts, *, action: str = "switch",
                drain_s: float | None = None, run: SwitchRun | None = None) -> list[Step]:
    """The steps of a switch (or rollback) to `target`, after the lock, each with what it runs when `run` (the
    switch under way) is given; run by `Switcher.switch_locked`. `drain_s`: how long the current backend may
    take to finish its requests in flight (None: the config's supervision.drain_timeout_s; 0: no draining step,
    it is stopped at once). The failure step runs `run.roll_back` with the error."""
    if facts.noop:
        return [Step("noop", f"nothing to do: {target.name} is already active")]
    cur, port, state = facts.cur, cfg.backend_port, str(Store(cfg.paths.state_dir).state_path)
    others = tuple(o.unit for o in cfg.other_backends(target.name))
    steps = [Step("intent", f"record intent: {action} {st.active_backend or '(none)'} -> {target.name}", (state,),
                  run=run.intent if run else None),
             Step("preflight", f"preflight {target.name}: config checks, fingerprints "
                               f"(deploytool verify {target.name})", run=run.check if run else None)]
    drain = drain_seconds(cfg, drain_s)
    if cur is not None and drain > 0:
        steps.append(Step("draining", f"drain {cur.unit}: the front holds new requests; wait until no request is in "
                                      f"flight on port {port} "
                                      f"(its TCP connections), at most {drain:g}s", run=run.drain if run else None))
    if cur is not None:
        steps.append(Step("stopping-current", f"stop {cur.unit} (it serves until here)", (cur.unit,),
                          run=run.stop_current if run else None))
    if facts.adopt:
        start = (f"{target.unit} runs, though no backend is recorded active: gated as it runs (a start of a running "
                 "unit changes nothing)")
    elif facts.overlap:
        start = (f"start {target.unit}: its ExecStartPre checks the fingerprints while the current backend exits, "
                 "then waits until it is gone and the port is free")
    else:
        start = f"start {target.unit} once nothing answers on port {port}"
    steps.append(Step("starting-target", start, (target.unit,), run=run.start_target if run else None))
    gate = f"health gate: {target.kind} readiness on port {port}, smoke completion as {cfg.serve.model_name!r}"
    if cfg.health.perf_gate_fraction is not None and st.release:
        gate += f", throughput at least {cfg.health.perf_gate_fraction:.0%} of its baseline"
    gate += f"; meanwhile {target.unit} enabled for boot, the others disabled"
    steps += [Step("gate", gate, (target.unit, *others), run=run.run_gate if run else None),
              Step("committing", "commit: write state and history (refused if the enablement failed)", (state,),
                   run=run.commit if run else None)]
    if cur is not None:
        steps.append(Step("rolling-back", f"stop {target.unit}, start {cur.unit} through the same gate, exit 10",
                          (target.unit, cur.unit, state), when="on failure"))
    else:
        steps.append(Step("rolling-back", f"stop {target.unit}, leave no backend running, exit 9",
                          (target.unit, state), when="on failure"))
    return steps


def recover_plan(cfg: Config, st: State, *, target_running: bool, run: _RecoverRun | None = None) -> list[Step]:
    """The steps that finish an interrupted switch or rollback (`target_running`: its target's unit is active),
    each with what it runs when `run` is given; run by `Switcher.recover_locked`: the first step whose action
    returns a result ends it."""
    op = st.operation
    assert op is not None and op.kind != "install"
    target = _recover_target(cfg, op)
    # a failover's from_backend had failed for good: it is not started again, whatever the fallback does
    prev = None if op.kind == "failover" else cfg.backends.get(op.from_backend or "")
    state = str(Store(cfg.paths.state_dir).state_path)
    if op.step in CHANGES_NOTHING:
        return [Step("nothing-changed", f"clear the interrupted {op.kind} (step {op.step}): it had changed nothing",
                     (state,), run=run.nothing_changed if run else None)]
    steps, when = [], ""
    if op.step == "committing" and target_running:
        steps.append(Step("finish-commit", f"health gate of {target.name}; if it passes, commit: enable "
                          f"{target.unit}, disable the others, write state", (target.unit, state),
                          run=run.finish_commit if run else None))
        when = "if the gate fails"
    steps.append(Step("stop-target", f"stop {target.unit}", (target.unit,), when=when, run=run.stop_target if run else None))
    if prev is None:
        why = f"{op.from_backend} had failed" if op.kind == "failover" else "no backend served before"
        steps.append(Step("leave-stopped", f"{why}: leave none running", (state,), when=when,
                          run=run.leave_stopped if run else None))
    else:
        steps.append(Step("restart-previous", f"start {prev.unit} through the health gate, enable it for boot "
                          "(the others disabled), write state", (prev.unit, state), when=when,
                          run=run.restart_previous if run else None))
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

Preflight = Callable[[Config, Backend], None]


#: a drifted value in the preflight's one-line refusal: a build line or a mode whole, a SHA-256 by its start
DRIFT_WIDTH = 80


def check_config(cfg: Config, target: Backend) -> None:
    """Refuse (DriftError) while the box's config differs from the one the installed release was packed with, in
    what the gate probes by: it would probe what the units, which run the release's, do not serve."""
    diffs = packedconfig.installed_differences(cfg)
    if diffs:
        where = f"the config {cfg.source_path}" if cfg.source_path else "the config"
        raise DriftError(f"preflight of {target.name}: {where} differs from the one the installed release was "
                         "packed with, which its units run: "
                         f"{packedconfig.describe(diffs, 'release')}",
                         hint=f"put those keys back as the release has them ({cfg.paths.current}/config.json), or "
                              "pack a bundle with this config and install it; nothing was changed",
                         details={"reason": "config-differs", "differences": [k for k, _, _ in diffs]})


def run_preflight(cfg: Config, target: Backend, *,
                  run_checks: Callable[..., list[checks.Finding]] = checks.run_checks,
                  verify: Callable[[Config, Backend], fingerprint.VerifyReport] = fingerprint.verify) -> None:
    """The preflight of a switch's target: the box's config against the installed release's (DriftError), its
    config checks (CheckFailed) and fingerprints (DriftError), and the modes its ExecStartPre would refuse
    (UnsafePathError). `run_checks` and `verify` are the seams a test hands
    in (Switcher(preflight=functools.partial(run_preflight, ...)))."""
    check_config(cfg, target)
    strictmodes.require(cfg, [target], f"preflight of {target.name}")  # its ExecStartPre would refuse
    # the checks of what the target's unit runs: the installed release's config (the box's may already name the next
    # bundle's model, not there yet), as its fingerprints are (fingerprint.what_runs)
    runs = packedconfig.installed_config(cfg) or cfg
    errs = [f for f in run_checks(runs, backends=[target.name])
            if f.severity == "error" and f.backend in (None, target.name)]
    if errs:
        raise CheckFailed(f"preflight of {target.name}: {errs[0].id}: {errs[0].message}",
                          hint=errs[0].fix, details=[f.to_json() for f in errs])
    rep = verify(cfg, target)
    if not rep.ok:
        rows = "; ".join(f"{r.item.label} ({r.item.path}): expected {fingerprint.short(r.expected, DRIFT_WIDTH)}, "
                         f"actual {fingerprint.short(r.actual, DRIFT_WIDTH)}" for r in rep.rows[:5])
        moved = rep.config_moved()
        raise DriftError(f"preflight of {target.name}: fingerprints drifted: {rows}" + (f"; {moved}" if moved else ""),
                         hint=f"restore the files, or re-pin on purpose: deploytool pin {target.name} --reason ..."
                         if not moved else f"put the config back as the installed release has it "
                         f"({cfg.paths.current}/config.json), or install the bundle packed with it; nothing was "
                         "changed")


class Switcher:
    """Switch, rollback and recover of one box. `finish` finishes an operation found interrupted under the lock
    (default: `recover_locked`, which knows switches and rollbacks only)."""

    def __init__(self, cfg: Config, *, log: Log = lambda s: None, sd: systemd_mod.Systemd | None = None,
                 finish: Callable[[State], object] | None = None, preflight: Preflight | None = None) -> None:
        self.cfg = cfg
        self.log = log
        self.sd = sd or systemd_mod.for_config(cfg)
        self.store = Store(cfg.paths.state_dir)
        self.finish = finish or self.recover_locked
        self._preflight = preflight or run_preflight

    # ------------------------------------------------------------------ the operations, each under the lock
    def switch(self, name: str, *, dry_run: bool = False, wait: float = 0.0, reason: str | None = None,
               action: str = "switch", drain_s: float | None = None) -> SwitchResult:
        target = self.cfg.backend(name)
        if dry_run:
            # the refusals the run would meet first, in its order (the lock; the preflight, which only reads), so
            # a script may use --dry-run as the run's preflight; with --wait the run would wait for the lock
            if not wait:
                self.store.refuse_if_held(f"{action} to {target.name}")
            st = self.store.load()
            facts = self.facts(st, target)
            if not facts.noop:
                self._preflight(self.cfg, target)
            return planned(st, target.name, self.store.lock_steps(st) + switch_plan(
                self.cfg, st, target, facts, action=action, drain_s=drain_s))
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
        unrecorded = None
        if st.active_backend is None:  # what runs unrecorded is stopped or gated, never taken for a stranger
            unrecorded = self._running_unrecorded(target)
        return switch_facts(self.cfg, st, target, target_running=running, awaits_port=self._awaits_port(target),
                            unrecorded=unrecorded)

    def _running_unrecorded(self, target: Backend) -> Backend | None:
        """The backend whose unit runs (the target first), asked of systemd; None when none does, or systemd cannot
        be asked (the switch's own stop or start then says so)."""
        for b in sorted(self.cfg.backends.values(), key=lambda b: (b.name != target.name, b.name)):
            try:
                if runs(self.sd.show(b.unit)):
                    return b
            except DeployError:
                return None
        return None

    def plan(self, st: State, target: Backend, *, action: str = "switch", drain_s: float | None = None) -> list[Step]:
        return switch_plan(self.cfg, st, target, self.facts(st, target), action=action, drain_s=drain_s)

    def recover_steps(self, st: State, run: _RecoverRun | None = None) -> list[Step]:
        op = st.operation
        assert op is not None
        running = op.step == "committing" and runs(self.sd.show(_recover_target(self.cfg, op).unit))
        return recover_plan(self.cfg, st, target_running=running, run=run)

    # ------------------------------------------------------------------ switch
    def switch_locked(self, st: State, target: Backend, *, reason: str | None = None,
                      action: str = "switch", drain_s: float | None = None) -> SwitchResult:
        """Switch to `target` along its plan; the caller holds the lock and nothing is left interrupted."""
        facts = self.facts(st, target)
        if facts.noop:
            return SwitchResult(True, "noop", st.active_backend, target.name,
                                message=f"{target.name} is already active; nothing to do")
        drain = drain_seconds(self.cfg, drain_s)
        run = SwitchRun(self, st, target, facts, action=action, reason=reason, drain_s=drain)
        if st.active_backend == target.name:
            self.log(f"{target.name} is recorded active but {target.unit} is not running: starting it")
        return run.run(switch_plan(self.cfg, st, target, facts, action=action, drain_s=drain, run=run))

    # ------------------------------------------------------------------ what the runs do (SwitchRun, failover)
    def preflight(self, target: Backend) -> None:
        """The target's config checks and fingerprints, the current backend still serving (the seam handed in,
        else `run_preflight`)."""
        self._preflight(self.cfg, target)

    def perf_gate(self, target: Backend, release: str | None) -> None:
        frac = self.cfg.health.perf_gate_fraction
        if frac is None or not release:
            return
        # the gate has waited for the unit's start job (its own readiness wait): nothing else shares the CPU
        ok, figures, message = perf_gate(self.cfg, target.name, release, fraction=frac, on_event=self.log)
        self.log(f"{target.name}: performance gate: {message}")
        if not ok:
            raise PerformanceError(f"{target.name} is below {frac:.0%} of its baseline: {message}",
                                   details={"reason": "performance", "figures": figures})

    def start_and_gate(self, b: Backend, *, enable: bool = False) -> GateReport:
        """Start `b` and gate it; with `enable`, its boot-time enablement is set while it starts (an error there
        is left alone: boot-time only)."""
        self.sd.reset_failed(b.unit)
        since = time.time()
        # queued, not waited for: the job ends when the unit's ExecStartPost sees the server ready, while the gate
        # watches the unit itself (a crash is seen at once, its own diagnostics kept); the gate takes the
        # invocation it first sees run
        self.sd.start(b.unit, no_block=True, past_start_limit=True)
        if enable:
            with contextlib.suppress(DeployError):
                self.set_enabled(b)
        return run_gate(self.cfg, self.sd, b, invocation=None, since=since, on_event=self.log)

    def _awaits_port(self, b: Backend) -> bool:
        """Whether b's installed unit waits for the served port in its ExecStartPre (units rendered by this
        deploytool do); a unit without it gets the stop and the start one after the other."""
        try:
            text = self.sd.unit_path(b.unit).read_text("utf-8", errors="replace")
        except OSError:
            return False
        return any(ln.startswith("ExecStartPre=") and " verify " in ln and "--await-port" in ln
                   for ln in text.splitlines())

    def quiet_reset(self, unit: str) -> None:
        with contextlib.suppress(DeployError):  # only an optimisation: start() gets past a start limit anyway
            self.sd.reset_failed(unit)

    def set_enabled(self, b: Backend) -> None:
        """Enable `b` for boot and disable the other backends (idempotent)."""
        # --no-reload: enabling only places [Install] symlinks; no need to reload the manager for that
        # one `disable` for the others whose unit files are installed (a no-op for a disabled one): cheaper
        # than asking `is-enabled` about each first
        others = [o.unit for o in self.cfg.other_backends(b.name) if self.sd.unit_path(o.unit).exists()]
        self.sd.enable(b.unit, reload=False)
        if others:
            self.sd.disable(*others, reload=False)

    def commit_state(self, st: State, target: Backend, from_backend: str | None = None) -> None:
        """`target` recorded active; the previous backend is the one it replaced (`from_backend`, default the recorded
        active one), unless that is the target itself."""
        left = from_backend or st.active_backend
        prev = left if left != target.name else st.previous_backend
        self.store.save(replace(st, active_backend=target.name, previous_backend=prev, operation=None))

    def restore(self, st: State, prev: Backend, *, enable: bool = True) -> DeployError | None:
        """Start `prev` through the gate, with `enable` its boot-time enablement flipped back while it starts (it
        is what served, whether or not it comes back); the error if it did not come back. The state says which."""
        try:
            self.start_and_gate(prev, enable=enable)
        except DeployError as exc:
            self.store.save(replace(st, operation=None, active_backend=None))
            return exc
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
        run = _RecoverRun(self, st)
        try:
            for step in self.recover_steps(st, run):
                assert step.run is not None, step.name
                res = step.run()
                if res is not None:
                    return res
        finally:
            # a switch killed while the front held new requests left the hold on (it would end by itself at the
            # hold bound): the requests go on to whichever backend the recovery left serving
            frontctl.release(self.cfg)
        raise AssertionError(f"the plan to recover {op.kind} at {op.step} has no final step")


class _RecoverRun:
    """Finishing one interrupted switch or rollback: what each step of its plan runs (recover_plan binds them);
    the first that returns a result ends it (a failed gate at finish-commit goes on to the steps "if the gate
    fails")."""

    def __init__(self, sw: Switcher, st: State) -> None:
        assert st.operation is not None
        self.sw, self.st, self.op = sw, st, st.operation
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
            run_gate(self.sw.cfg, self.sw.sd, self.target, on_event=self.sw.log)
            self.sw.set_enabled(self.target)
            self.sw.commit_state(self.st, self.target, self.op.from_backend)
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
        exc = self.sw.restore(self.st, prev)  # a switch flips the enablement during its gate: back
        if exc is not None:
            self.record(False, "rollback-failed", reason=exc.message.splitlines()[0])
            raise RollbackFailed(f"recovering the interrupted {self.op.kind}: {prev.name} did not come back: "
                                 f"{exc.message}") from None
        self.record(True, "rolled-back", to_backend=prev.name)
        return SwitchResult(True, "recovered", self.op.from_backend, prev.name,
                            message=f"rolled the interrupted {self.op.kind} back: {prev.name} is serving")


class SwitchRun:
    """One switch, rollback or failover under the lock: what each step of its plan runs (switch_plan binds them),
    walked in order, and the failure step.

    A failover is a switch run with its own history event and its own failure step (deploy_tool.box.failover):
    `record(run, **fields)` writes the event instead of `record`'s, `roll_back(run, exc)` is the failure step
    instead of `roll_back`'s."""

    def __init__(self, sw: Switcher, st: State, target: Backend, facts: SwitchFacts, *,
                 action: str, reason: str | None, drain_s: float = 0.0,
                 record: Callable[..., None] | None = None,
                 roll_back: Callable[[SwitchRun, DeployError], SwitchResult] | None = None) -> None:
        self.sw, self.st, self.target, self.facts = sw, st, target, facts
        self._record, self._roll_back = record, roll_back
        self.drain_s = drain_s
        self.drained: DrainReport | None = None
        self.cfg, self.sd, self.store, self.log = sw.cfg, sw.sd, sw.store, sw.log
        self.action, self.reason = action, reason
        self.cur = facts.cur
        # what it replaces, in its intent and history: an adopted target replaces itself (a recover after a kill
        # then restarts it through the gate instead of leaving none running; the commit keeps previous_backend)
        self.cur_name = facts.cur.name if facts.cur is not None else target.name if facts.adopt else st.active_backend
        self.since: float | None = None  # set once the target was started: its journal tail is that invocation's
        self.enabling: bool = False  # the boot-time enablement was flipped to the target (a rollback flips it back)
        self.enable_error: DeployError | None = None  # why flipping it failed: the commit fails with it
        self.gate: GateReport | None = None
        self.t0 = time.monotonic()
        # the front's counters before: what clients saw during this operation goes into its history event
        self.front_before = frontctl.stats(self.cfg)
        self.holding = False

    def run(self, steps: list[Step]) -> SwitchResult:
        try:
            return self._run(steps)
        finally:
            self._release()

    def _hold(self) -> None:
        """From the moment the current backend starts draining: the front holds new requests (they wait, and go
        to whichever backend is ready next); the hold ends after the gate, or by itself past the hold bound."""
        if not self.holding and frontctl.hold(self.cfg) is not None:
            self.holding = True
            self.log(f"the front holds new requests (at most {self.cfg.hold_timeout_s:g} s)")

    def _release(self) -> None:
        if self.holding:
            self.holding = False
            frontctl.release(self.cfg)

    def _run(self, steps: list[Step]) -> SwitchResult:
        changed = False
        try:
            for step in steps:
                if step.when:
                    continue  # the failure step: below
                changed = changed or step.name not in CHANGES_NOTHING
                if step.name != "intent":  # the intent journals the operation itself
                    self.st = self.store.advance(self.st, step.name)
                assert step.run is not None, step.name
                step.run()
        except DeployError as exc:
            if not changed:  # nothing was changed yet: the current backend keeps serving
                self.store.save(replace(self.st, operation=None))
                self.record(ok=False, from_backend=self.cur_name, to_backend=self.target.name,
                            outcome="refused", reason=exc.message, release=self.st.release)
                raise
            exc = refused_by_check(exc, self.target.unit)  # a blocking start's error: its own tail
            return self._roll_back(self, exc) if self._roll_back is not None else self.roll_back(exc)
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

    def clients(self) -> dict[str, Any]:
        """What the front's clients saw so far in this operation: requests answered, waited, failed, seconds held."""
        seen = frontctl.delta(self.front_before, frontctl.stats(self.cfg))
        return {"clients": seen} if seen is not None else {}

    def record(self, **fields: Any) -> None:
        """The operation's one history event (a failover writes its own: see deploy_tool.box.failover)."""
        if self._record is not None:
            self._record(self, **fields)
        else:
            self.store.record(self.action, **fields, **self.clients())

    def intent(self) -> None:
        op = Operation(kind=self.action, op_id=uuid.uuid4().hex[:12], started=iso_utc(micro=True), step="intent",
                       from_backend=self.cur_name, to_backend=self.target.name, release=self.st.release,
                       pid=os.getpid())
        self.st = self.store.begin(self.st, op)

    def check(self) -> None:
        self.sw.preflight(self.target)

    def drain(self) -> None:
        assert self.cur is not None
        self._hold()
        self.drained = drain(self.cfg, self.cur, self.drain_s, log=self.log)

    def stop_current(self) -> None:
        assert self.cur is not None
        self._hold()
        cur = self.cur
        self.log(f"stopping {cur.unit}")
        # with the target's unit waiting for the other backends itself (verify --await-port), the stop is only
        # queued: the target's start below runs its fingerprint check while the current backend exits, and its
        # server execs the moment the last process of the current one is gone (GPU memory and port free).
        # Then: clear the target's failed state and start-limit counter (a refused start and its retry would cost
        # more than this round trip).
        try:
            self.sd.stop(cur.unit, no_block=self.facts.overlap)
        finally:
            self.sw.quiet_reset(self.target.unit)

    def start_target(self) -> None:
        # held from here too where nothing drained (a failover, a first start): the requests that waited for a
        # backend go to the target after its gate, not into its smoke test as it comes up
        if self.facts.adopt:  # it runs and serves: nothing held; the gate reads this invocation's own journal
            self.log(f"{self.target.unit} runs, though no backend is recorded active: gating it as it runs")
            return
        self._hold()
        port = self.cfg.backend_port
        if not self.facts.overlap and port_owner_answers(self.cfg.backend_host, port):
            raise HealthError(f"port {port} is taken by another process after stopping "
                              f"{self.cur_name or 'the backends'}; {self.target.name} cannot bind it",
                              hint=f"find it with `ss -ltnp 'sport = :{port}'` and stop it",
                              details={"reason": "port-taken"})
        self.log(f"starting {self.target.unit}" + (f" (it takes the port once {self.cur.name} has exited)"
                                                   if self.facts.overlap and self.cur is not None else ""))
        if self.cur is None:  # else reset while the current backend was stopped
            self.sw.quiet_reset(self.target.unit)
        self.since = time.time()
        # queued, not waited for: the start job lasts until the unit's ExecStartPost sees the server ready; the gate
        # watches the unit meanwhile (its ExecStartPre, then the server's process through a pidfd)
        self.sd.start(self.target.unit, no_block=True, past_start_limit=True)

    def run_gate(self) -> None:
        # the boot-time enablement (symlinks only) is flipped while the target starts; a rollback, or a recover
        # after a crash, flips it back; a failure to flip it fails the commit, after the gate
        self.enabling = True
        try:
            self.sw.set_enabled(self.target)
        except DeployError as exc:
            self.enable_error = exc
        self.gate = run_gate(self.cfg, self.sd, self.target, invocation=None, since=self.since, on_event=self.log)
        self.sw.perf_gate(self.target, self.st.release)
        self._release()  # the held requests go to the target, which passed its gate

    def commit(self) -> None:
        if self.enable_error is not None:
            raise self.enable_error
        self.sw.commit_state(self.st, self.target, self.cur_name)

    def _adopt_failed(self, exc: DeployError) -> SwitchResult:
        target = self.target
        reason = exc.message.splitlines()[0]
        self.log(f"{target.name} failed its gate: {reason}; left running as it was found, not recorded active")
        self.store.save(replace(self.st, operation=None))
        self.record(ok=False, from_backend=None, to_backend=target.name, outcome="failed", reason=reason)
        raise HealthError(f"{target.name} runs but did not pass the gate: {exc.message}\n  it was left running as it "
                          "was found, and is not recorded active", hint=exc.hint or f"read `journalctl -u "
                          f"{target.unit}`; `deploytool switch {target.name}` again restarts nothing, a switch to "
                          "another backend stops it")

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
        through the same gate (exit 10), or none when none served (exit 9); exit 11 when it does not come back.
        An adopted target (it ran before this switch) is left running as it was found, unrecorded (exit 9)."""
        if self.facts.adopt:
            return self._adopt_failed(exc)
        target, cur, st = self.target, self.cur, self.st
        restore_enablement = self.enabling
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
        exc2 = self.sw.restore(st, cur, enable=restore_enablement)
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
