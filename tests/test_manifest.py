"""MANIFEST, hashing and Ed25519 signatures: canonical bytes, strict parsing, real keys."""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import pytest

from deploy_tool import manifest as mf
from deploy_tool.errors import BundleError, InputError
from deploy_tool.hashing import CHUNK
from deploy_tool.manifest import FileEntry, Manifest
from deploy_tool.progress import ProgressBar, make_progress, progress_for
from tests.support.bundles import make_keys

SHA = "a" * 64


def _m(**kw) -> Manifest:
    files = kw.pop("files", [FileEntry("wheels/b.whl", 3, 0o644, SHA), FileEntry("a.txt", 1, 0o755, "b" * 64)])
    return Manifest.build(files, inputs=kw.pop("inputs", {"lock_sha256": "c" * 64, "nccl": {"archs": ["sm_75"]}}),
                          native_libs=kw.pop("native_libs", {"lib/x.so": "d" * 64}), created=kw.pop("created", None))


def _reject(data: bytes | dict) -> str:
    if isinstance(data, dict):
        data = (json.dumps(data, sort_keys=True, indent=1) + "\n").encode()
    with pytest.raises(BundleError) as ei:
        Manifest.from_bytes(data)
    return ei.value.reason


# ---------------------------------------------------------------------------------------------- hashing

@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5])
def test_hash_file_matches_hashlib(tmp_path: Path, size: int) -> None:
    """hash_file equals hashlib's SHA-256 at chunk-boundary sizes."""
    data = os.urandom(size)
    p = tmp_path / "f"
    p.write_bytes(data)
    assert mf.hash_file(p) == hashlib.sha256(data).hexdigest()


def test_hash_files_parallel_equals_serial_and_reports_progress(tmp_path: Path) -> None:
    """Parallel hashing gives the same digests as serial, keyed as given, and progress reaches the byte total."""
    paths = []
    for i in range(12):
        p = tmp_path / f"f{i}"
        p.write_bytes(os.urandom(i * 300_000 + 7))
        paths.append(p)
    seen: list[tuple[str, int, int]] = []
    par = mf.hash_files(paths, workers=4, progress=lambda ph, d, t: seen.append((ph, d, t)))
    ser = mf.hash_files(paths, workers=1)
    assert par == ser == {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}
    total = sum(p.stat().st_size for p in paths)
    assert seen[-1][2] == total and max(d for _, d, _ in seen) == total


def test_hash_file_errors_are_input_errors(tmp_path: Path) -> None:
    """A missing file or a directory is an InputError naming it, not a traceback."""
    with pytest.raises(InputError, match="missing"):
        mf.hash_file(tmp_path / "missing")
    with pytest.raises(InputError, match="not a regular file"):
        mf.hash_file(tmp_path)


def test_hash_file_refuses_fifo_without_hanging(tmp_path: Path) -> None:
    """A fifo where a file should be is refused at once instead of blocking the open."""
    os.mkfifo(tmp_path / "p")
    with pytest.raises(InputError, match="not a regular file"):
        mf.hash_file(tmp_path / "p")


def test_hash_file_no_follow(tmp_path: Path) -> None:
    """With follow_symlinks=False a symlink is refused rather than hashed through."""
    (tmp_path / "t").write_text("x")
    os.symlink("t", tmp_path / "l")
    with pytest.raises(InputError):
        mf.hash_file(tmp_path / "l", follow_symlinks=False)


def test_hash_native_libs(tmp_path: Path) -> None:
    """Every regular *.so / *.so.N under the venv is hashed by relative path; symlinks and other files are not."""
    d = tmp_path / "lib"
    d.mkdir()
    (d / "a.so").write_bytes(b"a")
    (d / "b.so.1.2").write_bytes(b"b")
    (d / "c.cpython-311-x86_64-linux-gnu.so").write_bytes(b"c")
    (d / "x.py").write_bytes(b"x")
    (d / "resolve.sox").write_bytes(b"no")
    os.symlink("b.so.1.2", d / "b.so")
    got = mf.hash_native_libs(tmp_path)
    assert got == {"lib/a.so": hashlib.sha256(b"a").hexdigest(), "lib/b.so.1.2": hashlib.sha256(b"b").hexdigest(),
                   "lib/c.cpython-311-x86_64-linux-gnu.so": hashlib.sha256(b"c").hexdigest()}


