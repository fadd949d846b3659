"""The API key never stands on a command line or in an environment (issue 16, item 6).

Fast: the units as rendered (LoadCredential=, llama-server's --api-key-file, ftllm through the release's launcher),
the launcher itself run by a real Python on a stand-in console script, the root-only key file.

Live (real sandboxed systemd, both real CPU backends, a cpu-demo box of this module's own with
serve.api_key_file set): each server refuses a request without the key and serves one with it, and the key
stands in no /proc/PID/cmdline and no /proc/PID/environ of any process of this machine (read as root from the
host side, where the units' ProtectProc= does not apply), nor in the unit's journal, unit or env files.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from deploy_tool import procfs, render
from deploy_tool.errors import ConfigError
from tests.support.configs import load_example

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "deploy_tool" / "box" / "ftllm_launch.py"
F, L = "ftllm-dflash", "llamacpp-tensor"


# ------------------------------------------------------------------------------------------------ rendered units


def _unit(cfg, name: str) -> str:
    return next(f.content for f in render.render_all(cfg) if f.name == f"{name}.service")


@pytest.mark.parametrize("example", ["cpu-demo", "two-2080ti"])
def test_units_hand_the_key_over_as_a_credential(example: str, tmp_path: Path) -> None:
    """With serve.api_key_file: LoadCredential= from the root-only copy, llama-server reads `%d/api-key`, ftllm
    starts through the launcher with the venv's Python; no EnvironmentFile= or argument carries the key."""
    cfg = load_example(tmp_path, example, **{"serve.api_key_file": "/etc/deploytool/api.key"})
    for name in (F, L):
        text = _unit(cfg, name)
        assert f"LoadCredential=api-key:{cfg.paths.env_dir}/api-key" in text.splitlines()
        # the env file goes to the server's launcher as a credential too, never as an EnvironmentFile=
        assert [ln for ln in text.splitlines() if ln.startswith(("EnvironmentFile=", "Environment="))] == []
        assert f"LoadCredential=environment:{cfg.paths.env_dir}/{name}.env" in text.splitlines()
        assert "API_KEY" not in text and "secrets.env" not in text
    ll = next(ln for ln in _unit(cfg, L).splitlines() if ln.startswith("ExecStart="))
    assert " --api-key-file %d/api-key" in ll and "--api-key " not in ll
    ft = next(ln for ln in _unit(cfg, F).splitlines() if ln.startswith("ExecStart="))
    cur = cfg.paths.current
    assert ft.startswith(f"ExecStart={cur}/launch/bin/ftllm %d/environment {cur}/venv/bin/python "
                         f"{cur}/launch/ftllm_launch.py %d/api-key {cur}/venv/bin/ftllm server -p ")
    assert "--api_key" not in ft


def test_without_a_key_the_units_are_as_before(tmp_path: Path) -> None:
    """No serve.api_key_file: no key credential, ftllm's env launcher runs its console script directly."""
    cfg = load_example(tmp_path, "cpu-demo")
    for name in (F, L):
        text = _unit(cfg, name)
        assert "api-key" not in text and "ftllm_launch" not in text
        assert [ln for ln in text.splitlines() if ln.startswith("LoadCredential=")] == [
            f"LoadCredential=environment:{cfg.paths.env_dir}/{name}.env"]
    cur = cfg.paths.current
    assert f"ExecStart={cur}/launch/bin/ftllm %d/environment {cur}/venv/bin/ftllm server" in _unit(cfg, F)


@pytest.mark.parametrize("bad", ["two\nlines", " padded", "tab\tinside", "", "bell\x07"])
def test_an_unusable_key_is_refused_naming_the_file(bad: str, tmp_path: Path) -> None:
    """A key the servers would read differently from the clients (several lines, white space around it, a
    control character) or none at all: one ConfigError naming serve.api_key_file, no key in the message."""
    cfg = load_example(tmp_path, "cpu-demo", **{"serve.api_key_file": "/etc/deploytool/api.key"})
    with pytest.raises(ConfigError) as ei:
        render.render_api_key(cfg, bad)
    assert "serve.api_key_file" in ei.value.message and ei.value.exit_code == 3
    assert not bad.strip() or bad.strip() not in ei.value.message


