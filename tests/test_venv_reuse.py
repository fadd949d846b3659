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
import shutil
import stat
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deploy_tool.box import fingerprint, venvreuse
from tests.support.examples import examples
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


def _venv_mark(result) -> dict:
    """The venv-ready step of an install's result (what `install --json` reports)."""
    return next(s for s in result.steps if s["step"] == "venv-ready")


def _contents(venv: Path) -> dict[str, bytes]:
    return {rel: (venv / rel).read_bytes() for rel, st in _files(venv).items() if not Path(venv / rel).is_symlink()}


# the install tests run where tests/test_install_kills.py's two packed bundles are (tests/conftest.py): on its xdist
# worker, not packed again on another
ON_THE_BUNDLES_WORKER = pytest.mark.xdist_group("tests/test_install_kills.py")


@ON_THE_BUNDLES_WORKER
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


@ON_THE_BUNDLES_WORKER
@pytest.mark.parametrize("what", ["file", pytest.param("index", marks=pytest.mark.slow),
                                  pytest.param("missing", marks=pytest.mark.slow), "repinned"])
def test_a_current_release_not_as_pinned_gives_nothing_and_every_part_is_unpacked(box: Box, saved_a: Path,
                                                                                 what: str) -> None:
    """A file of the shared part changed in A (not re-pinned), A's index changed, a file of the part gone, or a
    file changed and A pinned again on purpose: B links nothing from A, unpacks every part from its own signed
    archives, and installs; A's files are left as they were found."""
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
    elif what == "missing":
        init.unlink()
    else:  # a hotfix in A, pinned on purpose: B must still get the signed bytes
        init.unlink()
        init.write_bytes(b"VALUE = 666\n")
        for name in (F, L):
            fingerprint.pin(box.cfg, name, "hotfix", release=a)
    before_a = _contents(va)
    out = box.install(box.b.b, cfg=box.b.cfg_b)
    assert out.what == "installed", (out, box.log)
    vb = _venv(box, b)
    fa, fb = _files(va), _files(vb)
    assert not {r for r in fa if r in fb and (fa[r].st_dev, fa[r].st_ino) == (fb[r].st_dev, fb[r].st_ino)}
    got = next(vb.glob("lib/python*/site-packages/tinypkg/__init__.py")).read_bytes()
    assert got == b"VALUE = 1\n"
    why = {"file": "differs from its pin", "index": "differs from its pin", "missing": "cannot link",
           "repinned": "pinned again since its install ('hotfix')"}[what]
    assert any("every part unpacked" in ln and why in ln for ln in box.log), box.log
    if what in ("file", "missing"):  # refused while linking (not before): the step's report says why
        assert why in _venv_mark(out.result)["reuse_refused"]
    assert _contents(va) == before_a
    assert box.verify(F).ok


# ------------------------------------------------------------------------------------------------ link_parts alone

PART = "venv-parts/pkg.tar.zst"
TREE = {"pkg": None, "pkg/a.py": (0o644, b"A = 1\n"), "pkg/b.so": (0o755, b"\x7fELF" + bytes(300)),
        "pkg/data": None, "pkg/data/x.txt": (0o644, b"x" * 5000), "pkg/link": "a.py",
        "bin/tool": (0o755, b"#!/opt/r/A/venv/bin/python\n")}
_FILE = ["content", "longer", "chmod-0600", "chmod-4755", "unlink", "to-symlink", "to-dir", "pin-owner", "pin-mode",
         "capability"]
MUTATIONS = sorted({(m, n) for n, k in TREE.items()
                    for m in (_FILE if isinstance(k, tuple) else ["unlink", "retarget", "pin-owner", "link-escape"]
                              if isinstance(k, str) else ["pin-owner", "pin-dir-mode", "dir-to-symlink"])}
                   | {("index-escape", "pkg"), ("index-unpinned", "pkg")})


def _donor(root: Path) -> venvreuse.Donor:
    from deploy_tool.box import treepin

    for name, what in TREE.items():
        p = root / "venv" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        if what is None:
            p.mkdir(exist_ok=True)
        elif isinstance(what, str):
            p.symlink_to(what)
        else:
            p.write_bytes(what[1])
            p.chmod(what[0])
    entries = {}
    for name in TREE:
        p = root / "venv" / name
        st_ = p.lstat()
        content = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and not p.is_symlink() else \
            os.readlink(p) if p.is_symlink() else ""
        entries[f"venv/{name}"] = treepin.value(st_, content)
    return venvreuse.Donor("A", root, entries, {PART: ("0" * 64, sorted(TREE))})


