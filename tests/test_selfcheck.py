"""deploytool's own installation is fingerprinted (tool.*) and the bootstrap's write check, on a real tool venv.

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

from deploy_tool import bootstrap, fingerprint, selfcheck
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
    items = fingerprint.collect(cfg, "llamacpp-tensor", use_cache=False, cache_file=False)
    return [i for i in items if i.id.startswith("tool.")]


def drift(before, cfg) -> dict[str, str]:
    return {d.item.id: d.actual for d in fingerprint.diff(before, tool_items(cfg))}


def test_installed_tool_venv_runs_and_all_items_are_collected(box) -> None:
    """The stdlib installer's console script runs; tool.* lists path, script, venv, RECORD checks, entries."""
    cfg, venv, sp = box
    out = subprocess.run([str(Path(cfg.paths.current) / "tool" / "bin" / "deploytool")], capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin"})
    assert out.stdout == "fake deploytool\n"
    items = {i.id: i.value for i in tool_items(cfg)}
    assert items["tool.path"] == str(venv / "bin" / "deploytool")
    # the wheel's 4 files, the generated console script, INSTALLER and the module's .pyc
    assert items["tool.files/deploytool"] == "all 7 files match RECORD"
    assert items["tool.files/dep"] == "all 5 files match RECORD"
    assert {"tool.script", "tool.pyvenv", "tool.python", "tool.record/deploytool", "tool.record/dep",
            "tool.site/dtfake", "tool.site/dep.py", "tool.site/deploytool-1.0.dist-info"} <= set(items)
    assert list(items)[:6] == ["tool.path", "tool.script", "tool.pyvenv", "tool.python", "tool.files/deploytool",
                               "tool.record/deploytool"]  # deploytool's own files come first
    assert drift(tool_items(cfg), cfg) == {}


def test_modified_module_is_named(box) -> None:
    """An edited module of deploytool's package: tool.files/deploytool names the file."""
    cfg, venv, sp = box
    before = tool_items(cfg)
    (sp / "dtfake" / "__init__.py").write_bytes(b"def main():\n    print('patched')\n")
    assert drift(before, cfg) == {"tool.files/deploytool": "1 of 7 files differ from RECORD: dtfake/__init__.py"}


def test_file_changed_together_with_its_record_line_is_caught(box) -> None:
    """A dependency file changed and its RECORD line rewritten to match: the pinned RECORD hash differs."""
    cfg, venv, sp = box
    before = tool_items(cfg)
    new = b"X = 2\n"
    (sp / "dep.py").write_bytes(new)
    rec = sp / "dep-1.0.dist-info" / "RECORD"
    b64 = base64.urlsafe_b64encode(hashlib.sha256(new).digest()).rstrip(b"=").decode()
    rec.write_text("\n".join(f"dep.py,sha256={b64},{len(new)}" if ln.startswith("dep.py,") else ln
                             for ln in rec.read_text().splitlines()) + "\n")
    d = drift(before, cfg)
    assert set(d) == {"tool.record/dep"}


def test_added_pth_file_and_edited_script_are_named(box) -> None:
    """A .pth file in site-packages shows up by name; an edited console script changes tool.script."""
    cfg, venv, sp = box
    before = tool_items(cfg)
    (sp / "evil.pth").write_text("import os\n")
    script = venv / "bin" / "deploytool"
    script.write_text(script.read_text() + "# edited\n")
    d = drift(before, cfg)
    assert d["tool.site/evil.pth"] == "present"
    assert "tool.script" in d and "../../../bin/deploytool" in d["tool.files/deploytool"]


def test_missing_tool_is_a_value(box) -> None:
    """No deploytool at paths.deploytool: tool.path is 'missing' (pinned like that, or drift if it was there)."""
    cfg, venv, sp = box
    before = tool_items(cfg)
    os.unlink(Path(cfg.paths.current))
    d = drift(before, cfg)
    assert d["tool.path"] == "missing"


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
    """Installed modules carry checked-hash .pyc files listed in RECORD; a replaced .pyc is drift, named."""
    cfg, venv, sp = box
    pyc = next((sp / "dtfake" / "__pycache__").glob("__init__.cpython-*.pyc"))
    flags = int.from_bytes(pyc.read_bytes()[4:8], "little")
    assert flags == 0b11  # hash-based and checked: Python compares it with the source's hash at import
    before = tool_items(cfg)
    data = bytearray(pyc.read_bytes())
    data[-1] ^= 1
    pyc.write_bytes(bytes(data))
    d = drift(before, cfg)
    assert set(d) == {"tool.files/deploytool"} and "dtfake/__pycache__/__init__.cpython-" in d["tool.files/deploytool"]
