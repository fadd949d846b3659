"""treepin's walk done in a forked child (prefetch, the installed tool's ExecStartPre): the same key and names as
the walk in the process for any tree hypothesis draws, and a failed or missing child is a walk in the process,
never a wrong answer."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy_tool.box import treepin

NAMES = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="/\0"), min_size=1,
                max_size=12).filter(lambda n: n not in (".", "..") and len(n.encode("utf-8")) < 200)
TREES = st.recursive(st.one_of(st.binary(max_size=64), st.just(None)),
                     lambda kids: st.dictionaries(NAMES, kids, max_size=5), max_leaves=30)


def build(d: Path, spec: object) -> None:
    if isinstance(spec, dict):
        d.mkdir()
        for name, kid in spec.items():
            build(d / name, kid)
    elif spec is None:
        os.symlink("../elsewhere", d)
    else:
        assert isinstance(spec, bytes)
        d.write_bytes(spec)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=st.dictionaries(NAMES, TREES, max_size=6))
def test_a_prefetched_walk_has_the_key_and_names_of_a_walk_in_the_process(tmp_path: Path, spec: dict) -> None:
    root = tmp_path / "t"
    shutil.rmtree(root, ignore_errors=True)
    build(root, spec)
    treepin.prefetch(str(root))
    got = treepin.prefetched(str(root))
    here = treepin.walk(str(root))
    assert got is not None
    assert got.key == treepin.snapshot_key(here)
    assert got.rels == here.rels and got.files == here.files
    assert got.stats == []  # no stats came back: good for comparing the key only


def test_a_change_after_the_prefetch_gives_another_key(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"1")
    treepin.prefetch(str(tmp_path))
    before = treepin.prefetched(str(tmp_path))
    os.chmod(tmp_path / "a", 0o600)
    assert before is not None and before.key != treepin.snapshot_key(treepin.walk(str(tmp_path)))


def test_no_prefetch_a_missing_root_and_forget_leave_no_child(tmp_path: Path) -> None:
    assert treepin.prefetched(str(tmp_path)) is None  # nobody started one
    treepin.prefetch(str(tmp_path / "gone"))
    w = treepin.prefetched(str(tmp_path / "gone"))
    assert w is not None and w.rels == [] and w.files == 0  # an empty walk, as walk() gives
    assert w.key == treepin.snapshot_key(treepin.walk(str(tmp_path / "gone")))
    treepin.prefetch(str(tmp_path))
    pid = treepin._PENDING[str(tmp_path)][0]
    treepin.forget()
    assert not treepin._PENDING
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # the child was reaped: no zombie is left


def test_only_a_tool_running_from_a_release_prefetches_that_release(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from deploy_tool import entry

    rel = tmp_path / "releases" / "r1"
    (rel / "tool" / "venv").mkdir(parents=True)
    (tmp_path / "current").symlink_to(rel)
    monkeypatch.setattr("sys.prefix", str(tmp_path / "current" / "tool" / "venv"))
    assert entry._own_release() is None  # no MANIFEST: not a release, nothing is walked
    (rel / "MANIFEST").write_text("")
    assert entry._own_release() == str(rel)
    monkeypatch.setattr("sys.prefix", str(tmp_path / ".venv"))  # a development checkout's venv
    assert entry._own_release() is None
