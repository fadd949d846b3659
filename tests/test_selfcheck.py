"""deploytool's own installation is fingerprinted (tool.* and its venv's tree entries) and the bootstrap's write
check, on a real tool venv.

The tool venv is a real `python -m venv --without-pip` filled by the bootstrap's stdlib wheel installer from two
small wheels built here (a `deploytool` distribution with a console script, and a dependency), laid out as
install lays it: releases/r1/tool/venv, releases/r1/tool/bin/deploytool -> ../venv/bin/deploytool, current -> r1.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from deploy_tool.box import bootstrap, fingerprint, selfcheck
from deploy_tool.errors import ExitCode, OSFailure
from tests.support.configs import load_example


def _wheel(path: Path, dist: str, files: dict[str, bytes], entry_points: str = "") -> Path:
    """A valid wheel: the files, METADATA, WHEEL, optional entry_points.txt and a RECORD with their hashes."""
    di = f"{dist}-1.0.dist-info"
    files = {**files, f"{di}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n".encode(),
             f"{di}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    if entry_points:
        files[f"{di}/entry_points.txt"] = entry_points.encode()
    rows = [f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b'=').decode()},{len(b)}"
            for n, b in files.items()]
    files[f"{di}/RECORD"] = ("\n".join(rows + [f"{di}/RECORD,,"]) + "\n").encode()
    out = path / f"{dist}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(out, "w") as z:
        for n, b in files.items():
            z.writestr(n, b)
    return out


@pytest.fixture
def box(tmp_path: Path):
    cfg = load_example(tmp_path / "cfg", "cpu-demo", **{"paths.root": str(tmp_path / "opt"),
                                                        "paths.state_dir": str(tmp_path / "state"),
                                                        "paths.env_dir": str(tmp_path / "env"),
                                                        "paths.unit_dir": str(tmp_path / "units"),
                                                        "systemd.sandbox": None})
    rel = tmp_path / "opt" / "releases" / "r1"
    venv = rel / "tool" / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    wd = tmp_path / "wheels"
    wd.mkdir()
    whls = [_wheel(wd, "deploytool", {"dtfake/__init__.py": b"def main():\n    print('fake deploytool')\n"},
                   "[console_scripts]\ndeploytool = dtfake:main\n"),
            _wheel(wd, "dep", {"dep.py": b"X = 1\n"})]
    bootstrap.install_wheels([str(w) for w in whls], str(venv))
    (rel / "tool" / "bin").mkdir()
    os.symlink("../venv/bin/deploytool", rel / "tool" / "bin" / "deploytool")
    os.symlink("releases/r1", tmp_path / "opt" / "current")
    sp = next((venv / "lib").glob("python3*/site-packages"))
    return cfg, venv, sp


def tool_items(cfg) -> list[fingerprint.Item]:
    """The tool.* items and the tool venv's entries of the release tree (release/tool/...)."""
    items = fingerprint.collect(cfg, "llamacpp-tensor", use_cache=False, cache_file=False)
    return [i for i in items if i.id.startswith(("tool.", "tool/", "release/tool/"))]


def drift(before, cfg) -> dict[str, str]:
    return {d.item.id: d.actual for d in fingerprint.diff(before, tool_items(cfg))}


def fval(p: Path) -> str:
    return f"file {p.stat().st_mode & 0o7777:04o} {hashlib.sha256(p.read_bytes()).hexdigest()}"


def rid(cfg, p: Path) -> str:
    return "release/" + p.relative_to(Path(cfg.paths.root) / "releases" / "r1").as_posix()


