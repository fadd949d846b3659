"""The box's NVIDIA GPUs as the driver and /dev show them, and whether a running server holds the GPUs it was
given. Reads /proc and /dev only; runs no program (status may run nvidia-smi, see `compute_apps`).

Device nodes (NVIDIA's driver README, "Device files"; measured on a real H200 with driver 580):
  /dev/nvidia<MINOR>    one per GPU, major 195, minor = the GPU's "Device Minor" in
                        /proc/driver/nvidia/gpus/<PCI bus>/information
  /dev/nvidiactl        195:255, the control node every CUDA process opens
  /dev/nvidia-uvm       nvidia-uvm's node (unified memory; CUDA fails without it), -tools beside it
`host.gpus` names GPUs by that minor. The units set CUDA_DEVICE_ORDER=PCI_BUS_ID, so CUDA numbers the visible
GPUs as nvidia-smi does (PCI order; CUDA's own default orders by speed), and the driver hands out minors in the
same PCI order when it probes: GPU N of nvidia-smi is /dev/nvidiaN. `driver_gpus` reads the real mapping.

Residency. A server whose CUDA init failed does not always say so: llama-server logs one line
(`ggml_cuda_init: failed to initialize CUDA: ...`) and serves on the CPU with /health 200 (five ways on the H200:
the nvidia-uvm class unresolved, no NVIDIA DeviceAllow=, the old nvidia-modprobe lines, nodes missing, nodes 0660
without the group); ftllm loads its CPU library. A process that really uses a GPU holds its node open for as long as
its CUDA context lives (llama-server on the H200: 20 descriptors of /dev/nvidia0, plus nvidiactl and nvidia-uvm).
So "the server's processes hold /dev/nvidia<N> for every configured GPU" is a check that does not depend on the
server's flags or log: `residency()`.
"""

from __future__ import annotations

import grp
import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

NVIDIA_MAJOR = 195
CTL = "/dev/nvidiactl"
UVM = "/dev/nvidia-uvm"
_GPU_NODE = re.compile(r"^/dev/nvidia(\d+)$")
_INFO_MINOR = re.compile(r"^Device Minor:\s*(\d+)\s*$", re.M)
_INFO_MODEL = re.compile(r"^Model:\s*(.+?)\s*$", re.M)


def gpu_node(minor: int) -> str:
    return f"/dev/nvidia{int(minor)}"


def required_nodes(gpus: Iterable[int]) -> tuple[str, ...]:
    """The nodes a CUDA server given `gpus` must hold: one per GPU (nvidiactl and nvidia-uvm are opened by any
    CUDA process, even one whose init then fails, so they prove nothing)."""
    return tuple(gpu_node(g) for g in gpus)


@dataclass(frozen=True)
class DriverGpu:
    """One GPU as /proc/driver/nvidia/gpus lists it."""

    bus: str  # PCI location, the directory's name (e.g. 0000:01:00.0)
    minor: int  # its /dev/nvidia<minor>
    model: str


def _root(root: str, path: str) -> Path:
    return Path(root) / path.lstrip("/")


def driver_loaded(root: str = "/") -> bool:
    """Whether the NVIDIA kernel driver is loaded (it creates /proc/driver/nvidia)."""
    return _root(root, "/proc/driver/nvidia").is_dir()


def driver_gpus(root: str = "/") -> list[DriverGpu] | None:
    """The GPUs the driver knows, in PCI order; None when no NVIDIA driver is loaded."""
    base = _root(root, "/proc/driver/nvidia/gpus")
    if not _root(root, "/proc/driver/nvidia").is_dir():
        return None
    out = []
    try:
        entries = sorted(os.scandir(base), key=lambda e: e.name)
    except OSError:
        return []
    for e in entries:
        try:
            text = Path(e.path, "information").read_text(errors="replace")
        except OSError:
            continue
        m = _INFO_MINOR.search(text)
        if m is None:
            continue
        model = _INFO_MODEL.search(text)
        out.append(DriverGpu(e.name, int(m.group(1)), model.group(1) if model else "?"))
    return out