def _mutate(d: venvreuse.Donor, how: str, victim: str) -> venvreuse.Donor:
    p = d.root / "venv" / victim
    rel = f"venv/{victim}"
    kind = TREE[victim]
    entries, names = dict(d.entries), list(d.parts[PART][1])
    is_file = p.is_file() and not p.is_symlink()
    if how in ("content", "longer", "chmod-0600", "chmod-4755", "to-dir") and isinstance(kind, tuple) and is_file:
        data = p.read_bytes()
        p.unlink()
        if how == "to-dir":
            p.mkdir()
        else:
            p.write_bytes({"content": bytes([data[0] ^ 1]) + data[1:], "longer": data + b"\n"}.get(how, data))
            p.chmod({"chmod-0600": 0o600, "chmod-4755": 0o4755}.get(how, kind[0]))
    elif how == "capability" and isinstance(kind, tuple) and is_file:
        fd = os.open(p, os.O_RDONLY)
        try:  # cap_sys_admin, effective: an xattr the pins do not cover
            os.setxattr(fd, "security.capability", struct.pack("<IIIII", 0x02000001, 1 << 21, 0, 0, 0))
        finally:
            os.close(fd)
    elif how == "dir-to-symlink" and kind is None and p.is_dir() and not p.is_symlink():
        # the directory moved out of the tree and a symlink to it left in its place: every file the same bytes
        elsewhere = d.root.parent / f"elsewhere-{victim.replace('/', '-')}"
        shutil.copytree(p, elsewhere, symlinks=True)
        shutil.rmtree(p)
        p.symlink_to(elsewhere)
    elif how in ("unlink", "to-symlink") and kind is not None and os.path.lexists(p) and not p.is_dir():
        p.unlink()
        if how == "to-symlink":
            p.symlink_to("a.py")
    elif how == "retarget" and p.is_symlink():
        p.unlink()
        p.symlink_to("data")
    elif how == "pin-owner":
        entries[rel] = entries[rel].replace(" ", " 1000:1000 ", 1) if " -> " not in entries[rel] else \
            entries[rel].replace("link ", "link 0:5 ")
    elif how == "pin-mode" and isinstance(kind, tuple):
        entries[rel] = entries[rel].replace(f"{kind[0]:04o}", "0600")
    elif how == "pin-dir-mode" and kind is None:
        entries[rel] = "dir 0700"
    elif how == "index-escape":
        names.append("../../etc/evil")
    elif how == "index-unpinned":
        names.append("pkg/planted.pth")
    elif how == "link-escape" and isinstance(kind, str):
        entries[rel] = "link -> ../../../../etc"
    else:
        return d  # the mutation does not apply to this entry: nothing changed
    return venvreuse.Donor(d.rid, d.root, entries, {PART: (d.parts[PART][0], names)})


def _tree_of(venv: Path) -> dict[str, tuple]:
    out = {}
    for name in TREE:
        p = venv / name
        st_ = p.lstat()
        if p.is_symlink():
            out[name] = ("link", os.readlink(p))
        elif p.is_dir():
            out[name] = ("dir", stat.S_IMODE(st_.st_mode))
        else:
            out[name] = ("file", stat.S_IMODE(st_.st_mode), p.read_bytes())
    return out


@settings(max_examples=examples(60), deadline=None)
@given(muts=st.lists(st.sampled_from(MUTATIONS), max_size=3))
def test_linked_parts_are_exactly_the_pinned_tree_or_nothing(muts: list[tuple[str, str]]) -> None:
    _linked_or_nothing(muts)


@pytest.mark.parametrize("mutation", MUTATIONS, ids="{0[0]}:{0[1]}".format)
def test_each_change_alone_is_refused_or_harmless(mutation: tuple[str, str]) -> None:
    """Every single change of the list, on its own (the property above draws them in combinations): refused, but
    a symlink of the donor's retargeted or removed: a link is made from its pinned target, so the tree is right."""
    on_disk_link = mutation[0] in ("retarget", "unlink") and isinstance(TREE[mutation[1]], str)
    assert _linked_or_nothing([mutation]) == ("linked" if on_disk_link else "refused")


