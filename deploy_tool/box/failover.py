"""Failover: when the active backend has failed for good, switch on our own to the last backend that passed the
health gate, through that same gate, at most once per window.

systemd starts `deploytool-failover@BACKEND.service` (the backend units' OnFailure=) when a backend unit enters
the failed state: with Restart=on-failure that is once its restarts gave up (StartLimitBurst= starts within
StartLimitIntervalSec=), never for a crash it restarts from. It runs `deploytool failover --from BACKEND`:

    lock (without waiting: a switch, rollback or install in progress handles its own target; skipped)
    -> guard (each a reason to leave things as they are, recorded):
         the backend is the one state.json names active, its unit is failed (not running again, not merely
         stopped), the failed run did not end in a stop job (an operator's `systemctl stop`, or a Conflicts= stop:
         a stop is deliberate even when the server exits non-zero or is SIGKILLed at TimeoutStopSec=), no failover
         ran within supervision.failover.window_s, and there is a fallback: the state's previous backend, whose
         last health gate on this box passed
    -> the failed run's journal tail kept
    -> the switch's own steps, the failed unit as nothing to stop or roll back to: intent, preflight of the
       fallback, start it, health gate, commit
    on failure: the fallback stopped, both stay stopped, the failed backend enabled for boot again, state and
    `status` say "nothing serving: X failed, failover to Y failed at T", exit 9 (the preflight's own code when
    it refused the fallback).

Every run writes one history event "failover" (result ok, failed or skipped; from_backend, to_backend, reason,
journal_tail: the failed backend's last lines); state.json keeps the last attempt (ok or failed) under
extra.failover, which the window is counted from.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from deploy_tool.box import systemd as systemd_mod
from deploy_tool.box.state import State, Step, Store
from deploy_tool.box.switch import (
    Preflight,
    Switcher,
    SwitchFacts,
    SwitchResult,
    SwitchRun,
    planned,
    switch_plan,
)
from deploy_tool.clock import iso_utc
from deploy_tool.config import Backend, Config
from deploy_tool.errors import DeployError, HealthError, LockedError

Log = Callable[[str], None]
wall: Callable[[], float] = time.time  # the clock the window is counted on (epoch seconds, across processes)
EVENT = "failover"  # the history event (a metric counts them)
JOURNAL_LINES = 40
# the manager's message when a stop job starts on the unit ("Stopping ftllm inference server..."); a crash that
# systemd restarts from, or gives up on, logs "Stopped ..." (a restart job) and "Failed to start ...", never this
_STOP_JOB = re.compile(r" systemd\[1\]: Stopping .*\.\.\.$")
# the outcomes with which a switch, rollback or recover says its target did not pass the gate
_GATE_FAILED = ("rolled-back", "failed", "rollback-failed", "refused")


def _quiet(msg: str) -> None:
    pass


@dataclass(frozen=True)
class Failure:
    """What systemd says about the backend that failed."""

    backend: str
    unit: str
    active_state: str  # failed, unless it was restarted or stopped meanwhile
    result: str  # systemd's Result= (exit-code, signal, core-dump, timeout, start-limit-hit, ...)
    stop_job: bool  # its failed run ended in a stop job (someone stopped it): not a crash
    journal: str  # that run's last lines


def stopped_by_a_job(journal: str) -> bool:
    """True when the run's journal holds the manager's "Stopping ..." message of a stop job (see _STOP_JOB)."""
    return any(_STOP_JOB.search(ln) for ln in journal.splitlines())


def last_gate_passed(history: list[dict[str, Any]], name: str) -> bool | None:
    """Whether `name`'s most recent health gate on this box passed (None: no gate of it is recorded)."""
    for e in reversed(history):
        ev, ok, outcome = e.get("event"), e.get("ok"), e.get("outcome")
        if ev == "install" and e.get("backend") == name and ok is not None:
            return bool(ok)
        if ev in ("switch", "rollback", EVENT, "recover"):
            if e.get("result") == "skipped" or outcome == "refused":
                continue  # no gate ran: a failover that did not start, a preflight that refused (nothing changed)
            if e.get("to_backend") == name and outcome not in ("rolled-back", "rollback-failed", "stopped"):
                return bool(ok)
            if e.get("to_backend") == name and outcome in _GATE_FAILED:
                return False
            if e.get("from_backend") == name and ev != EVENT and outcome == "rolled-back":
                return True  # restored through the gate after the switch away from it failed
            if e.get("from_backend") == name and ev != EVENT and outcome == "rollback-failed":
                return False
    return None


