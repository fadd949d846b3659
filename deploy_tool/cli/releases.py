"""releases [prune | remove ID] and uninstall: the releases a box keeps over time, and taking the box back down.

deploy_tool.box.releases (which loads the manifest's cryptography and the renderer's jinja2) is imported inside each
command, as in cli/ops.py: the CLI loads every command to parse one, and verify's ExecStartPre path stays light.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from deploy_tool.cli.context import Ctx, pass_ctx
from deploy_tool.cli.names import SECONDS, SuggestingGroup


def _log(ctx: Ctx):
    def log(msg: str) -> None:
        if not ctx.json:
            click.echo(f"  {msg}", err=True)

    return log


def _table(rels: list) -> str:
    from deploy_tool.box import releases as rel

    if not rels:
        return "no release is installed on this box"
    rows = [(r.id, f"{r.bundle_name or '?'} #{r.sequence if r.sequence is not None else '?'}", rel._human(r.bytes),
             rel._human(r.frees), (r.installed or "?")[:19], (r.last_active or "-")[:19], ", ".join(r.roles) or "-")
            for r in rels]
    head = ("RELEASE", "BUNDLE", "SIZE", "FREES", "INSTALLED", "LAST ACTIVE", "ROLE")
    w = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(c.ljust(w[i]) for i, c in enumerate(head)).rstrip()]
    lines += ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    total = rel.disk_usage(*(Path(r.path) for r in rels))[0]  # what they share counted once
    lines.append(f"{len(rels)} release(s), {rel._human(total)} on disk (FREES: what removing one alone frees; "
                 "the venv parts a release shares with another stay)")
    return "\n".join(lines)


@click.group("releases", cls=SuggestingGroup, invoke_without_command=True)
@pass_ctx
@click.pass_context
def releases(cctx: click.Context, ctx: Ctx) -> None:
    """List the releases on this box, or prune or remove them.

    \b
    Each release: its id, bundle name and sequence, size on disk and what removing it would free (the venv parts
    it shares with another release stay), when it was installed and last served, and its roles: current,
    previous, last-good (the last one whose health gate passed). Releases with a role are never removed. A
    committed install or switch keeps the newest supervision.keep_releases (3) and those.
      deploytool releases                  the table (--json: every field)
      deploytool releases prune [--keep N] remove the ones beyond the newest N (--dry-run: which)
      deploytool releases remove ID        remove one
    """
    from deploy_tool.box import releases as rel

    if cctx.invoked_subcommand is not None:
        return
    cfg = ctx.load_config()
    rels = rel.releases(cfg)
    ctx.emit({"releases": [r.to_json() for r in rels], "keep": cfg.supervision.keep_releases}, _table(rels))


@releases.command("prune")
@click.option("--keep", type=click.IntRange(min=1), default=None,
              help="Releases to keep (default: supervision.keep_releases); those with a role are kept besides.")
@click.option("--wait", type=SECONDS, default=0.0, help="Seconds to wait for the lock.")
@pass_ctx
def prune(ctx: Ctx, keep: int | None, wait: float) -> None:
    """Remove the releases beyond the newest N, never the current, previous or last-good one."""
    from deploy_tool.box import releases as rel

    cfg = ctx.load_config()
    res = rel.prune(cfg, keep=keep, dry_run=ctx.dry_run, wait=wait, log=_log(ctx))
    verb = "would remove" if ctx.dry_run else "removed"
    human = (f"{verb} {len(res.removed)} release(s), {rel._human(res.freed)}: "
             + (", ".join(r.id for r in res.removed) or "none")
             + f"; kept {', '.join(r.id for r in res.kept) or 'none'}")
    ctx.emit(res.to_json(), human)


@releases.command("remove")
@click.argument("release_id", metavar="ID")
@click.option("--wait", type=SECONDS, default=0.0, help="Seconds to wait for the lock.")
@pass_ctx
def remove(ctx: Ctx, release_id: str, wait: float) -> None:
    """Remove release ID (refused for the current, previous or last-good release)."""
    from deploy_tool.box import releases as rel

    cfg = ctx.load_config()
    r = rel.remove(cfg, release_id, dry_run=ctx.dry_run, wait=wait, log=_log(ctx))
    ctx.emit({"removed": r.to_json(), "dry_run": ctx.dry_run},
             f"{'would remove' if ctx.dry_run else 'removed'} release {r.id} ({rel._human(r.frees)} freed)")


def can_ask() -> bool:
    """Whether a question can be asked: stdin is a terminal."""
    return sys.stdin.isatty()


@click.command("uninstall")
@click.option("--purge", is_flag=True,
              help="Also remove the config, the trusted keys and the sequence record (the replay guard).")
@click.option("--yes", "-y", is_flag=True, help="Do not ask first (needed where there is no terminal to ask on).")
@click.option("--wait", type=SECONDS, default=0.0, help="Seconds to wait for the lock.")
@pass_ctx
def uninstall(ctx: Ctx, purge: bool, yes: bool, wait: float) -> None:
    """Stop the backends and remove what install laid down: units, env files, releases, state.

    \b
    Asks first on a terminal; --yes answers for it (a script must pass it); --dry-run shows the steps.
    The config, the trusted keys and the sequence record (a later install still refuses an older bundle) are
    kept (--purge removes them too); drop-ins under UNIT.d/ are the operator's and are kept. Journaled: a kill
    at any step leaves an operation that `deploytool recover`, or uninstall again, finishes. An interrupted
    install or switch must be recovered first.
    """
    from deploy_tool.box import releases as rel
    from deploy_tool.errors import InputError

    cfg = ctx.load_config()
    if not (yes or ctx.dry_run):
        what = f"stop the backends and remove every release under {cfg.paths.releases_dir}, the units and the state"
        if not can_ask():
            raise InputError(f"uninstall would {what}, and there is no terminal to ask on",
                             hint="pass --yes to go ahead (or --dry-run to see the steps)")
        purged = ", the config, the keys and the sequence record" if purge else ""
        click.confirm(f"uninstall: {what}{purged}?", abort=True, err=True)
    res = rel.uninstall(cfg, purge=purge, dry_run=ctx.dry_run, wait=wait, log=_log(ctx))
    lines = [("would: " if ctx.dry_run else "done: ") + s["what"] for s in res.steps] or ["nothing is installed"]
    if res.kept:
        lines.append("kept: " + ", ".join(res.kept))
    ctx.emit(res.to_json(), "\n".join(lines))


COMMANDS = (releases, uninstall)
