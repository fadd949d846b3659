"""Runtime truth: what a running backend actually loaded, and what its KV cache can actually hold.

Fingerprints on disk prove nothing about the process. Two failures from the field notes motivate this module:
FastLLM loaded Ubuntu's NCCL 2.22.3 although a self-built 2.31.2 was intended (pitfall 1), and "262K context" was
only on paper because GPU0 could give 1.41 GB to a KV pool needing 2.36 GB (pitfall 4). So after a backend is
ready we read `/proc/<pid>/maps` (and its descendants'), compare every known native library with its pin (path
and SHA-256 of the bytes actually mapped), look for CPU fallback in the startup log, and redo the KV-pool
arithmetic from the server's own startup lines.

Everything here is pure or reads /proc; nothing runs external programs. Problems with the inspection itself (the
process exited, maps unreadable, a log in a format we do not know) become findings of status `unknown`
("could not determine"), never a pass and never a traceback. Gate policy: any `fail` fails the gate; `unknown`
means the gate could not verify; `warn` is shown but does not fail unless the policy says so.

Log wording was read from the real programs: ftllm 0.1.8.2's libfastllm_tools.so format strings
(`[Fastllm] AutoWarmup GPU %d: free=..., availForKV=%.2f GB, localKVPerPage=%.2f MB, ...`,
`[Fastllm] KV Cache Token limit: %d tokens (totalPages=%d, pageLen=%d).`,
`[Fastllm] AddPrefill Pages limit: %d pages (80%% of %d).`), ftllm's loader (`Load libfastllm_tools-cpu.so`),
its server (`Model context window: %d tokens per session (...)`), and llama.cpp's llama-server
(`load_tensors: offloaded %d/%d layers to GPU`, `<dev> model buffer size`, `llama_kv_cache: <dev> KV buffer size`,
`llama_kv_cache: size = ... MiB (N cells, ...)`, `llama_context: n_ctx_seq = N`,
`warning: no usable GPU found, --gpu-layers option will be ignored`).
FastLLM's "GB" is 1024 MB: 2,048 pages x 1.18 MB = 2,416.64 MB = 2.36 GB, the write-up's figure.

Use after a backend is ready (install, switch, `status --deep`):

    report = inspect_runtime(main_pid, kind="ftllm", pins=pins, log_text=log_since_start,
                             device_profile="cuda", configured_ctx=262144, capacity_policy="warn")
    report.status      # "fail" -> fail the gate; "unknown" -> could not verify; "warn"/"ok" -> pass
    report.to_rows()   # for `status`: libraries (path, pinned yes/no), capacity truth, fallback
    report.to_json()   # for `status --json`

`log_text` should cover exactly this start of the service (for llama-server, run it with `-lv 4` so its load
lines are logged); where a line occurs more than once the last one wins.
"""

from __future__ import annotations

import errno
import fnmatch
import math
import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field

from deploy_tool import gpu, hashing
from deploy_tool.errors import RuntimeTruthError

# --------------------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------------------

FAIL, WARN, UNKNOWN, OK = "fail", "warn", "unknown", "ok"
_RANK = {OK: 0, WARN: 1, UNKNOWN: 2, FAIL: 3}

#: Native libraries whose path and hash matter, by family name. A family name may be used as a pin key.
KNOWN_LIBRARIES: dict[str, str] = {
    "fastllm_tools": "libfastllm_tools*.so",
    "nccl": "libnccl.so*",
    "ggml": "libggml*.so*",
    "llama": "libllama*.so*",
    "cudart": "libcudart*.so*",
    "cublas": "libcublas*.so*",
}
#: Families a process loads exactly one file of: any other file of the family is a substitute for the pinned one.
#: (ggml, llama and cublas come as several files: libggml-base, libggml-cpu...; libcublas and libcublasLt.)
SINGLE_FILE_FAMILIES = frozenset({"fastllm_tools", "nccl", "cudart"})


class InspectError(RuntimeTruthError):
    """The running process could not be inspected (it exited, or /proc is not readable)."""


@dataclass(frozen=True)
class LoadedLib:
    """One shared object mapped by a process (or one of its descendants)."""

    path: str  # as the kernel reports it, without the " (deleted)" suffix
    pid: int
    deleted: bool = False
    inode: int = 0
    dev: str = ""  # "major:minor" in hex, as in /proc/<pid>/maps
    map_file: str | None = None  # /proc/<pid>/map_files/<range> of one mapping: reads the bytes actually mapped

    @property
    def name(self) -> str:
        return os.path.basename(self.path)


@dataclass(frozen=True)
class Pin:
    """The expected path and SHA-256 of one native library (from the manifest / pinned fingerprints)."""

    path: str
    sha256: str


@dataclass(frozen=True)
class RuntimeFinding:
    """One problem (or one thing that could not be determined) about the running backend."""

    check: str  # "library" | "cpu-fallback" | "capacity" | "inspect"
    status: str  # "fail" | "warn" | "unknown"
    subject: str  # the library's file name, the backend kind, ...
    message: str
    loaded_path: str | None = None
    pinned_path: str | None = None
    pid: int | None = None
    hint: str | None = None

    def to_json(self) -> dict[str, object]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class LibStatus:
    """One row of the loaded-library table: a known native library the process maps, or a pin it does not."""

    name: str
    path: str | None  # loaded path (None: pinned but not mapped)
    pid: int | None
    pinned: bool
    pinned_path: str | None
    status: str  # "ok" | "fail" | "warn" | "unknown" | "unpinned"
    sha256: str | None = None
    deleted: bool = False

    def to_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class LibraryReport:
    rows: tuple[LibStatus, ...]
    findings: tuple[RuntimeFinding, ...]