def decide(cfg: Config, st: State, f: Failure, history: list[dict[str, Any]], *,
           now: float) -> tuple[Backend | None, str]:
    """The fallback to fail over to, or None and why not (the guard; pure)."""
    fo = cfg.supervision.failover
    if not fo.enabled:
        return None, "failover is off (supervision.failover.enabled: false)"
    if st.active_backend != f.backend:
        return None, f"{f.backend} is not the active backend ({st.active_backend or 'none'} is)"
    if f.active_state in ("active", "activating", "reloading"):
        return None, f"{f.unit} is {f.active_state} again"
    if f.active_state != "failed":
        return None, f"{f.unit} is {f.active_state or 'unknown'}, not failed: it was stopped, not lost"
    if f.stop_job:
        return None, (f"{f.unit} failed while being stopped ({f.result}): a deliberate stop (an operator's, or "
                      f"another unit's Conflicts=) is not a failure")
    last = st.extra.get("failover")
    if isinstance(last, Mapping) and fo.window_s > 0:
        since = now - float(last.get("epoch") or 0)
        if 0 <= since < fo.window_s:
            return None, (f"a failover already ran {since:.0f} s ago ({last.get('from')} -> {last.get('to')}, "
                          f"{last.get('result')} at {last.get('at')}); at most one per {fo.window_s:g} s "
                          f"(supervision.failover.window_s)")
    fb = st.previous_backend
    if not fb or fb == f.backend or fb not in cfg.backends:
        return None, "no fallback: no other backend has passed the health gate on this box"
    if last_gate_passed(history, fb) is False:
        return None, f"no fallback: {fb}'s last health gate on this box failed"
    return cfg.backends[fb], ""


def look(cfg: Config, sd: systemd_mod.Systemd, b: Backend, *, invocation: str | None = None) -> Failure:
    """What systemd says about `b`'s unit now, with its failed run's journal (`invocation`: the run that failed,
    as systemd hands it to the OnFailure= unit; default: the latest)."""
    us = sd.show(b.unit)
    inv = invocation or us.invocation_id or None
    try:
        journal = sd.journal(b.unit, invocation=inv, lines=200)
    except DeployError:
        journal = ""
    return Failure(b.name, b.unit, us.active_state, us.result, stopped_by_a_job(journal),
                   "\n".join(journal.splitlines()[-JOURNAL_LINES:]))


def failover_steps(cfg: Config, st: State, f: Failure, fallback: Backend | None, why: str,
                   run: SwitchRun | None = None) -> list[Step]:
    """The plan after the lock: the guard's verdict, then the switch's own steps (or the skip), those bound to
    `run` when it is given (the guard and the journal are done before: `_failover_locked`)."""
    state = str(Store(cfg.paths.state_dir).state_path)
    guard = Step("guard", f"check {f.unit} failed for good (the active backend, failed, no stop job, no failover "
                          f"within {cfg.supervision.failover.window_s:g} s) and pick the last backend that passed "
                          f"the health gate")
    if fallback is None:
        return [guard, Step("skip", f"record the failover as skipped, change nothing: {why}", (state,))]
    facts = SwitchFacts(cur=None, overlap=False, noop=False)
    steps = switch_plan(cfg, st, fallback, facts, action=EVENT, run=run)
    assert steps[-1].name == "rolling-back"
    steps[-1] = Step("rolling-back", f"stop {fallback.unit}, leave both stopped ({f.backend} enabled for boot "
                                     f"again), state and status say nothing is serving, exit 9",
                     (fallback.unit, f.unit, state), when="on failure")
    return [guard, Step("journal-kept", f"keep {f.unit}'s last {JOURNAL_LINES} journal lines for history")] + steps


