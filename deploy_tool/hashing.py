"""The one SHA-256 engine: streamed file hashing, the stat-keyed cache, the parallel collector.

Everything that hashes files (MANIFEST, bundle write and verify, archive extraction, fingerprints and pins,
runtime truth) goes through this module:

    sha256_file(path) -> hex                  a file, streamed in 1 MiB reads (memory flat in the file size)
    sha256_fd(fd, limit=None) -> (hex, n)     an open file from its current offset (`limit`: first n bytes)
    sha256_stream(fileobj, sink=None) -> (hex, n)   a binary stream; `sink(chunk)` sees every chunk (copy + hash)
    sha256_chunks(chunks, sink=None) -> (hex, n)    an iterable of byte chunks, likewise
    sha256_bytes(data) -> hex
    HashCache(path=None)                      values computed from files keyed by path and
                                              (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns);
                                              `cache.sha256(path)` hashes through it; optionally persisted
    parallel(fn, items, cost=...) -> [fn(item)]   the parallel collector (threads, largest first)
    hash_many(paths, cache=None) -> {path: hex}   sha256_file over many files with it

Why a stat-keyed value can be trusted (the cache's rules):
  * st_ctime is set by the kernel to the current time on every change to the inode: any write, truncate,
    chmod/chown, link/unlink, or rename over the path (a new inode: st_ino changes as well). No system call
    lets a user set it; `touch -d` and utimensat() set atime/mtime only and bump ctime themselves. So a file
    edited and then given back its old size and mtime still gets a new ctime and misses the cache.
  * Racy entries: timestamps come from a coarse clock (one tick, a few ms; whole seconds on some file
    systems), so a change in the same tick as the hash could keep the same ctime. A value is trusted only if
    the file's ctime is older than the moment the value was computed by a margin larger than the timestamp
    granularity (the rule git uses for its index): RACY_MARGIN_S (0.1 s, file systems with sub-second
    timestamps: ext4, xfs, btrfs, tmpfs), or COARSE_MARGIN_S (2 s) when the ctime is a whole second (ext3,
    FAT). Younger files are hashed every time until they age. A value is stored only if the file's stat did
    not change while it was hashed.
  * A persisted cache file is used only when it is a regular file owned by root or by the user running the
    check and not group- or world-writable; a file that is missing, unreadable, corrupt or of another format
    is ignored (everything is hashed). Writing it is best effort: failures cost speed, never correctness.
Limits: changes that bypass the file system (writing the block device, debugfs can set ctime), file systems
that do not maintain ctime (some FUSE and network file systems), root setting the clock back to a file's
exact ctime tick before changing it (root can rewrite the pins as well), a writable shared mmap (mtime and
ctime move at the first write after writeback, not at every store).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from deploy_tool.fsutil import atomic_write

CHUNK = 1 << 20
RACY_MARGIN_S = 0.1  # > one coarse-clock tick (1-10 ms) on file systems with sub-second timestamps
COARSE_MARGIN_S = 2.0  # whole-second ctimes: covers 1 s (ext3) and 2 s (FAT) timestamp granularity
CACHE_FORMAT = 1
CACHE_MAX_BYTES = 256 << 20

T = TypeVar("T")
K = TypeVar("K")
R = TypeVar("R")


class NotAFile(OSError):
    """The path is not a regular file (a directory, fifo, device, socket; a symlink with follow_symlinks=False)."""


# ---------------------------------------------------------------------------------------------- streaming

_tls = threading.local()


def read_buffer() -> tuple[bytearray, memoryview]:
    """One reusable 1 MiB read buffer per thread (allocating it per file costs more than hashing small files)."""
    pair = getattr(_tls, "pair", None)
    if pair is None:
        buf = bytearray(CHUNK)
        pair = _tls.pair = (buf, memoryview(buf))
    return pair


def _new() -> Any:
    return hashlib.sha256()


def sha256_bytes(data: bytes | bytearray | memoryview) -> str:
    h = _new()
    h.update(data)
    return str(h.hexdigest())


def sha256_fd(fd: int, *, limit: int | None = None, on_bytes: Callable[[int], None] | None = None,
              regular: bool = False) -> tuple[str, int]:
    """(hex digest, bytes read) of an open file from its current offset to the end (or its first `limit` bytes);
    `regular`: the fd is a regular file (as open_file checks), so a short read is its end."""
    h = _new()
    buf, view = read_buffer()
    total = 0
    while limit is None or total < limit:
        want = CHUNK if limit is None else min(CHUNK, limit - total)
        n = os.readv(fd, [view[:want]])
        if not n:
            break
        h.update(view[:n])
        total += n
        if on_bytes is not None:
            on_bytes(n)
        if n < want and regular:
            break  # a short read of a regular file is its end: saves a read per small file
    return h.hexdigest(), total


def open_file(path: str | os.PathLike[str], *, follow_symlinks: bool = True) -> tuple[int, os.stat_result]:
    """(fd, fstat) of a regular file opened for reading; NotAFile for anything else (the fd is closed then).

    O_NONBLOCK: a fifo swapped in for a file must not hang the open (fstat then refuses it)."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if not follow_symlinks and os.path.islink(path):
            raise NotAFile(exc.errno, "is a symlink", str(path)) from None
        raise
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotAFile(0, "not a regular file", str(path))
    return fd, st


