"""Helpers for bundle tests: real Ed25519 keys, a bundle with one file of each kind, hostile archive crafting."""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zstandard

from deploy_tool import archive, bundle
from deploy_tool.manifest import generate_keypair


@dataclass
class Keys:
    private: Path
    trusted_dir: Path
    key_id: str


def make_keys(base: Path, name: str = "signer", trusted: bool = True) -> Keys:
    """A real Ed25519 key pair; the public half goes into its own trusted-keys directory if `trusted`."""
    base.mkdir(parents=True, exist_ok=True)
    trusted_dir = base / f"{name}-trusted"
    trusted_dir.mkdir(exist_ok=True)
    pub = (trusted_dir if trusted else base) / f"{name}.pub"
    kid = generate_keypair(base / f"{name}.key", pub)
    return Keys(base / f"{name}.key", trusted_dir, kid)


def make_wheel(path: Path, name: str = "demo_pkg", version: str = "1.0", payload: bytes = b"") -> Path:
    """A small but real wheel (zip with a module, METADATA and WHEEL), reproducible (fixed zip times)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    files = {
        f"{name}/__init__.py": b"VALUE = 42\n" + payload,
        f"{name}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{name}-{version}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for arc, data in sorted(files.items()):
            zi = zipfile.ZipInfo(arc, date_time=(1980, 1, 1, 0, 0, 0))
            z.writestr(zi, data)
    return path


def make_venv_tree(root: Path, *, big: int = 200_000) -> Path:
    """A venv-shaped tree: bin/python3 (exec), bin/python -> python3, lib64 -> lib, a native lib, an empty dir."""
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python3").write_bytes(b"\x7fELF fake interpreter\n" + os.urandom(64))
    os.chmod(root / "bin" / "python3", 0o755)
    os.symlink("python3", root / "bin" / "python")
    sp = root / "lib" / "python3.11" / "site-packages" / "ftllm"
    sp.mkdir(parents=True)
    (sp / "__init__.py").write_text("from .llm import *\n")
    (sp / "libfastllm_tools.so").write_bytes(os.urandom(big))
    (sp / "libextra.so.1").write_bytes(os.urandom(1000))
    os.symlink("libextra.so.1", sp / "libextra.so")
    os.symlink("lib", root / "lib64")
    (root / "include" / "python3.11").mkdir(parents=True)
    (root / "pyvenv.cfg").write_text("home = /usr/bin\nversion = 3.11.7\n")
    deep = root / "lib" / "python3.11" / "site-packages" / ("a_very_long_directory_name_" * 3) / ("x" * 90)
    deep.mkdir(parents=True)
    (deep / "module_with_a_long_name_beyond_the_ustar_limit.py").write_text("pass\n")
    return root


def sample_inputs(src: Path) -> dict[str, Path]:
    """One real input file of each kind a bundle carries: wheel, venv archive, template, NCCL, unit, config."""
    src.mkdir(parents=True, exist_ok=True)
    make_wheel(src / "demo_pkg-1.0-py3-none-any.whl")
    venv = make_venv_tree(src / "venv")
    archive.archive_tree(venv, src / "venv.tar.zst", mtime=0)
    (src / "chat_template.jinja").write_text("{% set reasoning_effort = 'low' %}\n{{ messages }}\n")
    (src / "libnccl.so.2").write_bytes(b"\x7fELF" + os.urandom(50_000))
    (src / "ftllm-dflash.service").write_text("[Unit]\nDescription=ftllm\n[Service]\nExecStart=/bin/true\n")
    (src / "config.json").write_text('{"default_backend": "ftllm-dflash"}\n')
    return {
        "wheel": src / "demo_pkg-1.0-py3-none-any.whl",
        "venv": src / "venv.tar.zst",
        "template": src / "chat_template.jinja",
        "nccl": src / "libnccl.so.2",
        "unit": src / "ftllm-dflash.service",
        "config": src / "config.json",
    }


ARCNAMES = {
    "wheel": "wheels/demo_pkg-1.0-py3-none-any.whl",
    "venv": "venv.tar.zst",
    "template": "templates/chat_template.jinja",
    "nccl": "nccl/libnccl.so.2",
    "unit": "units/ftllm-dflash.service",
    "config": "config.json",
}


def sample_entries(inputs: dict[str, Path]) -> list[bundle.Entry]:
    ents = [bundle.Entry(ARCNAMES[k], p, 0o644) for k, p in inputs.items()]
    ents.append(bundle.Entry("bin/deploytool-hook", b"#!/bin/sh\nexit 0\n", 0o755))
    return ents


SAMPLE_INPUTS = {"config_sha256": "0" * 64, "lock_sha256": "1" * 64, "nccl": {"archs": ["sm_75"], "forced": False},
                 "chat_template": {"origin": "local", "patched": True}}


def write_sample_bundle(tmp: Path, keys: Keys, *, out: str = "out", name: str = "demo",
                        extra_inputs: dict | None = None, inputs_dir: str = "src") -> bundle.BundleInfo:
    inputs = sample_inputs(tmp / inputs_dir) if not (tmp / inputs_dir).exists() else _existing(tmp / inputs_dir)
    return bundle.write_bundle(sample_entries(inputs), tmp / out, name=name,
                               inputs={**SAMPLE_INPUTS, **(extra_inputs or {})},
                               native_libs={"lib/python3.11/site-packages/ftllm/libfastllm_tools.so": "2" * 64},
                               key_path=keys.private)


def _existing(src: Path) -> dict[str, Path]:
    return {k: src / Path(v).name for k, v in {
        "wheel": "demo_pkg-1.0-py3-none-any.whl", "venv": "venv.tar.zst", "template": "chat_template.jinja",
        "nccl": "libnccl.so.2", "unit": "ftllm-dflash.service", "config": "config.json"}.items()}


def snapshot(root: Path, *, exclude: Path | None = None) -> dict[str, tuple[int, int]]:
    """{relative path: (size, mtime_ns)} of everything under root (symlinks not followed), minus `exclude`."""
    out: dict[str, tuple[int, int]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        if exclude is not None and (d == exclude or exclude in d.parents):
            dirnames[:] = []
            continue
        for n in dirnames + filenames:
            p = d / n
            if exclude is not None and p == exclude:
                continue
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


# ------------------------------------------------------------------------------------------- hostile archives

Member = tuple[tarfile.TarInfo, bytes | None]


def read_members(path: Path) -> list[Member]:
    """Every member of a (possibly zstd-compressed) tar, with its data."""
    raw = path.read_bytes()
    if raw[:4] == b"\x28\xb5\x2f\xfd":
        raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw), read_across_frames=True).read()
    out: list[Member] = []
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tf:
        for ti in tf.getmembers():
            data = tf.extractfile(ti).read() if ti.isfile() else None  # type: ignore[union-attr]
            out.append((ti, data))
    return out


def write_members(path: Path, members: list[Member], *, compress: bool = True,
                  fmt: int = tarfile.GNU_FORMAT) -> Path:
    """Write members as given (any order, any type, duplicates allowed), optionally zstd-compressed."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for ti, data in members:
            if data is not None:
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
            else:
                tf.addfile(ti)
    raw = buf.getvalue()
    if compress:
        raw = zstandard.ZstdCompressor(level=3).compress(raw)
    path.write_bytes(raw)
    return path


