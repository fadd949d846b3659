"""A real systemd manager in private namespaces, for rehearsals and tests on machines whose PID 1 is not systemd.

The machine's own `/usr/lib/systemd/systemd` runs as PID 1 of private pid/mount/uts/ipc/cgroup namespaces on
the host root file system. It is started from a sub-cgroup of its own in every cgroup hierarchy, and the
cgroup namespace is rooted there, so it can never move the machine's other processes into its cgroups.
Inside: private `/run`, `/dev` and journal (volatile), read-only `/proc/sys` and `/sys`, generators
disabled, journald's audit socket masked, `DIR/etc-systemd-system` bind-mounted over `/etc/systemd/system`
and a hand-picked set of stock units over `/usr/lib/systemd/system`. The network namespace is shared, so a
service bound to 127.0.0.1 inside answers on the host's 127.0.0.1.

Layout of a sandbox directory DIR:
    .deploytool-sandbox   marker (JSON: format, cgroup name); a directory without it is not a sandbox
    state.json            while up: host PIDs and start times of PID 1 and of the `unshare` launcher
    cgroups               sub-cgroup directories created for this sandbox, one a line
    cgroup-mounts         the cgroup hierarchies to mount inside (read by init.sh)
    init.sh               the mount setup run inside the new namespaces (a copy of sandbox_init.sh)
    etc-systemd-system/   /etc/systemd/system inside (unit files, kept across up/down)
    vendor-units/         /usr/lib/systemd/system inside (rebuilt by every `up`)
    empty/                the (empty) generator directory
    console.log           PID 1's console output; launcher.log the launcher's output

A machine without a systemd of its own (the GPU rehearsal's: a bare CUDA image) can run one unpacked from Debian's
packages (`dpkg-deb -x systemd_252*.deb SD`, libsystemd-shared and what the machine lacks beside it): `up
--systemd-root SD`. Inside the namespaces only, SD/lib/systemd is bound over /usr/lib/systemd and an ld.so.cache
of the machine's libraries plus the ones only SD has (DIR/xlib) over /etc/ld.so.cache; the stock units come from
SD, and systemctl and journalctl from SD/bin. The machine's NVIDIA device nodes (/dev/nvidia*, /dev/nvidia-caps/*)
are re-created in the private /dev with the same major:minor, mode and owner, with their /dev/char links (what
nvidia-modprobe updates), so units run on the real GPU; on a machine without them nothing changes.

Every process this module signals is first checked to be ours: PID 1 by its start time and its namespace
PID (1), anything else by membership in this sandbox's own sub-cgroup.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from deploy_tool import proc, procfs
from deploy_tool.box.sandbox_handle import FORMAT, MARKER, Proc, SandboxHandle, alive
from deploy_tool.errors import DeployError, MissingTool, SandboxError

LOCK = ".deploytool-sandbox.lock"
CGROUP_ROOT = Path("/sys/fs/cgroup")
STOCK_UNITS = Path("/usr/lib/systemd/system")
# Stock units copied into the sandbox besides every *.target and *.slice: journald, dbus, shutdown services.
_VENDOR_SERVICES = (
    "systemd-journald.service", "systemd-journald.socket", "systemd-journald-dev-log.socket",
    "systemd-poweroff.service", "systemd-halt.service", "systemd-reboot.service", "systemd-exit.service",
    "dbus.service", "dbus.socket",
)
_REQUIRED_TOOLS = ("unshare", "nsenter", "bash", "mount", "mknod", "env")


@dataclass(frozen=True)
class SandboxStatus:
    """What `status()` found. `state` is one of: up, down, stale."""

    dir: str
    state: str
    pid: int | None = None
    system_state: str | None = None  # systemctl is-system-running inside: running, degraded, starting, ...
    detail: str = ""
    leftover_cgroups: tuple[str, ...] = ()
    leftover_pids: tuple[int, ...] = ()
    unit_dir: str = ""

    def to_json(self) -> dict[str, object]:
        d = asdict(self)
        d["leftover_cgroups"] = list(self.leftover_cgroups)
        d["leftover_pids"] = list(self.leftover_pids)
        return d


@dataclass(frozen=True)
class DownReport:
    """What `down()` did."""

    dir: str
    was_up: bool
    stopped_pid: int | None = None
    forced: bool = False  # PID 1 did not power off in time and was killed
    killed_pids: tuple[int, ...] = ()  # other leftover processes of this sandbox, killed by PID
    removed_cgroups: tuple[str, ...] = field(default=())
    seconds: float = 0.0


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        stat = procfs.read(Path(entry.path, "stat"))
        if stat and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry.name))
    return out


def _hierarchies() -> list[tuple[Path, Path, str]]:
    """(mount point, this process's cgroup directory, mount options) for every hierarchy under /sys/fs/cgroup.

    cpuset is skipped (a child cpuset needs cpus/mems set up, and systemd does not need it). The options are
    "cgroup2" for a pure cgroup2 host, "unified" for the cgroup2 of a hybrid host, else the v1 controller list
    (for example "cpu,cpuacct" or "name=systemd").
    """
    controllers = {line.split()[0] for line in Path("/proc/cgroups").read_text().splitlines()[1:] if line.strip()}
    mounts: dict[str, tuple[str, str]] = {}  # sorted controller list ("" for cgroup2) -> (mount point, options)
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, mp, fstype, opts = line.split()[:4]
        if fstype == "cgroup2" and mp == str(CGROUP_ROOT):
            mounts[""] = (mp, "cgroup2")
        elif fstype == "cgroup2" and mp == str(CGROUP_ROOT / "unified"):
            mounts[""] = (mp, "unified")
        elif fstype == "cgroup" and mp.startswith(str(CGROUP_ROOT) + "/"):
            wanted = [o for o in opts.split(",") if o.startswith("name=") or o in controllers]
            if "cpuset" in wanted:
                continue
            mounts[",".join(sorted(wanted))] = (mp, ",".join(wanted))
    out = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrl, path = line.split(":", 2)
        key = ",".join(sorted(ctrl.split(","))) if ctrl else ""
        if key in mounts:
            mp, opts = mounts[key]
            out.append((Path(mp), Path(mp + path.rstrip("/")), opts))
    return out


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Sandbox(SandboxHandle):
    """A systemd sandbox living in directory `dir` (created by `up` if missing or empty); what reaches a running
    one (its systemctl, journalctl, PIDs) is SandboxHandle's, which the box side's systemd driver uses."""

    def __init__(self, dir: str | os.PathLike[str], *, up_timeout: float = 20.0, down_timeout: float = 10.0,
                 lock_timeout: float = 30.0, systemd_root: str | os.PathLike[str] | None = None) -> None:
        super().__init__(dir)
        self._want_root = os.path.realpath(os.fspath(systemd_root)) if systemd_root else None
        self.up_timeout = up_timeout
        self.down_timeout = down_timeout
        self.lock_timeout = lock_timeout
        self._launcher: object | None = None  # Popen of the launcher when this object started it (to reap it)

    # ----------------------------------------------------------------- checks

    def _check_host(self) -> None:
        if os.geteuid() != 0:
            raise SandboxError("the systemd sandbox needs root (it creates namespaces, mounts and cgroups)",
                               hint="run as root, for example with sudo")
        for tool in _REQUIRED_TOOLS:
            if shutil.which(tool) is None:
                raise MissingTool(f"program not found: {tool} (needed by the systemd sandbox)",
                                  hint="apt-get install util-linux mount coreutils bash")
        if self._want_root is not None:
            if not Path(self._want_root, "lib/systemd/systemd").is_file():
                raise SandboxError(f"--systemd-root {self._want_root} holds no lib/systemd/systemd",
                                   hint="unpack Debian's systemd there: dpkg-deb -x systemd_*.deb DIR (and "
                                        "libsystemd-shared_*.deb)")
            if shutil.which("ldconfig") is None and not Path("/sbin/ldconfig").exists():
                raise MissingTool("program not found: ldconfig (needed for --systemd-root)", hint="apt-get install libc-bin")
        elif not any(Path(p).is_file() for p in ("/usr/lib/systemd/systemd", "/lib/systemd/systemd")):
            raise MissingTool("systemd is not installed (/usr/lib/systemd/systemd missing)",
                              hint="apt-get install systemd (it need not be PID 1)")

    # ----------------------------------------------------------------- state

    def _recorded_cgroups(self) -> list[Path]:
        text = procfs.read(self._cgroups_file) or ""
        return [Path(line) for line in text.splitlines() if line.strip()]

    def _our_cgroups(self) -> list[Path]:
        """Every existing sub-cgroup of this sandbox: the recorded ones plus any found by name (lost records)."""
        found: dict[str, Path] = {str(p): p for p in self._recorded_cgroups() if p.is_dir()}
        names = (self.cgroup_name, self.cgroup_name + ".sup")
        if CGROUP_ROOT.is_dir():
            for top, dirs, _ in os.walk(CGROUP_ROOT):
                depth = top[len(str(CGROUP_ROOT)):].count("/")
                for d in list(dirs):
                    if d in names:
                        p = Path(top, d)
                        found[str(p)] = p
                        dirs.remove(d)
                if depth >= 6:
                    dirs.clear()
        return sorted(found.values())

    def _cgroup_pids(self, cgroups: list[Path] | None = None) -> set[int]:
        pids: set[int] = set()
        for cg in self._our_cgroups() if cgroups is None else cgroups:
            for top, _, files in os.walk(cg):
                if "cgroup.procs" in files:
                    text = procfs.read(Path(top, "cgroup.procs")) or ""
                    pids.update(int(x) for x in text.split())
        return pids

    def _in_our_cgroup(self, pid: int) -> bool:
        return procfs.in_cgroup(pid, self.cgroup_name)

    def _pid1(self) -> Proc | None:
        """Our running PID 1 if there is one: from state.json (checked against PID reuse), else by cgroup scan."""
        st = self._load_state()
        if st is not None:
            p = Proc(st["pid"], st["pid_start"])
            if alive(p) and procfs.ns_pids(p.pid)[-1:] == [1]:
                return p
        for pid in self._cgroup_pids():
            start = procfs.start_time(pid)
            if start is not None and len(procfs.ns_pids(pid)) > 1 and procfs.ns_pids(pid)[-1] == 1 and self._in_our_cgroup(pid):
                return Proc(pid, start)
        return None

    # ----------------------------------------------------------------- public API

    def status(self) -> SandboxStatus:
        """Report whether the sandbox is up, down or stale (a killed run's leftovers), without changing anything."""
        self._check_is_sandbox()
        common: dict[str, Any] = {"dir": str(self.dir), "unit_dir": str(self.unit_dir)}
        p1 = self._pid1()
        cgroups = tuple(str(c) for c in self._our_cgroups())
        st = self._load_state()
        if p1 is not None and st is not None and p1.pid == st["pid"]:
            res = proc.run(self.exec_argv("systemctl", "is-system-running"), ok=range(256))
            return SandboxStatus(state="up", pid=p1.pid, system_state=res.stdout.strip() or "unknown",
                                 **common)
        pids = tuple(sorted(self._cgroup_pids()))
        if p1 is not None:
            return SandboxStatus(state="stale", pid=p1.pid, leftover_cgroups=cgroups, leftover_pids=pids,
                                 detail=f"systemd (pid {p1.pid}) runs but its state file is missing or damaged",
                                 **common)
        if st is not None:
            return SandboxStatus(state="stale", leftover_cgroups=cgroups, leftover_pids=pids,
                                 detail=f"systemd (pid {st['pid']}) is gone but the sandbox was not taken down",
                                 **common)
        if cgroups or pids:
            return SandboxStatus(state="stale", leftover_cgroups=cgroups, leftover_pids=pids,
                                 detail="half torn down: sub-cgroups or processes are left", **common)
        return SandboxStatus(state="down", **common)

    def up(self) -> SandboxStatus:
        """Start the sandbox; returns its status. Already up: nothing to do (status says so in `detail`)."""
        self._check_host()
        if self.dir.exists() and any(p.name != LOCK for p in self.dir.iterdir()) and not (self.dir / MARKER).exists():
            self._check_is_sandbox()  # raises "not a sandbox"
        self.dir.mkdir(parents=True, exist_ok=True)
        with self._locked():
            return self._up_locked()

    def _up_locked(self) -> SandboxStatus:
        if (self.dir / MARKER).exists():
            cur = self.status()
            if cur.state == "up":
                return SandboxStatus(**{**asdict(cur), "leftover_cgroups": (), "leftover_pids": (),
                                        "detail": "already up; nothing to do"})
            if cur.state == "stale":
                raise SandboxError(f"sandbox {self.dir} is stale ({cur.detail})",
                                   hint=f"clean it up first: deploytool sandbox down {self.dir}")
        started = time.monotonic()
        try:
            self._prepare()
            self._launch()
            self._wait_running(started)
        except BaseException as exc:
            logs = self._log_tail()
            with contextlib.suppress(DeployError):
                self._down_locked()
            if isinstance(exc, SandboxError) and logs:
                exc.details = logs
            raise
        return self.status()

    def _prepare(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        root = self._want_root
        _write_atomic(self.dir / MARKER, json.dumps({"format": FORMAT, "cgroup": self.cgroup_name,
                                                     **({"systemd_root": root} if root else {})}) + "\n")
        self._systemd_root = root
        self.unit_dir.mkdir(exist_ok=True)
        (self.dir / "empty").mkdir(exist_ok=True)
        (self.dir / "console.log").write_bytes(b"")
        self._make_vendor_units(self.dir / "vendor-units", Path(root, "lib/systemd/system") if root else STOCK_UNITS)
        if root:
            self._prepare_root(Path(root))
        elif (self.dir / "systemd-root").exists():
            (self.dir / "systemd-root").unlink()
        hier = _hierarchies()
        if not hier:
            raise SandboxError("no cgroup hierarchy found under /sys/fs/cgroup; cannot isolate a systemd sandbox")
        if any(opts == "cgroup2" for _, _, opts in hier):
            mounts = "cgroup2\n"
        else:
            mounts = "".join(("unified" if opts == "unified" else f"{mp} {opts}") + "\n" for mp, _, opts in hier)
        _write_atomic(self.dir / "cgroup-mounts", mounts)
        script = resources.files("deploy_tool.rehearsal").joinpath("sandbox_init.sh").read_text()
        _write_atomic(self.dir / "init.sh", script)
        created = []
        try:
            for _, d, _ in hier:
                for name in (self.cgroup_name, self.cgroup_name + ".sup"):
                    (d / name).mkdir(exist_ok=True)
                    created.append(str(d / name))
        finally:
            _write_atomic(self._cgroups_file, "".join(c + "\n" for c in created))

    def _prepare_root(self, root: Path) -> None:
        """DIR/systemd-root (read by init.sh) and DIR/ld.so.cache: the machine's libraries, then systemd's private
        ones and those of SD that the machine lacks (copied to DIR/xlib, found as the loader would not)."""
        xlib = self.dir / "xlib"
        if xlib.exists():
            shutil.rmtree(xlib)
        xlib.mkdir()
        private = [d for d in (root / "usr/lib/x86_64-linux-gnu/systemd", root / "lib/x86_64-linux-gnu/systemd")
                   if d.is_dir()]
        libdirs = [d for d in (root / "usr/lib/x86_64-linux-gnu", root / "lib/x86_64-linux-gnu") if d.is_dir()]
        progs = [p for p in (root / "lib/systemd/systemd", root / "lib/systemd/systemd-journald",
                             root / "lib/systemd/systemd-shutdown", root / "bin/systemctl", root / "bin/journalctl",
                             root / "usr/bin/systemd-run", root / "usr/bin/systemd-analyze") if p.is_file()]
        search = ":".join(str(d) for d in [*private, xlib])
        for _ in range(5):  # what is missing, then what that needs
            missing = set()
            for f in [*progs, *xlib.iterdir()]:
                res = proc.run(["ldd", str(f)], env={**os.environ, "LD_LIBRARY_PATH": search}, ok=range(256))
                missing |= {ln.split()[0] for ln in res.stdout.splitlines() if "not found" in ln}
            if not missing:
                break
            for so in sorted(missing):
                src = next((d / so for d in libdirs if (d / so).exists()), None)
                if src is None:
                    raise SandboxError(f"the systemd in {root} needs {so}, which neither this machine nor {root} has",
                                       hint="unpack the Debian package that holds it there as well (dpkg-deb -x)")
                shutil.copy2(src, xlib / so, follow_symlinks=True)
        conf = self.dir / "ld.so.conf"
        conf.write_text("include /etc/ld.so.conf.d/*.conf\n" + "".join(f"{d}\n" for d in [*private, xlib]))
        proc.run([shutil.which("ldconfig") or "/sbin/ldconfig", "-X", "-C", str(self.dir / "ld.so.cache"),
                  "-f", str(conf)])
        _write_atomic(self.dir / "systemd-root", f"{root}\n")

    @staticmethod
    def _make_vendor_units(dest: Path, stock: Path = STOCK_UNITS) -> None:
        if dest.exists():
            shutil.rmtree(dest)
        (dest / "sockets.target.wants").mkdir(parents=True)
        (dest / "sysinit.target.wants").mkdir()
        for src in sorted(stock.iterdir()):
            if src.name.endswith((".target", ".slice")) or src.name in _VENDOR_SERVICES:
                if src.is_symlink():
                    os.symlink(os.readlink(src), dest / src.name)
                elif src.is_file():
                    shutil.copy2(src, dest / src.name)
        # masked: journald would otherwise switch on kernel auditing for the whole machine
        os.symlink("/dev/null", dest / "systemd-journald-audit.socket")
        for sock in ("systemd-journald.socket", "systemd-journald-dev-log.socket", "dbus.socket"):
            if (dest / sock).exists():
                os.symlink(f"../{sock}", dest / "sockets.target.wants" / sock)
        os.symlink("../systemd-journald.service", dest / "sysinit.target.wants" / "systemd-journald.service")
        with contextlib.suppress(FileNotFoundError):
            (dest / "default.target").unlink()
        os.symlink("multi-user.target", dest / "default.target")

    def _launch(self) -> None:
        with open(self.dir / "launcher.log", "wb") as log:
            popen = proc.spawn(["bash", str(self.dir / "init.sh"), "launch", str(self.dir)], stdout=log,
                               stderr=log, new_session=True)
        self._launcher = popen
        launcher = popen.pid
        deadline = time.monotonic() + 10
        pid1 = None
        while time.monotonic() < deadline:
            if popen.poll() is not None:
                raise SandboxError(f"the sandbox launcher exited with code {popen.returncode} before systemd started",
                                   hint=f"see {self.dir / 'launcher.log'}")
            if (procfs.read(Path(f"/proc/{launcher}/comm")) or "").strip() == "unshare":
                kids = _children(launcher)
                if kids:
                    pid1 = kids[0]
                    break
            time.sleep(0.005)
        if pid1 is None:
            raise SandboxError("systemd did not start in the sandbox within 10 s", hint=f"see {self.dir / 'launcher.log'}")
        l_start = procfs.start_time(launcher)
        p_start = procfs.start_time(pid1)
        if l_start is None or p_start is None:
            raise SandboxError("the sandbox's PID 1 exited right after it started", hint=f"see {self.dir / 'console.log'}")
        _write_atomic(self._state_file, json.dumps({"pid": pid1, "pid_start": p_start, "launcher": launcher,
                                                    "launcher_start": l_start}) + "\n")
        # the namespace's root cgroup holds only PID 1's tree: park the launcher in the .sup siblings
        for cg in self._recorded_cgroups():
            if cg.name.endswith(".sup"):
                with contextlib.suppress(OSError):
                    (cg / "cgroup.procs").write_text(str(launcher))

    def _wait_running(self, started: float) -> None:
        p = self._require_up()
        argv = self.ns_argv(p, "systemctl", "is-system-running")
        state = ""
        while time.monotonic() - started < self.up_timeout:
            if not alive(p):
                raise SandboxError("the sandbox's systemd exited while starting",
                                   hint=f"see {self.dir / 'console.log'}")
            state = proc.run(argv, ok=range(256)).stdout.strip()  # no timeout: it costs 0.1 s a call
            if state in ("running", "degraded"):
                return
            time.sleep(0.02)
        raise SandboxError(f"the sandbox's systemd did not reach running within {self.up_timeout:.0f} s "
                           f"(state: {state or 'unreachable'})", hint=f"see {self.dir / 'console.log'}")

    def _log_tail(self, lines: int = 20) -> str:
        out = []
        for name in ("launcher.log", "console.log"):
            text = procfs.read(self.dir / name)
            if text and text.strip():
                out.append(f"--- {name}\n" + "\n".join(text.strip().splitlines()[-lines:]))
        return "\n".join(out)

    def down(self) -> DownReport:
        """Stop the sandbox and remove its sub-cgroups. Idempotent; also cleans up after a killed run."""
        self._check_is_sandbox()
        with self._locked():
            return self._down_locked()

    def _down_locked(self) -> DownReport:
        t0 = time.monotonic()
        p1 = self._pid1()
        forced = False
        if p1 is not None:
            forced = not self._poweroff(p1)
        killed = self._kill_leftovers()
        self._reap_launcher()
        removed, left = self._remove_cgroups()
        with contextlib.suppress(FileNotFoundError):
            self._state_file.unlink()
        if left:
            raise SandboxError(f"sandbox {self.dir}: could not remove sub-cgroups: {', '.join(left)}",
                               hint="a process may still be inside; see `deploytool sandbox status`")
        return DownReport(dir=str(self.dir), was_up=p1 is not None, stopped_pid=p1.pid if p1 else None,
                          forced=forced, killed_pids=tuple(killed), removed_cgroups=tuple(removed),
                          seconds=time.monotonic() - t0)

    def _poweroff(self, p: Proc) -> bool:
        """Power the sandbox's systemd off; SIGKILL it if that takes too long. True when it went gracefully.

        A systemd still booting may not answer systemctl yet nor handle signals, so the request is repeated.
        """
        argv = self.ns_argv(p, "systemctl", "poweroff", "--no-block")
        deadline = time.monotonic() + self.down_timeout
        asked = False
        next_try = 0.0
        while time.monotonic() < deadline:
            if not alive(p):
                return True
            if not asked and time.monotonic() >= next_try:
                try:
                    asked = proc.run(argv, ok=range(256), timeout=5).returncode == 0
                except DeployError:
                    asked = False
                if not asked and alive(p):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGRTMIN + 4)  # systemd's "poweroff" signal
                next_try = time.monotonic() + 0.2
            time.sleep(0.02)
        if alive(p):  # still the same process (start time checked): ours to kill
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
            self._wait_gone([p], 5)
        return False

    @staticmethod
    def _wait_gone(procs: list[Proc], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(alive(p) for p in procs):
            time.sleep(0.01)

    def _kill_leftovers(self) -> list[int]:
        """SIGKILL any process still in this sandbox's sub-cgroups (ours by construction), PID 1s first."""
        killed: list[int] = []
        for _ in range(3):
            procs = []
            for pid in sorted(self._cgroup_pids(), key=lambda x: procfs.ns_pids(x)[-1:] != [1]):
                start = procfs.start_time(pid)
                if start is None or not self._in_our_cgroup(pid):
                    continue
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                    procs.append(Proc(pid, start))
            if not procs:
                break
            self._wait_gone(procs, 5)
            self._reap_launcher()
        return killed

    def _reap_launcher(self) -> None:
        popen = self._launcher
        if popen is not None:
            with contextlib.suppress(Exception):
                popen.wait(timeout=5)  # type: ignore[attr-defined]
            self._launcher = None

    def _remove_cgroups(self) -> tuple[list[str], list[str]]:
        removed: list[str] = []
        deadline = time.monotonic() + 5
        while True:
            left = []
            for cg in self._our_cgroups():
                for top, _, _ in sorted(os.walk(cg), key=lambda t: -len(t[0])):
                    try:
                        os.rmdir(top)
                        if Path(top) == cg:
                            removed.append(str(cg))
                    except FileNotFoundError:
                        pass
                    except OSError:
                        left.append(top)
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if not left:
            with contextlib.suppress(FileNotFoundError):
                self._cgroups_file.unlink()
        return removed, sorted(set(left))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Serialize up/down of one sandbox directory between processes (flock on DIR/.deploytool-sandbox.lock)."""
        fd = os.open(self.dir / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            deadline = time.monotonic() + self.lock_timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise SandboxError(f"sandbox {self.dir} is busy: another deploytool is starting or "
                                           f"stopping it", hint="wait for it, then try again") from None
                    time.sleep(0.05)
            yield
        finally:
            os.close(fd)

    # ----------------------------------------------------------------- context manager

    def __enter__(self) -> Sandbox:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()
