"""deploytool installed the normal way (its wheel into a venv of its own, as `pipx install` does; no checkout
anywhere) runs the packaging machine's commands, `lock` and `pack` included: its own wheel for the bundle is
remade from the installed distribution (deploy_tool.builder.pack.installed_wheel), file for file what the
wheel held, and a file changed after the install is refused rather than packed.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _run(argv: list[str], cwd: Path, **kw) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=900, **kw)
    assert r.returncode == 0, (argv, r.stdout[-2000:], r.stderr[-3000:])
    return r


def _rows(whl: Path) -> dict[str, str]:
    with zipfile.ZipFile(whl) as z:
        record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        rows = [ln.split(",") for ln in z.read(record).decode().splitlines() if ln]
    return {r[0]: r[1] for r in rows if r[1] and not r[0].endswith(".dist-info/RECORD")}


@pytest.fixture(scope="module")
def pipx_like(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the venv deploytool's wheel was installed into, that wheel)."""
    d = tmp_path_factory.mktemp("pipx")
    from deploy_tool.builder.pack import _wheel_sources

    src = _wheel_sources(REPO, d / "src")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(d / "dist"), str(src)], d)
    whl = next((d / "dist").glob("deploytool-*.whl"))
    _run([sys.executable, "-m", "venv", str(d / "venv")], d)
    _run([str(d / "venv/bin/python"), "-m", "pip", "install", "-q", str(whl)], d)
    return d / "venv", whl


def test_the_remade_wheel_holds_exactly_the_installed_wheels_files(pipx_like: tuple[Path, Path],
                                                                   tmp_path: Path) -> None:
    venv, whl = pipx_like
    out = _run([str(venv / "bin/python"), "-c", "import sys; from pathlib import Path; from deploy_tool.builder.pack "
                "import installed_wheel; print(installed_wheel(Path(sys.argv[1])))", str(tmp_path)], tmp_path)
    remade = Path(out.stdout.strip())
    assert remade.name == whl.name
    assert _rows(remade) == _rows(whl)  # every file, by path and SHA-256
    again = _run([str(venv / "bin/python"), "-c", "import sys; from pathlib import Path; from deploy_tool.builder."
                  "pack import installed_wheel; print(installed_wheel(Path(sys.argv[1])))", str(tmp_path / "b")],
                 tmp_path)
    assert Path(again.stdout.strip()).read_bytes() == remade.read_bytes()  # reproducible


def test_lock_and_pack_run_from_the_installed_deploytool(pipx_like: tuple[Path, Path], tmp_path: Path) -> None:
    venv, whl = pipx_like
    dt = str(venv / "bin/deploytool")
    box = tmp_path / "box"
    box.mkdir()
    _run([dt, "init", "--example", "cpu-demo", "--out", str(box / "deploytool.yaml")], box)
    (box / "requirements.in").write_text("packaging==24.2\n")  # one small wheel stands in for the backends'
    data = yaml.safe_load((box / "deploytool.yaml").read_text())
    data["bundle"]["lock_mode"] = "exact"
    (box / "deploytool.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    _run([dt, "keygen", "--out", "keys"], box)
    _run([dt, "lock"], box)
    tool = sorted(p.name for p in (box / "tool-wheels").glob("*.whl"))
    assert whl.name in tool and any(n.startswith("click-") for n in tool)
    assert _rows(box / "tool-wheels" / whl.name) == _rows(whl)
    _run([dt, "pack", "--key", "keys/deploytool.key"], box)
    assert list((box / "artifacts").glob("cpu-demo-*.tar.zst"))


def test_a_changed_installed_file_is_refused(pipx_like: tuple[Path, Path], tmp_path: Path) -> None:
    venv, _ = pipx_like
    target = next(venv.glob("lib/python3*/site-packages/deploy_tool/textsafe.py"))
    kept = target.read_bytes()
    target.write_bytes(kept + b"\n# changed\n")
    try:
        r = subprocess.run([str(venv / "bin/python"), "-c", "import sys; from pathlib import Path; from deploy_tool."
                            "builder.pack import installed_wheel; installed_wheel(Path(sys.argv[1]))", str(tmp_path)],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert r.returncode != 0 and "textsafe.py differs from what its install recorded" in r.stderr
    finally:
        target.write_bytes(kept)