def member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes | None = None, *, mode: int = 0o644,
           linkname: str = "") -> Member:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.mode = mode
    ti.linkname = linkname
    if kind in (tarfile.CHRTYPE, tarfile.BLKTYPE):
        ti.devmajor, ti.devminor = 1, 3
    return ti, (data if kind == tarfile.REGTYPE else None)


def mutate_archive(src: Path, dst: Path, fn: Callable[[list[Member]], list[Member]], *,
                   compress: bool = True) -> Path:
    return write_members(dst, fn(read_members(src)), compress=compress)


def bundle_dir_copy(bundle: Path, dest: Path) -> Path:
    """A private copy of the bundle directory packed beside `bundle` (the form the README tells to rsync)."""
    src = bundle.parent / bundle.name.split(".tar")[0]
    out = dest / src.name
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(src, out)
    return out


def swap_same_size(p: Path) -> bytes:
    """Replace p (rename over it, as an attacker would) with other bytes of the same size and mode."""
    data = p.read_bytes()
    other = bytes(b ^ 0x20 if 0x41 <= (b & 0xDF) <= 0x5A else b for b in data) if b"\0" not in data[:4096] \
        else data[:-1] + bytes([data[-1] ^ 1])
    assert other != data and len(other) == len(data)
    tmp = p.with_name(p.name + ".swap")
    tmp.write_bytes(other)
    tmp.chmod(p.stat().st_mode & 0o7777)
    os.replace(tmp, p)
    return other


def rebundle(src: Path, dest: Path, key: Path, *, sequence: int | None = None, name: str | None = None,
             legacy: bool = False) -> Path:
    """A bundle directory with `src`'s files under a new MANIFEST: its inputs' sequence (and bundle_name) as given
    (legacy: neither, as packed before sequences), signed by `key`; a new bundle id, so a new release. No repack:
    what pack would write for the same inputs with another --sequence (the files do not depend on it).
    `src`: a bundle directory or its archive (the directory beside it is used)."""
    from deploy_tool import manifest as mf

    if src.is_file():
        src = src.parent / src.name.split(".tar")[0]
    old = mf.Manifest.from_bytes((src / mf.MANIFEST_NAME).read_bytes())
    inputs = dict(old.inputs)
    if legacy:
        inputs.pop("sequence", None)
        inputs.pop("bundle_name", None)
    if sequence is not None:
        inputs["sequence"] = sequence
    if name is not None:
        inputs["bundle_name"] = name
    new = mf.Manifest.build(old.files, inputs=inputs, native_libs=old.native_libs, created=old.created)
    out = dest / f"{src.name.rsplit('-', 1)[0]}-{new.bundle_id}"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns(mf.MANIFEST_NAME, mf.SIGNATURE_NAME))
    data = new.to_bytes()
    (out / mf.MANIFEST_NAME).write_bytes(data)
    (out / mf.SIGNATURE_NAME).write_bytes(mf.sign(data, key))
    for f in (mf.MANIFEST_NAME, mf.SIGNATURE_NAME):
        os.chmod(out / f, 0o644)
    return out


def resign(src: Path, dest: Path, key: Path) -> Path:
    """A copy of the bundle directory `src` (or the one beside the archive `src`) signed by `key` instead."""
    from deploy_tool import manifest as mf

    if src.is_file():
        src = src.parent / src.name.split(".tar")[0]
    out = dest / src.name
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(src, out)
    (out / mf.SIGNATURE_NAME).write_bytes(mf.sign((out / mf.MANIFEST_NAME).read_bytes(), key))
    return out
