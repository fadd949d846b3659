"""The `deploytool` console entry: fast paths for the units' ExecStartPre and ExecStartPost, everything else
through click.

`deploytool [--config PATH] verify BACKEND [--no-cache] [--await-port]` with stdout not a terminal (how systemd runs it
before every start) is handled here without importing click or the command modules, which is about a third
of the start-up time of a fully cached verify, and walks the release (treepin.prefetch) in a child process
while the rest is imported. The output, the error lines and the exit codes are the same
as the click command's (tests compare them); any other command line, or a terminal (colors), goes to click.
`deploytool [--config PATH] await-ready BACKEND` (the ExecStartPost, whose start-up delays the unit's "active")
takes the same kind of path.
"""

from __future__ import annotations

import os
import sys


def _parse(argv: list[str]) -> tuple[str | None, str, bool, bool] | None:
    """(config, backend, no_cache, await_port) for the exact shapes the fast path serves, else None."""
    config = None
    args = list(argv)
    if args[:1] in (["--config"], ["-c"]) and len(args) >= 2:
        config, args = args[1], args[2:]
    elif args and args[0].startswith("--config="):
        config, args = args[0].split("=", 1)[1], args[1:]
    if len(args) < 2 or args[0] != "verify" or args[1].startswith("-"):
        return None
    rest = args[2:]
    if len(set(rest)) != len(rest) or not set(rest) <= {"--no-cache", "--await-port"}:
        return None
    return config, args[1], "--no-cache" in rest, "--await-port" in rest


def fast_verify(config_path: str | None, backend: str, no_cache: bool, await_port: bool = False) -> int:
    """Run verify like the click command does; return the exit code."""
    from pathlib import Path

    from deploy_tool import config as config_mod
    from deploy_tool import strictmodes
    from deploy_tool.box import fingerprint
    from deploy_tool.errors import DeployError

    try:
        path = config_path or os.environ.get("DEPLOYTOOL_CONFIG") or None
        if path is None:
            local = Path("deploytool.yaml")
            path = str(local if local.exists() else config_mod.DEFAULT_CONFIG_PATH)
        fingerprint.check_unit_environment()
        cfg = config_mod.load(path)
        b = cfg.backend(backend)
        strictmodes.require(cfg, [b], f"{b.name} may not start")
        report = fingerprint.verify(cfg, b, use_cache=not no_cache, loaded_env=fingerprint.loaded_env_file())
        sys.stdout.write(fingerprint.format_report(report) + "\n")
        sys.stdout.flush()
        if not report.ok:
            raise fingerprint.drift_error(report)
        if await_port:
            from deploy_tool import portwait

            sys.stdout.write(portwait.await_for_backend(cfg, b) + "\n")
            sys.stdout.flush()
        return 0
    except DeployError as exc:
        sys.stderr.write(f"error: {exc.message}\n" + (f"hint: {exc.hint}\n" if exc.hint else ""))
        return int(exc.exit_code)


def _parse_await(argv: list[str]) -> tuple[str | None, str] | None:
    """(config, backend) for `[--config PATH] await-ready BACKEND` (the units' ExecStartPost), else None."""
    args = list(argv)
    config = None
    if args[:1] in (["--config"], ["-c"]) and len(args) >= 2:
        config, args = args[1], args[2:]
    elif args and args[0].startswith("--config="):
        config, args = args[0].split("=", 1)[1], args[1:]
    if len(args) != 2 or args[0] != "await-ready" or args[1].startswith("-"):
        return None
    return config, args[1]


def fast_await_ready(config_path: str | None, backend: str) -> int:
    """Run await-ready like the click command does, without importing click: the start job it ends waits for
    this process's own start-up too. Returns the exit code."""
    from pathlib import Path

    from deploy_tool import config as config_mod
    from deploy_tool.box import ready
    from deploy_tool.errors import DeployError, GpuError, HealthError

    try:
        path = config_path or os.environ.get("DEPLOYTOOL_CONFIG") or None
        if path is None:
            local = Path("deploytool.yaml")
            path = str(local if local.exists() else config_mod.DEFAULT_CONFIG_PATH)
        cfg = config_mod.load(path)
        b = cfg.backend(backend)
        rep = ready.await_ready(cfg, b, main_pid=ready.main_pid_from_env())
        sys.stdout.write(f"{b.name} serves {cfg.serve.model_name!r} at {rep.base_url} "
                         f"(ready after {rep.seconds:.1f}s)\n")
        return 0
    except (HealthError, GpuError) as exc:
        sys.stderr.write(f"not ready: {exc.message}\n" + (f"hint: {exc.hint}\n" if exc.hint else ""))
        return int(exc.exit_code)
    except DeployError as exc:
        sys.stderr.write(f"error: {exc.message}\n" + (f"hint: {exc.hint}\n" if exc.hint else ""))
        return int(exc.exit_code)


def _own_release() -> str | None:
    """The release this deploytool runs from (releases/<id>, whose tool/venv is this interpreter's), or None
    (a development checkout, a venv elsewhere)."""
    venv = os.path.realpath(sys.prefix)
    release = os.path.dirname(os.path.dirname(venv))
    if venv == os.path.join(release, "tool", "venv") and os.path.isfile(os.path.join(release, "MANIFEST")):
        return release
    return None


def main() -> None:
    argv = sys.argv[1:]
    parsed = _parse(argv) if not sys.stdout.isatty() else None
    if parsed is not None:
        from deploy_tool.box import treepin

        release = _own_release() if not parsed[2] else None  # --no-cache reads every file anyway
        if release is not None:
            # the lstat of the release's every entry (about half of a cached verify) runs in a child beside the
            # imports below; verify takes the result when it walks that tree (treepin.prefetched)
            treepin.prefetch(release)
        try:
            code = fast_verify(*parsed)
        except Exception as exc:  # a bug: the same one-line report as the click edge gives
            sys.stderr.write(f"internal error: {type(exc).__name__}: {exc}\n"
                             "hint: this is a bug in deploytool; rerun with --debug and report the traceback\n")
            code = 70
        treepin.forget()
        sys.exit(code)
    waiting = _parse_await(argv) if not sys.stdout.isatty() else None
    if waiting is not None:
        try:
            code = fast_await_ready(*waiting)
        except Exception as exc:  # a bug: the same one-line report as the click edge gives
            sys.stderr.write(f"internal error: {type(exc).__name__}: {exc}\n"
                             "hint: this is a bug in deploytool; rerun with --debug and report the traceback\n")
            code = 70
        sys.exit(code)
    from deploy_tool.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
