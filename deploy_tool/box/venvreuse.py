"""The venv parts a new release shares with the current one, taken from it instead of unpacked again.

A format-2 bundle carries the venv as one archive per distribution (deploy_tool.venv), so a release one wheel apart
from the installed one differs in that wheel's part alone. Install used to unpack every part anyway: on the real box
3.7 GB written again, and 3.7 GB more disk, for each such release. Now every install records in the release which
entries each part unpacked to (INDEX), and the next install hard-links the entries of each part whose archive is
the same (the same SHA-256 in both signed MANIFESTs) from the current release, and unpacks only the others.
`_base` is always unpacked, and `python -m venv` runs over the unpacked parts before anything is linked: it writes
some files in place (activate scripts, pyvenv.cfg, the interpreter's names), so a part holding one of those names
fails to link (the name exists) and every part is unpacked.

Why a linked file is as good as an unpacked one: the current release's pins must be the ones its own install
wrote (taken from bytes unpacked out of that release's verified archives; a deliberate `deploytool pin` since, a
hotfix say, or recover's, and nothing is taken), and after linking each file is hashed and must equal that pin,
with the pin's mode (0644 or 0755), root's, without file capabilities (an xattr no pin covers); the index itself
must equal its pin. No path is followed through a symlink, in the current release or in the new one. Any
difference, an entry that is not pinned or not a root-owned file, link or directory, a link that cannot be made
(another file system, a name that exists): the partial venv is dropped and every part is unpacked, as before.

Two releases then share those inodes. A change to one is a change to both, which both pins catch; removing either
leaves the other whole (`deploytool releases` counts a shared file in each). The replaced release's verify cache
misses once on them: a link moves a file's ctime.
"""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from deploy_tool import archive, venv
from deploy_tool.box import fingerprint
from deploy_tool.box.treepin import DIR_FLAGS
from deploy_tool.config import Config
from deploy_tool.errors import DeployError
from deploy_tool.fsutil import atomic_write
from deploy_tool.hashing import open_file, parallel, sha256_bytes, sha256_fd

INDEX = "venv-parts.index.json"
INDEX_FORMAT = 1
INDEX_MAX_BYTES = 256 << 20


class NoReuse(Exception):
    """Why the parts cannot be taken from the current release (install then unpacks every part)."""


@dataclass(frozen=True)
class Donor:
    """The current release, as its pins and its index describe it."""

    rid: str
    root: Path
    entries: dict[str, str]  # its pinned tree: path in the release -> treepin value
    parts: dict[str, tuple[str, list[str]]]  # INDEX: part path -> (its archive's SHA-256, the entries it unpacked)


@dataclass(frozen=True)
class Linked:
    """A file linked into the new venv: its name there, its fstat before it was read, its SHA-256 (the pin's)."""

    name: str
    st: os.stat_result
    sha256: str


def install_reason(rid: str) -> str:
    """The reason install pins a release with (the pins a donor's must carry)."""
    return f"install of release {rid}"


def write_index(release: Path, parts: dict[str, tuple[str, list[str]]]) -> None:
    body = {"format": INDEX_FORMAT, "parts": {p: {"sha256": sha, "names": names}
                                             for p, (sha, names) in sorted(parts.items())}}
    atomic_write(release / INDEX, json.dumps(body, separators=(",", ":")).encode(), 0o644)


def _pinned_file(value: str | None) -> tuple[int, str] | None:
    """(mode, SHA-256) of a treepin value of a root-owned regular file with a mode an unpack gives (`file 0644
    <sha>`, `file 0755 <sha>`), else None."""
    parts = (value or "").split(" ")
    if len(parts) == 3 and parts[0] == "file" and parts[1] in ("0644", "0755") and len(parts[2]) == 64:
        return int(parts[1], 8), parts[2]
    return None


def find_donor(cfg: Config, rid: str) -> Donor:
    """The current release, when it is another than `rid` and its pins and index can be trusted; NoReuse says why
    not."""
    cur = fingerprint.current_release(cfg)
    if cur is None or cur == rid:
        raise NoReuse("no other release is current")
    root = Path(os.path.realpath(cfg.paths.current))
    for name in [cfg.default_backend, *sorted(set(cfg.backends) - {cfg.default_backend})]:
        try:
            ps = fingerprint.load_pins(cfg, name)
        except DeployError:
            continue
        tree = ps.trees.get("release")
        if ps.release == cur and tree is not None and os.path.realpath(tree.root) == str(root):
            break
    else:
        raise NoReuse(f"no pins of release {cur}")
    if ps.reason != install_reason(cur):
        # a deliberate `deploytool pin` (a hotfix, a model change) or recover's: what it blessed is not what the
        # signed archives held, and a release installed from signed archives must not inherit it
        raise NoReuse(f"release {cur} was pinned again since its install ({ps.reason!r})")
    pinned = _pinned_file(tree.entries.get(INDEX))
    if pinned is None:
        raise NoReuse(f"release {cur} has no pinned {INDEX} (installed with --rebuild, from a bundle of format 1, "
                      "or by a deploytool that did not record it)")
    try:
        fd, st = open_file(root / INDEX, follow_symlinks=False)
        try:
            if st.st_size > INDEX_MAX_BYTES:
                raise NoReuse(f"{INDEX} of release {cur} is {st.st_size} bytes")
            raw = os.pread(fd, st.st_size + 1, 0)
        finally:
            os.close(fd)
    except OSError as exc:
        raise NoReuse(f"cannot read {INDEX} of release {cur}: {exc.strerror or exc}") from None
    if sha256_bytes(raw) != pinned[1]:
        raise NoReuse(f"{INDEX} of release {cur} differs from its pin")
    try:
        d = json.loads(raw)
        parts = {str(p): (str(v["sha256"]), [str(n) for n in v["names"]]) for p, v in d["parts"].items()}
        if d.get("format") != INDEX_FORMAT:
            raise ValueError
    except (ValueError, KeyError, TypeError, AttributeError):
        raise NoReuse(f"{INDEX} of release {cur} is not a format-{INDEX_FORMAT} index") from None
    return Donor(cur, root, tree.entries, parts)


