"""Releases over time (deploy_tool.box.releases): the list, keeping the newest N, removing one, and uninstall,
killed at every step, on the fake systemd with two real small bundles (tests/test_install_kills.py's): what
prune never removes is a property over any set of releases and roles; the rest runs the real file system work.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deploy_tool import config
from deploy_tool.box import operations, releases, sequence
from deploy_tool.box.state import Store
from deploy_tool.errors import DeployError, DowngradeError, InputError, StateError
from tests.support import fake_systemd as fs
from tests.support.examples import examples
from tests.test_install_kills import CLEAN, FU, Box, Bundles, _rid

# with tests/test_install_kills.py on one xdist worker: its two packed bundles (tests/conftest.py) serve both
pytestmark = pytest.mark.xdist_group("tests/test_install_kills.py")


@settings(max_examples=examples(300), deadline=None)
@given(roles=st.lists(st.sets(st.sampled_from(releases.ROLES), max_size=2), max_size=9), keep=st.integers(1, 6))
def test_prune_removes_the_oldest_without_a_role_and_never_one_with_a_role(roles: list[set[str]], keep: int) -> None:
    rels = [releases.Release(id=f"r{i:02d}", path="", installed=f"2026-01-{i + 1:02d}", roles=sorted(r))
            for i, r in enumerate(roles)]
    gone = releases.prune_plan(rels, keep)
    kept = [r for r in rels if r not in gone]
    assert not any(r.roles for r in gone)
    assert len(kept) == max(min(keep, len(rels)), sum(1 for r in rels if r.roles))
    if gone:  # the removed are the oldest of those without a role
        newest_gone = max(r.installed for r in gone)
        assert all(r.installed > newest_gone for r in kept if not r.roles)


def _box(b: Bundles, keep: int = 3) -> Box:
    bx = Box(b)
    bx.cfg = dataclasses.replace(b.cfg, supervision=dataclasses.replace(b.cfg.supervision, keep_releases=keep))
    return bx


def _stale(bx: Box, rid: str = "0123456789abcdef", age_s: float = 86400) -> str:
    """An old release no state or history names any more (as an install long ago left one)."""
    src = bx.releases / _rid(bx.b.a)
    shutil.copytree(src, bx.releases / rid, symlinks=True)
    t = time.time() - age_s
    os.utime(bx.releases / rid, (t, t))
    return rid


@settings(max_examples=examples(40), deadline=None)
@given(files=st.lists(st.tuples(st.sampled_from(["x", "y", "both", "x twice"]), st.integers(0, 20_000)),
                      max_size=8))
def test_what_removing_a_release_frees_leaves_out_what_another_shares(files: list[tuple[str, int]]) -> None:
    """Two releases whose files are linked between them in any way (as install links the venv parts a release
    shares with the one before): each one's size counts all its files, what removing it frees only those with no
    name in the other, both together free all, and a file counts once however many names it has."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        x, y = Path(tmp, "x"), Path(tmp, "y")
        x.mkdir()
        y.mkdir()
        blocks = {}
        for i, (where, size) in enumerate(files):
            first = (y if where == "y" else x) / f"f{i}"
            first.write_bytes(os.urandom(size))
            blocks[where, i] = first.stat().st_blocks * 512
            if where == "both":
                os.link(first, y / f"f{i}")
            elif where == "x twice":
                os.link(first, x / f"g{i}")
        dirs = {d: d.stat().st_blocks * 512 for d in (x, y)}

        def of(*wheres: str) -> int:
            return sum(b for (w, _), b in blocks.items() if w in wheres)

        assert releases.disk_usage(x) == (dirs[x] + of("x", "both", "x twice"), dirs[x] + of("x", "x twice"))
        assert releases.disk_usage(y) == (dirs[y] + of("y", "both"), dirs[y] + of("y"))
        everything = sum(dirs.values()) + of("x", "y", "both", "x twice")
        assert releases.disk_usage(x, y) == (everything, everything)


@pytest.fixture()
def box_a(bundles: Bundles, saved_a: Path):
    bx = _box(bundles, keep=1)
    bx.restore(saved_a)
    bx.world.bring_up(FU)
    yield bx
    bx.world.close()
    bx.reset()


def test_the_list_names_each_release_its_size_and_roles(box_a: Box) -> None:
    rid = _rid(box_a.b.a)
    rels = releases.releases(box_a.cfg)
    assert [r.id for r in rels] == [rid]
    r = rels[0]
    assert r.roles == ["current", "last-good"] and r.bundle_name == "cpu-demo" and r.bytes > 1_000_000
    assert r.installed and r.last_active


