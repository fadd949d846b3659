"""Reproducible tar.zst archives of venv trees, and the safe extractor against hostile archives."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
from pathlib import Path
from unittest import mock

import pytest
import zstandard

from deploy_tool import archive
from deploy_tool.errors import BundleError, InputError
from tests.support.bundles import make_venv_tree, member, snapshot, write_members
from tests.support.examples import examples


@pytest.fixture(scope="module", autouse=True, params=["tools", "python"])
def unpack_path(request: pytest.FixtureRequest):
    """Every test twice: extraction through the system's zstd and GNU tar (checked here, written there), and
    through the Python writer (a box without them, DEPLOYTOOL_UNPACK=python)."""
    if request.param == "tools" and archive.unpack_tools() is None:
        pytest.skip("no zstd or GNU tar on this machine")
    old = os.environ.get(archive.UNPACK_ENV)
    os.environ[archive.UNPACK_ENV] = "system" if request.param == "tools" else "python"
    yield request.param
    if old is None:
        os.environ.pop(archive.UNPACK_ENV, None)
    else:
        os.environ[archive.UNPACK_ENV] = old


def _tree_listing(root: Path) -> dict[str, tuple]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir", p.stat().st_mode & 0o777)
            else:
                out[rel] = ("file", p.stat().st_mode & 0o777, p.read_bytes())
    return out


def test_roundtrip_venv_tree_with_symlinks(tmp_path: Path) -> None:
    """A venv tree (relative symlinks, empty dir, exec bits, names over 100 bytes) survives write + safe extract."""
    venv = make_venv_tree(tmp_path / "venv")
    a = archive.archive_tree(venv, tmp_path / "v.tar.zst")
    got = archive.extract_archive(a, tmp_path / "out")
    assert got.root == tmp_path / "out"
    assert _tree_listing(tmp_path / "out") == _tree_listing(venv)
    assert os.readlink(tmp_path / "out" / "bin" / "python") == "python3"
    assert (tmp_path / "out" / "include" / "python3.11").is_dir()


def test_archive_is_reproducible_across_copies(tmp_path: Path) -> None:
    """The same tree, and a copy with other mtimes, owners and non-exec mode bits, archives to identical bytes."""
    venv = make_venv_tree(tmp_path / "venv")
    one = archive.archive_tree(venv, tmp_path / "1.tar.zst").read_bytes()
    two = archive.archive_tree(venv, tmp_path / "2.tar.zst").read_bytes()
    copy = tmp_path / "copy"
    shutil.copytree(venv, copy, symlinks=True)
    for p in copy.rglob("*"):
        if p.is_symlink():
            continue
        os.utime(p, (1_500_000_000, 1_600_000_000))
        if p.is_file():
            os.chmod(p, 0o700 if p.stat().st_mode & 0o100 else 0o600)
        if os.geteuid() == 0:
            os.chown(p, 4242, 4343)
    three = archive.archive_tree(copy, tmp_path / "3.tar.zst").read_bytes()
    assert one == two == three


def test_archive_headers_are_normalized(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Members are sorted, owned by 0/0 with empty names, mtime SOURCE_DATE_EPOCH, modes 0644/0755, no pax."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1234567890")
    venv = make_venv_tree(tmp_path / "venv")
    a = archive.archive_tree(venv, tmp_path / "v.tar.zst")
    raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(a.read_bytes())).read()
    with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
        ms = tf.getmembers()
        assert not tf.pax_headers
    names = [m.name for m in ms]
    assert names == sorted(names)
    assert {(m.uid, m.gid, m.uname, m.gname, m.mtime) for m in ms} == {(0, 0, "", "", 1234567890)}
    assert {m.mode for m in ms if m.isfile()} == {0o644, 0o755}
    assert {m.mode for m in ms if m.isdir()} == {0o755}
    assert len(raw) % 10240 == 0 and b"PaxHeader" not in raw and b"atime" not in raw


def test_gnu_tar_reads_our_archive_and_we_read_gnu_tar(tmp_path: Path) -> None:
    """Interop both ways with GNU tar: it lists and extracts ours; we extract a plain tar made by it."""
    venv = make_venv_tree(tmp_path / "venv")
    a = archive.archive_tree(venv, tmp_path / "v.tar.zst")
    (tmp_path / "gnu").mkdir()
    subprocess.run(["tar", "--zstd", "-xf", str(a), "-C", str(tmp_path / "gnu")], check=True)
    assert _tree_listing(tmp_path / "gnu") == _tree_listing(venv)
    entries = sorted(p.name for p in venv.iterdir())
    subprocess.run(["tar", "-cf", str(tmp_path / "g.tar"), "-C", str(venv), *entries], check=True)
    archive.extract_archive(tmp_path / "g.tar", tmp_path / "ours")
    assert _tree_listing(tmp_path / "ours").keys() == _tree_listing(venv).keys()


def test_members_from_tree_refuses_absolute_and_escaping_symlinks(tmp_path: Path) -> None:
    """An absolute symlink (a venv's bin/python3 -> /usr/bin/python3) or one leaving the tree is an InputError."""
    t = tmp_path / "t"
    t.mkdir()
    os.symlink("/usr/bin/python3", t / "python3")
    with pytest.raises(InputError, match="relative symlinks"):
        archive.members_from_tree(t)
    (t / "python3").unlink()
    os.symlink("../../etc/passwd", t / "up")
    with pytest.raises(InputError):
        archive.members_from_tree(t)
    (t / "up").unlink()
    os.mkfifo(t / "fifo")
    with pytest.raises(InputError, match="not a regular file"):
        archive.members_from_tree(t)
    (t / "fifo").unlink()
    os.symlink("x", t / "rel")
    with pytest.raises(InputError, match="symlinks are not allowed"):
        archive.members_from_tree(t, symlinks=False)
    assert [m.name for m in archive.members_from_tree(t, exclude=lambda n: n == "rel")] == []


def test_file_changing_size_while_archiving_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A member whose size differs from its stat when read is an InputError and no archive is left."""
    f = tmp_path / "grow"
    f.write_bytes(b"x" * 10)
    m = archive.Member("grow", "file", f, 0o644)
    real_stat = os.stat

    def fake_stat(p, *a, **kw):
        st = real_stat(p, *a, **kw)
        if str(p) == str(f):
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_uid, st.st_gid, 5,
                                   st.st_atime, st.st_mtime, st.st_ctime))
        return st

    monkeypatch.setattr(os, "stat", fake_stat)  # the file "grows" between stat and read
    with pytest.raises(InputError, match="changed size"):
        archive.write_archive([m], tmp_path / "out" / "a.tar.zst")
    monkeypatch.undo()
    assert list((tmp_path / "out").iterdir()) == []


# ---------------------------------------------------------------------------------------------- hostile input

HOSTILE = [
    ("absolute", [member("/tmp/deploytool-abs-escape", data=b"x")], "absolute-path"),
    ("dotdot", [member("a/../../dotdot-escape", data=b"x")], "dotdot-path"),
    ("symlink-escape", [member("l", tarfile.SYMTYPE, linkname="../outside")], "symlink-escape"),
    ("symlink-absolute", [member("l", tarfile.SYMTYPE, linkname="/etc")], "symlink-escape"),
    ("symlink-dotdot-inside-name", [member("a/l", tarfile.SYMTYPE, linkname="b/../../..")], "symlink-escape"),
    ("write-through-symlink", [member("d", tarfile.SYMTYPE, linkname="."),
                               member("d/x", data=b"x")], "path-through-symlink"),
    ("hardlink", [member("f", data=b"x"), member("h", tarfile.LNKTYPE, linkname="f")], "hardlink"),
    ("chardev", [member("null", tarfile.CHRTYPE)], "device-node"),
    ("blockdev", [member("sda", tarfile.BLKTYPE)], "device-node"),
    ("fifo", [member("p", tarfile.FIFOTYPE)], "fifo"),
    ("duplicate", [member("f", data=b"x"), member("f", data=b"y")], "duplicate-entry"),
    ("dir-then-file-same-name", [member("d", tarfile.DIRTYPE, mode=0o755), member("d", data=b"y")],
     "duplicate-entry"),
    ("file-under-file", [member("f", data=b"x"), member("f/g", data=b"y")], "path-conflict"),
    ("dot-component", [member("./f", data=b"x")], "bad-path"),
]


@pytest.mark.parametrize(("name", "members", "reason"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_extractor_rejects_hostile_entries(tmp_path: Path, name: str, members: list, reason: str) -> None:
    """Each hostile entry is rejected with its reason; the staging dir is removed and nothing lands elsewhere."""
    a = write_members(tmp_path / "evil.tar.zst", members)
    before = snapshot(tmp_path)
    with pytest.raises(BundleError) as ei:
        archive.extract_archive(a, tmp_path / "stage", symlinks=True)
    assert ei.value.reason == reason, ei.value.message
    assert not (tmp_path / "stage").exists()
    assert snapshot(tmp_path) == before
    assert not Path("/tmp/deploytool-abs-escape").exists() and not (tmp_path / "dotdot-escape").exists()


def test_extractor_rejects_symlinks_when_not_allowed(tmp_path: Path) -> None:
    """With symlinks=False (bundles) even a harmless in-tree symlink is rejected."""
    a = write_members(tmp_path / "a.tar.zst", [member("l", tarfile.SYMTYPE, linkname="x")])
    with pytest.raises(BundleError) as ei:
        archive.extract_archive(a, tmp_path / "s", symlinks=False)
    assert ei.value.reason == "symlink" and not (tmp_path / "s").exists()


def test_extractor_total_size_limit(tmp_path: Path) -> None:
    """An archive unpacking beyond max_total is rejected before the oversize entry is written."""
    a = write_members(tmp_path / "a.tar.zst", [member("a", data=b"x" * 600), member("b", data=b"y" * 600)])
    with pytest.raises(BundleError) as ei:
        archive.extract_archive(a, tmp_path / "s", max_total=1000)
    assert ei.value.reason == "archive-too-large" and not (tmp_path / "s").exists()
    with pytest.raises(BundleError) as ei:
        archive.extract_archive(a, tmp_path / "s", max_entries=1)
    assert ei.value.reason == "archive-too-large"


def test_extractor_zstd_bomb_of_zeros_is_bounded(tmp_path: Path) -> None:
    """A tiny zstd file declaring a huge entry is stopped by the size limit without writing it."""
    ti = tarfile.TarInfo("big")
    ti.size = 50 << 30
    hdr = ti.tobuf(tarfile.GNU_FORMAT)
    cctx = zstandard.ZstdCompressor(level=19)
    (tmp_path / "bomb.tar.zst").write_bytes(cctx.compress(hdr + b"\0" * (8 << 20)))
    with pytest.raises(BundleError) as ei:
        archive.extract_archive(tmp_path / "bomb.tar.zst", tmp_path / "s", max_total=1 << 30)
    assert ei.value.reason == "archive-too-large"


@pytest.mark.parametrize("cut", [1, 100, 513, 1024 + 3])
def test_truncated_archives(tmp_path: Path, cut: int) -> None:
    """Cutting bytes off a tar.zst or a plain tar is archive-truncated (zstd checked before any write)."""
    venv = make_venv_tree(tmp_path / "venv", big=5000)
    for comp, name in (("zstd", "v.tar.zst"), ("none", "v.tar")):
        a = archive.archive_tree(venv, tmp_path / name, compression=comp)
        data = a.read_bytes()
        if comp == "none":
            data = data.rstrip(b"\0")  # drop the end marker and padding too
        a.write_bytes(data[:-cut])
        with pytest.raises(BundleError) as ei:
            archive.extract_archive(a, tmp_path / "s")
        assert ei.value.reason == "archive-truncated", (comp, ei.value.message)
        assert not (tmp_path / "s").exists()


def test_malformed_archives(tmp_path: Path) -> None:
    """Bad checksums, pax headers, gzip, garbage and trailing data are rejected with their own reasons."""
    good = archive.write_archive([archive.Member("f", "file", b"hello", 0o644)], tmp_path / "g.tar",
                                 compression="none").read_bytes()

    def reason(data: bytes, name: str = "x.tar") -> str:
        p = tmp_path / name
        p.write_bytes(data)
        with pytest.raises(BundleError) as ei:
            archive.extract_archive(p, tmp_path / "s")
        assert not (tmp_path / "s").exists()
        return ei.value.reason

    bad = bytearray(good)
    bad[0] ^= 1
    assert reason(bytes(bad)) == "archive-malformed"
    assert reason(good + b"junk") == "trailing-data"
    assert reason(zstandard.ZstdCompressor().compress(good) + b"junk", "x.tar.zst") == "trailing-data"
    assert reason(b"\x1f\x8b" + b"\0" * 600) == "unsupported-compression"
    assert reason(b"hello world" * 100) == "unsupported-compression"
    assert reason(b"short") == "archive-truncated"
    pax = write_members(tmp_path / "pax.tar", [member("é" * 120, data=b"x")], compress=False,
                        fmt=tarfile.PAX_FORMAT).read_bytes()
    assert reason(pax) == "unsupported-entry"
    z = bytearray(zstandard.ZstdCompressor(write_checksum=True).compress(good))
    z[-2] ^= 0xFF  # the frame checksum
    assert reason(bytes(z), "c.tar.zst") == "archive-malformed"


def test_extract_refuses_existing_staging_dir(tmp_path: Path) -> None:
    """The staging dir must be new: an existing one (maybe someone else's) is never written into."""
    a = archive.write_archive([archive.Member("f", "file", b"x", 0o644)], tmp_path / "a.tar.zst")
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "keep").write_text("mine")
    with pytest.raises(InputError, match="already exists"):
        archive.extract_archive(a, tmp_path / "s")
    assert (tmp_path / "s" / "keep").read_text() == "mine"


def test_extracted_modes_are_normalized(tmp_path: Path) -> None:
    """setuid/world-writable modes in an archive come out as plain 0644/0755; the staging root is 0700."""
    a = write_members(tmp_path / "m.tar.zst", [member("suid", data=b"x", mode=0o4777),
                                               member("ww", data=b"y", mode=0o666)])
    archive.extract_archive(a, tmp_path / "s")
    assert (tmp_path / "s" / "suid").stat().st_mode & 0o7777 == 0o755
    assert (tmp_path / "s" / "ww").stat().st_mode & 0o7777 == 0o644
    assert (tmp_path / "s").stat().st_mode & 0o777 == 0o700


def test_reader_lists_entries_with_kinds_and_targets(tmp_path: Path) -> None:
    """The strict reader yields every entry with its kind, mode and symlink target (long names too)."""
    venv = make_venv_tree(tmp_path / "venv")
    a = archive.archive_tree(venv, tmp_path / "v.tar.zst")
    with archive.open_tar_stream(a) as stream:
        entries = {e.name: e for e in archive.TarReader(stream)}
    assert entries["bin/python"].kind == "symlink" and entries["bin/python"].target == "python3"
    assert entries["bin/python3"].mode == 0o755
    assert any(len(n) > 100 for n in entries)


# ---------------------------------------------------------------------------------------------- fuzzing

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@pytest.fixture(scope="module")
def fuzz_seed(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, bytes]:
    """A small venv-like tree as plain tar and as tar.zst."""
    base = tmp_path_factory.mktemp("fuzz")
    venv = make_venv_tree(base / "venv", big=3000)
    plain = archive.archive_tree(venv, base / "v.tar", compression="none").read_bytes()
    return plain, archive.archive_tree(venv, base / "v.tar.zst").read_bytes()


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_archives_fail_cleanly(tmp_path: Path, fuzz_seed: tuple[bytes, bytes], data) -> None:
    """Random byte flips, cuts and splices give a clean result or a named BundleError, never another exception
    and never a file outside the staging dir (which is gone after a failure)."""
    src = bytearray(data.draw(st.sampled_from(fuzz_seed)))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "splice"]))
        if op == "flip":
            i = data.draw(st.integers(0, len(src) - 1))
            src[i] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            i = data.draw(st.integers(1, len(src)))
            del src[i:]
        else:
            i = data.draw(st.integers(0, len(src)))
            src[i:i] = data.draw(st.binary(min_size=1, max_size=600))
    case = tmp_path / f"case-{os.getpid()}-{data.draw(st.integers(0, 10**9))}"
    case.mkdir()
    a = case / "a.tar"
    a.write_bytes(bytes(src))
    stage = case / "stage"
    try:
        archive.extract_archive(a, stage, symlinks=True)
    except BundleError as exc:
        assert exc.reason  # type: ignore[attr-defined]
        assert not stage.exists()
    else:
        for p in stage.rglob("*"):
            assert stage in p.parents
            if p.is_symlink():
                archive.check_symlink_target(str(p.relative_to(stage)), os.readlink(p))
    assert sorted(x.name for x in case.iterdir()) in (["a.tar"], ["a.tar", "stage"])
    shutil.rmtree(case)