# ---------------------------------------------------------------------------------------------- manifest

def test_canonical_roundtrip_and_sorting() -> None:
    """to_bytes is canonical (sorted, trailing newline) and from_bytes reads back an equal manifest."""
    m = _m()
    data = m.to_bytes()
    assert data.endswith(b"}\n") and data.count(b"\n\n") == 0
    assert [f.path for f in m.files] == ["a.txt", "wheels/b.whl"]
    assert Manifest.from_bytes(data) == m
    assert _m().to_bytes() == data
    assert b'"mode": "0755"' in data


def test_bundle_id_is_content_derived() -> None:
    """The id changes with any file or input, and not with the creation time."""
    base = _m().bundle_id
    assert len(base) == 16
    assert _m(created="2030-01-01T00:00:00Z").bundle_id == base
    assert _m(inputs={"lock_sha256": "e" * 64}).bundle_id != base
    assert _m(files=[FileEntry("a.txt", 1, 0o644, "b" * 64)]).bundle_id != base
    assert _m(native_libs={}).bundle_id != base


def test_created_from_source_date_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    """created comes from SOURCE_DATE_EPOCH (0 by default); a bad value is an InputError."""
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    assert _m().created == "1970-01-01T00:00:00Z"
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    assert _m().created == "2023-11-14T22:13:20Z"
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "yesterday")
    with pytest.raises(InputError, match="SOURCE_DATE_EPOCH"):
        _m()


def _good() -> dict:
    return json.loads(_m().to_bytes())


def _with(edit) -> dict:
    obj = _good()
    edit(obj)
    return obj