@dataclass(frozen=True)
class CardCapacity:
    """KV accounting for one card (FastLLM) or one device buffer (llama.cpp)."""

    card: str  # "GPU 0", "CUDA0", "CPU"
    kv_needed_mb: float | None  # what the configured pool needs on this card
    kv_avail_mb: float | None  # what the card can give to it
    ceiling_tokens: int | None  # tokens that really fit on this card
    ok: bool | None

    def to_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class CapacityReport:
    per_card: tuple[CardCapacity, ...]
    ceiling_tokens: int | None  # tokens one request can really use (None: could not determine)
    status: str  # "ok" | "warn" | "fail" | "unknown"
    message: str
    configured_ctx: int | None = None
    paper_tokens: int | None = None  # what the server claims (KV Cache Token limit / n_ctx_seq)
    prefill_cap_tokens: int | None = None  # FastLLM: one prompt may use at most this many tokens

    def to_json(self) -> dict[str, object]:
        out = asdict(self)
        out["per_card"] = [c.to_json() for c in self.per_card]
        return out

    def to_finding(self, kind: str) -> RuntimeFinding | None:
        if self.status == OK:
            return None
        return RuntimeFinding("capacity", self.status, kind, self.message)


def worst(statuses: Iterable[str]) -> str:
    """Combine statuses: fail > unknown > warn > ok (an unverified result is never reported as a pass)."""
    out = OK
    for s in statuses:
        if _RANK.get(s, _RANK[UNKNOWN]) > _RANK[out]:
            out = s if s in _RANK else UNKNOWN
    return out


# --------------------------------------------------------------------------------------------------------------
# /proc reading
# --------------------------------------------------------------------------------------------------------------

_MAPS_RE = re.compile(
    r"^(?P<start>[0-9a-f]+)-(?P<end>[0-9a-f]+)\s+\S+\s+[0-9a-f]+\s+(?P<dev>[0-9a-f]+:[0-9a-f]+)\s+"
    r"(?P<inode>\d+)\s+(?P<path>/.*?)\s*$"
)
_DELETED = " (deleted)"
_SO_RE = re.compile(r"\.so(\.[0-9]+)*$")


def _is_shared_object(path: str) -> bool:
    return bool(_SO_RE.search(os.path.basename(path)))


def parse_maps(text: str, pid: int) -> list[LoadedLib]:
    """Shared objects in the text of /proc/<pid>/maps, unique by path, in first-mapped order."""
    seen: dict[str, LoadedLib] = {}
    for line in text.splitlines():
        m = _MAPS_RE.match(line)
        if not m:
            continue
        path = m["path"]
        deleted = path.endswith(_DELETED)
        if deleted:
            path = path[: -len(_DELETED)]
        if not _is_shared_object(path) or path in seen:
            continue
        seen[path] = LoadedLib(path=path, pid=pid, deleted=deleted, inode=int(m["inode"]), dev=m["dev"],
                               map_file=f"/proc/{pid}/map_files/{m['start']}-{m['end']}")
    return list(seen.values())


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as fh:
        return fh.read()


def _is_zombie(pid: int, proc: str) -> bool:
    try:
        stat_text = _read_text(f"{proc}/{pid}/stat")
    except OSError:
        return True
    # the state follows the last ')' (the command name may contain spaces and parentheses)
    tail = stat_text.rsplit(")", 1)[-1].split()
    return bool(tail) and tail[0] in ("Z", "X")


def descendants(pid: int, *, proc: str = "/proc") -> list[int]:
    """PIDs of all descendants of pid (children first-level first), via /proc/<pid>/task/*/children.

    Falls back to scanning every /proc/<n>/stat for its parent when the kernel has no `children` files.
    Processes that exit while being walked are skipped.
    """
    children_of = _children_reader(proc)
    out: list[int] = []
    queue = [pid]
    seen = {pid}
    while queue:
        current = queue.pop(0)
        for child in children_of(current):
            if child not in seen:
                seen.add(child)
                out.append(child)
                queue.append(child)
    return out


def _children_reader(proc: str) -> Callable[[int], list[int]]:
    def via_task_files(pid: int) -> list[int] | None:
        try:
            tasks = os.listdir(f"{proc}/{pid}/task")
        except OSError:
            return []
        found: list[int] = []
        any_file = False
        for tid in tasks:
            try:
                text = _read_text(f"{proc}/{pid}/task/{tid}/children")
            except FileNotFoundError:
                continue
            except OSError:
                continue
            any_file = True
            found.extend(int(x) for x in text.split() if x.isdigit())
        return found if any_file else None

    parent_map: dict[int, list[int]] | None = None

    def via_scan(pid: int) -> list[int]:
        nonlocal parent_map
        if parent_map is None:
            parent_map = {}
            for entry in os.listdir(proc):
                if not entry.isdigit():
                    continue
                try:
                    tail = _read_text(f"{proc}/{entry}/stat").rsplit(")", 1)[-1].split()
                    parent_map.setdefault(int(tail[1]), []).append(int(entry))
                except (OSError, IndexError, ValueError):
                    continue
        return parent_map.get(pid, [])

    def children_of(pid: int) -> list[int]:
        got = via_task_files(pid)
        return got if got is not None else via_scan(pid)

    return children_of


