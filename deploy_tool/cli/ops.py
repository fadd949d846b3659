"""lock, pack, install, switch, rollback, recover, failover, status, history, rebuild.

Imports: each command imports what it runs inside its function, so that every command's start pays only for its
own modules (the CLI loads all commands to parse one). install, switch, rollback and recover run through
deploy_tool.box.operations, which takes the lock and finishes an interrupted operation first.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from deploy_tool.cli.context import Ctx, pass_ctx
from deploy_tool.cli.names import BACKEND, SECONDS


def _log(ctx: Ctx):
    def log(msg: str) -> None:
        if not ctx.json:
            click.echo(f"  {msg}", err=True)

    return log


def _progress(ctx: Ctx):
    from deploy_tool import progress

    return progress.make_progress(enabled=not ctx.json)


@click.command()
@pass_ctx
def lock(ctx: Ctx) -> None:
    """Download the wheels of bundle.requirements and write the hash-pinned lock (needs the package index)."""
    from deploy_tool.builder import pack

    cfg = ctx.load_config()
    if ctx.dry_run:
        pack.requirements_input(cfg)  # refused as the run would
        ctx.emit({"would_lock": cfg.bundle.requirements}, f"would lock {cfg.bundle.requirements} into "
                 f"{cfg.bundle.lock} with wheels in {cfg.bundle.wheels_dir}")
        return
    path, entries = pack.lock(cfg)
    ctx.emit({"lock": str(path), "packages": [e.__dict__ for e in entries]},
             f"wrote {path}: {len(entries)} packages, wheels in {cfg.bundle.wheels_dir}")


@click.command()
@click.option("--key", "key_path", type=click.Path(path_type=Path), default=None,
              help="Ed25519 private key (default: keys/deploytool.key beside the config).")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None,
              help="Where the bundle goes (default: artifacts/ beside the config).")
@click.option("--sequence", type=click.IntRange(0, (1 << 53) - 1), default=None, metavar="N",
              help="The bundle's sequence, signed: a box refuses a bundle of this name with a lower one than it "
                   "installed (default: bundle.sequence, else SOURCE_DATE_EPOCH, else 0).")
@pass_ctx
def pack(ctx: Ctx, key_path: Path | None, out_dir: Path | None, sequence: int | None) -> None:
    """Build a signed, reproducible, offline bundle: wheels, the venv's archives, template, NCCL, units, config."""
    from deploy_tool.builder import pack as pack_mod
    from deploy_tool.errors import InputError

    cfg = ctx.load_config()
    key = key_path or cfg.base_dir / "keys" / "deploytool.key"
    out = out_dir or cfg.base_dir / "artifacts"
    if not key.is_file():
        raise InputError(f"signing key not found: {key}",
                         hint=f"create one with `deploytool keygen --out {key.parent}`, or pass --key")
    seq = pack_mod.sequence_of(cfg, sequence)
    if ctx.dry_run:
        entries = pack_mod.read_lock(Path(cfg.bundle.lock))  # refused as the run would: no lock, no pack
        ctx.emit({"would_pack_into": str(out), "sequence": seq, "packages": len(entries)},
                 f"would pack {cfg.bundle.name} (sequence {seq}) into {out} signed with {key}")
        return
    info = pack_mod.pack(cfg, out_dir=out, key_path=key, progress=_progress(ctx), log=_log(ctx), sequence=seq)
    data = info.to_json() if hasattr(info, "to_json") else dict(info.__dict__)
    ctx.emit(data, f"bundle {data.get('bundle_id')}:\n  directory {data.get('directory')}\n"
                   f"  archive   {data.get('archive')}")


@click.command()
@click.argument("bundle", required=False)
@click.option("--keys", "keys_dir", default=None, help="Trusted public keys (default: paths.keys_dir).")
@click.option("--rebuild", is_flag=True, help="Rebuild the venv from the wheels instead of unpacking the archive.")
@click.option("--no-start", is_flag=True, help="Lay everything down but start nothing.")
@click.option("--wait", type=SECONDS, default=0.0, help="Wait this long for another operation's lock.")
@click.option("--allow-downgrade", is_flag=True,
              help="Install a bundle whose sequence is lower than the highest of its name this box installed "
                   "(refused otherwise, exit 24); needs --reason.")