def shared_parts(donor: Donor, want: dict[str, str]) -> list[str]:
    """The parts of `want` ({part path: SHA-256}, from the new release's MANIFEST) the donor unpacked from the
    same archive; never `_base`."""
    base = f"{venv.VENV_PARTS}/{venv.BASE_PART}.tar.zst"
    return sorted(p for p, sha in want.items() if p != base and p in donor.parts and donor.parts[p][0] == sha)


class _Dirs:
    """Directories under a root, each opened component by component without following a symlink, so a path is
    the tree's own however its directories were replaced since (an intermediate symlink fails: ELOOP/ENOTDIR).
    Only the directories on the path last asked for stay open: names come sorted, so a directory's entries reuse
    its fd, and a venv's thousands of directories never hold as many descriptors (a shell under sshd has 1024)."""

    def __init__(self, root: Path) -> None:
        self.root = os.open(root, DIR_FLAGS)
        self.chain: list[tuple[str, int]] = []  # the open path below root: (relative path, fd), outermost first

    def fd(self, rel_dir: str) -> int:
        parts = rel_dir.split("/") if rel_dir else []
        keep = 0
        while keep < min(len(self.chain), len(parts)) and self.chain[keep][0] == "/".join(parts[:keep + 1]):
            keep += 1
        for _, fd in self.chain[keep:]:
            os.close(fd)
        del self.chain[keep:]
        for i in range(keep, len(parts)):
            parent = self.chain[-1][1] if self.chain else self.root
            self.chain.append(("/".join(parts[:i + 1]), os.open(parts[i], DIR_FLAGS, dir_fd=parent)))
        return self.chain[-1][1] if self.chain else self.root

    def close(self) -> None:
        for _, fd in self.chain:
            os.close(fd)
        os.close(self.root)


def link_parts(donor: Donor, parts: list[str], dest: Path) -> tuple[list[Linked], int]:
    """Make the entries of `parts` in the venv `dest` (the other parts unpacked there, and `python -m venv` run
    over them, so nothing writes into these files after): directories made, symlinks written, files hard-linked
    from the donor's venv, then every linked file hashed and held to the donor's pin. No path component is
    followed through a symlink on either side. NoReuse on anything that is not exactly as pinned; the caller drops
    `dest` then. Also returns when the links were all made (time.time_ns(), before any was read): what a value
    computed from them counts as computed at (hashing.HashCache: a file changed since has a later ctime)."""
    files: list[tuple[str, int, str]] = []
    try:
        src = _Dirs(donor.root / "venv")
    except OSError as exc:
        raise NoReuse(f"cannot open the venv of release {donor.rid}: {exc.strerror or exc}") from None
    dst = _Dirs(dest)
    try:
        for part in parts:
            for name in sorted(donor.parts[part][1]):
                rel = f"venv/{name}"
                value = donor.entries.get(rel)
                if value is None:  # an odd name (absolute, "..", "a//b", "a/") is never a pinned entry
                    raise NoReuse(f"{rel} of {part} is not pinned in release {donor.rid}")
                parent, _, base = name.rpartition("/")
                file = _pinned_file(value)
                try:
                    at = dst.fd(parent)
                    if value == "dir 0755":
                        try:
                            os.mkdir(base, 0o755, dir_fd=at)
                        except FileExistsError:
                            dst.fd(name)  # it must be a directory, not a link to one
                    elif value.startswith("link -> "):
                        target = value[len("link -> "):]
                        try:
                            archive.check_symlink_target(name, target)  # as the unpack holds its links
                        except DeployError as exc:
                            raise NoReuse(f"{rel} of release {donor.rid}: {exc}") from None
                        os.symlink(target, base, dir_fd=at)
                    elif file is not None:
                        os.link(base, base, src_dir_fd=src.fd(parent), dst_dir_fd=at, follow_symlinks=False)
                        files.append((name, *file))
                    else:
                        raise NoReuse(f"{rel} of release {donor.rid} is pinned as {value!r}, not as root's file, "
                                      "link or directory with the modes an unpack gives")
                except OSError as exc:
                    raise NoReuse(f"cannot link {rel} from release {donor.rid}: {exc.strerror or exc}") from None
    finally:
        src.close()
        dst.close()
    at = time.time_ns()

    def check(item: tuple[str, int, str]) -> Linked:
        name, mode, sha = item
        try:
            fd, st = open_file(dest / name, follow_symlinks=False)
        except OSError as exc:
            raise NoReuse(f"cannot read venv/{name} linked from release {donor.rid}: {exc.strerror or exc}") from None
        try:
            got, _ = sha256_fd(fd, regular=True)
            caps = _has_capabilities(fd)
        finally:
            os.close(fd)
        if got != sha or stat.S_IMODE(st.st_mode) != mode or (st.st_uid, st.st_gid) != (0, 0) or caps:
            raise NoReuse(f"venv/{name} of release {donor.rid} differs from its pin")
        return Linked(name, st, got)  # the stat before the read: a write since gives the pin another stat

    return parallel(check, files), at


def _has_capabilities(fd: int) -> bool:
    """Whether the file carries file capabilities (an xattr the pins do not cover; an unpack never sets one)."""
    try:
        os.getxattr(fd, "security.capability")
    except OSError:
        return False  # ENODATA, or a file system without xattrs
    return True