def test_installed_tool_venv_runs_and_all_items_are_collected(box) -> None:
    """The stdlib installer's console script runs; the tool venv is pinned entry by entry as part of the release
    (the same code path as the backend's venv): every file by mode and SHA-256, every symlink by its target."""
    cfg, venv, sp = box
    out = subprocess.run([str(Path(cfg.paths.current) / "tool" / "bin" / "deploytool")], capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin"})
    assert out.stdout == "fake deploytool\n"
    items = {i.id: i.value for i in tool_items(cfg)}
    assert items["tool.path"] == str(venv / "bin" / "deploytool")
    assert items["tool.python"] == os.path.realpath(venv / "bin" / "python")
    n = 0
    for d, dirs, files in os.walk(venv):
        for name in dirs + files:
            p = Path(d, name)
            v = items.pop(rid(cfg, p))
            n += 1
            if p.is_symlink():
                assert v == f"link -> {os.readlink(p)}"
            elif p.is_dir():
                assert v == f"dir {p.stat().st_mode & 0o7777:04o}"
            else:
                assert v == fval(p)
    assert n > 10 and rid(cfg, sp / "dtfake" / "__init__.py") not in items
    assert not any(i.startswith("tool/") for i in items)  # inside the release: no second tree
    assert drift(tool_items(cfg), cfg) == {}


def test_modified_module_is_named(box) -> None:
    """An edited module of deploytool's package is named with its new hash."""
    cfg, venv, sp = box
    before = tool_items(cfg)
    mod = sp / "dtfake" / "__init__.py"
    mod.write_bytes(b"def main():\n    print('patched')\n")
    assert drift(before, cfg) == {rid(cfg, mod): fval(mod)}


def test_file_changed_together_with_its_record_line_is_caught(box) -> None:
    """A dependency file changed and its RECORD line rewritten to match: both are named."""
    cfg, venv, sp = box
    before = tool_items(cfg)
    new = b"X = 2\n"
    (sp / "dep.py").write_bytes(new)
    rec = sp / "dep-1.0.dist-info" / "RECORD"
    b64 = base64.urlsafe_b64encode(hashlib.sha256(new).digest()).rstrip(b"=").decode()
    rec.write_text("\n".join(f"dep.py,sha256={b64},{len(new)}" if ln.startswith("dep.py,") else ln
                             for ln in rec.read_text().splitlines()) + "\n")
    assert set(drift(before, cfg)) == {rid(cfg, sp / "dep.py"), rid(cfg, rec)}


def test_added_pth_file_and_edited_script_are_named(box) -> None:
    """A .pth file in site-packages shows up by name (not pinned before); an edited console script is named."""
    cfg, venv, sp = box
    before = tool_items(cfg)
    (sp / "evil.pth").write_text("import os\n")
    script = venv / "bin" / "deploytool"
    script.write_text(script.read_text() + "# edited\n")
    d = drift(before, cfg)
    assert d == {rid(cfg, sp / "evil.pth"): fval(sp / "evil.pth"), rid(cfg, script): fval(script)}


def test_missing_tool_is_a_value(box) -> None:
    """No deploytool at paths.deploytool: tool.path is 'missing' (pinned like that, or drift if it was there)."""
    cfg, venv, sp = box
    before = tool_items(cfg)
    os.unlink(Path(cfg.paths.current))
    d = drift(before, cfg)
    assert d["tool.path"] == "missing"


def test_tool_venv_outside_the_release_is_pinned_by_the_same_tree_code(box, tmp_path: Path) -> None:
    """paths.deploytool in a venv outside the release: that venv is its own tree (tool/PATH), and a .pth or a
    mode change there is named like one in the release."""
    import dataclasses
    import shutil

    cfg, venv, sp = box
    other = tmp_path / "elsewhere" / "venv"
    shutil.copytree(venv, other, symlinks=True)
    cfg = dataclasses.replace(cfg, paths=dataclasses.replace(cfg.paths, deploytool=str(other / "bin" / "deploytool")))
    before = tool_items(cfg)
    ids = {i.id for i in before}
    osp = other / sp.relative_to(venv)
    assert "tool/." in ids and f"tool/{(osp / 'dtfake' / '__init__.py').relative_to(other)}" in ids
    (osp / "sitecustomize.py").write_text("import os\n")
    os.chmod(other / "bin" / "deploytool", 0o775)
    d = drift(before, cfg)
    assert set(d) == {f"tool/{(osp / 'sitecustomize.py').relative_to(other)}", "tool/bin/deploytool"}
    assert d["tool/bin/deploytool"].startswith("file 0775 ")


def test_preflight_names_every_unwritable_target(box, tmp_path: Path) -> None:
    """The bootstrap's write check: writable targets pass; targets under a regular file are named (exit 17)."""
    cfg, venv, sp = box
    assert selfcheck.preflight(cfg)
    import dataclasses

    (tmp_path / "blocker").write_text("not a directory")
    bad = dataclasses.replace(cfg, paths=dataclasses.replace(cfg.paths, state_dir=str(tmp_path / "blocker" / "s"),
                                                             env_dir=str(tmp_path / "blocker" / "e")))
    with pytest.raises(OSFailure) as ei:
        selfcheck.preflight(bad)
    assert ei.value.exit_code == ExitCode.OS
    assert str(tmp_path / "blocker" / "s") in ei.value.message and str(tmp_path / "blocker" / "e") in ei.value.message
    assert "is not a directory" in ei.value.message


def test_preflight_refuses_a_missing_bundle_python(box) -> None:
    """bundle.python absent on the box: exit 16 naming it, before any target is looked at."""
    import dataclasses

    from deploy_tool.errors import MissingTool

    cfg, venv, sp = box
    bad = dataclasses.replace(cfg, bundle=dataclasses.replace(cfg.bundle, python="/usr/bin/python3.99"))
    with pytest.raises(MissingTool) as ei:
        selfcheck.preflight(bad)
    assert ei.value.exit_code == ExitCode.MISSING_TOOL and "/usr/bin/python3.99" in ei.value.message


def test_modules_are_checked_hash_pycs_and_a_swapped_pyc_is_named(box) -> None:
    """Installed modules carry checked-hash .pyc files; a replaced .pyc is drift, named, and so is a planted one."""
    cfg, venv, sp = box
    pyc = next((sp / "dtfake" / "__pycache__").glob("__init__.cpython-*.pyc"))
    flags = int.from_bytes(pyc.read_bytes()[4:8], "little")
    assert flags == 0b11  # hash-based and checked: Python compares it with the source's hash at import
    before = tool_items(cfg)
    data = bytearray(pyc.read_bytes())
    data[-1] ^= 1
    pyc.write_bytes(bytes(data))
    planted = sp / "__pycache__" / pyc.name.replace("__init__", "evil")
    new_dir = not planted.parent.exists()
    planted.parent.mkdir(exist_ok=True)
    planted.write_bytes(bytes(data))
    d = drift(before, cfg)
    assert set(d) == {rid(cfg, pyc), rid(cfg, planted)} | ({rid(cfg, planted.parent)} if new_dir else set())
    assert d[rid(cfg, planted)] == fval(planted)
