"""init, check, render, config-reference.

The library modules a command needs are imported when it runs: the renderer pulls in jinja2, which the units'
ExecStartPre verify (the same CLI) must not depend on.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import click

from deploy_tool.cli.context import Ctx, pass_ctx
from deploy_tool.cli.names import EXAMPLE
from deploy_tool.errors import CheckFailed, InputError
from deploy_tool.fsutil import atomic_write


@click.command()
@click.option("--example", "-e", type=EXAMPLE, default="two-2080ti", show_default=True,
              help="Which embedded example: two-2080ti (the real box) or cpu-demo (both backends on CPU).")
@click.option("--out", "-o", type=click.Path(dir_okay=False, path_type=Path), default=Path("deploytool.yaml"),
              show_default=True, help="Where to write the config (a file; its directory is made if missing).")
@click.option("--force", is_flag=True, help="Overwrite an existing file.")
@pass_ctx
def init(ctx: Ctx, example: str, out: Path, force: bool) -> None:
    """Write a starter deploytool.yaml from an embedded example."""
    from deploy_tool import config

    if not out.name or out.name in (".", ".."):
        raise click.BadParameter(f"{str(out)!r} names no file", param_hint="'--out'")
    text = config.example_text(example)
    files = {out: text.encode()}
    for name, data in config.example_companions(example).items():
        files[out.parent / name] = data
    clash = [str(p) for p in files if p.exists()]
    if clash and not force:
        raise InputError(f"{', '.join(clash)} already exist(s); not overwriting",
                         hint="pass --force, or --out another path")
    if ctx.dry_run:
        ctx.emit({"would_write": [str(p) for p in files], "example": example},
                 "\n".join(f"would write {p}" for p in files))
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    for p, data in files.items():
        atomic_write(p, data, 0o644)
    ctx.emit({"wrote": [str(p) for p in files], "example": example},
             "\n".join(f"wrote {p}" for p in files) + f"\nnext: deploytool --config {shlex.quote(str(out))} check")


@click.command()
@click.option("--no-files", is_flag=True, help="Skip checks that read files the config names (libraries, models).")
@pass_ctx
def check(ctx: Ctx, no_files: bool) -> None:
    """Validate the config against every known pitfall; exit 4 when any error is found.

    \b
    Each finding has a stable id, a severity (error, warning, info), the measured evidence from the
    field notes, and the fix. Warnings and infos never fail the check.
    """
    from deploy_tool import checks

    cfg = ctx.load_config()
    findings = checks.run_checks(cfg, inspect_files=not no_files)
    errors = [f for f in findings if f.severity == "error"]
    if ctx.json:
        ctx.emit({"config": cfg.source_path, "ok": not errors, "findings": [f.to_json() for f in findings]})
    else:
        click.echo(format_findings(findings, cfg.source_path or "config"))
    if errors:
        if ctx.json:
            sys.exit(int(CheckFailed.exit_code))
        raise CheckFailed(f"{len(errors)} error(s) in {cfg.source_path}", hint="fix the errors listed above")


def format_findings(findings, source: str) -> str:
    if not findings:
        return f"{source}: all checks passed"
    color = {"error": "red", "warning": "yellow", "info": "cyan"}
    lines = []
    for f in findings:
        head = click.style(f"{f.severity.upper():7}", fg=color[f.severity], bold=f.severity == "error")
        where = f" [{f.backend}]" if f.backend else ""
        lines.append(f"{head} {f.id}{where}: {f.message}")
        lines.append(f"        fix: {f.fix}  ({f.source})")
    n = {s: sum(1 for f in findings if f.severity == s) for s in ("error", "warning", "info")}
    lines.append(f"{n['error']} error(s), {n['warning']} warning(s), {n['info']} info")
    return "\n".join(lines)


@click.command()
@click.option("--out", "-o", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Directory to write the files into, made if missing (default: print them).")
@pass_ctx
def render(ctx: Ctx, out: Path | None) -> None:
    """Render the unit files and env files of every backend (deterministic)."""
    from deploy_tool import render as r

    cfg = ctx.load_config()
    files = r.render_all(cfg)
    if out is None or ctx.dry_run:
        if ctx.json:
            ctx.emit({f.name: f.content for f in files})
        else:
            for f in files:
                prefix = f"would write {out / f.name}" if out is not None else f.name
                click.echo(click.style(f"# ---- {prefix}", bold=True))
                click.echo(f.content, nl=False)
        return
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is not a directory", hint="name a directory (made if missing)")
    out.mkdir(parents=True, exist_ok=True)
    for f in files:
        atomic_write(out / f.name, f.content.encode(), f.mode)
    ctx.emit({"wrote": [str(out / f.name) for f in files]},
             "\n".join(f"wrote {out / f.name}" for f in files))


@click.command("config-reference")
@pass_ctx
def config_reference(ctx: Ctx) -> None:
    """Every config key with its type, default and meaning."""
    from deploy_tool import config

    rows = config.reference_rows()
    if ctx.json:
        ctx.emit([dict(zip(("key", "type", "default", "doc"), r, strict=True)) for r in rows])
        return
    for key, tp, default, doc in rows:
        click.echo(f"{key}\n    {tp}; default {default}\n    {doc}")


COMMANDS = [init, check, render, config_reference]
_ = os