def loaded_libraries(pid: int, *, include_children: bool = True, proc: str = "/proc") -> list[LoadedLib]:
    """Shared objects mapped by pid (and, by default, its descendants), unique by path; the main process first.

    Raises InspectError when the main process does not exist, has exited (zombie, empty maps) or its maps
    cannot be read. A descendant that exits while being read is skipped: what it had loaded no longer runs.
    """
    main = _read_maps(pid, proc=proc, required=True)
    libs = {lib.path: lib for lib in main}
    if include_children:
        for child in descendants(pid, proc=proc):
            try:
                child_libs = _read_maps(child, proc=proc, required=False)
            except InspectError:
                continue
            for lib in child_libs:
                libs.setdefault(lib.path, lib)
    return list(libs.values())


def _read_maps(pid: int, *, proc: str, required: bool) -> list[LoadedLib]:
    path = f"{proc}/{pid}/maps"
    try:
        text = _read_text(path)
    except FileNotFoundError as exc:
        raise InspectError(f"process {pid} is not running (no {path})",
                           hint="the backend exited; see its journal") from exc
    except PermissionError as exc:
        raise InspectError(f"cannot read {path}: permission denied",
                           hint="run deploytool as root (or as the service's user) to inspect the backend") from exc
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            raise InspectError(f"process {pid} exited while {path} was being read") from exc
        raise InspectError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if not text.strip():
        if _is_zombie(pid, proc) or not os.path.exists(f"{proc}/{pid}"):
            raise InspectError(f"process {pid} exited while its memory maps were being read",
                               hint="the backend exited; see its journal")
        if required:
            raise InspectError(f"{path} is empty: cannot tell what process {pid} loaded",
                               hint="run deploytool as root to inspect the backend")
    return parse_maps(text, pid)


# --------------------------------------------------------------------------------------------------------------
# Hashing
# --------------------------------------------------------------------------------------------------------------


#: SHA-256 through the stat-keyed cache of hashing (dev, inode, size, mtime_ns, ctime_ns), so a 516 MB
#: libfastllm_tools.so is read once; kept here under its old name for callers and tests.
HashCache = hashing.HashCache


#: The default hasher (process-wide cache).
sha256_cached = HashCache()


# --------------------------------------------------------------------------------------------------------------
# Library check
# --------------------------------------------------------------------------------------------------------------


def library_family(name: str) -> str | None:
    """The KNOWN_LIBRARIES family of a file name, or None when it is not a library we track."""
    for family, pattern in KNOWN_LIBRARIES.items():
        if fnmatch.fnmatchcase(name, pattern):
            return family
    return None


def _pin_names(key: str, pin: Pin) -> frozenset[str]:
    """The file names a pin answers to: its own and its symlink target's."""
    return frozenset((os.path.basename(pin.path), os.path.basename(os.path.realpath(pin.path))))


def _stem(name: str) -> str:
    """`libggml-base.so.0.20.0` -> `libggml-base`."""
    return name.split(".so", 1)[0]


def _pin_family(key: str, names: frozenset[str]) -> str | None:
    """The family of pin `key` whose file names (_pin_names) are `names`."""
    if key in KNOWN_LIBRARIES:
        return key
    for name in (key, *sorted(names)):
        fam = library_family(name)
        if fam:
            return fam
    return None


def _direct_match(lib: LoadedLib, key: str, names: frozenset[str]) -> int:
    """How specifically pin `key` (file names `names`) names lib: 3 exact file name, 2 glob key, 1 family key, 0
    not at all.

    A family key (`nccl`) only names the families loaded as one file; pin ggml/llama/cublas files by file name.
    """
    if lib.name == key or lib.name in names:
        return 3
    if any(c in key for c in "*?[") and fnmatch.fnmatchcase(lib.name, key):
        return 2
    if key in SINGLE_FILE_FAMILIES and fnmatch.fnmatchcase(lib.name, KNOWN_LIBRARIES[key]):
        return 1
    return 0


def _maps_dev(dev: str) -> int | None:
    try:
        major, minor = dev.split(":")
        return os.makedev(int(major, 16), int(minor, 16))
    except ValueError:
        return None


def _same_inode(st: os.stat_result, lib: LoadedLib) -> bool | None:
    """True/False when the file system says whether st is the mapped file; None when it cannot tell."""
    dev = _maps_dev(lib.dev)
    if not lib.inode or dev is None or dev != st.st_dev:
        return None  # different device numbers (overlay file systems): the inode proves nothing
    return st.st_ino == lib.inode


def _same_file(loaded: str, pinned: str, lib: LoadedLib) -> bool:
    """Whether the pinned path names the file the process maps (same path after symlinks, or same inode)."""
    try:
        if os.path.realpath(pinned) == loaded:
            return True
        return bool(_same_inode(os.stat(pinned), lib))
    except OSError:
        return False


def _hash_loaded(lib: LoadedLib, hash_file: Callable[[str], str]) -> tuple[str | None, str | None]:
    """(sha256 of the bytes the process maps, None) or (None, why it could not be read)."""
    if lib.map_file:
        try:
            return hash_file(lib.map_file), None
        except OSError:
            pass  # map_files needs extra privileges on some kernels: fall back to the path
    if lib.deleted:
        return None, f"{lib.path} was deleted and /proc/{lib.pid}/map_files is not readable"
    try:
        st = os.stat(lib.path)
    except OSError as exc:
        return None, f"cannot stat {lib.path}: {exc.strerror or exc}"
    if _same_inode(st, lib) is False:
        return None, (f"{lib.path} on disk is no longer the file process {lib.pid} mapped "
                      f"(inode {st.st_ino}, mapped {lib.inode}): it was replaced under the running process")
    if not stat.S_ISREG(st.st_mode):
        return None, f"{lib.path} is not a regular file"
    try:
        return hash_file(lib.path), None
    except OSError as exc:
        return None, f"cannot read {lib.path}: {exc.strerror or exc}"