def test_extract_many_small_files_and_big_ones_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer threads (small files) and the in-stream writes (big files) lay down exactly the archived bytes
    and modes, with a write-ahead budget smaller than the files in flight."""
    monkeypatch.setattr(archive, "WRITE_AHEAD", 4 * archive.CHUNK)
    monkeypatch.setattr(archive, "SMALL_FILE", 2 * archive.CHUNK)
    src = tmp_path / "src"
    for i in range(300):
        d = src / f"d{i % 7}"
        d.mkdir(parents=True, exist_ok=True)
        size = (i * 7919) % (3 * archive.CHUNK) if i % 25 == 0 else i * 13
        (d / f"f{i}").write_bytes(os.urandom(size))
        (d / f"f{i}").chmod(0o755 if i % 3 == 0 else 0o644)
    a = tmp_path / "a.tar.zst"
    archive.archive_tree(src, a, symlinks=True)
    archive.extract_archive(a, tmp_path / "out", symlinks=True)
    for p in src.rglob("*"):
        q = tmp_path / "out" / p.relative_to(src)
        if p.is_file():
            assert q.read_bytes() == p.read_bytes() and q.stat().st_mode & 0o777 == p.stat().st_mode & 0o777, p


# ---------------------------------------------------------------------------------------------- frames

_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_", min_size=1, max_size=12)
_BIG = 4096  # FRAME_BIG for these tests: the same rule at a size that keeps examples small


def _frames(path: Path) -> list[bytes]:
    with open(path, "rb") as f:
        out = []
        for s, e in archive.check_zstd_frames(f):
            f.seek(s)
            out.append(f.read(e - s))
    return out


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(files=st.dictionaries(_names, st.integers(0, 3 * _BIG), min_size=2, max_size=30),
       pick=st.integers(0, 10_000), at=st.integers(0, 10_000), append=st.booleans())
def test_one_changed_file_changes_one_frame(tmp_path_factory: pytest.TempPathFactory, files: dict[str, int],
                                            pick: int, at: int, append: bool) -> None:
    """Two archives of trees that differ in one file (a byte flipped, or one appended without crossing the
    big-file size) have the same frames in the same order except the one holding that file, and both extract to
    their trees. This is what lets rsync resend only the frames around a change when a release is shipped to a
    box that has the previous one."""
    tmp = tmp_path_factory.mktemp("frames")
    trees = [tmp / "a", tmp / "b"]
    names = sorted(files)
    for t in trees:
        for i, n in enumerate(names):
            p = t / n[:2] / n
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(bytes((i + k) % 251 for k in range(files[n])))
    victim = trees[1] / names[pick % len(names)][:2] / names[pick % len(names)]
    body = bytearray(victim.read_bytes())
    if append or not body:
        if len(body) + 1 == _BIG:
            return  # one more byte would make it a big file: another case
        body += b"!"
    else:
        body[at % len(body)] ^= 0xFF
    victim.write_bytes(bytes(body))
    got = []
    with mock.patch.object(archive, "FRAME_BIG", _BIG), mock.patch.object(archive, "FRAME_EVERY", 4):
        for t in trees:
            out = archive.archive_tree(t, tmp / f"{t.name}.tar.zst")
            got.append(_frames(out))
            members = sorted(archive.members_from_tree(t), key=lambda m: m.name)
            sizes = [os.path.getsize(m.source) if m.kind == "file" else 0 for m in members]  # type: ignore[arg-type]
            cuts = sum(archive.frame_boundary_before(m.name, sizes[i], i > 0 and sizes[i - 1] >= _BIG)
                       for i, m in enumerate(members) if i > 0)
            assert len(got[-1]) == 1 + cuts + 1, (len(got[-1]), cuts)  # the members' frames, then the trailer's
            back = tmp / f"{t.name}-out"
            archive.extract_archive(out, back)
            assert _tree_listing(back) == _tree_listing(t)
    fa, fb = got
    assert len(fa) == len(fb), (len(fa), len(fb))
    differ = sum(x != y for x, y in zip(fa, fb, strict=True))
    # plus the tar trailer's frame when the size changed (its padding follows the total size)
    same_size = len(body) == files[names[pick % len(names)]]
    assert differ == 1 or (differ == 2 and not same_size), [x == y for x, y in zip(fa, fb, strict=True)]


def test_a_tree_of_many_members_is_cut_into_frames(tmp_path: Path) -> None:
    """Frames come from content: a big file gets its own, other boundaries fall before names whose CRC-32 is 0
    modulo FRAME_EVERY; zstd -d reads the multi-frame archive like any other."""
    t = tmp_path / "t"
    (t / "small").mkdir(parents=True)
    for i in range(400):
        (t / "small" / f"f{i:03}.py").write_text(f"x = {i}\n")
    (t / "big.so").write_bytes(b"\x7fELF" + b"\0" * archive.FRAME_BIG)
    out = archive.archive_tree(t, tmp_path / "t.tar.zst")
    frames = _frames(out)
    import zlib

    expected_small = sum(zlib.crc32(f"small/f{i:03}.py".encode()) % archive.FRAME_EVERY == 0 for i in range(400))
    # big.so sorts first: its frame, then one boundary after it, then one before each small file whose name hits
    assert len(frames) >= 2 + expected_small - 1, (len(frames), expected_small)
    r = subprocess.run(["zstd", "-d", "-c", str(out)], capture_output=True, check=True)  # make setup installs zstd
    with tarfile.open(fileobj=io.BytesIO(r.stdout)) as tf:
        assert "big.so" in tf.getnames() and len(tf.getnames()) == 402


# ------------------------------------------------------------------------------------------------ several archives

def test_several_archives_unpack_as_one_tree(tmp_path: Path) -> None:
    """A venv cut into archives (directories in one, files spread over others) unpacks into the same tree as the
    whole; every file's digest is reported once, whichever archive held it."""
    venv = make_venv_tree(tmp_path / "venv")
    members = archive.members_from_tree(venv)
    dirs = [m for m in members if m.kind == "dir"]
    rest = [m for m in members if m.kind != "dir"]
    parts = [archive.write_archive(dirs, tmp_path / "p0.tar.zst"),
             archive.write_archive(rest[::2], tmp_path / "p1.tar.zst"),
             archive.write_archive(rest[1::2] + dirs[:1], tmp_path / "p2.tar.zst")]  # a directory again: merged
    digests: dict[str, str] = {}
    got = archive.extract_archive(parts, tmp_path / "out", digests=digests if os.environ[archive.UNPACK_ENV] ==
                                  "python" else None)
    assert _tree_listing(tmp_path / "out") == _tree_listing(venv)
    assert got.files == sum(1 for m in rest if m.kind == "file")
    if digests:
        assert set(digests) == {m.name for m in rest if m.kind == "file"}


