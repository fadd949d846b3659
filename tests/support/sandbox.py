"""pytest fixtures for the real systemd sandbox.

    systemd_sandbox  (session)   one sandbox for the whole run: SandboxEnv(sandbox, systemd, unit_dir)
    sandbox_env      (function)  the same SandboxEnv, cleaned after each test: units the test added are
                                 stopped, disabled and removed (drop-ins and .wants links too), transient
                                 units stopped, reset-failed, daemon-reload

Sandboxes and test boxes live under $DEPLOYTOOL_TEST_ROOT (default /var/lib/deploytool-test), one directory per
test run holding `owner.json` (the pytest process's PID and start time). A run that was killed leaves its
sandbox up; the next run finds it by its dead owner and takes it down, by PID and cgroup, never by name.
The machine's /proc/1/cgroup is recorded at session start and compared at session end.

conftest.py imports this module with `from tests.support.sandbox import *`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from deploy_tool import proc
from deploy_tool.box.systemd import Systemd
from deploy_tool.errors import DeployError
from deploy_tool.rehearsal.sandbox import MARKER, Sandbox

__all__ = ["systemd_sandbox", "sandbox_env", "own_sandbox", "visible_dir", "pytest_sessionstart",
           "pytest_sessionfinish"]

# Where every test box (sandbox directories, demo boxes with their demo-root/) lives: one directory per run,
# somewhere the rendered units can see it wherever the checkout is. Not under /tmp or /var/tmp (the units run
# with PrivateTmp=yes: a release there is hidden from the server, and a sandbox there cannot start them, status
# 203/EXEC), not in a home directory (ProtectHome=; a 0700 /root is closed to the servers' DynamicUser), and
# world-traversable all the way down (root-owned 0755), as on the real box.
RUN_PARENT = Path(os.environ.get("DEPLOYTOOL_TEST_ROOT", "/var/lib/deploytool-test"))
CGROUP_PREFIX = "deploytool-sandbox-"


@dataclass
class SandboxEnv:
    sandbox: Sandbox
    systemd: Systemd

    @property
    def unit_dir(self) -> Path:
        return self.sandbox.unit_dir

    def run(self, *cmd: str, ok: tuple[int, ...] = (0,)) -> proc.Result:
        """Run a command inside the sandbox."""
        return proc.run(self.sandbox.exec_argv(*cmd), ok=ok, timeout=60)


def _start_time(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def new_run_dir(tag: str = "run") -> Path:
    """A fresh directory for this test process's sandboxes, stamped with its owner (this process)."""
    RUN_PARENT.mkdir(parents=True, exist_ok=True)
    os.chmod(RUN_PARENT, 0o755)  # whatever the umask: the servers' DynamicUser must pass through
    root = RUN_PARENT / f"{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    (root / "owner.json").write_text(json.dumps({"pid": os.getpid(), "start": _start_time(os.getpid())}))
    return root


def sweep_orphans() -> list[str]:
    """Take down sandboxes left by killed test runs (owner process gone) and delete their directories."""
    swept = []
    if not RUN_PARENT.is_dir():
        return swept
    for root in sorted(RUN_PARENT.iterdir()):
        try:
            owner = json.loads((root / "owner.json").read_text())
        except (OSError, ValueError):
            continue
        if _start_time(int(owner["pid"])) == owner.get("start"):
            continue  # its test run is still going
        for d in sorted(d for d in root.iterdir() if (d / MARKER).is_file()):
            with contextlib.suppress(DeployError):
                Sandbox(d).down()
        shutil.rmtree(root, ignore_errors=True)
        swept.append(str(root))
    return swept