def test_the_key_file_is_root_only_and_one_line(tmp_path: Path) -> None:
    cfg = load_example(tmp_path, "cpu-demo", **{"serve.api_key_file": "/etc/deploytool/api.key"})
    f = render.render_api_key(cfg, "k3y-with.signs_+/=")
    assert (f.name, f.content, f.mode) == ("api-key", "k3y-with.signs_+/=\n", 0o600)


# ------------------------------------------------------------------------------------------------ the launcher

STAND_IN = """#!/usr/bin/python3
import json, logging, sys
from argparse import Namespace
logging.basicConfig(level=logging.INFO, format="LOG %(message)s")
key = sys.argv[sys.argv.index("--api_key") + 1]
logging.info(Namespace(api_key=key, port=8082))
logging.info("plain %s", key)
print("OUT=" + json.dumps({"argv": sys.argv, "cmdline": open("/proc/self/cmdline", "rb").read().decode(),
      "environ": open("/proc/self/environ", "rb").read().decode(errors="replace"), "name": __name__}), flush=True)
sys.exit(7)
"""


def _launch(tmp_path: Path, key: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "ftllm"
    script.write_text(STAND_IN)
    keyf = tmp_path / "api-key"
    if key is not None:
        keyf.write_text(key + "\n")
    return subprocess.run([sys.executable, str(LAUNCHER), str(keyf), str(script), *args], capture_output=True,
                          text=True, timeout=60, env={"PATH": os.environ.get("PATH", "/usr/bin")})


def test_launcher_hands_the_key_to_the_console_script_in_memory_only(tmp_path: Path) -> None:
    """The console script runs in the launcher's process as __main__ with `--api_key KEY` appended to its argv;
    the process's /proc/self/cmdline and environ hold no key; log messages show it masked; its exit code is
    the script's."""
    key = "Zq9-" + secrets.token_urlsafe(16)
    r = _launch(tmp_path, key, "server", "--port", "8082")
    assert r.returncode == 7, r.stderr
    out = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("OUT="))[4:])
    assert out["argv"] == [str(tmp_path / "ftllm"), "server", "--port", "8082", "--api_key", key]
    assert out["name"] == "__main__"
    assert key not in out["cmdline"] and key not in out["environ"]
    assert out["cmdline"].split("\0")[1:5] == [str(LAUNCHER), str(tmp_path / "api-key"), str(tmp_path / "ftllm"),
                                                "server"]
    logs = [ln for ln in r.stderr.splitlines() if ln.startswith("LOG ")]
    assert len(logs) == 2 and all("<api key>" in ln for ln in logs) and key not in r.stderr