def test_an_install_prunes_beyond_keep_but_never_what_the_box_needs(box_a: Box) -> None:
    """keep 1: installing B removes a stale old release, keeps A (previous: the rollback's way back) and B."""
    old = _stale(box_a)
    size = releases.disk_usage(Path(box_a.cfg.paths.releases_dir) / old)[1]
    out = box_a.install(box_a.b.b, cfg=dataclasses.replace(
        box_a.b.cfg_b, supervision=dataclasses.replace(box_a.b.cfg_b.supervision, keep_releases=1)))
    assert out.what == "installed", (out, box_a.log)
    names = box_a.release_entries(hidden=False)
    assert old not in names and {_rid(box_a.b.a), _rid(box_a.b.b)} <= set(names)
    ev = [e for e in box_a.history() if e["event"] == "prune"]
    # the automatic prune measures what it removes (and only that: nobody sees the others' sizes)
    assert ev and ev[-1]["removed"] == [old] and ev[-1]["freed_bytes"] == size > 0
    with pytest.raises(StateError, match="previous") as ei:
        releases.remove(box_a.cfg, _rid(box_a.b.a))
    assert "install another release first" in (ei.value.hint or "") and "switch or" not in (ei.value.hint or "")
    # a release id given to install (it takes a bundle): named as such, with what install takes
    from deploy_tool.box import install
    from deploy_tool.errors import InputError

    with pytest.raises(InputError) as ie:
        install.find_bundle(box_a.cfg, _rid(box_a.b.a))
    assert "is a release laid down on this box" in ie.value.message and ".tar.zst" in (ie.value.hint or "")


def test_prune_on_demand_dry_run_and_remove(box_a: Box) -> None:
    old = _stale(box_a)
    plan = releases.prune(box_a.cfg, keep=1, dry_run=True)
    assert [r.id for r in plan.removed] == [old] and old in box_a.release_entries()  # nothing changed
    with pytest.raises(InputError, match="no release 'nope'"):
        releases.remove(box_a.cfg, "nope")
    with pytest.raises(StateError, match="current"):
        releases.remove(box_a.cfg, _rid(box_a.b.a))
    assert releases.remove(box_a.cfg, old).id == old and old not in box_a.release_entries()


def test_a_kill_between_rename_and_delete_leaves_no_release_and_is_swept(box_a: Box) -> None:
    old = _stale(box_a)
    os.environ["DEPLOYTOOL_FAULT"] = "kill:release-renamed"
    try:
        with box_a.world.running(), pytest.raises(fs.Killed):
            releases.prune(box_a.cfg, keep=1)
    finally:
        os.environ.pop("DEPLOYTOOL_FAULT")
    assert old not in [r.id for r in releases.releases(box_a.cfg)]
    assert box_a.release_entries() == sorted([_rid(box_a.b.a), f".removing-{old}"])
    releases.prune(box_a.cfg, keep=1)
    assert box_a.release_entries() == [_rid(box_a.b.a)]


def _uninstalled(bx: Box, *, kept_config: bool = True, cfg: config.Config | None = None) -> None:
    cfg = cfg or bx.cfg
    assert bx.traces() == CLEAN | {"releases": []}, bx.traces()
    assert not bx.releases.exists()
    # the replay guard outlives the install (and the lock file, held until uninstall exits), the rest of the state
    # dir does not; --purge takes it too
    left = set(os.listdir(bx.state_dir)) if bx.state_dir.exists() else set()
    assert left - {releases.LOCK_FILE} == ({sequence.RECORD_NAME} if kept_config else set()), left
    assert all(u.active_state != "active" and not u.enabled for u in bx.world.units.values()), \
        {n: (u.active_state, u.enabled) for n, u in bx.world.units.items()}
    assert Path(cfg.paths.config).exists() == kept_config and Path(cfg.paths.keys_dir).exists() == kept_config