def assess_libraries(libs: Iterable[LoadedLib], pins: Mapping[str, Pin], *,
                     hash_file: Callable[[str], str] = sha256_cached) -> LibraryReport:
    """Compare every known native library the process maps with its pin; one row per library, plus findings.

    A library matches a pin by exact file name, by a glob key (`libggml*.so*`), by a family key (`nccl`), or, when
    none of these, by family: a system `libnccl.so.2.22.3` mapped where the pin names the bundle's
    `libnccl.so.2` fails with both paths named. A `(deleted)` mapping fails (the file was replaced under the
    running process). A hash is taken of the bytes the process maps (via /proc/<pid>/map_files when readable).
    """
    rows: list[LibStatus] = []
    findings: list[RuntimeFinding] = []
    used_pins: set[str] = set()
    names = {key: _pin_names(key, pin) for key, pin in pins.items()}  # one realpath per pin, not per library
    fams = {key: _pin_family(key, n) for key, n in names.items()}
    for lib in libs:
        family = library_family(lib.name)
        if family is None:
            continue
        scored = [(_direct_match(lib, key, names[key]), key) for key in pins]
        scored = [s for s in scored if s[0] > 0]
        key: str | None = None
        if scored:
            key = max(scored)[1]
        else:
            same_family = [k for k in pins if fams[k] == family
                           and (family in SINGLE_FILE_FAMILIES or _stem(lib.name) in {_stem(n) for n in names[k]})]
            if len(same_family) == 1:
                key = same_family[0]
            elif same_family:
                # a family with several pinned files (ggml: base, cpu, cuda...) and this one is none of them
                pinned = ", ".join(pins[k].path for k in sorted(same_family))
                findings.append(RuntimeFinding(
                    "library", FAIL, lib.name,
                    f"{lib.name}: process {lib.pid} maps {lib.path}, which is none of the pinned {family} "
                    f"libraries ({pinned})", loaded_path=lib.path, pid=lib.pid,
                    hint="the backend loads a library from outside the bundle; check LD_LIBRARY_PATH/LD_PRELOAD"))
                rows.append(LibStatus(lib.name, lib.path, lib.pid, False, None, FAIL, deleted=lib.deleted))
                continue
        if key is None:
            rows.append(LibStatus(lib.name, lib.path, lib.pid, False, None,
                                  FAIL if lib.deleted else "unpinned", deleted=lib.deleted))
            if lib.deleted:
                findings.append(_deleted_finding(lib, None))
            continue
        used_pins.add(key)
        pin = pins[key]
        status = OK
        sha: str | None = None
        if lib.deleted:
            findings.append(_deleted_finding(lib, pin.path))
            status = FAIL
        if not _same_file(lib.path, pin.path, lib):
            findings.append(RuntimeFinding(
                "library", FAIL, lib.name,
                f"{lib.name}: process {lib.pid} loaded {lib.path}, but the pinned library is {pin.path}",
                loaded_path=lib.path, pinned_path=pin.path, pid=lib.pid,
                hint="an unexpected copy is loaded (system library, LD_LIBRARY_PATH, missing LD_PRELOAD); "
                     "fix the unit's environment so the pinned file is used"))
            status = FAIL
        sha, why = _hash_loaded(lib, hash_file)
        if sha is None:
            findings.append(RuntimeFinding("library", UNKNOWN, lib.name,
                                    f"{lib.name}: could not determine the hash of the loaded library: {why}",
                                    loaded_path=lib.path, pinned_path=pin.path, pid=lib.pid))
            status = worst([status, UNKNOWN])
        elif sha.lower() != pin.sha256.lower():
            findings.append(RuntimeFinding(
                "library", FAIL, lib.name,
                f"{lib.name}: the loaded {lib.path} has SHA-256 {sha[:16]}..., the pin for {pin.path} "
                f"is {pin.sha256[:16]}...", loaded_path=lib.path, pinned_path=pin.path, pid=lib.pid,
                hint="the library changed since it was pinned; reinstall the bundle or re-pin on purpose"))
            status = FAIL
        rows.append(LibStatus(lib.name, lib.path, lib.pid, True, pin.path, status, sha, lib.deleted))
    mapped = {row.path for row in rows if row.path}
    used_shas = {pins[k].sha256.lower() for k in used_pins}
    used_single = {fams[k] for k in used_pins if fams[k] in SINGLE_FILE_FAMILIES}
    for key, pin in pins.items():
        if key in used_pins or os.path.realpath(pin.path) in mapped:
            continue  # another name (symlink) of a file already listed
        if pin.sha256.lower() in used_shas:
            continue  # a copy of a mapped file under another name (a wheel stores libx.so, libx.so.0 as copies)
        if fams[key] in used_single:
            continue  # the other variant of a one-file family (libfastllm_tools.so when -cpu.so is the one loaded)
        rows.append(LibStatus(os.path.basename(pin.path), None, None, True, pin.path, WARN))
        findings.append(RuntimeFinding("library", WARN, os.path.basename(pin.path),
                                f"pinned {pin.path} is not mapped by the process (not loaded yet, or not used)",
                                pinned_path=pin.path))
    return LibraryReport(tuple(rows), tuple(findings))


