"""Ready means ready: the units' ExecStartPost (`deploytool await-ready`) ends the start job when the server serves.

Fast part: deploy_tool.box.probe.ready against real HTTP listeners and real child processes. Sandbox part: the installed
cpu-demo box under the real sandboxed systemd: `systemctl start` returns only once the port serves, a unit
ordered After= the backend sees a serving port (and, without the ExecStartPost, does not), TimeoutStartSec=
ends a start that never gets ready, and a server that dies while loading fails its start at once.
"""

from __future__ import annotations

import http.server
import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy_tool import config, procfs
from deploy_tool.box.probe import ready
from deploy_tool.errors import HealthError, SystemdError
from tests.support.configs import example_dict, load_dict, set_key
from tests.support.demo_box import dt
from tests.support.sandbox import free_port

LU = "llamacpp-tensor.service"
FU = "ftllm-dflash.service"
MODEL = "qwen38-27b-ud"


# ------------------------------------------------------------------------------------------------ fast part

def _cfg(tmp: Path, port: int, *, key_file: Path | None = None):
    data = example_dict("cpu-demo")
    set_key(data, "serve.internal_port", port)
    set_key(data, "health.interval_s", 0.05)
    if key_file is not None:
        set_key(data, "serve.api_key_file", str(key_file))
    return load_dict(tmp, data)


