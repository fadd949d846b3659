"""The box's operations, as `deploytool install/switch/rollback/recover/failover` run them: each takes the state
lock, finishes what an interrupted operation left (whatever its kind), then runs its own plan.

This is the one module that knows both install and switch: it hands each the `finish` that recovers either
kind, so neither imports the other (the lock and the finishing are `Store.locked`). With dry_run, each returns
its plan (lock, finishing, then its own steps) instead of acting.

After each operation that ran (whatever its outcome, unless another operation held the lock), the metrics file is
rewritten from what the operation learned (deploy_tool.box.metrics.refresh: best effort, never fails the
operation).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

from deploy_tool.box import failover as failover_mod
from deploy_tool.box import install as install_mod
from deploy_tool.box import journal, metrics, releases
from deploy_tool.box import systemd as systemd_mod
from deploy_tool.box.install import InstallResult
from deploy_tool.box.state import State, Step, Store
from deploy_tool.box.switch import Preflight, Switcher, SwitchResult, planned
from deploy_tool.config import Config
from deploy_tool.errors import (
    DeployError,
    DowngradeError,
    KeyRefused,
    LockedError,
    RolledBack,
    UnsafePathError,
)

R = TypeVar("R")

Log = Callable[[str], None]


def _quiet(msg: str) -> None:
    pass


def finish(cfg: Config, st: State, *, sd: systemd_mod.Systemd, log: Log) -> SwitchResult:
    """Finish the interrupted operation in `st` (the caller holds the lock): an install is undone, a switch or
    rollback committed or rolled back."""
    op = st.operation
    assert op is not None
    if op.kind == "install":
        install_mod.recover_install(cfg, Store(cfg.paths.state_dir), st, sd=sd, log=log)
        return SwitchResult(True, "recovered", None, op.to_backend or "", message="interrupted install undone")
    if op.kind == "uninstall":
        releases.finish_uninstall(cfg, st, sd=sd, log=log)
        return SwitchResult(True, "recovered", None, "", message="interrupted uninstall finished")
    return _switcher(cfg, sd, log).recover_locked(st)


def recover_steps(cfg: Config, st: State, *, sd: systemd_mod.Systemd, log: Log) -> list[Step]:
    """The plan `finish` walks for the interrupted operation in `st`."""
    op = st.operation
    assert op is not None
    if op.kind == "install":
        return install_mod.recover_steps(cfg, st, sd=sd)
    if op.kind == "uninstall":
        return [Step(d["name"], d["what"]) for d in releases.uninstall_plan(cfg, purge=False)
                if d["name"] in releases.UNINSTALL_STEPS[releases.UNINSTALL_STEPS.index(op.step):]]
    return _switcher(cfg, sd, log).recover_steps(st)


def _switcher(cfg: Config, sd: systemd_mod.Systemd, log: Log, preflight: Preflight | None = None) -> Switcher:
    return Switcher(cfg, log=log, sd=sd, finish=lambda st: finish(cfg, st, sd=sd, log=log), preflight=preflight)


def _learned(cfg: Config, res: object) -> metrics.Learned | None:
    """What the operation that ended with `res` (its result or its error) found out for the metrics; None when
    its outcome says nothing of what serves (a refusal, a no-op, an undone install): then a status is collected."""
    if isinstance(res, SwitchResult) and res.action in ("switched", "failed-over"):
        return metrics.Learned(res.to_backend, {res.to_backend: True})  # its preflight verified, its gate passed
    if isinstance(res, InstallResult) and res.ok and res.action == "installed" and res.backend:
        return metrics.Learned(res.backend, {n: True for n in cfg.backends})  # it pinned them all
    if isinstance(res, RolledBack) and isinstance(res.details, dict) and res.details.get("restored"):
        return metrics.Learned(str(res.details["restored"]))  # back through the same gate
    if isinstance(res, DeployError) and Store(cfg.paths.state_dir).load().active_backend is None:
        return metrics.Learned(None)  # it left nothing serving (its rollback failed, or none served before)
    return None


def _then_metrics(cfg: Config, sd: systemd_mod.Systemd | None, dry_run: bool, run: Callable[[], R]) -> R:
    """Run the operation, then rewrite the metrics file (not after a dry run, nor when the lock was refused:
    the holder writes them when it is done)."""
    try:
        res = run()
    except (LockedError, UnsafePathError, DowngradeError, KeyRefused):
        raise  # refused before anything changed: nothing for the metrics either
    except Exception as exc:  # a failed or rolled-back operation changed the box too (a kill or ^C writes nothing)
        # (one that cannot write the state dir, e.g. not run as root, changed nothing: its error is the message)
        if not dry_run and os.access(cfg.paths.state_dir, os.W_OK):
            metrics.refresh(cfg, sd=sd, quiet=True, learned=_learned(cfg, exc))
        raise
    if not dry_run:
        metrics.refresh(cfg, sd=sd, learned=_learned(cfg, res))
    return res


def switch(cfg: Config, backend: str, *, dry_run: bool = False, wait: float = 0.0, reason: str | None = None,
           log: Log = _quiet, sd: systemd_mod.Systemd | None = None, drain_s: float | None = None,
           preflight: Preflight | None = None) -> SwitchResult:
    """`deploytool switch BACKEND`: exit 0 switched (or already active), 10 rolled back, 11 rollback failed.
    `drain_s`: the drain bound (None: supervision.drain_timeout_s; 0: no drain); `preflight`: the target's
    checks (None: deploy_tool.box.switch.run_preflight; a test hands in its own)."""
    with journal.operation(cfg, "switch", f"switch to {backend}" + (f" ({reason})" if reason else ""),
                           backend=_name(cfg, backend), dry_run=dry_run) as ev:
        log = ev.tee(log)
        sd = sd or systemd_mod.for_config(cfg)
        res = _result(ev, _then_metrics(cfg, sd, dry_run, lambda: _switcher(cfg, sd, log, preflight).switch(
            backend, dry_run=dry_run, wait=wait, reason=reason, drain_s=drain_s)))
    if res.ok and res.action == "switched" and not dry_run:
        _prune(cfg, log)
    return res


def _name(cfg: Config, backend: str) -> str:
    """The backend's own name for the journal (an alias or prefix resolved); as given when it names none."""
    try:
        return cfg.backend(backend).name
    except Exception:
        return backend