def _deleted_finding(lib: LoadedLib, pinned: str | None) -> RuntimeFinding:
    return RuntimeFinding("library", FAIL, lib.name,
                   f"{lib.name}: process {lib.pid} maps {lib.path} (deleted): the file was replaced or removed "
                   f"on disk while the process runs, so disk fingerprints no longer describe it",
                   loaded_path=lib.path, pinned_path=pinned, pid=lib.pid,
                   hint="restart the backend so it runs the installed file")


# --------------------------------------------------------------------------------------------------------------
# CPU fallback
# --------------------------------------------------------------------------------------------------------------

_FT_LOAD_RE = re.compile(r"(?:^|[\s:\]])Load (libfastllm_tools[\w.-]*\.so)\s*$", re.M)  # journal prefixes ok
_LL_NO_GPU_RE = re.compile(r"no usable GPU found", re.I)
# ggml-cuda's one line when CUDA init fails (measured on an H200, five causes): llama-server then serves on the CPU
_LL_CUDA_INIT_RE = re.compile(r"ggml_cuda_init: failed to initialize CUDA: ?([^\n]*)")
_LL_OFFLOADED_RE = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
_LL_BUFFER_RE = re.compile(r"(?:load_tensors|llama_kv_cache|llama_context|sched_reserve):\s+(\S+)\s+"
                           r"(?:model|KV|compute|output)\s+buffer size")
_LL_DEVICE_INFO_RE = re.compile(r"common_param:\s+-\s+(\S+)\s+:")
_GPU_DEV_RE = re.compile(r"^(CUDA|ROCm|Vulkan|SYCL|Metal|MUSA|CANN|OpenCL|HTP|RPC)\d*(?:\[.*\])?$", re.I)


def _gpu_devices(names: Iterable[str], profile: str) -> set[str]:
    out = {n for n in names if _GPU_DEV_RE.match(n) and "host" not in n.lower()}
    if profile == "cuda":
        out = {n for n in out if n.upper().startswith("CUDA")}
    return out


def detect_cpu_fallback(kind: str, log_text: str, device_profile: str) -> RuntimeFinding | None:
    """A `fail` finding when a GPU-profile backend runs on the CPU; `unknown` when the log cannot tell; else None.

    ftllm: `Load libfastllm_tools-cpu.so` (its loader fell back after the CUDA library failed to load) fails;
    `Load libfastllm_tools.so` (or -cu11) passes. llama.cpp: `no usable GPU found`, `offloaded 0/N layers`, or
    model/KV buffers that all live in host memory fail; a model or KV buffer on a GPU device passes. Note that
    llama-server prints "offloaded N/N layers to GPU" even when the only device is the CPU, so that line alone
    is not proof of GPU use; at the default verbosity (-lv 3) the load lines are not logged at all.
    """
    profile = (device_profile or "").lower()
    if profile in ("", "cpu"):
        return None
    text = log_text or ""
    if kind == "ftllm":
        loads = _FT_LOAD_RE.findall(text)
        if not loads:
            return RuntimeFinding("cpu-fallback", UNKNOWN, kind,
                           f"could not determine which FastLLM library loaded: no 'Load libfastllm_tools*.so' "
                           f"line in the log (device profile {profile})",
                           hint="read the log from the start of this run (journalctl -u UNIT --since START)")
        last = loads[-1]
        if last == "libfastllm_tools-cpu.so":
            return RuntimeFinding("cpu-fallback", FAIL, kind,
                           f"the {profile} backend fell back to the CPU: its log says 'Load {last}' "
                           f"(the CUDA library failed to load)",
                           hint="see 'FastLLM load errors' in the log; check the CUDA runtime and NCCL paths")
        return None
    if kind == "llamacpp":
        init = _LL_CUDA_INIT_RE.search(text)
        if init and profile == "cuda":
            return RuntimeFinding("cpu-fallback", FAIL, kind,
                           f"the cuda backend runs on the CPU: llama-server says 'ggml_cuda_init: failed to initialize "
                           f"CUDA: {init.group(1).strip()}'",
                           hint="see the unit's device access (DeviceAllow=, nodes and their group, nvidia-uvm)")
        if _LL_NO_GPU_RE.search(text):
            return RuntimeFinding("cpu-fallback", FAIL, kind,
                           f"the {profile} backend runs on the CPU: llama-server says 'no usable GPU found'",
                           hint="the GPU backend library did not load; check the build and the driver")
        offloaded = _LL_OFFLOADED_RE.findall(text)
        if offloaded and int(offloaded[-1][0]) == 0:
            n, total = offloaded[-1]
            return RuntimeFinding("cpu-fallback", FAIL, kind,
                           f"the {profile} backend offloads nothing: llama-server says 'offloaded {n}/{total} "
                           f"layers to GPU'", hint="set -ngl (n_gpu_layers) and check the GPU is visible")
        buffers = set(_LL_BUFFER_RE.findall(text))
        gpu = _gpu_devices(buffers, profile)
        if gpu:
            return None
        if buffers:
            return RuntimeFinding("cpu-fallback", FAIL, kind,
                           f"the {profile} backend keeps its model and KV buffers in host memory only "
                           f"({', '.join(sorted(buffers))}): no GPU device is used")
        devices = set(_LL_DEVICE_INFO_RE.findall(text))
        if devices and not _gpu_devices(devices, profile):
            return RuntimeFinding("cpu-fallback", FAIL, kind,
                           f"llama-server sees no {profile.upper()} device (devices: {', '.join(sorted(devices))})")
        return RuntimeFinding("cpu-fallback", UNKNOWN, kind,
                       "could not determine whether llama-server uses the GPU: the log has no buffer or "
                       "offload lines", hint="run llama-server with -lv 4 (LLAMA_ARG_LOG_VERBOSITY=4) so its "
                                             "load lines are logged")
    return RuntimeFinding("cpu-fallback", UNKNOWN, kind, f"unknown backend kind {kind!r}: cannot check for CPU fallback")


