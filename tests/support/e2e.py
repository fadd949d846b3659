"""The packed cpu-demo bundle and its real install under the session's sandboxed systemd, shared by every test
module of a run (tests/conftest.py loads these fixtures, so the bundle is packed once per session)."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.support.demo_box import DT, REPO, dt, make_demo  # noqa: F401  (DT, REPO, dt: re-exported)


@pytest.fixture(scope="session")
def demo(systemd_sandbox):
    """A packed cpu-demo bundle and a config pointing at the session's sandboxed systemd.

    It lives in a run directory of its own under tests/support/sandbox.py's RUN_PARENT, wherever the checkout is:
    the units (PrivateTmp=yes, ProtectHome=, DynamicUser=yes) see the box there as they do on a real one."""
    from tests.support.sandbox import free_port, new_run_dir

    root = new_run_dir("e2e")
    cfg = make_demo(root / "box", sandbox_dir=systemd_sandbox.sandbox.dir, unit_dir=systemd_sandbox.unit_dir,
                    port=free_port())
    yield cfg
    if not os.environ.get("DEPLOYTOOL_E2E_KEEP"):
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def installed(demo, systemd_sandbox):
    """The demo bundle installed once (offline) with ftllm-dflash serving."""
    r = dt(demo, "install")
    assert r.returncode == 0, r.stdout + r.stderr
    return demo


