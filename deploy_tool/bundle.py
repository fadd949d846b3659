"""Signed bundles: write one from a list of files, verify one (directory or archive) before trusting it.

A bundle is a directory `<name>-<bundle_id>/` holding the files, `MANIFEST` and `MANIFEST.sig`, and the same
content as one reproducible archive `<name>-<bundle_id>.tar.zst` (MANIFEST and MANIFEST.sig first, then the files
sorted by path, no directory entries, no symlinks). What goes into a bundle is the caller's business (`pack`
decides from the config); this module only takes `Entry(arcname, source, mode)` items.

Verification order: the signature over the exact MANIFEST bytes first (nothing else is read before the bundle is
known to come from a trusted key), then the manifest's strict parse, then the tree's shape (no symlinks,
devices, fifos, extra or missing files; never opening anything but regular files), then every size and mode, then
every hash. An archive is unpacked only into a private staging directory, entry by entry, each checked against the
signed manifest before and while it is written; on any rejection the staging directory is removed, so nothing
unverified stays on disk.

A directory's files may have other names (hard links). Who can change a file's bytes is the inode's owner and
mode, whatever name reaches it, so another name gives nobody a write they could not make through the bundle's own
path. What is installed is never read in place: install (and the offline rebuild) copies each file into a private
staging directory and hashes the bytes as it writes them, so nothing done to the source afterwards, through any
name, reaches the copy. A check in place (`deploytool bundle verify DIR`) holds for the moment it ran, links or not.
Accepting links lets bundles kept side by side share the files that did not change (a ship that links them needs
every box to run a deploytool that accepts them first: versions before this one refuse them). An archive's
hard-link entries stay refused (deploy_tool.archive): there a link is a name the archive makes, not a shared file.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from deploy_tool.archive import (
    DEFAULT_MAX_ENTRIES,
    DEFAULT_MAX_TOTAL,
    Member,
    SafeExtractor,
    TarReader,
    normal_mode,
    open_tar_stream,
    write_archive,
)
from deploy_tool.errors import BundleError, InputError, OSFailure
from deploy_tool.faults import fault
from deploy_tool.hashing import read_buffer, sha256_chunks, sha256_stream, write_all
from deploy_tool.manifest import (
    DEFAULT_KEYS_DIR,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    MAX_SIGNATURE_BYTES,
    RESERVED_NAMES,
    SIGNATURE_NAME,
    FileEntry,
    Manifest,
    check_relpath,
    hash_files,
    public_key_id,
    reject,
    sign,
    source_date_epoch,
    verify_signature,
)
from deploy_tool.progress import ByteCounter, ProgressFn
from deploy_tool.textsafe import q

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
ARCHIVE_SUFFIXES = {"zstd": ".tar.zst", "none": ".tar"}


@dataclass(frozen=True)
class Entry:
    """One file of a bundle: where it goes (`arcname`), where it comes from (a path or the bytes), its mode."""

    arcname: str
    source: Path | bytes
    mode: int = 0o644


@dataclass(frozen=True)
class BundleInfo:
    bundle_id: str
    directory: Path
    archive: Path | None
    manifest: Manifest
    manifest_bytes: bytes
    key_id: str

    def to_json(self) -> dict[str, Any]:
        return {"bundle_id": self.bundle_id, "directory": str(self.directory),
                "archive": str(self.archive) if self.archive else None, "key_id": self.key_id,
                "created": self.manifest.created, "files": len(self.manifest.files),
                "total_size": self.manifest.total_size}


@dataclass
class VerifiedBundle:
    """A bundle whose signature, manifest and every file checked out. `root` holds the verified files.

    For an archive, `root` is the private staging directory it was unpacked into; `cleanup()` (or leaving the
    `with` block) removes it unless it was passed in by the caller.
    """

    root: Path
    manifest: Manifest
    key_id: str
    source: Path
    extracted: bool = False
    _owned: Path | None = field(default=None, repr=False)

    @property
    def bundle_id(self) -> str:
        return self.manifest.bundle_id

    def cleanup(self) -> None:
        if self._owned is not None:
            shutil.rmtree(self._owned, ignore_errors=True)
            self._owned = None

    def __enter__(self) -> VerifiedBundle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def to_json(self) -> dict[str, Any]:
        return {"bundle_id": self.bundle_id, "key_id": self.key_id, "source": str(self.source),
                "created": self.manifest.created, "files": len(self.manifest.files),
                "total_size": self.manifest.total_size, "format_version": self.manifest.format_version}


# ---------------------------------------------------------------------------------------------- writing

def _check_entries(entries: Sequence[Entry]) -> list[Entry]:
    out: list[Entry] = []
    seen: set[str] = set()
    for e in entries:
        try:
            check_relpath(e.arcname, what="bundle entry name")
        except BundleError as exc:
            raise InputError(exc.message) from exc
        if e.arcname in RESERVED_NAMES:
            raise InputError(f"bundle entry name {q(e.arcname)} is reserved for the bundle's own manifest")
        if e.arcname in seen:
            raise InputError(f"bundle entry {q(e.arcname)} is listed twice")
        if not isinstance(e.source, bytes | bytearray):
            src = Path(e.source)
            if not src.is_file():
                raise InputError(f"bundle input {q(src)} (for {q(e.arcname)}) is not a readable file",
                                 hint="check the path in the config")
        seen.add(e.arcname)
        out.append(Entry(e.arcname, e.source, normal_mode(e.mode)))
    for e in out:
        for parent in PurePosixPath(e.arcname).parents:
            if str(parent) in seen:
                raise InputError(f"bundle entry {q(parent)} is a file and also the directory of {q(e.arcname)}")
    return sorted(out, key=lambda e: e.arcname)


def _copy_and_hash(src: Path | bytes, dst: Path, mode: int, mtime: int,
                   counter: ByteCounter) -> tuple[int, str]:
    """Copy src to dst (new file) while hashing what was written; one pass, 1 MiB reads."""
    out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        write = write_all(out)

        def sink(chunk: bytes | memoryview) -> None:
            write(chunk)
            counter.add(len(chunk))

        if isinstance(src, bytes | bytearray):
            sha, size = sha256_chunks([src], sink=sink)
        else:
            try:
                fin = open(src, "rb", buffering=0)  # noqa: SIM115 - only the open is an input error
            except OSError as exc:
                raise InputError(f"cannot read {q(src)}: {exc.strerror}") from exc
            with fin:
                sha, size = sha256_stream(fin, sink=sink)
        os.fchmod(out, mode)
    finally:
        os.close(out)
    os.utime(dst, (mtime, mtime), follow_symlinks=False)
    return size, sha


def write_bundle(entries: Sequence[Entry], out_dir: str | os.PathLike[str], *, name: str = "bundle",
                 inputs: Mapping[str, Any] | None = None, native_libs: Mapping[str, str] | None = None,
                 key_path: str | os.PathLike[str], archive: bool | str = True, workers: int | None = None,
                 progress: ProgressFn | None = None) -> BundleInfo:
    """Write `<out_dir>/<name>-<id>/` (files, MANIFEST, MANIFEST.sig) atomically, plus one archive of it.

    archive: True or "zstd" -> `<name>-<id>.tar.zst`; "none" -> `.tar`; False -> no archive. The same entries
    and inputs give byte-identical MANIFEST, MANIFEST.sig and archive (times come from SOURCE_DATE_EPOCH).
    """
    if not _NAME.match(name):
        raise InputError(f"bundle name {name!r} must be letters, digits, '.', '_' or '-'")
    compression = {True: "zstd", "zstd": "zstd", "none": "none", "tar": "none", False: None}.get(archive, "?")
    if compression == "?":
        raise InputError(f"unknown archive kind {archive!r}; use zstd, none or False")
    items = _check_entries(entries)
    key_id = public_key_id(key_path)  # fail on a bad key before copying gigabytes
    mtime = source_date_epoch()
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=out))
    except OSError as exc:
        raise OSFailure(f"cannot create {q(out)}: {exc.strerror}") from exc
    try:
        total = sum(len(e.source) if isinstance(e.source, bytes | bytearray) else Path(e.source).stat().st_size
                    for e in items)
        counter = ByteCounter(progress, "copying", total)
        for e in items:
            for parent in reversed(PurePosixPath(e.arcname).parents):
                if str(parent) != ".":
                    (staging / parent).mkdir(mode=0o755, exist_ok=True)
        workers = workers or max(1, os.cpu_count() or 1)
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bundle") as pool:
            futs = [pool.submit(_copy_and_hash, e.source, staging / e.arcname, e.mode, mtime, counter)
                    for e in items]
            results = [f.result() for f in futs]
        files = [FileEntry(e.arcname, size, e.mode, sha) for e, (size, sha) in zip(items, results, strict=True)]
        manifest = Manifest.build(files, inputs=inputs, native_libs=native_libs)
        mbytes = manifest.to_bytes()
        sbytes = sign(mbytes, key_path)
        for fname, data in ((MANIFEST_NAME, mbytes), (SIGNATURE_NAME, sbytes)):
            with open(staging / fname, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(staging / fname, 0o644)
            os.utime(staging / fname, (mtime, mtime))
        for d in sorted({str(p) for e in items for p in PurePosixPath(e.arcname).parents} - {"."},
                        reverse=True):
            os.utime(staging / d, (mtime, mtime))
        os.chmod(staging, 0o755)
        os.utime(staging, (mtime, mtime))
        final = out / f"{name}-{manifest.bundle_id}"
        _replace_dir(staging, final)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise OSFailure(f"cannot write bundle into {q(out)}: {exc}") from exc
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    archive_path = None
    if compression is not None:
        archive_path = out / f"{name}-{manifest.bundle_id}{ARCHIVE_SUFFIXES[compression]}"
        members = [Member(MANIFEST_NAME, "file", final / MANIFEST_NAME, 0o644),
                   Member(SIGNATURE_NAME, "file", final / SIGNATURE_NAME, 0o644)]
        members += [Member(f.path, "file", final / f.path, f.mode) for f in manifest.files]
        write_archive(members, archive_path, compression=compression, mtime=mtime, sort=False,
                      progress=progress)
    return BundleInfo(manifest.bundle_id, final, archive_path, manifest, mbytes, key_id)


def _replace_dir(staging: Path, final: Path) -> None:
    """Move the finished staging dir into place; an existing bundle of the same id is replaced whole."""
    if not final.exists() and not final.is_symlink():
        os.rename(staging, final)
        return
    trash = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".old", dir=final.parent))
    os.rename(final, trash / "old")
    os.rename(staging, final)
    shutil.rmtree(trash, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- verifying

def verify_bundle(path: str | os.PathLike[str], keys_dir: str | os.PathLike[str] = DEFAULT_KEYS_DIR, *,
                  staging: str | os.PathLike[str] | None = None, expect_id: str | None = None,
                  workers: int | None = None, progress: ProgressFn | None = None) -> VerifiedBundle:
    """Verify a bundle directory or archive; raise BundleError (with `.reason`) on the first problem.

    For an archive, files are unpacked into `staging` (created private; must not exist) or a fresh temp dir,
    and nowhere else; on rejection that directory is removed. For a directory with `staging`, every file is
    copied into it and hashed from the bytes written there (one read of each file, after the signature check):
    what the staging directory holds is what was verified, whatever happens to the directory afterwards.
    Without `staging`, a directory is verified in place (a check only: its files may change right after).
    """
    p = Path(path)
    try:
        st = os.stat(p)
    except OSError as exc:
        raise InputError(f"bundle {q(p)} not found: {exc.strerror}",
                         hint="pass a bundle directory or its .tar.zst archive") from exc
    if stat.S_ISDIR(st.st_mode):
        vb = _verify_dir(p, keys_dir, staging=staging, workers=workers, progress=progress)
    elif stat.S_ISREG(st.st_mode):
        vb = _verify_archive(p, keys_dir, staging=staging, progress=progress)
    else:
        raise InputError(f"{q(p)} is neither a bundle directory nor an archive file")
    if expect_id is not None and vb.bundle_id != expect_id:
        vb.cleanup()
        raise reject("bundle-id-mismatch", f"bundle {q(p)} is {vb.bundle_id}, expected {expect_id}")
    return vb


def _read_small(path: Path, limit: int, missing_reason: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError as exc:
        raise reject(missing_reason, f"{q(path.name)} is missing from the bundle {q(path.parent)}",
                     path=path.name) from exc
    except OSError as exc:
        if os.path.islink(path):
            raise reject("symlink", f"{q(path.name)} in the bundle is a symlink", path=path.name) from exc
        raise InputError(f"cannot read {q(path)}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise reject(_special_reason(st.st_mode), f"{q(path.name)} in the bundle is not a regular file",
                         path=path.name)
        # read once into memory, and those bytes are what is checked and used: other names do not matter
        if st.st_size > limit:
            reason = "manifest-too-large" if path.name == MANIFEST_NAME else "signature-malformed"
            raise reject(reason, f"{q(path.name)} is {st.st_size} bytes (limit {limit})", path=path.name)
        data = bytearray()
        while len(data) <= limit and (b := os.read(fd, limit + 1 - len(data))):
            data += b
        if len(data) > limit:
            raise reject("manifest-too-large" if path.name == MANIFEST_NAME else "signature-malformed",
                         f"{q(path.name)} grew beyond {limit} bytes while being read", path=path.name)
        return bytes(data)
    finally:
        os.close(fd)


def _special_reason(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device-node"
    if stat.S_ISFIFO(mode):
        return "fifo"
    return "special-file"


def _verify_dir(root: Path, keys_dir: str | os.PathLike[str], *, staging: str | os.PathLike[str] | None,
                workers: int | None, progress: ProgressFn | None) -> VerifiedBundle:
    mbytes = _read_small(root / MANIFEST_NAME, MAX_MANIFEST_BYTES, "manifest-missing")
    sbytes = _read_small(root / SIGNATURE_NAME, MAX_SIGNATURE_BYTES, "signature-missing")
    key_id = verify_signature(mbytes, sbytes, keys_dir)
    fault("signature-checked")
    manifest = Manifest.from_bytes(mbytes)
    expected = manifest.by_path()
    needed_dirs = {str(p) for f in manifest.files for p in PurePosixPath(f.path).parents} - {"."}
    found: dict[str, os.stat_result] = {}

    def walk(d: Path, rel: str) -> None:
        with os.scandir(d) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            name = f"{rel}{e.name}"
            st = e.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                if name not in needed_dirs:
                    raise reject("extra-file", f"bundle has an unexpected directory {q(name)}/", path=name)
                walk(Path(e.path), name + "/")
                continue
            if not stat.S_ISREG(st.st_mode):
                raise reject(_special_reason(st.st_mode), f"bundle entry {q(name)} is a "
                             f"{_special_reason(st.st_mode).replace('-', ' ')}, not a regular file", path=name)
            if rel == "" and e.name in RESERVED_NAMES:
                continue
            if name not in expected:
                raise reject("extra-file", f"bundle has a file the MANIFEST does not list: {q(name)}", path=name)
            found[name] = st

    try:
        walk(root, "")
    except OSError as exc:
        raise InputError(f"cannot read bundle {q(root)}: {exc}") from exc
    missing = sorted(set(expected) - set(found))
    if missing:
        raise reject("missing-file", f"bundle lacks {len(missing)} file(s) the MANIFEST lists: "
                     f"{', '.join(missing[:5])}", path=missing[0])
    if staging is not None:
        dest = Path(staging)
        try:
            dest.mkdir(mode=0o700)
        except FileExistsError as exc:
            raise InputError(f"staging directory {dest} already exists",
                             hint="pass a path that does not exist yet") from exc
        try:
            _copy_verified(root, dest, manifest, mbytes, sbytes, workers=workers, progress=progress)
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
        return VerifiedBundle(dest, manifest, key_id, root, extracted=True)
    for f in manifest.files:
        st = found[f.path]
        if st.st_size != f.size:
            raise reject("size-mismatch", f"{q(f.path)}: size {st.st_size}, MANIFEST says {f.size}", path=f.path)
        if stat.S_IMODE(st.st_mode) != f.mode:
            raise reject("mode-mismatch", f"{q(f.path)}: mode {stat.S_IMODE(st.st_mode):04o}, MANIFEST says "
                         f"{f.mode:04o}", path=f.path)
    hashes = hash_files([root / f.path for f in manifest.files], workers=workers, progress=progress,
                        follow_symlinks=False, phase="verifying")
    for f in manifest.files:
        actual = hashes[root / f.path]
        if actual != f.sha256:
            raise reject("hash-mismatch", f"{q(f.path)}: SHA-256 {actual[:16]}..., MANIFEST says {f.sha256[:16]}...",
                         path=f.path, hint="the file was changed after signing; fetch the bundle again")
    return VerifiedBundle(root, manifest, key_id, root)


def _copy_verified(root: Path, dest: Path, manifest: Manifest, mbytes: bytes, sbytes: bytes, *,
                   workers: int | None, progress: ProgressFn | None) -> None:
    """Copy every file the MANIFEST lists from `root` into the private `dest`, each hashed from the bytes that
    were written; MANIFEST and MANIFEST.sig are written from the bytes whose signature was checked."""
    for fname, data in ((MANIFEST_NAME, mbytes), (SIGNATURE_NAME, sbytes)):
        fd = os.open(dest / fname, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    for d in sorted({str(p) for f in manifest.files for p in PurePosixPath(f.path).parents} - {"."}):
        (dest / d).mkdir(mode=0o755)
    counter = ByteCounter(progress, "verifying", manifest.total_size)
    with ThreadPoolExecutor(max_workers=workers or max(1, os.cpu_count() or 1),
                            thread_name_prefix="bundle-copy") as pool:
        futs = [pool.submit(_copy_checked, root / f.path, dest / f.path, f, counter) for f in manifest.files]
        for fut in futs:
            fut.result()


def _copy_checked(src: Path, dst: Path, fe: FileEntry, counter: ByteCounter) -> None:
    """One file of a bundle directory into the staging copy: opened without following links, checked as a
    regular file with the MANIFEST's size and mode, copied, and the SHA-256 of the bytes written compared."""
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError as exc:
        raise reject("missing-file", f"bundle lacks {fe.path} (it went away while being read)",
                     path=fe.path) from exc
    except OSError as exc:
        if os.path.islink(src):
            raise reject("symlink", f"bundle entry {fe.path} is a symlink, not a regular file", path=fe.path) from exc
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise reject(_special_reason(st.st_mode), f"bundle entry {fe.path} is a "
                         f"{_special_reason(st.st_mode).replace('-', ' ')}, not a regular file", path=fe.path)
        # other names of the file do not matter: what is kept is the copy, hashed from the bytes as written
        if stat.S_IMODE(st.st_mode) != fe.mode:
            raise reject("mode-mismatch", f"{fe.path}: mode {stat.S_IMODE(st.st_mode):04o}, MANIFEST says "
                         f"{fe.mode:04o}", path=fe.path)
        size, sha = copy_hashed(fd, dst, fe.mode, limit=fe.size, counter=counter)
    finally:
        os.close(fd)
    if size != fe.size:
        raise reject("size-mismatch", f"{fe.path}: size {size}, MANIFEST says {fe.size}", path=fe.path)
    if sha != fe.sha256:
        raise reject("hash-mismatch", f"{fe.path}: SHA-256 {sha[:16]}..., MANIFEST says {fe.sha256[:16]}...",
                     path=fe.path, hint="the file was changed after signing; fetch the bundle again")


