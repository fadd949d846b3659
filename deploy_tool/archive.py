"""Reproducible tar(.zst) archives and a safe extractor for archives nobody should trust.

Writer: entries sorted by name, mtime fixed (SOURCE_DATE_EPOCH or 0), uid/gid 0, empty owner names, modes
normalized (0755 with any exec bit, else 0644; directories 0755; symlinks 0777), GNU tar headers (no pax
atime/ctime records), files streamed in 1 MiB reads, compressed with zstd level 3 through the `zstandard`
library on every core. Its output does not depend on the worker count, so two writes of the same tree give the
same bytes on any machine with the same zstandard version. The zstd stream is cut into frames at member boundaries
chosen by content alone (before and after every big file, and before a member whose name hashes to a fixed residue),
so two archives of trees that differ in one file share every frame away from it byte for byte: rsync's delta
transfer (shipping a release to a box that has the previous one) resends only the frames around the change. Symlinks are stored as symlinks when their target is
relative and stays inside the tree (a venv's bin/python -> python3); anything else is refused.

Extractor: reads plain tar or tar.zst (zstd frames checked complete before anything is written) with its own
strict header parser, into a fresh private staging directory only. It rejects, with a named reason: absolute
paths, `..`, symlinks (or, where symlinks are allowed, ones that escape the root or are traversed by later
entries), hardlinks, device nodes, fifos, pax/sparse/unknown entry types, duplicate entries, bad checksums,
truncation, trailing garbage, and totals above a limit. On any error the staging directory is removed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import io
import itertools
import os
import queue
import shutil
import stat
import subprocess
import tarfile
import tempfile
import threading
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

import zstandard

from deploy_tool.errors import BundleError, InputError, OSFailure
from deploy_tool.hashing import CHUNK, read_buffer, sha256_chunks, write_all
from deploy_tool.manifest import check_relpath, reject, source_date_epoch
from deploy_tool.progress import ByteCounter, ProgressFn
from deploy_tool.textsafe import q

BLOCK = 512
RECORD = 20 * BLOCK
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
ZSTD_LEVEL = 3
MAX_LONGNAME = 64 * 1024
MAX_TRAILING_ZEROS = 1 << 20
DEFAULT_MAX_TOTAL = 64 << 30
DEFAULT_MAX_ENTRIES = 1_000_000
SMALL_FILE = 4 << 20  # extract_archive: files up to this size are written by the writer threads
WRITE_AHEAD = 64 << 20  # ... with at most this many bytes read but not yet written
WRITERS = 4
SINK_BATCH = 4 << 20
SINK_DIRECT = 256 << 10
FRAME_BIG = 1 << 20  # a file this big gets frames of its own (a frame boundary before and after it)
FRAME_EVERY = 64  # ... and a boundary before every member whose name's CRC-32 is 0 modulo this (~1 in 64)


def normal_mode(st_mode: int) -> int:
    """0755 if any exec bit is set, else 0644."""
    return 0o755 if st_mode & 0o111 else 0o644


# ---------------------------------------------------------------------------------------------- writer

@dataclass(frozen=True)
class Member:
    """One archive entry. `source` is a file path or the bytes themselves (kind "file")."""

    name: str
    kind: str = "file"  # "file" | "dir" | "symlink"
    source: Path | bytes | None = None
    mode: int = 0o644
    target: str = ""  # symlink target (relative)


def check_symlink_target(name: str, target: str) -> None:
    """A symlink may only point inside the tree: relative, with `..` only as leading parts and not above root."""
    if not target or target.startswith("/"):
        raise reject("symlink-escape", f"symlink {q(name)} -> {target!r}: only relative targets are allowed",
                     path=name)
    if "\x00" in target:
        raise reject("bad-path", f"symlink {q(name)} has a NUL in its target", path=name)
    parts = [p for p in target.split("/") if p not in ("", ".")]
    ups = 0
    while ups < len(parts) and parts[ups] == "..":
        ups += 1
    if ".." in parts[ups:]:
        raise reject("symlink-escape", f"symlink {q(name)} -> {q(target)}: '..' after a name is not allowed",
                     path=name)
    depth = len(PurePosixPath(name).parts) - 1
    if ups > depth:
        raise reject("symlink-escape", f"symlink {q(name)} -> {q(target)} points outside the tree", path=name)


def members_from_tree(root: str | os.PathLike[str], *, symlinks: bool = True,
                      exclude: Callable[[str], bool] | None = None) -> list[Member]:
    """Every directory, regular file and (if allowed) in-tree relative symlink under root, sorted by name.

    Anything else (sockets, fifos, devices, absolute or escaping symlinks) is an InputError naming the path.
    """
    root = Path(root)
    if not root.is_dir():
        raise InputError(f"{q(root)} is not a directory")
    out: list[Member] = []

    def walk(d: Path, rel: str) -> None:
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError as exc:
            raise InputError(f"cannot list {q(d)}: {exc.strerror}") from exc
        for e in entries:
            name = f"{rel}{e.name}"
            if exclude is not None and exclude(name):
                continue
            try:
                check_relpath(name)
            except Exception as exc:
                raise InputError(f"cannot archive {d / e.name}: unusual file name") from exc
            st = e.stat(follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                if not symlinks:
                    raise InputError(f"{d / e.name} is a symlink; symlinks are not allowed here")
                target = os.readlink(e.path)
                try:
                    check_symlink_target(name, target)
                except Exception as exc:
                    raise InputError(f"{d / e.name} -> {q(target)}: only relative symlinks that stay inside "
                                     f"{q(root)} can be archived",
                                     hint="recreate it as a relative link, or build the venv with --copies"
                                     ) from exc
                out.append(Member(name, "symlink", target=target, mode=0o777))
            elif stat.S_ISDIR(st.st_mode):
                out.append(Member(name, "dir", mode=0o755))
                walk(Path(e.path), name + "/")
            elif stat.S_ISREG(st.st_mode):
                out.append(Member(name, "file", Path(e.path), normal_mode(st.st_mode)))
            else:
                raise InputError(f"{d / e.name} is not a regular file, directory or symlink; cannot archive it")

    walk(root, "")
    return out


def _tarinfo(m: Member, size: int, mtime: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(m.name)
    ti.mtime = mtime
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    if m.kind == "file":
        ti.type = tarfile.REGTYPE
        ti.size = size
        ti.mode = normal_mode(m.mode)
    elif m.kind == "dir":
        ti.type = tarfile.DIRTYPE
        ti.mode = 0o755
    elif m.kind == "symlink":
        ti.type = tarfile.SYMTYPE
        ti.linkname = m.target
        ti.mode = 0o777
    else:
        raise ValueError(f"unknown member kind {m.kind!r}")
    return ti


class _Sink:
    """Where tar bytes go: a file, optionally through a multithreaded zstd compressor."""

    def __init__(self, f: BinaryIO, compression: str, threads: int) -> None:
        self.f = f
        self.written = 0
        self._buf = bytearray()
        self._frame_start = 0
        self._zw = None
        if compression == "zstd":
            # threads >= 1 always: zstd's multithreaded format is the same for any worker count, but differs
            # from its single-threaded one, so a fixed mode keeps archives identical across machines.
            cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=max(1, threads), write_checksum=True)
            self._zw = cctx.stream_writer(f, closefd=False)
        elif compression != "none":
            raise ValueError(f"unknown compression {compression!r}")

    def write(self, data: bytes | memoryview) -> None:
        # Batch small pieces (headers, small files): each call into the compressor has a fixed cost.
        self.written += len(data)
        if len(data) >= SINK_DIRECT:  # big file chunks go straight in, without another copy
            self._drain()
            self._put(data)
            return
        self._buf += data
        if len(self._buf) >= SINK_BATCH:
            self._drain()

    def _put(self, data: bytes | bytearray | memoryview) -> None:
        if self._zw is not None:
            self._zw.write(data)
        else:
            self.f.write(data)

    def _drain(self) -> None:
        if self._buf:
            self._put(self._buf)
            self._buf = bytearray()

    def end_frame(self) -> None:
        """End the zstd frame here (nothing when uncompressed, or when nothing was written since the last end)."""
        self._drain()
        if self._zw is not None and self.written != self._frame_start:
            self._zw.flush(zstandard.FLUSH_FRAME)
            self._frame_start = self.written

    def close(self) -> None:
        self._drain()
        if self._zw is not None:
            self._zw.close()  # ends the last frame (a flush first would add an empty one)


def _pad(n: int) -> bytes:
    return b"\0" * (-n % BLOCK)


def write_archive(members: Iterable[Member], out_path: str | os.PathLike[str], *, compression: str = "zstd",
                  mtime: int | None = None, threads: int | None = None, sort: bool = True,
                  progress: ProgressFn | None = None) -> Path:
    """Write a reproducible tar (compression "none") or tar.zst; atomically (temp file + rename)."""
    out = Path(out_path)
    items = list(members)
    if sort:
        items.sort(key=lambda m: m.name)
    names: set[str] = set()
    for m in items:
        check_relpath(m.name, what="archive member name")
        if m.name in names:
            raise InputError(f"archive member {q(m.name)} is listed twice")
        names.add(m.name)
        if m.kind == "symlink":
            check_symlink_target(m.name, m.target)
    mtime = source_date_epoch() if mtime is None else mtime
    threads = threads or max(1, os.cpu_count() or 1)
    sizes = {}
    for m in items:
        if m.kind == "file":
            if isinstance(m.source, bytes | bytearray):
                sizes[m.name] = len(m.source)
            elif m.source is not None:
                try:
                    sizes[m.name] = os.stat(m.source).st_size
                except OSError as exc:
                    raise InputError(f"cannot read {q(m.source)}: {exc.strerror}") from exc
            else:
                raise ValueError(f"file member {q(m.name)} has no source")
    counter = ByteCounter(progress, "archiving", sum(sizes.values()))
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with open(fd, "wb") as f:
            _write_stream(items, sizes, f, compression=compression, threads=threads, mtime=mtime, counter=counter)
            f.flush()
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except OSError as exc:
        raise OSFailure(f"cannot write archive {q(out)}: {exc}") from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return out


def _write_stream(items: Sequence[Member], sizes: dict[str, int], f: BinaryIO, *, compression: str, threads: int,
                  mtime: int, counter: ByteCounter) -> None:
    """The tar byte stream of checked, ordered members, into f (optionally through zstd)."""
    sink = _Sink(f, compression, threads)
    big_before = False
    for m in items:
        size = sizes.get(m.name, 0)
        if frame_boundary_before(m.name, size, big_before):
            sink.end_frame()
        big_before = size >= FRAME_BIG
        sink.write(_tarinfo(m, size, mtime).tobuf(tarfile.GNU_FORMAT, "utf-8", "strict"))
        if m.kind != "file":
            continue
        if isinstance(m.source, bytes | bytearray):
            sink.write(m.source)
            counter.add(len(m.source))
        else:
            _copy_file_into(Path(m.source), size, sink, counter)  # type: ignore[arg-type]
        sink.write(_pad(size))
    sink.end_frame()  # the trailer's padding depends on the total size: a frame of its own keeps it from the rest
    sink.write(b"\0" * (2 * BLOCK))
    sink.write(b"\0" * (-sink.written % RECORD))
    sink.close()


def frame_boundary_before(name: str, size: int, after_big: bool) -> bool:
    """Whether a zstd frame ends before the member `name` (of `size` bytes; `after_big`: the member before it was a
    big file). Content-defined: it depends on this member and the one before it only, never on the offset, so a
    change in one file moves no boundary elsewhere."""
    return size >= FRAME_BIG or after_big or zlib.crc32(name.encode("utf-8", "surrogateescape")) % FRAME_EVERY == 0


def _copy_file_into(src: Path, size: int, sink: _Sink, counter: ByteCounter) -> None:
    buf, view = read_buffer()
    done = 0
    try:
        fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise InputError(f"cannot read {q(src)}: {exc.strerror}") from exc
    try:
        while done < size:
            n = os.readv(fd, [view[: min(CHUNK, size - done)]])
            if not n:
                break
            sink.write(view[:n])
            done += n
            counter.add(n)
        grew = os.read(fd, 1)
    finally:
        os.close(fd)
    if done != size or grew:
        raise InputError(f"{q(src)} changed size while it was being archived",
                         hint="stop whatever is writing to it and run again")


def archive_tree(root: str | os.PathLike[str], out_path: str | os.PathLike[str], *, symlinks: bool = True,
                 compression: str = "zstd", mtime: int | None = None,
                 exclude: Callable[[str], bool] | None = None, progress: ProgressFn | None = None) -> Path:
    """Archive a directory tree (e.g. a venv) reproducibly; the archive holds paths relative to root."""
    return write_archive(members_from_tree(root, symlinks=symlinks, exclude=exclude), out_path,
                         compression=compression, mtime=mtime, progress=progress)


# ---------------------------------------------------------------------------------------------- reading

def check_zstd_frames(f: BinaryIO) -> list[tuple[int, int]]:
    """Walk zstd frame and block headers to the end of the file; raise archive-truncated if it stops short.
    Returns the (start, end) offsets of the data frames."""
    f.seek(0, os.SEEK_END)
    end = f.tell()
    pos = 0
    frames = 0
    spans: list[tuple[int, int]] = []

    try:
        fd: int | None = f.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        fd = None

    def read_at(n: int, at: int) -> bytes:
        if fd is not None:
            return os.pread(fd, n, at)
        f.seek(at)
        return f.read(n)

    def need(n: int) -> bytes:
        nonlocal pos
        if pos + n > end:
            raise reject("archive-truncated", "archive is truncated: its zstd stream ends inside a frame",
                         hint="copy the archive again; compare its size with the original")
        # pread: one system call per header (a seek + read of the buffered file threw its buffer away each time,
        # half a second for a bundle's 18,000 blocks)
        data = read_at(n, pos) if n else b""
        if len(data) != n:
            raise reject("archive-truncated", "archive is truncated (short read)")
        pos += n
        return data

    while pos < end:
        magic = int.from_bytes(need(4), "little")
        if 0x184D2A50 <= magic <= 0x184D2A5F:  # skippable frame
            size = int.from_bytes(need(4), "little")
            need(0)
            pos += size
            if pos > end:
                raise reject("archive-truncated", "archive is truncated inside a skippable zstd frame")
            continue
        if magic != 0xFD2FB528:
            if frames == 0:
                raise reject("unsupported-compression", "archive is neither tar nor tar.zst")
            raise reject("trailing-data", "archive has data after its last zstd frame")
        start = pos - 4
        fhd = need(1)[0]
        if fhd & 0x08:
            raise reject("archive-malformed", "zstd frame header has its reserved bit set")
        fcs_flag, single, checksum, dict_flag = fhd >> 6, (fhd >> 5) & 1, (fhd >> 2) & 1, fhd & 3
        skip = (0 if single else 1) + (0, 1, 2, 4)[dict_flag] + ((1 if single else 0), 2, 4, 8)[fcs_flag]
        need(skip)
        while True:
            b = need(3)
            h = b[0] | (b[1] << 8) | (b[2] << 16)
            last, btype, bsize = h & 1, (h >> 1) & 3, h >> 3
            if btype == 3:
                raise reject("archive-malformed", "zstd stream has a reserved block type")
            content = 1 if btype == 1 else bsize
            if pos + content > end:
                raise reject("archive-truncated", "archive is truncated: its zstd stream ends inside a block",
                             hint="copy the archive again; compare its size with the original")
            pos += content
            if last:
                break
        if checksum:
            need(4)
        frames += 1
        spans.append((start, pos))
    return spans


def _open_checked(path: str | os.PathLike[str]) -> tuple[BinaryIO, bytes]:
    """The archive at `path` opened (a regular file, else InputError) and its first block; a zstd archive's
    frames are checked complete first. The caller closes the file and seeks as it reads."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - the caller closes it
    except OSError as exc:
        raise InputError(f"cannot read archive {q(path)}: {exc.strerror}") from exc
    try:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise InputError(f"{q(path)} is not a regular file")
        head = f.read(BLOCK)
        if head[:4] == ZSTD_MAGIC:
            check_zstd_frames(f)
    except BaseException:
        f.close()
        raise
    return f, head