@pytest.mark.parametrize(("edit", "reason"), [
    (lambda o: o.__setitem__("extra", 1), "unknown-key"),
    (lambda o: o["files"][0].__setitem__("uid", 0), "unknown-key"),
    (lambda o: o.pop("inputs"), "missing-key"),
    (lambda o: o["files"][0].pop("sha256"), "missing-key"),
    (lambda o: o.__setitem__("format_version", 3), "format-version-unsupported"),
    (lambda o: o.__setitem__("format_version", "1"), "wrong-type"),
    (lambda o: o.__setitem__("format_version", True), "wrong-type"),
    (lambda o: o["files"][0].__setitem__("size", "1"), "wrong-type"),
    (lambda o: o["files"][0].__setitem__("size", True), "wrong-type"),
    (lambda o: o["files"][0].__setitem__("size", -1), "wrong-type"),
    (lambda o: o["files"][0].__setitem__("mode", 420), "wrong-type"),
    (lambda o: o["files"][0].__setitem__("mode", "0600"), "bad-mode"),
    (lambda o: o["files"][0].__setitem__("mode", "4755"), "bad-mode"),
    (lambda o: o["files"][0].__setitem__("sha256", "A" * 64), "bad-hash"),
    (lambda o: o["files"][0].__setitem__("path", "/etc/passwd"), "absolute-path"),
    (lambda o: o["files"][0].__setitem__("path", "../x"), "dotdot-path"),
    (lambda o: o["files"][0].__setitem__("path", "a//b"), "bad-path"),
    (lambda o: o["files"][0].__setitem__("path", "./a"), "bad-path"),
    (lambda o: o["files"][0].__setitem__("path", "MANIFEST"), "reserved-path"),
    (lambda o: o["files"].append(dict(o["files"][-1])), "duplicate-path"),
    (lambda o: o["files"].reverse(), "manifest-not-canonical"),
    (lambda o: o.__setitem__("files", {}), "wrong-type"),
    (lambda o: o["files"][0].__setitem__("size", 999), "bundle-id-mismatch"),
    (lambda o: o["native_libs"].__setitem__("/abs.so", SHA), "absolute-path"),
    (lambda o: o.__setitem__("bundle_id", "xyz"), "wrong-type"),
    (lambda o: o.__setitem__("created", "yesterday"), "wrong-type"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_strict_parser_rejects(edit, reason: str) -> None:
    """Every malformed MANIFEST is rejected with its named reason."""
    assert _reject(_with(edit)) == reason


def test_parser_rejects_non_canonical_bytes() -> None:
    """Same content in other spacing, duplicate JSON keys, NaN, non-JSON and non-ASCII bytes are all rejected."""
    good = _m().to_bytes()
    assert _reject(json.dumps(json.loads(good), sort_keys=True).encode() + b"\n") == "manifest-not-canonical"
    assert _reject(good.rstrip(b"\n")) == "manifest-not-canonical"
    assert _reject(good.replace(b'{\n "bundle_id"', b'{\n "created": "x",\n "bundle_id"', 1)) == \
        "manifest-malformed"
    assert _reject(b'{"format_version": NaN}') == "manifest-malformed"
    assert _reject(b"\xff\xfe") == "manifest-malformed"
    assert _reject(b"[]") == "manifest-malformed"
    assert _reject(b"{}") == "missing-key"


def test_manifest_inputs_must_be_json() -> None:
    """Inputs that are not JSON values (a Path, NaN) are an InputError, not a traceback."""
    with pytest.raises(InputError, match="plain JSON"):
        _m(inputs={"template": Path("/x")})
    with pytest.raises(InputError):
        _m(inputs={"ratio": float("nan")})


def test_modules_import_alone_without_cli() -> None:
    """manifest, archive, bundle and progress import on their own and never pull in the CLI (one-way data flow)."""
    import subprocess
    import sys

    for mod in ("deploy_tool.progress", "deploy_tool.manifest", "deploy_tool.archive", "deploy_tool.bundle"):
        code = f"import sys, {mod}; assert not any(m.startswith('deploy_tool.cli') for m in sys.modules)"
        subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


def test_manifest_build_rejects_conflicting_paths() -> None:
    """A file that is also another file's directory cannot be in a manifest."""
    with pytest.raises(BundleError) as ei:
        _m(files=[FileEntry("a", 1, 0o644, SHA), FileEntry("a/b", 1, 0o644, SHA)])
    assert ei.value.reason == "path-conflict"


# ---------------------------------------------------------------------------------------------- signatures

def test_keypair_files_and_modes(tmp_path: Path) -> None:
    """generate_keypair writes a 0600 PEM private key, a public key, returns the id, refuses to overwrite."""
    kid = mf.generate_keypair(tmp_path / "k.key", tmp_path / "k.pub")
    assert (tmp_path / "k.key").stat().st_mode & 0o777 == 0o600
    assert b"BEGIN PUBLIC KEY" in (tmp_path / "k.pub").read_bytes()
    assert mf.public_key_id(tmp_path / "k.key") == kid
    before = (tmp_path / "k.key").read_bytes()
    with pytest.raises(InputError, match="already exists"):
        mf.generate_keypair(tmp_path / "k.key", tmp_path / "k2.pub")
    assert (tmp_path / "k.key").read_bytes() == before and not (tmp_path / "k2.pub").exists()
    kid2 = mf.generate_keypair(tmp_path / "k.key", tmp_path / "k.pub", force=True)
    assert kid2 != kid and (tmp_path / "k.key").stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.key", "k.pub"]


def test_sign_verify_and_reasons(tmp_path: Path) -> None:
    """A real Ed25519 signature verifies; other bytes, other keys and broken files fail with named reasons."""
    keys = make_keys(tmp_path / "a")
    stranger = make_keys(tmp_path / "b", name="stranger")
    data = _m().to_bytes()
    sig = mf.sign(data, keys.private)
    assert mf.sign(data, keys.private) == sig  # Ed25519 is deterministic
    obj = json.loads(sig)
    assert obj["key_id"] == keys.key_id and obj["algorithm"] == "ed25519"
    assert mf.verify_signature(data, sig, keys.trusted_dir) == keys.key_id

    def reason(d: bytes, s: bytes, kd: Path) -> str:
        with pytest.raises(BundleError) as ei:
            mf.verify_signature(d, s, kd)
        return ei.value.reason

    assert reason(data + b" ", sig, keys.trusted_dir) == "signature-invalid"
    assert reason(data, mf.sign(data, stranger.private), keys.trusted_dir) == "untrusted-key"
    forged = json.dumps({**obj, "key_id": keys.key_id, "signature": json.loads(mf.sign(data, stranger.private))[
        "signature"]}, sort_keys=True, separators=(",", ":")).encode()
    assert reason(data, forged, keys.trusted_dir) == "signature-invalid"
    assert reason(data, b"not json", keys.trusted_dir) == "signature-malformed"
    assert reason(data, json.dumps({**obj, "algorithm": "rsa"}).encode(), keys.trusted_dir) == "signature-malformed"
    assert reason(data, json.dumps({**obj, "signature": "AAAA"}).encode(), keys.trusted_dir) == "signature-malformed"
    assert reason(data, sig, tmp_path / "nowhere") == "no-trusted-keys"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert reason(data, sig, empty) == "no-trusted-keys"
    (empty / "junk.pub").write_text("not a key")
    assert reason(data, sig, empty) == "trusted-key-invalid"


def test_sign_with_bad_key_file(tmp_path: Path) -> None:
    """A missing or non-Ed25519 signing key is an InputError with a keygen hint."""
    with pytest.raises(InputError) as ei:
        mf.sign(b"x", tmp_path / "missing.key")
    assert "keygen" in (ei.value.hint or "")
    (tmp_path / "bad.key").write_text("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    with pytest.raises(InputError):
        mf.sign(b"x", tmp_path / "bad.key")


# ---------------------------------------------------------------------------------------------- progress

class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_off_for_non_tty_and_json() -> None:
    """No bar when stderr is not a terminal or output is JSON; a bar on a terminal."""
    assert progress_for(stream=io.StringIO()) is None
    assert progress_for(json_mode=True, stream=_Tty()) is None
    assert make_progress(enabled=False, stream=_Tty()) is None
    assert isinstance(progress_for(stream=_Tty()), ProgressBar)


def test_progress_bar_draws_and_ends_lines() -> None:
    """The bar shows phase and percentage and ends each finished phase with a newline."""
    s = _Tty()
    bar = ProgressBar(s, interval=0)
    bar("hashing", 50, 100)
    bar("hashing", 100, 100)
    bar("hashing", 100, 100)
    bar("archiving", 1, 2)
    bar.close()
    out = s.getvalue()
    assert "hashing" in out and "100.0%" in out and " 50.0%" in out
    assert out.count("100.0%") == 1
    assert out.endswith("\n") and "archiving" in out


def test_a_format_1_manifest_of_a_bundle_packed_before_the_venv_parts_still_reads() -> None:
    """deploytool writes format 2 (the venv may come in parts); a bundle packed before, format 1 (its venv one
    venv.tar.zst), still reads, its id checked as 1's (the ship's reader: tests/test_ship.py)."""
    m = _m()
    assert m.format_version == mf.FORMAT_VERSION == 2
    old = Manifest(1, mf.compute_bundle_id(m.files, m.inputs, m.native_libs, 1), m.created, m.inputs, m.files,
                   m.native_libs)
    raw = old.to_bytes()
    back = Manifest.from_bytes(raw)
    assert back.format_version == 1 and back.bundle_id == old.bundle_id != m.bundle_id
    assert _reject(json.loads(raw) | {"bundle_id": m.bundle_id}) == "bundle-id-mismatch"  # the id is the version's
