"""deploytool.fleet.ship on real hosts: the fleet test bed (tests/support/fleet.py), real sshd, real ansible-core,
real rsync, and two real cpu-demo bundles one wheel apart (tests/support/ship_bundles.py).

One fleet of three hosts for the whole module; the collection is built and installed with ansible-galaxy as a user
would. In order: a first ship to the three hosts (everything crosses, each host holds a verified copy); a re-ship
(nothing sent, changed=false); check mode of the second bundle (reports, changes nothing); a corrupted copy of the
second bundle on the controller (the host's verify names the file; nothing left on the host); the second bundle
(only what differs lands: the rebuilt wheel, its part of the venv, a few small files, all of them sent along
with the first module call, which commits); a tampered
file of an earlier bundle on a host (not reused: sent again, the bundle repaired); an unreachable host (fails alone).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fleet import Fleet, running_fleet
from tests.support.ship_bundles import cached_pair

pytestmark = [pytest.mark.sandbox, pytest.mark.fleet]

DEST = "/var/lib/deploytool/bundles"
TASK = "deploytool.fleet.ship"
FTLLM_PART = "venv-parts/ftllm.tar.zst"  # the venv's archive of ftllm's files, the same in both bundles
CHANGED_PART = "venv-parts/sniffio.tar.zst"  # ... of the rebuilt wheel's (tests/support/ship_bundles.py)


def manifest(bundle: Path) -> dict:
    return json.loads((bundle / "MANIFEST").read_text())


def size_of(bundle: Path) -> int:
    return sum(f["size"] for f in manifest(bundle)["files"])


def differing(a: Path, b: Path) -> set[str]:
    fa = {f["path"]: f["sha256"] for f in manifest(a)["files"]}
    return {f["path"] for f in manifest(b)["files"] if fa.get(f["path"]) != f["sha256"]}


class Bed:
    def __init__(self, fleet: Fleet, a: Path, b: Path) -> None:
        self.f, self.a, self.b = fleet, a, b

    def ship(self, src: Path, *extra: str, inventory: Path | None = None, pattern: str = "fleet"):
        return self.f.ansible(pattern, "-m", TASK, "-a", f"src={src} dest={DEST} keep=3", *extra,
                              inventory=inventory, timeout=300)

    def host_listing(self, host: str) -> list[str]:
        r = self.f.exec(host, "sh", "-c", f"ls -A {DEST} 2>/dev/null || true")
        return sorted(r.stdout.split())

    def host_sha(self, host: str, path: str) -> str:
        r = self.f.exec(host, "sha256sum", path, timeout=60)
        assert r.returncode == 0, r
        return r.stdout.split()[0]


@pytest.fixture(scope="module")
def bed() -> Iterator[Bed]:
    a, b = cached_pair()
    with running_fleet(3) as f:
        f.install_collection()
        yield Bed(f, a, b)


def test_first_ship_sends_the_bundle_and_each_host_holds_a_verified_copy(bed):
    ma = manifest(bed.a)
    run = bed.ship(bed.a)
    assert run.returncode == 0, run
    res = run.task_results(TASK)
    assert sorted(res) == bed.f.hosts, run
    total = size_of(bed.a)
    for h in bed.f.hosts:
        r = res[h]
        assert r["_status"] == "changed" and r["release"] == ma["bundle_id"], r
        assert r["path"] == f"{DEST}/{ma['bundle_id']}"
        assert r["sent_files"] == len(ma["files"]) and r["reused_files"] == 0
        # what crossed the wire (rsync --stats) is the bundle: a little more for the protocol
        assert total * 0.98 < r["sent_bytes"] < total * 1.02, (r["sent_bytes"], total)
        assert bed.host_listing(h) == [".ship-trust.json", ".ship.lock", ma["bundle_id"]]
        assert bed.f.exec(h, "cat", f"{r['path']}/MANIFEST").stdout == (bed.a / "MANIFEST").read_text()
        venv = next(x for x in ma["files"] if x["path"] == FTLLM_PART)
        assert bed.host_sha(h, f"{r['path']}/{FTLLM_PART}") == venv["sha256"]
        n = bed.f.exec(h, "sh", "-c", f"find {r['path']} -type f | wc -l").stdout.strip()
        assert int(n) == len(ma["files"]) + 2  # the files, MANIFEST and MANIFEST.sig: nothing else


def test_reship_sends_nothing_and_reports_no_change(bed):
    run = bed.ship(bed.a)
    assert run.returncode == 0, run
    for r in run.task_results(TASK).values():
        assert r["_status"] == "ok" and r["changed"] is False, r
        # nothing but the small files that go along with the first call (the controller cannot know before it asks)
        assert r["sent_files"] == 0 and r["sent_bytes"] == r["inline_bytes"] <= 512 << 10, r
        assert set(r["timings"]) == {"prepare"}, r["timings"]
    assert all(s["changed"] == 0 for s in run.stats.values()), run.stats
    # the host trusted its files by their records (nothing read); with rehash=true it reads them all again
    assert all(r["host_hashed_bytes"] == 0 for r in run.task_results(TASK).values())
    again = bed.f.ansible("h1", "-m", TASK, "-a", f"src={bed.a} dest={DEST} rehash=true", timeout=120)
    r = again.task_results(TASK)["h1"]
    assert r["changed"] is False and r["host_hashed_bytes"] == size_of(bed.a), r


def test_check_mode_reports_what_would_be_sent_and_changes_nothing(bed):
    before = {h: bed.host_listing(h) for h in bed.f.hosts}
    run = bed.ship(bed.b, "--check", "--diff")
    assert run.returncode == 0, run
    want = differing(bed.a, bed.b)
    sizes = {f["path"]: f["size"] for f in manifest(bed.b)["files"]}
    for r in run.task_results(TASK).values():
        assert r["_status"] == "changed", r
        assert r["sent_files"] == len(want) and r["sent_bytes"] == sum(sizes[p] for p in want), (r, want)
    assert {h: bed.host_listing(h) for h in bed.f.hosts} == before
    assert "+ wheels/sniffio-" in run.stdout and "= wheels/ftllm-" in run.stdout, run.stdout[-3000:]


def test_a_bundle_that_does_not_match_its_manifest_fails_naming_the_file_and_leaves_nothing(bed, tmp_path):
    # a copy of the second bundle (hard links) whose rebuilt wheel was swapped for other bytes of the same size
    bad = Path(str(bed.b) + "-bad")
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(bed.b, bad, copy_function=os.link)
    try:
        whl = next((bad / "wheels").glob("sniffio-*.whl"))
        size = whl.stat().st_size
        whl.unlink()
        whl.write_bytes(b"\0" * size)
        os.chmod(whl, 0o644)
        before = bed.host_listing("h1")
        run = bed.ship(bad, pattern="h1")
        assert run.returncode == 2, run
        r = run.task_results(TASK)["h1"]
        assert r["_status"] == "failed" and whl.name in r["msg"] and "does not match the MANIFEST" in r["msg"], r
        assert "Traceback" not in run.stdout + run.stderr
        assert bed.host_listing("h1") == before  # no release directory, no staging directory
    finally:
        shutil.rmtree(bad, ignore_errors=True)


def larger_change(b: Path) -> Path:
    """A copy of bundle `b` (hard links) whose smallest file over the inline budget (64 KiB) is other bytes, with a
    MANIFEST made again for it (the ship does not check the signature: install does): a release that needs rsync on
    hosts that hold `b`."""
    import hashlib

    from deploy_tool.manifest import FileEntry, Manifest, compute_bundle_id

    m = Manifest.from_bytes((b / "MANIFEST").read_bytes())
    big = min((f for f in m.files if f.size > 64 << 10), key=lambda f: f.size)
    out = Path(str(b) + "-larger")
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(b, out, copy_function=os.link)
    data = b"\0" * 16 + (b / big.path).read_bytes()[16:]
    (out / big.path).unlink()  # a new file: the link's other name, in `b`, keeps its bytes
    (out / big.path).write_bytes(data)
    os.chmod(out / big.path, big.mode)
    files = tuple(FileEntry(f.path, f.size, f.mode, hashlib.sha256(data).hexdigest()) if f.path == big.path else f
                  for f in m.files)
    new = Manifest(m.format_version, compute_bundle_id(files, m.inputs, m.native_libs, m.format_version), m.created,
                   m.inputs, files, m.native_libs)
    (out / "MANIFEST").unlink()  # a link to `b`'s, as every file of the copy: never written through
    (out / "MANIFEST").write_bytes(new.to_bytes())
    (out / "MANIFEST.sig").unlink()
    return out


def test_a_failed_transfer_leaves_nothing_on_the_host(bed):
    # onto a host that holds the first bundle, with one file over the inline budget changed: the staging directory
    # holds links to the first bundle's files and the small files sent along, and the failed rsync's abort removes
    # it, keeping the first bundle's records
    original = (bed.a / "MANIFEST").read_bytes()
    larger = larger_change(bed.a)
    assert (bed.a / "MANIFEST").read_bytes() == original  # the cached bundle is untouched
    try:
        before = bed.host_listing("h1")
        args = json.dumps({"src": str(larger), "dest": DEST, "rsync_opts": ["--no-such-option"]})
        run = bed.f.ansible("h1", "-m", TASK, "-a", args, timeout=120)
        assert run.returncode == 2, run
        r = run.task_results(TASK)["h1"]
        assert r["_status"] == "failed" and "rsync of 1 file(s)" in r["msg"] and "--no-such-option" in r["msg"], r
        assert bed.host_listing("h1") == before
        again = bed.ship(bed.a, pattern="h1").task_results(TASK)["h1"]
        assert again["changed"] is False and again["host_hashed_bytes"] == 0, again  # the records held
    finally:
        shutil.rmtree(larger, ignore_errors=True)
    # a directory holding no bundle yet: the large files must cross by rsync (the small ones went along with the
    # first call and were written into the staging directory, which the abort removes)
    other = DEST + "-empty"
    args = json.dumps({"src": str(bed.b), "dest": other, "rsync_opts": ["--no-such-option"]})
    run = bed.f.ansible("h1", "-m", TASK, "-a", args, timeout=120)
    assert run.returncode == 2, run
    r = run.task_results(TASK)["h1"]
    assert r["_status"] == "failed" and "rsync of" in r["msg"] and "--no-such-option" in r["msg"], r
    left = bed.f.exec("h1", "ls", "-A", other)
    assert left.returncode == 0 and sorted(left.stdout.split()) == [".ship-trust.json", ".ship.lock"], left


def test_a_release_one_wheel_apart_sends_only_that(bed):
    mb = manifest(bed.b)
    want = differing(bed.a, bed.b)
    assert any(p.startswith("wheels/sniffio-") for p in want) and CHANGED_PART in want
    # the venv differs in the rebuilt wheel's part alone: every other distribution's archive is byte-identical
    assert {p for p in want if p.startswith("venv-parts/")} == {CHANGED_PART}, want
    assert not any(p.startswith("wheels/ftllm-") for p in want)
    changed_bytes = sum(f["size"] for f in mb["files"] if f["path"] in want)
    first = size_of(bed.a)
    run = bed.ship(bed.b)
    assert run.returncode == 0, run
    for h, r in run.task_results(TASK).items():
        assert r["_status"] == "changed", r
        assert r["sent_files"] == len(want) and r["reused_files"] == len(mb["files"]) - len(want), r
        # every changed file is small, so all went along with the first module call, which committed: no rsync, no
        # second call; what crossed is the bundle's small files (at most 512 KiB), not the 250 MB of the venv's
        # other parts
        assert set(r["timings"]) == {"prepare"}, r["timings"]
        assert r["sent_bytes"] == r["inline_bytes"] >= changed_bytes, (r["sent_bytes"], changed_bytes)
        assert r["sent_bytes"] <= min(first * 0.01, 512 << 10), (r["sent_bytes"], first)
        venv = next(x for x in mb["files"] if x["path"] == CHANGED_PART)
        assert bed.host_sha(h, f"{r['path']}/{CHANGED_PART}") == venv["sha256"]
        assert bed.host_listing(h) == sorted([".ship-trust.json", ".ship.lock", mb["bundle_id"],
                                              manifest(bed.a)["bundle_id"]])


def test_a_tampered_file_of_an_earlier_bundle_is_not_reused(bed):
    ma = manifest(bed.a)
    ftllm = next(f for f in ma["files"] if f["path"].startswith("wheels/ftllm-"))
    path = f"{DEST}/{ma['bundle_id']}/{ftllm['path']}"
    r = bed.f.exec("h2", "sh", "-c", f"printf X | dd of={path} bs=1 seek=4096 conv=notrunc status=none")
    assert r.returncode == 0, r
    assert bed.host_sha("h2", path) != ftllm["sha256"]
    run = bed.ship(bed.a)
    assert run.returncode == 0, run
    res = run.task_results(TASK)
    assert res["h1"]["changed"] is False and res["h3"]["changed"] is False
    r = res["h2"]
    # the second bundle was shipped with the default `link` (both are of MANIFEST format 2): its name for that
    # wheel is the same damaged inode, so no good copy is left on h2 and the wheel is sent again
    assert r["_status"] == "changed" and r["sent_files"] == 1 and r["refused"], r
    assert bed.host_sha("h2", path) == ftllm["sha256"]
    assert bed.ship(bed.a, pattern="h2").task_results(TASK)["h2"]["changed"] is False
    # the second bundle's damaged name is refused at its next ship, and repaired from the first's new copy
    rb = bed.ship(bed.b, pattern="h2").task_results(TASK)["h2"]
    assert rb["changed"] is True and rb["sent_files"] == 0 and rb["linked_files"] == rb["reused_files"], rb
    assert bed.ship(bed.b, pattern="h2").task_results(TASK)["h2"]["changed"] is False


def test_an_unreachable_host_fails_alone(bed):
    inv = bed.f.inventory_with("ghost", {"ghost": "ansible_host=10.231.0.99"}, after="h1")
    run = bed.ship(bed.b, inventory=inv)
    assert run.returncode == 4, run
    assert run.stats["ghost"]["unreachable"] == 1, run.stats
    res = run.task_results(TASK)
    assert res["ghost"]["_status"] == "unreachable", res["ghost"]
    for h in bed.f.hosts:
        assert run.stats[h]["failures"] == 0 and run.stats[h]["unreachable"] == 0, run.stats
        assert res[h]["changed"] is False  # each already holds the second bundle



def test_with_link_the_second_bundle_shares_the_firsts_unchanged_files(bed):
    """link=true on real hosts holding the first bundle (the second removed first): each file both bundles hold is
    one inode under two names, what changed is the second's own, nothing unchanged is sent, and a ship again finds
    it present without reading a byte (the links' records hold)."""
    ma, mb = manifest(bed.a), manifest(bed.b)
    want = differing(bed.a, bed.b)
    run = bed.f.ansible("fleet", "-m", "ansible.builtin.file", "-a", f"path={DEST}/{mb['bundle_id']} state=absent")
    assert run.returncode == 0, run
    def ship_linked():
        return bed.f.ansible("fleet", "-m", TASK, "-a", f"src={bed.b} dest={DEST} keep=3 link=true", timeout=300)

    run = ship_linked()
    assert run.returncode == 0, run
    ftllm = next(f["path"] for f in mb["files"] if f["path"].startswith("wheels/ftllm-"))
    for h, r in run.task_results(TASK).items():
        assert r["_status"] == "changed" and r["sent_files"] == len(want), r
        ino = {}
        for rel in (ftllm, FTLLM_PART, CHANGED_PART):
            st = bed.f.exec(h, "stat", "-c", "%i %h", f"{DEST}/{ma['bundle_id']}/{rel}", f"{DEST}/{mb['bundle_id']}/{rel}")
            assert st.returncode == 0, st
            ino[rel] = st.stdout.split("\n")[:2]
        assert ino[ftllm][0] == ino[ftllm][1] and ino[ftllm][0].endswith(" 2"), ino  # shared: two links
        assert ino[FTLLM_PART][0] == ino[FTLLM_PART][1], ino  # an unchanged part of the venv: shared too
        assert ino[CHANGED_PART][0] != ino[CHANGED_PART][1], ino  # changed: its own
    again = ship_linked()
    assert again.returncode == 0, again
    for r in again.task_results(TASK).values():
        assert r["changed"] is False and r["host_hashed_bytes"] == 0, r