class _Models(http.server.BaseHTTPRequestHandler):
    want_key: str | None = None
    seen_auth: list[str | None] = []

    def log_message(self, *a: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        self.seen_auth.append(self.headers.get("Authorization"))
        if self.want_key and self.headers.get("Authorization") != f"Bearer {self.want_key}":
            self.send_response(401)
            self.end_headers()
            return
        body = json.dumps({"data": [{"id": MODEL}]}).encode()
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture()
def models_server() -> Iterator[tuple[int, type[_Models]]]:
    handler = type("H", (_Models,), {"want_key": None, "seen_auth": []})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address[1], handler
    srv.shutdown()
    srv.server_close()


def test_ready_when_the_model_is_listed_with_the_key(tmp_path: Path, models_server) -> None:
    port, handler = models_server
    handler.want_key = "s3cret"
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    cfg = _cfg(tmp_path, port, key_file=key)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        rep = ready.await_ready(cfg, cfg.backends["ftllm-dflash"], main_pid=child.pid, timeout=5)
    finally:
        child.kill()
        child.wait()
    assert MODEL in rep.served_models and rep.seconds < 2
    assert handler.seen_auth[-1] == "Bearer s3cret"


def test_a_dead_main_process_ends_the_wait_at_once(tmp_path: Path) -> None:
    """Nothing listens; the server's process exits after 0.3 s: the wait ends then, not at its 30 s timeout."""
    cfg = _cfg(tmp_path, free_port())
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    t0 = time.monotonic()
    try:
        with pytest.raises(HealthError) as ei:
            ready.await_ready(cfg, cfg.backends["ftllm-dflash"], main_pid=child.pid, timeout=30)
    finally:
        child.wait()
    took = time.monotonic() - t0
    assert took < 2.0, took
    assert ei.value.details["reason"] == "unit-failed"
    assert f"main process (PID {child.pid})" in ei.value.message


def test_without_a_main_pid_it_waits_to_its_timeout(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, free_port())
    t0 = time.monotonic()
    with pytest.raises(HealthError) as ei:
        ready.await_ready(cfg, cfg.backends["llamacpp-tensor"], main_pid=None, timeout=0.5)
    assert ei.value.details["reason"] == "timeout" and 0.5 <= time.monotonic() - t0 < 3


def test_main_pid_from_env() -> None:
    assert ready.main_pid_from_env({"MAINPID": "123"}) == 123
    assert ready.main_pid_from_env({"MAINPID": ""}) is None
    assert ready.main_pid_from_env({"MAINPID": "0"}) is None
    assert ready.main_pid_from_env({"MAINPID": "x1"}) is None
    assert ready.main_pid_from_env({}) is None


def test_cli_exit_code_and_not_ready_line(tmp_path: Path) -> None:
    """The CLI: exit 9 and a `not ready:` line (never `error:`, which a switch reads as the ExecStartPre's)."""
    from tests.support.configs import write_dict

    data = example_dict("cpu-demo")
    set_key(data, "serve.internal_port", free_port())
    cfg = write_dict(tmp_path, data)
    r = subprocess.run([sys.executable, "-m", "deploy_tool", "--config", str(cfg), "await-ready", "ftllm-dflash",
                        "--timeout", "0.3"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 9, r.stdout + r.stderr
    assert r.stderr.startswith("not ready: ") and "error:" not in r.stderr


def test_console_entry_await_ready(tmp_path: Path, models_server) -> None:
    """The units' exact ExecStartPost command line through the console entry: the ready line and exit 0; a
    server that does not answer its readiness check: "not ready:" and exit 9."""
    from tests.support.configs import write_dict

    port, _handler = models_server
    data = example_dict("cpu-demo")
    set_key(data, "serve.internal_port", port)
    set_key(data, "health.start_timeout_s", 1)
    cfg = write_dict(tmp_path, data)
    cmd = [sys.executable, "-m", "deploy_tool", "--config", str(cfg), "await-ready"]
    r = subprocess.run([*cmd, "ftllm-dflash"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"ftllm-dflash serves {MODEL!r} at http://127.0.0.1:{port}" in r.stdout
    r = subprocess.run([*cmd, "llamacpp-tensor"], capture_output=True, text=True, timeout=60)  # /health: 404 here
    assert r.returncode == 9 and r.stderr.startswith("not ready: "), r


def _unit_state(active: str, sub: str, job: str, inv: str = "a" * 32):
    from deploy_tool.box.systemd import UnitState

    return UnitState(unit="u.service", load_state="loaded", active_state=active, sub_state=sub, result="success",
                     exec_main_status=0, exec_main_code=0, exec_main_pid=0, main_pid=0, n_restarts=0,
                     invocation_id=inv, unit_file_state="enabled", job=job)


def test_the_gate_reads_a_queued_start_as_not_started() -> None:
    """A start queued with --no-block (Job= set) on a unit still showing its last run, or waiting for its
    Restart= (systemd holds the start until then): not dead, not started, its old invocation not taken."""
    from deploy_tool.box.probe.gate import _snapshot

    seen: list[str] = []
    for active, sub in (("inactive", "dead"), ("failed", "failed"), ("activating", "auto-restart"),
                        ("deactivating", "stop-sigterm")):
        snap = _snapshot(_unit_state(active, sub, "21"), "u.service", seen)
        assert (snap.sub_state, snap.dead) == ("queued", False), (active, sub)
    assert seen == []
    assert _snapshot(_unit_state("activating", "auto-restart", ""), "u.service").dead  # a crash: no job
    assert _snapshot(_unit_state("failed", "failed", ""), "u.service").dead
    snap = _snapshot(_unit_state("activating", "start-pre", "21", "b" * 32), "u.service", seen)
    assert snap.sub_state == "start-pre" and not snap.dead and seen == ["b" * 32]


def test_the_readiness_wait_never_probes_before_the_server_runs(models_server) -> None:
    """While the unit is queued or in its ExecStartPre, whatever answers on the port (the previous backend, in a
    switch) is not taken for the target being ready; the wait times out naming the state."""
    from deploy_tool.box.probe import health

    port, _handler = models_server
    for sub in ("queued", "start-pre"):
        with pytest.raises(HealthError) as ei:
            health.wait_ready("ftllm", f"http://127.0.0.1:{port}", MODEL, timeout=0.3, interval=0.05,
                              unit_state=lambda sub=sub: health.UnitSnapshot("activating", sub, name="u.service"))
        assert ei.value.details["reason"] == "timeout" and "has not started its server yet" in ei.value.message
    rep = health.wait_ready("ftllm", f"http://127.0.0.1:{port}", MODEL, timeout=2, interval=0.05,
                            unit_state=lambda: health.UnitSnapshot("activating", "start-post", name="u.service"))
    assert MODEL in rep.served_models


def test_the_gate_sees_the_server_gone_while_the_readiness_wait_still_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server exits while systemd still waits for the unit's ExecStartPost (activating/start-post, its exit
    status recorded): the gate's watch reads the unit as failed at once, not once the ExecStartPost has exited."""
    import dataclasses

    from deploy_tool.box.probe import gate

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read(); sys.exit(3)"],
                             stdin=subprocess.PIPE)
    running = dataclasses.replace(_unit_state("activating", "start-post", "7"), main_pid=child.pid)
    gone = dataclasses.replace(running, exec_main_code=1, exec_main_status=3)
    answers = [running, gone, gone]

    class Sd:
        def show(self, unit: str):
            return answers.pop(0)

    monkeypatch.setattr(gate, "_watch", lambda pid, unit: procfs.ProcessWatch(pid))
    watch = gate.UnitWatch(Sd(), "u.service", seen=[])  # type: ignore[arg-type]
    try:
        assert watch.state() is not None and watch.fd is not None  # first look: running, pidfd open
        assert watch.state() is None  # alive: no systemctl round trip
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
        snap = watch.state()
        assert snap is not None and snap.dead and (snap.active_state, snap.result) == ("failed", "exit-code")
        assert snap.exec_main_status == 3
    finally:
        watch.close()
    # before systemd has the exit status, the unit's own state stands (looked at again next time)
    still = gate._snapshot(running, "u.service")
    assert not still.dead


def test_the_gate_watches_the_execstartpre_instead_of_polling_systemd(monkeypatch: pytest.MonkeyPatch) -> None:
    """While the unit runs its ExecStartPre (the fingerprint check, the wait for the other backend's exit) the gate
    watches that control process: each look answers "not started yet" without a systemctl round trip (so the
    readiness wait never probes the port, where the previous backend may still answer), the wait between looks
    ends when it exits, and the unit is read again then: its main process is watched from there."""
    import dataclasses

    from deploy_tool.box.probe import gate, health

    pre = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    server = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    starting = dataclasses.replace(_unit_state("activating", "start-pre", ""), control_pid=101)
    running = dataclasses.replace(_unit_state("activating", "start-post", ""), main_pid=202, control_pid=303)
    answers = [starting, running]
    shows: list[str] = []

    class Sd:
        def show(self, unit: str):
            shows.append(unit)
            return answers.pop(0)

    pids = {101: pre.pid, 202: server.pid}
    monkeypatch.setattr(gate, "_watch", lambda pid, unit: procfs.ProcessWatch(pid))
    watch = gate.UnitWatch(Sd(), "u.service", seen=[], to_host_pid=pids.__getitem__)  # type: ignore[arg-type]
    try:
        first = watch.state()
        assert first is not None and first.sub_state == "start-pre" and watch.fd is not None
        for _ in range(3):  # not started yet, from the watch alone
            again = watch.state()
            assert again is not None and again.sub_state in health.NOT_STARTED_SUB_STATES
        assert len(shows) == 1 and watch.main_pid == 0
        assert pre.stdin is not None
        pre.stdin.close()
        pre.wait()
        t0 = time.monotonic()
        watch.sleep(5.0)  # ends at the ExecStartPre's exit, not after 5 s
        assert time.monotonic() - t0 < 2.0
        snap = watch.state()  # read again: the server runs
        assert snap is not None and snap.sub_state == "start-post" and len(shows) == 2
        assert watch.main_pid == 202 and watch.state() is None and len(shows) == 2  # the main process, alive
        assert watch.main_pid_now() == 202 and len(shows) == 2
    finally:
        watch.close()
        for p in (pre, server):
            if p.poll() is None:
                assert p.stdin is not None
                p.stdin.close()
                p.wait()


def test_the_gate_takes_the_main_pid_from_its_watch_while_the_process_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """After readiness the gate needs the unit's MainPID (GPU residency, the mapped libraries): while the watched
    process runs (its pidfd says so), that is its PID, with no systemctl round trip; once it has ended, systemd is
    asked (a restarted unit has another main process)."""
    import dataclasses

    from deploy_tool.box.probe import gate

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    # systemd's view of the PID may differ from ours (a sandbox's PID namespace): the watch maps it
    running = dataclasses.replace(_unit_state("active", "running", ""), main_pid=4242)
    restarted = dataclasses.replace(running, main_pid=4343, invocation_id="8")
    shows: list[object] = []

    class Sd:
        def show(self, unit: str):
            shows.append(unit)
            return running if len(shows) == 1 else restarted

    monkeypatch.setattr(gate, "_watch", lambda pid, unit: procfs.ProcessWatch(pid))
    watch = gate.UnitWatch(Sd(), "u.service", seen=[], to_host_pid=lambda pid: child.pid)  # type: ignore[arg-type]
    try:
        assert watch.state() is not None and watch.fd is not None
        assert (watch.main_pid_now(), len(shows)) == (4242, 1)  # systemd's PID, from the watch alone
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
        assert (watch.main_pid_now(), len(shows)) == (4343, 2)  # gone: asked again
    finally:
        watch.close()
    assert (watch.main_pid_now(), len(shows)) == (4343, 3)  # closed: nothing watched, systemd asked


def test_the_gate_waits_for_the_start_job_watching_its_control_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate's probes can pass before the unit's own readiness wait (its ExecStartPost) has exited; a switch
    that returned then left the unit activating, and a stop right after killed that control process: the unit
    failed and its failover started (2 of 12 stops right after a switch, on the real sandbox). The gate ends only
    once the start job has: it watches the control process (no systemctl round trip while it runs, the wait ends
    at its exit) and answers the unit's state then; a start job that ends failed is answered as failed."""
    import dataclasses

    from deploy_tool.box.probe import gate

    post = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    posting = dataclasses.replace(_unit_state("activating", "start-post", ""), main_pid=202, control_pid=303)
    shows: list[float] = []

    def run(after: object) -> tuple[object, float]:
        answers = [posting, after]

        class Sd:
            def show(self, unit: str):
                shows.append(time.monotonic())
                return answers.pop(0) if len(answers) > 1 else answers[0]

        watch = gate.UnitWatch(Sd(), "u.service", seen=[], to_host_pid={303: post.pid}.__getitem__,  # type: ignore[arg-type]
                               recheck_s=30.0)
        t0 = time.monotonic()
        try:
            snap = watch.started(60.0, interval=0.01)
        finally:
            watch.close()
        return snap, time.monotonic() - t0

    monkeypatch.setattr(gate, "_watch", lambda pid, unit: procfs.ProcessWatch(pid))
    threading.Timer(0.4, lambda: post.stdin.close() if post.stdin else None).start()  # its ExecStartPost exits
    try:
        snap, took = run(_unit_state("active", "running", ""))
        assert snap.active_state == "active" and 0.35 <= took < 10.0, (snap, took)  # the exit woke it, not 30 s
        assert len(shows) == 2  # one look before, one after the exit: nothing in between
    finally:
        post.wait()
    shows.clear()
    failed = dataclasses.replace(_unit_state("failed", "failed", ""), result="exit-code")
    snap, took = run(failed)  # the control process has gone already: asked again at once
    assert (snap.active_state, snap.result) == ("failed", "exit-code") and took < 5.0 and len(shows) == 2
    # a unit not in its start (auto-restart: its server died after the probes) is answered as it is, not waited on
    shows.clear()
    restarting = dataclasses.replace(_unit_state("activating", "auto-restart", ""), control_pid=0)
    snap, took = run(restarting)
    assert snap.sub_state == "auto-restart" and len(shows) == 2
    # Restart= ran between the gate's checks and this wait: another invocation than the gated one, even active, is
    # answered at once and noted (the gate fails it: the server it checked has exited)
    again = dataclasses.replace(_unit_state("active", "running", "", inv="b" * 32), main_pid=404)

    class Sd:
        def show(self, unit: str):
            return again

    watch = gate.UnitWatch(Sd(), "u.service", seen=["a" * 32])  # type: ignore[arg-type]
    snap = watch.started(60.0, interval=0.01)
    assert snap.active_state == "active" and watch.restarted == "b" * 32
    watch = gate.UnitWatch(Sd(), "u.service", seen=["b" * 32])  # type: ignore[arg-type]
    assert watch.started(60.0, interval=0.01).active_state == "active" and not watch.restarted


# ------------------------------------------------------------------------------------------------ sandbox part

sandboxed = [pytest.mark.sandbox, pytest.mark.backends, pytest.mark.slow, pytest.mark.e2e]


def _port(cfg: Path) -> int:
    """The backends' own port (behind the front's public one): what these tests watch open and close."""
    return config.load(cfg).backend_port


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _get_refused(port: int) -> bool:
    try:
        _get(port, "/health")
    except (urllib.error.URLError, ConnectionError):
        return True
    return False


def _dropin(env, cfg: Path, text: str) -> Path:
    """A drop-in on llamacpp-tensor, pinned on purpose (a drop-in is drift to the units' ExecStartPre)."""
    d = env.unit_dir / f"{LU}.d"
    d.mkdir(exist_ok=True)
    (d / "50-ready-test.conf").write_text(text)
    env.systemd.daemon_reload()
    r = dt(cfg, "pin", "llamacpp-tensor", "--reason", "test: readiness")
    assert r.returncode == 0, r.stdout + r.stderr
    return d


def _clear(env, cfg: Path, d: Path) -> None:
    env.systemd.stop(LU)
    env.systemd.reset_failed(LU)
    shutil.rmtree(d, ignore_errors=True)
    env.systemd.daemon_reload()
    r = dt(cfg, "pin", "llamacpp-tensor", "--reason", "test: readiness done")
    assert r.returncode == 0, r.stdout + r.stderr


def _sandboxed(fn):
    for m in sandboxed:
        fn = m(fn)
    return fn


@_sandboxed
def test_systemctl_start_returns_once_the_port_serves(installed, systemd_sandbox) -> None:
    sd, port = systemd_sandbox.systemd, _port(installed)
    sd.stop(FU)
    sd.stop(LU)
    assert _get_refused(port)
    try:
        t0 = time.monotonic()
        sd.start(LU)  # plain `systemctl start`, waiting for the job
        took = time.monotonic() - t0
        health = _get(port, "/health")  # right after it returned
        models = _get(port, "/v1/models")
        st = sd.show(LU)
        assert health[0] == 200 and MODEL in models[1], (health, models)
        assert (st.active_state, st.sub_state, st.job) == ("active", "running", "")
        log = sd.journal(LU, invocation=st.invocation_id, lines=200)
        assert "await-ready" in log or "serves" in log, log
        print(f"systemctl start {LU}: {took:.2f}s to serving")
    finally:
        sd.stop(LU)


@_sandboxed
@pytest.mark.parametrize("post", [True, False], ids=["with-readiness-wait", "without"])
def test_a_unit_ordered_after_the_backend_sees_it_serving(installed, systemd_sandbox, post: bool) -> None:
    """llama-server made 2 s slow to open its port (sh sleeps, then execs it: the same main process). A probe unit
    Wants= and After= it: started, it finds /health 200; with the ExecStartPost reset (the units as they were
    before), the probe runs right after the exec and finds the port closed."""
    sd, port = systemd_sandbox.systemd, _port(installed)
    unit = (systemd_sandbox.unit_dir / LU).read_text()
    exec_line = next(ln for ln in unit.splitlines() if ln.startswith("ExecStart="))
    # the launcher's credential (%d/environment) is the only specifier; no quoting
    assert '"' not in exec_line and exec_line.count("%") == 1 and " %d/environment " in exec_line
    slow = f'ExecStart=\nExecStart=/bin/sh -c "sleep 2; exec {exec_line.split("=", 1)[1]}"\n'
    d = _dropin(systemd_sandbox, installed, "[Service]\n" + slow + ("" if post else "ExecStartPost=\n"))
    probe = systemd_sandbox.unit_dir / "ready-probe.service"
    probe.write_text(f"[Unit]\nWants={LU}\nAfter={LU}\n[Service]\nType=oneshot\n"
                     f"ExecStart=/usr/bin/python3 -c \"import urllib.request; r = urllib.request.urlopen("
                     f"'http://127.0.0.1:{port}/health', timeout=5); print('PROBE', r.status)\"\n")
    sd.daemon_reload()
    sd.stop(FU)
    try:
        t0 = time.monotonic()
        if post:
            sd.start("ready-probe.service")
            assert time.monotonic() - t0 >= 2.0
            assert "PROBE 200" in sd.journal("ready-probe.service", lines=20)
        else:
            with pytest.raises(SystemdError):
                sd.start("ready-probe.service")
            log = sd.journal("ready-probe.service", lines=20)
            assert "PROBE 200" not in log and "Connection refused" in log, log
    finally:
        sd.stop("ready-probe.service")
        sd.reset_failed("ready-probe.service")
        probe.unlink()
        _clear(systemd_sandbox, installed, d)


@_sandboxed
def test_start_timeout_covers_the_load(installed, systemd_sandbox) -> None:
    """A server that never gets ready: the start fails when TimeoutStartSec= (4 s here) runs out, not at exec."""
    sd = systemd_sandbox.systemd
    d = _dropin(systemd_sandbox, installed, "[Service]\nTimeoutStartSec=4\nExecStart=\nExecStart=/bin/sleep 600\n")
    sd.stop(FU)
    try:
        t0 = time.monotonic()
        with pytest.raises(SystemdError):
            sd.start(LU)
        took = time.monotonic() - t0
        st = sd.show(LU)
        assert 4.0 <= took < 12.0, took
        assert st.result == "timeout", st
        print(f"never-ready start failed after {took:.2f}s (TimeoutStartSec=4)")
    finally:
        _clear(systemd_sandbox, installed, d)


@_sandboxed
def test_a_server_dying_while_loading_fails_the_start_at_once(installed, systemd_sandbox) -> None:
    sd = systemd_sandbox.systemd
    d = _dropin(systemd_sandbox, installed, "[Service]\nTimeoutStartSec=60\nExecStart=\n"
                "ExecStart=/bin/sh -c \"sleep 1; echo simulated OOM while loading >&2; exit 3\"\n")
    sd.stop(FU)
    try:
        t0 = time.monotonic()
        with pytest.raises(SystemdError) as ei:
            sd.start(LU)
        took = time.monotonic() - t0
        assert took < 6.0, took  # the 1 s the server lived, plus the start's own checks; not the 60 s timeout
        text = ei.value.message + str(ei.value.details or "") + sd.journal(LU, lines=40)
        assert "simulated OOM while loading" in text and "not ready:" in text, text
        print(f"a server dying 1 s into its load failed its start after {took:.2f}s")
    finally:
        _clear(systemd_sandbox, installed, d)


@_sandboxed
def test_a_switch_returns_with_its_unit_active_and_a_stop_right_after_is_clean(installed, systemd_sandbox) -> None:
    """What the switch said is what systemd says: the moment `deploytool switch` returns, the unit is active (its
    start job, the ExecStartPost readiness wait, has ended), and an operator's `systemctl stop` right then is a
    clean stop: inactive, no failover. Before the gate waited for the start job, 2 in 12 such stops killed the
    ExecStartPost and left the unit failed, its OnFailure= failover started."""
    sd = systemd_sandbox.systemd
    try:
        for _ in range(4):
            r = dt(installed, "switch", "llamacpp")
            assert r.returncode == 0, r.stdout + r.stderr
            assert sd.show(LU).active_state == "active", sd.show(LU)
            sd.stop(LU)
            st = sd.show(LU)
            assert (st.active_state, st.result) == ("inactive", "success"), st
            r = dt(installed, "switch", "ftllm")
            assert r.returncode == 0, r.stdout + r.stderr
            assert sd.show(FU).active_state == "active", sd.show(FU)
    finally:
        sd.reset_failed()
        if sd.show(FU).active_state != "active":
            dt(installed, "switch", "ftllm")
