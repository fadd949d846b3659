"""The fleet test bed: N sandboxed hosts on this machine, each a real systemd + sshd, driven by real ansible-core.

    fleet              (fixture, function)  a Fleet of 3 hosts h1..h3 (10.231.0.11-13), up for one test, then taken
                                            down and checked gone (`indirect` parametrization gives another N)
    running_fleet(n)   the context manager behind it: machine-wide lock, sweep of killed runs' fleets, up, down, check
    Fleet              up / down / exec / ansible / playbook / leftovers / mem of one fleet directory

A test module gets the fixture with `from tests.support.fleet import fleet_fixture` (it registers as `fleet`).

A host (tests/support/fleet/fleet-ns.sh) is the machine's own /usr/lib/systemd/systemd as PID 1 of private
pid/mount/uts/ipc/cgroup namespaces, started from a sub-cgroup of its own in every hierarchy (the root of its cgroup
namespace, so it can never move the machine's processes), with its own network namespace `fleet-hN` whose veth
`fv-hN` is on the bridge `fleetbr0` (10.231.0.1/24, the controller's address; no route out, no NAT), a copy-on-write
root (overlayfs over the machine's /, upper layer on a tmpfs: nothing a host writes reaches the machine's disk) and
Debian's ssh.service listening on the host's address, root login with the fleet's own key only. The controller is
this machine: ansible-core pinned in a venv of its own (.cache/fleet-ansible, made by `make setup`), over ssh.
Every systemctl/journalctl goes into a host (Fleet.exec or ssh), never to the machine itself.

A fleet's directory is $DEPLOYTOOL_TEST_ROOT/fleet-<pid>-<hex> (default /var/lib/deploytool-test, like the test
boxes), wherever the checkout is: that directory goes into overlayfs mount options and into ssh's and ansible's option
lists, so it must hold no space, comma or colon, while the checkout path may (nothing of the checkout goes into such
a list: the scripts are run from it, the ansible callback is copied into the fleet directory). It holds
`fleet-owner.json` (the test process's PID and start time), not `owner.json`: the sandbox sweep leaves it alone, and
the next fleet run takes down a fleet whose owner was killed (by its recorded PIDs and sub-cgroups, never by name).
One fleet per machine (fixed bridge, subnet and netns names): a lock file serializes test runs.

While a fleet is up, the test process is a child subreaper: the hosts' launchers (`unshare`), ansible's ssh
ControlPersist masters and the intermediate processes they detach through become its children when their parents
exit, and are reaped here by PID (left to the machine's PID 1 they would linger as zombies).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.sandbox import RUN_PARENT

__all__ = ["Fleet", "FleetError", "AnsibleRun", "fleet_fixture", "running_fleet", "sweep_orphan_fleets", "host_ip",
           "machine_lock", "new_fleet_dir", "subreaper", "ANSIBLE_BIN", "SCRIPTS", "BRIDGE", "CONTROLLER_IP"]

SCRIPTS = Path(__file__).resolve().with_name("fleet")
REPO = Path(__file__).resolve().parents[2]
ANSIBLE_BIN = REPO / ".cache" / "fleet-ansible" / "bin"
COLLECTION_SRC = REPO / "ansible"  # the deploytool.fleet collection's source (galaxy.yml)
BRIDGE = "fleetbr0"
CONTROLLER_IP = "10.231.0.1"
OWNER = "fleet-owner.json"
LOCK_NAME = "fleet.lock"
_UNSAFE = re.compile(r"[\s,:]")
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


class FleetError(Exception):
    """The fleet could not be brought up or taken down; the message says what and where to look."""


def host_ip(i: int) -> str:
    """Address of host hI on the bridge."""
    return f"10.231.0.{10 + i}"


@dataclass(frozen=True)
class Proc:
    pid: int
    start: int  # clock ticks since boot (field 22 of /proc/PID/stat): guards against PID reuse


def _stat_fields(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _start_time(pid: int) -> int | None:
    f = _stat_fields(pid)
    return int(f[19]) if f else None


def _proc(pid: int) -> Proc | None:
    start = _start_time(pid)
    return Proc(pid, start) if start is not None else None


def _exists(p: Proc) -> bool:
    """True while `p` is in the process table (running or a zombie), same PID and start time."""
    return _start_time(p.pid) == p.start


def _zombie_or_gone(p: Proc) -> bool:
    f = _stat_fields(p.pid)
    return f is None or int(f[19]) != p.start or f[0] in ("Z", "X")


def _readlink(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def subreaper(on: bool) -> bool:
    """Make this process a child subreaper (or not); returns the previous setting."""
    libc = _libc()
    prev = ctypes.c_int(0)
    libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(prev), 0, 0, 0)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1 if on else 0, 0, 0, 0)
    return bool(prev.value)


@dataclass
class AnsibleRun:
    """One ansible or ansible-playbook run: exit code, screen output, and what the fleet_record callback
    (tests/support/fleet/callback_plugins) wrote: every task's per-host results and the recap."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    data: dict[str, Any] | None = None

    @property
    def stats(self) -> dict[str, dict[str, int]]:
        """Per-host recap (ok, changed, failures, unreachable, ...) from the JSON callback."""
        assert self.data is not None, f"no results recorded (run with json_out=True)\n{self}"
        return self.data["stats"]

    def task_results(self, name: str) -> dict[str, dict[str, Any]]:
        """host -> result of the task called `name` (the last one of that name when there are several)."""
        assert self.data is not None, f"no results recorded (run with json_out=True)\n{self}"
        out: dict[str, dict[str, Any]] = {}
        for task in self.data["tasks"]:
            if task["name"] == name:
                out.update(task["hosts"])
        return out

    def __str__(self) -> str:
        return (f"$ {' '.join(self.argv)}\nexit {self.returncode} after {self.seconds:.1f} s\n"
                f"--- stdout\n{self.stdout[-6000:]}\n--- stderr\n{self.stderr[-3000:]}")


