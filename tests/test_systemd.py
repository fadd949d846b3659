"""The systemd driver against the REAL sandboxed systemd 252 (no mocks)."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from deploy_tool.box.systemd import Systemd, for_config, host_systemd_available, validate_unit_name
from deploy_tool.errors import DeployError, InputError, MissingTool, SystemdError
from tests.support.sandbox import SandboxEnv, free_port, port_closed, wait_http

pytestmark = pytest.mark.sandbox


def web_unit(port: int, extra: str = "") -> bytes:
    return (f"[Unit]\nDescription=test web {port}\n[Service]\n{extra}"
            f"ExecStart=/usr/bin/python3 -m http.server --bind 127.0.0.1 {port}\n"
            "[Install]\nWantedBy=multi-user.target\n").encode()


def wait_journal(sd: Systemd, needle: str, unit: str = "t-j.service") -> None:
    """Wait until journald has taken in a line (it reads service output streams asynchronously)."""
    deadline = time.monotonic() + 5
    while needle not in sd.journal(unit) and time.monotonic() < deadline:
        time.sleep(0.02)


def test_execstartpre_failure_refuses_start_and_journal_has_reason(sandbox_env: SandboxEnv) -> None:
    """A unit whose ExecStartPre fails is refused: start raises with the pre-check's own words from the journal."""
    sd = sandbox_env.systemd
    port = free_port()
    sd.install_file("t-pre.service", (
        "[Service]\nExecStartPre=/bin/sh -c 'echo fingerprint drift: libnccl.so.2 changed >&2; exit 7'\n"
        f"ExecStart=/usr/bin/python3 -m http.server --bind 127.0.0.1 {port}\n").encode())
    sd.daemon_reload()
    with pytest.raises(SystemdError) as ei:
        sd.start("t-pre.service")
    err = ei.value
    assert "fingerprint drift: libnccl.so.2 changed" in err.message
    assert "fingerprint drift" in str(err.details)
    assert "Result=exit-code" in err.message
    st = sd.show("t-pre.service")
    assert (st.active_state, st.result) == ("failed", "exit-code")
    assert sd.is_failed("t-pre.service") and not sd.is_active("t-pre.service")
    log = sd.journal("t-pre.service", invocation=st.invocation_id)
    assert "fingerprint drift" in log and "status=7" in log  # the unit's stderr and the manager's verdict
    assert port_closed(port)  # ExecStart never ran


def test_start_show_stop_and_service_reachable_from_host(sandbox_env: SandboxEnv) -> None:
    """start -> active/running with a main PID, served on the host's 127.0.0.1; stop -> inactive/dead, port freed."""
    sd = sandbox_env.systemd
    port = free_port()
    sd.install_file("t-web.service", web_unit(port))
    sd.daemon_reload()
    before = sd.show("t-web.service")
    assert (before.load_state, before.active_state, before.sub_state) == ("loaded", "inactive", "dead")
    sd.start("t-web.service")
    st = sd.show("t-web.service")
    assert (st.active_state, st.sub_state, st.result) == ("active", "running", "success")
    assert st.main_pid > 0 and st.main_pid == st.exec_main_pid
    assert re.fullmatch(r"[0-9a-f]{32}", st.invocation_id)
    assert sd.is_active("t-web.service") and not sd.is_failed("t-web.service")
    assert wait_http(port), "service inside the sandbox not reachable on the host's 127.0.0.1"
    host_pid = sandbox_env.sandbox.host_pid(st.main_pid)
    assert "http.server" in Path(f"/proc/{host_pid}/cmdline").read_text()
    sd.stop("t-web.service")
    st = sd.show("t-web.service")
    assert (st.active_state, st.sub_state) == ("inactive", "dead")
    assert not sd.is_active("t-web.service")
    assert port_closed(port)


def test_restart_gives_new_invocation_and_nrestarts_counts(sandbox_env: SandboxEnv) -> None:
    """restart yields a new InvocationID; Restart=on-failure restarts are counted in NRestarts."""
    sd = sandbox_env.systemd
    port = free_port()
    sd.install_file("t-rs.service", web_unit(port))
    sd.install_file("t-crash.service", b"[Service]\nExecStart=/bin/sh -c 'sleep 0.05; exit 1'\n"
                                       b"Restart=on-failure\nRestartSec=50ms\n")
    sd.daemon_reload()
    sd.start("t-rs.service")
    first = sd.show("t-rs.service").invocation_id
    sd.restart("t-rs.service")
    assert sd.show("t-rs.service").invocation_id not in ("", first)
    sd.start("t-crash.service", no_block=True)
    deadline = time.monotonic() + 5
    while sd.show("t-crash.service").n_restarts < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sd.show("t-crash.service").n_restarts >= 2