def test_uninstall_dry_run_changes_nothing_and_uninstall_leaves_config_and_keys(box_a: Box, tmp_path: Path) -> None:
    before = box_a.traces()
    plan = releases.uninstall(box_a.cfg, dry_run=True)
    assert [s["name"] for s in plan.steps] == list(releases.UNINSTALL_STEPS) and box_a.traces() == before
    with box_a.world.running():
        res = releases.uninstall(box_a.cfg, sd=box_a.world.systemd(), log=box_a.log.append)
    assert res.ok and res.kept == [box_a.cfg.paths.config, box_a.cfg.paths.keys_dir]
    _uninstalled(box_a)
    with box_a.world.running():  # again: nothing to do
        assert releases.uninstall(box_a.cfg, sd=box_a.world.systemd()).steps == []
    # what it kept still refuses an older bundle of the name it installed, as before the uninstall
    (name, rec), = sequence.load(box_a.state_dir).items()
    older = sequence.BundleSequence(name=name, number=rec["sequence"] - 1)
    with pytest.raises(DowngradeError):
        sequence.check(box_a.releases, box_a.state_dir, older, "an-older-release")
    cfg = _own_config_and_keys(box_a, tmp_path)
    with box_a.world.running():  # --purge on an uninstalled box: the config, the keys and the record go
        res = releases.uninstall(cfg, purge=True, sd=box_a.world.systemd())
    assert [s["name"] for s in res.steps] == ["purged"] and res.kept == []
    _uninstalled(box_a, kept_config=False, cfg=cfg)


def _own_config_and_keys(bx: Box, tmp: Path) -> config.Config:
    """The box's config with a copy of its config file and keys dir of its own (the shared ones serve the other
    tests), for a --purge to remove."""
    shutil.copy(bx.cfg.paths.config, tmp / "deploytool.yaml")
    shutil.copytree(bx.cfg.paths.keys_dir, tmp / "keys")
    return dataclasses.replace(bx.cfg, paths=dataclasses.replace(bx.cfg.paths, config=str(tmp / "deploytool.yaml"),
                                                                keys_dir=str(tmp / "keys")))


def test_uninstall_purge_leaves_nothing_of_the_box(box_a: Box, tmp_path: Path) -> None:
    cfg = _own_config_and_keys(box_a, tmp_path)
    with box_a.world.running():
        res = releases.uninstall(cfg, purge=True, sd=box_a.world.systemd())
    assert res.kept == [] and res.steps[-1]["name"] == "purged"
    _uninstalled(box_a, kept_config=False, cfg=cfg)


@pytest.mark.parametrize("step", releases.UNINSTALL_STEPS)
def test_uninstall_killed_at_every_step_is_finished_by_recover(box_a: Box, step: str) -> None:
    os.environ["DEPLOYTOOL_FAULT"] = f"kill:{step}"
    try:
        with box_a.world.running(), pytest.raises(fs.Killed):
            releases.uninstall(box_a.cfg, sd=box_a.world.systemd())
    finally:
        os.environ.pop("DEPLOYTOOL_FAULT")
    if step != "state-removed":
        assert box_a.state()["operation"]["kind"] == "uninstall"
        with box_a.world.running():
            operations.recover(box_a.cfg, sd=box_a.world.systemd())
    else:  # killed after the state dir was renamed away: uninstall again sweeps what is left
        with box_a.world.running():
            releases.uninstall(box_a.cfg, sd=box_a.world.systemd())
    _uninstalled(box_a)


def test_uninstall_with_an_interrupted_install_says_recover_first(box_a: Box) -> None:
    out = box_a.install(box_a.b.b, cfg=box_a.b.cfg_b, kill="pinned")
    assert out.what == "killed"
    with box_a.world.running(), pytest.raises(DeployError, match="recover"):
        releases.uninstall(box_a.cfg, sd=box_a.world.systemd())
    assert box_a.state()["operation"]["kind"] == "install"  # nothing changed


def test_a_release_installed_again_counts_from_its_latest_install(box_a: Box) -> None:
    """A, then B, then A again (going back): A is the newer install now, for the list and for what a prune keeps,
    not dated by its first install."""
    a, b = _rid(box_a.b.a), _rid(box_a.b.b)
    assert box_a.install(box_a.b.b, cfg=box_a.b.cfg_b).what == "installed"
    assert box_a.install(box_a.b.a).what == "installed", box_a.log
    store = Store(box_a.cfg.paths.state_dir)
    rels = {r.id: r for r in releases.releases(box_a.cfg, store.load(), store.history())}
    firsts = [e["time"] for e in box_a.history() if e["event"] == "install" and e.get("release") == a and e.get("ok")]
    assert len(firsts) == 2 and rels[a].installed == firsts[-1] > rels[b].installed
