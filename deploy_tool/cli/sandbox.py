"""deploytool sandbox up|down|status|exec: a real systemd manager in private namespaces, for rehearsals.

The sandbox module is imported when a command runs: it is rehearsal machinery, never needed on a box.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import click

from deploy_tool.cli.context import Ctx, pass_ctx
from deploy_tool.cli.names import SuggestingGroup
from deploy_tool.errors import ExitCode, SandboxError


@click.group(cls=SuggestingGroup)
def sandbox() -> None:
    """A real systemd in private namespaces, to rehearse installs and switches.

    This machine's own systemd runs as PID 1 of private pid/mount/uts/ipc/cgroup namespaces, in its own
    sub-cgroups; the host's /etc/systemd/system is never touched.

    \b
    Needs root, unshare and nsenter. Services inside share the host's network: one bound to 127.0.0.1
    answers on the host. Unit files go to DIR/etc-systemd-system (it is /etc/systemd/system inside).
    To point deploytool at it, set in the config:
      systemd:
        sandbox: DIR
    """


def _a_directory(dir: Path) -> None:
    # os.path's answers: a path this user may not look at is no error here (up then says it needs root)
    if os.path.lexists(dir) and not os.path.isdir(dir):
        raise SandboxError(f"{dir} is not a directory, so not a sandbox", hint="name a new, empty or sandbox directory")


def _would(ctx: Ctx, dir: Path, down: str, up: str) -> None:
    """A dry run of up or down: the sandbox's state now, and what the command would do about it."""
    from deploy_tool.rehearsal.sandbox import Sandbox

    state = Sandbox(dir).status().state if os.path.isdir(dir) else "absent"
    what = up if state == "up" else down
    ctx.emit({"dry_run": True, "dir": str(dir), "state": state, "would": what},
             f"sandbox {dir} is {state}: would {what}" if not what.startswith(("nothing", "already")) else
             f"sandbox {dir} is {state}: {what}")


@sandbox.command()
@click.argument("dir", type=click.Path(path_type=Path))
@click.option("--systemd-root", type=click.Path(path_type=Path, exists=True, file_okay=False), default=None,
              help="Run the systemd unpacked in this directory (dpkg-deb -x of Debian's systemd and "
                   "libsystemd-shared packages) instead of the machine's own: for a machine without systemd, such "
                   "as a bare CUDA image.")
@pass_ctx
def up(ctx: Ctx, dir: Path, systemd_root: Path | None) -> None:
    """Start the sandbox in DIR.

    DIR is created if missing; it must be new, empty or a sandbox. Already up: nothing to do.
    The machine's NVIDIA device nodes, if it has any, are re-created in the sandbox's /dev, so units there
    run on the real GPU.
    """
    from deploy_tool.rehearsal.sandbox import Sandbox

    _a_directory(dir)
    if ctx.dry_run:
        _would(ctx, dir, "start a systemd manager there", "already up: nothing to do")
        return
    st = Sandbox(dir, systemd_root=systemd_root).up()
    human = (f"sandbox {st.dir}: {st.detail}" if st.detail else
             f"sandbox {st.dir} is up: systemd pid {st.pid}, {st.system_state}\n"
             f"unit files: {st.unit_dir}\n"
             f"try: deploytool sandbox exec {st.dir} -- systemctl status")
    ctx.emit(st.to_json(), human)


@sandbox.command()
@click.argument("dir", type=click.Path(path_type=Path))
@pass_ctx
def down(ctx: Ctx, dir: Path) -> None:
    """Stop the sandbox in DIR and remove its cgroups.

    Safe to repeat; also cleans up after a killed run.
    """
    from deploy_tool.rehearsal.sandbox import Sandbox

    _a_directory(dir)
    if ctx.dry_run:
        _would(ctx, dir, "nothing to do (it is not up; a stale one's leftovers would be cleaned)",
               "power its systemd off, stopping every service in it, and remove its cgroups")
        return
    rep = Sandbox(dir).down()
    if not rep.was_up and not rep.killed_pids and not rep.removed_cgroups:
        human = f"sandbox {rep.dir} is already down; nothing to do"
    else:
        how = "killed (did not power off in time)" if rep.forced else "powered off"
        human = (f"sandbox {rep.dir} is down" + (f": systemd pid {rep.stopped_pid} {how}" if rep.was_up else "")
                 + (f"; killed leftover pids {' '.join(map(str, rep.killed_pids))}" if rep.killed_pids else "")
                 + f"; {len(rep.removed_cgroups)} cgroups removed ({rep.seconds:.2f} s)")
    ctx.emit(rep.__dict__, human)


@sandbox.command()
@click.argument("dir", type=click.Path(path_type=Path))
@pass_ctx
def status(ctx: Ctx, dir: Path) -> None:
    """Say whether the sandbox in DIR is up, down or stale.

    Exit code 0 when up, 15 otherwise (down, stale, or not a sandbox).
    """
    from deploy_tool.rehearsal.sandbox import Sandbox

    st = Sandbox(dir).status()
    lines = [f"sandbox {st.dir}: {st.state}"
             + (f" (systemd pid {st.pid}, {st.system_state})" if st.state == "up" else "")
             + (f": {st.detail}" if st.detail else "")]
    if st.leftover_cgroups:
        lines.append("leftover cgroups: " + " ".join(st.leftover_cgroups))
    if st.leftover_pids:
        lines.append("leftover pids: " + " ".join(map(str, st.leftover_pids)))
    if st.state == "stale":
        lines.append(f"hint: clean up with: deploytool sandbox down {st.dir}")
    ctx.emit(st.to_json(), "\n".join(lines))
    if st.state != "up":
        sys.exit(int(ExitCode.SANDBOX))


@sandbox.command(name="exec", context_settings={"ignore_unknown_options": True})
@click.argument("dir", type=click.Path(path_type=Path))
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
@pass_ctx
def exec_(ctx: Ctx, dir: Path, cmd: tuple[str, ...]) -> None:
    """Run CMD inside the sandbox in DIR.

    For example: deploytool sandbox exec DIR -- systemctl status. The exit code is CMD's; with --dry-run
    (before `sandbox`) CMD is shown, not run.
    """
    from deploy_tool import proc
    from deploy_tool.rehearsal.sandbox import Sandbox

    if cmd[:1] == ("--",):  # `exec DIR -- CMD`: options are read only before DIR, so the `--` arrives here
        cmd = cmd[1:]
    if not cmd:
        raise click.UsageError("missing CMD")
    argv = Sandbox(dir).exec_argv(*cmd)
    if ctx.dry_run:
        ctx.emit({"dry_run": True, "dir": str(dir), "argv": list(argv)}, "would run: " + shlex.join(argv))
        return
    # output streamed to the terminal as it comes (journalctl -f works); stdin is not passed on
    sys.exit(proc.spawn(argv, stdout=None, stderr=None, new_session=False).wait())
