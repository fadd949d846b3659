"""`deploytool lock` once per test run for every cpu-demo box of the run.

Each test box (the session's installed box, the install fault box, the bootstrap, secrets and fleet boxes) is
packed from the same requirements.in, so their locks are the same file and their tool wheels (deploytool's own
wheel built from this checkout, and its dependencies) the same wheels; a lock costs ~12 s. The first box of a run
(of any xdist worker) runs the real `deploytool lock`; every later box gets a copy of what it wrote. Nothing is kept between runs: the cache
lives in $DEPLOYTOOL_TEST_ROOT/lock-cache-<run>/, owned (owner.json) by the run's main pytest process, which
removes it at the end (a killed run's is swept by the next, as a sandbox is).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import yaml

from tests.support.sandbox import RUN_PARENT, _start_time


def _main_pid() -> int:
    """The run's main pytest process: an xdist worker's parent, else this process."""
    return os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()


def run_dir(pid: int | None = None) -> Path:
    pid = pid or _main_pid()
    return RUN_PARENT / f"lock-cache-{pid}-{_start_time(pid)}"


@contextlib.contextmanager
def _locked(d: Path) -> Iterator[None]:
    with open(d / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _paths(cfg: Path) -> tuple[Path, Path, str]:
    """cfg's lock file, its tool wheels directory (the config's default when unset), and the key of what a lock
    of it depends on (the requirements, the lock mode, the python)."""
    b = yaml.safe_load(cfg.read_text())["bundle"]

    def at(p: str) -> Path:
        return (cfg.parent / p) if not p.startswith("/") else Path(p)

    key = json.dumps([hashlib.sha256(at(b["requirements"]).read_bytes()).hexdigest(), b.get("lock_mode"),
                      b.get("python")]).encode()
    return at(b["lock"]), at(b.get("tool_wheels_dir") or "tool-wheels"), hashlib.sha256(key).hexdigest()[:16]


def lock(cfg: Path, real_lock: Callable[[], None]) -> bool:
    """Give cfg's box its lock and tool wheels: a copy of this run's first lock of the same inputs, else
    `real_lock()` (deploytool lock), whose results are then kept for the next box. True if it was a copy."""
    lock_path, tool, key = _paths(cfg)
    d = run_dir()
    RUN_PARENT.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        d.mkdir(mode=0o755)
        pid = _main_pid()
        (d / "owner.json").write_text(json.dumps({"pid": pid, "start": _start_time(pid)}))
    entry = d / key
    with _locked(d):
        if (entry / "done").is_file():
            shutil.copyfile(entry / "requirements.lock", lock_path)
            if (entry / "tool-wheels").is_dir():
                shutil.rmtree(tool, ignore_errors=True)
                shutil.copytree(entry / "tool-wheels", tool)
            return True
        real_lock()
        shutil.rmtree(entry, ignore_errors=True)
        entry.mkdir()
        shutil.copyfile(lock_path, entry / "requirements.lock")
        if tool.is_dir():
            shutil.copytree(tool, entry / "tool-wheels")
        (entry / "done").touch()
        return False


def remove_own() -> None:
    """The main pytest process, at the end of its run: its cache goes."""
    shutil.rmtree(run_dir(os.getpid()), ignore_errors=True)
