"""A directory tree pinned entry by entry: every file by type, mode, owner and SHA-256, every symlink by its
owner and target string, every directory by its mode and owner, so anything added, removed, changed, retyped,
re-moded or re-owned is a difference.

    walk(root) -> Walk                      every entry below root (root itself is "."), lstat only: symlinks are
                                            never followed, so a link is pinned as a link wherever it points
    value(st, content) -> str               one entry's pinned value:
                                              file 0644 <sha256>      a regular file
                                              link -> <target>        a symlink
                                              dir 0755                a directory
                                              fifo 0644, socket ..., chardev ..., blockdev ...
                                            with the owner after the mode when it is not root's
                                            (`file 0644 1000:1000 <sha256>`, `link 0:5 -> <target>`)
    snapshot_key(walk) -> str               every entry's (ino, ctime_ns, mode, dev) and a CRC of the names:
                                            equal keys mean no entry was added, removed, renamed, written,
                                            chmod-ed or retargeted since (ctime moves on every change to an inode;
                                            hashing's module doc), which is what lets a verify with nothing
                                            changed reuse the last run's values without hashing anything

fingerprint.py uses these for the release (releases/<id>, what `current` points at) and for a venv that lives
outside it (a backend's or deploytool's own).
"""

from __future__ import annotations

import binascii
import os
import stat
from array import array

ROOT = "."
_KINDS = {stat.S_IFIFO: "fifo", stat.S_IFSOCK: "socket", stat.S_IFCHR: "chardev", stat.S_IFBLK: "blockdev"}
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Walk:
    """Entries in walk order: rels[i] (relative to root, "/"-separated) has lstat stats[i]."""

    __slots__ = ("root", "rels", "stats", "errors", "files", "keys", "key")

    def __init__(self, root: str) -> None:
        self.root = root
        self.rels: list[str] = []
        self.stats: list[os.stat_result] = []
        self.errors: dict[str, str] = {}  # rel of a directory that could not be listed: why
        self.files = 0  # how many entries are regular files
        self.keys = array("q")  # (ino, ctime_ns, mode, dev) of every entry
        self.key: str | None = None  # snapshot_key(), once computed

    def path(self, rel: str) -> str:
        return self.root if rel == ROOT else os.path.join(self.root, rel)


def walk(root: str) -> Walk:
    """lstat every entry under `root` (listing each directory through its own fd, so a stat is one lookup)."""
    w = Walk(root)
    try:
        st0 = os.lstat(root)
    except OSError:
        return w  # no root: an empty walk (the caller reports the root as missing)
    w.rels.append(ROOT)
    w.stats.append(st0)
    w.keys.extend((st0.st_ino, st0.st_ctime_ns, st0.st_mode, st0.st_dev))
    if not stat.S_ISDIR(st0.st_mode):
        w.files = int(stat.S_ISREG(st0.st_mode))
        return w
    add_rel, add_stat, key = w.rels.append, w.stats.append, w.keys.extend
    s_isdir, s_isreg = stat.S_ISDIR, stat.S_ISREG
    files = 0
    stack = [("", root)]
    while stack:
        prefix, path = stack.pop()
        try:
            fd = os.open(path, DIR_FLAGS)
        except OSError as exc:
            w.errors[prefix.rstrip("/") or ROOT] = exc.strerror or type(exc).__name__
            continue
        try:
            with os.scandir(fd) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue  # gone between the listing and the stat: as if never there
                    rel = prefix + e.name
                    add_rel(rel)
                    add_stat(st)
                    m = st.st_mode
                    key((st.st_ino, st.st_ctime_ns, m, st.st_dev))
                    if s_isdir(m):
                        stack.append((rel + "/", path + "/" + e.name))
                    elif s_isreg(m):
                        files += 1
        except OSError as exc:
            w.errors[prefix.rstrip("/") or ROOT] = exc.strerror or type(exc).__name__
        finally:
            os.close(fd)
    w.files = files
    return w


def snapshot_key(w: Walk) -> str:
    """The walk's (st_ino, st_ctime_ns, st_mode, st_dev) of every entry in walk order, with a CRC of the names
    and the listing errors, as one string: equal keys mean no entry changed. ctime moves on every change to an
    inode (content, size, mtime, mode, owner, links) and cannot be set by a user; a replaced file has another
    inode; an entry added, removed or renamed changes its directory's ctime. The stat data is compared whole."""
    if w.key is not None:
        return w.key
    names = "\0".join(w.rels).encode("utf-8", "surrogateescape")
    errs = repr(sorted(w.errors.items())).encode("utf-8", "surrogateescape")
    head = f"{len(w.rels)}:{binascii.crc32(names):08x}:{binascii.crc32(errs):08x}:"
    w.key = head + binascii.b2a_base64(w.keys.tobytes(), newline=False).decode("ascii")
    return w.key


def value(st: os.stat_result, content: str = "") -> str:
    """An entry's pinned value; `content` is a file's SHA-256 (or why it could not be read), a link's target.

    The owner (uid:gid) follows the mode when it is not root's 0:0, and is left out when it is: every entry install
    lays down is root's, so a root-owned entry reads as deploytool wrote it before owners were pinned, and pins
    written by a deploytool of either kind verify under the other (the fleet installs a release with the previous
    release's deploytool). Any other owner, or a change of owner, is a different value: drift."""
    m = st.st_mode
    mode = stat.S_IMODE(m)
    own = "" if st.st_uid == 0 and st.st_gid == 0 else f" {st.st_uid}:{st.st_gid}"
    if stat.S_ISREG(m):
        return f"file {mode:04o}{own} {content}"
    if stat.S_ISLNK(m):
        return f"link{own} -> {content}"
    if stat.S_ISDIR(m):
        return f"dir {mode:04o}{own}"
    return f"{_KINDS.get(stat.S_IFMT(m), 'special')} {mode:04o}{own}"


def read_link(w: Walk, rel: str) -> str:
    try:
        return os.readlink(w.path(rel))
    except OSError as exc:
        return f"unreadable ({exc.strerror or type(exc).__name__})"


def inside(path: str, root: str) -> bool:
    """Whether `path` (both real paths) is `root` or below it."""
    return path == root or path.startswith(root.rstrip("/") + "/")