@click.option("--reason", default=None, help="Why the downgrade is wanted (kept in history); with --allow-downgrade.")
@pass_ctx
def install(ctx: Ctx, bundle: str | None, keys_dir: str | None, rebuild: bool, no_start: bool, wait: float,
            allow_downgrade: bool, reason: str | None) -> None:
    """Set up this box from a bundle, offline, and start the default backend behind the health gate.

    With no BUNDLE, the single bundle in artifacts/ is used (several is an error listing them).
    Installing the same bundle again is a no-op that says so. A bundle signed by a revoked or expired key is
    refused (exit 25); one older than the newest of its name this box installed (its signed sequence is lower)
    is refused (exit 24) unless --allow-downgrade --reason TEXT; a release still laid down on the box is not a
    downgrade. A path the root steps read that is not root's alone is refused first (exit 23).

    \b
    For example: deploytool install ~/deploy/cpu-demo-0123abcd   (a bundle directory, or its .tar.zst)
    Exit 0 installed (or already), 5 no such bundle, 6 bundle refused (tampered, unsigned, another config),
    12 locked, 14 install failed (its health gate included: the previous release serves again), 17 disk full and
    the like, 23 unsafe path, 24 downgrade, 25 key refused.
    """
    from deploy_tool.box import operations

    why = (reason or "").strip()
    if allow_downgrade and not why:
        raise click.UsageError("--allow-downgrade needs --reason TEXT (kept in history): why the older bundle")
    if why and not allow_downgrade:
        raise click.UsageError("--reason goes with --allow-downgrade; an install needs no reason otherwise")
    cfg = ctx.load_config()
    res = operations.install(cfg, bundle, keys_dir=keys_dir, rebuild=rebuild, dry_run=ctx.dry_run,
                             start=not no_start, log=_log(ctx), progress=_progress(ctx), wait=wait,
                             allow_downgrade=why or None)
    if res.action == "planned":
        ctx.emit(res.to_json(), "would:\n" + "\n".join(f"  {s['step']}" for s in res.steps))
    else:
        ctx.emit(res.to_json(), res.message + (f" ({res.seconds:.1f}s)" if res.action != "noop" else ""))


def _drain_options(fn):
    fn = click.option("--no-drain", is_flag=True,
                      help="Stop the current backend at once, cutting requests in flight.")(fn)
    return click.option("--drain-timeout", type=click.FloatRange(0, 86400), default=None, metavar="SECONDS",
                        help="Wait at most this long for the current backend's requests in flight to finish "
                             "before stopping it (default: supervision.drain_timeout_s; 0: no drain).")(fn)


def _drain_s(drain_timeout: float | None, no_drain: bool) -> float | None:
    if no_drain and drain_timeout is not None:
        raise click.UsageError("--no-drain and --drain-timeout contradict each other: give one of them")
    return 0.0 if no_drain else drain_timeout


@click.command()
@click.argument("backend", type=BACKEND)
@click.option("--wait", type=SECONDS, default=0.0, help="Wait this long for another switch's lock (else fail fast).")
@click.option("--reason", default=None, help="Why (kept in history).")
@_drain_options
@pass_ctx
def switch(ctx: Ctx, backend: str, wait: float, reason: str | None, drain_timeout: float | None,
           no_drain: bool) -> None:
    """Swap the backend behind the port, health-gated, rolling back automatically on failure.

    \b
    BACKEND is a name, an alias or an unambiguous prefix: `deploytool switch llamacpp`.
    The current backend first finishes its requests in flight (bounded: --drain-timeout; --no-drain skips it).
    Exit 0 switched (or already active), 10 rolled back to the previous backend, 11 rollback failed too.
    """
    from deploy_tool.box import operations

    drain_s = _drain_s(drain_timeout, no_drain)
    cfg = ctx.load_config()
    cfg.backend(backend)  # the name first: an unknown one fails (exit 3, did-you-mean) before systemd is probed
    _emit_switch(ctx, operations.switch(cfg, backend, dry_run=ctx.dry_run, wait=wait, reason=reason, log=_log(ctx),
                                        drain_s=drain_s))


@click.command()
@click.option("--wait", type=SECONDS, default=0.0, help="Wait this long for another operation's lock.")
@_drain_options
@pass_ctx
def rollback(ctx: Ctx, wait: float, drain_timeout: float | None, no_drain: bool) -> None:
    """Switch back to the previous backend through the same health gate (drained like a switch).

    \b
    For example: deploytool rollback --dry-run   (which backend, and the steps)
    Exit 0 switched back, 4 or 7 its preflight refused (nothing changed), 10 rolled back again, 11 that failed too,
    12 locked, 13 no previous backend recorded.
    """
    from deploy_tool.box import operations

    drain_s = _drain_s(drain_timeout, no_drain)
    cfg = ctx.load_config()
    _emit_switch(ctx, operations.rollback(cfg, dry_run=ctx.dry_run, wait=wait, log=_log(ctx), drain_s=drain_s))


