"""The host side of deploytool.fleet.ship (ansible/plugins/module_utils/ship_core.py) on local directories.

What a host has (by SHA-256, from the MANIFESTs of the bundles under DEST), the staging directory seeded with it,
the verify of every staged file against the MANIFEST before the one rename, `keep`, check mode, and the trust
record that stands in for re-reading earlier files (never for a file changed since). The transfer in between is
rsync's in the real thing (tests/test_ship_fleet.py); here the missing files are copied in from the bundle, as rsync
would write them. The controller's rsync stats parser is checked on real rsync output.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy_tool.errors import BundleError
from deploy_tool.manifest import FileEntry, Manifest, compute_bundle_id
from tests.support.examples import examples

REPO = Path(__file__).resolve().parents[1]
CORE = REPO / "ansible" / "plugins" / "module_utils" / "ship_core.py"


def _load():
    spec = importlib.util.spec_from_file_location("ship_core", CORE)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ship_core"] = mod
    spec.loader.exec_module(mod)
    return mod


sc = _load()


def make_bundle(root: Path, files: dict[str, bytes], modes: dict[str, int] | None = None,
                inputs: dict | None = None, format_version: int = 2) -> tuple[Path, object]:
    """A bundle directory (files + a real deploytool MANIFEST) at root/<bundle_id>; returns (dir, parsed).
    `format_version` 1: as deploytool before 2026-12-06 packed it."""
    modes = modes or {}
    ents = [FileEntry(p, len(b), modes.get(p, 0o644), hashlib.sha256(b).hexdigest()) for p, b in files.items()]
    m = Manifest.build(ents, inputs=inputs or {}, created="2026-01-01T00:00:00Z")
    if format_version != m.format_version:
        m = Manifest(format_version, compute_bundle_id(m.files, m.inputs, m.native_libs, format_version), m.created,
                     m.inputs, m.files, m.native_libs)
    d = root / f"bundle-{m.bundle_id}"
    d.mkdir(parents=True)
    for p, b in files.items():
        q = d / p
        q.parent.mkdir(parents=True, exist_ok=True)
        q.write_bytes(b)
        os.chmod(q, modes.get(p, 0o644))
    (d / "MANIFEST").write_bytes(m.to_bytes())
    (d / "MANIFEST.sig").write_text('{"sig":"x"}\n')
    return d, sc.parse_manifest(m.to_bytes())


def send(src: Path, staging: str, missing: list[str]) -> None:
    """What rsync does in the real thing: the missing files into the staging directory, with their modes."""
    for rel in missing:
        dst = Path(staging, rel)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, dst)


def ship(dest: Path, src: Path, m, *, keep: int = 3, rehash: bool = False, link: bool = False) -> dict:
    prep = sc.prepare(str(dest), m, rehash=rehash, link=link)
    if prep["present"]:
        return prep
    send(src, prep["staging"], prep["missing"])
    prep["commit"] = sc.commit(str(dest), prep["staging"], m, signature=b'{"sig":"x"}\n', keep=keep,
                               rehash=rehash)
    return prep


def tree(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def leftovers(dest: Path) -> list[str]:
    return sorted(p.name for p in dest.iterdir() if p.name.startswith((".incoming-", ".outgoing-")))


FILES_A = {"venv.tar.zst": b"V" * 5000, "wheels/a-1.whl": b"wheel a", "wheels/b-1.whl": b"wheel b",
           "bootstrap": b"#!/bin/sh\n", "units/x.service": b"[Unit]\n"}


@pytest.fixture
def dest(tmp_path: Path) -> Path:
    return tmp_path / "host" / "bundles"


def test_first_ship_sends_everything_and_lands_verified(tmp_path, dest):
    src, m = make_bundle(tmp_path / "ctl", FILES_A, {"bootstrap": 0o755})
    r = ship(dest, src, m)
    assert r["present"] is False and sorted(r["missing"]) == sorted(FILES_A) and r["reused_files"] == 0
    assert r["missing_bytes"] == sum(map(len, FILES_A.values()))
    final = dest / m.bundle_id
    assert r["commit"]["path"] == str(final)
    assert tree(final) == tree(src)  # files, MANIFEST and MANIFEST.sig, byte for byte
    assert os.stat(final / "bootstrap").st_mode & 0o777 == 0o755
    assert leftovers(dest) == []


def test_reship_of_a_present_release_is_no_change_and_reads_nothing(tmp_path, dest):
    src, m = make_bundle(tmp_path / "ctl", FILES_A)
    ship(dest, src, m)
    time.sleep(sc.RACY_NS / 1e9)
    again = sc.prepare(str(dest), m)
    assert again["present"] is True and again["staging"] is None and again["missing"] == []
    assert again["hashed_bytes"] == 0, "the trust record vouches for the files just verified"
    assert sc.prepare(str(dest), m, rehash=True)["hashed_bytes"] == m.total_size
    assert leftovers(dest) == []


def test_a_bundle_signed_again_is_shipped_again_sending_nothing(tmp_path, dest):
    src, m = make_bundle(tmp_path / "ctl", FILES_A)
    ship(dest, src, m)
    time.sleep(sc.RACY_NS / 1e9)
    assert sc.prepare(str(dest), m, signature=b'{"sig":"x"}\n')["present"] is True
    prep = sc.prepare(str(dest), m, signature=b'{"sig":"new key"}\n')
    assert prep["present"] is False and prep["missing"] == [] and prep["hashed_bytes"] == 0
    sc.commit(str(dest), prep["staging"], m, signature=b'{"sig":"new key"}\n')
    assert (dest / m.bundle_id / "MANIFEST.sig").read_bytes() == b'{"sig":"new key"}\n'
    assert tree(dest / m.bundle_id) | {"MANIFEST.sig": b""} == tree(src) | {"MANIFEST.sig": b""}
    assert leftovers(dest) == []


def test_second_release_reuses_what_the_host_has_at_any_path(tmp_path, dest):
    src_a, ma = make_bundle(tmp_path / "ctl", FILES_A)
    ship(dest, src_a, ma)
    files_b = dict(FILES_A)
    files_b["wheels/b-2.whl"] = b"wheel b two"
    del files_b["wheels/b-1.whl"]
    files_b["moved/a-1.whl"] = FILES_A["wheels/a-1.whl"]  # same bytes at another path: reused
    src_b, mb = make_bundle(tmp_path / "ctl", files_b)
    r = ship(dest, src_b, mb)
    assert r["missing"] == ["wheels/b-2.whl"]
    assert r["reused_files"] == len(files_b) - 1
    final = dest / mb.bundle_id
    assert tree(final) == tree(src_b)
    # reused by a local copy, not a hard link: deploytool's bundle verify refuses a file with other links
    for new, old in (("venv.tar.zst", "venv.tar.zst"), ("moved/a-1.whl", "wheels/a-1.whl")):
        a, b = os.stat(final / new), os.stat(dest / ma.bundle_id / old)
        assert a.st_ino != b.st_ino and a.st_nlink == b.st_nlink == 1
    assert all(os.lstat(p).st_nlink == 1 for p in final.rglob("*") if p.is_file())


@pytest.mark.parametrize("link", [False, True])
def test_same_bytes_with_another_mode_are_copied_not_linked(tmp_path, dest, link):
    src_a, ma = make_bundle(tmp_path / "ctl", {"tool": b"run me"})
    ship(dest, src_a, ma)
    src_b, mb = make_bundle(tmp_path / "ctl", {"tool": b"run me", "x": b"y"}, {"tool": 0o755})
    r = ship(dest, src_b, mb, link=link)
    assert r["missing"] == ["x"]
    a, b = os.stat(dest / ma.bundle_id / "tool"), os.stat(dest / mb.bundle_id / "tool")
    assert a.st_ino != b.st_ino and a.st_mode & 0o777 == 0o644 and b.st_mode & 0o777 == 0o755


@pytest.mark.parametrize("how", ["write", "write-keep-mtime", "replace", "chmod"])
@pytest.mark.parametrize("rehash", [False, True])
def test_a_file_changed_on_the_host_is_never_reused(tmp_path, dest, how, rehash):
    src_a, ma = make_bundle(tmp_path / "ctl", FILES_A)
    ship(dest, src_a, ma)
    time.sleep(sc.RACY_NS / 1e9)
    victim = dest / ma.bundle_id / "wheels/a-1.whl"
    before = os.stat(victim)
    if how.startswith("write"):
        victim.write_bytes(b"WHEEL A")  # same size
        if how == "write-keep-mtime":
            os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))
    elif how == "replace":
        tmp = victim.with_name("t")
        tmp.write_bytes(b"WHEEL A")
        os.utime(tmp, ns=(before.st_atime_ns, before.st_mtime_ns))
        os.replace(tmp, victim)
    else:
        os.chmod(victim, 0o600)
    files_b = dict(FILES_A, extra=b"new")
    src_b, mb = make_bundle(tmp_path / "ctl", files_b)
    r = ship(dest, src_b, mb, rehash=rehash)
    if how == "chmod":
        # content intact: reused, with a copy at the mode the MANIFEST wants
        assert sorted(r["missing"]) == ["extra"]
        assert os.stat(dest / mb.bundle_id / "wheels/a-1.whl").st_mode & 0o777 == 0o644
    else:
        assert sorted(r["missing"]) == ["extra", "wheels/a-1.whl"], r
        assert str(victim) in r["refused"]
    assert tree(dest / mb.bundle_id) == tree(src_b)
    # and the damaged release is not "present": shipping it again repairs it
    again = ship(dest, src_a, ma)
    if how != "chmod":
        # not "present"; the good copy that came with the second release is what repairs it
        assert again["present"] is False and again["missing"] == [] and again["reused_files"] == len(FILES_A)
    assert tree(dest / ma.bundle_id) == tree(src_a)
    assert leftovers(dest) == []


@pytest.mark.parametrize("damage", ["extra-file", "extra-dir", "missing-file", "mode-mismatch", "hash-mismatch",
                                    "size-mismatch", "symlink"])
def test_commit_refuses_a_staging_dir_that_differs_from_the_manifest_and_leaves_nothing(tmp_path, dest, damage):
    src, m = make_bundle(tmp_path / "ctl", FILES_A)
    prep = sc.prepare(str(dest), m)
    send(src, prep["staging"], prep["missing"])
    s = Path(prep["staging"])
    name = {"extra-file": "stowaway", "extra-dir": "empty", "missing-file": "wheels/b-1.whl",
            "mode-mismatch": "bootstrap", "hash-mismatch": "wheels/a-1.whl", "size-mismatch": "units/x.service",
            "symlink": "wheels/b-1.whl"}[damage]
    if damage == "extra-file":
        (s / name).write_text("x")
    elif damage == "extra-dir":
        (s / name).mkdir()
    elif damage == "missing-file":
        (s / name).unlink()
    elif damage == "mode-mismatch":
        os.chmod(s / name, 0o755)
    elif damage == "hash-mismatch":
        (s / name).write_bytes(b"WHEEL A")
    elif damage == "size-mismatch":
        (s / name).write_bytes(b"[Unit]\n\n")
    else:
        (s / name).unlink()
        (s / name).symlink_to(s / "wheels/a-1.whl")
    with pytest.raises(sc.ShipError) as exc:
        sc.commit(str(dest), prep["staging"], m, keep=3)
    want = {"extra-dir": "extra-file", "symlink": "special-file"}.get(damage, damage)
    assert exc.value.reason == want, exc.value
    assert name in str(exc.value) and exc.value.path == name
    assert not (dest / m.bundle_id).exists() and leftovers(dest) == []


def test_a_file_where_the_release_directory_belongs_is_replaced(tmp_path, dest):
    src, m = make_bundle(tmp_path / "ctl", FILES_A)
    dest.mkdir(parents=True)
    (dest / m.bundle_id).write_text("not a bundle")
    ship(dest, src, m)
    assert tree(dest / m.bundle_id) == tree(src) and leftovers(dest) == []


def test_an_edited_manifest_is_refused_naming_the_mismatch(tmp_path):
    src, m = make_bundle(tmp_path / "ctl", FILES_A)
    raw = (src / "MANIFEST").read_bytes()
    obj = json.loads(raw)
    obj["files"][0]["size"] += 1
    with pytest.raises(sc.ShipError, match="does not match its content") as exc:
        sc.parse_manifest(json.dumps(obj).encode())
    assert exc.value.reason == "bundle-id-mismatch"
    obj = json.loads(raw)
    obj["files"][0]["path"] = "../etc/passwd"
    with pytest.raises(sc.ShipError, match="not a clean relative path"):
        sc.parse_manifest(json.dumps(obj).encode())
    with pytest.raises(sc.ShipError, match="not valid JSON"):
        sc.parse_manifest(b"{")


def test_check_mode_reports_and_changes_nothing(tmp_path, dest):
    src_a, ma = make_bundle(tmp_path / "ctl", FILES_A)
    r = sc.prepare(str(dest), ma, check_mode=True)
    assert not dest.exists() and r["staging"] is None and sorted(r["missing"]) == sorted(FILES_A)
    ship(dest, src_a, ma)
    src_b, mb = make_bundle(tmp_path / "ctl", dict(FILES_A, extra=b"e"))
    snap = {p: (os.lstat(p).st_mtime_ns, os.lstat(p).st_ino) for p in dest.rglob("*")}
    r = sc.prepare(str(dest), mb, check_mode=True)
    assert r["missing"] == ["extra"] and r["missing_bytes"] == 1 and r["staging"] is None
    assert {p: (os.lstat(p).st_mtime_ns, os.lstat(p).st_ino) for p in dest.rglob("*")} == snap


def test_keep_removes_the_oldest_and_the_kept_stay_trusted(tmp_path, dest):
    ms = []
    for i in range(4):
        src, m = make_bundle(tmp_path / "ctl", dict(FILES_A, version=str(i).encode()))
        r = ship(dest, src, m, keep=2)
        ms.append((src, m, r))
    kept = sorted(p.name for p in dest.iterdir() if not p.name.startswith("."))
    assert kept == sorted([ms[2][1].bundle_id, ms[3][1].bundle_id])
    assert ms[3][2]["commit"]["removed"] == [str(dest / ms[1][1].bundle_id)]
    assert ms[3][2]["reused_files"] == len(FILES_A)  # the shared files came from the earlier bundles
    time.sleep(sc.RACY_NS / 1e9)
    # removing the oldest bundles left the kept ones' files and their records as they were
    r = sc.prepare(str(dest), ms[2][1])
    assert r["present"] is True and r["hashed_bytes"] == 0


@pytest.mark.parametrize("old_format", [1, 2])
@pytest.mark.parametrize("new_format", [1, 2])
@pytest.mark.parametrize("link", [None, True, False])
def test_which_files_are_linked(tmp_path, dest, link, old_format, new_format):
    """Over every combination: `link` true links and false copies; omitted (None, the module's default) links only
    between two bundles of MANIFEST format 2, which no deploytool before 2026-12-06 (the ones that refuse a linked
    file) installs. The tree shipped is the controller's either way, and `linked_files` says what was linked."""
    src_a, ma = make_bundle(tmp_path / "ctl", FILES_A, format_version=old_format)
    ship(dest, src_a, ma, link=False)
    files_b = dict(FILES_A, **{"wheels/b-1.whl": b"wheel b rebuilt"})
    src_b, mb = make_bundle(tmp_path / "ctl", files_b, format_version=new_format)
    assert (ma.format_version, mb.format_version) == (old_format, new_format)
    r = ship(dest, src_b, mb, link=link)
    linked = link if link is not None else old_format == new_format == 2
    a, b = dest / ma.bundle_id, dest / mb.bundle_id
    assert tree(b) == tree(src_b) and tree(a) == tree(src_a)
    shared = sorted(rel for rel in FILES_A if os.stat(a / rel).st_ino == os.stat(b / rel).st_ino)
    assert shared == (sorted(set(FILES_A) - {"wheels/b-1.whl"}) if linked else []), shared
    assert r["linked_files"] == len(shared) and r["reused_files"] == len(FILES_A) - 1


def test_with_link_the_kept_bundles_share_what_did_not_change(tmp_path, dest):
    """link=True: a release one file apart is the earlier bundle's files under new names (same inodes) plus the
    file sent; MANIFEST and MANIFEST.sig are its own; the tree is exactly the controller's."""
    src_a, ma = make_bundle(tmp_path / "ctl", FILES_A)
    ship(dest, src_a, ma, link=True)
    files_b = dict(FILES_A, **{"wheels/b-1.whl": b"wheel b rebuilt"})
    src_b, mb = make_bundle(tmp_path / "ctl", files_b)
    r = ship(dest, src_b, mb, link=True)
    assert r["missing"] == ["wheels/b-1.whl"]
    a, b = dest / ma.bundle_id, dest / mb.bundle_id
    assert tree(b) == tree(src_b) and tree(a) == tree(src_a)
    for rel in FILES_A:
        same = os.stat(a / rel).st_ino == os.stat(b / rel).st_ino
        assert same == (rel != "wheels/b-1.whl"), rel
    for name in ("MANIFEST", "MANIFEST.sig", "wheels/b-1.whl"):
        assert os.stat(b / name).st_nlink == 1, name
    assert leftovers(dest) == []


def test_with_link_removing_old_bundles_keeps_the_shared_files_trusted(tmp_path, dest):
    """Removing a bundle takes a name from each file it shared, which moves the file's ctime: commit records the
    kept bundles' shared files again, so the next ship trusts them without reading them."""
    ms = []
    for i in range(4):
        src, m = make_bundle(tmp_path / "ctl", dict(FILES_A, version=str(i).encode()))
        ms.append((src, m, ship(dest, src, m, keep=2, link=True)))
    assert ms[3][2]["commit"]["removed"] == [str(dest / ms[1][1].bundle_id)]
    assert os.stat(dest / ms[3][1].bundle_id / "venv.tar.zst").st_nlink == 2  # the kept two share it
    time.sleep(sc.RACY_NS / 1e9)
    for _src, m, _r in ms[2:]:
        r = sc.prepare(str(dest), m)
        assert r["present"] is True and r["hashed_bytes"] == 0, r


def test_with_link_an_aborted_ship_leaves_the_kept_bundles_trusted(tmp_path, dest):
    """A failed transfer's abort removes a staging directory of links to the kept bundles' files, which moves their
    ctimes: their records are carried across, so the retry reads none of them again."""
    src_a, ma = make_bundle(tmp_path / "ctl", FILES_A)
    ship(dest, src_a, ma, link=True)
    src_b, mb = make_bundle(tmp_path / "ctl", dict(FILES_A, version=b"2"))
    prep = sc.prepare(str(dest), mb, link=True)
    assert prep["reused_files"] == len(FILES_A) and prep["missing"] == ["version"]
    sc.abort(str(dest), prep["staging"], mb.bundle_id)
    assert leftovers(dest) == []
    time.sleep(sc.RACY_NS / 1e9)
    again = sc.prepare(str(dest), mb, link=True)
    assert again["reused_files"] == len(FILES_A) and again["hashed_bytes"] == 0, again
    sc.abort(str(dest), again["staging"], mb.bundle_id)


def test_with_link_a_killed_ships_staging_is_swept_and_the_kept_bundles_stay_trusted(tmp_path, dest):
    """A ship killed after its prepare leaves a staging directory of links; the next ship sweeps it once it is stale
    and carries the shared files' records across, so it reads none of them again."""
    src_a, ma = make_bundle(tmp_path / "ctl", FILES_A)
    ship(dest, src_a, ma, link=True)
    src_b, mb = make_bundle(tmp_path / "ctl", dict(FILES_A, version=b"2"))
    killed = sc.prepare(str(dest), mb, link=True)["staging"]
    old = time.time() - sc.STALE_SECONDS - 60
    os.utime(killed, (old, old))
    time.sleep(sc.RACY_NS / 1e9)
    again = sc.prepare(str(dest), mb, link=True)
    assert not os.path.exists(killed)
    assert again["reused_files"] == len(FILES_A) and again["hashed_bytes"] == 0, again
    sc.abort(str(dest), again["staging"], mb.bundle_id)


def test_with_link_a_damaged_shared_file_is_refused_in_every_bundle_and_sent_again(tmp_path, dest):
    """A shared file written in place through one bundle's name is damaged in every bundle that names it: each is
    refused by its hash at its next ship and gets the file again (sent, or linked from a bundle repaired since)."""
    src_a, ma = make_bundle(tmp_path / "ctl", FILES_A)
    ship(dest, src_a, ma, link=True)
    src_b, mb = make_bundle(tmp_path / "ctl", dict(FILES_A, version=b"2"))
    ship(dest, src_b, mb, link=True)
    with open(dest / ma.bundle_id / "wheels/a-1.whl", "r+b") as f:
        f.write(b"X")
    assert (dest / mb.bundle_id / "wheels/a-1.whl").read_bytes() != FILES_A["wheels/a-1.whl"]
    r = ship(dest, src_b, mb, link=True)
    assert r["present"] is False and r["missing"] == ["wheels/a-1.whl"], r
    assert tree(dest / mb.bundle_id) == tree(src_b)
    r = ship(dest, src_a, ma, link=True)  # repaired from the second bundle's new copy: nothing to send
    assert r["present"] is False and r["missing"] == [], r
    assert tree(dest / ma.bundle_id) == tree(src_a) and leftovers(dest) == []


def test_a_record_younger_than_the_clock_tick_is_not_trusted(tmp_path, dest):
    dest.mkdir(parents=True)
    f = dest / "f"
    f.write_bytes(b"abc")
    cache = sc.TrustCache(str(dest))
    st_ = os.lstat(f)
    cache.record(st_, "x" * 64, now_ns=st_.st_ctime_ns + sc.RACY_NS // 2)
    assert cache.lookup(st_) is None
    cache.record(st_, "x" * 64, now_ns=st_.st_ctime_ns + sc.RACY_NS * 2)
    assert cache.lookup(st_) == "x" * 64
    os.chmod(f, 0o600)
    assert cache.lookup(os.lstat(f)) is None


def test_stale_staging_of_a_killed_ship_is_swept_and_abort_removes_its_own(tmp_path, dest):
    src, m = make_bundle(tmp_path / "ctl", FILES_A)
    prep = sc.prepare(str(dest), m)
    old = dest / f".incoming-{m.bundle_id}-deadbeef"
    old.mkdir()
    os.utime(old, (time.time() - sc.STALE_SECONDS - 10,) * 2)
    sc.prepare(str(dest), m)["staging"]
    assert not old.exists()
    with pytest.raises(sc.ShipError, match="not a staging directory"):
        sc.abort(str(dest), str(dest / m.bundle_id), m.bundle_id)
    sc.abort(str(dest), prep["staging"], m.bundle_id)
    assert not Path(prep["staging"]).exists()


blobs = st.sampled_from([b"", b"a", b"bb", b"ccc", b"dddd" * 100, b"e" * 3000])
paths = st.sampled_from(["a", "b", "d/c", "d/e", "x/y/z", "w.whl", "venv.tar.zst"])
bundle_files = st.dictionaries(paths, blobs, min_size=1, max_size=6).filter(
    lambda d: not any(p != q and q.startswith(p + "/") for p in d for q in d))


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(earlier=st.lists(bundle_files, max_size=3), target=bundle_files, tamper=st.sets(st.integers(0, 20)),
       offer=st.none() | st.sets(paths))
def test_seeded_plus_sent_is_exactly_the_manifest(tmp_path_factory, earlier, target, tamper, offer):
    """Any earlier bundles on the host (any files, any paths, some tampered afterwards), and any of the target's
    files sent along with the first call (`offer`; None: prepare alone, as before inline files): the seeded files,
    the inline ones written and the ones still to send are exactly the MANIFEST, without overlap; no tampered file
    is reused; the release lands in the first call exactly when nothing is left to send; the result verifies."""
    base = tmp_path_factory.mktemp("h")
    dest = base / "bundles"
    sc.RACY_NS = 20_000_000  # still above the file-timestamp tick; restored below (100 ms is the product's margin)
    try:
        _seeded_plus_sent(base, dest, earlier, target, tamper, offer)
    finally:
        sc.RACY_NS = 100_000_000


def _seeded_plus_sent(base, dest, earlier, target, tamper, offer=None):
    for i, files in enumerate(earlier):
        src, m = make_bundle(base / f"ctl{i}", files, inputs={"n": i})
        ship(dest, src, m, keep=10)
    # tamper with some files of the earlier bundles (appending a byte keeps nothing of the old content trusted)
    on_host = sorted(p for p in dest.rglob("*") if p.is_file() and p.parent != dest and p.name not in
                     ("MANIFEST", "MANIFEST.sig"))
    tampered = set()
    for k in tamper:
        if on_host:
            p = on_host[k % len(on_host)]
            with open(p, "ab") as f:
                f.write(b"!")
            tampered.add(p)
    src, m = make_bundle(base / "ctl-t", target, inputs={"n": "target"})
    want = {e.path for e in m.files}
    if offer is None:
        prep = sc.prepare(str(dest), m)
    else:
        inline = {p: target[p] for p in offer if p in target}
        prep = sc.ship(str(dest), m, inline, signature=b'{"sig":"x"}\n', keep=10)
        inlined = set(prep["inlined"])
        assert inlined <= set(inline) and not inlined & set(prep["missing"])
        if prep["committed"]:
            assert prep["missing"] == [] and prep["staging"] is None
            assert prep["reused_files"] + len(inlined) == len(want)
            assert tree(dest / m.bundle_id) == tree(src) and leftovers(dest) == []
            return
    if prep["present"]:
        assert not any(str(p).startswith(str(dest / m.bundle_id) + "/") for p in tampered)
        assert tree(dest / m.bundle_id) == tree(src)
        return
    staging = Path(prep["staging"])
    inlined = set(prep["inlined"])
    seeded = {p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file()} - inlined
    assert seeded | inlined | set(prep["missing"]) == want and not seeded & set(prep["missing"])
    assert not seeded & inlined and prep["reused_files"] == len(seeded)
    assert prep["missing"] or offer is None, "nothing was left to send, yet the first call did not commit"
    for rel in seeded | inlined:
        assert (staging / rel).read_bytes() == target[rel]
        assert not any(os.path.samefile(staging / rel, t) for t in tampered if t.exists())
    send(src, str(staging), prep["missing"])
    sc.commit(str(dest), str(staging), m, signature=b'{"sig":"x"}\n', keep=10)
    assert tree(dest / m.bundle_id) == tree(src)
    assert leftovers(dest) == []


def test_a_release_a_few_small_files_apart_lands_in_one_call(tmp_path, dest):
    """The controller sends the bundle's small files along with the first call: what the host lacks of them is
    written, the rest linked from the earlier bundle, and the commit follows in the same call (no rsync, no second
    module call). Offered files the host has are not written again."""
    src_a, ma = make_bundle(tmp_path / "ctl-a", FILES_A)
    ship(dest, src_a, ma, link=True)
    files_b = dict(FILES_A, **{"wheels/b-1.whl": b"wheel b, rebuilt", "units/y.service": b"[Unit]\nY\n"})
    src_b, mb = make_bundle(tmp_path / "ctl-b", files_b)
    small = {p: b for p, b in files_b.items() if len(b) < 100}
    r = sc.ship(str(dest), mb, small, signature=b'{"sig":"x"}\n')
    assert r["committed"] is True and r["missing"] == [] and r["staging"] is None, r
    assert sorted(r["inlined"]) == ["units/y.service", "wheels/b-1.whl"], r
    assert r["inlined_bytes"] == len(files_b["wheels/b-1.whl"]) + len(files_b["units/y.service"])
    assert r["reused_files"] == 4 and r["linked_files"] == 4, r
    assert tree(dest / mb.bundle_id) == tree(src_b) and leftovers(dest) == []
    assert os.path.samefile(dest / mb.bundle_id / "venv.tar.zst", dest / ma.bundle_id / "venv.tar.zst")
    # present: nothing written, nothing committed again
    again = sc.ship(str(dest), mb, small, signature=b'{"sig":"x"}\n')
    assert again["present"] is True and again["committed"] is False and again["inlined"] == []


def test_inline_files_that_do_not_cover_the_change_leave_the_rest_to_send(tmp_path, dest):
    src_a, ma = make_bundle(tmp_path / "ctl-a", FILES_A)
    ship(dest, src_a, ma)
    files_b = dict(FILES_A, **{"venv.tar.zst": b"W" * 5000, "wheels/b-1.whl": b"wheel b, rebuilt"})
    src_b, mb = make_bundle(tmp_path / "ctl-b", files_b)
    r = sc.ship(str(dest), mb, {"wheels/b-1.whl": files_b["wheels/b-1.whl"]})
    assert r["committed"] is False and r["missing"] == ["venv.tar.zst"] and r["inlined"] == ["wheels/b-1.whl"], r
    assert r["missing_bytes"] == 5000 and r["inlined_bytes"] == len(files_b["wheels/b-1.whl"])
    assert Path(r["staging"], "wheels/b-1.whl").read_bytes() == files_b["wheels/b-1.whl"]
    assert not (dest / mb.bundle_id).exists()
    send(src_b, r["staging"], r["missing"])
    sc.commit(str(dest), r["staging"], mb, signature=b'{"sig":"x"}\n')
    assert tree(dest / mb.bundle_id) == tree(src_b) and leftovers(dest) == []


@pytest.mark.parametrize("damage", ["other-bytes", "not-listed", "short"])
def test_an_inline_file_unlike_the_manifest_is_refused_and_leaves_nothing(tmp_path, dest, damage):
    src_a, ma = make_bundle(tmp_path / "ctl-a", FILES_A)
    ship(dest, src_a, ma)
    files_b = dict(FILES_A, **{"wheels/b-1.whl": b"wheel b, rebuilt"})
    src_b, mb = make_bundle(tmp_path / "ctl-b", files_b)
    before = sorted(p.name for p in dest.iterdir())
    inline = {"wheels/b-1.whl": files_b["wheels/b-1.whl"]}
    if damage == "other-bytes":
        inline["wheels/b-1.whl"] = b"WHEEL B, REBUILT"  # same size, other bytes: the commit's hash check
        reason, named = "hash-mismatch", "wheels/b-1.whl"
    elif damage == "not-listed":
        inline["wheels/evil.whl"] = b"x"
        reason, named = "bad-inline", "wheels/evil.whl"
    else:
        inline["wheels/b-1.whl"] = b"wheel b"
        reason, named = "size-mismatch", "wheels/b-1.whl"
    with pytest.raises(sc.ShipError) as exc:
        sc.ship(str(dest), mb, inline, signature=b'{"sig":"x"}\n')
    assert exc.value.reason == reason and named in str(exc.value), exc.value
    assert sorted(p.name for p in dest.iterdir()) == before and leftovers(dest) == []


def test_inline_bytes_for_a_file_the_host_has_are_not_used(tmp_path, dest):
    """What goes along for a file the host already has is never written (the host's checked copy is reused), so
    the ship lands; a size that is not the MANIFEST's is refused whatever the host has."""
    src_a, ma = make_bundle(tmp_path / "ctl-a", FILES_A)
    ship(dest, src_a, ma)
    files_b = dict(FILES_A, **{"wheels/b-1.whl": b"wheel b, rebuilt"})
    src_b, mb = make_bundle(tmp_path / "ctl-b", files_b)
    with pytest.raises(sc.ShipError) as exc:
        sc.ship(str(dest), mb, {"wheels/b-1.whl": files_b["wheels/b-1.whl"], "wheels/a-1.whl": b"WHEEL A!"})
    assert exc.value.reason == "size-mismatch" and exc.value.path == "wheels/a-1.whl"
    assert leftovers(dest) == [] and not (dest / mb.bundle_id).exists()
    r = sc.ship(str(dest), mb, {"wheels/b-1.whl": files_b["wheels/b-1.whl"], "wheels/a-1.whl": b"WHEEL A"},
                signature=b'{"sig":"x"}\n')
    assert r["committed"] is True and r["inlined"] == ["wheels/b-1.whl"], r
    assert tree(dest / mb.bundle_id) == tree(src_b)


def test_every_file_the_host_writes_is_its_own_until_it_is_whole(tmp_path, dest, monkeypatch):
    """Copies of what the host has (link=false), files sent along, MANIFEST and MANIFEST.sig are created 0600 and
    get their mode only once written, whatever the umask: no other user can open one for writing meanwhile and
    change it after the commit's check."""
    src_a, ma = make_bundle(tmp_path / "ctl-a", FILES_A)
    ship(dest, src_a, ma)
    files_b = dict(FILES_A, **{"wheels/b-1.whl": b"wheel b, rebuilt"})
    src_b, mb = make_bundle(tmp_path / "ctl-b", files_b)
    seen = []
    real = os.fchmod

    def spy(fd, mode):
        st_ = os.fstat(fd)
        seen.append((stat.S_IMODE(st_.st_mode), st_.st_size, mode))
        real(fd, mode)

    monkeypatch.setattr(sc.os, "fchmod", spy)
    old = os.umask(0)
    try:
        r = sc.ship(str(dest), mb, {"wheels/b-1.whl": files_b["wheels/b-1.whl"]}, signature=b'{"sig":"x"}\n',
                    link=False)
    finally:
        os.umask(old)
    assert r["committed"] is True and r["linked_files"] == 0 and r["inlined"] == ["wheels/b-1.whl"], r
    sizes = sorted([len(b) for b in files_b.values()] + [len(mb.raw), len(b'{"sig":"x"}\n')])
    assert sorted(size for _m, size, _w in seen) == sizes, seen  # every file whole before its mode
    assert {m for m, _s, _w in seen} == {0o600}, seen
    assert tree(dest / mb.bundle_id) == tree(src_b)


def test_ship_refuses_a_bad_keep_before_it_lays_anything_down(tmp_path, dest):
    src_a, ma = make_bundle(tmp_path / "ctl-a", FILES_A)
    for keep in (0, -1, True, "3"):
        with pytest.raises(sc.ShipError) as exc:
            sc.ship(str(dest), ma, dict(FILES_A), keep=keep)
        assert exc.value.reason == "bad-keep"
        assert not dest.exists() or leftovers(dest) == [] and not (dest / ma.bundle_id).exists()


INLINE = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
from ansible.errors import AnsibleActionFail
from ansible_collections.deploytool.fleet.plugins.action import ship
out = {"budget": [ship.INLINE_FILE_MAX, ship.INLINE_TOTAL_MAX], "bundles": []}
for d in sys.argv[2:]:
    try:
        m, _sig = ship.ActionModule._read_bundle(d)
        files, _total = ship.ActionModule._inline(d, m)
        out["bundles"].append(sorted(files))
    except AnsibleActionFail as exc:
        out["bundles"].append("refused: " + str(exc))
print(json.dumps(out))
'''


def test_the_ship_action_sends_along_the_smallest_files_within_its_budget_and_only_the_manifests_bytes(tmp_path):
    """The action plugin, run by ansible-core's Python: the files sent along with the first call are the smallest,
    each within the per-file budget, together within the total (smallest first, so one that would overflow it ends
    the list); a listed file that is a symlink, or whose bytes are not the MANIFEST's, is refused on the controller,
    before anything reaches a host."""
    coll = tmp_path / "coll" / "ansible_collections" / "deploytool"
    coll.mkdir(parents=True)
    (coll / "fleet").symlink_to(REPO / "ansible")
    probe = subprocess.run([str(FLEET_PYTHON), "-c", INLINE, str(tmp_path / "coll")], capture_output=True,
                           text=True, cwd=tmp_path, check=False, env={"PATH": os.environ["PATH"], "HOME": str(tmp_path)})
    assert probe.returncode == 0, probe.stderr
    per_file, total = json.loads(probe.stdout)["budget"]
    n = total // (per_file // 2)  # files of half the per-file budget: n fit, the next does not
    files = {f"w/{i:03d}.whl": bytes([i]) * (per_file // 2) for i in range(n + 2)}
    files.update({"big.tar.zst": b"B" * (per_file + 1), "tiny": b"t", "units/x.service": b"[Unit]\n"})
    good, _ = make_bundle(tmp_path / "a", files)
    linked, _ = make_bundle(tmp_path / "b", {"tiny": b"t", "other": b"o" * 100})
    secret = tmp_path / "secret"
    secret.write_bytes(b"s")
    (linked / "tiny").unlink()
    (linked / "tiny").symlink_to(secret)
    changed, _ = make_bundle(tmp_path / "c", {"tiny": b"t", "other": b"o" * 100})
    (changed / "other").write_bytes(b"O" * 100)
    r = subprocess.run([str(FLEET_PYTHON), "-c", INLINE, str(tmp_path / "coll"), str(good), str(linked),
                        str(changed)], capture_output=True, text=True, cwd=tmp_path, check=False,
                       env={"PATH": os.environ["PATH"], "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    sent, refused_link, refused_bytes = json.loads(r.stdout)["bundles"]
    # "tiny" and the unit first, then as many half-budget wheels as the total leaves room for
    room = (total - 1 - len(b"[Unit]\n")) // (per_file // 2)
    assert sent == sorted(["tiny", "units/x.service"] + [f"w/{i:03d}.whl" for i in range(room)]), sent
    assert "big.tar.zst" not in sent and sum(len(files[p]) for p in sent) <= total
    assert refused_link.startswith("refused: ") and "tiny" in refused_link and "secret" not in refused_link
    assert refused_bytes.startswith("refused: ") and "other does not match the MANIFEST (SHA-256 differs)" in \
        refused_bytes, refused_bytes


def test_rsync_stats_are_read_from_real_rsync_output(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "f").write_bytes(os.urandom(300_000))
    r = subprocess.run(["rsync", "-a", "--stats", "--no-whole-file", f"{tmp_path}/s/", f"{tmp_path}/d/"],
                       capture_output=True, text=True, check=True)
    stats = sc.parse_stats(r.stdout)
    assert stats["transferred_files"] == 1 and stats["literal_bytes"] == 300_000
    assert stats["sent_bytes"] > 300_000 and stats["matched_bytes"] == 0
    # a delta against a basis that shares most of the file: literal small, matched large
    with open(tmp_path / "s" / "f", "r+b") as f:
        f.seek(150_000)
        f.write(b"changed")
    r = subprocess.run(["rsync", "-a", "--stats", "--no-whole-file", "-I", f"{tmp_path}/s/", f"{tmp_path}/d/"],
                       capture_output=True, text=True, check=True)
    stats = sc.parse_stats(r.stdout)
    assert stats["literal_bytes"] < 30_000 and stats["matched_bytes"] > 250_000, stats


# ------------------------------------------------------------------ the controller's MANIFEST reader

def _with_id(obj):
    """`obj` with the bundle_id its content hashes to (as both readers compute it), where it has the shape for it."""
    try:
        body = {"format_version": obj["format_version"], "files": sorted(obj["files"], key=lambda f: f["path"]),
                "inputs": obj["inputs"], "native_libs": obj["native_libs"]}
        obj["bundle_id"] = hashlib.sha256(sc._canonical(body, None)).hexdigest()[:16]
    except (KeyError, TypeError, ValueError):
        pass
    return obj


def _canonical(obj) -> bytes:
    return sc._canonical(obj, 1)


def _file0(key, value):
    def f(o):
        o["files"][0][key] = value
        return _canonical(_with_id(o))
    return f


def _top(key, value):
    def f(o):
        o[key] = value
        return _canonical(_with_id(o))
    return f


def _drop(key):
    def f(o):
        del o[key]
        return _canonical(_with_id(o))
    return f


# what both readers refuse: every check ship_core makes (the bundle_id made right again after the edit, so the
# check itself is what refuses)
BOTH_REFUSE = {
    "size+1, id kept": lambda o: (o["files"][0].update(size=o["files"][0]["size"] + 1), _canonical(o))[1],
    "other id": lambda o: _canonical(dict(o, bundle_id="0" * 16)),
    "id not hex": lambda o: _canonical(dict(o, bundle_id="XYZ")),
    "negative size": _file0("size", -1), "bool size": _file0("size", True), "text size": _file0("size", "1"),
    "mode 0600": _file0("mode", "0600"), "mode int": _file0("mode", 420), "mode 644": _file0("mode", "644"),
    "sha upper": lambda o: _file0("sha256", o["files"][0]["sha256"].upper())(o), "sha short": _file0("sha256", "ab"),
    "dotdot": _file0("path", "../etc/passwd"), "absolute": _file0("path", "/etc/passwd"),
    "empty part": _file0("path", "a//b"), "dot part": _file0("path", "./a"), "backslash": _file0("path", "a\\b"),
    "control char": _file0("path", "a\nb"), "reserved": _file0("path", "MANIFEST"), "empty path": _file0("path", ""),
    "extra file key": _file0("x", 1),
    "twice": lambda o: (o["files"].append(dict(o["files"][0])), _canonical(_with_id(o)))[1],
    "file and dir": lambda o: (o["files"].append(dict(o["files"][0], path=o["files"][0]["path"] + "/x")),
                               _canonical(_with_id(o)))[1],
    "format 3": _top("format_version", 3), "format true": _top("format_version", True), "extra key": _top("x", 1),
    "no created": _drop("created"), "no files": _drop("files"), "files a dict": _top("files", {}),
    "inputs a list": _top("inputs", []), "native_libs a list": _top("native_libs", []),
    "not an object": lambda o: b"[]\n", "not JSON": lambda o: _canonical(o)[:-3],
    "not ASCII": lambda o: _canonical(o).replace(b'"format_version"', '"format_versión"'.encode()),
    # out of order, a MANIFEST could name "a.part" before "a": refused before anything is laid down
    "files unsorted": lambda o: _canonical(_with_id(dict(o, files=o["files"][::-1]))),
}
# what deploytool's reader alone refuses (the install on the host refuses them too: ship_core leaves them to it)
DEPLOYTOOL_ALONE_REFUSES = {
    "not canonical": lambda o: json.dumps(o).encode(),
    "created not a time": _top("created", "yesterday"),
    "native lib hash bad": _top("native_libs", {"lib/x.so": "nope"}),
}


def _answer(read, raw):
    """(bundle_id, ((path, size, mode, sha256), ...)) or 'refused'."""
    try:
        m = read(raw)
    except (sc.ShipError, BundleError):
        return "refused"
    return m.bundle_id, tuple((e.path, e.size, e.mode, e.sha256) for e in m.files)


@pytest.mark.parametrize("edit", [None, *BOTH_REFUSE, *DEPLOYTOOL_ALONE_REFUSES])
@settings(max_examples=examples(8), deadline=None)
@given(files=bundle_files.filter(lambda d: len(d) >= 2), modes=st.lists(st.sampled_from([0o644, 0o755]), min_size=6))
def test_the_controllers_two_manifest_readers_agree(edit, files, modes):
    """deploytool's MANIFEST reader (what the ship action uses where deploytool is installed) and ship_core's (its
    fallback, and the host's): the same bundle id and files on any real MANIFEST; both refuse what ship_core
    refuses; deploytool's alone refuses a MANIFEST out of canonical form."""
    ents = [FileEntry(p, len(b), modes[i], hashlib.sha256(b).hexdigest()) for i, (p, b) in enumerate(files.items())]
    m = Manifest.build(ents, inputs={"n": 1}, created="2026-01-01T00:00:00Z")
    raw = m.to_bytes() if edit is None else {**BOTH_REFUSE, **DEPLOYTOOL_ALONE_REFUSES}[edit](json.loads(m.to_bytes()))
    core, package = _answer(sc.parse_manifest, raw), _answer(Manifest.from_bytes, raw)
    if edit is None:
        assert core == package == (m.bundle_id, tuple((e.path, e.size, e.mode, e.sha256) for e in m.files))
    elif edit in BOTH_REFUSE:
        assert core == package == "refused", edit
    else:
        assert package == "refused" and core != "refused", edit


FLEET_PYTHON = REPO / ".cache" / "fleet-ansible" / "bin" / "python"
READ_BUNDLES = r'''
import json, os, sys
collections, repo, with_package = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
sys.path.insert(0, collections)
if with_package:
    sys.path.append(repo)  # after site-packages: ansible is ansible-core's, deploy_tool the checkout's
from ansible.errors import AnsibleActionFail
from ansible_collections.deploytool.fleet.plugins.action import ship
out = {"package": ship.PackageManifest is not None, "bundles": []}
for d in sys.argv[4:]:
    try:
        m, sig = ship.ActionModule._read_bundle(d)
        out["bundles"].append([m.raw.decode(), m.bundle_id, [[e.path, e.size, e.mode, e.sha256] for e in m.files],
                               sig.decode()])
    except AnsibleActionFail as exc:
        out["bundles"].append("refused: " + str(exc).split(": ", 1)[0])
print(json.dumps(out))
'''


def test_the_ship_action_reads_a_bundle_alike_with_or_without_deploytool(tmp_path):
    """The action plugin, run by ansible-core's Python: with deploytool importable it reads the MANIFEST with
    deploy_tool.manifest, without it with ship_core; the same bundles read the same, the same ones are refused."""
    coll = tmp_path / "coll" / "ansible_collections" / "deploytool"
    coll.mkdir(parents=True)
    (coll / "fleet").symlink_to(REPO / "ansible")
    good, m = make_bundle(tmp_path / "a", FILES_A)
    edited, _ = make_bundle(tmp_path / "b", {"x": b"1", "d/y": b"22"})
    obj = json.loads((edited / "MANIFEST").read_bytes())
    obj["files"][0]["size"] += 1
    (edited / "MANIFEST").write_bytes(_canonical(obj))
    short, _ = make_bundle(tmp_path / "c", {"x": b"1"})
    (short / "x").write_bytes(b"")
    bundles = [str(good), str(edited), str(short), str(tmp_path / "none")]
    runs = {}
    for with_package in ("1", "0"):
        r = subprocess.run([str(FLEET_PYTHON), "-c", READ_BUNDLES, str(tmp_path / "coll"), str(REPO), with_package,
                            *bundles], capture_output=True, text=True, cwd=tmp_path, check=False,
                           env={"PATH": os.environ["PATH"], "HOME": str(tmp_path)})
        assert r.returncode == 0, r.stderr
        runs[with_package] = json.loads(r.stdout)
    assert runs["1"]["package"] is True and runs["0"]["package"] is False
    assert runs["1"]["bundles"] == runs["0"]["bundles"]
    first = runs["1"]["bundles"][0]
    assert first[1] == m.bundle_id and [tuple(f) for f in first[2]] == [(e.path, e.size, e.mode, e.sha256)
                                                                         for e in m.files]
    assert [b if isinstance(b, str) else "read" for b in runs["1"]["bundles"]] == [
        "read", f"refused: bundle {edited}", f"refused: bundle {short}", f"refused: src {tmp_path / 'none'} is not a "
        f"directory"]


def test_the_ship_reads_manifests_of_format_1_and_2_with_their_ids() -> None:
    """A bundle packed before 2026-12-06 (format 1) ships as one packed now (2); the id is checked with the
    version the MANIFEST states, so a version edited without its id is refused."""
    files = (FileEntry("venv.tar.zst", 3, 0o644, "a" * 64),)
    for version in (1, 2):
        m = Manifest(version, compute_bundle_id(files, {}, {}, version), "1970-01-01T00:00:00Z", {}, files, {})
        assert sc.parse_manifest(m.to_bytes()).bundle_id == m.bundle_id
        other = m.to_bytes().replace(b'"format_version": %d' % version, b'"format_version": %d' % (3 - version))
        with pytest.raises(sc.ShipError, match="bundle_id"):
            sc.parse_manifest(other)