def as_seen_from_here(cfg: Config) -> Config:
    """`cfg` for this process: run by a unit of the sandbox the config targets (the failover unit is one), that
    sandbox's systemd is this process's own (plain systemctl and journalctl, its PIDs as this process sees them)."""
    sandbox = cfg.systemd.sandbox
    if not sandbox:
        return cfg
    try:  # the sandbox's unit dir is bind-mounted over /etc/systemd/system inside it
        a, b = os.stat("/etc/systemd/system"), os.stat(cfg.paths.unit_dir)
    except OSError:
        return cfg
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
        return cfg
    return replace(cfg, systemd=replace(cfg.systemd, sandbox=None))


def failover(cfg: Config, from_backend: str, *, dry_run: bool = False, invocation: str | None = None,
             log: Log = _quiet, sd: systemd_mod.Systemd | None = None,
             finish: Callable[[State], object] | None = None, preflight: Preflight | None = None) -> SwitchResult:
    """`deploytool failover --from BACKEND`: exit 0 failed over or skipped (recorded), 9 the fallback failed too.
    (`cfg` as_seen_from_here, `sd` and `finish` made of it: see deploy_tool.box.operations.)"""
    b = cfg.backend(from_backend.removesuffix(".service"))
    sd = sd or systemd_mod.for_config(cfg)
    store = Store(cfg.paths.state_dir)
    sw = Switcher(cfg, log=log, sd=sd, finish=finish, preflight=preflight)
    if dry_run:
        st = store.load()
        f = look(cfg, sd, b, invocation=invocation)
        fallback, why = decide(cfg, st, f, store.history(), now=wall())
        steps = store.lock_steps(st) + failover_steps(cfg, st, f, fallback, why)
        return planned(st, fallback.name if fallback else "", steps)
    try:
        with store.locked(what=f"failover from {b.name}", wait=0.0, finish=sw.finish, log=log) as st:
            return _failover_locked(sw, st, b, invocation=invocation)
    except LockedError as exc:
        holder = exc.details.get("holder") if isinstance(exc.details, dict) else None
        what = (holder or {}).get("operation") or "another operation"
        why = f"{what} is in progress (it handles its own target)"
        store.record(EVENT, result="skipped", from_backend=b.name, to_backend=None, reason=why)
        log(f"no failover: {why}")
        return SwitchResult(True, "skipped", b.name, "", message=f"no failover from {b.name}: {why}")


def _failover_locked(sw: Switcher, st: State, b: Backend, *, invocation: str | None) -> SwitchResult:
    cfg, sd, store, log = sw.cfg, sw.sd, sw.store, sw.log
    t0 = wall()
    f = look(cfg, sd, b, invocation=invocation)
    fallback, why = decide(cfg, st, f, store.history(), now=t0)
    if fallback is None:
        store.record(EVENT, result="skipped", from_backend=b.name, to_backend=st.previous_backend, reason=why,
                     unit_state=f.active_state, unit_result=f.result)
        log(f"no failover: {why}")
        return SwitchResult(True, "skipped", b.name, "", message=f"no failover from {b.name}: {why}")
    reason = f"failover: {f.unit} failed for good ({f.result or 'unknown'})"
    log(f"{reason}; failing over to {fallback.name}")
    fo = _Failover(f, {"at": iso_utc(micro=True), "epoch": t0, "from": b.name, "to": fallback.name}, reason)
    run = SwitchRun(sw, st, fallback, SwitchFacts(cur=None, overlap=False, noop=False), action=EVENT, reason=reason,
                    record=fo.record, roll_back=fo.roll_back)
    steps = [s for s in failover_steps(cfg, st, f, fallback, "", run) if s.name not in ("guard", "journal-kept")]
    return fo.run(run, steps)