def sha256_file(path: str | os.PathLike[str], *, follow_symlinks: bool = True, limit: int | None = None,
                on_bytes: Callable[[int], None] | None = None) -> str:
    """SHA-256 hex digest of a regular file (or of its first `limit` bytes). Raises OSError (NotAFile)."""
    fd, _st = open_file(path, follow_symlinks=follow_symlinks)
    try:
        return sha256_fd(fd, limit=limit, on_bytes=on_bytes, regular=True)[0]
    finally:
        os.close(fd)


def sha256_stream(src: BinaryIO, *, sink: Callable[[memoryview], object] | None = None,
                  limit: int | None = None) -> tuple[str, int]:
    """(hex digest, size) of what a binary stream yields, 1 MiB at a time; `sink(chunk)` gets each chunk first
    (e.g. a write: copy and hash in one pass). The chunk is a view of a reused buffer: consume it at once."""
    h = _new()
    buf, view = read_buffer()
    total = 0
    readinto = getattr(src, "readinto", None)
    while limit is None or total < limit:
        want = CHUNK if limit is None else min(CHUNK, limit - total)
        if readinto is not None:
            n = readinto(view[:want])
            chunk = view[:n] if n else None
        else:
            data = src.read(want)
            n = len(data)
            chunk = memoryview(data) if n else None
        if chunk is None:
            break
        if sink is not None:
            sink(chunk)
        h.update(chunk)
        total += n
    return h.hexdigest(), total


def sha256_chunks(chunks: Iterable[bytes | bytearray | memoryview], *,
                  sink: Callable[[Any], object] | None = None) -> tuple[str, int]:
    """(hex digest, size) of a sequence of byte chunks; `sink(chunk)` gets each chunk first."""
    h = _new()
    total = 0
    for b in chunks:
        if sink is not None:
            sink(b)
        h.update(b)
        total += len(b)
    return h.hexdigest(), total


def write_all(fd: int) -> Callable[[bytes | bytearray | memoryview], None]:
    """A sink for sha256_stream/sha256_chunks that writes every chunk fully to `fd`."""
    def sink(b: bytes | bytearray | memoryview) -> None:
        view = memoryview(b)
        while view:
            view = view[os.write(fd, view):]
    return sink


# ---------------------------------------------------------------------------------------------- the cache