# --------------------------------------------------------------------------------------------------------------
# Capacity read-back
# --------------------------------------------------------------------------------------------------------------

_NUM = r"(-?\d+(?:\.\d+)?)"
_FT_CARD_AVAIL_RE = re.compile(r"GPU\s+(\d+):[^\n]*?\bavailForKV=" + _NUM + r"\s*GB")
_FT_CARD_PAGE_RE = re.compile(r"GPU\s+(\d+):[^\n]*?\b(?:localKVPerPage|kvPerPage)=" + _NUM + r"\s*MB")
_FT_PAGE_RE = re.compile(r"\b(?:localKVPerPage|kvPerPage)=" + _NUM + r"\s*MB")
_FT_LIMIT_RE = re.compile(r"KV Cache Token limit:\s*(\d+)(?:\s*tokens)?\s*(?:\((?:totalPages=(\d+),\s*)?"
                          r"pageLen=(\d+)\))?")
_FT_PREFILL_RE = re.compile(r"AddPrefill Pages limit:\s*(\d+)\s*pages")
_FT_WINDOW_RE = re.compile(r"Model context window:\s*(\d+)\s+tokens per session")
_FT_UNKNOWN_GPU_RE = re.compile(r"AutoWarmup GPU\s+\d+:")

_LL_N_CTX_SEQ_RE = re.compile(r"llama_context:\s+n_ctx_seq\s*=\s*(\d+)")
_LL_N_CTX_RE = re.compile(r"llama_context:\s+n_ctx\s*=\s*(\d+)")
_LL_SLOT_RE = re.compile(r"n_ctx_slot\s*=\s*(\d+)")
_LL_KV_SIZE_RE = re.compile(r"llama_kv_cache:\s+size\s*=\s*" + _NUM + r"\s*MiB\s*\(\s*(\d+)\s+cells")
_LL_KV_BUF_RE = re.compile(r"llama_kv_cache:\s+(\S+)\s+KV buffer size\s*=\s*" + _NUM + r"\s*MiB")


def _last(regex: re.Pattern[str], text: str) -> tuple[str, ...] | None:
    found = regex.findall(text)
    if not found:
        return None
    last = found[-1]
    return last if isinstance(last, tuple) else (last,)


def _fmt_tokens(n: int) -> str:
    return f"{n:,}"


def capacity_truth(kind: str, log_text: str, configured_ctx: int | None, *, policy: str = WARN) -> CapacityReport:
    """Redo the server's KV accounting from its startup log: the context that really fits, per card.

    `policy` is the status given when the configured context is only on paper: "warn" (default) or "fail".
    A log this function cannot read yields status "unknown" with the reason, never "ok".
    """
    if policy not in (WARN, FAIL):
        raise ValueError(f"capacity policy must be 'warn' or 'fail', not {policy!r}")
    text = log_text or ""
    try:
        if kind == "ftllm":
            return _ftllm_capacity(text, configured_ctx, policy)
        if kind == "llamacpp":
            return _llamacpp_capacity(text, configured_ctx, policy)
    except (ValueError, ArithmeticError) as exc:  # a malformed number in a log line we thought we knew
        return CapacityReport((), None, UNKNOWN, f"could not determine the KV capacity: unreadable log line ({exc})",
                              configured_ctx)
    return CapacityReport((), None, UNKNOWN, f"could not determine the KV capacity of unknown backend kind {kind!r}",
                          configured_ctx)