def leftover_cgroups() -> list[str]:
    """Every sandbox sub-cgroup on the machine (any run's), found by its name prefix."""
    out = []
    for top, dirs, _ in os.walk("/sys/fs/cgroup"):
        for d in list(dirs):
            if d.startswith(CGROUP_PREFIX):
                out.append(os.path.join(top, d))
                dirs.remove(d)
        if top.count("/") >= 9:
            dirs.clear()
    return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (tests.support.backends.free_port: why not port 0's)."""
    from tests.support.backends import free_port as pick

    return pick("127.0.0.1")


def wait_http(port: int, timeout: float = 10.0) -> bool:
    """True once http://127.0.0.1:port/ answers (any status), False after `timeout`."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1):
                return True
        except urllib.error.HTTPError:
            return True
        except OSError:
            time.sleep(0.05)
    return False


def port_closed(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) != 0


# ----------------------------------------------------------------------------------- session-wide check

_P1_CGROUP = pytest.StashKey[str]()


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_P1_CGROUP] = Path("/proc/1/cgroup").read_text()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not hasattr(session.config, "workerinput"):  # the run's main process (xdist's controller, or the only one)
        from tests.support import lock_cache

        lock_cache.remove_own()
    before = session.config.stash.get(_P1_CGROUP, None)
    after = Path("/proc/1/cgroup").read_text()
    if before is not None and before != after:
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        msg = f"/proc/1/cgroup changed during the test run!\nbefore:\n{before}\nafter:\n{after}"
        if tr is not None:
            tr.write_line(msg, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# ----------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def systemd_sandbox() -> Iterator[SandboxEnv]:
    """One real sandboxed systemd for the whole test run; taken down (and checked gone) at the end."""
    p1_before = Path("/proc/1/cgroup").read_text()
    sweep_orphans()
    root = new_run_dir("session")
    sb = Sandbox(root / "sandbox")
    try:
        sb.up()  # on failure it has already taken down what it started
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    try:
        env = SandboxEnv(sb, Systemd(sb.systemctl_prefix(), sb.journalctl_prefix(), sb.unit_dir))
        yield env
    finally:
        sb.down()
        shutil.rmtree(root, ignore_errors=True)
    assert Path("/proc/1/cgroup").read_text() == p1_before, "the machine's /proc/1/cgroup changed"
    assert not [c for c in leftover_cgroups() if sb.cgroup_name in c], "sandbox sub-cgroups left behind"


_BASE_UNITS = ("systemd-journald.service",)


def _active_services(env: SandboxEnv) -> set[str]:
    res = env.run("systemctl", "list-units", "--plain", "--no-legend", "--no-pager", "--all",
                  "--type=service,socket,timer,path", "--state=active,activating,deactivating,reloading,failed")
    return {line.split()[0] for line in res.stdout.splitlines() if line.strip()}


@dataclass(frozen=True)
class Snapshot:
    files: frozenset[str]
    units: frozenset[str]


def snapshot(env: SandboxEnv) -> Snapshot:
    """What the sandbox holds now: unit-dir entries and active/failed units."""
    return Snapshot(frozenset(os.listdir(env.unit_dir)), frozenset(_active_services(env)))


def restore(env: SandboxEnv, snap: Snapshot) -> None:
    """Bring the sandbox back to `snap`: stop and disable newer units, delete newer files, reset-failed, reload."""
    sd = env.systemd
    new_files = set(os.listdir(env.unit_dir)) - snap.files
    units = {n for n in new_files if not n.endswith((".d", ".wants", ".requires"))}
    units |= _active_services(env) - snap.units - set(_BASE_UNITS)
    for unit in sorted(units):
        with contextlib.suppress(DeployError):
            sd.stop(unit)
        with contextlib.suppress(DeployError):
            if (env.unit_dir / unit).is_file():
                sd.disable(unit)
    for name in sorted(set(os.listdir(env.unit_dir)) - snap.files):
        p = env.unit_dir / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    sd.reset_failed()
    sd.daemon_reload()


@pytest.fixture()
def sandbox_env(systemd_sandbox: SandboxEnv) -> Iterator[SandboxEnv]:
    """The session sandbox, left as clean as found after the test: its units stopped, removed, reloaded."""
    snap = snapshot(systemd_sandbox)
    yield systemd_sandbox
    restore(systemd_sandbox, snap)


@pytest.fixture()
def visible_dir() -> Iterator[Path]:
    """A fresh directory where a box's files can live as on a real box: the rendered units see it (not under /tmp,
    not in a home) and the servers' DynamicUser can pass through every directory on the way. Removed afterwards."""
    root = new_run_dir("box")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def own_sandbox() -> Iterator[SandboxEnv]:
    """A sandboxed systemd for one test module alone: a module that installs a box of its own (same unit names
    as the session's installed box) must not meet the other box's running units."""
    root = new_run_dir("module")
    sb = Sandbox(root / "sandbox")
    try:
        sb.up()
        yield SandboxEnv(sb, Systemd(sb.systemctl_prefix(), sb.journalctl_prefix(), sb.unit_dir))
    finally:
        sb.down()
        shutil.rmtree(root, ignore_errors=True)