@pytest.mark.parametrize("key", [None, ""], ids=["missing", "empty"])
def test_launcher_without_a_key_exits_2_naming_the_file(key: str | None, tmp_path: Path) -> None:
    r = _launch(tmp_path, key, "server")
    assert r.returncode == 2 and "OUT=" not in r.stdout
    assert str(tmp_path / "api-key") in r.stderr and len(r.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------------ live

@pytest.fixture(scope="module")
def keyed(own_sandbox):
    """A cpu-demo box with serve.api_key_file, installed under this module's own sandboxed systemd, ftllm-dflash
    serving; the key is random, written root-only."""
    from tests.support.demo_box import Box, dt, make_demo
    from tests.support.sandbox import free_port, new_run_dir

    root = new_run_dir("secrets")
    d = root / "box"
    d.mkdir(parents=True)
    key = "k-" + secrets.token_urlsafe(24)
    keyf = root / "api.key"
    keyf.write_text(key + "\n")
    os.chmod(keyf, 0o600)
    cfg = make_demo(d, sandbox_dir=own_sandbox.sandbox.dir, unit_dir=own_sandbox.unit_dir, port=free_port(),
                    serve={"api_key_file": str(keyf)})
    box = Box(cfg)
    box.env_dir.mkdir(parents=True, exist_ok=True)
    (box.env_dir / "secrets.env").write_text(f'DEPLOYTOOL_API_KEY="{key}"\n')  # as older deploytools left it
    os.chmod(box.env_dir / "secrets.env", 0o600)
    r = dt(cfg, "install")
    assert r.returncode == 0, r.stdout + r.stderr
    yield {"cfg": cfg, "key": key, "box": box, "sbx": own_sandbox}
    box.reset(own_sandbox.systemd)
    if not os.environ.get("DEPLOYTOOL_E2E_KEEP"):
        shutil.rmtree(root, ignore_errors=True)


def _request(port: int, key: str | None) -> int:
    body = json.dumps({"model": "qwen38-27b-ud", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 4, "temperature": 0}).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert json.loads(resp.read())["choices"][0]["message"]["content"]
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _unit_processes(sandbox, unit: str) -> list[int]:
    """Host PIDs of every process of `unit` in the sandbox (found by its cgroups, read from the host side)."""
    out = []
    for e in os.scandir("/proc"):
        if e.name.isdigit() and procfs.in_cgroup(int(e.name), sandbox.cgroup_name):
            text = procfs.read(f"/proc/{e.name}/cgroup") or ""
            if any(ln.endswith(f"/system.slice/{unit}") for ln in text.splitlines()):
                out.append(int(e.name))
    return out


def _processes_holding(needle: bytes) -> tuple[list[str], int, list[int]]:
    """Every (PID, file) among /proc/*/cmdline and /proc/*/environ of this machine that holds `needle`, how many
    processes were read, and the PIDs root may not read (this machine's own PID 1 when it runs in a container).
    Read as root from the host's PID namespace: every process, whoever runs it."""
    found, read, closed = [], 0, []
    for e in os.scandir("/proc"):
        if not e.name.isdigit():
            continue
        try:
            for what in ("cmdline", "environ"):
                data = Path(f"/proc/{e.name}/{what}").read_bytes()
                if needle in data:
                    found.append(f"{e.name}/{what}")
            read += 1
        except (FileNotFoundError, ProcessLookupError):
            continue  # it exited meanwhile
        except PermissionError:
            closed.append(int(e.name))
    return found, read, closed


def _check_no_key_anywhere(keyed, unit: str, argv_has: str) -> None:
    sbx, key = keyed["sbx"], keyed["key"]
    pids = _unit_processes(sbx.sandbox, unit)
    assert pids, f"no process of {unit} found"
    main = sbx.sandbox.host_pid(sbx.systemd.show(unit).main_pid)
    assert main in pids
    for pid in pids:  # the servers themselves: read, and what they hold is what the unit says
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert environ and key.encode() not in cmdline + environ
    assert argv_has in Path(f"/proc/{main}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    found, read, closed = _processes_holding(key.encode())
    assert found == [] and read > len(pids), found
    assert not [p for p in closed if procfs.in_cgroup(p, sbx.sandbox.cgroup_name)], closed  # all of the box read
    log = sbx.systemd.journal(unit, lines=100000)
    assert log and key not in log, "the key reached the journal"


@pytest.mark.sandbox
@pytest.mark.backends
@pytest.mark.slow
def test_ftllm_serves_with_the_key_that_stands_nowhere(keyed) -> None:
    """ftllm-dflash (through the launcher): 401 without the key, 200 with it; the key in no cmdline, environ or
    journal line; the root-only copy is the only file on the box holding it, and the old secrets.env is gone."""
    cfg, key, box = keyed["cfg"], keyed["key"], keyed["box"]
    port = yaml.safe_load(cfg.read_text())["serve"]["port"]
    assert _request(port, None) == 401
    assert _request(port, "wrong-" + key) == 401
    assert _request(port, key) == 200
    _check_no_key_anywhere(keyed, f"{F}.service", "/launch/ftllm_launch.py")
    cred = box.env_dir / "api-key"
    st = cred.stat()
    assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o600, 0) and cred.read_text() == key + "\n"
    assert not (box.env_dir / "secrets.env").exists()
    holders = [p for d in (box.env_dir, box.unit_dir) for p in d.iterdir() if p.is_file()
               and key.encode() in p.read_bytes()]
    assert holders == [cred]


@pytest.mark.sandbox
@pytest.mark.backends
@pytest.mark.slow
def test_llama_server_serves_with_the_key_that_stands_nowhere(keyed) -> None:
    """After a switch, llama-server (--api-key-file %d/api-key): 401 without the key, 200 with it; the key in no
    cmdline, environ or journal line."""
    from tests.support.demo_box import dt

    cfg, key = keyed["cfg"], keyed["key"]
    r = dt(cfg, "switch", "llamacpp")
    assert r.returncode == 0, r.stdout + r.stderr
    port = yaml.safe_load(cfg.read_text())["serve"]["port"]
    assert _request(port, None) == 401
    assert _request(port, key) == 200
    _check_no_key_anywhere(keyed, f"{L}.service", "--api-key-file /run/credentials/")