def _ftllm_capacity(text: str, configured: int | None, policy: str) -> CapacityReport:
    avail = {int(c): float(v) for c, v in _FT_CARD_AVAIL_RE.findall(text)}
    card_page = {int(c): float(v) for c, v in _FT_CARD_PAGE_RE.findall(text)}
    limit = _last(_FT_LIMIT_RE, text)
    prefill = _last(_FT_PREFILL_RE, text)
    window = _last(_FT_WINDOW_RE, text)
    page_any = _last(_FT_PAGE_RE, text)

    if not avail:
        if _FT_UNKNOWN_GPU_RE.search(text):
            return CapacityReport((), None, UNKNOWN, "could not determine the KV capacity: the log has "
                                  "'AutoWarmup GPU' lines without availForKV (a newer ftllm?)", configured)
        if window and not limit:
            # CPU run: no per-card page pool; ftllm enforces this context per session
            tokens = int(window[0])
            return _verdict((), tokens, configured, policy, tokens,
                            f"ftllm reports {_fmt_tokens(tokens)} tokens per session; no GPU KV pool to check "
                            f"(CPU run)", None)
        return CapacityReport((), None, UNKNOWN, "could not determine the KV capacity: no 'availForKV' or "
                              "'Model context window' line in the ftllm log", configured)
    if not limit or not limit[2]:
        return CapacityReport((), None, UNKNOWN, "could not determine the KV capacity: no 'KV Cache Token limit: "
                              "N tokens (totalPages=P, pageLen=L)' line in the ftllm log", configured)
    paper = int(limit[0])
    page_len = int(limit[2])
    total_pages = int(limit[1]) if limit[1] else math.ceil(paper / page_len)
    if page_len <= 0:
        return CapacityReport((), None, UNKNOWN, f"could not determine the KV capacity: pageLen={page_len}",
                              configured)
    prefill_pages = int(prefill[0]) if prefill else None
    prefill_tokens = prefill_pages * page_len if prefill_pages is not None else None
    cards: list[CardCapacity] = []
    parts: list[str] = []
    short: list[str] = []
    for card in sorted(avail):
        per_page = card_page.get(card, float(page_any[0]) if page_any else None)
        if per_page is None or per_page <= 0:
            return CapacityReport((), None, UNKNOWN, f"could not determine the KV capacity: no localKVPerPage "
                                  f"for GPU {card} in the ftllm log", configured, paper)
        avail_mb = avail[card] * 1024.0
        need_mb = total_pages * per_page
        fits_pages = max(0, math.floor(avail_mb / per_page + 1e-9))
        ceiling = min(fits_pages, total_pages) * page_len
        ok = fits_pages >= total_pages
        cards.append(CardCapacity(f"GPU {card}", round(need_mb, 2), round(avail_mb, 2), ceiling, ok))
        line = (f"GPU {card} can give {avail[card]:.2f} GB to a KV pool needing {need_mb / 1024:.2f} GB "
                f"({_fmt_tokens(total_pages)} pages x {per_page:.2f} MB)")
        if ok:
            parts.append(line + ": fits")
        else:
            short.append(line + f": only {_fmt_tokens(fits_pages)} pages = {_fmt_tokens(ceiling)} tokens fit, "
                                f"a long prompt would crash GPU {card}")
    ceiling_tokens = min(c.ceiling_tokens for c in cards if c.ceiling_tokens is not None)
    detail = "; ".join(short + parts)
    if prefill_pages is not None and prefill_tokens is not None:
        detail += (f"; one prompt is capped at {_fmt_tokens(prefill_pages)} pages = "
                   f"{_fmt_tokens(prefill_tokens)} tokens")
    return _verdict(tuple(cards), ceiling_tokens, configured, policy, paper, detail, prefill_tokens)


def _verdict(cards: tuple[CardCapacity, ...], ceiling: int, configured: int | None, policy: str,
             paper: int | None, detail: str, prefill_tokens: int | None) -> CapacityReport:
    target = configured if configured else paper
    if target and ceiling < target:
        head = (f"context {_fmt_tokens(target)} is only on paper: about {_fmt_tokens(ceiling)} tokens "
                f"really fit")
        return CapacityReport(cards, ceiling, policy, f"{head}. {detail}", configured, paper, prefill_tokens)
    head = f"{_fmt_tokens(ceiling)} tokens fit" + (f" (configured {_fmt_tokens(configured)})" if configured else "")
    return CapacityReport(cards, ceiling, OK, f"{head}. {detail}", configured, paper, prefill_tokens)


def _llamacpp_capacity(text: str, configured: int | None, policy: str) -> CapacityReport:
    seq = _last(_LL_N_CTX_SEQ_RE, text) or _last(_LL_SLOT_RE, text)
    n_ctx = _last(_LL_N_CTX_RE, text)
    kv = _last(_LL_KV_SIZE_RE, text)
    found = seq or n_ctx
    if not found:
        return CapacityReport((), None, UNKNOWN, "could not determine the context size: no 'llama_context: "
                              "n_ctx' or 'n_ctx_slot' line in the llama-server log", configured)
    per_seq = int(found[0])
    buffers: dict[str, float] = {}
    for dev, mib in _LL_KV_BUF_RE.findall(text):
        buffers[dev] = float(mib)
    cards = tuple(CardCapacity(dev, mib, None, None, True) for dev, mib in sorted(buffers.items()))
    detail = f"llama-server allocated its KV cache at load: {_fmt_tokens(per_seq)} tokens per sequence"
    if n_ctx:
        detail += f" (n_ctx {_fmt_tokens(int(n_ctx[0]))}"
        if kv:
            detail += f", {_fmt_tokens(int(kv[1]))} cells, {float(kv[0]):.2f} MiB"
        detail += ")"
    if buffers:
        detail += "; KV buffers: " + ", ".join(f"{d} {m:.2f} MiB" for d, m in sorted(buffers.items()))
    else:  # llama-server's default verbosity (3) logs no buffer lines (field notes, pitfall 16): say so, never guess
        detail += ("; per-device KV buffer sizes: could not determine (the log has no 'KV buffer size' lines; "
                   "llama-server writes them at -lv 4 and above)")
    if configured and per_seq < configured:
        return CapacityReport(cards, per_seq, policy,
                              f"context {_fmt_tokens(configured)} is only on paper: the server runs at "
                              f"{_fmt_tokens(per_seq)} tokens per sequence (is -c set? -sm tensor ignores --fit). "
                              f"{detail}", configured, per_seq)
    return CapacityReport(cards, per_seq, OK, f"{_fmt_tokens(per_seq)} tokens fit. {detail}", configured, per_seq)


