"""verify (the units' ExecStartPre) and pin: compare and re-pin a backend's fingerprints.

Imports stay lazy: `verify` runs before every start, so this path loads no jinja2 and no cryptography.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import click

from deploy_tool.cli.context import Ctx, pass_ctx
from deploy_tool.cli.names import BACKEND, SECONDS
from deploy_tool.errors import DeployError, ExitCode
from deploy_tool.textsafe import safe

if TYPE_CHECKING:  # the report's type only: verify's path imports fingerprint when it runs
    from deploy_tool.box.fingerprint import VerifyReport


def _json(data: object) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


@click.command("verify")
@click.argument("backend", type=BACKEND)
@click.option("--no-cache", is_flag=True, help="Hash every file; ignore the (device, inode, size, mtime, ctime) "
                                               "cache in the state dir.")
@click.option("--await-port", is_flag=True,
              help="Then wait until no process of the other backends runs (their GPU memory and the port go with "
                   "them; a switch starts the target while the current one exits), up to 90 s, and fail (exit 9) if "
                   "anything else holds the served port. The units' ExecStartPre uses this.")
@pass_ctx
def verify(ctx: Ctx, backend: str, no_cache: bool, await_port: bool) -> None:
    """Check BACKEND's fingerprints against its pins; exit 7 listing item, expected, actual on any change.

    \b
    The units run this as ExecStartPre, so systemd refuses to start a backend whose environment drifted:
    every file, symlink and directory of the release (type, mode, SHA-256; anything added is drift too), ftllm
    and Python versions, the interpreter's import hooks, unit and env files, NCCL's GPU architecture,
    llama-server binary, build and libraries, model and draft config and weight sizes.
    A deliberate change is re-pinned with `deploytool pin BACKEND --reason TEXT`.
    First, every path a root step reads for BACKEND (units, drop-ins, env files, config, keys, state, the release
    and every directory above them) must be owned by root and not writable by group or other (StrictModes).
    Exit codes: 0 all match, 7 drift, 13 not pinned (or damaged pins), 9 port held (--await-port),
    23 a path is not root's alone (named, with the chmod/chown that fixes it).
    """
    from deploy_tool import strictmodes
    from deploy_tool.box import fingerprint

    fingerprint.check_unit_environment()
    cfg = ctx.load_config()
    b = cfg.backend(backend)
    strictmodes.require(cfg, [b], f"{b.name} may not start")
    report = fingerprint.verify(cfg, b, use_cache=not no_cache, loaded_env=fingerprint.loaded_env_file())

    def port_line() -> str:  # after the report: a terminal shows the verdict before the wait
        from deploy_tool import portwait

        return portwait.await_for_backend(cfg, b)

    _report(ctx, report, fingerprint.drift_error, then=port_line if await_port else None)


def _report(ctx: Ctx, report: VerifyReport, refusal: Callable[[VerifyReport], DeployError],
            then: Callable[[], str] | None = None) -> None:
    """Print a verify report (a table, or --json) and refuse on drift (exit 7): `refusal` makes the error; `then`,
    run only when all matches, adds a line (--json: its "port")."""
    from deploy_tool.box import fingerprint

    if ctx.json:
        _json({**report.to_json(), **({"port": then()} if report.ok and then else {})})
        if not report.ok:
            sys.exit(int(ExitCode.DRIFT))
        return
    text = fingerprint.format_report(report)
    if report.ok:
        click.echo(text)
        if then:
            click.echo(then())
        return
    first, _, rest = text.partition("\n")
    click.echo(click.style(first, fg="red", bold=True))  # styles are dropped when stdout is not a terminal
    click.echo(rest)
    raise refusal(report)


@click.command("verify-front")
@pass_ctx
def verify_front(ctx: Ctx) -> None:
    """Check the front's program against the pinned release; exit 7 naming what changed.

    \b
    The front's unit runs this as ExecStartPre, so systemd refuses to start a front whose program (the release's
    launch/front.py, which sees every client request and its API key) is not the file pinned at install, or whose
    `current` no longer points at the pinned release. Only that is read: a drift elsewhere in the release is the
    backends' own check, and does not close the public port. The pins are the active backend's.
    First, every path a root step reads (units, drop-ins, config, keys, state, the release) must be root's alone
    (StrictModes).
    Exit codes: 0 it matches, 7 drift, 13 no backend pinned, 23 a path is not root's alone.
    """
    from deploy_tool import strictmodes
    from deploy_tool.box import fingerprint

    fingerprint.check_unit_environment()
    cfg = ctx.load_config()
    strictmodes.require(cfg, [], "the front may not start")
    _report(ctx, fingerprint.verify_front(cfg), fingerprint.front_drift_error)


@click.command("pin")
@click.argument("backend", type=BACKEND)
@click.option("--reason", "-r", required=True, help="Why the environment changed on purpose (kept in history).")
@pass_ctx
def pin(ctx: Ctx, backend: str, reason: str) -> None:
    """Re-pin BACKEND's fingerprints to what is installed now, recording who, why and when in history.

    \b
    Use it after a deliberate change (a model file replaced in place, an edited env file); `install` pins on its
    own. It pins what the installed release's units load: a config naming other files takes a bundle packed with it.
    With --dry-run, show what would change and write nothing.
    """
    from deploy_tool.box import fingerprint
    from deploy_tool.box.state import Store

    cfg = ctx.load_config()
    b = cfg.backend(backend)
    previous = None
    try:
        previous = fingerprint.load_pins(cfg, b)
    except DeployError:
        previous = None
    reason = fingerprint.pin_reason(reason, b.name)  # refused before anything is touched, dry run or not
    if ctx.dry_run:
        items = fingerprint.collect(cfg, b, use_cache=False, cache_file=False)
        changes = fingerprint.diff(previous.all_items(), items) if previous else []
        ctx.emit({"would_pin": b.name, "items": [i.to_json() for i in items],
                  "changes": [d.to_json() for d in changes]},
                 _pin_text(b.name, len(items), previous is not None, changes, dry=True))
        return
    store = Store(cfg.paths.state_dir)
    with store.lock(what=f"pin {b.name}"):
        ps = fingerprint.pin(cfg, b, reason, store=store)
    changes = fingerprint.diff(previous.all_items(), ps.all_items()) if previous else []
    ctx.emit({**ps.to_json(), "path": ps.path, "changes": [d.to_json() for d in changes]},
             _pin_text(b.name, ps.count(), previous is not None, changes, dry=False) + f"\nwrote {ps.path}")


def _pin_text(name: str, n: int, had_pins: bool, changes: list, *, dry: bool) -> str:
    from deploy_tool.box.fingerprint import short

    verb = "would pin" if dry else "pinned"
    if not had_pins:
        return f"{verb} {n} fingerprints of {name} (first pin)"
    if not changes:
        return f"{verb} {n} fingerprints of {name}: nothing changed since the last pin"
    lines = [f"{verb} {n} fingerprints of {name}; {len(changes)} changed:"]
    lines += [f"  {safe(d.item.label)}: {short(d.expected)} -> {short(d.actual)}" for d in changes]
    return "\n".join(lines)


@click.command("await-ready")
@click.argument("backend", type=BACKEND)
@click.option("--timeout", type=SECONDS, default=None,
              help="Seconds to wait (default: the backend's start timeout, which the unit's TimeoutStartSec= is "
                   "rendered from).")
@pass_ctx
def await_ready(ctx: Ctx, backend: str, timeout: float | None) -> None:
    """Wait until BACKEND serves the configured model; the units run this as ExecStartPost.

    \b
    So `systemctl start BACKEND` returns, and units ordered After= it start, only once the server answers:
    llama-server's /health, then /v1/models naming the model (with the API key, if one is configured).
    Under systemd ($MAINPID set) it exits at once, non-zero, when the server's process exits first, and a cuda
    backend's server must hold its GPUs (/dev/nvidia<N> of each of host.gpus): one that fell back to the CPU
    fails the start.
    Exit codes: 0 ready, 9 not ready (process exited, timeout, wrong model, refused key), 30 ready without its GPUs.
    """
    from deploy_tool.box.probe import ready
    from deploy_tool.errors import GpuError, HealthError

    cfg = ctx.load_config()
    b = cfg.backend(backend)
    try:
        rep = ready.await_ready(cfg, b, main_pid=ready.main_pid_from_env(), timeout=timeout)
    except (HealthError, GpuError) as exc:
        # "not ready:", not "error:": a switch reads a start's "deploytool[PID]: error:" journal line as the
        # ExecStartPre's refusal; the server's own failure is what the gate reports
        if ctx.json:
            _json(exc.to_json())
        else:
            click.echo(f"not ready: {exc.message}", err=True)
            if exc.hint:
                click.echo(f"hint: {exc.hint}", err=True)
        sys.exit(int(exc.exit_code))
    ctx.emit({"backend": b.name, "ready_s": round(rep.seconds, 3), "attempts": rep.attempts,
              "served_models": list(rep.served_models)},
             f"{b.name} serves {cfg.serve.model_name!r} at {rep.base_url} (ready after {rep.seconds:.1f}s)")


COMMANDS = (verify, pin, await_ready)
