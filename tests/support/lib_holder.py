"""A real process that maps given shared objects and waits: something for the runtime checks to inspect.

`holding(paths)` starts `python -c ...` which dlopen()s every path, prints `ready`, and sleeps until killed. With
`child=True` the libraries are loaded by a grandchild, so descendant walking is exercised. The process (and its
child) is killed by PID on exit, also when the test fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

_HOLDER = (
    "import ctypes, sys, time\n"
    "for p in sys.argv[1:]:\n"
    "    ctypes.CDLL(p)\n"
    "print('ready', flush=True)\n"
    "time.sleep(300)\n"
)

_PARENT = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', sys.argv[1], *sys.argv[2:]])\n"
    "print(child.pid, flush=True)\n"
    "child.wait()\n"
)


def sample_shared_object() -> Path:
    """A real ELF shared object that any Python can dlopen: the stdlib `_json` extension module."""
    import _json

    path = getattr(_json, "__file__", None)
    if path:
        return Path(path)
    # _json built in: take any extension module from lib-dynload
    dynload = Path(sysconfig.get_paths()["platstdlib"]) / "lib-dynload"
    return next(dynload.glob("*.so"))


def copy_library(dest: Path) -> Path:
    """Copy the sample shared object to `dest` (a real, loadable file under any name)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(sample_shared_object(), dest)
    return dest


@contextlib.contextmanager
def holding(paths: Sequence[str | os.PathLike[str]], *, child: bool = False,
            timeout: float = 20.0) -> Iterator[tuple[int, int]]:
    """Yield (pid, loader_pid): the started process and the one that mapped `paths` (the same unless child)."""
    args = [str(p) for p in paths]
    if child:
        argv = [sys.executable, "-c", _PARENT, _HOLDER, *args]
    else:
        argv = [sys.executable, "-c", _HOLDER, *args]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    loader = proc.pid
    grandchild: int | None = None
    try:
        if child:
            grandchild = int(proc.stdout.readline().strip())  # type: ignore[union-attr]
            loader = grandchild
            _wait_mapped(grandchild, args, timeout)
        else:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if line.strip() != "ready":
                raise RuntimeError(f"library holder did not start: {line!r}")
        yield proc.pid, loader
    finally:
        for pid in (grandchild, proc.pid):
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=10)
        if proc.stdout:
            proc.stdout.close()


def _wait_mapped(pid: int, paths: Sequence[str], timeout: float) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            maps = ""
        if all(os.path.realpath(p) in maps for p in paths):
            return
        time.sleep(0.05)
    raise RuntimeError(f"process {pid} did not map {paths} within {timeout}s")
