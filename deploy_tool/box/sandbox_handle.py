"""Reach a running systemd sandbox from its directory: the argv that runs a command inside it (nsenter into its
namespaces), its PID 1, the host PID of a process inside it. The box side's systemd driver needs this much when
a config targets a sandbox (`systemd.sandbox`); starting and stopping one is the rehearsal side's (sandbox.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from deploy_tool import procfs
from deploy_tool.errors import SandboxError

MARKER = ".deploytool-sandbox"
FORMAT = 1
NSENTER_FLAGS = ("-m", "-p", "-u", "-i", "-C")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class Proc:
    pid: int
    start: int  # clock ticks since boot, field 22 of /proc/PID/stat; guards against PID reuse


def alive(p: Proc) -> bool:
    return procfs.start_time(p.pid) == p.start


class SandboxHandle:
    """A sandbox directory, for reaching the systemd that runs from it."""

    def __init__(self, dir: str | os.PathLike[str]) -> None:
        self.dir = Path(os.path.realpath(os.fspath(dir)))
        self.cgroup_name = procfs.sandbox_cgroup(self.dir)
        self._systemd_root: str | None | bool = False  # read from the marker on first use

    @property
    def systemd_root(self) -> str | None:
        """The tree the sandbox's systemd was unpacked into (`sandbox up --systemd-root`), or None when it runs the
        machine's own systemd."""
        if self._systemd_root is False:
            try:
                meta = json.loads((self.dir / MARKER).read_text())
                root = meta.get("systemd_root") if isinstance(meta, dict) else None
            except (OSError, ValueError):
                root = None
            self._systemd_root = root if isinstance(root, str) else None
        return self._systemd_root  # type: ignore[return-value]

    # ----------------------------------------------------------------- paths

    @property
    def unit_dir(self) -> Path:
        """Host path of the directory that is /etc/systemd/system inside the sandbox."""
        return self.dir / "etc-systemd-system"

    @property
    def _state_file(self) -> Path:
        return self.dir / "state.json"

    @property
    def _cgroups_file(self) -> Path:
        return self.dir / "cgroups"

    def __repr__(self) -> str:
        return f"Sandbox({str(self.dir)!r})"

    def _check_is_sandbox(self) -> None:
        if not self.dir.exists():
            raise SandboxError(f"no sandbox at {self.dir}: the directory does not exist",
                               hint=f"create one with: deploytool sandbox up {self.dir}")
        if not self.dir.is_dir():
            raise SandboxError(f"{self.dir} is not a directory, so not a sandbox")
        marker = self.dir / MARKER
        if not marker.is_file():
            raise SandboxError(f"{self.dir} is not a deploytool sandbox (no {MARKER} in it)",
                               hint="give a new or empty directory to: deploytool sandbox up DIR")
        try:
            meta = json.loads(marker.read_text())
            fmt = meta["format"]
        except (ValueError, KeyError, TypeError) as exc:
            raise SandboxError(f"{marker} is damaged; {self.dir} cannot be used as a sandbox",
                               hint="tear down whatever runs from it, then remove the directory") from exc
        if fmt != FORMAT:
            raise SandboxError(f"{self.dir} is a sandbox of format {fmt}; this deploytool knows format {FORMAT}")

    def _load_state(self) -> dict[str, int] | None:
        text = procfs.read(self._state_file)
        if text is None:
            return None
        try:
            st = json.loads(text)
            return {k: int(st[k]) for k in ("pid", "pid_start", "launcher", "launcher_start")}
        except (ValueError, KeyError, TypeError):
            return None  # damaged: treated like a lost state file (the cgroup scan still finds our processes)

    def _require_up(self) -> Proc:
        self._check_is_sandbox()
        st = self._load_state()
        if st is not None:
            p = Proc(st["pid"], st["pid_start"])
            if alive(p):
                return p
            raise SandboxError(f"sandbox {self.dir} is stale: its systemd (pid {p.pid}) is gone",
                               hint=f"clean it up and start again: deploytool sandbox down {self.dir} && "
                                    f"deploytool sandbox up {self.dir}")
        raise SandboxError(f"sandbox {self.dir} is not up", hint=f"start it: deploytool sandbox up {self.dir}")

    def contains_self(self) -> bool:
        """True when this process runs inside the sandbox: its PID 1 is the sandbox's systemd (same start time;
        the host's PID 1 started at boot). A unit of that systemd reaches it with plain systemctl."""
        st = self._load_state()
        return st is not None and procfs.start_time(1) == st["pid_start"]

    def exec_argv(self, *cmd: str) -> list[str]:
        """The argv that runs `cmd` inside the sandbox (nsenter into all its namespaces but the network one); with a
        systemd root, its systemctl and journalctl come first on the PATH."""
        return self.ns_argv(self._require_up(), *cmd)

    def ns_argv(self, p: Proc, *cmd: str) -> list[str]:
        """exec_argv for the sandbox's PID 1 `p` (while it is starting or stopping, too)."""
        root = self.systemd_root
        env = ["env", f"PATH={root}/bin:{root}/usr/bin:{DEFAULT_PATH}"] if root else []
        return ["nsenter", "-t", str(p.pid), *NSENTER_FLAGS, "--", *env, *cmd]

    def systemctl_prefix(self) -> list[str]:
        return self.exec_argv("systemctl")

    def journalctl_prefix(self) -> list[str]:
        return self.exec_argv("journalctl")

    def host_pid(self, ns_pid: int) -> int:
        """Host PID of the process that has PID `ns_pid` inside the sandbox (for example a unit's MainPID)."""
        self._require_up()
        pid = procfs.host_pid(ns_pid, self.cgroup_name)
        if pid is not None:
            return pid
        raise SandboxError(f"no process with PID {ns_pid} runs inside sandbox {self.dir}")

    @property
    def pid(self) -> int:
        """Host PID of the sandbox's systemd (raises SandboxError when not up)."""
        return self._require_up().pid
