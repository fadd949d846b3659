"""Fingerprints of an installed backend, pinned at install and checked before every start (ExecStartPre).

`collect(cfg, backend)` computes the current values; `pin()` writes them with a reason to
`<state_dir>/pins/<backend>.json` (atomically) and records who/why/when in history; `verify()` compares and
lists every difference as (item, expected, actual). `deploytool verify` exits 7 on any difference, which makes
systemd refuse the start, and prints one plain line per changed item for `journalctl -u` / `systemctl status`.

What is fingerprinted (item ids in brackets; a missing file is a value too: "missing"):
  release   the release `current` points at [release], and every entry under it, whatever it is and whoever
            uses it (the backend venv, deploytool's own venv, templates, NCCL, the release's units and env files,
            MANIFEST, wheels): a file by type, mode, owner and SHA-256, a symlink by its owner and target string,
            a directory by its mode and owner [release/PATH] (deploy_tool.box.treepin; the owner is written only
            when it is not root's 0:0). Anything added after the pin is drift as well
            (expected "absent"): a new .pth, sitecustomize or usercustomize module, a planted .pyc in a
            __pycache__, any new file in any directory. A venv outside the release (a backend's executable
            elsewhere [venv/PATH], or paths.deploytool's venv [tool/PATH], see _collect_tool) is pinned the same way.
  ftllm     ftllm version from the venv's dist-info METADATA [ftllm.version] (ftllm is never imported), Python
            version from pyvenv.cfg [python.version], the base interpreter's real path [python.interpreter] and
            SHA-256 [python.binary] (and its libpython, when linked against one [python.libpython]), the import
            hooks in the base interpreter's own library directories [python.hooks, python.hook/NAME], and
            whether the bundled NCCL (its bytes are a tree entry, like the chat template's) still holds code for
            the configured GPU architecture under the arch policy [nccl.arch].
  llamacpp  SHA-256 of the binary [binary.sha256] and its mode and owner [binary.mode], its build as `--version` reports it
            (run only when the binary's hash matches the pin, never on a changed binary: the check runs as
            root) [binary.build], SHA-256 of every shared library beside the binary (libggml*, libllama*, ...)
            [binary.lib/NAME], mmproj size and header hash [mmproj.size, mmproj.header].
  both      the installed unit file [unit], its drop-ins <unit>.d/*.conf [unit.d/NAME], those of the other
            drop-in directories systemd reads for it (`a-.service.d`, `service.d`) [dropin/DIR/NAME] and the env
            file [env];
            the model: a directory gives its config.json SHA-256 [model.config], every weight file's size
            [model.weight/NAME] and the SHA-256 of its small metadata files (tokenizer, generation config,
            custom code) [model.file/NAME]; a single GGUF file gives its size [model.size] and the SHA-256 of
            its first 1 MiB (the header: architecture, hyper-parameters, tokenizer, chat template)
            [model.header], plus the sizes of the other parts of a split GGUF [model.split/NAME]; the
            speculative draft directory likewise [draft.*].
Not fingerprinted: the API key file env/api-key (a hash of a short key in a world-readable pins file could be guessed),
drop-ins outside the unit dir (/run/systemd/system, system.control), the system libraries (libc, CUDA driver).

Speed. Files are hashed by deploy_tool.hashing (the one SHA-256 engine: 1 MiB reads, parallel threads, largest
first). A cache in `<state_dir>/cache/fingerprint-<backend>.json` (hashing.HashCache) maps a file's path and
(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns) to the values computed from it, so a start with nothing
changed only stats files. Why that can be trusted, and its limits (where `verify --no-cache` is the answer), is
in deploy_tool.hashing's module doc. The cache file is trusted only when owned by root or the user running
verify and not group- or world-writable; `--no-cache` ignores it; `pin` always hashes afresh.

Nothing here may import jinja2 or cryptography: the units' ExecStartPre verify must not depend on them.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from deploy_tool import __version__, strictmodes
from deploy_tool.binaries import arch_supported, read_fatbin, read_llama_version
from deploy_tool.box import packedconfig, treepin
from deploy_tool.box.state import Store
from deploy_tool.clock import iso_utc
from deploy_tool.config import (
    BUNDLED_FRONT,
    BUNDLED_NCCL,
    Backend,
    Config,
    FtllmBackend,
    LlamacppBackend,
    expand,
)
from deploy_tool.errors import DeployError, DriftError, InputError, StateError
from deploy_tool.fsutil import atomic_write, os_error
from deploy_tool.hashing import (
    RACY_MARGIN_S,
    HashCache,
    NotAFile,
    open_file,
    parallel,
    settled,
    sha256_fd,
    stat_key,
)
from deploy_tool.textsafe import q, safe

PINS_FORMAT = 1
HEADER_BYTES = 1 << 20  # a GGUF's header hash covers its first 1 MiB
CACHE_RACY_MARGIN_S = RACY_MARGIN_S
SHORT_HASH = 12
MISSING = "missing"
ABSENT = "absent"  # a tree entry that was not there at pin time

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".flm", ".pt", ".pth", ".ckpt", ".npz", ".h5", ".msgpack")
META_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken", ".py", ".yaml")
META_MAX_BYTES = 64 << 20
_SPLIT_GGUF = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<total>\d{5})\.gguf$")
_HEX64 = re.compile(r"[0-9a-f]{64}")


# --------------------------------------------------------------------------------------------------------------
# data


@dataclass(frozen=True)
class Item:
    """One fingerprint: a stable id, a human label, the file it comes from (if any) and its value."""

    id: str
    label: str
    path: str | None
    value: str

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "label": self.label, "path": self.path, "value": self.value}


class Drift(NamedTuple):
    """One difference: (item, expected, actual); `item` is the current item, or the pinned one if gone.
    `pinned_path`: the file the pin was taken of, where the config now names another for the same item (the config
    was edited since the pin)."""

    item: Item
    expected: str
    actual: str
    pinned_path: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"id": self.item.id, "label": self.item.label, "path": self.item.path,
                "expected": self.expected, "actual": self.actual,
                **({"pinned_path": self.pinned_path} if self.pinned_path is not None else {})}


@dataclass(frozen=True)
class TreePin:
    """A directory tree entry by entry (treepin): {path relative to root ("." is root itself): value}."""

    root: str
    entries: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        return {"root": self.root, "entries": self.entries}

    def items(self, prefix: str) -> list[Item]:
        return [_tree_item(prefix, self.root, rel, v) for rel, v in self.entries.items()]


def _tree_item(prefix: str, root: str, rel: str, value: str) -> Item:
    return Item(f"{prefix}/{rel}", f"{prefix}/{rel}", root if rel == treepin.ROOT else os.path.join(root, rel),
                value)


def _expand(items: Iterable[Item], trees: dict[str, TreePin]) -> list[Item]:
    return [*items, *(i for prefix, t in trees.items() for i in t.items(prefix))]


@dataclass(frozen=True)
class PinSet:
    backend: str
    kind: str
    pinned_at: str
    release: str | None
    reason: str
    by: dict[str, Any]
    items: tuple[Item, ...]  # the single items; the trees' entries are in `trees`
    path: str = ""
    trees: dict[str, TreePin] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"format": PINS_FORMAT, "backend": self.backend, "kind": self.kind, "pinned_at": self.pinned_at,
                "release": self.release, "reason": self.reason, "by": self.by, "deploytool": __version__,
                "items": [i.to_json() for i in self.items],
                "trees": {k: t.to_json() for k, t in self.trees.items()}}

    def values(self) -> dict[str, str]:
        return {i.id: i.value for i in self.items}

    def all_items(self) -> list[Item]:
        """The single items and every tree entry as an item (id `<tree>/<path>`)."""
        return _expand(self.items, self.trees)

    def count(self) -> int:
        return len(self.items) + sum(len(t.entries) for t in self.trees.values())


@dataclass(frozen=True)
class Stats:
    files: int = 0  # files whose content was needed (hashes and derived values)
    hashed: int = 0  # of those, hashed (or inspected) in this run
    cache_hits: int = 0
    bytes_hashed: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"files": self.files, "hashed": self.hashed, "cache_hits": self.cache_hits,
                "bytes_hashed": self.bytes_hashed, "seconds": round(self.seconds, 4)}


@dataclass(frozen=True)
class VerifyReport:
    ok: bool
    rows: list[Drift]
    backend: str = ""
    pins: PinSet | None = None
    items: tuple[Item, ...] = ()  # the single items
    stats: Stats = field(default_factory=Stats)
    trees: dict[str, TreePin] = field(default_factory=dict)

    def checked(self) -> int:
        return len(self.items) + sum(len(t.entries) for t in self.trees.values())

    def config_moved(self) -> str | None:
        """One line when the config names other files than were pinned (it was edited since the pin, e.g. for the
        next bundle): the cause of those rows, and the fix; None otherwise."""
        moved = [r for r in self.rows if r.pinned_path is not None]
        if not moved:
            return None
        paths = list(dict.fromkeys((r.pinned_path, r.item.path) for r in moved))
        shown = "; ".join(f"pinned {q(a)}, the config names {q(b)}" for a, b in paths[:3])
        return (f"the config names other files than were pinned ({shown}): it was edited after the pin, and "
                f"every start of {self.backend or 'the backend'} is refused until it is put back as the installed "
                "release has it, or the bundle packed with it is installed (or `deploytool pin` re-pins it on purpose)")

    def to_json(self) -> dict[str, Any]:
        p = self.pins
        return {"backend": self.backend, "ok": self.ok, "checked": self.checked(),
                "drift": [r.to_json() for r in self.rows],
                "pinned_at": p.pinned_at if p else None, "release": p.release if p else None,
                "reason": p.reason if p else None, "stats": self.stats.to_json(),
                "items": [i.to_json() for i in self.items],
                "trees": {k: {"root": t.root, "entries": len(t.entries)} for k, t in self.trees.items()}}


# --------------------------------------------------------------------------------------------------------------
# the cache


#: the stat-keyed cache of every file value (hashing.HashCache; its rules are in the module doc above)
Cache = HashCache


def cache_path(cfg: Config, backend: str) -> Path:
    """The cache of the single items' files, plus each tree's last snapshot (the fast path of a verify with
    nothing changed: treepin.snapshot_key)."""
    return Path(cfg.paths.state_dir) / "cache" / f"fingerprint-{backend}.json"


def files_cache_path(cfg: Config, backend: str) -> Path:
    """The cache of every file of the pinned trees (read only when a tree's snapshot changed)."""
    return Path(cfg.paths.state_dir) / "cache" / f"fingerprint-{backend}-files.json"


def cached_hasher(cfg: Config, backend: str) -> Callable[[str], str]:
    """SHA-256 of a file through the values `deploytool verify BACKEND` cached (same dev, inode, size, mtime_ns
    and ctime_ns, under any name), else computed (and kept in this process). Each cache file is read when a
    lookup first needs it: a gate whose process maps nothing pinned reads neither (the trees' cache is the
    large one)."""
    paths = (cache_path(cfg, backend), files_cache_path(cfg, backend))
    caches: list[HashCache] = []

    def sha256(path: str) -> str:
        st = os.stat(path)
        for i, p in enumerate(paths):
            if i == len(caches):
                caches.append(HashCache(p))
            hit = caches[i].get_same_file(st)
            if hit is not None:
                return hit
        return caches[0].sha256(path)

    return sha256


# --------------------------------------------------------------------------------------------------------------
# hashing


def _err_value(exc: OSError) -> str:
    if isinstance(exc, FileNotFoundError | NotADirectoryError):
        return MISSING
    return f"unreadable ({exc.strerror or type(exc).__name__})"


class _Job:
    __slots__ = ("path", "kind", "st", "value", "cached", "fn", "nbytes", "cache", "nofollow", "settled")

    def __init__(self, path: str, kind: str, fn: Callable[[str], str] | None = None) -> None:
        self.path = path
        self.kind = kind  # "sha256", "head" or a derived kind ("build", "arch:7.5:exact")
        self.fn = fn
        self.st: os.stat_result | None = None
        self.value: str | None = None
        self.cached = False
        self.nbytes = 0
        self.cache: HashCache | None = None  # where the value goes (the collector's cache if None)
        self.nofollow = False  # a tree entry: hashed only if it is still the regular file the walk saw
        self.settled = False  # the value may be trusted by a later run (hashing.settled)


def _cost(job: _Job) -> int:
    size = job.st.st_size if job.st is not None else 0
    return size if job.kind == "sha256" else min(size, HEADER_BYTES)


def _run_hash(job: _Job, cache: HashCache) -> None:
    t0 = time.time_ns()
    cache = job.cache or cache
    try:
        fd = os.open(job.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | (os.O_NOFOLLOW if job.nofollow else 0))
    except OSError as exc:
        job.value = _err_value(exc)
        return
    try:
        st1 = os.fstat(fd)
        if not stat.S_ISREG(st1.st_mode):
            job.value = "not a regular file"
            return
        digest, n = sha256_fd(fd, limit=None if job.kind == "sha256" else HEADER_BYTES, regular=True)
        st2 = os.fstat(fd)
    except OSError as exc:
        job.value = _err_value(exc)
        return
    finally:
        os.close(fd)
    job.value, job.nbytes = digest, n
    # kept only if the file did not change while it was read (nor, for a tree entry, since the walk saw it)
    if stat_key(st1) == stat_key(st2) and not (job.nofollow and job.st is not None
                                               and stat_key(st1) != stat_key(job.st)):
        cache.put(job.path, st1, job.kind, digest, t0)
        job.settled = settled(st1, t0, cache.margin_ns, cache.coarse_margin_ns)


def _run_derived(job: _Job, cache: HashCache) -> None:
    assert job.fn is not None and job.st is not None
    t0 = time.time_ns()
    try:
        job.value = job.fn(job.path)
    except InputError as exc:
        job.value = f"unreadable ({exc.message})"
        return
    except OSError as exc:
        job.value = _err_value(exc)
        return
    with contextlib.suppress(OSError):
        if stat_key(os.stat(job.path)) == stat_key(job.st):
            cache.put(job.path, job.st, job.kind, job.value, t0)


# --------------------------------------------------------------------------------------------------------------
# collection


class _Collector:
    """Items in order; file contents are read later, all at once, in parallel, through the cache."""

    def __init__(self, cache: HashCache, expected: dict[str, str] | None, workers: int | None,
                 files_cache: Callable[[], HashCache] | None = None, use_cache: bool = True) -> None:
        self.cache = cache
        self.expected = expected
        self.workers = workers
        self.specs: list[tuple[str, str, str | None, Any]] = []  # (id, label, path, str value | _Job | guard)
        self.jobs: dict[tuple[str, str], _Job] = {}
        self.trees: dict[str, str] = {}  # prefix -> real path of the root
        self._files_cache_fn = files_cache or (lambda: HashCache())
        self._files_cache: HashCache | None = None
        self.use_cache = use_cache
        self.snapshots: dict[str, Any] = {}  # prefix -> the snapshot saved for the next run
        self.loaded_env: str | None = None  # the env file as systemd loaded it for this start (verify in a unit)

    def value(self, id: str, label: str, path: str | os.PathLike[str] | None, value: str) -> None:
        self.specs.append((id, label, None if path is None else str(path), value))

    def _job(self, path: str, kind: str, fn: Callable[[str], str] | None = None) -> _Job:
        key = (path, kind)
        if key not in self.jobs:
            self.jobs[key] = _Job(path, kind, fn)
        return self.jobs[key]

    def sha256(self, id: str, label: str, path: str | os.PathLike[str]) -> None:
        self.specs.append((id, label, str(path), self._job(str(path), "sha256")))

    def head(self, id: str, label: str, path: str | os.PathLike[str]) -> None:
        self.specs.append((id, label, str(path), self._job(str(path), "head")))

    def derived(self, id: str, label: str, path: str | os.PathLike[str], kind: str, fn: Callable[[str], str],
                *, guard: str | None = None) -> None:
        """A value computed from a file by `fn` (cached like a hash); with `guard`, computed only while the
        item `guard` still has its pinned value (e.g. run a binary only if its hash is the pinned one)."""
        self.specs.append((id, label, str(path), (self._job(str(path), kind, fn), guard)))

    def tree(self, prefix: str, root: str | os.PathLike[str]) -> bool:
        """Pin every entry under `root` (treepin) as `<prefix>/<path>`; False (nothing added) when root lies
        inside a tree already pinned (or is the root of one)."""
        real = os.path.realpath(root)
        if prefix in self.trees or any(treepin.inside(real, r) for r in self.trees.values()):
            return False
        self.trees[prefix] = real
        return True

    def in_tree(self, path: str | os.PathLike[str]) -> bool:
        real = os.path.realpath(path)
        return any(treepin.inside(real, r) for r in self.trees.values())

    def size(self, id: str, label: str, path: str | os.PathLike[str]) -> None:
        try:
            st = os.stat(path)
            v = str(st.st_size) if stat.S_ISREG(st.st_mode) else "not a regular file"
        except OSError as exc:
            v = _err_value(exc)
        self.value(id, label, path, v)

    def files_cache(self) -> HashCache:
        if self._files_cache is None:
            self._files_cache = self._files_cache_fn()
        return self._files_cache

    def _walk_tree(self, prefix: str, root: str, todo: list[_Job]) -> tuple[Any, list[Any], list[tuple[int, _Job]],
                                                                             int]:
        """(walk, values with None where a hash is pending, the pending jobs by index, cache hits)."""
        snap = self.cache.section("trees") if self.use_cache else None
        snap = snap.get(prefix) if isinstance(snap, dict) else None

        def unchanged(w: treepin.Walk) -> bool:
            return (isinstance(snap, dict) and snap.get("root") == root and snap.get("key") == treepin.snapshot_key(w)
                    and snap.get("settled") is True and isinstance(snap.get("values"), list)
                    and len(snap["values"]) == len(w.rels) and set(map(type, snap["values"])) <= {str})

        w = treepin.walk(root)
        key = treepin.snapshot_key(w)
        n = len(w.rels)
        if unchanged(w):
            assert isinstance(snap, dict)
            self.snapshots[prefix] = snap  # nothing changed since the last run: its values hold
            return w, snap["values"], [], w.files
        fc = self.files_cache()
        values: list[Any] = [None] * n
        pending: list[tuple[int, _Job]] = []
        hits = 0
        s_isreg, s_islnk, get, value = stat.S_ISREG, stat.S_ISLNK, fc.get, treepin.value
        for i, (rel, st) in enumerate(zip(w.rels, w.stats, strict=True)):
            m = st.st_mode
            if s_isreg(m):
                path = w.path(rel)
                hit = get(path, st)
                if hit is not None:
                    values[i] = value(st, hit)
                    hits += 1
                    continue
                job = _Job(path, "sha256")
                job.st, job.cache, job.nofollow = st, fc, True
                pending.append((i, job))
                todo.append(job)
            elif s_islnk(m):
                values[i] = value(st, treepin.read_link(w, rel))
            else:
                values[i] = value(st)
        for rel, why in w.errors.items():
            i = w.rels.index(rel)
            values[i] = f"{values[i]}; cannot list: {why}"
        self.snapshots[prefix] = {"root": root, "key": key, "values": values, "settled": None}
        return w, values, pending, hits

    def finish(self) -> tuple[list[Item], dict[str, TreePin], Stats]:
        t0 = time.perf_counter()
        hits = 0
        todo: list[_Job] = []
        for job in self.jobs.values():
            try:
                job.st = os.stat(job.path)
            except OSError as exc:
                job.value = _err_value(exc)
                continue
            if not stat.S_ISREG(job.st.st_mode):
                job.value = "not a regular file"
                continue
            cached = self.cache.get(job.path, job.st, job.kind)
            if cached is not None:
                job.value, job.cached = cached, True
                hits += 1
            elif job.fn is None:
                todo.append(job)
        n_files = sum(1 for j in self.jobs.values() if j.st is not None and stat.S_ISREG(j.st.st_mode))
        walked = []
        for prefix, root in self.trees.items():
            w, values, pending, h = self._walk_tree(prefix, root, todo)
            walked.append((prefix, root, w, values, pending))
            hits += h
            n_files += h + len(pending)
        # every hash of this run at once: largest first, so the long ones start early and the small ones fill the gaps
        parallel(lambda j: _run_hash(j, self.cache), todo, workers=self.workers, cost=_cost)
        trees: dict[str, TreePin] = {}
        for prefix, root, w, values, pending in walked:
            for i, job in pending:
                values[i] = treepin.value(job.st, job.value or "unreadable")  # type: ignore[arg-type]
            snap = self.snapshots[prefix]
            if snap.get("settled") is None:
                snap["settled"] = all(j.settled for _, j in pending)
            trees[prefix] = TreePin(root, dict(zip(w.rels, values, strict=True)))
        items: list[Item] = []
        resolved: dict[str, str] = {}
        derived_run = 0
        for id_, label, path, spec in self.specs:
            if isinstance(spec, str):
                v = spec
            elif isinstance(spec, _Job):
                v = spec.value if spec.value is not None else "unreadable"
            else:
                job, guard = spec
                if job.value is None:
                    if guard is not None and self.expected is not None and resolved.get(guard) != self.expected.get(guard):
                        v = "not checked (the file changed)"
                        items.append(Item(id_, label, path, v))
                        resolved[id_] = v
                        continue
                    _run_derived(job, self.cache)
                    derived_run += 1
                v = job.value or "unreadable"
            items.append(Item(id_, label, path, v))
            resolved[id_] = v
        stats = Stats(files=n_files, hashed=len(todo) + derived_run, cache_hits=hits,
                      bytes_hashed=sum(j.nbytes for j in todo), seconds=time.perf_counter() - t0)
        return items, trees, stats

    def save(self) -> None:
        """Write the caches (best effort): the single items' values and each tree's snapshot; the tree files'
        values only when a tree had to be looked at entry by entry."""
        self.cache.save(trees=self.snapshots)
        if self._files_cache is not None:
            self._files_cache.save()


def _read_kv(path: Path) -> dict[str, str] | None:
    """pyvenv.cfg-style `key = value` lines; None if the file cannot be read."""
    try:
        text = path.read_text("utf-8", errors="replace")
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        k, sep, v = line.partition("=")
        if sep:
            out[k.strip().lower()] = v.strip()
    return out


def _metadata_version(dist_info: Path) -> str:
    try:
        with open(dist_info / "METADATA", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break  # end of the headers
                if line.lower().startswith("version:"):
                    return line.split(":", 1)[1].strip()
    except OSError as exc:
        return _err_value(exc)
    return "no Version in METADATA"


def _venv_dir(cfg: Config, b: FtllmBackend) -> Path:
    exe = Path(expand(cfg, b.executable))
    if (exe.parent.parent / "pyvenv.cfg").exists():
        return exe.parent.parent
    return Path(cfg.paths.current) / "venv"


def _site_packages(venv: Path, version: str | None) -> Path:
    if version:
        m = re.match(r"(\d+)\.(\d+)", version)
        if m:
            p = venv / "lib" / f"python{m.group(1)}.{m.group(2)}" / "site-packages"
            if p.is_dir():
                return p
    found = sorted((venv / "lib").glob("python3*/site-packages"))
    return found[0] if found else venv / "lib" / "python3" / "site-packages"


def _is_native_lib(name: str) -> bool:
    return name.endswith(".so") or ".so." in name


def _listdir(d: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(d) as it:
            return sorted(it, key=lambda e: e.name)
    except OSError:
        return []


def _is_file(e: os.DirEntry[str]) -> bool:
    try:
        return e.is_file()  # follows symlinks (Hugging Face snapshots link into blobs/)
    except OSError:
        return False


def _collect_python(c: _Collector, venv: Path) -> Path:
    pcfg = _read_kv(venv / "pyvenv.cfg")
    version = None
    if pcfg is None:
        c.value("python.version", "Python version", venv / "pyvenv.cfg", MISSING)
    else:
        version = pcfg.get("version") or pcfg.get("version_info")
        c.value("python.version", "Python version", venv / "pyvenv.cfg", version or "not in pyvenv.cfg")
    py = venv / "bin" / "python"
    if os.path.lexists(py):
        real = os.path.realpath(py)
        c.value("python.interpreter", "Python interpreter", py, real)
        c.sha256("python.binary", "Python interpreter SHA-256", real)
        if version:
            mm = ".".join(version.split(".")[:2])
            lib = Path(real).parent.parent / "lib" / f"libpython{mm}.so.1.0"
            if lib.exists():
                c.sha256("python.libpython", f"SHA-256 of libpython{mm}.so.1.0", lib)
            _collect_hooks(c, Path(real).parent.parent / "lib" / f"python{mm}")
    else:
        c.value("python.interpreter", "Python interpreter", py, MISSING)
    return _site_packages(venv, version)


HOOK_MODULES = ("sitecustomize", "usercustomize")


def _collect_hooks(c: _Collector, stdlib: Path) -> None:
    """The import hooks Python runs at every start from the base interpreter's own directories, outside any venv
    (sitecustomize/usercustomize modules, packages, .pyc and extension modules in the standard library and
    lib-dynload): which exist [python.hooks] and the SHA-256 of each [python.hook/NAME]. Those in the venv are
    entries of its tree like any other file."""
    found: list[tuple[str, str]] = []
    for d in (stdlib, stdlib / "__pycache__", stdlib / "lib-dynload"):
        for e in _listdir(d):
            if e.name.split(".", 1)[0] in HOOK_MODULES:
                found.append((os.path.relpath(e.path, stdlib), e.path))
    c.value("python.hooks", f"import hooks in {stdlib}", stdlib, ", ".join(n for n, _ in found) or "none")
    for name, path in found:
        if os.path.isdir(path):
            for e in _listdir(Path(path)):
                if _is_file(e):
                    c.sha256(f"python.hook/{name}/{e.name}", f"import hook {name}/{e.name}", e.path)
        else:
            c.sha256(f"python.hook/{name}", f"import hook {name}", path)


def _collect_model(c: _Collector, prefix: str, what: str, model: str, model_config: str | None) -> None:
    p = Path(model)
    if p.is_dir():
        cfgp = Path(model_config) if model_config else p / "config.json"
        c.sha256(f"{prefix}.config", f"{what} config.json", cfgp)
        for e in _listdir(p):
            if not _is_file(e) or Path(e.path) == cfgp:
                continue
            if e.name.endswith(WEIGHT_SUFFIXES):
                c.size(f"{prefix}.weight/{e.name}", f"{what} weight {q(e.name)} size", e.path)
            elif e.name.endswith(META_SUFFIXES):
                with contextlib.suppress(OSError):
                    if e.stat().st_size <= META_MAX_BYTES:
                        c.sha256(f"{prefix}.file/{e.name}", f"{what} file {q(e.name)}", e.path)
        return
    if not p.exists():
        c.value(f"{prefix}.config", f"{what} config.json", p / "config.json", MISSING)
        return
    _collect_gguf(c, prefix, what, p)
    if model_config:
        c.sha256(f"{prefix}.config", f"{what} config", model_config)


def _collect_gguf(c: _Collector, prefix: str, what: str, path: str | os.PathLike[str]) -> None:
    p = Path(path)
    c.size(f"{prefix}.size", f"{what} {q(p.name)} size", p)
    c.head(f"{prefix}.header", f"{what} {q(p.name)} header (1 MiB) SHA-256", p)
    m = _SPLIT_GGUF.match(p.name)
    if m:  # the other parts of a split GGUF (llama.cpp opens them by name)
        for i in range(1, int(m.group("total")) + 1):
            part = p.with_name(f"{m.group('stem')}-{i:05d}-of-{m.group('total')}.gguf")
            if part != p:
                c.size(f"{prefix}.split/{part.name}", f"{what} part {q(part.name)} size", part)


def _arch_value(cc: str, policy: str) -> Callable[[str], str]:
    def fn(path: str) -> str:
        info = read_fatbin(path)
        ok, _why = arch_supported(info, cc, policy)
        want = "sm_" + cc.replace(".", "")
        cubins = ", ".join(info.cubin_archs) or "none"
        return (f"has {want} code (policy {policy})" if ok else f"NO {want} code (policy {policy})") + \
            f"; cubins: {cubins}"
    return fn


def _collect_release(c: _Collector, cfg: Config) -> None:
    """The release `current` points at [release], and every entry under it [release/PATH] (treepin)."""
    cur = Path(cfg.paths.current)
    if not os.path.lexists(cur):
        c.value("release", "release (current)", cur, MISSING)
        return
    real = os.path.realpath(cur)
    c.value("release", "release (current)", cur, real if os.path.isdir(real) else f"{real} ({MISSING})")
    if os.path.isdir(real):
        c.tree("release", real)


def _collect_ftllm(c: _Collector, cfg: Config, b: FtllmBackend) -> None:
    venv = _venv_dir(cfg, b)
    if os.path.isdir(venv) and not c.in_tree(venv):
        c.tree("venv", venv)  # a venv outside the release is pinned entry by entry as well
    sp = _collect_python(c, venv)
    dists = sorted(sp.glob("ftllm-*.dist-info"))
    if not dists:
        c.value("ftllm.version", "ftllm version", sp / "ftllm-*.dist-info", MISSING)
    else:
        versions = [_metadata_version(d) for d in dists]
        c.value("ftllm.version", "ftllm version", dists[0] / "METADATA",
                versions[0] if len(versions) == 1 else "several: " + ", ".join(versions))
    _collect_units(c, cfg, b)
    cur = Path(cfg.paths.current)  # the bundled chat template and NCCL are entries of the release tree
    if b.use_bundle_nccl:
        nccl = cur / BUNDLED_NCCL
        policy = cfg.bundle.nccl.arch_policy if cfg.bundle.nccl else "exact"
        cc = cfg.host.compute_capability
        c.derived("nccl.arch", f"NCCL code for sm_{cc.replace('.', '')}", nccl, f"arch:{cc}:{policy}",
                  _arch_value(cc, policy))
    _collect_model(c, "model", "model", b.model, b.model_config)
    sp_cfg = b.speculative
    if sp_cfg is not None and sp_cfg.algorithm != "none" and sp_cfg.draft_model:
        _collect_model(c, "draft", "draft", sp_cfg.draft_model, None)


def _collect_units(c: _Collector, cfg: Config, b: Backend) -> None:
    unit_dir = Path(cfg.paths.unit_dir)
    c.sha256("unit", f"unit file {b.unit}", unit_dir / b.unit)
    # drop-ins change what starts as much as the unit does (deploytool never writes them: a local one is
    # pinned with a reason like any deliberate change), wherever systemd reads them for this unit: its own
    # NAME.d, the dash-prefix ones (`ftllm-.service.d` for ftllm-dflash.service) and the type-wide `service.d`
    for d in strictmodes.dropin_dirs(b.unit):
        key = "unit.d" if d == f"{b.unit}.d" else f"dropin/{d}"
        for e in _listdir(unit_dir / d):
            if e.name.endswith(".conf") and _is_file(e):
                c.sha256(f"{key}/{e.name}", f"unit drop-in {d}/{e.name}", e.path)
    if c.loaded_env:  # the unit's credential copy: exactly what the launcher hands the server in this start
        c.sha256("env", f"env file {b.name}.env (as systemd loaded it for this start)", c.loaded_env)
    else:
        c.sha256("env", f"env file {b.name}.env", Path(cfg.paths.env_dir) / f"{b.name}.env")


def _build_value(path: str) -> str:
    info = read_llama_version(path, timeout=20)
    if info.build_number is None:
        first = info.text.splitlines()[0] if info.text else "no output"
        return f"unknown ({first[:80]})"
    parts = [f"version {info.version}"] if info.version else []
    parts.append(f"build {info.build_number}")
    if info.commit:
        parts.append(f"commit {info.commit}")
    return ", ".join(parts)


def _collect_llamacpp(c: _Collector, cfg: Config, b: LlamacppBackend) -> None:
    binary = Path(expand(cfg, b.binary))
    name = binary.name
    c.sha256("binary.sha256", f"SHA-256 of {name}", binary)
    c.value("binary.mode", f"mode of {name}", binary, _mode_value(binary))
    kind = "build" if not b.build else f"build:{b.build}"

    def build(path: str) -> str:
        v = _build_value(path)
        if b.build and not re.search(rf"\bbuild {re.escape(b.build.lstrip('b'))}\b", v):
            v += f"; config says {b.build}"
        return v

    c.derived("binary.build", f"{name} build", binary, kind, build, guard="binary.sha256")
    if binary.exists():
        libdir = Path(os.path.realpath(binary)).parent
        for e in _listdir(libdir):
            if _is_native_lib(e.name) and _is_file(e):
                c.sha256(f"binary.lib/{e.name}", f"SHA-256 of {e.name}", e.path)
    _collect_units(c, cfg, b)
    p = Path(b.model)
    if p.is_dir():
        _collect_model(c, "model", "model", b.model, b.model_config)
    else:
        _collect_gguf(c, "model", "model", p)
        if b.model_config:
            c.sha256("model.config", "model config", b.model_config)
    if b.mmproj:
        _collect_gguf(c, "mmproj", "mmproj", b.mmproj)


def _mode_value(path: str | os.PathLike[str]) -> str:
    """The mode, and the owner uid:gid when it is not root's (as treepin.value writes them)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return _err_value(exc)
    own = "" if st.st_uid == 0 and st.st_gid == 0 else f" {st.st_uid}:{st.st_gid}"
    return f"{stat.S_IMODE(st.st_mode):04o}{own}"


# --------------------------------------------------------------------------------------------------------------
# deploytool itself: the deploytool the units' ExecStartPre runs is pinned like the backend it guards, so a
# changed verifier (a stray `pip install -U`, an edited module, an added .pth file or .pyc) is drift, exit 7:
#   tool.path     the real path of paths.deploytool (normally {current}/tool/bin/deploytool, a link into the
#                 release's own tool venv)
#   tool.python   the real path of the tool venv's interpreter
#   tool/PATH     every entry of the tool venv by type, mode and SHA-256 (treepin), when the venv lies outside the
#                 release; inside it (the normal case) the release's own entries (release/tool/venv/...) are these
#   tool.script   SHA-256 of the console script, when it is not in a venv (nor in the release)


def tool_path(cfg: Config) -> Path:
    return Path(expand(cfg, cfg.paths.deploytool))


def tool_venv(script: str | os.PathLike[str]) -> Path | None:
    """The venv a console script lives in (.../venv/bin/deploytool -> .../venv), or None."""
    real = Path(os.path.realpath(script))
    venv = real.parent.parent
    if real.parent.name == "bin" and (venv / "pyvenv.cfg").is_file():
        return venv
    return None


def _collect_tool(c: _Collector, cfg: Config) -> None:
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


def what_runs(cfg: Config, b: Backend) -> tuple[Config, Backend]:
    """The config and backend whose files the units load: the installed release's config.json (the box's own keys
    from `cfg`: packedconfig.installed_config) when there is a release with this backend, else `cfg` itself. The
    box's config may already be edited for the next bundle (another model file): that is no drift, and the file
    the running release loads is what its pins are of and checked against."""
    rcfg = packedconfig.installed_config(cfg)
    if rcfg is None or b.name not in rcfg.backends:
        return cfg, b
    return rcfg, rcfg.backends[b.name]


def _resolve(cfg: Config, backend: Backend | str) -> Backend:
    return cfg.backend(backend) if isinstance(backend, str) else backend


def collect(cfg: Config, backend: Backend | str, *, use_cache: bool = True, expected: dict[str, str] | None = None,
            workers: int | None = None, racy_margin_s: float = CACHE_RACY_MARGIN_S,
            cache_file: Path | None | bool = True) -> list[Item]:
    """The current fingerprints of a backend (see the module doc for the list), tree entries included."""
    items, trees, _stats = _collect(cfg, _resolve(cfg, backend), use_cache=use_cache, expected=expected,
                                    workers=workers, racy_margin_s=racy_margin_s, cache_file=cache_file)
    return _expand(items, trees)


def _collect(cfg: Config, b: Backend, *, use_cache: bool, expected: dict[str, str] | None, workers: int | None,
             racy_margin_s: float, cache_file: Path | None | bool,
             fresh: HashCache | None = None, loaded_env: str | None = None
             ) -> tuple[list[Item], dict[str, TreePin], Stats]:
    """`fresh`: with use_cache=False, an in-memory cache whose values were all computed in this process (pins of
    several backends in one install share it, so the release is read once)."""
    cpath = cache_path(cfg, b.name) if cache_file is True else (cache_file or None)
    cpath = cpath if isinstance(cpath, Path) else None
    cache = HashCache(cpath, read=use_cache, racy_margin_s=racy_margin_s)
    if fresh is not None and not use_cache:
        cache.entries = fresh.entries  # shared (HashCache is thread-safe per instance; pins run one at a time)
    fpath = cpath.with_name(cpath.stem + "-files.json") if cpath is not None else None

    def files_cache() -> HashCache:
        fc = HashCache(fpath, read=use_cache, racy_margin_s=racy_margin_s)
        if fresh is not None and not use_cache:
            fc.entries = fresh.entries
        return fc

    c = _Collector(cache, expected, workers, files_cache=files_cache, use_cache=use_cache)
    c.loaded_env = loaded_env
    cfg, b = what_runs(cfg, b)
    _collect_release(c, cfg)
    if isinstance(b, FtllmBackend):
        _collect_ftllm(c, cfg, b)
    else:
        _collect_llamacpp(c, cfg, b)
    _collect_tool(c, cfg)  # the deploytool that runs this check is pinned as well
    items, trees, stats = c.finish()
    seen: set[str] = set()
    for it in items:
        assert it.id not in seen, f"duplicate fingerprint id {it.id}"
        seen.add(it.id)
    c.save()
    return items, trees, stats


# --------------------------------------------------------------------------------------------------------------
# pins


def pins_path(cfg: Config, backend: str) -> Path:
    return Path(cfg.paths.state_dir) / "pins" / f"{backend}.json"


def current_release(cfg: Config) -> str | None:
    """The release id `current` points at (releases/<id>), or None."""
    cur = Path(cfg.paths.current)
    if not os.path.lexists(cur):
        return None
    real = Path(os.path.realpath(cur))
    if real.parent == Path(os.path.realpath(cfg.paths.releases_dir)):
        return real.name
    return None


def _who() -> dict[str, Any]:
    uid = os.getuid()
    user = os.environ.get("SUDO_USER") or os.environ.get("USER") or os.environ.get("LOGNAME")
    if not user:
        try:
            user = pwd.getpwuid(uid).pw_name
        except (KeyError, ImportError):
            user = str(uid)
    out: dict[str, Any] = {"user": user, "uid": uid}
    if os.environ.get("SUDO_USER"):
        out["sudo"] = True
    return out


def load_pins(cfg: Config, backend: Backend | str) -> PinSet:
    """The pinned fingerprints of a backend; StateError if there are none or the file is damaged."""
    b = _resolve(cfg, backend)
    path = pins_path(cfg, b.name)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise StateError(f"{b.name} is not pinned: {q(path)} does not exist, so there is nothing to verify against",
                         hint=f"run `deploytool install`, or pin what is installed now with "
                              f"`deploytool pin {b.name} --reason TEXT`") from None
    except OSError as exc:
        raise os_error(exc, f"cannot read the pins {path}") from None
    bad = StateError(f"the pins file {q(path)} is damaged (not a format-{PINS_FORMAT} pins file)",
                     hint=f"re-pin deliberately with `deploytool pin {b.name} --reason TEXT` "
                          f"(or reinstall the release)")
    try:
        d = json.loads(raw)
    except (ValueError, RecursionError):
        raise bad from None
    if not isinstance(d, dict) or d.get("format") != PINS_FORMAT or not isinstance(d.get("items"), list):
        raise bad
    try:
        items = tuple(Item(str(i["id"]), str(i["label"]), None if i.get("path") is None else str(i["path"]),
                           str(i["value"])) for i in d["items"])
        trees = {}
        for prefix, t in (d.get("trees") or {}).items():
            entries = t["entries"]
            if (not isinstance(t["root"], str) or not isinstance(entries, dict)
                    or not set(map(type, entries.values())) <= {str}):
                raise bad
            trees[str(prefix)] = TreePin(t["root"], entries)
        return PinSet(backend=str(d["backend"]), kind=str(d["kind"]), pinned_at=str(d["pinned_at"]),
                      release=d.get("release"), reason=str(d["reason"]), by=dict(d.get("by") or {}),
                      items=items, path=str(path), trees=trees)
    except (KeyError, TypeError, ValueError, AttributeError):
        raise bad from None


#: How many changed items a pin's history event names (it counts them all in `changed_total` past that).
HISTORY_CHANGED = 20


def pin_reason(reason: str | None, backend: str) -> str:
    """The reason a pin records, stripped; InputError when there is none (a dry run of `pin` checks it too)."""
    reason = (reason or "").strip()
    if not reason:
        raise InputError("a pin needs a reason", hint=f"deploytool pin {backend} --reason 'why this change is wanted'")
    return reason


def pin(cfg: Config, backend: Backend | str, reason: str, *, release: str | None = None, store=None,
        workers: int | None = None, fresh: HashCache | None = None) -> PinSet:
    """Fingerprint the backend afresh (no cache read), write the pins atomically, record who/why/when. A tree
    entry that is not root's alone (deploy_tool.strictmodes) is refused, exit 23, nothing written.

    `fresh`: an in-memory HashCache shared by the pins of several backends in one run (install pins every
    backend: the release they share is read once); only values computed in this process are in it."""
    b = _resolve(cfg, backend)
    reason = pin_reason(reason, b.name)
    previous: PinSet | None = None
    with contextlib.suppress(DeployError):
        previous = load_pins(cfg, b)
    items, trees, _stats = _collect(cfg, b, use_cache=False, expected=None, workers=workers,
                                    racy_margin_s=CACHE_RACY_MARGIN_S, cache_file=True, fresh=fresh)

    unsafe = [u for t in trees.values() for u in strictmodes.tree_problems(t.entries, t.root)]
    if unsafe:  # verify holds the tree to its pins only: what is pinned must be root's alone
        raise strictmodes.refusal(unsafe, f"cannot pin {b.name}")
    ps = PinSet(backend=b.name, kind=b.kind, pinned_at=iso_utc(), release=release or current_release(cfg),
                reason=reason, by=_who(), items=tuple(items), path=str(pins_path(cfg, b.name)), trees=trees)
    path = pins_path(cfg, b.name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    except OSError as exc:
        raise os_error(exc, f"cannot create {path.parent}") from None
    atomic_write(path, (json.dumps(ps.to_json(), sort_keys=True, separators=(",", ":")) + "\n").encode(), 0o644)
    changed = []
    if previous is not None:
        changed = [{"id": r.item.id, "from": short(r.expected), "to": short(r.actual)}
                   for r in diff(previous.items, items) + tree_diff(previous.trees, trees)]
    store = store if store is not None else Store(cfg.paths.state_dir)
    # the first HISTORY_CHANGED and how many in all: a new release changes every file of it, and history.jsonl is
    # read whole by status and the metrics for months of installs
    extra = {"changed_total": len(changed)} if len(changed) > HISTORY_CHANGED else {}
    store.record("pin", backend=b.name, reason=reason, by=ps.by.get("user"), uid=ps.by.get("uid"),
                 release=ps.release, items=ps.count(),
                 changed=changed[:HISTORY_CHANGED] if previous is not None else None, first=previous is None,
                 **extra)
    return ps


# --------------------------------------------------------------------------------------------------------------
# verify


def diff(pinned: Iterable[Item], current: Iterable[Item]) -> list[Drift]:
    """Every item whose value differs, plus items only one side has (pinned order first)."""
    cur = {i.id: i for i in current}
    out: list[Drift] = []
    seen = set()
    for p in pinned:
        seen.add(p.id)
        c = cur.get(p.id)
        if c is None:
            gone = p.path is not None and not os.path.lexists(p.path)
            out.append(Drift(p, p.value, MISSING if gone else "no longer fingerprinted"))
        elif c.value != p.value:
            out.append(Drift(c, p.value, c.value, p.path if p.path not in (None, c.path) else None))
    for i in cur.values():
        if i.id not in seen:
            out.append(Drift(i, "not pinned", i.value))
    return out


def tree_diff(pinned: dict[str, TreePin], current: dict[str, TreePin]) -> list[Drift]:
    """Every tree entry added ("absent" expected), removed ("missing"), or changed, sorted by path per tree."""
    out: list[Drift] = []
    for prefix in [*pinned, *(k for k in current if k not in pinned)]:
        p, c = pinned.get(prefix), current.get(prefix)
        if p is None or c is None:  # a whole tree pinned and gone, or there and never pinned: one row
            t = c if c is not None else p
            assert t is not None
            out.append(Drift(_tree_item(prefix, t.root, treepin.ROOT, t.entries.get(treepin.ROOT, MISSING)),
                             f"{len(p.entries)} entries" if p is not None else "not pinned",
                             f"{len(c.entries)} entries" if c is not None else MISSING))
            continue
        pe, ce = p.entries, c.entries
        if pe == ce:
            continue
        root = c.root
        for rel in sorted(pe.keys() | ce.keys()):
            a, v = pe.get(rel), ce.get(rel)
            if a != v:
                item = _tree_item(prefix, root, rel, v if v is not None else a)  # type: ignore[arg-type]
                out.append(Drift(item, a if a is not None else ABSENT, v if v is not None else MISSING))
    return out


def verify(cfg: Config, backend: Backend | str, *, use_cache: bool = True, workers: int | None = None,
           racy_margin_s: float = CACHE_RACY_MARGIN_S, loaded_env: str | None = None) -> VerifyReport:
    """Compare the current fingerprints with the pins (StateError if there are no pins). `loaded_env`: the env
    file as systemd copied it for the start being checked (the unit's credential), checked in place of the file."""
    b = _resolve(cfg, backend)
    pins = load_pins(cfg, b)
    items, trees, stats = _collect(cfg, b, use_cache=use_cache, expected=pins.values(), workers=workers,
                                   racy_margin_s=racy_margin_s, cache_file=True, loaded_env=loaded_env)
    rows = diff(pins.items, items) + tree_diff(pins.trees, trees)
    return VerifyReport(ok=not rows, rows=rows, backend=b.name, pins=pins, items=tuple(items), stats=stats,
                        trees=trees)


#: how a report names the front (its unit runs `deploytool verify-front`)
FRONT = "the front"


def _entry_value(path: str) -> str:
    """A tree entry's value (treepin.value) of the one path, as the release's pin holds it; MISSING when gone."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return MISSING
    except OSError as exc:
        return f"unreadable ({exc.strerror or type(exc).__name__})"
    if stat.S_ISLNK(st.st_mode):
        try:
            return treepin.value(st, os.readlink(path))
        except OSError as exc:
            return treepin.value(st, f"unreadable ({exc.strerror or type(exc).__name__})")
    if not stat.S_ISREG(st.st_mode):
        return treepin.value(st)
    try:
        fd, fst = open_file(path, follow_symlinks=False)
    except (OSError, NotAFile) as exc:
        return treepin.value(st, f"unreadable ({getattr(exc, 'strerror', None) or type(exc).__name__})")
    try:
        digest, _n = sha256_fd(fd, regular=True)
    finally:
        os.close(fd)
    return treepin.value(fst, digest)


def front_pins(cfg: Config) -> PinSet:
    """The pins the front is checked against: the active backend's, else the first pinned backend's (a box whose
    state names none); StateError when no backend is pinned."""
    active = Store(cfg.paths.state_dir).load().active_backend
    names = ([active] if active and active in cfg.backends else []) + [n for n in cfg.backends if n != active]
    for name in names:
        try:
            return load_pins(cfg, name)
        except StateError:
            continue
    raise StateError("no backend is pinned, so there is nothing to check the front's program against",
                     hint="run `deploytool install` (it pins every backend)")


def verify_front(cfg: Config) -> VerifyReport:
    """The front's program against the pinned release, before the front starts (its unit's ExecStartPre): `current`
    still points at the release the pins hold, and that release's launch/front.py (what the front's ExecStart=
    runs) is the entry they pinned: type, mode, owner, SHA-256. Nothing else is read: the front holds the clients'
    requests, so a drift elsewhere in the release (which the backend's own check refuses) does not close the port."""
    t0 = time.monotonic()
    pins = front_pins(cfg)
    pinned = {i.id: i for i in pins.items}
    tree = pins.trees.get("release")
    cur = Path(cfg.paths.current)
    real = os.path.realpath(cur)
    release = Item("release", "release (current)", str(cur),
                   (real if os.path.isdir(real) else f"{real} ({MISSING})") if os.path.lexists(cur) else MISSING)
    program = f"{real}/{BUNDLED_FRONT}"
    rel_id = f"release/{BUNDLED_FRONT}"
    front = Item(rel_id, rel_id, program, _entry_value(program))
    rows: list[Drift] = []
    want_release = pinned["release"].value if "release" in pinned else f"(not pinned in {pins.backend}'s pins)"
    if release.value != want_release:
        rows.append(Drift(release, want_release, release.value))
    want_front = (tree.entries.get(BUNDLED_FRONT) if tree is not None else None) or \
        f"(not pinned in {pins.backend}'s pins)"
    if front.value != want_front:
        rows.append(Drift(front, want_front, front.value))
    stats = Stats(files=1, seconds=time.monotonic() - t0)
    return VerifyReport(ok=not rows, rows=rows, backend=FRONT, pins=pins, items=(release, front), stats=stats)


#: The credential (LoadCredential=) through which a unit hands its env file to the server's launcher (render.py)
ENV_CREDENTIAL = "environment"


def loaded_env_file(environ: dict[str, str] | os._Environ[str] | None = None) -> str | None:
    """In a unit's ExecStartPre: the env file as systemd copied it for this start ($CREDENTIALS_DIRECTORY/
    environment, what the launcher will hand the server); None elsewhere."""
    env = os.environ if environ is None else environ
    d = env.get("CREDENTIALS_DIRECTORY")
    if not d:
        return None
    p = os.path.join(d, ENV_CREDENTIAL)
    return p if os.path.isfile(p) else None


def check_unit_environment(environ: dict[str, str] | os._Environ[str] | None = None) -> None:
    """Under systemd (INVOCATION_ID set), refuse a root step whose own environment carries a variable of the
    dynamic loader (LD_*) or of Python (PYTHON*): the units name no EnvironmentFile= and unset these
    (UnsetEnvironment=), so one that arrives came from a drop-in or the manager's environment, and is drift."""
    env = os.environ if environ is None else environ
    if not env.get("INVOCATION_ID"):
        return
    bad = sorted(k for k in env if k.startswith(("LD_", "PYTHON")))
    if bad:
        raise DriftError(f"the unit's root step runs with {', '.join(bad)} in its environment: an Environment= of a "
                         "drop-in, or the manager's environment (systemctl set-environment), sets it, and it can "
                         "run code as root before any check",
                         hint="remove it (systemctl show-environment; grep -r Environment /etc/systemd/system/*.d); "
                              "the server's environment belongs in its env file, which only the server sees")


def drift_error(r: VerifyReport) -> DriftError:
    names = ", ".join(safe(d.item.label) for d in r.rows[:6]) + (", ..." if len(r.rows) > 6 else "")
    return DriftError(f"{r.backend}: {len(r.rows)} fingerprint(s) differ from the pins: {names}",
                      hint="restore what changed; if the change is deliberate, re-pin it with "
                           f"`deploytool pin {r.backend} --reason TEXT`",
                      details=[d.to_json() for d in r.rows])


def front_drift_error(r: VerifyReport) -> DriftError:
    """The front's refusal: what to restore, or which backend's pins to re-pin for a change made on purpose."""
    names = ", ".join(safe(d.item.label) for d in r.rows)
    by = r.pins.backend if r.pins else "BACKEND"
    return DriftError(f"the front's program differs from the pinned release: {names}",
                      hint="restore it (reinstall the release); if the change is deliberate, re-pin the release with "
                           f"`deploytool pin {by} --reason TEXT`",
                      details=[d.to_json() for d in r.rows])


# --------------------------------------------------------------------------------------------------------------
# text


def short(value: str, width: int = 44) -> str:
    """A value for a table: hashes cut to 12 hex digits, long text to `width` (keeping the end)."""
    v = safe(_HEX64.sub(lambda m: m.group(0)[:SHORT_HASH], value))
    return v if len(v) <= width else "..." + v[-(width - 3):]


def format_report(r: VerifyReport) -> str:
    """Plain text, one line per item, readable in `journalctl -u` and `systemctl status` (no colors)."""
    p = r.pins
    since = "not pinned"
    if p is not None:
        since = f"pinned {p.pinned_at}" + (f", release {p.release}" if p.release else "")
    st = r.stats
    timing = f"{st.seconds:.2f} s, {st.cache_hits} of {st.files} files from cache"
    if r.ok:
        return f"{r.backend}: all {r.checked()} fingerprints match ({since}) [{timing}]"
    head = f"{r.backend}: DRIFT in {len(r.rows)} of {r.checked()} fingerprints ({since}) [{timing}]"
    rows = [(safe(d.item.label), short(d.expected), short(d.actual)) for d in r.rows]
    w0 = max(len("ITEM"), *(len(a) for a, _, _ in rows))
    w1 = max(len("EXPECTED"), *(len(b) for _, b, _ in rows))
    lines = [head, f"  {'ITEM':<{w0}}  {'EXPECTED':<{w1}}  ACTUAL"]
    lines += [f"  {a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows]
    moved = r.config_moved()
    if moved:
        lines.append(f"  {safe(moved)}")
    return "\n".join(lines)