def test_enable_disable_is_enabled(sandbox_env: SandboxEnv) -> None:
    """enable links the unit into multi-user.target.wants inside the sandbox's unit dir; disable removes it."""
    sd = sandbox_env.systemd
    sd.install_file("t-en.service", web_unit(free_port()))
    sd.daemon_reload()
    assert sd.is_enabled("t-en.service") == "disabled"
    sd.enable("t-en.service")
    assert sd.is_enabled("t-en.service") == "enabled"
    link = sandbox_env.unit_dir / "multi-user.target.wants" / "t-en.service"
    assert link.is_symlink()
    assert sd.show("t-en.service").unit_file_state == "enabled"
    sd.disable("t-en.service")
    assert sd.is_enabled("t-en.service") == "disabled"
    assert not link.exists()
    assert sd.is_enabled("t-nonexistent.service") == "not-found"
    assert not sd.is_active("t-nonexistent.service")
    assert sd.show("t-nonexistent.service").load_state == "not-found"
    sd.stop("t-nonexistent.service")  # nothing to stop: fine


def test_atomic_install_keeps_dropin_dir(sandbox_env: SandboxEnv) -> None:
    """install_file replaces only the unit file: the user's <unit>.d/ drop-in survives and still applies."""
    sd = sandbox_env.systemd
    dropin = sandbox_env.unit_dir / "t-di.service.d"
    dropin.mkdir()
    override = dropin / "override.conf"
    override.write_bytes(b"[Service]\nEnvironment=FROM_DROPIN=kept\n")
    for n in range(3):
        p = sd.install_file("t-di.service", f"[Service]\nEnvironment=ROUND={n}\nExecStart=/bin/true\n".encode(),
                            0o640)
        assert p.read_bytes().startswith(b"[Service]\nEnvironment=ROUND=%d" % n)
    assert os.stat(p).st_mode & 0o777 == 0o640
    assert override.read_bytes() == b"[Service]\nEnvironment=FROM_DROPIN=kept\n"
    assert not [n for n in os.listdir(sandbox_env.unit_dir) if "tmp" in n]  # no temp file left over
    sd.daemon_reload()
    env = sandbox_env.run("systemctl", "show", "-p", "Environment", "t-di.service").stdout
    assert "FROM_DROPIN=kept" in env and "ROUND=2" in env
    with pytest.raises(InputError):
        sd.install_file("t-di.service.d", b"x")  # not a unit name (and it is the drop-in dir)
    assert sd.remove_file("t-di.service") and not sd.remove_file("t-di.service")
    assert override.is_file()


def test_sigkilled_service_seen_failed_within_a_second(sandbox_env: SandboxEnv) -> None:
    """A service killed with SIGKILL (from the host, by its host PID) shows failed, Result=signal, within 1 s."""
    sd = sandbox_env.systemd
    port = free_port()
    sd.install_file("t-kill.service", web_unit(port))
    sd.daemon_reload()
    sd.start("t-kill.service")
    st = sd.show("t-kill.service")
    host_pid = sandbox_env.sandbox.host_pid(st.main_pid)
    t0 = time.monotonic()
    os.kill(host_pid, signal.SIGKILL)
    while not sd.is_failed("t-kill.service") and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    elapsed = time.monotonic() - t0
    st = sd.show("t-kill.service")
    assert elapsed < 1.0, f"failure seen only after {elapsed:.2f} s"
    assert (st.active_state, st.result) == ("failed", "signal")
    assert (st.exec_main_code, st.exec_main_status) == (2, signal.SIGKILL)  # CLD_KILLED, signal 9


def test_kill_via_systemctl(sandbox_env: SandboxEnv) -> None:
    """Systemd.kill sends a signal through the manager; SIGTERM to http.server ends it (failed, Result=signal)."""
    sd = sandbox_env.systemd
    sd.install_file("t-sk.service", web_unit(free_port()))
    sd.daemon_reload()
    sd.start("t-sk.service")
    sd.kill("t-sk.service", "SIGKILL", who="main")
    deadline = time.monotonic() + 5
    while sd.show("t-sk.service").active_state != "failed" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sd.show("t-sk.service").result == "signal"


