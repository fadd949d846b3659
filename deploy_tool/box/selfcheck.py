"""Checks of the box before an install.

`preflight(cfg)` is the check `python3 BUNDLE/bootstrap` runs before `install`: bundle.python must exist on the
box (MissingTool), and every directory install writes to (releases, state, env files, units) must be writable,
else one OSFailure names them all; nothing is written either way. `python -m deploy_tool.box.selfcheck preflight
--config PATH` runs it from the command line. (The deploytool that verifies is itself pinned: fingerprint's
tool.* items.)
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from deploy_tool.config import Config
from deploy_tool.errors import MissingTool, OSFailure


def write_targets(cfg: Config) -> list[Path]:
    p = cfg.paths
    return [Path(p.releases_dir), Path(p.state_dir), Path(p.env_dir), Path(p.unit_dir)]


def _nearest_existing(path: Path) -> Path:
    p = path
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    return p


def _unwritable(path: Path) -> str | None:
    """Why install could not write under `path`, or None."""
    anc = _nearest_existing(path)
    if not anc.is_dir():
        return f"{anc} is not a directory"
    try:
        ro = bool(os.statvfs(anc).f_flag & os.ST_RDONLY)
    except OSError as exc:
        return f"{anc}: {exc.strerror}"
    if ro:
        return f"{anc} is on a read-only file system"
    if not os.access(anc, os.W_OK | os.X_OK):
        return f"{anc} is not writable by this user (uid {os.getuid()})"
    return None


def preflight(cfg: Config) -> list[Path]:
    """Raise MissingTool if bundle.python (the interpreter install builds the release's venvs with) is not on
    this box, OSFailure naming every target directory install could not write; return the targets."""
    py = cfg.bundle.python
    found = shutil.which(py) if os.sep not in py else (py if os.access(py, os.X_OK) and os.path.isfile(py) else None)
    if not found:
        raise MissingTool(f"bundle.python {py} is not on this box; install builds the release's venvs with it",
                          hint="set bundle.python to this box's python3 (3.11 or newer), the one the bundle's "
                               "wheels were locked for")
    targets = write_targets(cfg)
    bad = [(t, why) for t in targets if (why := _unwritable(t)) is not None]
    if bad:
        raise OSFailure("install could not write to " + "; ".join(f"{t} ({why})" for t, why in bad),
                        hint="run as root, or remount the file system read-write, or point paths.* in the "
                             "config at writable directories; nothing was written")
    return targets


def main(argv: list[str] | None = None) -> int:
    """`python -m deploy_tool.box.selfcheck preflight --config PATH`: exit 0, or the DeployError's code."""
    import argparse

    from deploy_tool import config as config_mod
    from deploy_tool.errors import DeployError

    ap = argparse.ArgumentParser(prog="python -m deploy_tool.box.selfcheck")
    ap.add_argument("command", choices=["preflight"])
    ap.add_argument("--config", required=True)
    args = ap.parse_args(argv)
    try:
        cfg = config_mod.load(args.config)
        targets = preflight(cfg)
    except DeployError as exc:
        sys.stderr.write(f"error: {exc.message}\n" + (f"hint: {exc.hint}\n" if exc.hint else ""))
        return int(exc.exit_code)
    sys.stdout.write("writable: " + ", ".join(str(t) for t in targets) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
