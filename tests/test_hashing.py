"""The one SHA-256 engine (deploy_tool.hashing): streamed hashing, the stat-keyed cache, the parallel collector."""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy_tool import hashing
from deploy_tool.hashing import CHUNK, HashCache, NotAFile
from tests.support.examples import examples

SIZES = st.one_of(st.integers(0, 3 * CHUNK + 7), st.sampled_from([0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK]))
FAST = settings(max_examples=examples(40), deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _data(size: int, seed: int) -> bytes:
    return (hashlib.sha256(str(seed).encode()).digest() * (size // 32 + 1))[:size]


@FAST
@given(size=SIZES, seed=st.integers(0, 1000), limit=st.one_of(st.none(), st.integers(0, 3 * CHUNK)))
def test_file_fd_stream_and_chunks_equal_hashlib(tmp_path: Path, size: int, seed: int, limit: int | None) -> None:
    """Every entry point gives hashlib's digest of the same bytes, at any size and any limit."""
    data = _data(size, seed)
    p = tmp_path / "f"
    p.write_bytes(data)
    want = hashlib.sha256(data).hexdigest()
    assert hashing.sha256_file(p) == want == hashing.sha256_bytes(data)
    assert hashing.sha256_file(p, limit=limit) == hashlib.sha256(data[:limit]).hexdigest()
    fd = os.open(p, os.O_RDONLY)
    try:
        assert hashing.sha256_fd(fd, limit=limit) == (hashlib.sha256(data[:limit]).hexdigest(),
                                                      len(data[:limit]))
    finally:
        os.close(fd)
    copied = bytearray()
    with open(p, "rb", buffering=0) as f:
        assert hashing.sha256_stream(f, sink=copied.extend) == (want, size)
    assert bytes(copied) == data
    assert hashing.sha256_stream(io.BytesIO(data)) == (want, size)  # BytesIO: readinto
    parts = [data[i:i + 777] for i in range(0, len(data), 777)]
    out = bytearray()
    assert hashing.sha256_chunks(parts, sink=out.extend) == (want, size) and bytes(out) == data


def test_non_regular_files_are_refused_without_hanging(tmp_path: Path) -> None:
    """A directory, a fifo (opened non-blocking: no hang) and, when not following, a symlink: NotAFile."""
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "d").mkdir()
    (tmp_path / "real").write_bytes(b"x")
    os.symlink("real", tmp_path / "link")
    for name in ("fifo", "d"):
        with pytest.raises(NotAFile):
            hashing.sha256_file(tmp_path / name)
    with pytest.raises(NotAFile):
        hashing.sha256_file(tmp_path / "link", follow_symlinks=False)
    assert hashing.sha256_file(tmp_path / "link") == hashlib.sha256(b"x").hexdigest()
    with pytest.raises(FileNotFoundError):
        hashing.sha256_file(tmp_path / "nope")


def _settle(*paths: Path) -> None:
    time.sleep(hashing.RACY_MARGIN_S + 0.05)  # values computed after this are not racy


def test_cache_key_includes_ctime_a_touched_back_same_size_change_is_seen(tmp_path: Path) -> None:
    """The stat key holds ctime: a same-size change whose mtime is set back (touch -d) is hashed again."""
    f = tmp_path / "lib.so"
    f.write_bytes(b"a" * 4096)
    _settle(f)
    cache = HashCache()
    before = os.stat(f)
    assert cache.sha256(f) == hashlib.sha256(b"a" * 4096).hexdigest() and cache.computed == 1
    assert cache.sha256(f) == hashlib.sha256(b"a" * 4096).hexdigest() and cache.computed == 1  # from cache
    time.sleep(0.01)  # the next change gets a later ctime tick
    with open(f, "r+b") as fh:
        fh.seek(100)
        fh.write(b"b")
    os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns))  # mtime and size as before
    after = os.stat(f)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)
    assert after.st_ctime_ns != before.st_ctime_ns
    want = hashlib.sha256(b"a" * 100 + b"b" + b"a" * 3995).hexdigest()
    assert cache.sha256(f) == want and cache.computed == 2
    assert hashing.stat_key(after)[-1] == after.st_ctime_ns


def test_racy_values_are_not_trusted_until_the_file_ages(tmp_path: Path) -> None:
    """A value computed right after a change is recomputed (the git index rule), then trusted once old enough."""
    f = tmp_path / "f"
    f.write_bytes(b"x" * 10)
    cache = HashCache()
    cache.sha256(f)
    cache.sha256(f)
    assert cache.computed == 2  # racy: the file changed < 0.1 s before its value was computed
    _settle(f)
    cache.sha256(f)
    cache.sha256(f)
    assert cache.computed == 3


def test_persisted_cache_round_trip_same_file_and_trust_rules(tmp_path: Path) -> None:
    """Saved entries come back; the same file under another name answers; a world-writable file is ignored."""
    f = tmp_path / "f"
    f.write_bytes(b"payload")
    os.link(f, tmp_path / "hard")
    _settle(f)
    cp = tmp_path / "cache" / "c.json"
    c1 = HashCache(cp)
    digest = c1.sha256(f)
    c1.save(extra={"k": 1})
    c2 = HashCache(cp)
    assert c2.get(str(f), os.stat(f)) == digest and c2.section("extra") == {"k": 1}
    assert c2.sha256(tmp_path / "hard") == digest and c2.computed == 0  # same inode, other name
    doc = json.loads(cp.read_text())
    doc["entries"][str(f)]["values"]["sha256"][0] = "0" * 64
    cp.write_text(json.dumps(doc))
    os.chmod(cp, 0o644)
    assert HashCache(cp).sha256(f) == "0" * 64  # the file is really used (doctored value shows)
    os.chmod(cp, 0o666)
    assert HashCache(cp).sha256(f) == digest  # writable by others: ignored
    for garbage in (b"", b"\xffnot json", b'{"format": 99, "entries": {}}', b'{"format": 1, "entries": [1]}',
                    b'{"format": 1, "entries": {"x": {"key": "k", "values": 5}}}'):
        cp.write_bytes(garbage)
        os.chmod(cp, 0o644)
        assert HashCache(cp).sha256(f) == digest


def test_parallel_keeps_order_runs_costliest_first_and_raises(tmp_path: Path) -> None:
    seen: list[int] = []
    lock = threading.Lock()

    def fn(x: int) -> int:
        with lock:
            seen.append(x)
        return x * x

    items = [3, 1, 4, 1, 5, 9, 2, 6]
    assert hashing.parallel(fn, items, workers=1, cost=lambda x: x) == [x * x for x in items]
    assert seen == sorted(items, reverse=True)
    assert hashing.parallel(fn, items, workers=4) == [x * x for x in items]
    assert hashing.parallel(fn, []) == []

    def boom(x: int) -> int:
        if x == 5:
            raise OSError(5, "boom")
        return x

    with pytest.raises(OSError, match="boom"):
        hashing.parallel(boom, items, workers=3)


def test_hash_many_equals_one_by_one(tmp_path: Path) -> None:
    paths = []
    for i, size in enumerate([0, 5, CHUNK + 3, 3 * CHUNK]):
        p = tmp_path / f"f{i}"
        p.write_bytes(_data(size, i))
        paths.append(p)
    want = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}
    assert hashing.hash_many(paths, workers=3) == want
    assert hashing.hash_many(paths, workers=1, cache=HashCache()) == want
    with pytest.raises(FileNotFoundError):
        hashing.hash_many([*paths, tmp_path / "missing"])