# --------------------------------------------------------------------------------------------------------------
# GPU residency
# --------------------------------------------------------------------------------------------------------------


def gpu_residency(pid: int, gpus: Iterable[int], *, proc: str = "/proc") -> gpu.Residency:
    """Which of its GPUs' nodes the server `pid` and its descendants hold open (deploy_tool.gpu)."""
    try:
        pids = [pid, *descendants(pid, proc=proc)]
    except InspectError:
        pids = [pid]
    return gpu.residency(pids, gpus, proc=proc)


def residency_finding(res: gpu.Residency, who: str) -> RuntimeFinding | None:
    """FAIL when the server does not hold every one of its GPUs, UNKNOWN when that cannot be read, else None."""
    if not res.known:
        return RuntimeFinding("gpu-residency", UNKNOWN, who, res.describe(who))
    if not res.ok:
        return RuntimeFinding("gpu-residency", FAIL, who, res.describe(who),
                              hint="its CUDA init failed: see the unit's device access (DeviceAllow=, the nodes and "
                                   "their group, nvidia-uvm) and `deploytool check` on the box")
    return None


# --------------------------------------------------------------------------------------------------------------
# One call for the gate and `status --deep`
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RuntimeReport:
    """Everything known about one running backend: its libraries, CPU fallback and KV capacity findings."""

    pid: int
    kind: str
    libraries: tuple[LibStatus, ...]
    findings: tuple[RuntimeFinding, ...]
    capacity: CapacityReport | None = None
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def status(self) -> str:
        return worst([f.status for f in self.findings])

    def failures(self) -> list[RuntimeFinding]:
        return [f for f in self.findings if f.status == FAIL]

    def to_rows(self) -> list[dict[str, str]]:
        """Table rows for `status`, all with the keys what, name, detail, pinned, status.

        One row per known native library (detail: the loaded path, or "(not mapped)" for a pin the process
        does not map; pinned: yes/no), then the capacity truth (name: the real token ceiling; detail: the
        arithmetic), then CPU-fallback and inspection findings.
        """
        rows = [{"what": "library", "name": r.name, "detail": r.path or "(not mapped)",
                 "pinned": "yes" if r.pinned else "no", "status": r.status + (" (deleted)" if r.deleted else "")}
                for r in self.libraries]
        if self.capacity is not None:
            ceiling = "?" if self.capacity.ceiling_tokens is None else _fmt_tokens(self.capacity.ceiling_tokens)
            rows.append({"what": "capacity", "name": f"{ceiling} tokens", "detail": self.capacity.message,
                         "pinned": "-", "status": self.capacity.status})
        res = self.extra.get("gpu")
        if isinstance(res, dict):
            held = ", ".join(res["held"]) or "no NVIDIA device"
            rows.append({"what": "gpu", "name": ", ".join(res["required"]),
                         "detail": f"held: {held}", "pinned": "-",
                         "status": OK if res["ok"] else FAIL if res["known"] else UNKNOWN})
        for f in self.findings:
            if f.check in ("cpu-fallback", "inspect", "gpu-residency"):
                rows.append({"what": f.check, "name": f.subject, "detail": f.message, "pinned": "-",
                             "status": f.status})
        return rows

    def to_json(self) -> dict[str, object]:
        return {"pid": self.pid, "kind": self.kind, "status": self.status,
                "libraries": [r.to_json() for r in self.libraries],
                "findings": [f.to_json() for f in self.findings],
                "capacity": self.capacity.to_json() if self.capacity else None, **self.extra}


def inspect_runtime(pid: int, *, kind: str, pins: Mapping[str, Pin],
                    log_text: str | Callable[[], str] | None = None,
                    device_profile: str = "cpu", configured_ctx: int | None = None,
                    capacity_policy: str = WARN, hash_file: Callable[[str], str] = sha256_cached,
                    include_children: bool = True, proc: str = "/proc",
                    gpus: Iterable[int] = ()) -> RuntimeReport:
    """Inspect a running backend; never raises for a vanished process, unreadable /proc or an unknown log.

    `log_text` may be a function, called once the libraries are assessed (a log read in the background)."""
    findings: list[RuntimeFinding] = []
    rows: tuple[LibStatus, ...] = ()
    try:
        libs = loaded_libraries(pid, include_children=include_children, proc=proc)
    except InspectError as exc:
        findings.append(RuntimeFinding("inspect", UNKNOWN, f"pid {pid}", f"could not determine the loaded libraries: "
                                f"{exc.message}", pid=pid, hint=exc.hint))
    else:
        report = assess_libraries(libs, pins, hash_file=hash_file)
        rows = report.rows
        findings.extend(report.findings)
    extra: dict[str, object] = {}
    gpus = tuple(gpus)
    if (device_profile or "").lower() == "cuda" and gpus:
        res = gpu_residency(pid, gpus, proc=proc)
        extra["gpu"] = res.to_json()
        found = residency_finding(res, f"pid {pid}")
        if found is not None:
            findings.append(found)
    capacity = None
    if callable(log_text):
        log_text = log_text()
    if log_text is not None:
        fallback = detect_cpu_fallback(kind, log_text, device_profile)
        if fallback is not None:
            findings.append(fallback)
        capacity = capacity_truth(kind, log_text, configured_ctx, policy=capacity_policy)
        cap_finding = capacity.to_finding(kind)
        if cap_finding is not None:
            findings.append(cap_finding)
    return RuntimeReport(pid, kind, rows, tuple(findings), capacity, extra)