def _result(ev: journal.Events, res: Any) -> Any:
    """Journal an operation's result (a switch's or an install's) and hand it on."""
    if getattr(res, "action", "") != "planned":
        ev.backend = ev.backend or getattr(res, "to_backend", None) or getattr(res, "backend", None) or None
        ev.result(bool(res.ok), res.message or res.action)
    return res


def _prune(cfg: Config, log: Log) -> None:
    """After a committed switch: supervision.keep_releases (a busy lock: the next operation prunes)."""
    store = Store(cfg.paths.state_dir)
    with contextlib.suppress(LockedError), store.lock(wait=5, what="releases prune"):
        if store.load().operation is None:
            releases.auto_prune(cfg, store, log)


def rollback(cfg: Config, *, dry_run: bool = False, wait: float = 0.0, log: Log = _quiet,
             sd: systemd_mod.Systemd | None = None, drain_s: float | None = None,
             preflight: Preflight | None = None) -> SwitchResult:
    """`deploytool rollback`: switch back to the previous backend through the same gate (drained as a switch)."""
    with journal.operation(cfg, "rollback", "rollback to the previous backend", dry_run=dry_run) as ev:
        log = ev.tee(log)
        sd = sd or systemd_mod.for_config(cfg)
        return _result(ev, _then_metrics(cfg, sd, dry_run, lambda: _switcher(cfg, sd, log, preflight).rollback(
            dry_run=dry_run, wait=wait, drain_s=drain_s)))


def recover(cfg: Config, *, dry_run: bool = False, wait: float = 0.0, log: Log = _quiet,
            sd: systemd_mod.Systemd | None = None) -> SwitchResult:
    """`deploytool recover`: finish an interrupted install, switch or rollback to a consistent end."""
    sd = sd or systemd_mod.for_config(cfg)
    store = Store(cfg.paths.state_dir)
    if dry_run:
        st = store.load()
        if st.operation is None:
            return planned(st, st.active_backend or "", [Step("noop", "nothing to recover")])
        steps = store.lock_steps(replace(st, operation=None)) + recover_steps(cfg, st, sd=sd, log=log)
        return planned(st, st.operation.to_backend or "", steps)
    with journal.operation(cfg, "recover", "recover an interrupted operation") as ev:
        log = ev.tee(log)  # its `finish` knows every kind
        return _result(ev, _then_metrics(cfg, sd, dry_run, lambda: _switcher(cfg, sd, log).recover(wait=wait)))


def failover(cfg: Config, from_backend: str, *, dry_run: bool = False, invocation: str | None = None,
             log: Log = _quiet, sd: systemd_mod.Systemd | None = None,
             preflight: Preflight | None = None) -> SwitchResult:
    """`deploytool failover --from BACKEND` (the failover unit runs it): exit 0 failed over or skipped, 9 the
    fallback failed too (both stay stopped)."""
    cfg = failover_mod.as_seen_from_here(cfg)
    with journal.operation(cfg, "failover", f"failover from {from_backend}", backend=_name(cfg, from_backend),
                           dry_run=dry_run) as ev:
        log = ev.tee(log)
        sd = sd or systemd_mod.for_config(cfg)
        # failovers and what serves now reach the metrics at once
        return _result(ev, _then_metrics(cfg, sd, dry_run, lambda: failover_mod.failover(
            cfg, from_backend, dry_run=dry_run, invocation=invocation, log=log, sd=sd, preflight=preflight,
            finish=lambda st: finish(cfg, st, sd=sd, log=log))))


def install(cfg: Config, bundle: str | None, *, keys_dir: str | None = None, rebuild: bool = False,
            dry_run: bool = False, start: bool = True, log: Log = _quiet, progress: Any = None,
            wait: float = 0.0, sd: systemd_mod.Systemd | None = None,
            allow_downgrade: str | None = None) -> InstallResult:
    """`deploytool install [BUNDLE]`: set up the box from a signed bundle, all or nothing."""
    if dry_run:
        return install_mod.install(cfg, bundle, keys_dir=keys_dir, rebuild=rebuild, dry_run=True, start=start)
    with journal.operation(cfg, "install", f"install {bundle or 'the bundle in artifacts/'}") as ev:
        log = ev.tee(log)
        sd = sd or systemd_mod.for_config(cfg)
        return _result(ev, _then_metrics(cfg, sd, dry_run, lambda: install_mod.install(
            cfg, bundle, keys_dir=keys_dir, rebuild=rebuild, start=start, log=log, progress=progress, sd=sd,
            wait=wait, finish=lambda st: finish(cfg, st, sd=sd, log=log), allow_downgrade=allow_downgrade)))