def stat_key(st: os.stat_result) -> list[int]:
    """What a cached value is keyed on besides the path: (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def settled(st: os.stat_result, computed_at_ns: int, margin_ns: int, coarse_margin_ns: int) -> bool:
    """Whether a value computed at `computed_at_ns` from a file with this stat can be trusted (not racy)."""
    margin = coarse_margin_ns if st.st_ctime_ns % 1_000_000_000 == 0 else margin_ns
    return st.st_ctime_ns + margin <= computed_at_ns


class HashCache:
    """Values computed from files (SHA-256 and others, by `kind`), keyed by path and stat_key().

    In memory by default; with `path`, loaded from (when `read`) and saved to that JSON file, which keeps the
    entries used in the run. `get_same_file` answers for the same file under another name (a library a process
    maps, opened through /proc/PID/map_files). Thread-safe; see the module doc for when a value is trusted.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, read: bool = True,
                 racy_margin_s: float = RACY_MARGIN_S) -> None:
        self.path = Path(path) if path is not None else None
        self.margin_ns = int(racy_margin_s * 1e9)
        self.coarse_margin_ns = max(self.margin_ns, int(COARSE_MARGIN_S * 1e9))
        self._sections: dict[str, Any] = {}  # other top-level parts of the file (see section())
        self.entries: dict[str, Any] = self._load() if (self.path is not None and read) else {}
        self.used: set[str] = set()
        self.dirty = False
        self.computed = 0  # files actually read by sha256() (tests assert on it)
        self._lock = threading.Lock()
        self._by_key: dict[tuple[int, ...], str] | None = None

    def _load(self) -> dict[str, Any]:
        d = read_trusted_json(self.path) if self.path is not None else None
        if not isinstance(d, dict) or d.get("format") != CACHE_FORMAT or not isinstance(d.get("entries"), dict):
            return {}
        self._sections = {k: v for k, v in d.items() if k not in ("format", "entries")}
        return d["entries"]

    def section(self, name: str) -> Any:
        """Another top-level part of the loaded cache file (None if absent); for callers with their own layout."""
        return self._sections.get(name)

    def get(self, path: str, st: os.stat_result, kind: str = "sha256") -> str | None:
        e = self.entries.get(path)
        if not isinstance(e, dict) or e.get("key") != stat_key(st):
            return None
        vals = e.get("values")
        v = vals.get(kind) if isinstance(vals, dict) else None
        if (not isinstance(v, list) or len(v) != 2 or not isinstance(v[0], str) or not isinstance(v[1], int)
                or isinstance(v[1], bool)):
            return None
        if not settled(st, v[1], self.margin_ns, self.coarse_margin_ns):
            return None  # racy: the file changed too shortly before the value was computed
        with self._lock:
            self.used.add(path)
        return v[0]

    def get_same_file(self, st: os.stat_result, kind: str = "sha256") -> str | None:
        """The value cached for any path whose stat_key() is `st`'s (same trust as get())."""
        with self._lock:
            if self._by_key is None:
                self._by_key = {}
                for p, e in self.entries.items():
                    if isinstance(e, dict) and isinstance(e.get("key"), list):
                        self._by_key.setdefault(tuple(e["key"]), p)
            same = self._by_key.get(tuple(stat_key(st)))
        return self.get(same, st, kind) if same is not None else None

    def put(self, path: str, st: os.stat_result, kind: str, value: str, computed_at_ns: int) -> None:
        key = stat_key(st)
        with self._lock:
            e = self.entries.get(path)
            if not isinstance(e, dict) or e.get("key") != key or not isinstance(e.get("values"), dict):
                e = self.entries[path] = {"key": key, "values": {}}
            e["values"][kind] = [value, computed_at_ns]
            self.used.add(path)
            self.dirty = True
            if self._by_key is not None:
                self._by_key.setdefault(tuple(key), path)

    def sha256(self, path: str | os.PathLike[str]) -> str:
        """SHA-256 of a regular file (symlinks followed) through the cache. Raises OSError (NotAFile)."""
        p = str(path)
        st = os.stat(p)
        if stat.S_ISREG(st.st_mode):
            hit = self.get(p, st) or self.get_same_file(st)
            if hit is not None:
                return hit
        t0 = time.time_ns()
        fd, st1 = open_file(p)
        try:
            digest, _n = sha256_fd(fd, regular=True)
            st2 = os.fstat(fd)
        finally:
            os.close(fd)
        with self._lock:
            self.computed += 1
        if stat_key(st1) == stat_key(st2):
            self.put(p, st1, "sha256", digest, t0)
        return digest

    __call__ = sha256

    def save(self, **sections: Any) -> None:
        """Write the entries used in this run and the loaded sections updated by `sections` (best effort; nothing
        is written when nothing changed)."""
        if self.path is None:
            return
        merged = {**self._sections, **sections}
        if not self.dirty and merged == self._sections and self.used == set(self.entries):
            return
        doc: dict[str, Any] = {**merged, "format": CACHE_FORMAT,
                               "entries": {p: self.entries[p] for p in self.used}}
        data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        with contextlib.suppress(Exception):
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
            atomic_write(self.path, data, 0o644)


