"""The venv as one archive per distribution (pack.archive_venv_parts, venv.part_owner) and install's choice of
archives (venv.venv_archives): a property test over generated venvs, the cases by name beside it."""

from __future__ import annotations

import csv
import io
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy_tool import archive, venv
from deploy_tool.builder.pack import archive_venv_parts
from deploy_tool.errors import BundleError

SITE = "lib/python3.11/site-packages"


def _listing(root: Path) -> dict[str, tuple]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir",)
            else:
                out[rel] = ("file", p.stat().st_mode & 0o111 != 0, p.read_bytes())
    return out


def _write(root: Path, rel: str, data: bytes, mode: int = 0o644) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    os.chmod(p, mode)


def make_venv(root: Path, dists: dict[str, list[str]], loose: list[str], salt: dict[str, bytes]) -> dict[str, str]:
    """A venv-shaped tree: each distribution `Name` (as a wheel spells it) with its modules, a .pyc of each, a
    console script in bin/ and a dist-info whose RECORD lists them; `loose` files no RECORD names. Returns
    {path: the part it must go to}."""
    want: dict[str, str] = {}
    _write(root, "pyvenv.cfg", b"home = /usr/bin\n")
    want["pyvenv.cfg"] = venv.BASE_PART
    os.symlink("lib", root / "lib64")
    want["lib64"] = venv.BASE_PART
    for rel in loose:
        _write(root, rel, b"loose " + rel.encode())
        want[rel] = venv.BASE_PART
    for name, mods in sorted(dists.items()):
        part = venv.canonical_name(name)
        info = f"{name.replace('-', '_')}-1.0.dist-info"
        rows = []
        for m in mods:
            src = f"{SITE}/{m}.py"
            _write(root, src, b"# " + m.encode() + salt.get(name, b""))
            rows.append([f"{m}.py", "sha256=x", "1"])
            d, _, base = src.rpartition("/")
            pyc = f"{d}/__pycache__/{base[:-3]}.cpython-311.pyc"
            _write(root, pyc, b"pyc of " + src.encode())  # compiled at pack time: in no RECORD
            want[src] = want[pyc] = part
        script = f"bin/{part}-run"
        _write(root, script, b"#!/__deploytool_venv_prefix__/bin/python\n", 0o755)
        rows.append([f"../../../{script}", "sha256=y", "1"])
        want[script] = part
        _write(root, f"{SITE}/{info}/METADATA", f"Name: {name}\n".encode())
        want[f"{SITE}/{info}/METADATA"] = part
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerows(rows + [[f"{info}/RECORD", "", ""]])
        _write(root, f"{SITE}/{info}/RECORD", out.getvalue().encode())
        want[f"{SITE}/{info}/RECORD"] = part
    return want


dist_names = st.sampled_from(["Foo", "foo_bar", "Baz.Qux", "numpy", "typing-extensions", "zz9"])
modules = st.lists(st.sampled_from(["a", "b", "pkg/__init__", "pkg/sub/mod", "ns/x"]), min_size=1, max_size=3,
                   unique=True)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.dictionaries(dist_names, modules, min_size=1, max_size=4),
       loose=st.lists(st.sampled_from([f"{SITE}/loose.pth", "bin/activate", "share/doc.txt"]), unique=True),
       changed=st.integers(min_value=0, max_value=3))
def test_parts_unpack_to_the_venv_and_a_changed_distribution_changes_its_part_alone(raw, loose, changed) -> None:
    """For any venv of these shapes: every file goes to the part of the distribution whose RECORD names it (a .pyc
    with its source, the rest to _base); the parts unpack to the very tree; two venvs that differ in one
    distribution's file give parts that differ in that distribution's archive and nowhere else."""
    # two names that one canonical name covers would be one distribution twice: not a venv pip makes
    dists: dict[str, list[str]] = {}
    taken: dict[str, set[str]] = {}
    for name, mods in raw.items():
        if venv.canonical_name(name) in {venv.canonical_name(n) for n in dists}:
            continue
        mine = [m for m in mods if not any(m in t for t in taken.values())]  # a module path has one owner
        if mine:
            dists[name] = mine
            taken[name] = set(mine)
    if not dists:
        return
    victim = sorted(dists)[changed % len(dists)]
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        want = make_venv(t / "a", dists, loose, {})
        make_venv(t / "b", dists, loose, {victim: b" changed"})
        owner = venv.part_owner(t / "a")
        assert {rel: owner(rel) for rel in want} == want
        pa = archive_venv_parts(t / "a", t / "pa")
        pb = archive_venv_parts(t / "b", t / "pb")
        assert [p.name for p in pa] == [p.name for p in pb]
        assert {p.stem.removesuffix(".tar") for p in pa} == {venv.BASE_PART} | {venv.canonical_name(n) for n in dists}
        differ = {a.name for a, b in zip(pa, pb, strict=True) if a.read_bytes() != b.read_bytes()}
        assert differ == {f"{venv.canonical_name(victim)}.tar.zst"}
        archive.extract_archive(pa, t / "out")
        assert _listing(t / "out") == _listing(t / "a")


def test_a_path_two_records_name_goes_to_the_first_and_is_archived_once(tmp_path: Path) -> None:
    root = tmp_path / "v"
    make_venv(root, {"alpha": ["shared"], "beta": ["own"]}, [], {})
    with open(root / SITE / "beta-1.0.dist-info" / "RECORD", "a") as f:
        f.write("shared.py,sha256=x,1\n")
    assert venv.part_owner(root)(f"{SITE}/shared.py") == "alpha"
    parts = archive_venv_parts(root, tmp_path / "parts")
    archive.extract_archive(parts, tmp_path / "out")  # a path in two parts would be refused as a duplicate
    assert _listing(tmp_path / "out") == _listing(root)


def test_a_distribution_whose_name_cannot_name_a_file_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "v"
    _write(root, f"{SITE}/-odd-1.0.dist-info/RECORD", b"")
    with pytest.raises(BundleError, match="cannot name a bundle file"):
        venv.part_owner(root)


@pytest.mark.parametrize(("paths", "want"), [
    (["wheels/a.whl", "venv-parts/b.tar.zst", "venv-parts/_base.tar.zst"],
     ["venv-parts/_base.tar.zst", "venv-parts/b.tar.zst"]),
    (["wheels/a.whl", "venv.tar.zst"], ["venv.tar.zst"]),
])
def test_install_unpacks_the_parts_or_the_legacy_archive(paths: list[str], want: list[str]) -> None:
    assert venv.venv_archives(paths) == want


@pytest.mark.parametrize("paths", [["wheels/a.whl"], ["venv.tar.zst", "venv-parts/_base.tar.zst"]])
def test_a_bundle_with_no_venv_or_two_is_refused(paths: list[str]) -> None:
    with pytest.raises(BundleError, match="venv"):
        venv.venv_archives(paths)
