"""The host side of deploytool.fleet.ship, in plain Python 3 (the host may have no deploytool yet).

A host keeps shipped bundles at DEST/<release>/ (release = the MANIFEST's bundle id). To ship a release:

  prepare(dest, manifest)   which files of the MANIFEST the host already has, by SHA-256, in the bundles under
                            DEST (each checked before it is trusted: see TrustCache); a staging directory
                            DEST/.incoming-<release>-<random> seeded with every file it has, as a hard link to
                            the earlier bundle's or a local copy (link: True links, False copies, None links
                            between bundles of MANIFEST format 2 and copies otherwise: deploytool 0.1.0 may
                            refuse a bundle file with other links, and reads format 1 only); the list
                            of the missing ones.
  (the controller sends the missing files into the staging directory with rsync)
  ship(dest, manifest, inline, ...)
                            prepare with the small files the controller sent along in the same call (`inline`,
                            {path: bytes}): those the host lacks are written into the staging directory, and when
                            nothing else is missing the commit follows at once. A release a few small files apart
                            (a rebuilt pure-Python wheel, the lock, the units) then takes one module call and no
                            rsync; otherwise it returns what is still missing, as prepare does.
  commit(dest, staging, manifest, ...)
                            EVERY file of the staging directory checked against the MANIFEST (no extra or missing
                            file, size, mode, SHA-256), then MANIFEST and MANIFEST.sig written and the directory
                            renamed to DEST/<release> in one rename; older bundles beyond `keep` removed.
  abort(dest, staging)      the staging directory removed (a failed transfer).

Nothing unverified is ever at DEST/<release>: a failure leaves neither it (unless an earlier, verified copy was
there) nor the staging directory. The MANIFEST signature is NOT checked here: that stays with deploytool's install
and bootstrap on the host, which verify the signature against the box's trusted keys before anything is used.

Trust of files already on the host (TrustCache): re-hashing every earlier bundle at each ship is the honest way
and costs a full read of them (see bench/bench_ship.py: `rehash`). By default a file is trusted without re-reading
it when its (device, inode, size, mtime_ns, ctime_ns) are exactly those recorded when this code last hashed it (or
linked it right after trusting it) and its ctime was at least RACY_NS older than that record. That is safe
against everything but a root user bent on it or the disk itself: any write, truncate, chmod, rename-over or
re-link of the file moves its ctime to the current time, and no system call sets ctime (utimensat sets atime and
mtime and moves ctime to now); a file replaced by another gets another inode (or the same number with a new ctime).
The RACY_NS margin covers the coarse clock of file timestamps (a write in the same clock tick as the record would
leave ctime unchanged): a record is only used for a file whose ctime is clearly older than the record. What is not
covered: silent corruption below the file system (bit rot, a raw write to the block device) and a root user who
resets the clock; `rehash: true` re-reads everything for those. With `link`, removing a bundle moves the ctime of
the files it shared with the kept ones; their records are carried across the removal when, under the lock, their
(device, inode, size, mtime_ns, mode, owner) are unchanged and only their link count fell: there only a root user
who rewrites a file in that moment and sets its mtime back goes unseen.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import stat
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

MANIFEST_NAME = "MANIFEST"
SIGNATURE_NAME = "MANIFEST.sig"
RESERVED = (MANIFEST_NAME, SIGNATURE_NAME)
STAGING_PREFIX = ".incoming-"
TRASH_PREFIX = ".outgoing-"
TRUST_FILE = ".ship-trust.json"
LOCK_FILE = ".ship.lock"
STALE_SECONDS = 6 * 3600  # a staging directory untouched this long was left by a killed ship: removed
RACY_NS = 100_000_000  # 100 ms: well above the file-timestamp clock tick (1-10 ms)
CHUNK = 1 << 20
FILE_MODES = (0o644, 0o755)

_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_HEXID = re.compile(r"[0-9a-f]{16}\Z")
_MODE = re.compile(r"0[0-7]{3}\Z")
_BAD = re.compile(r"[\x00-\x1f\x7f\\]")
_TOP = frozenset(("format_version", "bundle_id", "created", "inputs", "files", "native_libs"))
_FILE = frozenset(("path", "size", "mode", "sha256"))


class ShipError(Exception):
    """A ship step refused or failed; the message names the file and what is wrong. `reason` is a stable slug."""

    def __init__(self, message, reason="error", path=None):
        Exception.__init__(self, message)
        self.reason = reason
        self.path = path


# ------------------------------------------------------------------------------------------- manifest

class Entry:
    __slots__ = ("path", "size", "mode", "sha256")

    def __init__(self, path, size, mode, sha256):
        self.path, self.size, self.mode, self.sha256 = path, size, mode, sha256

    def __repr__(self):
        return "Entry(%r, %d, %04o, %s)" % (self.path, self.size, self.mode, self.sha256[:12])


class Manifest:
    """The parts of a deploytool bundle MANIFEST that shipping needs, read strictly enough to be safe: every path
    clean and relative, sizes, modes and hashes well-formed, the bundle id the hash of the content (as
    deploy_tool/manifest.py computes it), so a MANIFEST that was edited is refused here too."""

    def __init__(self, raw, bundle_id, files, format_version=1):
        self.raw = raw
        self.bundle_id = bundle_id
        self.files = files
        self.format_version = format_version

    @property
    def total_size(self):
        return sum(e.size for e in self.files)

    def by_path(self):
        return dict((e.path, e) for e in self.files)


def _is_int(v):
    """An int and not a bool (JSON's true is not a size, a mode or a version)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _canonical(obj, indent):
    seps = (",", ": ") if indent is not None else (",", ":")
    return (json.dumps(obj, sort_keys=True, ensure_ascii=True, allow_nan=False, indent=indent, separators=seps)
            + "\n").encode("ascii")


def check_relpath(path):
    if not isinstance(path, str) or not path:
        raise ShipError("MANIFEST: a file path is empty or not a string", "bad-path")
    parts = path.split("/")
    if path.startswith("/") or ".." in parts or "" in parts or "." in parts or _BAD.search(path):
        raise ShipError("MANIFEST: %r is not a clean relative path" % (path,), "bad-path", path)
    if path in RESERVED:
        raise ShipError("MANIFEST: %r is reserved for the manifest itself" % (path,), "bad-path", path)
    return path


def parse_manifest(raw):
    """A Manifest from the MANIFEST's bytes (or text); ShipError naming what is wrong."""
    if isinstance(raw, str):
        raw = raw.encode("ascii", "strict")
    try:
        obj = json.loads(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ShipError("MANIFEST is not valid JSON: %s" % exc, "manifest-malformed") from None
    if not isinstance(obj, dict) or set(obj) != _TOP:
        raise ShipError("MANIFEST is not a deploytool bundle manifest (keys %s)"
                        % sorted(obj) if isinstance(obj, dict) else "MANIFEST is not a JSON object",
                        "manifest-malformed")
    if not _is_int(obj["format_version"]) or obj["format_version"] not in (1, 2):
        raise ShipError("MANIFEST format_version %r is not supported (this collection reads 1 and 2)"
                        % (obj["format_version"],), "format-version-unsupported")
    bid = obj["bundle_id"]
    if not isinstance(bid, str) or not _HEXID.match(bid):
        raise ShipError("MANIFEST bundle_id %r is not 16 hex digits" % (bid,), "manifest-malformed")
    if not isinstance(obj["files"], list) or not isinstance(obj["native_libs"], dict) \
            or not isinstance(obj["inputs"], dict):
        raise ShipError("MANIFEST files/inputs/native_libs have the wrong types", "manifest-malformed")
    files = []
    seen = set()
    prev = None
    for i, rf in enumerate(obj["files"]):
        if not isinstance(rf, dict) or set(rf) != _FILE:
            raise ShipError("MANIFEST files[%d] is not {path, size, mode, sha256}" % i, "manifest-malformed")
        path = check_relpath(rf["path"])
        if prev is not None and path < prev:
            # deploytool writes them sorted and installs nothing else: refused here before anything is laid down
            raise ShipError("MANIFEST files are not sorted by path at %s (deploytool writes and reads them sorted)"
                            % path, "manifest-malformed", path)
        prev = path
        size, mode_s, sha = rf["size"], rf["mode"], rf["sha256"]
        if not _is_int(size) or size < 0:
            raise ShipError("MANIFEST %s: size %r is not a non-negative integer" % (path, size), "manifest-malformed",
                            path)
        if not isinstance(mode_s, str) or not _MODE.match(mode_s) or int(mode_s, 8) not in FILE_MODES:
            raise ShipError("MANIFEST %s: mode %r is not '0644' or '0755'" % (path, mode_s), "manifest-malformed",
                            path)
        if not isinstance(sha, str) or not _HEX64.match(sha):
            raise ShipError("MANIFEST %s: sha256 is not 64 lowercase hex digits" % path, "manifest-malformed", path)
        if path in seen:
            raise ShipError("MANIFEST lists %s twice" % path, "manifest-malformed", path)
        seen.add(path)
        files.append(Entry(path, size, int(mode_s, 8), sha))
    for e in files:
        parts = e.path.split("/")
        for k in range(1, len(parts)):
            if "/".join(parts[:k]) in seen:
                raise ShipError("MANIFEST: %s is a file and also the directory of %s" % ("/".join(parts[:k]), e.path),
                                "manifest-malformed", e.path)
    body = {"format_version": obj["format_version"], "files": sorted(obj["files"], key=lambda f: f["path"]),
            "inputs": obj["inputs"], "native_libs": obj["native_libs"]}
    expected = hashlib.sha256(_canonical(body, None)).hexdigest()[:16]
    if expected != bid:
        raise ShipError("MANIFEST bundle_id %s does not match its content (%s): the MANIFEST was altered"
                        % (bid, expected), "bundle-id-mismatch")
    return Manifest(raw, bid, files, obj["format_version"])


def read_manifest(bundle_dir):
    p = os.path.join(bundle_dir, MANIFEST_NAME)
    try:
        with open(p, "rb") as f:
            raw = f.read(64 << 20)
    except OSError as exc:
        raise ShipError("cannot read %s: %s" % (p, exc.strerror), "manifest-missing", p) from None
    return parse_manifest(raw)


# ------------------------------------------------------------------------------------------- hashing

def sha256_path(path, fsync=False):
    """SHA-256 of a regular file, opened without following a symlink; optionally fsync'd while open."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ShipError("%s is not a regular file" % path, "special-file", path)
        h = hashlib.sha256()
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while True:
            n = os.readv(fd, [buf])
            if not n:
                break
            h.update(view[:n])
        if fsync:
            os.fsync(fd)
        return h.hexdigest()
    finally:
        os.close(fd)


def _workers():
    return max(1, min(4, os.cpu_count() or 1))


# ------------------------------------------------------------------------------------------- trust cache

class TrustCache:
    """(dev, ino) -> (size, mtime_ns, ctime_ns, sha256, recorded_ns), kept in DEST/.ship-trust.json (see the
    module doc for why a match is a safe stand-in for re-reading the file)."""

    def __init__(self, dest, enabled=True):
        self.path = os.path.join(dest, TRUST_FILE)
        self.enabled = enabled
        self.map = {}
        self.hashed_bytes = 0
        self.hashed_files = 0
        self.trusted_files = 0
        if enabled:
            with contextlib.suppress(OSError, ValueError, TypeError):
                with open(self.path) as f:
                    data = json.load(f)
                if isinstance(data, dict):
                    for k, v in data.items():
                        if isinstance(v, list) and len(v) == 5:
                            self.map[k] = v

    @staticmethod
    def key(st):
        return "%d:%d" % (st.st_dev, st.st_ino)

    def lookup(self, st):
        """The recorded SHA-256 of the file with this stat, or None when the record does not vouch for it."""
        if not self.enabled:
            return None
        rec = self.map.get(self.key(st))
        if rec is None:
            return None
        size, mtime_ns, ctime_ns, sha, at = rec
        if (size, mtime_ns, ctime_ns) != (st.st_size, st.st_mtime_ns, st.st_ctime_ns):
            return None
        if st.st_ctime_ns > at - RACY_NS:
            return None  # changed in the same clock tick as the record: cannot tell a later write
        return sha

    def record(self, st, sha, now_ns=None):
        self.map[self.key(st)] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, sha,
                                  now_ns if now_ns is not None else time.time_ns()]

    def save(self, keep_keys=None):
        if not self.enabled:
            return
        data = self.map if keep_keys is None else dict((k, v) for k, v in self.map.items() if k in keep_keys)
        tmp = "%s.%s.tmp" % (self.path, uuid.uuid4().hex[:8])
        try:
            with open(tmp, "w") as f:
                json.dump(data, f, separators=(",", ":"))
            os.replace(tmp, self.path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def digest(self, path, st, fsync=False):
        """SHA-256 of `path` (whose lstat is `st`): from the record when it vouches for the file, else read."""
        sha = self.lookup(st)
        if sha is not None:
            self.trusted_files += 1
            return sha
        sha = sha256_path(path, fsync=fsync)
        self.hashed_files += 1
        self.hashed_bytes += st.st_size
        st2 = os.lstat(path)
        if (st2.st_ino, st2.st_size, st2.st_mtime_ns, st2.st_ctime_ns) == \
                (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns):
            self.record(st2, sha)
        return sha


# ------------------------------------------------------------------------------------------- the steps

def _check_dest(dest):
    if not isinstance(dest, str) or not os.path.isabs(dest):
        raise ShipError("dest must be an absolute path, got %r" % (dest,), "bad-dest")
    return os.path.normpath(dest)


@contextlib.contextmanager
def locked(dest):
    """An exclusive lock on DEST/.ship.lock: two ships to one host take turns for prepare and commit."""
    fd = os.open(os.path.join(dest, LOCK_FILE), os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def bundle_dirs(dest):
    """Shipped bundles under DEST (directories holding a MANIFEST, not staging), newest first (by mtime)."""
    out = []
    try:
        names = os.listdir(dest)
    except FileNotFoundError:
        return []
    for name in names:
        if name.startswith("."):
            continue
        p = os.path.join(dest, name)
        with contextlib.suppress(OSError):
            st = os.lstat(p)
            if stat.S_ISDIR(st.st_mode) and os.path.isfile(os.path.join(p, MANIFEST_NAME)):
                out.append((st.st_mtime_ns, name, p))
    out.sort(reverse=True)
    return [p for _mtime, _name, p in out]


def _mkparents(root, rel):
    d = os.path.dirname(rel)
    if d:
        os.makedirs(os.path.join(root, d), mode=0o755, exist_ok=True)


def _part_name(path):
    """A random name beside `path` to write it through, which no MANIFEST can know in advance: a file placed
    earlier in this staging directory (say "a.part" before "a") is never written over."""
    return "%s.part-%s" % (path, uuid.uuid4().hex[:12])


def _write_through(dst, mode, write):
    """`dst` with `mode`, written by `write(fd)` into a new file at a random name beside it and renamed into place.
    The file is created 0600, so no other user can open it while it is written, whatever the umask; a copy is
    reached by another user only once it is whole and has its mode, and a write through an fd opened earlier is
    not possible."""
    tmp = _part_name(dst)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                 | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        write(fd)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    os.rename(tmp, dst)


def _copy_into(src, fd):
    with open(src, "rb") as f:
        size, off = os.fstat(f.fileno()).st_size, 0
        while off < size:
            n = os.sendfile(fd, f.fileno(), off, size - off)
            if not n:
                raise ShipError("%s shrank while it was copied" % src, "size-mismatch", src)
            off += n


def _write_all(data, fd, fsync=False):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    if fsync:
        os.fsync(fd)


def _check_keep(keep):
    if not _is_int(keep) or keep < 1:
        raise ShipError("keep must be an integer of at least 1, got %r" % (keep,), "bad-keep")


def _place(src, dst, mode, link=False):
    """Put trusted file `src` at `dst` with `mode`: a local copy, nothing over the network. With `link`, a hard link
    to `src` instead where it already has that mode and belongs to this user (root), so kept bundles share it; a
    copy where the file system refuses the link (which of the two, `prepare` decides: `_link_wanted`). Returns
    whether it is a link.

    A link is safe because nothing writes a shipped bundle's files: rsync writes only the missing files, each to a
    temporary name renamed into place; commit writes only MANIFEST and MANIFEST.sig, as new files; removing a bundle
    removes its names, not the inodes the others still name. deploytool's install copies each file into a private
    staging directory and hashes the bytes as it writes them."""
    if link:
        st = os.lstat(src)
        if stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == mode and st.st_uid == os.geteuid():
            tmp = _part_name(dst)
            try:
                os.link(src, tmp, follow_symlinks=False)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP):
                    raise
            else:
                os.rename(tmp, dst)
                return True
    _write_through(dst, mode, lambda fd: _copy_into(src, fd))
    return False


def _link_wanted(link, manifest, source_format):
    """Whether a file the host has goes into the new bundle as a hard link: `link` when given; else (None) when both
    the new bundle and the one the file comes from are of MANIFEST format 2 or later. Only deploytool 0.2.0 or later
    reads format 2 (0.1.0 refuses such a bundle by its format, before it looks at any file), and every such
    deploytool installs a bundle file that has other links; a format-1 bundle may still be installed by deploytool
    0.1.0, which may refuse a linked file, so its files gain no links unless asked."""
    if link is not None:
        return link
    return manifest.format_version >= 2 and source_format >= 2


def _have(dest, manifest, cache, skip=None):
    """{sha256: (path on the host, mode, the MANIFEST format of its bundle)} of the files the host has that the
    MANIFEST needs, each checked (by the trust cache or read) before it is believed; plus how many candidates were
    refused (tampered or gone). A format-2 bundle's copy is taken before a format-1 one's (it may be linked)."""
    need = set(e.sha256 for e in manifest.files)
    cands = {}
    for bdir in bundle_dirs(dest):
        if skip and bdir == skip:
            continue
        try:
            m = read_manifest(bdir)
        except ShipError:
            continue  # not a bundle we can read: nothing of it is reused
        for e in m.files:
            if e.sha256 in need:
                cands.setdefault(e.sha256, []).append((os.path.join(bdir, e.path), e, m.format_version))
    for found_in in cands.values():
        found_in.sort(key=lambda c: -c[2])  # stable: newest bundle first within a format
    found = {}
    refused = []

    def check(sha):
        for path, e, fmt in cands[sha]:
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_size != e.size:
                refused.append(path)
                continue
            try:
                if cache.digest(path, st) == sha:
                    return sha, (path, stat.S_IMODE(st.st_mode), fmt)
            except (OSError, ShipError):
                pass
            refused.append(path)
        return sha, None

    with ThreadPoolExecutor(_workers()) as pool:
        for sha, hit in pool.map(check, sorted(cands)):
            if hit is not None:
                found[sha] = hit
    return found, sorted(refused)


def _verify_tree(root, manifest, cache, fsync_new=False, allow_manifest=True):
    """Check every file under `root` against `manifest`: no extra file or directory, no missing file, no symlink or
    special file, each size, mode and SHA-256. ShipError naming the first bad file."""
    want = manifest.by_path()
    dirs = set()
    for e in manifest.files:
        parts = e.path.split("/")
        for k in range(1, len(parts)):
            dirs.add("/".join(parts[:k]))
    seen = {}
    for top, dnames, fnames in os.walk(root):
        rel_top = os.path.relpath(top, root)
        rel_top = "" if rel_top == "." else rel_top + "/"
        for dn in dnames:
            rel = rel_top + dn
            st = os.lstat(os.path.join(top, dn))
            if stat.S_ISLNK(st.st_mode):
                raise ShipError("%s is a symlink, the MANIFEST lists no such thing" % rel, "extra-file", rel)
            if rel not in dirs:
                raise ShipError("%s is a directory the MANIFEST does not list" % rel, "extra-file", rel)
        for fn in fnames:
            rel = rel_top + fn
            p = os.path.join(top, fn)
            st = os.lstat(p)
            if allow_manifest and rel in RESERVED and stat.S_ISREG(st.st_mode):
                continue
            e = want.get(rel)
            if e is None:
                raise ShipError("%s is not in the MANIFEST (extra file)" % rel, "extra-file", rel)
            if not stat.S_ISREG(st.st_mode):
                raise ShipError("%s is not a regular file" % rel, "special-file", rel)
            if st.st_size != e.size:
                raise ShipError("%s is %d bytes, the MANIFEST says %d" % (rel, st.st_size, e.size), "size-mismatch",
                                rel)
            if stat.S_IMODE(st.st_mode) != e.mode:
                raise ShipError("%s has mode %04o, the MANIFEST says %04o" % (rel, stat.S_IMODE(st.st_mode), e.mode),
                                "mode-mismatch", rel)
            seen[rel] = (p, st, e)
    missing = sorted(set(want) - set(seen))
    if missing:
        raise ShipError("%s is missing (%d file(s) of the MANIFEST are not there)" % (missing[0], len(missing)),
                        "missing-file", missing[0])

    # Files changed within the last clock tick (rsync just wrote them) are hashed only once that tick is over: a
    # write after the hash then shows in ctime, so the record taken with the hash can vouch for them later.
    fresh = [st.st_ctime_ns for p, st, e in seen.values() if cache.enabled and cache.lookup(st) is None]
    if fresh:
        wait = max(fresh) + RACY_NS + 1_000_000 - time.time_ns()
        if wait > 0:
            time.sleep(wait / 1e9)

    def check(item):
        rel, (p, st, e) = item
        return rel, cache.digest(p, st, fsync=fsync_new and cache.lookup(st) is None), e.sha256

    bad = []
    with ThreadPoolExecutor(_workers()) as pool:
        for rel, got, exp in pool.map(check, sorted(seen.items())):
            if got != exp:
                bad.append(rel)
    if bad:
        raise ShipError("%s does not match the MANIFEST (SHA-256 differs)%s" % (
            bad[0], " and %d more file(s)" % (len(bad) - 1) if len(bad) > 1 else ""), "hash-mismatch", bad[0])


def _refresh(cache, items):
    """Record [(path, sha256, stat or None)] of files trusted a moment ago (copies or links just made; shared files
    whose link count a removal just changed, with the stat seen right after it), under the lock: each is stat'ed now
    (and must still be the given stat, where one is), RACY_NS is waited out once, and a file is recorded only if its
    stat is exactly the same then (a write meanwhile is never recorded as trusted)."""
    if not cache.enabled or not items:
        return
    first = []
    for p, sha, want in items:
        with contextlib.suppress(OSError):
            st = os.lstat(p)
            if want is None or _stat_key(st) == _stat_key(want):
                first.append((p, sha, st))
    time.sleep(RACY_NS / 1e9 * 1.2)
    now = time.time_ns()
    for p, sha, st in first:
        with contextlib.suppress(OSError):
            st2 = os.lstat(p)
            if _stat_key(st2) == _stat_key(st):
                cache.record(st2, sha, now)


def _stat_key(st):
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode, st.st_uid, st.st_nlink)


def _same_signature(final, signature):
    if signature is None:
        return True
    want = signature if isinstance(signature, bytes) else signature.encode("ascii")
    try:
        with open(os.path.join(final, SIGNATURE_NAME), "rb") as f:
            return f.read(1 << 16) == want
    except OSError:
        return False


def _check_inline(manifest, inline):
    """`inline` ({path: bytes}, the files the controller sent along) checked against the MANIFEST's paths and
    sizes; their hashes are checked with every other staged file by the commit."""
    if inline is None:
        return {}
    if not isinstance(inline, dict):
        raise ShipError("inline must map MANIFEST paths to file contents", "bad-inline")
    want = manifest.by_path()
    for path, data in inline.items():
        e = want.get(path)
        if e is None:
            raise ShipError("inline file %r is not in the MANIFEST" % (path,), "bad-inline", path)
        if not isinstance(data, bytes) or len(data) != e.size:
            raise ShipError("inline file %s is %s bytes, the MANIFEST says %d" % (
                path, len(data) if isinstance(data, bytes) else "not", e.size), "size-mismatch", path)
    return inline


def prepare(dest, manifest, check_mode=False, rehash=False, signature=None, link=None, inline=None):
    """Which files the host has, a staging directory seeded with them (not in check mode), and what is missing.

    `inline` ({path: bytes}): files the controller sent along; those the host lacks are written into the staging
    directory (as rsync would) and are not missing.

    Returns a dict: present (the release is already there and verified: nothing to do), staging, missing (paths
    still to send), missing_bytes, inlined (paths written from `inline`), inlined_bytes, reused_files,
    reused_bytes, refused (earlier files that failed their check), basis (earlier bundles for rsync's --copy-dest,
    newest first), hashed_bytes (what had to be read to trust files). In check mode nothing is written and
    missing names every file the host lacks."""
    dest = _check_dest(dest)
    inline = _check_inline(manifest, inline)
    release = manifest.bundle_id
    final = os.path.join(dest, release)
    out = {"release": release, "path": final, "present": False, "staging": None, "missing": [],
           "missing_bytes": 0, "inlined": [], "inlined_bytes": 0, "reused_files": 0, "reused_bytes": 0,
           "linked_files": 0, "refused": [], "basis": [], "hashed_bytes": 0}
    if check_mode and not os.path.isdir(dest):
        out["missing"] = [e.path for e in manifest.files]
        out["missing_bytes"] = manifest.total_size
        return out
    if not check_mode:
        os.makedirs(dest, mode=0o755, exist_ok=True)
    with (locked(dest) if not check_mode else contextlib.nullcontext()):
        # read under the lock: a record another ship saved a moment ago is not lost to this one's save
        cache = TrustCache(dest, enabled=not rehash)
        if not check_mode:
            sweep_stale(dest, cache)
        if os.path.isdir(final):
            try:
                # the same MANIFEST and signature (a bundle signed again, e.g. by a new key, is shipped again:
                # every file is reused, the new MANIFEST.sig replaces the old)
                if read_manifest(final).raw == manifest.raw and _same_signature(final, signature):
                    _verify_tree(final, manifest, cache)
                    out["present"] = True
            except (ShipError, OSError):
                pass  # damaged or different: shipped again, and replaced on commit
            if out["present"]:
                out["reused_files"] = len(manifest.files)
                out["reused_bytes"] = manifest.total_size
                out["hashed_bytes"] = cache.hashed_bytes
                if not check_mode:
                    cache.save()
                return out
        found, refused = _have(dest, manifest, cache)
        out["refused"] = refused
        out["basis"] = bundle_dirs(dest)[:20]
        missing = [e for e in manifest.files if e.sha256 not in found]
        sent = [] if check_mode else [e for e in missing if e.path in inline]  # written below from `inline`
        rest = [e for e in missing if check_mode or e.path not in inline]
        out["missing"] = [e.path for e in rest]
        out["missing_bytes"] = sum(e.size for e in rest)
        out["inlined"] = [e.path for e in sent]
        out["inlined_bytes"] = sum(e.size for e in sent)
        reused = [e for e in manifest.files if e.sha256 in found]
        out["reused_files"] = len(reused)
        out["reused_bytes"] = sum(e.size for e in reused)
        out["hashed_bytes"] = cache.hashed_bytes
        if check_mode:
            return out
        staging = os.path.join(dest, "%s%s-%s" % (STAGING_PREFIX, release, uuid.uuid4().hex[:8]))
        os.mkdir(staging, 0o755)
        try:
            touched = []
            for e in reused:
                src, _mode, fmt = found[e.sha256]
                _mkparents(staging, e.path)
                dst = os.path.join(staging, e.path)
                out["linked_files"] += _place(src, dst, e.mode, link=_link_wanted(link, manifest, fmt))
                touched.append((dst, e.sha256, None))
            # written before the records' wait below (where there is one: files were reused), so the commit then
            # finds them past the clock tick and need not wait again before hashing them
            for e in sent:
                _mkparents(staging, e.path)
                data = functools.partial(_write_all, inline[e.path])
                _write_through(os.path.join(staging, e.path), e.mode, data)
            _refresh(cache, touched)
            cache.save()
        except BaseException:
            _remove_keeping_records(cache, dest, [staging])
            raise
        out["staging"] = staging
        return out


def ship(dest, manifest, inline, signature=None, keep=3, rehash=False, link=None):
    """prepare() with `inline`, then, when nothing is left to send, commit() in the same call: one module call for
    a release whose changed files the controller sent along. Returns prepare's dict with `committed` (and, when
    true, commit's `removed`, `trusted_files` and the hashed bytes of both)."""
    _check_keep(keep)  # before prepare: a refused commit would leave its staging directory
    out = prepare(dest, manifest, rehash=rehash, signature=signature, link=link, inline=inline)
    out["committed"] = False
    if out["present"] or out["missing"]:
        return out
    done = commit(dest, out["staging"], manifest, signature=signature, keep=keep, rehash=rehash)
    out.update(committed=True, staging=None, removed=done["removed"], trusted_files=done["trusted_files"],
               hashed_bytes=out["hashed_bytes"] + done["hashed_bytes"])
    return out


def sweep_stale(dest, cache, older_than=STALE_SECONDS):
    """Remove staging and trash directories that no ship has touched for `older_than` seconds (killed ships), under
    the lock, keeping the trust `cache`'s records of the files they shared with kept bundles."""
    now = time.time()
    swept = []
    for name in os.listdir(dest):
        if name.startswith((STAGING_PREFIX, TRASH_PREFIX)):
            p = os.path.join(dest, name)
            with contextlib.suppress(OSError):
                if now - os.lstat(p).st_mtime > older_than:
                    swept.append(p)
    _remove_keeping_records(cache, dest, swept)
    return swept


def _staging_ok(dest, staging, release):
    if not isinstance(staging, str) or os.path.dirname(os.path.normpath(staging)) != dest \
            or not os.path.basename(staging).startswith(STAGING_PREFIX + release + "-"):
        raise ShipError("staging %r is not a staging directory of release %s under %s" % (staging, release, dest),
                        "bad-staging")
    return os.path.normpath(staging)


def abort(dest, staging, release):
    dest = _check_dest(dest)
    staging = _staging_ok(dest, staging, release)
    with locked(dest):
        cache = TrustCache(dest)
        _remove_keeping_records(cache, dest, [staging])
        cache.save()
    return {"removed": staging}


def _remove_keeping_records(cache, dest, trees):
    """Remove `trees` (bundles, staging or trash directories) under the lock. A file one of them shares with a kept
    bundle (ship with link) loses a name there, which moves its ctime and so voids its record: the kept bundles'
    trusted shared files are recorded again when nothing but their link count changed. Without links, nothing is
    shared and this is rmtree. (A failed commit removes its staging directory with a plain rmtree, after the lock:
    the records of what it shared are lost, and the next ship reads those files once to trust them again.)"""
    shared = _trusted_shared(cache, [d for d in bundle_dirs(dest) if d not in trees])  # the kept ones
    for t in trees:
        shutil.rmtree(t, ignore_errors=True)
    moved = []
    for p, st, sha in shared:
        now = _lost_a_link(p, st)
        if now is not None:
            moved.append((p, sha, now))
    _refresh(cache, moved)


def commit(dest, staging, manifest, signature=None, keep=3, rehash=False):
    """Verify the staging directory against the MANIFEST, write MANIFEST (+ MANIFEST.sig), rename it to
    DEST/<release>, remove older bundles beyond `keep`. The staging directory is gone afterwards, also on failure.
    Returns {path, removed (older bundles), hashed_bytes, trusted_files}."""
    dest = _check_dest(dest)
    release = manifest.bundle_id
    staging = _staging_ok(dest, staging, release)
    final = os.path.join(dest, release)
    _check_keep(keep)
    cache = None
    try:
        if not os.path.isdir(staging):
            raise ShipError("staging directory %s is gone" % staging, "bad-staging")
        with locked(dest):
            cache = TrustCache(dest, enabled=not rehash)  # read under the lock, as prepare does
            _verify_tree(staging, manifest, cache, fsync_new=True, allow_manifest=False)
            for name, data in ((MANIFEST_NAME, manifest.raw), (SIGNATURE_NAME, signature)):
                if data is None:
                    continue
                raw = data if isinstance(data, bytes) else data.encode("ascii")
                _write_through(os.path.join(staging, name), 0o644, functools.partial(_write_all, raw, fsync=True))
            dfd = os.open(staging, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
            trash = None
            if os.path.lexists(final):
                trash = os.path.join(dest, "%s%s-%s" % (TRASH_PREFIX, release, uuid.uuid4().hex[:8]))
                os.rename(final, trash)
            os.rename(staging, final)
            os.utime(final)  # newest: `keep` counts from it
            doomed = []
            if trash:
                if os.path.isdir(trash) and not os.path.islink(trash):
                    doomed.append(trash)
                else:
                    os.unlink(trash)  # a file or link where the release directory belongs
            # removing a bundle removes its names: a file it shares with a kept one (link) stays, with its bytes
            removed = bundle_dirs(dest)[keep:]
            _remove_keeping_records(cache, dest, doomed + removed)
            live = set()
            for bdir in bundle_dirs(dest):
                live.update(_inodes(bdir))
            cache.save(keep_keys=live)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {"path": final, "removed": removed, "hashed_bytes": cache.hashed_bytes,
            "trusted_files": cache.trusted_files}


def _trusted_shared(cache, dirs):
    """[(path, lstat, sha256)] of the files under `dirs` that have other links and whose record vouches for them."""
    out = []
    for bdir in dirs:
        for top, _dirs, fnames in os.walk(bdir):
            for fn in fnames:
                p = os.path.join(top, fn)
                with contextlib.suppress(OSError):
                    st = os.lstat(p)
                    sha = cache.lookup(st) if st.st_nlink > 1 else None
                    if sha is not None:
                        out.append((p, st, sha))
    return out


def _lost_a_link(path, st):
    """The stat of `path` now when it is still the inode of `st` (trusted before a removal) with the same size,
    mtime, mode and owner and fewer links, else None. Only root could change its bytes meanwhile and set the mtime
    back (the ctime moved with the link count, so it cannot tell); the module doc's limits say so."""
    try:
        now = os.lstat(path)
    except OSError:
        return None
    same = (now.st_dev, now.st_ino, now.st_size, now.st_mtime_ns, now.st_mode, now.st_uid) == \
        (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode, st.st_uid)
    return now if same and now.st_nlink < st.st_nlink else None


def _inodes(root):
    out = set()
    for top, _dirs, fnames in os.walk(root):
        for fn in fnames:
            with contextlib.suppress(OSError):
                out.add(TrustCache.key(os.lstat(os.path.join(top, fn))))
    return out


# ------------------------------------------------------------------------------------------- rsync (controller)

_STAT_RE = {
    "sent_bytes": re.compile(r"^Total bytes sent: ([\d,.]+)", re.M),
    "literal_bytes": re.compile(r"^Literal data: ([\d,.]+)", re.M),
    "matched_bytes": re.compile(r"^Matched data: ([\d,.]+)", re.M),
    "transferred_files": re.compile(r"^Number of regular files transferred: ([\d,.]+)", re.M),
}


def _num(text):
    return int(text.replace(",", "").replace(".", ""))


def parse_stats(out):
    """rsync --stats figures (sent_bytes, literal_bytes, matched_bytes, transferred_files) from its output."""
    res = {}
    for k, rx in _STAT_RE.items():
        m = rx.search(out)
        if m:
            res[k] = _num(m.group(1))
    return res