def copy_hashed(fd: int, dst: Path, mode: int, *, limit: int, counter: ByteCounter | None = None) -> tuple[int, str]:
    """Copy the open file `fd` into the new file `dst` (at most `limit` + 1 bytes: a grown file is seen as such)
    and return (bytes written, SHA-256 of exactly those bytes). The one place a bundle's bytes are hashed as
    they are laid down."""
    buf, mv = read_buffer()

    def chunks() -> Iterator[memoryview]:
        size = 0
        while size <= limit:
            n = os.readv(fd, [buf])
            if not n:
                return
            size += n
            if counter is not None:
                counter.add(n)
            yield mv[:n]

    out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        sha, size = sha256_chunks(chunks(), sink=write_all(out))
        os.fchmod(out, mode)
    finally:
        os.close(out)
    return size, sha


def _verify_archive(archive: Path, keys_dir: str | os.PathLike[str], *, staging: str | os.PathLike[str] | None,
                    progress: ProgressFn | None) -> VerifiedBundle:
    owned_parent: Path | None = None
    if staging is None:
        owned_parent = Path(tempfile.mkdtemp(prefix="deploytool-bundle-"))
        dest = owned_parent / "bundle"
    else:
        dest = Path(staging)
    ex = SafeExtractor(dest, symlinks=False, max_total=DEFAULT_MAX_TOTAL, max_entries=DEFAULT_MAX_ENTRIES)
    try:
        key_id, manifest = _extract_verified(archive, keys_dir, ex, progress)
    except BaseException:
        ex.remove()
        if owned_parent is not None:
            shutil.rmtree(owned_parent, ignore_errors=True)
        raise
    return VerifiedBundle(dest, manifest, key_id, archive, extracted=True,
                          _owned=owned_parent if owned_parent is not None else None)


