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


def make_venv(root: Path, dists: dict[str, list[str]], loose: list[str], salt: dict[str, bytes],
              versions: dict[str, str] | None = None) -> dict[str, str]:
    """A venv-shaped tree: each distribution `Name` (as a wheel spells it) with its modules, a .pyc of each, a
    console script in bin/ and a dist-info whose RECORD lists them; `loose` files no RECORD names. Returns
    {path: the part it must go to}."""
    versions = versions or {}
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
        info = f"{name.replace('-', '_')}-{versions.get(name, '1.0')}.dist-info"
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
       changed=st.integers(min_value=0, max_value=3), how=st.sampled_from(["rebuilt", "version", "new module"]))
def test_parts_unpack_to_the_venv_and_a_changed_distribution_changes_its_part_alone(raw, loose, changed,
                                                                                      how) -> None:
    """For any venv of these shapes: every file goes to the part of the distribution whose RECORD names it (a .pyc
    with its source, the rest to _base); the parts unpack to the very tree; two venvs that differ in one
    distribution (a file rebuilt, a new version: another dist-info directory, a new module in a new package
    directory) give parts that differ in that distribution's archive and nowhere else."""
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
        if how == "rebuilt":
            make_venv(t / "b", dists, loose, {victim: b" changed"})
        elif how == "version":
            make_venv(t / "b", dists, loose, {}, {victim: "2.0"})
        else:
            mine = f"new_{venv.canonical_name(victim).replace('-', '_')}/mod"  # a package no other one has
            make_venv(t / "b", dict(dists, **{victim: [*dists[victim], mine]}), loose, {})
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


def test_a_path_two_records_name_goes_to_base_and_is_archived_once(tmp_path: Path) -> None:
    """A namespace package's __init__.py that two wheels both install: in neither's part, so adding or removing
    one of them leaves the other's part as it was."""
    root = tmp_path / "v"
    make_venv(root, {"alpha": ["shared"], "beta": ["own"]}, [], {})
    with open(root / SITE / "beta-1.0.dist-info" / "RECORD", "a") as f:
        f.write("shared.py,sha256=x,1\n")
    assert venv.part_owner(root)(f"{SITE}/shared.py") == venv.BASE_PART
    parts = archive_venv_parts(root, tmp_path / "parts")
    archive.extract_archive(parts, tmp_path / "out")  # a path in two parts would be refused as a duplicate
    assert _listing(tmp_path / "out") == _listing(root)


@pytest.mark.parametrize("infos", [["-odd-1.0.dist-info"], ["Foo_Bar-1.0.dist-info", "foo.bar-2.0.dist-info"]])
def test_a_distribution_whose_name_cannot_name_a_file_of_its_own_is_refused(tmp_path: Path, infos) -> None:
    root = tmp_path / "v"
    for info in infos:
        _write(root, f"{SITE}/{info}/RECORD", b"")
    with pytest.raises(BundleError, match="cannot name a bundle file"):
        venv.part_owner(root)


def test_a_dist_info_without_a_version_is_named_by_its_name(tmp_path: Path) -> None:
    root = tmp_path / "v"
    _write(root, f"{SITE}/Foo.dist-info/RECORD", b"foo.py,,\n")
    assert venv.part_owner(root)(f"{SITE}/foo.py") == "foo"


@pytest.mark.parametrize(("paths", "want"), [
    (["wheels/a.whl", "venv-parts/b.tar.zst", "venv-parts/_base.tar.zst"],
     ["venv-parts/_base.tar.zst", "venv-parts/b.tar.zst"]),
    (["wheels/a.whl", "venv.tar.zst"], ["venv.tar.zst"]),
])
def test_install_unpacks_the_parts_or_the_legacy_archive(paths: list[str], want: list[str]) -> None:
    assert venv.venv_archives(paths) == want


@pytest.mark.parametrize("paths", [["wheels/a.whl"], ["venv.tar.zst", "venv-parts/_base.tar.zst"],
                                   ["venv-parts/_base.tar.zst", "venv-parts/x.tar"],
                                   ["venv-parts/_base.tar.zst", "venv-parts/sub/x.tar.zst"]])
def test_a_bundle_with_no_venv_or_two_is_refused(paths: list[str]) -> None:
    with pytest.raises(BundleError, match="venv"):
        venv.venv_archives(paths)


def test_directories_travel_with_the_one_part_that_fills_them(tmp_path: Path) -> None:
    placed = [("lib/sp/a/x.py", "a"), ("lib/sp/a/sub/y.py", "a"), ("lib/sp/b/z.py", "b"), ("bin/a-run", "a"),
              ("bin/activate", venv.BASE_PART)]
    got = venv.part_of_dirs(["lib", "lib/sp", "lib/sp/a", "lib/sp/a/sub", "lib/sp/b", "bin", "empty"], placed)
    assert got == {"lib": "_base", "lib/sp": "_base", "lib/sp/a": "a", "lib/sp/a/sub": "a", "lib/sp/b": "b",
                   "bin": "_base", "empty": "_base"}


@pytest.mark.parametrize(("pyc", "source"), [("mod.cpython-311.pyc", "mod.py"), ("mod.cpython-311.opt-2.pyc", "mod.py"),
                                             ("odd.name.cpython-311.pyc", "odd.name.py")])
def test_a_pyc_goes_with_its_source(tmp_path: Path, pyc: str, source: str) -> None:
    root = tmp_path / "v"
    _write(root, f"{SITE}/pkg/{source}", b"x")
    _write(root, f"{SITE}/p-1.0.dist-info/RECORD", f"pkg/{source},sha256=x,1\n".encode())
    assert venv.part_owner(root)(f"{SITE}/pkg/__pycache__/{pyc}") == "p"


def _tool_wheel(path: Path, manifest_py: bytes | None) -> Path:
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        z.writestr("deploy_tool/__init__.py", b"")
        if manifest_py is not None:
            z.writestr("deploy_tool/manifest.py", manifest_py)
    return path


@pytest.mark.parametrize(("source", "ok"), [
    (b"FORMAT_VERSION = 2\nSUPPORTED_FORMAT_VERSIONS = frozenset({1, 2})\n", True),
    (b"FORMAT_VERSION = 1\nSUPPORTED_FORMAT_VERSIONS = frozenset({1})\n", False),  # a `lock` of deploytool 0.1.0
    (b"nothing of the kind\n", False),
    (None, False),
])
def test_pack_refuses_a_deploytool_wheel_that_does_not_read_the_bundles_format(tmp_path: Path, source, ok) -> None:
    """The deploytool a bundle carries is what a box bootstraps with and then runs: one that refuses the bundle's
    own MANIFEST would leave the box unable to install it (or, installed, unable to install the next)."""
    from deploy_tool.builder.pack import check_tool_reads_format

    w = _tool_wheel(tmp_path / "deploytool-0.2.0-py3-none-any.whl", source)
    if ok:
        check_tool_reads_format(w)
    else:
        with pytest.raises(BundleError) as ei:
            check_tool_reads_format(w)
        assert w.name in ei.value.message and "deploytool lock" in (ei.value.hint or "")


def test_the_deploytool_wheel_of_this_checkout_reads_what_it_packs(tmp_path: Path) -> None:
    """This checkout's own deploy_tool/manifest.py, as `lock` puts it in deploytool's wheel, passes the check."""
    from deploy_tool import manifest
    from deploy_tool.builder.pack import check_tool_reads_format

    check_tool_reads_format(_tool_wheel(tmp_path / "deploytool-x.whl", Path(manifest.__file__).read_bytes()))