@dataclass(frozen=True)
class Node:
    """A device node: where it is, its mode bits, owner and device number."""

    path: str
    mode: int  # permission bits (0o666, 0o660, ...)
    uid: int
    gid: int
    major: int
    minor: int

    @property
    def group(self) -> str:
        try:
            return grp.getgrgid(self.gid).gr_name
        except KeyError:
            return str(self.gid)

    @property
    def world_rw(self) -> bool:
        return self.mode & 0o006 == 0o006

    def describe(self) -> str:
        return f"{self.path} {self.mode:04o} uid {self.uid} group {self.group} ({self.major}:{self.minor})"


def node(path: str, root: str = "/") -> Node | None:
    """The character device at `path`; None when it is missing or not a character device."""
    try:
        st = os.stat(_root(root, path))
    except OSError:
        return None
    if not stat.S_ISCHR(st.st_mode):
        return None
    return Node(path, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, os.major(st.st_rdev), os.minor(st.st_rdev))


def box_nodes(gpus: Iterable[int], root: str = "/") -> dict[str, Node | None]:
    """The nodes a cuda backend given `gpus` opens, as they are now (None: missing)."""
    paths = [*required_nodes(gpus), CTL, UVM]
    return {p: node(p, root) for p in paths}


def closed_nodes(nodes: dict[str, Node | None], *, groups: Iterable[str]) -> list[Node]:
    """The nodes a service user that is in `groups` (names) and owns none of them cannot open read-write: not
    world read-writable and not group read-writable for one of the groups."""
    names = set(groups)
    out = []
    for n in nodes.values():
        if n is None or n.world_rw:
            continue
        if n.mode & 0o060 == 0o060 and n.group in names:
            continue
        out.append(n)
    return out


# ------------------------------------------------------------------------------------------------ residency


@dataclass(frozen=True)
class Residency:
    """Which GPU nodes the processes of a server hold open, against the ones it was given."""

    required: tuple[str, ...]
    held: tuple[str, ...]  # every /dev/nvidia* path held by any of the processes, sorted
    pids: tuple[int, ...]
    unreadable: tuple[int, ...] = field(default=())  # processes whose fds could not be read (permission)

    @property
    def missing(self) -> tuple[str, ...]:
        return tuple(n for n in self.required if n not in self.held)

    @property
    def ok(self) -> bool:
        return not self.missing

    @property
    def known(self) -> bool:
        """False when nothing could be read (every process's fds unreadable, or no process)."""
        return bool(self.pids) and len(self.unreadable) < len(self.pids)

    def describe(self, who: str) -> str:
        if not self.known:
            why = "it has no process" if not self.pids else "its file descriptors cannot be read here"
            return f"could not determine whether {who} holds its GPUs: {why}"
        held = ", ".join(self.held) or "no NVIDIA device"
        if self.ok:
            return f"{who} holds its GPUs ({held})"
        return (f"{who} runs without its GPU{'s' if len(self.missing) > 1 else ''}: no process of it holds "
                f"{', '.join(self.missing)} (it holds {held}); the server fell back to the CPU or lost the device")

    def to_json(self) -> dict[str, object]:
        return {"required": list(self.required), "held": list(self.held), "missing": list(self.missing),
                "pids": list(self.pids), "ok": self.ok, "known": self.known}


def held_nodes(pid: int, proc: str = "/proc") -> set[str] | None:
    """The /dev/nvidia* paths process `pid` holds open; None when its fds cannot be read (gone or not ours)."""
    base = f"{proc}/{pid}/fd"
    try:
        fds = os.listdir(base)
    except OSError:
        return None
    out = set()
    for fd in fds:
        try:
            target = os.readlink(f"{base}/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/nvidia"):
            out.add(target)
    return out


def residency(pids: Iterable[int], gpus: Iterable[int], proc: str = "/proc") -> Residency:
    """Residency of the processes `pids` (a server and its children) for the GPUs `gpus` (their minors)."""
    pids = tuple(pids)
    held: set[str] = set()
    unreadable = []
    for pid in pids:
        got = held_nodes(pid, proc)
        if got is None:
            unreadable.append(pid)
        else:
            held |= got
    return Residency(required_nodes(gpus), tuple(sorted(held)), pids, tuple(unreadable))


def parse_compute_apps(text: str) -> dict[int, int]:
    """`nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits` -> {host pid: MiB}."""
    out: dict[int, int] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[0].isdigit():
            mib = parts[1].removesuffix("MiB").strip()
            if mib.isdigit():
                out[int(parts[0])] = out.get(int(parts[0]), 0) + int(mib)
    return out