def read_trusted_json(path: str | os.PathLike[str]) -> Any:
    """The JSON document in `path` if it is a regular file owned by root or by this user, not group- or
    world-writable and at most CACHE_MAX_BYTES; else None (never raises)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022
                or st.st_size > CACHE_MAX_BYTES):
            return None
        with open(fd, "rb", closefd=False) as f:
            return json.loads(f.read())
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------- in parallel


def default_workers() -> int:
    return max(1, os.cpu_count() or 1)


def parallel(fn: Callable[[T], R], items: Sequence[T], *, workers: int | None = None,
             cost: Callable[[T], int] | None = None) -> list[R]:
    """[fn(item) for item in items], run in threads (hashlib and file reads release the GIL), the costliest
    first when `cost` is given (long files start early, small ones fill the gaps). The first exception raised
    by fn is raised here."""
    n = len(items)
    if n == 0:
        return []
    order = sorted(range(n), key=lambda i: -cost(items[i])) if cost is not None else list(range(n))
    w = max(1, min(workers or default_workers(), n))
    if w == 1:
        out: dict[int, R] = {i: fn(items[i]) for i in order}
        return [out[i] for i in range(n)]

    with ThreadPoolExecutor(max_workers=w, thread_name_prefix="hash") as pool:
        futs = {i: pool.submit(fn, items[i]) for i in order}
        return [futs[i].result() for i in range(n)]


def hash_many(paths: Iterable[K], *, workers: int | None = None, cache: HashCache | None = None,
              follow_symlinks: bool = True, on_bytes: Callable[[int], None] | None = None) -> dict[K, str]:
    """{path: SHA-256} of many files in parallel, keys as given (through `cache` when given). Raises the first
    OSError (NotAFile for a path that is not a regular file)."""
    items = list(paths)

    def size(p: K) -> int:
        try:
            return os.stat(p, follow_symlinks=follow_symlinks).st_size  # type: ignore[arg-type]
        except OSError:
            return 0  # the hash reports the real error

    def one(p: K) -> str:
        if cache is not None and follow_symlinks:
            return cache.sha256(p)  # type: ignore[arg-type]
        return sha256_file(p, follow_symlinks=follow_symlinks, on_bytes=on_bytes)  # type: ignore[arg-type]

    return dict(zip(items, parallel(one, items, workers=workers, cost=size), strict=True))


__all__ = ["CHUNK", "RACY_MARGIN_S", "COARSE_MARGIN_S", "NotAFile", "sha256_bytes", "sha256_fd", "sha256_file",
           "sha256_stream", "sha256_chunks", "write_all", "open_file", "read_buffer", "stat_key", "settled", "HashCache",
           "read_trusted_json", "parallel", "hash_many", "default_workers"]
