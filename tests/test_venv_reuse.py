"""An upgrade takes the venv parts it shares with the current release from that release (deploy_tool.box.venvreuse):
hard links, held to the current release's pins, never written through; anything not as pinned and every part is
unpacked instead. The real install (fake systemd, the real small bundles of tests/test_install_kills.py: B differs
from A in one env var, so every part but `_base` is shared)."""

from __future__ import annotations

import base64
import csv
import hashlib
import json
import os
from pathlib import Path

import pytest

from deploy_tool.box import venvreuse
from tests.test_install_kills import FU, Box, F, L, _rid, _serving, _with_a

SCRIPT = "bin/tiny-hello"


@pytest.fixture()
def box(bundles) -> Box:
    bx = Box(bundles)
    yield bx
    bx.world.close()
    bx.reset()


def _venv(bx: Box, rid: str) -> Path:
    return bx.releases / rid / "venv"


def _files(venv: Path) -> dict[str, os.stat_result]:
    out = {}
    for top, _dirs, names in os.walk(venv):
        for n in names:
            p = Path(top, n)
            out[str(p.relative_to(venv))] = p.lstat()
    return out


def _index(bx: Box, rid: str) -> dict:
    return json.loads((bx.releases / rid / venvreuse.INDEX).read_text())["parts"]


def _venv_mark(bx: Box) -> dict:
    ev = [e for e in bx.history() if e["event"] == "install"][-1]
    return next(s for s in ev.get("steps", []) if s["step"] == "venv-ready") if ev.get("steps") else {}


def _contents(venv: Path) -> dict[str, bytes]:
    return {rel: (venv / rel).read_bytes() for rel, st in _files(venv).items() if not Path(venv / rel).is_symlink()}


def test_an_upgrade_links_the_shared_parts_and_relocates_without_writing_through(box: Box, saved_a: Path) -> None:
    """A->B: every file of the shared part is A's inode in B, `_base` is unpacked anew; B's script names B's venv
    (and its RECORD row says so) while A's still names A's; both releases verify; B's index lists the same entries
    for every part as A's."""
    _with_a(box, saved_a)
    a, b = _rid(box.b.a), _rid(box.b.b)
    before_a = _contents(_venv(box, a))
    out = box.install(box.b.b, cfg=box.b.cfg_b)
    assert out.what == "installed", (out, box.log)
    va, vb = _venv(box, a), _venv(box, b)
    fa, fb = _files(va), _files(vb)
    assert set(fa) == set(fb)
    assert _index(box, b) == _index(box, a)  # the same archives, the same entries
    parts = _index(box, b)
    base = set(parts.pop("venv-parts/_base.tar.zst")["names"])
    assert "venv-parts/tinypkg.tar.zst" in parts
    shared = {n for p in parts.values() for n in p["names"]}
    linked = {r for r in fa if (fa[r].st_dev, fa[r].st_ino) == (fb[r].st_dev, fb[r].st_ino)}
    assert SCRIPT in shared and linked, box.log
    # relocated, so written anew in B: the scripts naming A's venv, and the RECORDs listing them
    scripts = {r for r in shared if r in fa and str(va).encode() in (va / r).read_bytes()}
    records = {r for r in shared if r.endswith(".dist-info/RECORD")
               and any(f"/{s}," in (va / r).read_text() for s in scripts)}
    assert SCRIPT in scripts and len(records) >= 2  # tinypkg's and pip's
    assert linked == {r for r in shared if r in fa} - scripts - records
    assert not linked & base
    assert _contents(va) == before_a  # nothing written through a link: A is as it was, its script naming A
    assert (va / SCRIPT).read_bytes().startswith(f"#!{va}/bin/python".encode())
    script_b = (vb / SCRIPT).read_bytes()
    assert script_b.startswith(f"#!{vb}/bin/python".encode())
    record = next(vb.glob("lib/python*/site-packages/tinypkg-1.0.dist-info/RECORD"))
    row = next(r for r in csv.reader(record.read_text().splitlines()) if r[0].endswith("bin/tiny-hello"))
    digest = base64.urlsafe_b64encode(hashlib.sha256(script_b).digest()).rstrip(b"=").decode()
    assert row[1:] == [f"sha256={digest}", str(len(script_b))]
    assert any(f"reused_parts={len(parts)}" in ln and f"from={a}" in ln for ln in box.log), box.log
    assert box.verify(F).ok and box.verify(L).ok
    assert _serving(box) == {FU}


@pytest.mark.parametrize("what", ["file", "index", "missing"])
def test_a_current_release_not_as_pinned_gives_nothing_and_every_part_is_unpacked(box: Box, saved_a: Path,
                                                                                 what: str) -> None:
    """A file of the shared part changed in A (not re-pinned), A's index changed, or a file of the part gone: B
    links nothing from A, unpacks every part from its own signed archives, and installs; A's files are left as
    they were found."""
    _with_a(box, saved_a)
    a, b = _rid(box.b.a), _rid(box.b.b)
    va = _venv(box, a)
    init = next(va.glob("lib/python*/site-packages/tinypkg/__init__.py"))
    if what == "file":
        init.unlink()  # A's files are links of the saved box's: replace, never write through
        init.write_bytes(b"VALUE = 666\n")
    elif what == "index":
        idx = box.releases / a / venvreuse.INDEX
        d = json.loads(idx.read_text())
        idx.unlink()
        idx.write_text(json.dumps(d, indent=1))
    else:
        init.unlink()
    before_a = _contents(va)
    out = box.install(box.b.b, cfg=box.b.cfg_b)
    assert out.what == "installed", (out, box.log)
    vb = _venv(box, b)
    fa, fb = _files(va), _files(vb)
    assert not {r for r in fa if r in fb and (fa[r].st_dev, fa[r].st_ino) == (fb[r].st_dev, fb[r].st_ino)}
    got = next(vb.glob("lib/python*/site-packages/tinypkg/__init__.py")).read_bytes()
    assert got == b"VALUE = 1\n"
    why = {"file": "differs from its pin", "index": "differs from its pin", "missing": "cannot link"}[what]
    assert any("every part unpacked" in ln and why in ln for ln in box.log), box.log
    assert _contents(va) == before_a
    assert box.verify(F).ok
