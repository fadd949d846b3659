"""Run this checkout's Python as an unprivileged user (uid/gid 65534), wherever the checkout and its interpreter live.

A checkout in a home only its owner can enter (/root is 0700), or a venv whose base interpreter lives there
(pyenv), is out of reach of uid 65534: `import deploy_tool` fails before the test's point is reached. So the child
gets a private mount namespace in which the checkout, the venv and the base interpreter's prefix are bind-mounted
under a fresh world-traversable directory, and runs from there: the interpreter by its bind-mounted path, the
checkout first on sys.path, then the venv's site-packages. Nothing outside the child changes; the mounts go with
it. Needs root (which is what running something as another user needs anyway).

    run_python(["-c", code, arg, ...], cwd=None, env=None, timeout=60) -> CompletedProcess
    REPO_AS_SEEN  the placeholder for the checkout in arguments: replaced with where the child sees it
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
UID = 65534
REPO_AS_SEEN = "{repo}"

_SCRIPT = r"""
set -e
top=$1; shift
for pair in "repo=$REPO_SRC" "venv=$VENV_SRC" "base=$BASE_SRC"; do
  name=${pair%%=*}; src=${pair#*=}
  mount --bind "$src" "$top/$name"
done
cd "$top/repo"
exec setpriv --reuid="$AS_UID" --regid="$AS_UID" --clear-groups --inh-caps=-all "$@"
"""


def run_python(args: list[str], *, env: dict[str, str] | None = None,
               timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`python ARGS` as uid 65534 with this checkout importable; REPO_AS_SEEN in ARGS becomes the checkout's path
    as the child sees it. The child's cwd is the checkout. Its environment: `env` (default PATH only), plus
    PYTHONPATH and PYTHONNOUSERSITE."""
    assert os.geteuid() == 0, "running something as another user needs root"
    top = Path(tempfile.mkdtemp(prefix="deploytool-nobody-"))
    try:
        os.chmod(top, 0o755)
        for name in ("repo", "venv", "base"):
            (top / name).mkdir(mode=0o755)
        rel_site = Path(sysconfig.get_paths()["purelib"]).relative_to(sys.prefix)
        python = top / "base" / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
        e = {"PATH": "/usr/bin:/bin", **(env or {})}
        e.update(PYTHONPATH=f"{top / 'repo'}:{top / 'venv' / rel_site}", PYTHONNOUSERSITE="1",
                 REPO_SRC=str(REPO), VENV_SRC=sys.prefix, BASE_SRC=sys.base_prefix, AS_UID=str(UID))
        argv = [a.replace(REPO_AS_SEEN, str(top / "repo")) for a in args]
        return subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", _SCRIPT, "sh",
                               str(top), str(python), *argv], capture_output=True, text=True, env=e,
                              timeout=timeout)
    finally:
        # rmdir, never rmtree: if a mount had leaked out of the child's namespace, a mount point holding the
        # checkout is not empty and stays, instead of the checkout being deleted through it
        for d in (top / "repo", top / "venv", top / "base", top):
            with contextlib.suppress(OSError):
                d.rmdir()
