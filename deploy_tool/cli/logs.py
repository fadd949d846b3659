"""logs: the journal of the active (or a named) backend's unit, with deploytool's own events interleaved.

deploytool journals every operation's start, steps and result under SYSLOG_IDENTIFIER=deploytool
(deploy_tool.box.journal); `logs` asks journalctl for the unit's lines, systemd's lines about the unit, and those
events, in one time-ordered stream, from the box's journal (a sandbox's when the config names one).
"""

from __future__ import annotations

import shlex
import subprocess

import click

from deploy_tool.cli.context import Ctx, pass_ctx
from deploy_tool.cli.names import BACKEND


def journal_matches(unit: str, *, events: bool = True) -> list[str]:
    """journalctl matches (ORed with '+'): what the unit's processes wrote, what systemd wrote about the unit,
    and deploytool's own events."""
    out = [f"_SYSTEMD_UNIT={unit}", "+", f"UNIT={unit}", "_PID=1"]
    if events:
        from deploy_tool.box.journal import IDENTIFIER

        out += ["+", f"SYSLOG_IDENTIFIER={IDENTIFIER}"]
    return out


@click.command("logs")
@click.argument("backend", required=False, type=BACKEND)
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines as they come (until ^C).")
@click.option("--limit", "--lines", "-l", "lines", type=click.IntRange(0, 1_000_000), default=50, show_default=True,
              metavar="N", help="How many of the last lines to show (0: all).")
@click.option("--since", default=None, metavar="TIME",
              help="Only lines since TIME (as journalctl reads it: '1 hour ago', '2026-01-31 10:00', 'today').")
@click.option("--no-events", is_flag=True, help="The unit's lines only, without deploytool's own events.")
@pass_ctx
def logs(ctx: Ctx, backend: str | None, follow: bool, lines: int, since: str | None, no_events: bool) -> None:
    """The journal of the active backend's unit (or BACKEND's), with deploytool's own events.

    \b
    Every install, switch, rollback, recover, failover and uninstall writes its start, steps and result to the
    journal under the identifier `deploytool` (`journalctl -t deploytool` shows them alone). With --json, one
    object per line as journalctl -o json writes it. --dry-run prints the journalctl command.
    """
    cfg = ctx.load_config()
    if backend is not None:
        name = cfg.backend(backend).name  # the name first: an unknown one fails before systemd is asked
    else:
        from deploy_tool.box.state import Store

        name = Store(cfg.paths.state_dir).load().active_backend or cfg.default_backend
    unit = cfg.backends[name].unit
    args = ["--no-pager", "-o", "json" if ctx.json else "short-iso"]
    if lines:
        args += ["-n", str(lines)]
    elif not follow:
        args += ["--no-tail"]
    if since:
        args += ["--since", since]
    if follow:
        args += ["-f"]
    args += journal_matches(unit, events=not no_events)
    from deploy_tool.box import systemd as systemd_mod

    if ctx.dry_run:
        prefix = list(cfg.systemd.journalctl) if not cfg.systemd.sandbox else ["journalctl"]
        cmd = shlex.join([*prefix, *args])
        ctx.emit({"backend": name, "unit": unit, "would_run": [*prefix, *args]}, f"would run: {cmd}")
        return
    sd = systemd_mod.for_config(cfg)
    from deploy_tool import proc

    if not ctx.json and not follow:
        click.echo(click.style(f"-- {unit} ({name}) and deploytool's events", bold=True), err=True)
    # read through a pipe and echoed line by line as it comes (--follow too): what click prints goes where
    # click's output goes, and journalctl's error lines to stderr as they are
    # (journalctl's error lines, a few at most, are read once it ends: one about --since is a usage error)
    p = proc.spawn([*sd.journalctl, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, new_session=False)
    assert p.stdout is not None and p.stderr is not None
    try:
        for line in iter(p.stdout.readline, b""):
            click.echo(line.decode("utf-8", "replace"), nl=False)
        rc = p.wait()
    except KeyboardInterrupt:  # ^C ends a --follow: that is how one stops it
        p.terminate()
        p.wait()
        rc = 0
    finally:
        p.stdout.close()
        err = p.stderr.read().decode("utf-8", "replace")
        p.stderr.close()
    if since and rc != 0 and "timestamp" in err.lower():
        raise click.BadParameter(f"{since!r} is not a time journalctl reads ({err.strip().splitlines()[-1]}); "
                                 "e.g. '1 hour ago', '2026-01-31 10:00', 'today'", param_hint="'--since'")
    if err:
        click.echo(err, err=True, nl=False)
    if rc != 0:
        from deploy_tool.errors import SystemdError

        raise SystemdError(f"journalctl exited {rc} reading the journal of {unit}",
                           hint="see the line journalctl printed above; is journald running on the box?")