def _linked_or_nothing(muts: list[tuple[str, str]]) -> str:
    """Whatever was done to the current release or its pins and index since: link_parts either refuses (NoReuse;
    install then unpacks every part) or lays down exactly the tree the pins describe (kinds, modes, bytes, link
    targets), never writing through to the donor; with nothing done it links."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "A"
        pristine = _donor(root)
        expected = _tree_of(root / "venv")
        d = pristine
        for how, victim in muts:
            d = _mutate(d, how, victim)
        donor_before = {n: _tree_of_one(root / "venv" / n) for n in TREE}
        dest = Path(tmp) / "B"
        (dest / "bin").mkdir(parents=True)  # as `_base` leaves it
        try:
            linked, _ = venvreuse.link_parts(d, [PART], dest)
        except venvreuse.NoReuse:
            assert d is not pristine, "refused though nothing was changed"
            outcome = "refused"
        else:
            assert _tree_of(dest) == expected
            assert {f.name for f in linked} == {n for n, k in TREE.items() if isinstance(k, tuple)}
            assert all(f.sha256 == hashlib.sha256((dest / f.name).read_bytes()).hexdigest() for f in linked)
            outcome = "linked"
        assert {n: _tree_of_one(root / "venv" / n) for n in TREE} == donor_before
        return outcome


def _tree_of_one(p: Path) -> tuple | None:
    if p.is_symlink():
        return ("link", os.readlink(p))
    if not p.exists():
        return None
    if p.is_dir():
        return ("dir", stat.S_IMODE(p.lstat().st_mode))
    return ("file", stat.S_IMODE(p.lstat().st_mode), p.read_bytes())


@pytest.mark.parametrize("there", ["bin/activate", "pkg"])
def test_a_name_the_new_venv_already_has_is_never_linked_over(tmp_path: Path, there: str) -> None:
    """`python -m venv` ran before the links (it writes bin/activate and the like in place), and the unpacked parts
    are there: a shared part's entry that exists already (a file, or a symlink where the part has a directory) is
    refused, so nothing is written into, or through, what is there, and the donor is untouched."""
    d = _donor(tmp_path / "A")
    names = sorted(TREE) + (["bin/activate"] if there == "bin/activate" else [])
    entries = dict(d.entries)
    if there == "bin/activate":
        (tmp_path / "A" / "venv" / "bin" / "activate").write_bytes(b"# a script a wheel called activate\n")
        entries["venv/bin/activate"] = entries["venv/bin/tool"].replace(
            entries["venv/bin/tool"].split()[-1],
            hashlib.sha256(b"# a script a wheel called activate\n").hexdigest()).replace("0755", "0644")
        os.chmod(tmp_path / "A" / "venv" / "bin" / "activate", 0o644)
    d = venvreuse.Donor("A", d.root, entries, {PART: ("0" * 64, names)})
    dest = tmp_path / "B"
    (dest / "bin").mkdir(parents=True)
    (tmp_path / "other").mkdir()
    if there == "bin/activate":
        (dest / "bin" / "activate").write_bytes(b"# venv's own\n")
    else:
        (dest / "pkg").symlink_to(tmp_path / "other")
    donor_before = {n: _tree_of_one(tmp_path / "A" / "venv" / n) for n in names}
    with pytest.raises(venvreuse.NoReuse, match="exists|Not a directory|Too many levels"):
        venvreuse.link_parts(d, [PART], dest)
    assert not os.listdir(tmp_path / "other")
    assert {n: _tree_of_one(tmp_path / "A" / "venv" / n) for n in names} == donor_before
    if there == "bin/activate":
        assert (dest / "bin" / "activate").read_bytes() == b"# venv's own\n"


def test_a_venv_of_more_directories_than_open_files_allowed_links(tmp_path: Path) -> None:
    """Under sshd (an ansible module's shell) a process may hold 1024 descriptors; a real venv has thousands of
    directories: link_parts holds only the path it is in open, on either side, so 300 directories link under a
    limit of 64."""
    import resource

    from deploy_tool.box import treepin

    root = tmp_path / "A"
    names = []
    for i in range(300):
        d = root / "venv" / "pkg" / f"d{i:03}"
        d.mkdir(parents=True)
        (d / "m.py").write_bytes(b"X = %d\n" % i)
        names += [f"pkg/d{i:03}", f"pkg/d{i:03}/m.py"]
    names.append("pkg")
    entries = {}
    for n in names:
        p = root / "venv" / n
        entries[f"venv/{n}"] = treepin.value(p.lstat(), hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file()
                                             else "")
    d = venvreuse.Donor("A", root, entries, {PART: ("0" * 64, sorted(names))})
    (tmp_path / "B").mkdir()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    try:
        linked, _ = venvreuse.link_parts(d, [PART], tmp_path / "B")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(linked) == 300
    assert (tmp_path / "B" / "pkg" / "d299" / "m.py").read_bytes() == b"X = 299\n"
