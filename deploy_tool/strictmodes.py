"""StrictModes (after sshd's): every path that systemd or a root step reads to run a backend is root's alone.

The rule, for one path by its lstat (`judge`):
  - it is owned by root (uid 0): another owner can chmod it, or rewrite it, whatever its mode;
  - it is not writable by group or other (mode & 0o022 == 0), whatever the group: a group-writable path is one
    any member of that group can change (a POSIX ACL granting write shows as group write, its mask, too);
  - a symlink's own mode means nothing (it is always 0777; its target cannot be changed in place, only replaced,
    which takes write access to its directory): a link is held to the owner rule only, and its target is checked
    as a path of its own (the chain of its real path, below);
  - a directory ABOVE a checked path may be writable by group or other when it is sticky, owned by root and the
    next path component in it exists (/tmp, 1777, above /tmp/box): in a sticky directory only an entry's owner
    (or the directory's) can rename or remove it, so no one can put their own entry in place of root's. That
    entry is judged on its own: one not owned by root is named itself (`chown root /tmp/box`, not `chmod go-w
    /tmp`). The same directory is refused as a checked path itself (anyone could add entries there) and above a
    name that does not exist yet (anyone could create it first).

What is checked (`box_paths`), each with every directory above it up to /, along the path as written and along its
real path (so a symlink on the way, and where it leads, are both checked):
  config       paths.config (what the units' ExecStartPre reads) and the config file actually loaded
  unit         each backend's unit file in paths.unit_dir and the other units the release installs ({current}/units:
               the failover template, the liveness probe), their drop-in directories (NAME.d, the dash-prefix
               drop-ins systemd also reads, `service.d`) and every file in them
  env          paths.env_dir and every file in it (env files, the API key)
  keys         paths.keys_dir, every key file and the revocation list (they decide which bundles install runs)
  state        paths.state_dir, every entry in it (state.json, pins/, the history, the lock, ...), every pin file
  release      `current`, the release it points at, the releases directory; the server binary a llama.cpp
               backend names and the verifier (paths.deploytool) when they live outside the release
Inside the release (and a venv outside it) every entry is pinned with its mode and owner (deploy_tool.box.treepin),
and `pin` refuses to pin one that breaks this rule, so a later change there is drift; verify does not walk the
tree again for this check. Not checked: system paths outside these (/usr/lib/systemd, the base interpreter, the C
library), the models (data the server reads, pinned by size and hash).

Who runs it: `install` (all of it, before anything changes), `verify BACKEND` (the units' ExecStartPre: before the
pins are compared, since a writable pins file or config could lie), `status` (degraded), `check` on a box where the
config's install exists (a packaging machine's checkout is not held to it), and the bundle's bootstrap for the keys
directory and the config (deploy_tool/box/bootstrap.py: its own copy of `judge`, kept the same by a test). A verify
with nothing wrong costs a few dozen lstat calls and a handful of directory listings.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from deploy_tool.config import Backend, Config, LlamacppBackend, expand
from deploy_tool.errors import UnsafePathError

#: the role of a path in a chain: the checked path itself, or a directory above it
PATH, ABOVE = "path", "above"


def judge(uid: int, mode: int, *, role: str = PATH, child_uid: int | None = None) -> tuple[str, ...]:
    """What is wrong with one path, by its lstat owner and mode (empty: it is root's alone). `role` ABOVE with
    `child_uid` (the owner of the next component, None when it does not exist) for a directory above a checked
    path. Pure: the whole rule (see the module doc)."""
    problems: list[str] = []
    if uid != 0:
        problems.append(f"owned by uid {uid}, not root")
    if stat.S_ISLNK(mode):
        return tuple(problems)
    w = mode & 0o022
    sticky_ok = (role == ABOVE and stat.S_ISDIR(mode) and bool(mode & stat.S_ISVTX) and uid == 0
                 and child_uid is not None)
    if w and not sticky_ok:
        who = "group and others" if w == 0o022 else "group" if w & 0o020 else "others"
        problems.append(f"writable by {who}")
    return tuple(problems)


def fixes(path: str, problems: Iterable[str]) -> str:
    """The commands that fix `problems` of `path`."""
    out = []
    for p in problems:
        if p.startswith("owned by"):
            out.append(f"chown root {path}")
        elif p.startswith("writable"):
            out.append(f"chmod go-w {path}")
    return " && ".join(dict.fromkeys(out))


@dataclass(frozen=True)
class Unsafe:
    """One path that breaks the rule."""

    path: str
    what: str  # which path class it serves: "env dir", "above the unit file of ftllm-dflash.service", ...
    uid: int
    gid: int
    mode: int  # st_mode: type and permission bits
    problems: tuple[str, ...]

    @property
    def fix(self) -> str:
        return fixes(self.path, self.problems)

    def line(self) -> str:
        return (f"{self.path} ({self.what}): owner {self.uid}:{self.gid}, mode {stat.S_IMODE(self.mode):04o}, "
                f"{' and '.join(self.problems)}; fix: {self.fix}")

    def to_json(self) -> dict[str, object]:
        return {"path": self.path, "what": self.what, "uid": self.uid, "gid": self.gid,
                "mode": f"{stat.S_IMODE(self.mode):04o}", "problems": list(self.problems), "fix": self.fix}


# ------------------------------------------------------------------------------------------------ the paths

def dropin_dirs(unit: str) -> list[str]:
    """The drop-in directory names systemd reads for `unit` (systemd.unit(5)): NAME.d, the dash-prefix ones
    (`a-b-.service.d`, `a-.service.d` for `a-b-c.service`), a template's (`t@.service.d` for `t@i.service`) and
    the type-wide `service.d`."""
    stem, dot, suffix = unit.rpartition(".")
    if not dot:
        return [f"{unit}.d"]
    out = [f"{unit}.d"]
    if "@" in stem and not stem.endswith("@"):
        out.append(f"{stem.split('@', 1)[0]}@.{suffix}.d")
    parts = stem.split("@", 1)[0].split("-")  # systemd truncates the name's prefix (before any @instance)
    for i in range(len(parts) - 1, 0, -1):
        out.append(f"{'-'.join(parts[:i])}-.{suffix}.d")
    out.append(f"{suffix}.d")
    return list(dict.fromkeys(out))


def _entries(d: str) -> list[str]:
    try:
        with os.scandir(d) as it:
            return sorted(e.path for e in it)
    except OSError:
        return []


def unit_names(cfg: Config, backends: Iterable[Backend]) -> list[str]:
    """The backends' units and every unit the installed release carries (failover template, liveness probe), with
    the template's instance per backend."""
    names = [b.unit for b in backends]
    for p in _entries(os.path.join(cfg.paths.current, "units")):
        n = os.path.basename(p)
        names.append(n)
        if n.endswith("@.service"):
            names += [n.replace("@.", f"@{b}.") for b in sorted(cfg.backends)]
    return list(dict.fromkeys(names))


def box_paths(cfg: Config, backends: Iterable[Backend] | None = None) -> list[tuple[str, str]]:
    """(what, path) of every path the rule covers for `backends` (default: all), in a stable order."""
    bs = list(cfg.backends.values()) if backends is None else list(backends)
    p = cfg.paths
    out: list[tuple[str, str]] = [("config", p.config)]
    if cfg.source_path:
        out.append(("config", str(cfg.source_path)))
    unit_dir = p.unit_dir
    for n in unit_names(cfg, bs):
        out.append((f"unit file {n}", os.path.join(unit_dir, n)))
        for d in dropin_dirs(n):
            dp = os.path.join(unit_dir, d)
            if os.path.lexists(dp):
                out.append((f"drop-in dir of {n}", dp))
                out += [(f"drop-in of {n}", e) for e in _entries(dp)]
    out.append(("env dir", p.env_dir))
    out += [("env file", e) for e in _entries(p.env_dir)]
    out.append(("keys dir", p.keys_dir))
    out += [("trusted key" if e.endswith(".pub") else "keys dir entry", e) for e in _entries(p.keys_dir)]
    out.append(("state dir", p.state_dir))
    for e in _entries(p.state_dir):
        out.append(("state", e))
        if os.path.basename(e) == "pins":
            out += [("pins", f) for f in _entries(e)]
    out.append(("current", p.current))
    if os.path.lexists(p.current):
        out.append(("release", os.path.realpath(p.current)))
    out.append(("releases dir", p.releases_dir))
    release = os.path.realpath(p.current)
    for what, prog in [("verifier", expand(cfg, p.deploytool))] + [
            (f"server binary of {b.name}", expand(cfg, b.binary)) for b in bs if isinstance(b, LlamacppBackend)]:
        if not _inside(os.path.realpath(prog), release):
            out.append((what, prog))
    return list(dict.fromkeys(out))


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


# ------------------------------------------------------------------------------------------------ the scan

def _chain(path: str) -> list[str]:
    """/, /a, /a/b, ... path (normalized, absolute)."""
    parts = [x for x in os.path.abspath(path).split("/") if x]
    return ["/"] + ["/" + "/".join(parts[:i]) for i in range(1, len(parts) + 1)]


class _Stats:
    """lstat once per path for the whole scan."""

    def __init__(self) -> None:
        self.seen: dict[str, os.stat_result | None] = {}

    def __call__(self, p: str) -> os.stat_result | None:
        if p not in self.seen:
            try:
                self.seen[p] = os.lstat(p)
            except OSError:
                self.seen[p] = None
        return self.seen[p]


def _walk(what: str, path: str, lstat: _Stats) -> Iterator[tuple[str, str, os.stat_result, str, int | None]]:
    """(what, path, lstat, role, child uid) along the chain of `path` as written and, when a symlink is on the way
    (or is the path), along its real path too; a chain stops at the first component that does not exist (nothing
    below it can be read) or at a link (the real path's chain goes on from there)."""
    chain: list[str] | None = _chain(path)
    followed = False
    while chain is not None:
        walk, chain = chain, None
        for i, p in enumerate(walk):
            st = lstat(p)
            if st is None:
                break
            last = i == len(walk) - 1
            child = None if last else lstat(walk[i + 1])
            yield (what if last else f"above the {what}"), p, st, PATH if last else ABOVE, \
                None if child is None else child.st_uid
            if stat.S_ISLNK(st.st_mode):
                if not followed:  # once: a real path has no links (a loop's has, and ends here)
                    followed, chain = True, _chain(os.path.realpath(path))
                break


def scan(cfg: Config, backends: Iterable[Backend] | None = None,
         paths: Iterable[tuple[str, str]] | None = None) -> list[Unsafe]:
    """Every path (of `box_paths`, or `paths`) or directory above one that breaks the rule, once each."""
    lstat = _Stats()
    found: dict[str, Unsafe] = {}
    for what, path in (box_paths(cfg, backends) if paths is None else paths):
        for w, p, st, role, child in _walk(what, path, lstat):
            if p in found:
                continue
            problems = judge(st.st_uid, st.st_mode, role=role, child_uid=child)
            if problems:
                found[p] = Unsafe(p, w, st.st_uid, st.st_gid, st.st_mode, problems)
    return list(found.values())


def refusal(unsafe: list[Unsafe], doing: str) -> UnsafePathError:
    """The one error for a refused operation: the first path in the message, all in details, the fix as hint."""
    first = unsafe[0]
    more = ""
    if len(unsafe) > 1:
        more = f" (and {len(unsafe) - 1} more: {', '.join(u.path for u in unsafe[1:4])}{' ...' if len(unsafe) > 4 else ''})"
    return UnsafePathError(f"{doing}: {first.line()}{more}",
                           hint=f"{first.fix}; a path a root step reads must be owned by root and not writable by "
                                "group or other (`deploytool check` lists them all)",
                           details=[u.to_json() for u in unsafe])


def keys_paths(keys_dir: str) -> list[tuple[str, str]]:
    """A keys directory and what is in it (for a --keys DIR other than paths.keys_dir)."""
    return [("keys dir", keys_dir)] + [("trusted key" if e.endswith(".pub") else "keys dir entry", e)
                                       for e in _entries(keys_dir)]


def require(cfg: Config, backends: Iterable[Backend] | None, doing: str,
            extra: Iterable[tuple[str, str]] = ()) -> None:
    """Refuse (UnsafePathError, exit 23) when any path of `backends` (and `extra`) breaks the rule; nothing is
    changed."""
    bad = scan(cfg, paths=[*box_paths(cfg, backends), *extra])
    if bad:
        raise refusal(bad, doing)


def tree_problems(entries: dict[str, str], root: str) -> list[Unsafe]:
    """The entries of a pinned tree (deploy_tool.box.treepin values: `file 0644 <sha>`, `dir 0755 1000:1000`, ...)
    that break the rule: what `pin` refuses to pin."""
    out = []
    for rel, v in entries.items():
        parsed = parse_tree_value(v)
        if parsed is None:
            continue
        mode, uid, gid = parsed
        problems = judge(uid, mode)
        if problems:
            out.append(Unsafe(root if rel == "." else os.path.join(root, rel), "release entry", uid, gid, mode,
                              problems))
    return out


_TYPES = {"file": stat.S_IFREG, "dir": stat.S_IFDIR, "fifo": stat.S_IFIFO, "socket": stat.S_IFSOCK,
          "chardev": stat.S_IFCHR, "blockdev": stat.S_IFBLK, "special": 0}


def parse_tree_value(v: str) -> tuple[int, int, int] | None:
    """(st_mode, uid, gid) of a tree entry's pinned value (the owner is left out when it is 0:0), or None when it
    does not say (unreadable, missing)."""
    words = v.split(" ")
    if words[0] == "link":
        uid, gid = _owner(words[1]) if len(words) > 2 and words[1] != "->" else (0, 0)
        return stat.S_IFLNK | 0o777, uid, gid
    if words[0] not in _TYPES or len(words) < 2 or len(words[1]) != 4 or not words[1].isdigit():
        return None
    mode = _TYPES[words[0]] | int(words[1], 8)
    uid, gid = _owner(words[2]) if len(words) > 2 and ":" in words[2] else (0, 0)
    return mode, uid, gid


def _owner(word: str) -> tuple[int, int]:
    u, _, g = word.partition(":")
    return (int(u), int(g)) if u.isdigit() and g.isdigit() else (0, 0)