@contextlib.contextmanager
def open_tar_stream(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """The uncompressed tar byte stream of a .tar or .tar.zst file (zstd completeness checked first)."""
    f, head = _open_checked(path)
    try:
        if head[:4] == ZSTD_MAGIC:
            f.seek(0)
            reader = zstandard.ZstdDecompressor().stream_reader(f, read_size=CHUNK, read_across_frames=True,
                                                              closefd=False)
            pre = _Prefetch(_ZstdErrors(reader, zstandard.ZstdError))
            try:
                yield io.BufferedReader(pre, buffer_size=CHUNK)
            finally:
                pre.stop()
                reader.close()
        elif len(head) == BLOCK and head[257:262] == b"ustar":
            f.seek(0)
            yield f
        elif head[:2] == b"\x1f\x8b":
            raise reject("unsupported-compression", f"{q(path)} is gzip-compressed; only tar and tar.zst are read")
        elif len(head) < BLOCK:
            raise reject("archive-truncated", f"{q(path)} is too short to be an archive ({len(head)} bytes)")
        else:
            raise reject("unsupported-compression", f"{q(path)} is neither a tar nor a tar.zst archive")
    finally:
        f.close()


class _ZstdErrors(io.RawIOBase):
    """Raw stream over the zstd decoder; decoding errors (corrupt data, bad checksum) become a named rejection."""

    def __init__(self, reader: Any, error: type[Exception]) -> None:
        self._r = reader
        self._err = error

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        try:
            return self._r.readinto(b)
        except self._err as exc:
            raise reject("archive-malformed", f"archive's zstd data is corrupt: {exc}") from exc


class _Prefetch(io.RawIOBase):
    """Decompresses on a background thread (a few MiB ahead) so that decoding overlaps with writing files."""

    _END = object()

    def __init__(self, raw: io.RawIOBase, depth: int = 8) -> None:
        self._raw = raw
        self._q: queue.Queue[object] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._pending = memoryview(b"")
        self._done = False
        self._t = threading.Thread(target=self._run, name="zstd-prefetch", daemon=True)
        self._t.start()

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                buf = bytearray(CHUNK)
                n = self._raw.readinto(buf)
                if not n:
                    break
                if not self._put(memoryview(buf)[:n]):
                    return
            self._put(self._END)
        except BaseException as exc:  # handed to the reading thread
            self._put(exc)

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if not self._pending:
            if self._done:
                return 0
            item = self._q.get()
            if item is self._END:
                self._done = True
                return 0
            if isinstance(item, BaseException):
                self._done = True
                raise item
            self._pending = item  # type: ignore[assignment]
        n = min(len(b), len(self._pending))
        b[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def stop(self) -> None:
        self._stop.set()
        self._t.join()


@dataclass(frozen=True)
class TarEntry:
    name: str
    kind: str  # file, dir, symlink, hardlink, chardev, blockdev, fifo
    size: int
    mode: int
    target: str


_KINDS = {b"0": "file", b"\0": "file", b"5": "dir", b"2": "symlink", b"1": "hardlink", b"3": "chardev",
          b"4": "blockdev", b"6": "fifo"}


def _num(field: bytes, what: str) -> int:
    if field and field[0] & 0x80:  # GNU base-256
        if field[0] != 0x80:
            raise reject("archive-malformed", f"tar header {what} is negative or too large")
        return int.from_bytes(field[1:], "big")
    s = field.split(b"\0", 1)[0].strip(b" ")
    if not s:
        return 0
    try:
        return int(s, 8)
    except ValueError as exc:
        raise reject("archive-malformed", f"tar header {what} is not octal: {s[:20]!r}") from exc


def _text(field: bytes) -> bytes:
    return field.split(b"\0", 1)[0]


class TarReader:
    """Strict streaming reader of ustar/GNU tar: yields entries; read each file's data with `chunks()`."""

    def __init__(self, stream: BinaryIO, *, what: str = "archive") -> None:
        self.s = stream
        self.what = what
        self._remaining = 0  # unread data + padding of the current entry
        self._data_left = 0
        self.offset = 0

    def _read(self, n: int) -> bytes:
        b = self.s.read(n)
        if len(b) == n or not b:
            self.offset += len(b)
            return b
        out = bytearray(b)
        while len(out) < n:
            b = self.s.read(n - len(out))
            if not b:
                break
            out += b
        self.offset += len(out)
        return bytes(out)

    def _exact(self, n: int) -> bytes:
        b = self._read(n)
        if len(b) != n:
            raise reject("archive-truncated", f"{self.what} is truncated at byte {self.offset}",
                         hint="copy the archive again; compare its size with the original")
        return b

    def _skip_rest(self) -> None:
        while self._remaining:
            n = min(self._remaining, CHUNK)
            self._exact(n)
            self._remaining -= n
        self._data_left = 0

    def take_data(self) -> int:
        """The current entry's data and padding are moved by the caller, not read here: how many bytes that is
        (the reader's position moves past them)."""
        n = self._remaining
        self._remaining = self._data_left = 0
        self.offset += n
        return n

    def chunks(self) -> Iterator[bytes]:
        """The current file entry's data, in pieces of at most 1 MiB."""
        while self._data_left:
            n = min(self._data_left, CHUNK)
            b = self._exact(n)
            self._data_left -= n
            self._remaining -= n
            yield b
        pad = self._remaining
        if pad:
            self._exact(pad)
            self._remaining = 0

    def __iter__(self) -> Iterator[TarEntry]:
        longname: bytes | None = None
        longlink: bytes | None = None
        while True:
            self._skip_rest()
            hdr = self._exact(BLOCK)
            if hdr == b"\0" * BLOCK:
                if longname is not None or longlink is not None:
                    raise reject("archive-malformed", "tar long-name record is not followed by an entry")
                if self._exact(BLOCK) != b"\0" * BLOCK:
                    raise reject("archive-malformed", "tar end-of-archive marker is followed by data")
                self._check_trailing()
                return
            self._checksum(hdr)
            magic = hdr[257:265]
            if magic not in (b"ustar\x0000", b"ustar  \0"):
                raise reject("archive-malformed", f"tar entry at byte {self.offset - BLOCK} is not ustar/GNU")
            typ = hdr[156:157]
            size = _num(hdr[124:136], "size")
            if typ in (b"L", b"K"):
                if size > MAX_LONGNAME:
                    raise reject("archive-malformed", "tar long name is too long")
                self._data_left, self._remaining = size, size + (-size % BLOCK)
                data = b"".join(self.chunks()).split(b"\0", 1)[0]
                if typ == b"L":
                    longname = data
                else:
                    longlink = data
                continue
            raw_name = longname if longname is not None else _text(hdr[0:100])
            if longname is None and magic == b"ustar\x0000" and hdr[345] != 0:
                raw_name = _text(hdr[345:500]) + b"/" + raw_name
            raw_link = longlink if longlink is not None else _text(hdr[157:257])
            longname = longlink = None
            try:
                name = raw_name.decode("utf-8")
                target = raw_link.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise reject("bad-path", f"tar entry name is not UTF-8: {raw_name[:80]!r}") from exc
            kind = _KINDS.get(typ)
            if kind is None:
                what = {b"x": "a pax header", b"g": "a pax global header", b"S": "a sparse file",
                        b"7": "a contiguous file", b"V": "a volume label", b"M": "a multi-volume part"}
                raise reject("unsupported-entry",
                             f"tar entry {name!r} is {what.get(typ, f'of unknown type {typ!r}')}", path=name)
            if kind == "dir" and name.endswith("/"):
                name = name.rstrip("/")
            if kind not in ("file", "hardlink") and size:
                # Data behind a non-file entry would be skipped silently by other tools; refuse it.
                raise reject("archive-malformed", f"tar entry {name!r} ({kind}) carries data", path=name)
            mode = _num(hdr[100:108], "mode") & 0o7777
            self._data_left = size if kind == "file" else 0
            self._remaining = (size + (-size % BLOCK)) if kind in ("file", "hardlink") else 0
            yield TarEntry(name, kind, size, mode, target)

    def _checksum(self, hdr: bytes) -> None:
        want = _num(hdr[148:156], "checksum")
        blanked = hdr[:148] + b" " * 8 + hdr[156:]
        if want == sum(blanked):
            return
        signed = sum(blanked) - 256 * sum(1 for b in blanked if b > 127)  # old tars summed signed chars
        if want != signed:
            raise reject("archive-malformed", f"tar header checksum mismatch at byte {self.offset - BLOCK}")

    def _check_trailing(self) -> None:
        seen = 0
        while True:
            b = self.s.read(CHUNK)
            if not b:
                return
            if b.count(0) != len(b):
                raise reject("trailing-data", f"{self.what} has data after its end-of-archive marker")
            seen += len(b)
            if seen > MAX_TRAILING_ZEROS:
                raise reject("trailing-data", f"{self.what} has more than 1 MiB of padding after its end")


# ---------------------------------------------------------------------------------------------- extractor

def _parents(name: str) -> list[str]:
    """'a/b/c' -> ['a/b', 'a'] (nearest first), as strings: cheaper than PurePosixPath for every entry."""
    out = []
    i = name.rfind("/")
    while i > 0:
        name = name[:i]
        out.append(name)
        i = name.rfind("/")
    return out


class SafeExtractor:
    """Writes checked entries into a private staging dir it creates; never follows or writes through links."""

    def __init__(self, dest: str | os.PathLike[str], *, symlinks: bool, max_total: int = DEFAULT_MAX_TOTAL,
                 max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.dest = Path(dest)
        self.symlinks = symlinks
        self.max_total = max_total
        self.max_entries = max_entries
        self.total = 0
        self.count = 0
        self.files: set[str] = set()
        self.dirs: set[str] = set()
        self.links: set[str] = set()
        try:
            self.dest.mkdir(mode=0o700)
        except FileExistsError as exc:
            raise InputError(f"staging directory {q(self.dest)} already exists",
                             hint="pass a path that does not exist yet") from exc
        except OSError as exc:
            raise OSFailure(f"cannot create staging directory {q(self.dest)}: {exc.strerror}") from exc
        os.chmod(self.dest, 0o700)

    def remove(self) -> None:
        shutil.rmtree(self.dest, ignore_errors=True)

    def check(self, e: TarEntry) -> None:
        """Every structural rule, before anything is written for this entry."""
        check_relpath(e.name, what="archive entry")
        if e.kind == "hardlink":
            raise reject("hardlink", f"archive entry {q(e.name)} is a hardlink (to {q(e.target)})", path=e.name)
        if e.kind in ("chardev", "blockdev"):
            raise reject("device-node", f"archive entry {q(e.name)} is a device node", path=e.name)
        if e.kind == "fifo":
            raise reject("fifo", f"archive entry {q(e.name)} is a fifo", path=e.name)
        if e.kind == "symlink":
            if not self.symlinks:
                raise reject("symlink", f"archive entry {q(e.name)} is a symlink (to {q(e.target)})", path=e.name)
            check_symlink_target(e.name, e.target)
        if e.name in self.files or e.name in self.links or (e.name in self.dirs and e.kind != "dir"):
            raise reject("duplicate-entry", f"archive lists {q(e.name)} more than once", path=e.name)
        for p in _parents(e.name):
            if p in self.links:
                raise reject("path-through-symlink", f"archive entry {q(e.name)} lies under symlink {q(p)}",
                             path=e.name)
            if p in self.files:
                raise reject("path-conflict", f"archive entry {q(e.name)} lies under file {q(p)}", path=e.name)
        self.count += 1
        if self.count > self.max_entries:
            raise reject("archive-too-large", f"archive has more than {self.max_entries} entries")
        if e.kind == "file":
            self.total += e.size
            if self.total > self.max_total:
                raise reject("archive-too-large",
                             f"archive unpacks to more than {self.max_total} bytes (limit)", path=e.name)

    def _parents(self, name: str) -> None:
        for p in reversed(_parents(name)):
            if p in self.dirs:
                continue
            os.mkdir(self.dest / p, 0o755)
            self.dirs.add(p)

    def reserve(self, e: TarEntry) -> None:
        """Create the parents of a file entry and claim its name now, in stream order, so that `write` may run in
        another thread while later entries are checked against it."""
        self._parents(e.name)
        self.files.add(e.name)

    def write(self, e: TarEntry, chunks: Iterable[bytes], *, mode: int | None = None, digest: bool = True) -> str:
        """Create the entry (after `check`); for files return the SHA-256 of what was written (if `digest`)."""
        self._parents(e.name)
        path = self.dest / e.name
        if e.kind == "dir":
            if e.name not in self.dirs:
                os.mkdir(path, 0o755)
                self.dirs.add(e.name)
            return ""
        if e.kind == "symlink":
            os.symlink(e.target, path)
            self.links.add(e.name)
            return ""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self.files.add(e.name)
        sha = ""
        try:
            if digest and e.size >= OVERLAP_MIN:
                sha, written = _hash_while_writing(chunks, fd)
            elif digest:
                sha, written = sha256_chunks(chunks, sink=write_all(fd))
            else:
                sink, written = write_all(fd), 0
                for b in chunks:
                    sink(b)
                    written += len(b)
            os.fchmod(fd, normal_mode(e.mode) if mode is None else mode)
        finally:
            os.close(fd)
        if written != e.size:  # pragma: no cover - TarReader raises first
            raise reject("archive-truncated", f"archive entry {q(e.name)} is short", path=e.name)
        return sha


OVERLAP_MIN = 8 << 20  # a file this big is hashed on this thread while the chunk before is written on another
_writer: ThreadPoolExecutor | None = None
_writer_lock = threading.Lock()


def _hash_while_writing(chunks: Iterable[bytes], fd: int) -> tuple[str, int]:
    """(SHA-256, bytes) of `chunks`, each written to `fd` in order by one writer thread while this one hashes it:
    both release the GIL, so a big file costs about the larger of the two, not their sum. At most two chunks are
    in flight; the hash is of exactly the bytes handed to the write."""
    global _writer
    with _writer_lock:
        if _writer is None:
            _writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hash-write")
    h = hashlib.sha256()
    n = 0
    prev: Future[None] | None = None
    sink = write_all(fd)
    try:
        for b in chunks:
            b = bytes(b)  # immutable: the writer thread reads it while this one goes on
            fut = _writer.submit(sink, b)
            h.update(b)
            n += len(b)
            if prev is not None:
                prev.result()
            prev = fut
    finally:
        if prev is not None:
            prev.result()
    return h.hexdigest(), n


@dataclass(frozen=True)
class Extracted:
    root: Path
    files: int
    total_size: int


def extract_archive(archive: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
                    dest: str | os.PathLike[str], *, symlinks: bool = True,
                    max_total: int = DEFAULT_MAX_TOTAL, max_entries: int = DEFAULT_MAX_ENTRIES,
                    progress: ProgressFn | None = None, system_tools: bool | None = None,
                    digests: dict[str, str] | None = None, names: list[list[str]] | None = None) -> Extracted:
    """Safely unpack a tar/tar.zst, or several one after another, into `dest` (created, private, must not exist);
    removed again on any error. Several archives unpack as one: a path two of them hold as a file or link is a
    duplicate entry; directories merge; the limits count them all.

    With the system's `zstd` and GNU `tar` (`system_tools` None: where present, see `unpack_tools`), they do the
    decompressing and the writing, and this process only checks: every header passes the same checks as below
    before `tar` sees a byte of it (`_extract_with_tools`). `digests`: filled with {member name: SHA-256} of every
    file's bytes as they were written (handed to the writer), so a caller need not read the tree back. `names`:
    one list per archive appended, every entry's name in it (what a later install may take from this one)."""
    archives = [archive] if isinstance(archive, str | os.PathLike) else list(archive)
    tools = unpack_tools() if system_tools is None or system_tools else None
    if system_tools and tools is None:
        raise InputError("system_tools asked for, but zstd or GNU tar is not on PATH")
    sizes = [os.stat(a).st_size for a in archives]
    counter = ByteCounter(progress, "extracting", sum(sizes))
    ex = SafeExtractor(dest, symlinks=symlinks, max_total=max_total, max_entries=max_entries)
    if tools is not None:
        try:
            for a, before in zip(archives, itertools.accumulate([0] + sizes), strict=False):
                _extract_with_tools(a, ex, tools, counter, before, digests, _new_list(names))
        except BaseException:
            ex.remove()
            raise
        return Extracted(ex.dest, len(ex.files), ex.total)
    # Creating thousands of files costs file-system latency more than CPU: the stream is read and checked in this
    # thread, each small file's bytes are handed to a few writer threads (open, write, chmod, close release the
    # GIL), with at most WRITE_AHEAD bytes in flight; big files are written here, in stream order.
    pending: deque[tuple[str, Future[str]]] = deque()
    inflight = threading.BoundedSemaphore(WRITE_AHEAD // CHUNK)
    pool = ThreadPoolExecutor(max_workers=WRITERS, thread_name_prefix="extract")

    def release(n: int, _f: Future[str]) -> None:
        for _ in range(n):
            inflight.release()

    try:
        for a, before, size in zip(archives, itertools.accumulate([0] + sizes), sizes, strict=False):
            with open_tar_stream(a) as stream:
                reader = TarReader(stream, what=str(a))
                listed = _new_list(names)
                for e in reader:
                    ex.check(e)
                    if listed is not None:
                        listed.append(e.name)
                    if e.kind == "file" and e.size <= SMALL_FILE:
                        ex.reserve(e)
                        data = [bytes(b) for b in reader.chunks()]
                        n = max(1, -(-e.size // CHUNK))
                        for _ in range(n):
                            inflight.acquire()
                        fut = pool.submit(ex.write, e, data, digest=digests is not None)
                        fut.add_done_callback(functools.partial(release, n))
                        pending.append((e.name, fut))
                        while pending and pending[0][1].done():
                            name, done = pending.popleft()
                            sha = done.result()
                            if digests is not None:
                                digests[name] = sha
                    else:
                        sha = ex.write(e, reader.chunks() if e.kind == "file" else (), digest=digests is not None)
                        if digests is not None and e.kind == "file":
                            digests[e.name] = sha
                    if progress is not None:
                        counter.done = 0
                        counter.add(before + min(reader.offset, size))
        while pending:
            name, done = pending.popleft()
            sha = done.result()
            if digests is not None:
                digests[name] = sha
        return Extracted(ex.dest, len(ex.files), ex.total)
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        ex.remove()
        raise
    finally:
        pool.shutdown(wait=True)


# ---------------------------------------------------------------------------------------------- system tools

UNPACK_ENV = "DEPLOYTOOL_UNPACK"  # "python": never the system tools (tests, benchmarks); anything else: where present
PIPE_SIZE = 1 << 20


@functools.lru_cache(maxsize=1)
def _find_tools() -> tuple[str, str] | None:
    zstd, tar = shutil.which("zstd"), shutil.which("tar")
    if not zstd or not tar:
        return None
    try:
        out = subprocess.run([tar, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return (zstd, tar) if out.startswith("tar (GNU tar)") else None


def unpack_tools() -> tuple[str, str] | None:
    """(zstd, GNU tar) of this machine, or None (either missing, another tar, or DEPLOYTOOL_UNPACK=python)."""
    if os.environ.get(UNPACK_ENV) == "python":
        return None
    return _find_tools()


class _Tee(io.RawIOBase):
    """The tar stream as TarReader reads it, every byte also kept until `take` hands it on: headers only after
    they were checked, data as it comes."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self.held: list[bytes] = []

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        b = self._raw.read(n)
        if b:
            self.held.append(b)
        return b

    def take(self) -> list[bytes]:
        out, self.held = self.held, []
        return out

    def normalize_header(self, mode: int) -> None:
        """Set the mode of the header just read (the last block held) and its checksum to match."""
        last = self.held[-1]
        if len(last) < BLOCK:  # the header came in pieces: join what is held
            joined = b"".join(self.held)
            self.held = [joined[:-BLOCK], joined[-BLOCK:]] if len(joined) > BLOCK else [joined]
            last = self.held[-1]
        hdr = bytearray(last[-BLOCK:])
        hdr[100:108] = b"%07o\0" % mode
        hdr[148:156] = b" " * 8
        hdr[148:156] = b"%06o\0 " % sum(hdr)
        self.held[-1] = last[:-BLOCK] + bytes(hdr)


def _new_list(lists: list[list[str]] | None) -> list[str] | None:
    if lists is None:
        return None
    lists.append([])
    return lists[-1]


def _extract_with_tools(archive: str | os.PathLike[str], ex: SafeExtractor, tools: tuple[str, str],
                        counter: ByteCounter, before: int, digests: dict[str, str] | None = None,
                        names: list[str] | None = None) -> None:
    """`zstd -d | (check here) | tar -x` into ex.dest: the stream is read by TarReader and each entry passes
    SafeExtractor.check (paths, links, devices, duplicates, limits) before its header (with the mode normalized
    as SafeExtractor writes it) goes on to tar; nothing that failed a check reaches tar, and a failure kills both
    tools and the caller removes the directory. tar writes with --no-same-owner, --touch, --keep-old-files."""
    zstd, tar = tools
    total = os.stat(archive).st_size
    procs: list[subprocess.Popen[bytes]] = []
    # the tools' messages go to files, not pipes: a tar that writes many (a full disk) must never block on them
    errs = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]  # noqa: SIM115 - closed below
    try:
        f, head = _open_checked(archive)
    except BaseException:
        for errf in errs:
            errf.close()
        raise
    try:
        if head[:4] == ZSTD_MAGIC:
            os.lseek(f.fileno(), 0, os.SEEK_SET)  # zstd reads the file this process opened and checked
            z = subprocess.Popen([zstd, "-d", "-c", "-q", "--no-progress"], stdin=f.fileno(),
                                 stdout=subprocess.PIPE, stderr=errs[0])
            procs.append(z)
            assert z.stdout is not None
            _grow_pipe(z.stdout.fileno())
            src_fd = z.stdout.fileno()
        elif len(head) == BLOCK and head[257:262] == b"ustar":
            os.lseek(f.fileno(), 0, os.SEEK_SET)
            src_fd = f.fileno()
        else:
            with open_tar_stream(archive):  # the same refusal (gzip, too short, unknown) as the Python path
                pass
            raise reject("unsupported-compression", f"{q(archive)} is neither a tar nor a tar.zst archive")
        t = subprocess.Popen([tar, "-x", "-f", "-", "-C", str(ex.dest), "--no-same-owner", "--touch",
                              "--keep-old-files"], stdin=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, stderr=errs[1], umask=0o022)
        procs.append(t)
        assert t.stdin is not None
        _grow_pipe(t.stdin.fileno())
        send = write_all(t.stdin.fileno())
        # headers are read here unbuffered (a read stops where the stream is: no data of the next entry taken
        # early); file data goes from zstd's pipe (or the file) to tar's with splice(2), never through this
        # process, unless its digest is wanted
        splice = digests is None and hasattr(os, "splice")
        raw = io.FileIO(src_fd, "rb", closefd=False)
        src: BinaryIO = raw if splice else io.BufferedReader(raw, buffer_size=CHUNK)
        tee = _Tee(src)
        reader = TarReader(tee, what=str(archive))  # type: ignore[arg-type]
        try:
            for e in reader:
                ex.check(e)
                if names is not None:
                    names.append(e.name)
                for parent in _parents(e.name):
                    ex.dirs.add(parent)
                if e.kind == "dir":
                    ex.dirs.add(e.name)
                    tee.normalize_header(0o755)
                elif e.kind == "symlink":
                    ex.links.add(e.name)
                else:
                    ex.files.add(e.name)
                    tee.normalize_header(normal_mode(e.mode))
                for b in tee.take():
                    send(b)
                if e.kind == "file" and splice:
                    _splice_exact(src_fd, t.stdin.fileno(), reader.take_data(), reader)
                elif e.kind == "file":
                    h = hashlib.sha256() if digests is not None else None
                    for chunk in reader.chunks():
                        if h is not None:
                            h.update(chunk)
                        for b in tee.take():
                            send(b)
                    for b in tee.take():
                        send(b)
                    if h is not None and digests is not None:
                        digests[e.name] = h.hexdigest()
                counter.done = 0
                counter.add(before + min(reader.offset, total))
            for b in tee.take():  # the end-of-archive blocks, checked zeros
                send(b)
        except BrokenPipeError:
            pass  # tar stopped early: its exit status and message say why
        except BundleError as exc:  # a stream cut short because zstd found its data corrupt is named as such
            z0 = procs[0] if len(procs) == 2 else None
            if getattr(exc, "reason", "") == "archive-truncated" and z0 is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    if z0.wait(timeout=10) != 0:
                        raise reject("archive-malformed", "archive's zstd data is corrupt") from None
            raise
        with contextlib.suppress(BrokenPipeError):
            t.stdin.close()
        for proc in reversed(procs):  # tar first: when it stops early, zstd's broken pipe is not the cause
            if proc.wait() != 0:
                err = errs[1 if proc is t else 0]
                err.seek(0)
                msg = err.read()[-4000:].decode("utf-8", "replace").strip()[-400:]
                if "No space left on device" in msg:
                    raise OSError(errno.ENOSPC, f"tar: {msg}")
                if proc is not t:
                    raise reject("archive-malformed", f"archive's zstd data is corrupt: {msg}")
                raise OSFailure(f"tar could not unpack {q(archive)} into {q(ex.dest)}: {msg}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for s in (proc.stdin, proc.stdout):
                if s is not None:
                    with contextlib.suppress(OSError):
                        s.close()
        for errf in errs:
            errf.close()
        f.close()


def _splice_exact(src: int, dst: int, n: int, reader: TarReader) -> None:
    """Move exactly n bytes from src to the pipe dst in the kernel; a stream that ends first is truncated."""
    while n:
        k = os.splice(src, dst, min(n, PIPE_SIZE))
        if not k:
            raise reject("archive-truncated", f"{reader.what} is truncated at byte {reader.offset - n}",
                         hint="copy the archive again; compare its size with the original")
        n -= k


def _grow_pipe(fd: int) -> None:
    """A 1 MiB pipe (from 64 KiB): fewer wake-ups between the processes; best effort."""
    with contextlib.suppress(OSError, AttributeError):
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