@click.command()
@pass_ctx
def recover(ctx: Ctx) -> None:
    """Finish an interrupted install, switch or rollback (a killed run) to a consistent end.

    \b
    For example: deploytool status   (exit 21: an operation awaits recover), then deploytool recover
    An install is undone (the previous release serves again); a switch is committed when its target passed its
    gate, else rolled back. Exit 0 recovered (or nothing to recover), 11 the backend could not be brought back,
    12 locked.
    """
    from deploy_tool.box import operations

    cfg = ctx.load_config()
    _emit_switch(ctx, operations.recover(cfg, dry_run=ctx.dry_run, log=_log(ctx)))


@click.command()
@click.option("--from", "from_backend", required=True, metavar="BACKEND", type=BACKEND,
              help="The backend that failed (the failover unit passes its instance, %i).")
@pass_ctx
def failover(ctx: Ctx, from_backend: str) -> None:
    """Fail over from a backend that failed for good to the last one that passed the health gate.

    \b
    Run by systemd (deploytool-failover@BACKEND.service, the backend units' OnFailure=). Guarded: it acts only
    when BACKEND is the active one and its unit failed (not stopped by someone), no other operation holds the
    lock and no failover ran within supervision.failover.window_s; otherwise it records why and changes nothing.
    Exit 0 failed over or skipped, 9 the fallback failed too (both stay stopped).
    """
    import os

    from deploy_tool.box import operations

    cfg = ctx.load_config()
    cfg.backend(from_backend)  # the name first, before systemd is probed
    # systemd hands the OnFailure= unit the run that failed
    unit = os.environ.get("MONITOR_UNIT", "")
    inv = os.environ.get("MONITOR_INVOCATION_ID") if unit.removesuffix(".service") == from_backend else None
    _emit_switch(ctx, operations.failover(cfg, from_backend, dry_run=ctx.dry_run, invocation=inv or None,
                                          log=_log(ctx)))


def _emit_switch(ctx: Ctx, res) -> None:
    """A switch, rollback or recover: its plan under --dry-run, else its message."""
    if res.action == "planned":
        ctx.emit(res.to_json(), "plan:\n" + "\n".join(f"  {i}. {s}" for i, s in enumerate(res.plan, 1)))
    else:
        ctx.emit(res.to_json(), res.message)


