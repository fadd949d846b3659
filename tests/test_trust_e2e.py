"""Trust on the real sandbox, where systemd's own behaviour is the point: a key rotation end to end with the
bundle's bootstrap (the box trusts old and new, a bundle signed by the new key bootstraps and serves, the old key
is revoked and a bundle it signed is refused before anything of it runs), a start refused by the units'
ExecStartPre because a path it reads turned group-writable, and an old bundle refused by install while the
newer release serves on.

Real parts only: a real signed cpu-demo bundle (ftllm 0.1.8.2 and llama-server on a tiny model), the system
python3 running BUNDLE/bootstrap in an empty network namespace, a real systemd 252 of this module's own, the CLI.
The decision logic over its whole input space is the fast suite's (tests/test_strictmodes.py, test_keyring.py,
test_trust.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from deploy_tool import manifest
from tests.support.bundles import rebundle
from tests.support.demo_box import Box, chat, dt, make_demo

pytestmark = [pytest.mark.sandbox, pytest.mark.backends, pytest.mark.slow, pytest.mark.e2e]

FU = "ftllm-dflash.service"
SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.fixture(scope="module")
def trust(own_sandbox):
    """A packed cpu-demo box on this module's sandbox; the old key (the one the demo packs with) and a new key;
    the packed bundle re-signed as: A (sequence 10, new key), A5 (sequence 5, new key), OLD (sequence 20, old
    key): re-signed MANIFESTs of the same files, so three releases without three packs."""
    from tests.support.sandbox import free_port, new_run_dir

    root = new_run_dir("trust")
    d = root / "box"
    try:
        cfg = make_demo(d, sandbox_dir=own_sandbox.sandbox.dir, unit_dir=own_sandbox.unit_dir, port=free_port())
        packed = next(p for p in (d / "artifacts").iterdir() if p.is_dir() and (p / "MANIFEST").is_file())
        old_key, new_key = d / "keys" / "deploytool.key", d / "keys" / "new.key"
        manifest.generate_keypair(new_key, d / "keys" / "new.pub")
        out = d / "bundles"
        out.mkdir()
        bundles = {"a": rebundle(packed, out, new_key, sequence=10), "a5": rebundle(packed, out, new_key, sequence=5),
                   "old": rebundle(packed, out, old_key, sequence=20)}
        for sub in ("home", "tmp"):
            (d / "fresh" / sub).mkdir(parents=True)
        yield {"cfg": cfg, "box": Box(cfg), "dir": d, "sbx": own_sandbox, "old_id": manifest.public_key_id(old_key),
               "new_id": manifest.public_key_id(new_key), "port": yaml.safe_load(cfg.read_text())["serve"]["port"],
               **bundles}
        Box(cfg).reset(own_sandbox.systemd)
    finally:
        if not os.environ.get("DEPLOYTOOL_E2E_KEEP"):
            shutil.rmtree(root, ignore_errors=True)


def bootstrap(t: dict, bundle: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`python3 BUNDLE/bootstrap` as a person runs it on a fresh box: the system python3, env cleared, no network."""
    fresh = t["dir"] / "fresh"
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "HOME": str(fresh / "home"),
           "TMPDIR": str(fresh / "tmp")}
    return subprocess.run(["unshare", "--net", "--", SYSTEM_PYTHON, str(bundle / "bootstrap"), "--config",
                           str(t["cfg"]), *args], capture_output=True, text=True, timeout=900, env=env, cwd=fresh)


def box_files(box: Box) -> dict[str, object]:
    """What an install or bootstrap would change: the box's traces, state and history."""
    return {"traces": box.traces(), "state": box.state(), "history": box.history()}


def exec_main_start(t: dict) -> str:
    """When systemd last exec'd the unit's main process (the server), as it reports it."""
    return subprocess.run(t["sbx"].sandbox.exec_argv("systemctl", "show", "-p", "ExecMainStartTimestampMonotonic",
                                                     FU), capture_output=True, text=True, timeout=60).stdout.strip()


def rid(bundle: Path) -> str:
    return bundle.name.rsplit("-", 1)[1]