class _Failover:
    """What makes a switch run to the fallback a failover: the failed backend is nothing to stop or return to,
    so on failure both stay stopped; it writes the one "failover" event and state's extra.failover. Its
    `record` and `roll_back` are the run's (SwitchRun's hooks); `run` walks the plan and settles the state."""

    def __init__(self, failure: Failure, attempt: dict[str, Any], reason: str) -> None:
        self.failure, self.attempt, self.reason = failure, attempt, reason
        self.rolled = False  # the fallback was started and failed (roll_back ran)

    def record(self, run: SwitchRun, **fields: Any) -> None:
        ok = bool(fields.get("ok"))
        why = fields.get("reason") if not ok and fields.get("reason") != self.reason else None
        run.store.record(EVENT, ok=ok, result="ok" if ok else "failed", from_backend=self.failure.backend,
                         to_backend=run.target.name, outcome=fields.get("outcome"), reason=self.reason,
                         unit_result=self.failure.result, journal_tail=self.failure.journal[-4000:],
                         **({"error": why} if why else {}),
                         **({"fallback_journal_tail": fields["journal_tail"]} if fields.get("journal_tail") else {}),
                         **{k: fields[k] for k in ("seconds", "ready_s", "release") if k in fields},
                         **run.clients())

    def run(self, run: SwitchRun, steps: list[Step]) -> SwitchResult:
        try:
            res = run.run(steps)
        except DeployError as exc:
            self._settle(run.store, ok=False, error=exc.message.splitlines()[0])
            if self.rolled:  # roll_back's own error says it all
                raise
            raise type(exc)(f"failover from {self.failure.backend} to {run.target.name} refused: {exc.message}; "
                            f"nothing is serving: both stay stopped", hint=exc.hint, details=exc.details) from None
        self._settle(run.store, ok=True)
        res.action = "failed-over"
        res.message = (f"{self.failure.unit} failed ({self.failure.result}); failed over to {run.target.name}, "
                       f"which serves {run.cfg.serve.model_name!r} on port {run.cfg.serve.port} "
                       f"({res.seconds:.1f}s)")
        return res

    def _settle(self, store: Store, *, ok: bool, error: str = "") -> None:
        """state.json: the attempt (the window counts from it); after a failure, nothing recorded active."""
        st = store.load()
        entry = {**self.attempt, "result": "ok" if ok else "failed", **({"error": error} if error else {})}
        upd: dict[str, Any] = {"extra": {**st.extra, "failover": entry}, "operation": None}
        if not ok:
            upd["active_backend"] = None
        store.save(replace(st, **upd))

    def roll_back(self, run: SwitchRun, exc: DeployError) -> SwitchResult:
        """The fallback failed after it was started: its journal tail kept, it is stopped; nothing is started
        instead (the failed backend had failed for good) and it is enabled for boot again."""
        self.rolled = True
        target, f, sd = run.target, self.failure, run.sd
        reason = exc.message.splitlines()[0]
        inv = None
        with contextlib.suppress(DeployError):
            inv = sd.show(target.unit).invocation_id or None
        try:
            journal = sd.journal(target.unit, invocation=inv, lines=30, since=run.since if inv else None)
        except DeployError:
            journal = ""
        run.log(f"{target.name} failed too: {reason}; leaving both stopped")
        run.st = run.store.advance(run.st, "rolling-back")
        with contextlib.suppress(DeployError):
            sd.stop(target.unit)
            sd.reset_failed(target.unit)
        if run.enabling:  # the gate flipped the boot-time enablement: what served boots again
            with contextlib.suppress(DeployError):
                sd.enable(f.unit, reload=False)
                sd.disable(target.unit, reload=False)
        run.record(ok=False, outcome="failed", reason=reason, journal_tail=journal[-4000:])
        tail = "\n  ".join(journal.splitlines()[-8:])
        raise HealthError(f"failover from {f.backend} to {target.name} failed: {exc.message}\nnothing is serving: "
                          f"{f.backend} failed ({f.result}) and {target.name} did not pass the health gate; both "
                          f"stay stopped" + (f"\n  {target.name} journal tail:\n  {tail}" if tail else ""),
                          hint=f"see `deploytool status`, `deploytool history`, `journalctl -u {f.unit}` and "
                               f"`journalctl -u {target.unit}`; then `deploytool switch BACKEND`",
                          details={"reason": reason, "from": f.backend, "to": target.name})

