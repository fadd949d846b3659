"""deploytool checks itself: the deploytool the units' ExecStartPre runs is pinned like the backend it guards.

`collect(c, cfg)` adds these fingerprint items to every backend's set (fingerprint._collect calls it), so
`deploytool verify` reports a changed verifier (a stray `pip install -U`, an edited module, an added .pth file or
.pyc) with exit 7 like any other drift:

  tool.path            the real path of paths.deploytool (normally {current}/tool/bin/deploytool, a link into
                       the release's own tool venv)
  tool.python          the real path of the tool venv's interpreter
  tool/PATH            every entry of the tool venv by type, mode and SHA-256 (treepin), when the venv lies
                       outside the release; inside it (the normal case) the release's own entries
                       (release/tool/venv/...) already are these, through the same code path as the backend venv
  tool.script          SHA-256 of the console script, when it is not in a venv (nor in the release)

The values are taken at install (pin) and compared before every start; the hashing goes through the
fingerprint cache, so an unchanged tool venv costs one stat per file.

`preflight(cfg)` is the check `python3 BUNDLE/bootstrap` runs before `install`: bundle.python must exist on the
box (MissingTool), and every directory install writes to (releases, state, env files, units) must be writable,
else one OSFailure names them all; nothing is written either way. `python -m deploy_tool.selfcheck preflight --config PATH` runs it from the command line.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from deploy_tool.config import Config
from deploy_tool.errors import MissingTool, OSFailure

if TYPE_CHECKING:
    from deploy_tool.fingerprint import _Collector



def tool_path(cfg: Config) -> Path:
    from deploy_tool.render import expand

    return Path(expand(cfg, cfg.paths.deploytool))


def tool_venv(script: str | os.PathLike[str]) -> Path | None:
    """The venv a console script lives in (…/venv/bin/deploytool -> …/venv), or None."""
    real = Path(os.path.realpath(script))
    venv = real.parent.parent
    if real.parent.name == "bin" and (venv / "pyvenv.cfg").is_file():
        return venv
    return None


def collect(c: _Collector, cfg: Config) -> None:
    """Add the tool.* items (see the module doc) to a fingerprint collection."""
    from deploy_tool.fingerprint import MISSING

    script = tool_path(cfg)
    if not os.path.lexists(script):
        c.value("tool.path", "deploytool (paths.deploytool)", script, MISSING)
        return
    c.value("tool.path", "deploytool (paths.deploytool)", script, os.path.realpath(script))
    venv = tool_venv(script)
    if venv is None:
        if not c.in_tree(script):
            c.sha256("tool.script", "deploytool console script", os.path.realpath(script))
        return
    py = venv / "bin" / "python"
    c.value("tool.python", "deploytool venv interpreter", py,
            os.path.realpath(py) if os.path.lexists(py) else MISSING)
    c.tree("tool", venv)  # nothing added when the venv lies in the release (normally {current}/tool/venv)


# ------------------------------------------------------------------------------------------------ preflight

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
    import shutil  # lazy: verify (every start) imports this module for collect()

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
    """`python -m deploy_tool.selfcheck preflight --config PATH`: exit 0, or the DeployError's code."""
    import argparse

    from deploy_tool import config as config_mod
    from deploy_tool.errors import DeployError

    ap = argparse.ArgumentParser(prog="python -m deploy_tool.selfcheck")
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