def _extract_verified(archive: Path, keys_dir: str | os.PathLike[str], ex: SafeExtractor,
                      progress: ProgressFn | None) -> tuple[str, Manifest]:
    total = os.stat(archive).st_size
    counter = ByteCounter(progress, "verifying", total)
    with open_tar_stream(archive) as stream:
        reader = TarReader(stream, what=str(archive))
        it = iter(reader)
        head: dict[str, bytes] = {}
        for want, limit in ((MANIFEST_NAME, MAX_MANIFEST_BYTES), (SIGNATURE_NAME, MAX_SIGNATURE_BYTES)):
            e = next(it, None)
            if e is None:
                raise reject("manifest-missing" if want == MANIFEST_NAME else "signature-missing",
                             f"archive ends before its {q(want)}")
            ex.check(e)
            if e.name != want or e.kind != "file":
                raise reject("manifest-not-first",
                             f"archive must start with MANIFEST and MANIFEST.sig; found {e.name!r} ({e.kind})",
                             path=e.name)
            if e.size > limit:
                raise reject("manifest-too-large" if want == MANIFEST_NAME else "signature-malformed",
                             f"{q(want)} is {e.size} bytes (limit {limit})")
            head[want] = b"".join(reader.chunks())
        mbytes, sbytes = head[MANIFEST_NAME], head[SIGNATURE_NAME]
        key_id = verify_signature(mbytes, sbytes, keys_dir)
        fault("signature-checked")
        manifest = Manifest.from_bytes(mbytes)
        for fname in (MANIFEST_NAME, SIGNATURE_NAME):
            ex.write(_FileHead(fname, len(head[fname])), [head[fname]], mode=0o644)  # type: ignore[arg-type]
        expected = manifest.by_path()
        needed_dirs = {str(p) for f in manifest.files for p in PurePosixPath(f.path).parents} - {"."}
        for e in it:
            ex.check(e)
            if e.kind == "dir":
                if e.name not in needed_dirs:
                    raise reject("extra-file", f"archive has an unexpected directory {q(e.name)}/", path=e.name)
                ex.write(e, ())
                continue
            fe = expected.get(e.name)
            if fe is None:
                raise reject("extra-file", f"archive has a file the MANIFEST does not list: {q(e.name)}",
                             path=e.name)
            if e.size > fe.size:
                raise reject("entry-too-large", f"archive entry {q(e.name)} is {e.size} bytes, MANIFEST says "
                             f"{fe.size}", path=e.name)
            if e.size != fe.size:
                raise reject("size-mismatch", f"archive entry {q(e.name)} is {e.size} bytes, MANIFEST says "
                             f"{fe.size}", path=e.name)
            if e.mode != fe.mode:
                raise reject("mode-mismatch", f"archive entry {q(e.name)}: mode {e.mode:04o}, MANIFEST says "
                             f"{fe.mode:04o}", path=e.name)
            sha = ex.write(e, reader.chunks(), mode=fe.mode)
            if sha != fe.sha256:
                raise reject("hash-mismatch", f"{q(e.name)}: SHA-256 {sha[:16]}..., MANIFEST says "
                             f"{fe.sha256[:16]}...", path=e.name,
                             hint="the archive was changed after signing; fetch it again")
            if progress is not None:
                counter.done = 0
                counter.add(min(reader.offset, total))
    missing = sorted(set(expected) - ex.files)
    if missing:
        raise reject("missing-file", f"archive lacks {len(missing)} file(s) the MANIFEST lists: "
                     f"{', '.join(missing[:5])}", path=missing[0])
    return key_id, manifest


@dataclass(frozen=True)
class _FileHead:
    name: str
    size: int
    kind: str = "file"
    mode: int = 0o644
    target: str = ""


__all__ = ["Entry", "BundleInfo", "VerifiedBundle", "write_bundle", "verify_bundle", "ARCHIVE_SUFFIXES"]