@pytest.mark.parametrize("kind", [tarfile.REGTYPE, tarfile.SYMTYPE])
def test_a_path_two_archives_hold_is_refused_and_nothing_is_left(tmp_path: Path, kind: bytes) -> None:
    """The second archive may not replace or add to what the first wrote: a file or link both hold is a duplicate
    entry, and the whole destination is removed."""
    one = write_members(tmp_path / "one.tar.zst", [member("d", tarfile.DIRTYPE), member("d/x", data=b"first")])
    two = write_members(tmp_path / "two.tar.zst", [member("d/y", data=b"ok"),
                                                   member("d/x", kind, b"second", linkname="y")])
    with pytest.raises(BundleError) as ei:
        archive.extract_archive([one, two], tmp_path / "out")
    assert ei.value.reason == "duplicate-entry" and "d/x" in str(ei.value)
    assert not (tmp_path / "out").exists()


def test_the_limits_count_every_archive(tmp_path: Path) -> None:
    parts = [write_members(tmp_path / f"p{i}.tar.zst", [member(f"f{i}", data=b"x" * 600)]) for i in range(2)]
    with pytest.raises(BundleError) as ei:
        archive.extract_archive(parts, tmp_path / "out", max_total=1000)
    assert ei.value.reason == "archive-too-large"
    assert not (tmp_path / "out").exists()
    assert archive.extract_archive(parts, tmp_path / "ok", max_total=1200).total_size == 1200