@dataclass
class _Record:
    """What `up` made, recorded while it was up, so that `leftovers` can look for each piece after `down`."""

    procs: set[Proc] = field(default_factory=set)        # PID 1s, launchers, everything seen in the hosts
    pidns: set[str] = field(default_factory=set)         # the hosts' pid namespaces ("pid:[inode]")
    cgroups: set[str] = field(default_factory=set)       # the hosts' sub-cgroup directories
    netns: set[str] = field(default_factory=set)
    veths: set[str] = field(default_factory=set)
    pid1_cgroup: str = ""                                # the machine's /proc/1/cgroup before up


class Fleet:
    """The fleet whose working directory is `dir` (see the module doc for what lives where)."""

    def __init__(self, dir: str | os.PathLike[str]) -> None:
        self.dir = Path(os.path.realpath(os.fspath(dir)))
        if _UNSAFE.search(str(self.dir)) or str(self.dir).startswith(("/tmp/", "/var/tmp/")):
            raise FleetError(f"fleet directory {str(self.dir)!r}: it must not be under /tmp or /var/tmp nor hold "
                             "a space, comma or colon (overlayfs, ssh and ansible options are built from it)")
        self.hosts: list[str] = []
        self.up_seconds = 0.0
        self.boot_ms: dict[str, int] = {}  # per host, from fleet-ns.sh: preparation to systemd "running"
        self.record = _Record()
        self._reaper_prev: bool | None = None

    def __repr__(self) -> str:
        return f"Fleet({str(self.dir)!r}, hosts={self.hosts})"

    # ----------------------------------------------------------------- paths

    @property
    def ansible_cfg(self) -> Path:
        return self.dir / "ansible.cfg"

    @property
    def inventory(self) -> Path:
        return self.dir / "inventory.ini"

    @property
    def ssh_config(self) -> Path:
        return self.dir / "ssh" / "config"

    @property
    def started(self) -> bool:
        """True once `fleet.sh up` got past its checks here (it then records the machine's /proc/1/cgroup)."""
        return (self.dir / "pid1-cgroup.before").is_file()

    def host_dir(self, host: str) -> Path:
        return self.dir / "hosts" / host

    def ip(self, host: str) -> str:
        return host_ip(int(host.lstrip("h")))

    # ----------------------------------------------------------------- scripts

    def _script(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "FLEET_DIR": str(self.dir)}
        return subprocess.run(["bash", str(SCRIPTS / "fleet.sh"), *args], env=env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def exec(self, host: str, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """Run `cmd` inside host `host` (all its namespaces): systemctl, journalctl, cat, ..."""
        return self._script("exec", host, *cmd, timeout=timeout)

    def pid1(self, host: str) -> int:
        return int((self.host_dir(host) / "pid").read_text())

    def host_cgroup_name(self, host: str) -> str:
        """The name of host's sub-cgroup (the root of its cgroup namespace), `fleetns-<hash>`."""
        first = (self.host_dir(host) / "cgroups").read_text().split()[0]
        return Path(first).name

    def console_tail(self, lines: int = 15) -> str:
        out = []
        for log in sorted(self.dir.glob("hosts/*/console.log")) + sorted(self.dir.glob("hosts/*/launcher.log")):
            with contextlib.suppress(OSError):
                text = log.read_text(errors="replace").strip()
                if text:
                    out.append(f"--- {log.relative_to(self.dir)}\n" + "\n".join(text.splitlines()[-lines:]))
        return "\n".join(out)

    # ----------------------------------------------------------------- up / down

    def up(self, n: int = 3) -> None:
        """Boot hosts h1..hN. On any failure, what was started is taken down before FleetError is raised."""
        if subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode == 0:
            raise FleetError(f"bridge {BRIDGE} exists: a fleet is already up on this machine (one at a time); "
                             f"take it down with FLEET_DIR=<its directory> {SCRIPTS / 'fleet.sh'} down")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.record = _Record(pid1_cgroup=Path("/proc/1/cgroup").read_text())
        self._reaper_prev = subreaper(True)
        try:
            self._up(n)
        except BaseException as exc:
            logs = self.console_tail()
            with contextlib.suppress(Exception):
                self.down()
            if isinstance(exc, subprocess.TimeoutExpired):
                raise FleetError(f"fleet.sh up {n} did not finish in {exc.timeout:.0f} s\n{logs}") from None
            if isinstance(exc, FleetError):
                exc.args = (f"{exc.args[0]}\n{logs}",)
            raise

    def _up(self, n: int) -> None:
        t0 = time.monotonic()
        r = self._script("up", str(n))
        self.up_seconds = time.monotonic() - t0
        if r.returncode != 0:
            raise FleetError(f"fleet.sh up {n} failed (exit {r.returncode}):\n{r.stdout}{r.stderr}")
        self.hosts = [f"h{i}" for i in range(1, n + 1)]
        self.boot_ms = {m[1]: int(m[2]) for m in re.finditer(r"^(h\d+): up in (\d+) ms", r.stdout, re.M)}
        for h in self.hosts:
            b = self.host_dir(h)
            for name in ("pid", "launcher.pid"):
                p = _proc(int((b / name).read_text()))
                if p is not None:
                    self.record.procs.add(p)
            self.record.pidns.add(_readlink(f"/proc/{self.pid1(h)}/ns/pid") or "")
            self.record.cgroups.update((b / "cgroups").read_text().split())
            self.record.netns.add((b / "netns").read_text().strip())
            self.record.veths.add((b / "veth").read_text().strip())
        self.record.pidns.discard("")
        self.note_processes()

    def _adopt(self) -> None:
        """Take the record of a fleet that another process brought up (a killed test run's) from its directory:
        the hosts' PIDs, sub-cgroups, netns and veths as fleet-ns.sh wrote them, so that `leftovers` can check
        each of them after `down`."""
        before = self.dir / "pid1-cgroup.before"
        self.record = _Record(pid1_cgroup=before.read_text() if before.is_file() else "")
        for b in sorted(self.dir.glob("hosts/*/")):
            with contextlib.suppress(OSError, ValueError):
                self.record.cgroups.update((b / "cgroups").read_text().split())
            for name in ("pid", "launcher.pid"):
                with contextlib.suppress(OSError, ValueError):
                    p = _proc(int((b / name).read_text()))
                    if p is not None:
                        self.record.procs.add(p)
            for name, dest in (("netns", self.record.netns), ("veth", self.record.veths)):
                with contextlib.suppress(OSError):
                    dest.add((b / name).read_text().strip())
        self.record.netns.discard("")
        self.record.veths.discard("")

    def note_processes(self) -> set[Proc]:
        """Record every process now in the hosts (by their sub-cgroups) and ansible's ssh masters for this fleet;
        `leftovers` checks each of them, by PID and start time, after `down`. Returns what it saw."""
        seen: set[Proc] = set()
        for cg in self.record.cgroups:
            for top, _, files in os.walk(cg):
                if "cgroup.procs" in files:
                    with contextlib.suppress(OSError):
                        for x in Path(top, "cgroup.procs").read_text().split():
                            p = _proc(int(x))
                            if p is not None:
                                seen.add(p)
        seen |= self._ssh_masters()
        self.record.procs |= seen
        return seen

    def _ssh_masters(self) -> set[Proc]:
        mark = f"{self.dir}/ansible-home/cp/".encode()
        out = set()
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if mark in Path(entry.path, "cmdline").read_bytes():
                        p = _proc(int(entry.name))
                        if p is not None:
                            out.add(p)
        return out

    def down(self) -> None:
        """Power the hosts off (SIGKILL of their PID 1 as fallback), remove their cgroups, veths, netns, the
        bridge and ansible's ssh masters, and reap what became our children. Idempotent."""
        if self.started:
            if not self.record.cgroups:
                self._adopt()
            self.note_processes()
            r = self._script("down", timeout=120)
            if r.returncode != 0:
                raise FleetError(f"fleet.sh down failed (exit {r.returncode}):\n{r.stdout}{r.stderr}")
        self._reap()
        self._reap_ssh_orphans()
        if self._reaper_prev is not None:
            subreaper(self._reaper_prev)
            self._reaper_prev = None

    @staticmethod
    def _reap_ssh_orphans() -> None:
        """waitpid() the exited ssh processes that ansible's runs left to us: a ControlPersist master detaches
        through an intermediate process whose parent never waits for it; as child subreaper we inherit it. This
        process starts no ssh itself, so an exited `ssh` child of ours is one of those."""
        me = os.getpid()
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(entry.path, "stat").read_text()
                comm = stat[stat.index("(") + 1:stat.rindex(")")]
                f = stat.rsplit(")", 1)[1].split()
                if comm == "ssh" and f[0] == "Z" and int(f[1]) == me:
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(int(entry.name), os.WNOHANG)

    def _reap(self, timeout: float = 5.0) -> None:
        """waitpid() the recorded processes that are our children once they exit (launchers, ssh masters)."""
        me = os.getpid()
        deadline = time.monotonic() + timeout
        pending = {p for p in self.record.procs if _exists(p)}
        while pending and time.monotonic() < deadline:
            for p in list(pending):
                f = _stat_fields(p.pid)
                if f is None or int(f[19]) != p.start:
                    pending.discard(p)
                elif int(f[1]) != me:
                    pending.discard(p)  # not our child: nothing to reap (leftovers() reports it if it runs on)
                elif f[0] in ("Z", "X"):
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(p.pid, os.WNOHANG)
            if pending:
                time.sleep(0.02)

    # ----------------------------------------------------------------- checks

    def leftovers(self) -> list[str]:
        """Everything of this fleet still on the machine (empty = clean): the scripts' own check (fleet netns,
        veths, bridge, `fleetns-*` cgroups, processes naming the fleet dir, mounts, /proc/1/cgroup) plus each
        recorded process by PID and start time (zombies too), any process in a host's pid namespace, each
        recorded cgroup, netns and veth, and /proc/1/cgroup against its copy from before `up`."""
        if not self.started:
            return []  # `fleet.sh up` never got past its checks here: nothing of this fleet was made
        out: list[str] = []
        r = self._script("check")
        if r is not None and r.returncode != 0:
            out += [f"fleet.sh check: {line}" for line in (r.stdout + r.stderr).splitlines() if line.strip()]
        for p in sorted(self.record.procs, key=lambda p: p.pid):
            if _exists(p):
                f = _stat_fields(p.pid) or ["?"]
                out.append(f"process {p.pid} (state {f[0]}) still there")
        me = os.getpid()
        for entry in os.scandir("/proc"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(entry.path, "stat").read_text() if entry.name.isdigit() else ""
                f = stat.rsplit(")", 1)[1].split() if stat else []
                if f and f[0] == "Z" and int(f[1]) == me and "(ssh)" in stat:
                    out.append(f"process {entry.name} (ssh) exited but was not reaped")
        if self.record.pidns:
            for entry in os.scandir("/proc"):
                if entry.name.isdigit() and _readlink(f"{entry.path}/ns/pid") in self.record.pidns:
                    out.append(f"process {entry.name} lives in a host's pid namespace")
        out += [f"cgroup {c} still there" for c in sorted(self.record.cgroups) if os.path.isdir(c)]
        out += [f"netns {n} still there" for n in sorted(self.record.netns) if os.path.exists(f"/run/netns/{n}")]
        for v in sorted(self.record.veths):
            if subprocess.run(["ip", "link", "show", v], capture_output=True).returncode == 0:
                out.append(f"veth {v} still there")
        if subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode == 0:
            out.append(f"bridge {BRIDGE} still there")
        mountinfo = Path("/proc/self/mountinfo").read_text()
        out += [f"mount: {line}" for line in mountinfo.splitlines()
                if f" {self.dir}/" in line or f" {self.dir} " in line or " /run/netns/fleet-" in line]
        if self.record.pid1_cgroup and Path("/proc/1/cgroup").read_text() != self.record.pid1_cgroup:
            out.append("the machine's /proc/1/cgroup changed")
        return out

    def mem(self) -> str:
        """Per host: processes, RSS, PSS and the memory cgroup's usage (which includes its tmpfs files)."""
        return self._script("mem").stdout

    # ----------------------------------------------------------------- ansible

    def ansible_env(self, results: Path | None = None) -> dict[str, str]:
        """The environment of an ansible run against this fleet (the fleet's ansible.cfg, the pinned ansible-core
        first on PATH); with `results`, the fleet_record callback writes the run's results there as JSON."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
        env.update(ANSIBLE_CONFIG=str(self.ansible_cfg), FLEET_DIR=str(self.dir), LANG="C.UTF-8", LC_ALL="C.UTF-8",
                   PATH=f"{ANSIBLE_BIN}:{env.get('PATH', '/usr/bin:/bin')}", ANSIBLE_NOCOLOR="1",
                   ANSIBLE_COLLECTIONS_PATH=str(self.collections_dir))
        if results is not None:
            # a copy in the fleet dir: ANSIBLE_CALLBACK_PLUGINS is a colon-separated list, the checkout path may
            # hold a colon
            plugins = self.dir / "callback_plugins"
            if not plugins.is_dir():
                shutil.copytree(SCRIPTS / "callback_plugins", plugins, ignore=shutil.ignore_patterns("__pycache__"))
            env.update(ANSIBLE_CALLBACK_PLUGINS=str(plugins),
                       ANSIBLE_CALLBACKS_ENABLED="fleet_record", ANSIBLE_LOAD_CALLBACK_PLUGINS="1",
                       FLEET_RESULTS=str(results))
        return env

    @property
    def collections_dir(self) -> Path:
        """Where `install_collection` puts the deploytool.fleet collection (ANSIBLE_COLLECTIONS_PATH of every run)."""
        return self.dir / "collections"

    def install_collection(self, source: Path = COLLECTION_SRC) -> Path:
        """Build the collection in `source` with `ansible-galaxy collection build` and install the tarball into
        `collections_dir`, as a user would; returns the tarball. Idempotent (--force)."""
        out = self.dir / "collection-build"
        galaxy = str(ANSIBLE_BIN / "ansible-galaxy")
        self._galaxy(galaxy, "collection", "build", str(source), "--output-path", str(out), "--force")
        tarball = max(out.glob("deploytool-fleet-*.tar.gz"), key=lambda p: p.stat().st_mtime)
        self._galaxy(galaxy, "collection", "install", "--force", "-p", str(self.collections_dir), str(tarball))
        return tarball

    def _galaxy(self, *argv: str) -> None:
        r = subprocess.run(argv, env=self.ansible_env(), capture_output=True, text=True, timeout=120, cwd=self.dir,
                           stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            raise FleetError(f"{' '.join(argv)} failed (exit {r.returncode}):\n{r.stdout}{r.stderr}")

    def _ansible(self, tool: str, args: Sequence[str], *, inventory: Path | None, json_out: bool,
                 timeout: float) -> AnsibleRun:
        exe = ANSIBLE_BIN / tool
        if not exe.is_file():
            raise FleetError(f"{exe} is missing: the fleet test bed's ansible-core is installed by `make setup` "
                             "(scripts/setup.sh)")
        argv = [str(exe), *(["-i", str(inventory)] if inventory else []), *args]
        results = self.dir / f"results-{uuid.uuid4().hex[:8]}.json"
        t0 = time.monotonic()
        r = subprocess.run(argv, env=self.ansible_env(results if json_out else None), capture_output=True,
                           text=True, timeout=timeout, cwd=self.dir, stdin=subprocess.DEVNULL)
        self._reap_ssh_orphans()
        run = AnsibleRun(argv, r.returncode, r.stdout, r.stderr, time.monotonic() - t0)
        if json_out:
            with contextlib.suppress(OSError, ValueError):
                run.data = json.loads(results.read_text())
        self.note_processes()
        return run

    def ansible(self, pattern: str, *args: str, inventory: Path | None = None, json_out: bool = True,
                timeout: float = 120) -> AnsibleRun:
        """An ad-hoc `ansible PATTERN ARGS...` run from this machine over ssh."""
        return self._ansible("ansible", [pattern, *args], inventory=inventory, json_out=json_out, timeout=timeout)

    def playbook(self, playbook: str | os.PathLike[str], *args: str, inventory: Path | None = None,
                 json_out: bool = True, timeout: float = 180) -> AnsibleRun:
        """`ansible-playbook PLAYBOOK ARGS...`; a bare name is one of the playbooks in tests/support/fleet/."""
        path = Path(playbook)
        if not path.is_absolute() and not path.exists():
            path = SCRIPTS / path
        return self._ansible("ansible-playbook", [str(path), *args], inventory=inventory, json_out=json_out,
                             timeout=timeout)

    def inventory_with(self, name: str, lines: dict[str, str], after: str | None = None) -> Path:
        """A copy of the fleet's inventory with extra `host vars...` lines (after host `after`, else at the end)."""
        out = []
        for line in self.inventory.read_text().splitlines():
            out.append(line)
            if after and line.split(" ", 1)[0] == after:
                out += [f"{h} {v}" for h, v in lines.items()]
        if not after:
            out += [f"{h} {v}" for h, v in lines.items()]
        path = self.dir / f"inventory-{name}.ini"
        path.write_text("\n".join(out) + "\n")
        return path


# --------------------------------------------------------------------------------------- run directories


def _base() -> Path:
    base = Path(os.path.realpath(RUN_PARENT))
    if _UNSAFE.search(str(base)) or str(base).startswith(("/tmp/", "/var/tmp/")):
        raise FleetError(f"DEPLOYTOOL_TEST_ROOT={str(base)!r} cannot hold a fleet: it must not be under /tmp or "
                         "/var/tmp nor hold a space, comma or colon; unset it (default /var/lib/deploytool-test)")
    base.mkdir(parents=True, exist_ok=True)
    return base


def new_fleet_dir() -> Path:
    d = _base() / f"fleet-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    d.mkdir(mode=0o755)
    (d / OWNER).write_text(json.dumps({"pid": os.getpid(), "start": _start_time(os.getpid())}) + "\n")
    return d


def _owner_alive(d: Path) -> bool:
    try:
        owner = json.loads((d / OWNER).read_text())
        return _start_time(int(owner["pid"])) == owner.get("start")
    except (OSError, ValueError, KeyError, TypeError):
        return False


def sweep_orphan_fleets() -> list[str]:
    """Take down fleets left by killed test runs (owner process gone) and delete their directories."""
    swept = []
    base = _base()
    for d in sorted(base.glob("fleet-*")):
        if not d.is_dir() or not (d / OWNER).is_file() or _owner_alive(d):
            continue
        f = Fleet(d)
        f.down()
        left = f.leftovers()
        if left:
            raise FleetError(f"a killed test run's fleet at {d} could not be taken down:\n" + "\n".join(left))
        shutil.rmtree(d, ignore_errors=True)
        swept.append(str(d))
    return swept


@contextlib.contextmanager
def machine_lock(timeout: float = 600) -> Iterator[None]:
    """One fleet per machine: hold an exclusive lock on $DEPLOYTOOL_TEST_ROOT/fleet.lock while a fleet is up."""
    fd = os.open(_base() / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise FleetError(f"another test run holds the fleet test bed ({_base() / LOCK_NAME}) for over "
                                     f"{timeout:.0f} s") from None
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def running_fleet(n: int = 3) -> Iterator[Fleet]:
    """Hosts h1..hN up for the `with` body; always taken down afterwards, then checked: FleetError lists anything
    left (the fleet directory is then kept for a look and for the next run's sweep; it is removed when clean)."""
    with machine_lock():
        sweep_orphan_fleets()
        f = Fleet(new_fleet_dir())
        try:
            f.up(n)  # on failure it has taken down what it started
        except BaseException:
            if not f.started:
                shutil.rmtree(f.dir, ignore_errors=True)
            raise
        try:
            yield f
        finally:
            f.down()
            left = f.leftovers()
            if left:
                raise FleetError(f"the fleet at {f.dir} left things behind:\n" + "\n".join(left))
            shutil.rmtree(f.dir, ignore_errors=True)


@pytest.fixture(name="fleet")
def fleet_fixture(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    """A fleet of 3 hosts (or `request.param` with indirect parametrization) for one test; taken down and checked
    gone afterwards (a teardown error lists what was left)."""
    with running_fleet(getattr(request, "param", 3)) as f:
        yield f
