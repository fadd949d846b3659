"""The box's operations, as `deploytool install/switch/rollback/recover` run them: each takes the state lock,
finishes what an interrupted operation left (whatever its kind), then runs its own plan.

This is the one module that knows both install and switch: it hands each the `finish` that recovers either
kind, so neither imports the other (the lock and the finishing are `Store.locked`). With dry_run, each returns
its plan (lock, finishing, then its own steps) instead of acting.

Imports: install (the bundle, archive and venv machinery: ~55 ms on top of what a switch loads) is imported
only for an install or to undo an interrupted one, so that a switch does not pay for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from deploy_tool.box import systemd as systemd_mod
from deploy_tool.box.state import State, Step, Store
from deploy_tool.box.switch import Switcher, SwitchResult, planned
from deploy_tool.config import Config

if TYPE_CHECKING:
    from deploy_tool.box.install import InstallResult

Log = Callable[[str], None]


def _quiet(msg: str) -> None:
    pass


def finish(cfg: Config, st: State, *, sd: systemd_mod.Systemd, log: Log) -> SwitchResult:
    """Finish the interrupted operation in `st` (the caller holds the lock): an install is undone, a switch or
    rollback committed or rolled back."""
    op = st.operation
    assert op is not None
    if op.kind == "install":
        from deploy_tool.box import install  # lazy: see the module's docstring

        install.recover_install(cfg, Store(cfg.paths.state_dir), st, sd=sd, log=log)
        return SwitchResult(True, "recovered", None, op.to_backend or "", message="interrupted install undone")
    return _switcher(cfg, sd, log).recover_locked(st)


def recover_steps(cfg: Config, st: State, *, sd: systemd_mod.Systemd, log: Log) -> list[Step]:
    """The plan `finish` walks for the interrupted operation in `st`."""
    op = st.operation
    assert op is not None
    if op.kind == "install":
        from deploy_tool.box import install  # lazy: see the module's docstring

        return install.recover_steps(cfg, st, sd=sd)
    return _switcher(cfg, sd, log).recover_steps(st)


def _switcher(cfg: Config, sd: systemd_mod.Systemd, log: Log) -> Switcher:
    return Switcher(cfg, log=log, sd=sd, finish=lambda st: finish(cfg, st, sd=sd, log=log))


def switch(cfg: Config, backend: str, *, dry_run: bool = False, wait: float = 0.0, reason: str | None = None,
           log: Log = _quiet, sd: systemd_mod.Systemd | None = None, drain_s: float | None = None) -> SwitchResult:
    """`deploytool switch BACKEND`: exit 0 switched (or already active), 10 rolled back, 11 rollback failed.
    `drain_s`: the drain bound (None: supervision.drain_timeout_s; 0: no drain)."""
    return _switcher(cfg, sd or systemd_mod.for_config(cfg), log).switch(backend, dry_run=dry_run, wait=wait,
                                                                       reason=reason, drain_s=drain_s)


def rollback(cfg: Config, *, dry_run: bool = False, wait: float = 0.0, log: Log = _quiet,
             sd: systemd_mod.Systemd | None = None, drain_s: float | None = None) -> SwitchResult:
    """`deploytool rollback`: switch back to the previous backend through the same gate (drained as a switch)."""
    return _switcher(cfg, sd or systemd_mod.for_config(cfg), log).rollback(dry_run=dry_run, wait=wait,
                                                                         drain_s=drain_s)


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
    return _switcher(cfg, sd, log).recover(wait=wait)  # its `finish` knows every kind


def install(cfg: Config, bundle: str | None, *, keys_dir: str | None = None, rebuild: bool = False,
            dry_run: bool = False, start: bool = True, log: Log = _quiet, progress: Any = None,
            wait: float = 0.0, sd: systemd_mod.Systemd | None = None) -> InstallResult:
    """`deploytool install [BUNDLE]`: set up the box from a signed bundle, all or nothing."""
    from deploy_tool.box import install as install_mod  # lazy: see the module's docstring

    if dry_run:
        return install_mod.install(cfg, bundle, keys_dir=keys_dir, rebuild=rebuild, dry_run=True, start=start)
    sd = sd or systemd_mod.for_config(cfg)
    return install_mod.install(cfg, bundle, keys_dir=keys_dir, rebuild=rebuild, start=start, log=log,
                               progress=progress, sd=sd, wait=wait,
                               finish=lambda st: finish(cfg, st, sd=sd, log=log))