def test_journal_since_cursor_and_by_invocation(sandbox_env: SandboxEnv) -> None:
    """journal() reads only what follows a cursor, or only one invocation's lines."""
    sd = sandbox_env.systemd
    sd.install_file("t-j.service", b"[Service]\nType=oneshot\nRemainAfterExit=yes\n"
                                   b"ExecStart=/bin/sh -c 'echo run-$INVOCATION_ID'\n")
    sd.daemon_reload()
    sd.start("t-j.service")
    inv1 = sd.show("t-j.service").invocation_id
    wait_journal(sd, f"run-{inv1}")
    cursor = sd.journal_cursor()
    assert cursor.startswith("s=")
    sd.restart("t-j.service")
    inv2 = sd.show("t-j.service").invocation_id
    wait_journal(sd, f"run-{inv2}")
    assert inv1 != inv2
    everything = sd.journal("t-j.service")
    assert f"run-{inv1}" in everything and f"run-{inv2}" in everything
    after = sd.journal("t-j.service", since_cursor=cursor)
    assert f"run-{inv2}" in after and f"run-{inv1}" not in after
    only1 = sd.journal("t-j.service", invocation=inv1)
    assert f"run-{inv1}" in only1 and f"run-{inv2}" not in only1
    assert len(sd.journal("t-j.service", lines=1).splitlines()) == 1
    with pytest.raises(InputError, match="not a journal cursor"):
        sd.journal("t-j.service", since_cursor="garbage")


@pytest.mark.parametrize("name", [
    "web", "a b.service", "x;rm -rf.service", "../etc/passwd.service", "sub/x.service", "-x.service",
    "x.exe", "", ".service", "é.service", "a\n.service", "x$(id).service", "a@b@c.service", "x" * 300 + ".service",
])
def test_bad_unit_names_rejected(sandbox_env: SandboxEnv, name: str) -> None:
    """A unit name with odd characters or no unit type is refused with one clear error; nothing is written."""
    sd = sandbox_env.systemd
    before = sorted(os.listdir(sandbox_env.unit_dir))
    with pytest.raises(InputError) as ei:
        validate_unit_name(name)
    assert "unit name" in ei.value.message
    for call in (lambda: sd.install_file(name, b"[Service]\nExecStart=/bin/true\n"), lambda: sd.start(name),
                 lambda: sd.show(name), lambda: sd.enable(name), lambda: sd.journal(name)):
        with pytest.raises(InputError):
            call()
    assert sorted(os.listdir(sandbox_env.unit_dir)) == before


def test_good_unit_names_accepted() -> None:
    """Ordinary names, templates and instances pass validation."""
    for n in ("llamacpp-tensor.service", "ftllm-dflash.service", "getty@tty1.service", "a:b_c.d.socket",
              "x.timer", "foo@.service"):
        assert validate_unit_name(n) == n


def test_host_systemctl_refused_when_pid1_is_not_systemd(tmp_path: Path) -> None:
    """The machine's own systemctl is refused (with the sandbox recipe) when PID 1 is not systemd; nothing runs."""
    if host_systemd_available():
        Systemd(["systemctl"], ["journalctl"], tmp_path)  # a real systemd host: allowed
        assert Path("/proc/1/comm").read_text().strip() == "systemd"
        return
    with pytest.raises(SystemdError) as ei:
        Systemd(["systemctl"], ["journalctl"], tmp_path)
    assert ei.value.message.startswith("PID 1 is not systemd")
    assert "deploytool sandbox up DIR" in ei.value.message and "systemd.sandbox: DIR" in ei.value.message
    assert ei.value.exit_code == 8


def test_missing_systemctl_program(tmp_path: Path) -> None:
    """A systemctl/journalctl prefix whose program does not exist is a MissingTool error naming it."""
    with pytest.raises(MissingTool) as ei:
        Systemd(["/nonexistent/systemctl"], ["journalctl"], tmp_path)
    assert "/nonexistent/systemctl" in ei.value.message
    with pytest.raises(MissingTool) as ei:
        Systemd(["nsenter", "-t", "1", "--", "systemctl"], ["no-such-journalctl"], tmp_path)
    assert "no-such-journalctl" in ei.value.message


