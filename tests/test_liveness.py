"""Liveness and drain, fast: the decision (pure), and ticks and switches against the fake systemd (real sockets,
fake processes, virtual time; tests.support.fake_systemd). A client "in flight" is a real TCP connection from a
child process (the count reads /proc/net/tcp and leaves this process's own connections out, as a prober's).

The real-backend versions (a SIGSTOPped server restarted by the installed probe, a stream finishing during a
switch) are in tests/test_liveness_e2e.py.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from deploy_tool import procfs
from deploy_tool.box.probe import drain, liveness
from deploy_tool.box.probe.liveness import LiveState, Observation, decide
from deploy_tool.cli import main
from deploy_tool.config import LivenessCfg
from tests.support import fake_systemd as fs
from tests.support.configs import example_dict, write_dict
from tests.test_state_machine import FU, Box, F, L, assert_settled, no_real_sleep

LC = LivenessCfg(failures=3, restarts=1, restart_window_s=600.0, timeout_s=0.3, completion_every_s=0.0)
START_S = 60.0


def obs(answered: bool = False, *, inv: str = "i1", in_flight: int = 0, cpu: bool | None = None,
        detail: str = "no answer within 0.3s") -> Observation:
    return Observation(inv, answered, "" if answered else detail, in_flight=in_flight, cpu_advanced=cpu)


def run(cfg: LivenessCfg, seen: list[Observation], st: LiveState | None = None, t0: float = 1000.0,
        every: float = 10.0) -> tuple[list[str], LiveState]:
    st = st or LiveState(backend=F, invocation="i1", first_seen=0.0, seen_ready=True)
    actions = []
    for i, o in enumerate(seen):
        v = decide(cfg, START_S, st, o, t0 + i * every)
        actions.append(v.action)
        st = v.state
    return actions, st


# ------------------------------------------------------------------------------------------------ the decision

def test_k_failures_in_a_row_restart_and_an_answer_resets_the_count() -> None:
    acts, st = run(LC, [obs(), obs(), obs(True), obs(), obs(), obs()])
    assert acts == ["failure", "failure", "ok", "failure", "failure", "restart"]
    assert st.failures == 0 and len(st.restarts) == 1


def test_busy_is_not_hung_but_busy_without_cpu_is() -> None:
    """No answer with a request in flight: busy while the server uses CPU (not restarted within busy_max_s); the
    same with no CPU used (a stopped or deadlocked server with a client waiting) counts."""
    acts, st = run(LC, [obs(in_flight=1, cpu=True)] * 20)
    assert set(acts) == {"busy"} and st.failures == 0 and st.busy and st.busy_since == 1000.0
    acts, _ = run(LC, [obs(in_flight=1, cpu=None)] * 5)  # CPU accounting off: the connections decide
    assert set(acts) == {"busy"}
    acts, _ = run(LC, [obs(in_flight=2, cpu=False)] * 3)
    assert acts == ["failure", "failure", "restart"]


@pytest.mark.parametrize("bound", [0.0, 30.0, 95.0, 900.0])
def test_a_busy_streak_is_bounded(bound: float) -> None:
    """Busy for ever (a host thread spinning on a hung kernel uses CPU): past busy_max_s in a row each tick fails,
    `failures` of them restart it; the streak's start survives the failures; an answer ends the streak, and a
    later streak has the whole bound again. 0: no bound."""
    cfg = dataclasses.replace(LC, busy_max_s=bound)
    acts, st = run(cfg, [obs(in_flight=1, cpu=True)] * 20)  # ticks at 0, 10, ... 190 s
    if not bound or bound > 190:
        assert set(acts) == {"busy"} and st.busy_since == 1000.0
        return
    first_fail = next(i for i in range(20) if i * 10 >= bound)
    assert acts[:first_fail] == ["busy"] * first_fail
    assert acts[first_fail:first_fail + 3] == ["failure", "failure", "restart"], acts
    v = decide(cfg, START_S, LiveState(backend=F, invocation="i1", seen_ready=True, busy_since=1000.0),
               obs(in_flight=1, cpu=True), 1000.0 + bound)
    assert v.action == "failure" and f"busy for {bound:.0f}s without answering a probe" in v.detail, v
    # an answer ends the streak: the next one starts from its own first tick
    acts, st = run(cfg, [obs(in_flight=1, cpu=True)] * (first_fail - 1) + [obs(True)] +
                   [obs(in_flight=1, cpu=True)] * (first_fail - 1))
    assert acts == ["busy"] * (first_fail - 1) + ["ok"] + ["busy"] * (first_fail - 1), acts
    assert st.busy_since == 1000.0 + first_fail * 10


def test_a_start_never_seen_ready_has_its_start_timeout() -> None:
    """A (re)started server loading its model is not hung until its start timeout has passed."""
    st = LiveState(backend=F)
    acts, st2 = run(LC, [obs(inv="i2")] * 6, st=st, every=10.0)  # 0..50 s after first seen: within START_S
    assert set(acts) == {"starting"} and st2.failures == 0
    acts, _ = run(LC, [obs(inv="i2")] * 9, st=st, every=10.0)  # 60, 70, 80 s: failures
    assert acts[6:] == ["failure", "failure", "restart"]
    acts, _ = run(LC, [obs(True, inv="i2"), obs(inv="i2"), obs(inv="i2"), obs(inv="i2")], st=st)
    assert acts == ["ok", "failure", "failure", "restart"]  # once it served, the grace is over


def test_a_start_an_operation_gated_has_no_grace() -> None:
    """Started by a switch (state.json committed after the process started: it passed the gate), a hang right
    after counts at once; started by Restart= (nothing committed since), it has its start timeout."""
    st = LiveState(backend=F)
    gated = Observation("i2", False, "no answer", up_s=5.0, gated=True)
    assert run(LC, [gated] * 3, st=st)[0] == ["failure", "failure", "restart"]
    assert run(LC, [dataclasses.replace(gated, gated=False)] * 3, st=st)[0] == ["starting"] * 3


def test_a_new_invocation_starts_counting_afresh() -> None:
    acts, st = run(LC, [obs(), obs(), obs(inv="i9")], st=None)
    assert acts == ["failure", "failure", "starting"] and st.failures == 0 and st.invocation == "i9"


def test_gives_up_when_restarts_in_the_window_did_not_help() -> None:
    """restarts=1: the first hang restarts; the next within the window gives up; one after the window
    restarts again."""
    acts, st = run(LC, [obs()] * 6)
    assert acts == ["failure", "failure", "restart", "failure", "failure", "gave-up"]
    acts, _ = run(LC, [obs()] * 3, st=dataclasses.replace(st, failures=0), t0=1000.0 + 10_000)
    assert acts == ["failure", "failure", "restart"]
    zero = dataclasses.replace(LC, restarts=0)
    assert run(zero, [obs()] * 3)[0] == ["failure", "failure", "gave-up"]


# ------------------------------------------------------------------------------------------------ ticks on the fake

@pytest.fixture
def box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Box]:
    monkeypatch.delenv("DEPLOYTOOL_FAULT", raising=False)
    b = Box(tmp_path, monkeypatch)
    b.cfg = dataclasses.replace(b.cfg, supervision=dataclasses.replace(b.cfg.supervision, liveness=LC))
    slept = no_real_sleep(monkeypatch)
    try:
        with b.world.running():
            yield b
    finally:
        b.world.close()
    assert slept == [], f"slept for real: {slept}"


def tick(box: Box, **over: Any) -> liveness.TickResult:
    """One probe tick, then the interval (virtual). The probe's timeout is real time: 0.3 s (LC) while a fake
    process the test stopped or blocked hangs the probe, 30 s while every process answers (an answering fake
    answers within milliseconds; a shorter bound only measures the load of a busy CI machine)."""
    cfg = box.cfg
    hung = any(u.proc is not None and u.proc.unresponsive() for u in box.world.units.values())
    over.setdefault("timeout_s", LC.timeout_s if hung else 30.0)
    if over:
        lc = dataclasses.replace(cfg.supervision.liveness, **over)
        cfg = dataclasses.replace(cfg, supervision=dataclasses.replace(cfg.supervision, liveness=lc))
    res = liveness.Prober(cfg, sd=box.world.systemd(), now=lambda: box.world.now, mono=lambda: box.world.now).tick()
    box.world.advance(10.0)  # the interval
    return res


def events(box: Box) -> list[tuple[str, str]]:
    return [(h["backend"], h["action"]) for h in box.history() if h["event"] == "liveness"]


class Client:
    """A client of another process holding one connection to the served port open (a request in flight)."""

    def __init__(self, port: int) -> None:
        code = (f"import socket, sys; s = socket.create_connection(('127.0.0.1', {port})); print('up', flush=True); "
                "sys.stdin.read()")
        self.p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
        assert self.p.stdout is not None and self.p.stdout.readline().strip() == "up"

    def close(self) -> None:
        if self.p.poll() is None:
            assert self.p.stdin is not None
            self.p.stdin.close()
            self.p.wait()  # (a wait with a timeout polls through time.sleep)


@pytest.fixture
def client(box: Box) -> Iterator[Any]:
    made: list[Client] = []

    def make() -> Client:
        made.append(Client(box.cfg.backend_port))
        return made[-1]

    yield make
    for c in made:
        c.close()


def test_a_well_server_is_probed_and_nothing_is_recorded(box: Box) -> None:
    box.installed(F)
    for _ in range(5):
        res = tick(box)
        assert res.action == "ok", res
    assert events(box) == []
    st = liveness.load_state(Path(box.cfg.paths.state_dir) / liveness.STATE_FILE)
    assert st.backend == F and st.seen_ready and st.failures == 0


def test_a_config_edited_after_install_stops_the_probe_from_acting(box: Box) -> None:
    """The running release was packed with another backend port than the config now says (an edit after install,
    read by the probe after a reboot): it would find nothing answering there and kill a healthy server; it skips,
    naming the key, and kills nothing."""
    from tests.test_state_machine import _packed_with

    box.installed(F)
    _packed_with(box, "serve.internal_port", box.cfg.backend_port + 11)
    for _ in range(4):
        res = tick(box)
        assert res.action == "skipped" and "serve.internal_port" in res.detail, res
    assert not box.calls("kill") and events(box) == [] and box.world.healthy() == {FU}


def test_a_stopped_server_is_restarted_after_k_failures(box: Box) -> None:
    """SIGSTOP: no answer, no CPU. Three failures in a row, then SIGKILL: Restart=on-failure brings it back
    RestartSec later, and it serves again."""
    box.installed(F)
    assert tick(box).action == "ok"
    box.world.systemd().kill(FU, "SIGSTOP")
    assert [tick(box).action for _ in range(3)] == ["failure", "failure", "restart"]
    assert events(box) == [(F, "failure")] * 3 + [(F, "restart")]
    assert [c.args for c in box.calls("kill")][-1] == (FU, "SIGKILL")
    box.world.advance(fs.RESTART_S)
    assert box.world.healthy() == {FU} and box.serves()
    assert tick(box).action == "ok"
    h = [h for h in box.history() if h["event"] == "liveness"]
    assert h[0]["failures"] == 1 and "no answer within" in h[0]["detail"]


def test_busy_with_a_request_in_flight_is_not_restarted(box: Box, client: Any) -> None:
    """The server answers no probe while a client's request holds it, but uses CPU: busy, recorded once, never a
    failure; once the request is over and it still does not answer, it is hung."""
    box.installed(F)
    box.world.advance(box.cfg.health.start_timeout_s)  # past its start: not "starting" any more
    c = client()
    proc = box.world.units[FU].proc
    assert proc is not None
    proc.blocked = True
    assert [tick(box).action for _ in range(6)] == ["busy"] * 6
    assert events(box) == [(F, "busy")]
    c.close()
    assert [tick(box).action for _ in range(3)] == ["failure", "failure", "restart"]


def test_stopped_with_a_client_waiting_is_hung(box: Box, client: Any) -> None:
    box.installed(F)
    box.world.advance(box.cfg.health.start_timeout_s)
    client()
    box.world.systemd().kill(FU, "SIGSTOP")
    assert [tick(box).action for _ in range(3)] == ["failure", "failure", "restart"]
    assert "no CPU time used" in [h for h in box.history() if h["event"] == "liveness"][0]["detail"]


def test_gave_up_leaves_the_unit_failed_for_on_failure(box: Box) -> None:
    """restarts=0: the first hang gives up: killed with restarting off for once, the unit ends failed
    (Result=signal: what OnFailure= reacts to), and the runtime drop-in is gone again."""
    box.installed(F)
    box.world.advance(box.cfg.health.start_timeout_s)
    box.world.systemd().kill(FU, "SIGSTOP")
    acts = [tick(box, restarts=0).action for _ in range(3)]
    assert acts == ["failure", "failure", "gave-up"]
    u = box.world.units[FU]
    assert (u.active_state, u.result) == ("failed", "signal")
    assert not (Path(box.cfg.paths.unit_dir) / f"{FU}.d").exists()
    assert events(box)[-1] == (F, "gave-up")
    box.world.advance(60)
    assert box.world.units[FU].active_state == "failed"  # not restarted
    assert tick(box).action == "not-running"


def test_off_switch_and_operations_in_progress(box: Box) -> None:
    box.installed(F)
    box.world.systemd().kill(FU, "SIGSTOP")
    n = len(box.world.calls)
    for _ in range(5):
        assert tick(box, enabled=False).action == "off"
    assert len(box.world.calls) == n and events(box) == []
    from deploy_tool.box.state import Store

    with Store(box.cfg.paths.state_dir).lock(what="switch to x"):
        res = tick(box)
    assert res.action == "skipped" and "switch to x holds the lock" in res.detail
    assert events(box) == []


def test_watch_ticks_every_interval(box: Box) -> None:
    """--watch: a tick every interval_s (virtual time here), the hang found and restarted as by single ticks."""
    box.installed(F)
    box.world.advance(box.cfg.health.start_timeout_s)
    box.world.systemd().kill(FU, "SIGSTOP")
    t0 = box.world.now
    liveness.watch(box.cfg, sd=box.world.systemd(), ticks=4, now=lambda: box.world.now, mono=lambda: box.world.now)
    assert events(box) == [(F, "failure")] * 3 + [(F, "restart")]
    assert 3 * LC.interval_s <= box.world.now - t0 < 3 * LC.interval_s + 1
    off = dataclasses.replace(box.cfg, supervision=dataclasses.replace(
        box.cfg.supervision, liveness=dataclasses.replace(LC, enabled=False)))
    liveness.watch(off, sd=box.world.systemd())  # off: returns at once instead of looping for ever


def test_liveness_cli_off_and_dry_run(tmp_path: Path) -> None:
    data = example_dict("cpu-demo")
    data["systemd"] = {"systemctl": ["/bin/false"], "journalctl": ["/bin/false"]}
    data["supervision"] = {"liveness": {"enabled": False}}
    cfg = write_dict(tmp_path, data)
    r = CliRunner().invoke(main, ["--config", str(cfg), "liveness"])
    assert r.exit_code == 0 and "off" in r.output, r.output
    data["supervision"] = {"liveness": {"failures": 0}}
    r = CliRunner().invoke(main, ["--config", str(write_dict(tmp_path, data)), "liveness"])
    assert r.exit_code == 3 and "supervision.liveness.failures" in r.output, r.output


# ------------------------------------------------------------------------------------------------ drain

def test_connections_are_counted_from_proc_without_our_own(box: Box, client: Any) -> None:
    box.installed(F)
    port = box.cfg.backend_port
    assert drain.in_flight(box.cfg) == 0
    box.serves()  # this process's own request: not counted (nor left behind)
    c = client()
    assert drain.in_flight(box.cfg) == 1
    c.close()
    assert procfs.connections_in(port) == 0


def test_switch_waits_for_the_request_in_flight(box: Box, client: Any) -> None:
    """A client connected when the switch begins: the current backend is stopped only once it has gone (at 5 s
    virtual), and the drain is in the history entry."""
    box.installed(F)
    c = client()
    box.world.at(5.0, c.close)
    t0 = box.world.now
    out = box.run("switch", L)
    assert out.action == "switched", out
    h = box.history()[-1]
    assert h["drain"]["outcome"] == "drained" and h["drain"]["in_flight"] == 1
    assert 5.0 <= h["drain"]["waited_s"] < 5.5
    stop = next(c for c in box.calls("stop") if c.args == (FU,))
    assert stop and box.world.now - t0 >= 5.0
    assert any("1 request(s) in flight" in ln for ln in box.log)


def test_drain_is_bounded_then_the_switch_proceeds(box: Box, client: Any) -> None:
    box.installed(F)
    client()  # never goes away (an idle keep-alive connection looks the same)
    out = box.run("switch", L, drain_s=3.0)
    assert out.action == "switched", out
    d = box.history()[-1]["drain"]
    assert d["outcome"] == "timeout" and d["left"] == 1 and 3.0 <= d["waited_s"] < 3.3
    assert_settled(box)  # the target serves (its unit's readiness wait ends moments after the switch)


def test_no_drain_stops_at_once(box: Box, client: Any) -> None:
    box.installed(F)
    client()
    t0 = box.world.now
    out = box.run("switch", L, drain_s=0.0)
    assert out.action == "switched", out
    assert "drain" not in box.history()[-1]
    assert box.world.now - t0 < 1.0, (box.world.now - t0, box.log)
    # rollback drains too (and, here, nothing is in flight on llamacpp after the client went with ftllm)
    out = box.run("rollback")
    assert out.action == "switched" and box.history()[-1]["drain"]["outcome"] == "idle"


def test_llama_server_slots_end_a_drain_held_by_idle_keepalive() -> None:
    """With connections open but /slots saying no slot processes, twice SLOTS_IDLE_S apart: drained."""
    from deploy_tool import retry

    now = [0.0]
    with retry.test_mode(lambda: now[0], lambda s: now.__setitem__(0, now[0] + s)):
        rep = drain.drain(_cfg_stub(), _backend_stub("llamacpp"), 60.0, count=lambda: 2, slots=lambda: True,
                          sending=lambda: 0)
        assert rep.outcome == "slots-idle" and rep.left == 2 and rep.waited_s == drain.SLOTS_IDLE_S
        now[0] = 0.0  # an answer still on its way to a slow reader: not idle, whatever /slots says
        rep = drain.drain(_cfg_stub(), _backend_stub("llamacpp"), 5.0, count=lambda: 1, slots=lambda: True,
                          sending=lambda: 1)
        assert rep.outcome == "timeout" and rep.waited_s == 5.0
        now[0] = 0.0
        seq = iter([False, False, True, True, True])
        rep = drain.drain(_cfg_stub(), _backend_stub("llamacpp"), 60.0, count=lambda: 1, slots=lambda: next(seq),
                          sending=lambda: 0)
        assert rep.outcome == "slots-idle" and rep.waited_s >= 2 * drain.POLL_S + drain.SLOTS_IDLE_S
        now[0] = 0.0
        rep = drain.drain(_cfg_stub(), _backend_stub("ftllm"), 10.0, count=lambda: 1, slots=lambda: None,
                          sending=lambda: 0)
        assert rep.outcome == "timeout" and rep.waited_s == 10.0


def _cfg_stub() -> Any:
    return None


def _backend_stub(kind: str) -> Any:
    return type("B", (), {"kind": kind, "name": kind, "unit": f"{kind}.service"})()


def test_cli_drain_options(tmp_path: Path) -> None:
    data = example_dict("cpu-demo")
    data["systemd"] = {"systemctl": ["/bin/false"], "journalctl": ["/bin/false"]}
    cfg = write_dict(tmp_path, data)
    r = CliRunner().invoke(main, ["--config", str(cfg), "switch", "llamacpp", "--no-drain", "--drain-timeout", "5"])
    assert r.exit_code == 2 and "contradict" in r.output, r.output
    r = CliRunner().invoke(main, ["--config", str(cfg), "switch", "llamacpp", "--drain-timeout", "-1"])
    assert r.exit_code == 2 and "--drain-timeout" in r.output, r.output


def test_a_hung_servers_backlog_is_not_its_work() -> None:
    """A server that accepts nothing (stopped, hung): the connections the front keeps opening to it wait in its
    listen backlog. They count for a drain (each is a request), not as the server's work for the liveness probe,
    which would otherwise call a hung server busy for as long as clients keep trying; one it accepted counts."""
    import socket
    import subprocess
    import sys

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    port = srv.getsockname()[1]
    # the clients in another process (a connection of this process's own is never counted)
    code = ("import socket, sys, time\n"
            f"cs = [socket.create_connection(('127.0.0.1', {port})) for _ in range(3)]\n"
            "print('up', flush=True); sys.stdin.readline()\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "up"
        assert procfs.connections_in(port) == 3
        assert procfs.connections_in(port, accepted=True) == 0
        a, _ = srv.accept()
        try:
            assert procfs.connections_in(port, accepted=True) == 1 and procfs.connections_in(port) == 3
        finally:
            a.close()
    finally:
        assert p.stdin is not None
        p.stdin.write("\n")
        p.stdin.close()
        p.wait(10)
        srv.close()
