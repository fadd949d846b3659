"""The modes install gives a release: readable and traversable by the servers' DynamicUser, writable by root only.

A property test over any tree of modes (install.server_modes), the real case (a venv archive unpacks into a
private 0700 staging dir), and the e2e proof that a server runs under a dynamic uid is in tests/test_e2e.py.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy_tool import archive
from deploy_tool.box.install import server_modes
from tests.support.bundles import make_venv_tree
from tests.support.demo_box import access_problems
from tests.support.examples import examples
from tests.support.sandbox import new_run_dir


@pytest.fixture(scope="module")
def run_dir():
    """A root-owned 0755 directory with a world-traversable path to it (tmp_path's /tmp is world-writable)."""
    root = new_run_dir("modes")
    yield root
    shutil.rmtree(root, ignore_errors=True)


_modes = st.integers(min_value=0, max_value=0o7777)
_tree = st.lists(st.tuples(st.sampled_from(["d", "f", "l"]), st.integers(0, 3), _modes), min_size=1, max_size=12)


@settings(max_examples=examples(60), deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_tree)
def test_any_modes_become_0755_dirs_and_0644_or_0755_files(run_dir, spec):
    """Whatever modes a tree has (0700 dirs, 0000 files, setuid, world-writable), server_modes leaves dirs 0755 and
    files 0644, or 0755 if any execute bit was set; a symlink (even to a file outside the tree) is not followed."""
    outside = run_dir / "outside"
    outside.write_text("x")
    os.chmod(outside, 0o600)
    t = run_dir / "t"
    shutil.rmtree(t, ignore_errors=True)
    t.mkdir()
    dirs, want = [t], {}
    for i, (kind, parent, mode) in enumerate(spec):
        p = dirs[parent % len(dirs)] / f"e{i}"
        if kind == "d":
            p.mkdir()
            dirs.append(p)
            want[p] = 0o755
        elif kind == "f":
            p.write_text("x")
            want[p] = 0o755 if mode & 0o111 else 0o644
        else:
            p.symlink_to(outside)
            continue
        os.chmod(p, mode)
    for d in reversed(dirs):
        os.chmod(d, 0o700 if d == t else os.stat(d).st_mode & 0o7777)
    server_modes(t)
    got = {p: stat.S_IMODE(os.lstat(p).st_mode) for p in want}
    assert got == want
    assert stat.S_IMODE(os.stat(outside).st_mode) == 0o600
    assert access_problems([t]) == []
    assert server_modes(t) == 0  # a second pass changes nothing


def test_a_venv_unpacked_for_a_release_is_readable_by_any_uid(run_dir):
    """The real path: the venv archive unpacks into a private 0700 directory (what a DynamicUser could not
    enter, 203/EXEC at the first start); after server_modes the whole tree and the way to it are open to read."""
    a = archive.archive_tree(make_venv_tree(run_dir / "src-venv"), run_dir / "v.tar.zst")
    venv = archive.extract_archive(a, run_dir / "venv", symlinks=True).root
    assert any("cannot list and enter" in p for p in access_problems([venv]))
    server_modes(venv)
    assert access_problems([venv]) == []


def test_access_problems_names_a_closed_parent_and_a_writable_file(run_dir):
    """The test helper itself: a 0700 parent and a group-writable file are reported, each by path."""
    d = run_dir / "closed" / "inner"
    d.mkdir(parents=True)
    (d / "f").write_text("x")
    os.chmod(d / "f", 0o664)
    os.chmod(run_dir / "closed", 0o700)
    probs = access_problems([d])
    assert any(p.startswith(f"{run_dir / 'closed'}:") and "pass through" in p for p in probs), probs
    assert any(p.startswith(f"{d / 'f'}:") and "group/other write" in p for p in probs), probs
    os.chmod(run_dir / "closed", 0o755)
    os.chmod(d / "f", 0o644)
    assert access_problems([d]) == []
    assert access_problems([Path("/tmp")]) != []  # world-writable: no box path belongs there


def test_install_root_directories_are_created_open_whatever_the_umask(run_dir):
    """Under a umask of 077 (a hardened root shell), the install root's missing directories still come out 0755;
    one that exists keeps its mode."""
    from deploy_tool.box.install import makedirs_open

    (run_dir / "keep").mkdir()
    os.chmod(run_dir / "keep", 0o750)
    old = os.umask(0o077)
    try:
        makedirs_open(run_dir / "keep" / "opt" / "deploytool" / "releases")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(run_dir / "keep").st_mode) == 0o750
    for d in ("keep/opt", "keep/opt/deploytool", "keep/opt/deploytool/releases"):
        assert stat.S_IMODE(os.stat(run_dir / d).st_mode) == 0o755, d