def test_for_config_targets_the_sandbox(sandbox_env: SandboxEnv) -> None:
    """A config with systemd.sandbox set yields a driver that talks to that sandbox and its unit dir."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(systemd=SimpleNamespace(sandbox=str(sandbox_env.sandbox.dir), systemctl=("systemctl",),
                                                  journalctl=("journalctl",)),
                          paths=SimpleNamespace(unit_dir=str(sandbox_env.unit_dir)))
    sd = for_config(cfg)
    assert sd.systemctl[0] == "nsenter" and sd.unit_dir == sandbox_env.unit_dir
    assert sd.show("systemd-journald.service").active_state == "active"


def test_install_into_missing_unit_dir(tmp_path: Path, sandbox_env: SandboxEnv) -> None:
    """Installing into a unit dir that does not exist is one clear error, and nothing is created."""
    sd = Systemd(sandbox_env.systemd.systemctl, sandbox_env.systemd.journalctl, tmp_path / "nope")
    with pytest.raises(DeployError) as ei:
        sd.install_file("x.service", b"[Service]\nExecStart=/bin/true\n")
    assert "does not exist" in ei.value.message
    assert not (tmp_path / "nope").exists()


def test_each_failed_start_reports_its_own_reason(sandbox_env: SandboxEnv) -> None:
    """Back-to-back failing starts: every error and every invocation's journal holds its own pre-check line only."""
    sd = sandbox_env.systemd
    sd.install_file("t-rep.service", b"[Service]\nExecStartPre=/bin/sh -c 'echo refused-$INVOCATION_ID >&2; exit 7'\n"
                                     b"ExecStart=/bin/sleep 10\n")
    sd.daemon_reload()
    invs = []
    for _ in range(8):
        with pytest.raises(SystemdError) as ei:
            sd.start("t-rep.service")
        inv = sd.show("t-rep.service").invocation_id
        assert f"refused-{inv}" in ei.value.message
        invs.append(inv)
        sd.reset_failed("t-rep.service")
    assert len(set(invs)) == 8
    for inv in invs:
        log = sd.journal("t-rep.service", invocation=inv)
        assert f"refused-{inv}" in log and "status=7" in log
        assert not [o for o in invs if o != inv and f"refused-{o}" in log]


def test_operator_start_gets_past_the_start_limit(sandbox_env: SandboxEnv) -> None:
    """An enabled unit started and stopped StartLimitBurst= times within StartLimitIntervalSec= is refused by
    systemd (Result=start-limit-hit: what happened to ftllm-dflash when a drifted llamacpp-tensor was started by
    hand and Conflicts= stopped it); an operator's start (past_start_limit=True) resets the counter and runs it."""
    sd = sandbox_env.systemd
    port = free_port()
    sd.install_file("t-lim.service", web_unit(port, "").replace(
        b"[Unit]\n", b"[Unit]\nStartLimitIntervalSec=60\nStartLimitBurst=3\n"))
    sd.daemon_reload()
    sd.enable("t-lim.service")  # an enabled unit stays loaded when stopped, and so does its start counter
    try:
        hit = None
        for _ in range(5):
            try:
                sd.start("t-lim.service")
            except SystemdError as exc:
                hit = exc
                break
            sd.stop("t-lim.service")
        assert hit is not None and "Result=start-limit-hit" in hit.message
        sd.start("t-lim.service", past_start_limit=True)
        assert sd.is_active("t-lim.service")
        assert wait_http(port)
        sd.stop("t-lim.service")
        with pytest.raises(SystemdError):  # without the flag the limit still holds for the next start
            for _ in range(4):
                sd.start("t-lim.service")
                sd.stop("t-lim.service")
    finally:
        sd.stop("t-lim.service")
        sd.disable("t-lim.service")
        sd.reset_failed("t-lim.service")


def test_journal_since_reads_only_what_this_start_logged(sandbox_env: SandboxEnv) -> None:
    """journal(since=t) with t taken before a start: that start's lines (also by invocation), none of an earlier
    start more than a second before."""
    sd = sandbox_env.systemd
    # each run prints run-N, N counting up in /run ($$: a literal $ for systemd)
    sd.install_file("t-since.service", b"[Service]\nExecStart=/bin/sh -c 'n=$$(cat /run/t-since.n 2>/dev/null "
                                       b"|| echo 0); n=$$((n+1)); echo $$n > /run/t-since.n; echo run-$$n; "
                                       b"exec sleep 30'\n")
    sd.daemon_reload()
    try:
        sd.start("t-since.service")
        wait_journal(sd, "run-1", "t-since.service")
        sd.stop("t-since.service")
        time.sleep(2.1)
        t = time.time()
        sd.start("t-since.service")
        inv = sd.show("t-since.service").invocation_id
        wait_journal(sd, "run-2", "t-since.service")
        text = sd.journal("t-since.service", since=t, lines=2000)
        assert "run-2" in text and "run-1" not in text
        by_inv = sd.journal("t-since.service", since=t, invocation=inv, lines=5)
        assert "run-2" in by_inv and "run-1" not in by_inv
        assert "run-1" in sd.journal("t-since.service", lines=50)  # it is there without the bound
    finally:
        sd.stop("t-since.service")
        sandbox_env.run("rm", "-f", "/run/t-since.n")


