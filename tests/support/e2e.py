"""The packed cpu-demo bundle and its real install under the session's sandboxed systemd, shared by every test
module of a run (tests/conftest.py loads these fixtures, so the bundle is packed once per session)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DT = [sys.executable, "-m", "deploy_tool"]


def dt(cfg: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 600,
       wrap: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    e = dict(os.environ)
    e.update(env or {})
    e["PYTHONPATH"] = str(REPO)
    return subprocess.run([*(wrap or []), *DT, "--config", str(cfg), *args], capture_output=True, text=True,
                          timeout=timeout, env=e, cwd=cfg.parent)


@pytest.fixture(scope="session")
def demo(systemd_sandbox):
    """A packed cpu-demo bundle and a config pointing at the session's sandboxed systemd.

    It lives under the repo's .cache/, not /tmp: the units run with PrivateTmp=yes and could not see /tmp."""
    d = REPO / ".cache" / f"e2e-{os.getpid()}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    cfg = d / "deploytool.yaml"
    r = subprocess.run([*DT, "init", "--example", "cpu-demo", "--out", str(cfg)], capture_output=True, text=True,
                       cwd=d, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    data = yaml.safe_load(cfg.read_text())
    data["systemd"]["sandbox"] = str(systemd_sandbox.sandbox.dir)
    data["paths"]["unit_dir"] = str(systemd_sandbox.unit_dir)
    from tests.support.sandbox import free_port

    data["serve"]["port"] = free_port()
    cfg.write_text(yaml.safe_dump(data, sort_keys=False))
    cache = REPO / ".cache" / "wheels-demo"
    cache.mkdir(parents=True, exist_ok=True)
    (d / "wheels").symlink_to(cache)
    (d / "models").mkdir()
    from tests.support.tiny_model import write_model

    write_model(d / "models" / "tiny-f16.gguf", size="tiny", f16=True)
    for args in (("keygen", "--out", str(d / "keys")), ("lock",), ("pack",)):
        r = dt(cfg, *args)
        assert r.returncode == 0, f"{args}: {r.stdout}\n{r.stderr}"
    keys = d / "demo-root" / "etc" / "deploytool" / "keys"
    keys.mkdir(parents=True)
    for p in (d / "keys").glob("*.pub"):
        shutil.copy(p, keys / p.name)
    yield cfg
    if not os.environ.get("DEPLOYTOOL_E2E_KEEP"):
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def installed(demo, systemd_sandbox):
    """The demo bundle installed once (offline) with ftllm-dflash serving."""
    r = dt(demo, "install")
    assert r.returncode == 0, r.stdout + r.stderr
    return demo


