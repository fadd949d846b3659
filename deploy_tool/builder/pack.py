"""What goes into a bundle, from the config: the lock, its wheels, a venv built from them offline, the patched
chat template, the NCCL library, the rendered units and env files, and the resolved config.

pip runs through `proc.run_tool` (the `sh` library: a build machine does not mind its start time), always with
the machine's pip configuration switched off (venv.pip_env).
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import os
import re
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from importlib.resources import files
from pathlib import Path
from typing import Any

import deploy_tool
from deploy_tool import archive, bundle, proc, render
from deploy_tool.binaries import arch_supported, read_fatbin
from deploy_tool.config import (
    BUNDLED_ENV_LAUNCHER_DIR,
    BUNDLED_FRONT,
    BUNDLED_FTLLM_LAUNCHER,
    SEQUENCE,
    Config,
)
from deploy_tool.errors import BundleError, CheckFailed, InputError
from deploy_tool.fsutil import atomic_write
from deploy_tool.manifest import FORMAT_VERSION, hash_file, hash_files, hash_native_libs, source_date_epoch
from deploy_tool.proc import run_tool
from deploy_tool.progress import waiting
from deploy_tool.render import resolved_config_json
from deploy_tool.venv import (
    BASE_PART,
    VENV_PARTS,
    VENV_PLACEHOLDER,
    build_venv,
    compile_venv,
    part_of_dirs,
    part_owner,
    pip_env,
    relocate_venv,
)

WHEEL_RE = re.compile(r"^(?P<name>[A-Za-z0-9_.]+)-(?P<version>[^-]+)(-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl$")
LOCK_LINE_RE = re.compile(r"^(?P<name>[A-Za-z0-9_.\-]+)==(?P<version>\S+)\s+--hash=sha256:(?P<sha>[0-9a-f]{64})\s*$")


def normalize_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class LockEntry:
    name: str
    version: str
    sha256: str


def parse_wheel_name(fn: str) -> tuple[str, str]:
    m = WHEEL_RE.match(fn)
    if not m:
        raise InputError(f"{fn}: not a wheel file name", hint="only wheels are bundled; no source distributions")
    return normalize_name(m["name"]), m["version"]


def read_lock(path: Path) -> list[LockEntry]:
    """Parse a lock written by `deploytool lock` (one `name==version --hash=sha256:...` per requirement)."""
    try:
        text = path.read_text("utf-8")
    except FileNotFoundError:
        raise InputError(f"lock file not found: {path}", hint="run `deploytool lock` first") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read lock file {path}: {exc}") from None
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    for n, line in enumerate(joined.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = LOCK_LINE_RE.match(line)
        if not m:
            raise InputError(f"{path}: line {n} is not `name==version --hash=sha256:HEX`: {line[:80]!r}",
                             hint="regenerate the lock with `deploytool lock`")
        out.append(LockEntry(normalize_name(m["name"]), m["version"], m["sha"]))
    if not out:
        raise InputError(f"{path}: the lock lists no packages")
    return out


def write_lock(entries: list[LockEntry], path: Path, *, source_sha: str) -> None:
    lines = [f"# deploytool lock: {len(entries)} packages, wheels only, install with --no-index --require-hashes",
             f"# requirements input sha256: {source_sha}"]
    for e in sorted(entries, key=lambda e: e.name):
        lines.append(f"{e.name}=={e.version} \\\n    --hash=sha256:{e.sha256}")
    atomic_write(path, ("\n".join(lines) + "\n").encode(), 0o644)


def requirements_input(cfg: Config) -> Path:
    """bundle.requirements, a file; InputError otherwise (`lock --dry-run` checks it too)."""
    if not cfg.bundle.requirements:
        raise InputError("bundle.requirements is not set", hint="point it at a requirements.in file")
    req = Path(cfg.bundle.requirements)
    if not req.is_file():
        raise InputError(f"requirements input not found: {req}" + (" (a directory)" if req.is_dir() else ""),
                         hint="point bundle.requirements at a requirements.in file (`deploytool init` writes one)")
    return req


def lock(cfg: Config, *, python: str | None = None) -> tuple[Path, list[LockEntry]]:
    """Download every wheel of the requirements into wheels_dir (wheels only) and write the hash-pinned lock."""
    b = cfg.bundle
    req = requirements_input(cfg)
    wheels = Path(b.wheels_dir)
    wheels.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="deploytool-lock-") as tmp:
        argv = [python or b.python, "-m", "pip", "download", "--only-binary=:all:", "-d", tmp, "-r", str(req)]
        if b.lock_mode == "exact":
            argv.append("--no-deps")
        with waiting(f"pip to download the wheels of {req.name}", limit=3600):
            run_tool(argv, env=pip_env(), timeout=3600)
        entries = []
        for fn in sorted(os.listdir(tmp)):
            name, version = parse_wheel_name(fn)
            src = Path(tmp, fn)
            sha = _sha(src)
            dest = wheels / fn
            if not (dest.is_file() and _sha(dest) == sha):  # a wheel already there stays: a pack may be reading it
                shutil.copyfile(src, wheels / f".{fn}.tmp")
                os.replace(wheels / f".{fn}.tmp", dest)
            entries.append(LockEntry(name, version, sha))
    write_lock(entries, Path(b.lock), source_sha=_sha(req))
    if b.tool_wheels_dir:
        lock_tool(cfg, python=python)
    return Path(b.lock), entries


def lock_tool(cfg: Config, *, python: str | None = None) -> list[Path]:
    """deploytool's own wheel and its dependencies' wheels: the wheel built reproducibly from this source tree
    when deploytool runs from one (a checkout), else remade from the installed distribution itself (a `pipx
    install` or `pip install` of deploytool's wheel: installed_wheel)."""
    src = Path(deploy_tool.__file__).resolve().parents[1]
    out = Path(cfg.bundle.tool_wheels_dir or "tool-wheels")
    out.mkdir(parents=True, exist_ok=True)
    py = python or cfg.bundle.python
    with tempfile.TemporaryDirectory(prefix="deploytool-toolwheel-") as tmp:
        if (src / "setup.cfg").is_file():
            # pip builds a local directory in place (build/, *.egg-info): built from the source tree itself, the
            # wheel would leave those behind, and a build/ left from an earlier run carries modules deleted since
            # into the next wheel. A clean copy of what the wheel is made of is built instead.
            copy = _wheel_sources(src, Path(tmp) / "src")
            with waiting("pip to build deploytool's own wheel", limit=1200):
                run_tool([py, "-m", "pip", "wheel", "--no-deps", "-w", str(Path(tmp) / "out"),
                          str(copy)], env=pip_env({"SOURCE_DATE_EPOCH": "315532800"}), timeout=1200)
            whl = next((Path(tmp) / "out").glob("deploytool-*.whl"))
        else:
            whl = installed_wheel(Path(tmp) / "out")
        for old in out.glob("deploytool-*.whl"):
            old.unlink()
        with waiting("pip to download deploytool's dependencies' wheels", limit=1200):
            run_tool([py, "-m", "pip", "download", "--only-binary=:all:", "-d", str(out), str(whl)],
                     env=pip_env(), timeout=1200)
    return sorted(out.glob("*.whl"))


#: What of an installed distribution's RECORD is not part of its wheel: what the installer wrote (its scripts
#: outside site-packages, bytecode) or records about the install itself.
_INSTALL_ONLY = ("INSTALLER", "REQUESTED", "RECORD", "direct_url.json")


def installed_wheel(dest: Path, dist_name: str = "deploytool") -> Path:
    """deploytool's wheel, remade from the distribution installed in this interpreter: every file its RECORD lists
    under site-packages (each checked against the RECORD's SHA-256 first: a changed file is refused, never
    packed), the .dist-info's own metadata, a new RECORD; entries sorted, times fixed, so the same install gives
    the same bytes. An editable install (a .pth pointing at a checkout) has no files to remake it from."""
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        raise InputError(f"{dist_name} is not installed as a distribution here, so its wheel cannot be made",
                         hint="install deploytool with pip or pipx, or run it from a checkout") from None
    files = [f for f in (dist.files or []) if not str(f).startswith("..") and "__pycache__" not in str(f)
             and not str(f).endswith(".pyc")]
    pkg = [f for f in files if str(f).startswith("deploy_tool/")]
    if not pkg:
        raise InputError(f"the installed {dist_name} has no package files (an editable install?), so its wheel "
                         "cannot be remade from it", hint="run deploytool from its checkout, or install its wheel")
    version = dist.version
    name = f"{dist_name}-{version}-py3-none-any.whl"
    dest.mkdir(parents=True, exist_ok=True)
    rows: list[str] = []
    with zipfile.ZipFile(dest / name, "w", zipfile.ZIP_DEFLATED) as z:
        for f in sorted(files, key=str):
            rel = str(f)
            if rel.split("/")[-1] in _INSTALL_ONLY and ".dist-info/" in rel:
                continue
            path = Path(str(f.locate()))
            data = path.read_bytes()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            if f.hash is not None and (f.hash.mode != "sha256" or f.hash.value != digest):
                raise BundleError(f"the installed {dist_name}'s {rel} differs from what its install recorded",
                                  hint=f"reinstall {dist_name} (pipx reinstall deploytool), then lock again")
            info = zipfile.ZipInfo(rel, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = (0o644 if not os.access(path, os.X_OK) else 0o755) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
            rows.append(f"{rel},sha256={digest},{len(data)}")
        record = f"{dist_name}-{version}.dist-info/RECORD"
        rows.append(f"{record},,")
        info = zipfile.ZipInfo(record, date_time=(1980, 1, 1, 0, 0, 0))
        info.external_attr = 0o644 << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        z.writestr(info, "\n".join(rows) + "\n")
    return dest / name


# What deploytool's wheel is built from (setup.cfg's packages and package_dir, its long_description): nothing
# else of the checkout (venvs, caches, build/, *.egg-info, bytecode) reaches the build.
WHEEL_SOURCES = ("setup.cfg", "pyproject.toml", "README.md", "deploy_tool", "templates", "ansible")


def _wheel_sources(src: Path, dest: Path) -> Path:
    """A fresh copy of the files deploytool's wheel is built from, under `dest`."""
    dest.mkdir(parents=True)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")
    for name in WHEEL_SOURCES:
        p = src / name
        if p.is_dir():
            shutil.copytree(p, dest / name, ignore=skip)
        elif p.is_file():
            shutil.copy2(p, dest / name)
    return dest


def _sha(p: Path) -> str:
    return hash_file(p)


def select_wheels(cfg: Config, entries: list[LockEntry], *, progress=None) -> dict[str, Path]:
    """Map every lock entry to exactly one wheel in wheels_dir whose SHA-256 matches the lock."""
    wd = Path(cfg.bundle.wheels_dir)
    if not wd.is_dir():
        raise InputError(f"wheel directory not found: {wd}", hint="run `deploytool lock` first")
    cands: dict[tuple[str, str], list[Path]] = {}
    for p in sorted(wd.iterdir()):
        if p.suffix == ".whl":
            try:
                cands.setdefault(parse_wheel_name(p.name), []).append(p)
            except InputError:
                continue
    want = [p for e in entries for p in cands.get((e.name, e.version), [])]
    hashes = hash_files(want, progress=progress, phase="wheels")
    out: dict[str, Path] = {}
    for e in entries:
        hits = [p for p in cands.get((e.name, e.version), []) if hashes[p] == e.sha256]
        if not hits:
            found = cands.get((e.name, e.version))
            raise BundleError(f"no wheel in {wd} for {e.name}=={e.version} with the locked sha256 {e.sha256[:12]}"
                              + (f" (found {', '.join(p.name for p in found)} with other hashes)" if found else ""),
                              hint="run `deploytool lock` again, or restore the wheel the lock names")
        out[e.name] = hits[0]
    return out


def venv_archive_excludes(venv: Path, rel: str) -> bool:
    """The interpreter links (bin/python* -> /usr/bin/python3) stay out of the archive: install re-creates them
    with `python -m venv` on the box, against the box's own interpreter."""
    return rel.startswith("bin/python") and (venv / rel).is_symlink()


def archive_venv_parts(venv: Path, out: Path, *, progress=None) -> list[Path]:
    """The venv as one reproducible archive per part (venv.part_owner: each distribution's files, and the
    directories only they fill, venv.part_of_dirs; BASE_PART for the rest) under `out`; their paths, sorted. A
    distribution's archive depends on that distribution's files alone, so two packs one wheel apart (a rebuild, a
    new version, a new module) share the bytes of every other part."""
    groups: dict[str, list[archive.Member]] = {BASE_PART: []}
    owner = part_owner(venv)
    members = archive.members_from_tree(venv, symlinks=True, exclude=lambda rel: venv_archive_excludes(venv, rel))
    placed = {m.name: owner(m.name) for m in members if m.kind != "dir"}
    placed.update(part_of_dirs([m.name for m in members if m.kind == "dir"], placed.items()))
    for m in members:
        groups.setdefault(placed[m.name], []).append(m)
    sizes = {name: sum(os.stat(m.source).st_size for m in ms if isinstance(m.source, Path))
             for name, ms in groups.items()}
    out_paths, before = [], 0
    for name, members in sorted(groups.items()):
        # one progress line for all parts: each part's bytes counted on from the parts before it
        shown = None if progress is None else functools.partial(_progress_from, progress, before, sum(sizes.values()))
        out_paths.append(archive.write_archive(members, out / f"{name}.tar.zst", progress=shown))
        before += sizes[name]
    return out_paths


def _progress_from(progress, before: int, total: int, phase: str, done: int, _part_total: int) -> None:
    progress(phase, before + done, total)


def patch_template(cfg: Config) -> tuple[bytes, bytes, dict[str, Any]] | None:
    """(original, patched, record) for the configured chat template; the patch must match exactly once."""
    ct = cfg.bundle.chat_template
    if ct is None:
        return None
    src = Path(ct.source)
    try:
        original = src.read_bytes()
    except OSError as exc:
        raise InputError(f"chat template {src}: {exc.strerror}", hint="fix bundle.chat_template.source") from None
    orig_sha = hashlib.sha256(original).hexdigest()
    if ct.sha256 and ct.sha256 != orig_sha:
        raise CheckFailed(f"chat template {src}: sha256 {orig_sha[:12]} is not the pinned {ct.sha256[:12]}",
                          hint="the patch is only valid for the pinned version (v22.3); fetch that commit")
    patched = original
    if ct.patch is not None:
        count = original.count(ct.patch.find.encode())
        if count != 1:
            raise CheckFailed(f"chat template {src}: the patch pattern {ct.patch.find!r} occurs {count} times "
                              f"(it must occur exactly once)",
                              hint="the template is not the version the patch was written for")
        patched = original.replace(ct.patch.find.encode(), ct.patch.replace.encode())
    record = {"source": src.name, "origin": ct.origin, "commit": ct.commit, "original_sha256": orig_sha,
              "patched_sha256": hashlib.sha256(patched).hexdigest(),
              "patch": dataclasses.asdict(ct.patch) if ct.patch else None}
    return original, patched, record


def inspect_nccl(cfg: Config) -> tuple[Path, dict[str, Any]] | None:
    n = cfg.bundle.nccl
    if n is None:
        return None
    lib = Path(n.library)
    info = read_fatbin(lib)
    ok, why = arch_supported(info, cfg.host.compute_capability, n.arch_policy)
    if not ok and not n.force:
        raise CheckFailed(f"NCCL {lib}: {why}", hint="bundle an NCCL built with the GPUs' arch, or set "
                          "bundle.nccl.force: true to bundle it anyway (marked in the manifest)")
    return lib, {"library": str(lib), "cubin_archs": list(info.cubin_archs), "ptx_archs": list(info.ptx_archs),
                 "policy": n.arch_policy, "arch_ok": ok, "forced": (not ok) and n.force, "explanation": why}


def sequence_of(cfg: Config, given: int | None = None) -> int:
    """The bundle's sequence: `pack --sequence N`, else bundle.sequence, else SOURCE_DATE_EPOCH (0 when unset).
    An input like every other (two packs of the same inputs give the same bytes), never the clock."""
    if given is not None:
        if not SEQUENCE.admits(given) or isinstance(given, bool):
            raise InputError(f"--sequence {given} is not {SEQUENCE.text(True)}", hint=SEQUENCE.why)
        return given
    if cfg.bundle.sequence is not None:
        return cfg.bundle.sequence
    return min(source_date_epoch(), int(SEQUENCE.hi))


def pack(cfg: Config, *, out_dir: Path, key_path: Path, progress=None, log: Callable[[str], None] = lambda s: None,
         sequence: int | None = None):
    """Build the signed bundle (directory + one archive) from the config; returns bundle.BundleInfo.
    `sequence`: the bundle's place in its name's order (sequence_of), signed in the MANIFEST's inputs."""
    seq = sequence_of(cfg, sequence)
    if seq == 0:
        log("sequence 0 (no --sequence, bundle.sequence or SOURCE_DATE_EPOCH): a box that installed a bundle of "
            f"{cfg.bundle.name!r} with a higher sequence refuses this one, and this one protects against no older one")
    else:
        log(f"sequence {seq} of {cfg.bundle.name!r}")
    lock_path = Path(cfg.bundle.lock)
    entries = read_lock(lock_path)
    log(f"lock: {len(entries)} packages in {lock_path}")
    wheels = select_wheels(cfg, entries, progress=progress)
    tmpl = patch_template(cfg)
    nccl = inspect_nccl(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pack-", dir=out_dir) as tmp:
        t = Path(tmp)
        venv = t / "venv"
        log(f"venv: building from {len(wheels)} wheels with no network")
        wheel_dir = t / "wheels"
        wheel_dir.mkdir()
        for p in wheels.values():
            os.link(p, wheel_dir / p.name) if _same_fs(p, wheel_dir) else shutil.copy2(p, wheel_dir / p.name)
        try:
            with waiting(f"pip to build the venv from {len(wheels)} wheels"):
                build_venv(cfg.bundle.python, lock_path, wheel_dir, venv, run=run_tool)
        except proc.CommandFailed as exc:
            raise BundleError(f"building the venv from the locked wheels failed: {exc.message}",
                              hint="is the lock complete (every dependency pinned)? is bundle.python right?") from None
        with waiting("the venv to byte-compile"):
            compiled = compile_venv(venv, cfg.paths.current, log)
        if compiled:
            log("venv: byte-compiled (checked-hash .pyc, paths under "
                f"{cfg.paths.current}/venv)")
        relocate_venv(venv, str(venv), VENV_PLACEHOLDER)
        native = hash_native_libs(venv, progress=progress)
        log(f"venv: {len(native)} native libraries hashed")
        ents: list[Any] = [bundle.Entry(f"wheels/{p.name}", p, 0o644) for p in sorted(wheels.values())]
        ents.append(bundle.Entry("requirements.lock", lock_path, 0o644))
        parts = archive_venv_parts(venv, t / VENV_PARTS, progress=progress)
        log(f"venv: {len(parts)} archives, one per distribution and {BASE_PART} (under {VENV_PARTS}/)")
        ents += [bundle.Entry(f"{VENV_PARTS}/{p.name}", p, 0o644) for p in parts]
        inputs: dict[str, Any] = {
            "config_sha256": cfg.source_sha256, "lock_sha256": hash_file(lock_path),
            "python": cfg.bundle.python, "venv_placeholder": VENV_PLACEHOLDER,
            "backends": sorted(cfg.backends), "default_backend": cfg.default_backend,
            # the replay guard (deploy_tool.box.sequence): a box refuses a lower sequence of the same name
            "bundle_name": cfg.bundle.name, "sequence": seq,
        }
        if tmpl is not None:
            original, patched, rec = tmpl
            ents.append(bundle.Entry("templates/chat_template.jinja", patched, 0o644))
            ents.append(bundle.Entry("templates/chat_template.orig.jinja", original, 0o644))
            inputs["chat_template"] = rec
        if nccl is not None:
            lib, rec = nccl
            ents.append(bundle.Entry("nccl/libnccl.so.2", lib, 0o644))
            inputs["nccl"] = rec
        for f in render.render_all(cfg):
            ents.append(bundle.Entry(("units/" if f.kind == "unit" else "env/") + f.name, f.content.encode(), 0o644))
        ents.append(bundle.Entry("config.json", resolved_config_json(cfg), 0o644))
        tool = tool_wheels(cfg)
        for p in tool:
            ents.append(bundle.Entry(f"tool/wheels/{p.name}", p, 0o644))
        if tool:
            inputs["tool_wheels"] = sorted(p.name for p in tool)
        # `python3 BUNDLE/bootstrap` on a box with no deploytool (deploy_tool/box/bootstrap.py, stdlib only)
        ents.append(bundle.Entry("bootstrap", bootstrap_script(), 0o755))
        # what an ftllm unit runs when the box has an API key (render.ftllm_launcher_argv)
        ents.append(bundle.Entry(BUNDLED_FTLLM_LAUNCHER, launcher("ftllm_launch.py"), 0o644))
        # what every unit's ExecStart= runs: the server with its env file, which no root step sees (render.py)
        script = render.launcher_script(cfg, launcher("env_launch.py"))
        for name in sorted({render.launcher_name(b) for b in cfg.backends.values()}):
            ents.append(bundle.Entry(f"{BUNDLED_ENV_LAUNCHER_DIR}/{name}", script, 0o755))
        # what the front's unit runs: the public port, held while no backend is ready (render.render_front)
        ents.append(bundle.Entry(BUNDLED_FRONT, launcher("front.py"), 0o644))
        # the deploytool.fleet collection: `ansible-galaxy collection install BUNDLE/ansible` on a controller
        ents += [bundle.Entry(f"ansible/{rel}", data, 0o644) for rel, data in collection_files()]
        log("bundle: hashing, signing and archiving")
        return bundle.write_bundle(ents, out_dir, name=cfg.bundle.name, inputs=inputs, native_libs=native,
                                   key_path=key_path, archive=True, progress=progress)


def launcher(name: str) -> bytes:
    """The release's launch/NAME: deploy_tool/box/NAME as shipped in deploytool's wheel."""
    return files("deploy_tool.box").joinpath(name).read_bytes()


def collection_files() -> list[tuple[str, bytes]]:
    """The deploytool.fleet Ansible collection (the checkout's ansible/, shipped in deploytool's wheel as
    deploy_tool.collection): (path relative to the collection, bytes), sorted; no bytecode, no package marker."""
    out: list[tuple[str, bytes]] = []

    def walk(node: Any, rel: str) -> None:
        for child in node.iterdir():
            name = f"{rel}{child.name}"
            if child.is_dir():
                if child.name != "__pycache__":
                    walk(child, name + "/")
            elif not child.name.endswith(".pyc") and not child.name.startswith(".") and name != "__init__.py":
                out.append((name, child.read_bytes()))

    walk(files("deploy_tool.collection"), "")
    return sorted(out)


def bootstrap_script() -> bytes:
    """The bundle's `bootstrap` entry point: deploy_tool/box/bootstrap.py as shipped in deploytool's own wheel."""
    return files("deploy_tool.box").joinpath("bootstrap.py").read_bytes()


def tool_wheels(cfg: Config) -> list[Path]:
    d = cfg.bundle.tool_wheels_dir
    if not d:
        return []
    p = Path(d)
    if not p.is_dir():
        raise InputError(f"bundle.tool_wheels_dir {p} does not exist", hint="run `deploytool lock` first (it fills "
                         "it with deploytool's own wheel and its dependencies')")
    wheels = sorted(x for x in p.iterdir() if x.suffix == ".whl")
    for w in wheels:
        if w.name.startswith("deploytool-"):
            check_tool_reads_format(w)
    return wheels


_READS = re.compile(rb"^SUPPORTED_FORMAT_VERSIONS = frozenset\(\{([\d, ]+)\}\)", re.M)


def check_tool_reads_format(wheel: Path) -> None:
    """The deploytool a bundle carries must read the MANIFEST it is packed with: a box bootstraps with it, and it
    becomes the box's deploytool. A wheel left by a `lock` of an older deploytool reads format 1 only."""
    try:
        with zipfile.ZipFile(wheel) as z:
            text = z.read("deploy_tool/manifest.py")
    except (OSError, KeyError, zipfile.BadZipFile) as exc:
        raise BundleError(f"tool wheel {wheel.name}: cannot read its deploy_tool/manifest.py ({exc})",
                          hint="run `deploytool lock` again to rebuild deploytool's own wheel") from None
    m = _READS.search(text)
    reads = {int(v) for v in m.group(1).replace(b" ", b"").split(b",") if v} if m else set()
    if FORMAT_VERSION not in reads:
        raise BundleError(f"tool wheel {wheel.name} reads MANIFEST format {sorted(reads) or '?'}, and this bundle "
                          f"is format {FORMAT_VERSION}: a box would install it with a deploytool that refuses it",
                          hint="run `deploytool lock` again: it rebuilds deploytool's own wheel from this deploytool")


def _same_fs(a: Path, d: Path) -> bool:
    try:
        return a.stat().st_dev == d.stat().st_dev
    except OSError:
        return False