def test_invocation_window_orders() -> None:
    """The invocation window copes with journald storing a process's output before or without its invocation id."""
    from deploy_tool.box.systemd import _invocation_window

    a, b, c = "a" * 32, "b" * 32, "c" * 32

    def mgr(inv: str, msg: str) -> dict[str, object]:
        return {"INVOCATION_ID": inv, "MESSAGE": msg, "_PID": "1"}

    def out(msg: str, inv: str | None = None) -> dict[str, object]:
        return {"MESSAGE": msg, **({"_SYSTEMD_INVOCATION_ID": inv} if inv else {})}

    ents = [out("a-early", a), mgr(a, "Starting"), mgr(a, "Failed"),
            out("b-before-start"), mgr(b, "Starting"), out("b-run", b), mgr(b, "Failed"),
            out("c-before-start", c), out("b-late", b), mgr(c, "Starting"), out("c-untagged")]
    msgs = lambda inv: [e["MESSAGE"] for e in _invocation_window(ents, inv)]  # noqa: E731
    assert msgs(a) == ["a-early", "Starting", "Failed"]
    assert msgs(b) == ["b-before-start", "Starting", "b-run", "Failed", "b-late"]
    assert msgs(c) == ["c-before-start", "Starting", "c-untagged"]
    assert msgs("d" * 32) == []


class _CountingShows:
    """The real Systemd, counting `show` calls (what the readiness wait would otherwise pay per probe)."""

    def __init__(self, sd: Systemd) -> None:
        self.sd, self.shows = sd, 0

    def show(self, unit: str):
        self.shows += 1
        return self.sd.show(unit)


def test_unit_watch_reads_the_unit_only_when_its_process_exits(sandbox_env: SandboxEnv) -> None:
    """The gate's UnitWatch: one `show` to learn MainPID, then none while the process lives; its exit wakes a
    long sleep at once, and the next look reads the unit's failure from systemd."""
    from deploy_tool.box.probe.gate import UnitWatch

    sd = sandbox_env.systemd
    sd.install_file("t-watch.service", b"[Service]\nType=exec\nExecStart=/bin/sh -c 'sleep 1.5; exit 3'\n")
    sd.daemon_reload()
    sd.start("t-watch.service")
    counting = _CountingShows(sd)
    watch = UnitWatch(counting, "t-watch.service", to_host_pid=sandbox_env.sandbox.host_pid)  # type: ignore[arg-type]
    try:
        first = watch.state()
        assert first is not None and not first.dead and watch.fd is not None
        assert [watch.state() for _ in range(20)] == [None] * 20  # alive: nothing asked of systemd
        assert counting.shows == 1
        t0 = time.monotonic()
        watch.sleep(30)
        assert watch.exited and time.monotonic() - t0 < 5  # woken by the exit, not by the 30 s
        deadline = time.monotonic() + 5
        snap = watch.state()
        while snap is not None and not snap.dead and time.monotonic() < deadline:  # systemd reaps it just after
            time.sleep(0.02)
            snap = watch.state()
        assert snap is not None and snap.dead and snap.exec_main_status == 3, snap
    finally:
        watch.close()


def test_unit_watch_without_a_pidfd_asks_systemd_every_time(sandbox_env: SandboxEnv) -> None:
    """A MainPID that does not map to a process of the unit (here: this test's own PID) gets no pidfd: every look
    is a `show`, as before, so a dead unit is still seen."""
    from deploy_tool.box.probe.gate import UnitWatch

    sd = sandbox_env.systemd
    port = free_port()
    sd.install_file("t-watch2.service", web_unit(port))
    sd.daemon_reload()
    sd.start("t-watch2.service")
    counting = _CountingShows(sd)
    watch = UnitWatch(counting, "t-watch2.service", to_host_pid=lambda pid: os.getpid())  # type: ignore[arg-type]
    try:
        assert watch.state() is not None and watch.fd is None
        assert watch.state() is not None and counting.shows == 2
    finally:
        watch.close()