@click.command()
@click.option("--deep", is_flag=True, help="Also read what the running process loaded and its capacity log lines.")
@click.option("--metrics-file", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Also write the Prometheus metrics of this report to this file (atomically).")
@pass_ctx
def status(ctx: Ctx, deep: bool, metrics_file: Path | None) -> None:
    """Active backend, release, unit states, health, fingerprints, interrupted operation, last events.

    \b
    Exits with the box's state, like `systemctl is-active` (the worst found wins):
      0   serving as recorded (active unit up, health check ok, no drift, nothing pending)
      20  degraded: serving, but fingerprints drifted, the config differs from the installed release's, another
          backend's unit is failed, a path a root step reads is not root's alone, the process loaded something
          unpinned (--deep), or systemd cannot be asked
      21  pending: serving, but an interrupted operation awaits `deploytool recover`
      22  not serving: no active backend, its unit is not active, or its health check fails
    Errors keep their own codes (3 config, 5 input, 13 state, ...).
    """
    from deploy_tool.box import status as st_mod

    cfg = ctx.load_config()
    rep = st_mod.collect(cfg, deep=deep)
    if metrics_file is not None and ctx.dry_run:
        click.echo(f"dry run: would write the metrics to {metrics_file}", err=True)
    elif metrics_file is not None:
        from deploy_tool.box import metrics
        from deploy_tool.box.state import Store

        _write_metrics(metrics_file, metrics.render(cfg, rep, Store(cfg.paths.state_dir).history()))
    ctx.emit(rep, st_mod.format_status(rep))
    code = rep["verdict"]["exit_code"]
    if code:
        sys.exit(code)


@click.command("metrics")
@click.option("--write", "write_", is_flag=True, help="Write them to paths.metrics_file instead of printing.")
@click.option("--out", "-o", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Write them to this file instead of printing.")
@pass_ctx
def metrics_cmd(ctx: Ctx, write_: bool, out: Path | None) -> None:
    """The box's Prometheus metrics (node_exporter textfile format): print, or write them atomically.

    \b
    Install, switch, rollback and recover rewrite paths.metrics_file themselves; run `deploytool metrics --write`
    from a timer to keep deploytool_serving fresh between operations. Exit 0 whatever the box's state (the
    metrics carry it: deploytool_serving, deploytool_status_code).
    """
    from deploy_tool.box import metrics
    from deploy_tool.errors import InputError, OSFailure, StateError

    cfg = ctx.load_config()
    if write_ and out is not None:
        raise InputError("--write and --out both name where to write", hint="pass one of them")
    target = out
    if write_:
        if not cfg.paths.metrics_file:
            raise InputError(f"paths.metrics_file is off in {cfg.source_path}",
                             hint="set paths.metrics_file, or pass --out PATH")
        target = Path(cfg.paths.metrics_file)
    try:
        text, _ = metrics.collect_text(cfg)
    except (StateError, OSFailure) as exc:  # still exit 0, the metrics say what `status` would exit with
        click.echo(f"warning: {exc.message}", err=True)
        text = metrics.unreadable_text(exc)
    if target is None:
        if ctx.json:  # the text exposition, as one JSON object
            ctx.emit({"format": "prometheus-text-0.0.4", "metrics": text})
        else:
            click.echo(text, nl=False)
        return
    if ctx.dry_run:
        ctx.emit({"would_write": str(target), "bytes": len(text.encode())},
                 f"dry run: would write {len(text.encode())} bytes of metrics to {target}")
        return
    _write_metrics(target, text)
    ctx.emit({"wrote": str(target)}, f"wrote {target}")


def _write_metrics(target: Path, text: str) -> None:
    from deploy_tool.box import metrics
    from deploy_tool.errors import InputError

    if not target.parent.is_dir():
        raise InputError(f"cannot write the metrics to {target}: its directory does not exist",
                         hint="create it (node_exporter's --collector.textfile.directory), or name another path")
    metrics.write(target, text)


@click.command()
@click.option("--limit", "-l", type=click.IntRange(0, None), default=20, show_default=True, metavar="N",
              help="How many events (0: all).")
@pass_ctx
def history(ctx: Ctx, limit: int) -> None:
    """Installs, switches, rollbacks, recoveries and pins, with their reasons."""
    from deploy_tool.box import status as st_mod
    from deploy_tool.box.state import Store

    cfg = ctx.load_config()
    events = Store(cfg.paths.state_dir).history(limit or None)
    ctx.emit(events, st_mod.format_history(events))


@click.command()
@click.argument("bundle")
@click.option("--offline", is_flag=True, required=True, help="Required: no package index is used.")
@click.option("--keys", "keys_dir", default=None, help="Trusted public keys (default: paths.keys_dir).")
@click.option("--python", "python", default=None, help="Python to build with (default: bundle.python).")
@pass_ctx
def rebuild(ctx: Ctx, bundle: str, offline: bool, keys_dir: str | None, python: str | None) -> None:
    """CI: rebuild the venv from the bundle's wheels with no network; compare every native library hash."""
    from deploy_tool.builder import rebuild as rb

    cfg = ctx.load_config()
    rep = rb.rebuild(cfg, bundle, keys_dir=keys_dir, python=python, log=_log(ctx))
    ctx.emit(rep, rb.format_report(rep))
    if not rep["ok"]:
        sys.exit(7)


@click.command()
@click.option("--watch", is_flag=True, help="Probe every supervision.liveness.interval_s until stopped (what "
                                            "deploytool-liveness.service runs).")
@pass_ctx
def liveness(ctx: Ctx, watch: bool) -> None:
    """Probe the active backend once; restart it when it hangs (--watch: again and again).

    \b
    Busy (requests in flight, the server using CPU) is not hung. Failures in a row, restarts and give-ups are
    recorded in history as "liveness" events; see supervision.liveness in the config.
    """
    from deploy_tool.box.probe import liveness as lv

    cfg = ctx.load_config()
    if watch and not ctx.dry_run:
        lv.watch(cfg, log=lambda msg: click.echo(msg, err=True))
        return
    if ctx.dry_run:
        lc = cfg.supervision.liveness
        ctx.emit({"would_probe": cfg.default_backend, "config": lc.__dict__},
                 f"would probe the active backend within {lc.timeout_s:g}s, restart it after {lc.failures} "
                 f"failures in a row" if lc.enabled else "liveness is off (supervision.liveness.enabled: false)")
        return
    res = lv.tick(cfg, log=_log(ctx))
    ctx.emit(res.to_json(), f"{res.backend or '-'}: {res.action}" + (f" ({res.detail})" if res.detail else ""))


COMMANDS = [lock, pack, install, switch, rollback, recover, failover, liveness, status, metrics_cmd, history, rebuild]