def test_rotation_with_the_bootstrap(trust):
    """The box trusts old and new; a bundle signed by the new key bootstraps (then its own deploytool starts it);
    the old key revoked
    (KEYS/revoked), a bundle signed by it, even of a higher sequence, is refused by the bootstrap's stdlib check
    (exit 25, naming the key id, before a venv of the bundle is made) and by the installed deploytool alike, the
    box untouched and serving."""
    t, box, sd = trust, trust["box"], trust["sbx"].systemd
    shutil.copy(t["dir"] / "keys" / "new.pub", box.keys / "new.pub")
    assert sorted(p.name for p in box.keys.iterdir()) == ["deploytool.pub", "new.pub"]
    r = bootstrap(t, t["a"], "--no-start")  # no network in here: the gate's probe could not reach the server
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"signed by trusted key {t['new_id']}" in r.stderr
    assert box.current_release() == rid(t["a"])
    tool = str(box.current / "tool" / "bin" / "deploytool")  # the release's deploytool, from the bootstrap
    r = subprocess.run([tool, "--config", str(t["cfg"]), "install", str(t["a"])], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "was not running and now serves" in r.stdout, r.stdout + r.stderr
    assert sd.show(FU).active_state == "active"
    assert chat(t["port"])["choices"][0]["message"]["content"]
    last = [e for e in box.history() if e["event"] == "install" and e.get("mode")][-1]  # the bootstrap's
    assert last["key_id"] == t["new_id"] and last["sequence"] == 10 and last["bundle_name"] == "cpu-demo"

    (box.keys / "revoked").write_text(f"# rotated: {t['new_id']} signs from now on\n{t['old_id']} retired\n")
    os.chmod(box.keys / "revoked", 0o644)
    pid = sd.show(FU).main_pid
    before = box_files(box)
    r = bootstrap(t, t["old"], "--no-start")
    assert r.returncode == 25, r.stdout + r.stderr
    assert f"key-revoked: the bundle is signed by key {t['old_id']}, which is revoked in {box.keys / 'revoked'} " \
        "line 2 (retired)" in r.stderr
    assert "creating deploytool's venv" not in r.stderr and "Traceback" not in r.stderr
    assert not list((t["dir"] / "fresh" / "tmp").iterdir()), "the bootstrap left a staging dir"
    r = subprocess.run([tool, "--config", str(t["cfg"]), "install", str(t["old"])], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 25 and t["old_id"] in r.stderr and "revoked" in r.stderr, r.stdout + r.stderr
    assert box_files(box) == before and sd.show(FU).main_pid == pid


def test_a_start_is_refused_while_the_env_dir_is_group_writable(trust):
    """The env directory turns g+w while ftllm-dflash serves: status says degraded (exit 20) naming it, check lists
    it (exit 4); a restart is refused by the unit's own ExecStartPre (exit 23 in the journal, naming the path, its
    mode and `chmod go-w`; the server never starts); the fix applied, it starts and serves again."""
    t, box, sd = trust, trust["box"], trust["sbx"].systemd
    assert sd.show(FU).active_state == "active", "the rotation test leaves ftllm-dflash serving"
    env = box.env_dir
    os.chmod(env, 0o775)
    try:
        r = dt(t["cfg"], "status")
        assert r.returncode == 20, r.stdout + r.stderr
        assert f"{env} is not root's alone (writable by group), so no backend may start: chmod go-w {env}" in r.stdout
        r = dt(t["cfg"], "check", "--no-files")
        assert r.returncode == 4 and "path-not-root-only" in r.stdout and f"chmod go-w {env}" in r.stdout, r.stdout
        cursor = sd.journal_cursor()
        started = exec_main_start(t)
        res = subprocess.run(t["sbx"].sandbox.exec_argv("systemctl", "restart", FU), capture_output=True, text=True,
                             timeout=120)
        assert res.returncode != 0
        u = sd.show(FU)
        assert u.active_state in ("failed", "activating", "inactive") and u.main_pid == 0, u
        # systemd forgets the last main process when a new start begins; 0: no server process in this one
        assert started != "ExecMainStartTimestampMonotonic=0" and exec_main_start(t) == "ExecMainStartTimestampMonotonic=0"
        journal = sd.journal(FU, since_cursor=cursor, lines=200)
        assert f"{env} (env dir): owner 0:0, mode 0775, writable by group; fix: chmod go-w {env}" in journal, journal
        assert "status=23" in journal, journal
    finally:
        os.chmod(env, 0o755)
    sd.reset_failed(FU)
    sd.start(FU)
    assert sd.show(FU).active_state == "active"
    assert chat(t["port"])["choices"][0]["message"]["content"]
    assert dt(t["cfg"], "status").returncode == 0


def test_an_old_bundle_is_refused_while_the_newer_release_serves(trust):
    """A (sequence 10) serves; A5 (sequence 5, signed by the trusted new key, never on this box): install exits 24
    naming both, the box's files, state and history as they were, the same server process serving."""
    t, box, sd = trust, trust["box"], trust["sbx"].systemd
    assert box.current_release() == rid(t["a"]) and sd.show(FU).active_state == "active"
    pid = sd.show(FU).main_pid
    before = box_files(box)
    r = dt(t["cfg"], "install", str(t["a5"]))
    assert r.returncode == 24, r.stdout + r.stderr
    assert f"bundle {rid(t['a5'])} (cpu-demo) has sequence 5, lower than sequence 10 of release {rid(t['a'])}" \
        in r.stderr
    assert "--allow-downgrade --reason TEXT" in r.stderr
    assert box_files(box) == before and sd.show(FU).main_pid == pid
    assert chat(t["port"])["choices"][0]["message"]["content"]
