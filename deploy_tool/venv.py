"""Python venvs and pip, for the packager and the box alike: the venv built offline from locked wheels, its
bytecode, its interpreter links re-created on the box, and its prefix rewritten to where it is installed.

pip always runs with the machine's pip configuration switched off (PIP_CONFIG_FILE=/dev/null): an extra index
or find-links of the packaging machine must never leak into a lock or an offline build.

External programs run through `proc.run` (subprocess: install on the box waits for them); the build side
passes `run=proc.run_tool` (through `sh`) to build_venv.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import posixpath
import re
from collections.abc import Callable, Iterable
from pathlib import Path

from deploy_tool import proc
from deploy_tool.errors import BundleError, DeployError
from deploy_tool.fsutil import atomic_write

# Shebangs and pyvenv.cfg of the archived venv point at this prefix; install rewrites it to the real path.
VENV_PLACEHOLDER = "/__deploytool_venv_prefix__"

# The venv travels in the bundle as one archive per installed distribution (venv-parts/<name>.tar.zst), plus
# BASE_PART for what no distribution owns, so a release one wheel apart differs in that wheel's part only: a fleet
# ship sends and hashes that part, and links or copies the rest (deploytool.fleet.ship). Bundles packed before
# 2026-12-06 (format 1, deploytool 0.1.0) carry the whole venv as LEGACY_VENV_ARCHIVE; install takes either.
VENV_PARTS = "venv-parts"
BASE_PART = "_base"  # a distribution's canonical name never starts with "_"
LEGACY_VENV_ARCHIVE = "venv.tar.zst"
_PART_NAME = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?")
_PYC = re.compile(r"(.+?)\.[a-z]+-\d+(?:\.opt-\d+)?\.pyc")  # NAME.cpython-311[.opt-1].pyc -> NAME

Runner = Callable[..., object]  # proc.run or proc.run_tool: (argv, *, env=..., timeout=...)


def pip_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    # PYTHONPATH & co. would let pip see packages outside the venv being built (for example a source checkout of
    # deploytool) and skip installing them: the venv must come from the wheels alone.
    drop = ("PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE", "PYTHONSTARTUP", "VIRTUAL_ENV", "PYTHONNOUSERSITE")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k not in drop}
    env["PYTHONNOUSERSITE"] = "1"
    env.update({"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONDONTWRITEBYTECODE": "1",
                "PIP_NO_INPUT": "1"})
    env.update(extra or {})
    return env


def build_venv(python: str, lock_path: Path, wheels_dir: Path, dest: Path, *, run: Runner = proc.run) -> None:
    """A venv at `dest` from local wheels only: --no-index --require-hashes --no-deps (the lock is the closure)."""
    run([python, "-m", "venv", str(dest)], env=pip_env(), timeout=600)
    run([str(dest / "bin" / "python"), "-m", "pip", "install", "--no-index", "--find-links", str(wheels_dir),
         "--require-hashes", "--no-deps", "--no-compile", "-r", str(lock_path)], env=pip_env(), timeout=3600)


def compile_venv(venv: Path, current: str, log: Callable[[str], None] = lambda s: None) -> bool:
    """Byte-compile the venv's Python (lib/) into checked-hash .pyc files, recording the paths the sources have
    on the box through `current` (`<current>/venv/lib/...`), so the bytes are the same wherever the venv is
    built: pack puts them in the venv's archives and they are signed and pinned like every other file.

    A backend runs with DynamicUser= and ProtectSystem=strict: it cannot write bytecode, so without these every
    start of ftllm would compile its Python again. checked-hash .pyc files are validated against their source's
    hash, not its mtime, so an edited source is never run from a stale .pyc (and an unpacked archive's mtimes do
    not matter). `-f`: the timestamp-based .pyc that ensurepip left for pip itself (with the build path in them)
    are rewritten too. A file that does not compile only costs its own speed: a warning, not a failure."""
    python = venv / "bin" / "python"
    try:
        res = proc.run([str(python), "-m", "compileall", "-q", "-f", "-j", "0", "--invalidation-mode", "checked-hash",
                        "-s", str(venv), "-p", f"{current}/venv", str(venv / "lib")], ok=(0, 1), timeout=1800,
                       env={"PATH": "/usr/bin:/bin", "LC_ALL": "C", "PYTHONHASHSEED": "0"})
    except DeployError as exc:
        log(f"warning: byte-compiling the venv failed, backends will compile at each start: {exc.message}")
        return False
    if res.returncode != 0:
        first = next((ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip()), "")
        log(f"warning: some files of the venv did not byte-compile (they compile at each start): {first[:200]}")
        return False
    return True


def finish_venv(python: str, venv: Path) -> None:
    """Re-create the interpreter links and pyvenv.cfg of an unpacked venv (site-packages untouched)."""
    proc.run([python, "-m", "venv", "--without-pip", str(venv)], env=pip_env(), timeout=600)


def relocate_venv(venv: Path, old: str | tuple[str, ...], new: str) -> int:
    """Rewrite the venv prefix (`old`, or each of several) in bin/ text files and pyvenv.cfg (shebangs, activate
    scripts), and the RECORD lines of the rewritten files, so RECORD stays true and two builds at different
    places give the same bytes."""
    olds = [o.encode() for o in ((old,) if isinstance(old, str) else old)]
    changed: dict[Path, bytes] = {}
    targets = [venv / "pyvenv.cfg"] + sorted((venv / "bin").iterdir())
    for p in targets:
        if p.is_symlink() or not p.is_file():
            continue
        data = p.read_bytes()
        if b"\0" in data[:4096] or not any(o in data for o in olds):
            continue
        st = p.stat()
        for o in olds:
            data = data.replace(o, new.encode())
        atomic_write(p, data, st.st_mode & 0o7777)
        changed[p.resolve()] = data
    if changed:
        _fix_records(venv, changed)
    return len(changed)


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _fix_records(venv: Path, changed: dict[Path, bytes]) -> None:
    names = {p.name for p in changed}
    for record in sorted(venv.glob("lib/python*/site-packages/*.dist-info/RECORD")):
        site = record.parent.parent
        rows = list(csv.reader(io.StringIO(record.read_text("utf-8"))))
        dirty = False
        for row in rows:
            # only a row named like a rewritten file can be one: resolving every row (a path lookup per component)
            # was most of an unpack's relocation
            if len(row) != 3 or row[0].rpartition("/")[2] not in names:
                continue
            target = (site / row[0]).resolve()
            if target in changed:
                row[1], row[2] = _record_hash(changed[target]), str(len(changed[target]))
                dirty = True
        if dirty:
            out = io.StringIO()
            csv.writer(out, lineterminator="\n").writerows(rows)
            atomic_write(record, out.getvalue().encode(), record.stat().st_mode & 0o7777)


def venv_archives(paths: Iterable[str]) -> list[str]:
    """The venv archives among a bundle's file paths, in the order install unpacks them: the one legacy archive,
    or every part. A bundle with neither, or with both, is refused (BundleError)."""
    paths = list(paths)
    parts = sorted(p for p in paths if p.startswith(VENV_PARTS + "/"))
    odd = [p for p in parts if p.count("/") != 1 or not p.endswith(".tar.zst")]
    if odd:
        raise BundleError(f"the bundle's {odd[0]} is not a venv archive ({VENV_PARTS}/NAME.tar.zst)",
                          hint="pack the bundle again")
    legacy = LEGACY_VENV_ARCHIVE in paths
    if parts and legacy:
        raise BundleError(f"the bundle carries both {LEGACY_VENV_ARCHIVE} and {VENV_PARTS}/: which venv is meant?",
                          hint="pack the bundle again")
    if not parts and not legacy:
        raise BundleError(f"the bundle carries no venv ({VENV_PARTS}/*.tar.zst or {LEGACY_VENV_ARCHIVE})",
                          hint="pack the bundle again")
    return parts or [LEGACY_VENV_ARCHIVE]


def canonical_name(name: str) -> str:
    """A distribution's name as PEP 503 normalizes it (`Typing_Extensions` -> `typing-extensions`)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def part_owner(venv: Path) -> Callable[[str], str]:
    """Which venv part a file or link (path relative to the venv) goes into: the distribution whose dist-info RECORD
    lists it (or lists the source of a __pycache__ .pyc, or whose dist-info directory holds it), else BASE_PART
    (pyvenv.cfg, activate scripts, files no RECORD names). A path two distributions' RECORDs list (a namespace
    package's __init__.py) goes to BASE_PART, so that neither distribution's part depends on the other."""
    owner: dict[str, str] = {}
    info_dirs: dict[str, str] = {}
    for info in sorted(venv.glob("lib/python*/site-packages/*.dist-info")):
        stem = info.name[: -len(".dist-info")]
        name = canonical_name(stem.rpartition("-")[0] or stem)  # NAME-VERSION.dist-info (NAME.dist-info: no version)
        if not _PART_NAME.fullmatch(name) or name in info_dirs.values():
            raise BundleError(f"venv: distribution {info.name!r} has a name that cannot name a bundle file of its "
                              "own (empty, unusual, or another distribution's)", hint="remove that package from the lock")
        site = info.parent.relative_to(venv).as_posix()
        info_dirs[f"{site}/{info.name}"] = name
        try:
            rows = list(csv.reader(io.StringIO((info / "RECORD").read_text("utf-8"))))
        except (OSError, UnicodeDecodeError, csv.Error):
            rows = []
        for row in rows:
            if row and row[0]:
                rel = posixpath.normpath(f"{site}/{row[0]}")
                if not rel.startswith("../"):
                    owner[rel] = name if owner.get(rel, name) == name else BASE_PART

    def of(rel: str) -> str:
        hit = owner.get(rel)
        if hit is not None:
            return hit
        head = "/".join(rel.split("/")[:4])
        if head in info_dirs:
            return info_dirs[head]
        d, _, base = rel.rpartition("/")
        m = _PYC.fullmatch(base)
        if d.endswith("/__pycache__") and m:
            return owner.get(f"{d[: -len('/__pycache__')]}/{m.group(1)}.py", BASE_PART)
        return BASE_PART

    return of


def part_of_dirs(dirs: Iterable[str], placed: Iterable[tuple[str, str]]) -> dict[str, str]:
    """The part of each directory (paths relative to the venv): the one part that every file and link below it
    went to (`placed`: (path, part)), so a distribution's package and dist-info directories travel with it and
    a new version or subpackage changes its part alone; BASE_PART for a directory shared by several parts or
    holding nothing (unpacking merges a directory that two parts create)."""
    below: dict[str, set[str]] = {}
    for rel, part in placed:
        d = rel.rpartition("/")[0]
        while d:
            below.setdefault(d, set()).add(part)
            d = d.rpartition("/")[0]
    out = {}
    for d in dirs:
        parts = below.get(d, set())
        out[d] = next(iter(parts)) if len(parts) == 1 else BASE_PART
    return out
