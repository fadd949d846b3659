"""Failover, fast: the guard, the window, the lock, a fallback that fails too, against the fake systemd
(tests.support.fake_systemd: real sockets, fake processes, virtual time; its units' StartLimitBurst= ends a crash
loop in the failed state and notes that systemd would start the OnFailure= unit now, which these tests then run as
that unit does: `deploytool failover --from BACKEND`, through deploy_tool.box.operations).

The real thing (systemd's OnFailure= starting the rendered failover unit, the real backends) is
tests/test_failover_e2e.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from deploy_tool.box import operations, status
from deploy_tool.box.failover import decide, last_gate_passed, stopped_by_a_job
from deploy_tool.box.state import State
from deploy_tool.errors import DeployError, ExitCode
from tests.support import fake_systemd as fs
from tests.test_state_machine import (
    FU,
    LU,
    Box,
    F,
    L,
    Outcome,
    assert_settled,
    changes_within_touches,
    no_real_sleep,
)


@pytest.fixture
def box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Box]:
    monkeypatch.delenv("DEPLOYTOOL_FAULT", raising=False)
    b = Box(tmp_path, monkeypatch)
    slept = no_real_sleep(monkeypatch)
    from deploy_tool.box import failover as failover_mod

    monkeypatch.setattr(failover_mod, "wall", lambda: 1.7e9 + b.world.now)  # the window on the virtual clock
    try:
        with b.world.running():
            yield b
    finally:
        b.world.close()
    assert slept == [], f"slept for real: {slept}"


def failover(box: Box, name: str, *, kill: str | None = None, dry_run: bool = False) -> Outcome:
    """What the failover unit runs: `deploytool failover --from NAME` (a fresh process: a new driver handle)."""
    import os

    if kill:
        os.environ["DEPLOYTOOL_FAULT"] = f"kill:{kill}"
    try:
        res = operations.failover(box.cfg, name, dry_run=dry_run, log=box.log.append, sd=box.world.systemd(),
                                  preflight=box.check)
    except fs.Killed as exc:
        return Outcome("killed", killed=str(exc))
    except DeployError as exc:
        return Outcome("error", error=exc, code=int(exc.exit_code))
    finally:
        os.environ.pop("DEPLOYTOOL_FAULT", None)
    return Outcome(res.action, result=res)


def switched_to_l(box: Box, *then: fs.Behaviour) -> None:
    """ftllm installed, then a committed switch to llama.cpp, whose later starts (restarts) do `then`."""
    box.installed(F)
    box.world.script(LU, fs.OK, *then)
    assert box.run("switch", L).action == "switched"


def crash_loop(box: Box, unit: str) -> float:
    """SIGKILL the unit's server (an out-of-memory crash); its restarts die while loading until the start limit
    ends it. Returns the virtual time it failed for good."""
    n = len(box.world.failed_for_good)
    box.world.systemd().kill(unit, "SIGKILL")
    for _ in range(100):
        if len(box.world.failed_for_good) > n:
            break
        box.world.advance(1.0)
    assert len(box.world.failed_for_good) == n + 1, box.world.units[unit]
    when, failed = box.world.failed_for_good[-1]
    assert failed == unit and box.world.units[unit].active_state == "failed"
    return when


def events(box: Box) -> list[dict]:
    return [h for h in box.history() if h["event"] == "failover"]


# ------------------------------------------------------------------------------------------------ failing over

def test_crash_loop_after_a_committed_switch_fails_over(box: Box) -> None:
    switched_to_l(box, fs.DIES_LOADING)
    failed_at = crash_loop(box, LU)
    # systemd gave up after StartLimitBurst=3 starts (the switch's and two restarts), RestartSec=10 apart
    assert box.world.units[LU].n_restarts == 2
    n_front, n_calls = len(box.front.log), len(box.world.calls)
    out = failover(box, L)
    assert out.action == "failed-over", (out, box.log)
    assert_settled(box)
    # the requests that waited through the crash loop are held from the fallback's start until it passed its gate
    # (they go to it after its smoke test, not into it)
    log = box.front.log[n_front:]
    assert [c for c, _ in log if c != "stats"] == ["hold", "release"], log
    start_at = next(i for i, c in enumerate(box.world.calls) if i >= n_calls and c.method == "start"
                    and c.args[0] == FU)
    assert next(n for c, n in log if c == "hold") <= start_at < next(n for c, n in log if c == "release"), log
    st = box.state()
    assert (st["active_backend"], st["previous_backend"]) == (F, L)
    assert box.world.now - failed_at < 1  # the fallback is ready at once here: nothing but its start and gate
    (e,) = events(box)
    assert (e["result"], e["ok"], e["from_backend"], e["to_backend"]) == ("ok", True, L, F)
    assert e["reason"] == f"failover: {LU} failed for good (signal)"
    assert "out of memory" in e["journal_tail"] and "Start request repeated too quickly" in e["journal_tail"]
    assert st["extra"]["failover"]["result"] == "ok"
    assert status.nothing_serving(box.store.load()) is None


def test_failover_unit_name_is_accepted_too(box: Box) -> None:
    switched_to_l(box, fs.DIES_LOADING)
    crash_loop(box, LU)
    assert failover(box, LU).action == "failed-over"


def test_dry_run_prints_the_plan_and_changes_nothing(box: Box) -> None:
    switched_to_l(box, fs.DIES_LOADING)
    crash_loop(box, LU)
    n = len(box.world.calls)
    out = failover(box, L, dry_run=True)
    assert out.action == "planned"
    names = [s["name"] for s in out.result.steps]
    assert names == ["lock", "guard", "journal-kept", "intent", "preflight", "starting-target", "gate",
                     "committing", "rolling-back"]
    assert not [c for c in box.world.calls[n:] if c.method in ("start", "stop", "enable", "disable")]
    assert events(box) == []
    # once it has run, the plan is the skip
    assert failover(box, L).action == "failed-over"
    out = failover(box, L, dry_run=True)
    assert [s["name"] for s in out.result.steps][-1] == "skip"


# ------------------------------------------------------------------------------------------------ the guard

def test_an_operators_stop_is_not_failed_over(box: Box) -> None:
    """A stop that ends the unit failed (the server SIGKILLed at TimeoutStopSec=, as a hung one is) is still a
    deliberate stop: systemd runs the OnFailure= unit, which changes nothing."""
    box.installed(F)
    box.world.script(LU, fs.HANGS_ON_STOP)
    assert box.run("switch", L).action == "switched"
    box.world.systemd().stop(LU)  # the operator's `systemctl stop`
    assert box.world.units[LU].active_state == "failed" and box.world.units[LU].result == "timeout"
    n = len(box.world.calls)
    out = failover(box, L)
    assert out.action == "skipped", out
    assert "while being stopped" in out.result.message
    assert not [c for c in box.world.calls[n:] if c.method in ("start", "stop", "enable", "disable")]
    (e,) = events(box)
    assert e["result"] == "skipped" and "deliberate stop" in e["reason"]
    assert box.state()["active_backend"] == L and box.world.active() == set()


def test_a_clean_stop_is_not_failed_over(box: Box) -> None:
    switched_to_l(box)
    box.world.systemd().stop(LU)
    out = failover(box, L)
    assert out.action == "skipped" and "not failed" in out.result.message
    assert box.world.active() == set()


def test_only_the_active_backend_is_failed_over(box: Box) -> None:
    switched_to_l(box)
    out = failover(box, F)
    assert out.action == "skipped" and f"{F} is not the active backend ({L} is)" in out.result.message
    assert_settled(box)
    assert box.state()["active_backend"] == L


def test_a_backend_running_again_is_left_alone(box: Box) -> None:
    switched_to_l(box)
    out = failover(box, L)
    # active, or activating while its readiness wait (ExecStartPost) ends after a switch: running again either way
    assert out.action == "skipped" and re.search(r"is (active|activating) again", out.result.message)
    assert_settled(box)


def test_no_fallback_without_a_backend_that_passed_the_gate(box: Box) -> None:
    box.installed(F, fs.OK, fs.DIES_LOADING)
    crash_loop(box, FU)
    out = failover(box, F)
    assert out.action == "skipped" and "no fallback" in out.result.message
    assert box.world.active() == set()


def test_a_running_switch_holds_the_lock_and_the_failover_is_skipped(box: Box) -> None:
    switched_to_l(box, fs.DIES_LOADING)
    crash_loop(box, LU)
    with box.store.lock(what="switch to ftllm-dflash"):
        out = failover(box, L)
    assert out.action == "skipped" and "switch to ftllm-dflash is in progress" in out.result.message
    (e,) = events(box)
    assert e["result"] == "skipped"
    assert box.world.active() == set()


# ------------------------------------------------------------------------------------------------ never a loop

def test_a_failover_of_a_failover_does_not_loop(box: Box) -> None:
    """llama.cpp crash-loops and fails over to ftllm, which then crash-loops too: within the window the second
    failover is skipped, both stay stopped; past the window a failover runs again, once."""
    switched_to_l(box, fs.DIES_LOADING)
    crash_loop(box, LU)
    box.world.script(FU, fs.OK, fs.DIES_LOADING)
    assert failover(box, L).action == "failed-over"
    crash_loop(box, FU)
    n = len(box.world.calls)
    out = failover(box, F)
    assert out.action == "skipped" and "at most one per 3600 s" in out.result.message
    assert not [c for c in box.world.calls[n:] if c.method in ("start", "stop", "enable", "disable")]
    assert box.world.active() == set()
    assert [e["result"] for e in events(box)] == ["ok", "skipped"]
    # the operator brings llama.cpp back by hand, a switch; an hour on it crash-loops: failed over again, once
    box.world.script(LU, fs.OK, fs.DIES_LOADING)
    box.world.script(FU, fs.OK)
    assert box.run("switch", L).action == "switched"
    box.world.advance(3600)
    crash_loop(box, LU)
    assert failover(box, L).action == "failed-over"
    assert [e["result"] for e in events(box)] == ["ok", "skipped", "ok"]
    assert_settled(box)


def test_the_window_is_configurable() -> None:
    import tempfile

    from deploy_tool.box.failover import Failure
    from tests.support.configs import example_dict, load_dict, set_key

    with tempfile.TemporaryDirectory() as d:
        data = example_dict("cpu-demo")
        set_key(data, "supervision.failover.window_s", 60)
        cfg = load_dict(Path(d), data)
    f = Failure(L, LU, "failed", "signal", False, "")
    st = State(active_backend=L, previous_backend=F, extra={"failover": {"epoch": 1000.0, "from": F, "to": L,
                                                                         "result": "ok", "at": "t"}})
    assert decide(cfg, st, f, [], now=1059.0)[0] is None
    assert decide(cfg, st, f, [], now=1061.0)[0] is not None
    assert decide(replace(cfg, supervision=replace(cfg.supervision, failover=replace(
        cfg.supervision.failover, enabled=False))), st, f, [], now=1061.0) == (
        None, "failover is off (supervision.failover.enabled: false)")


@pytest.mark.parametrize("then", ["ok", "never-ready"])
def test_a_failover_changes_only_what_its_plan_says_each_step_touches(box: Box, then: str) -> None:
    """The failover's --dry-run plan names what each step touches; running it changes nothing else (the gate
    enables the fallback and disables the failed backend, a failed fallback's step gives the boot back)."""
    switched_to_l(box, fs.DIES_LOADING)
    box.world.script(FU, fs.BEHAVIOURS[then])
    crash_loop(box, LU)
    plan = failover(box, L, dry_run=True)
    assert plan.action == "planned", plan
    n = len(box.world.calls)
    failover(box, L)
    seen = changes_within_touches(box, plan.result.steps, n)
    assert {"starting-target", "gate"} | ({"rolling-back"} if then != "ok" else set()) <= seen, seen


# ------------------------------------------------------------------------------------------------ the fallback fails

@pytest.mark.parametrize("name", ["never-ready", "dies-while-loading", "wrong-model"])
def test_a_fallback_that_fails_too_leaves_both_stopped(box: Box, name: str) -> None:
    switched_to_l(box, fs.DIES_LOADING)
    box.world.script(FU, fs.BEHAVIOURS[name])
    crash_loop(box, LU)
    out = failover(box, L)
    assert out.code == ExitCode.HEALTH, out
    assert "nothing is serving" in out.error.message and "both stay stopped" in out.error.message
    assert box.world.healthy() == set() and FU not in box.world.active()
    st = box.state()
    assert st["active_backend"] is None and st["operation"] is None
    assert box.world.enabled() == {LU}  # what served last boots again
    (e,) = events(box)
    assert (e["result"], e["ok"], e["outcome"]) == ("failed", False, "failed")
    assert "out of memory" in e["journal_tail"]
    line = status.nothing_serving(box.store.load())
    assert line is not None and line.startswith(f"nothing serving: {L} failed, failover to {F} failed at ")
    # and no failover follows it within the window, whatever fails next
    out = failover(box, F)
    assert out.action == "skipped"


def test_a_drifted_fallback_is_refused_and_nothing_starts(box: Box) -> None:
    switched_to_l(box, fs.DIES_LOADING)
    crash_loop(box, LU)
    box.preflight.verdict[F] = "drift"
    n = len(box.world.calls)
    out = failover(box, L)
    assert out.code == ExitCode.DRIFT, out
    assert "nothing is serving" in out.error.message
    assert not [c for c in box.world.calls[n:] if c.method in ("start", "enable", "disable")]
    assert box.state()["active_backend"] is None
    assert status.nothing_serving(box.store.load()) is not None
    (e,) = events(box)
    assert e["result"] == "failed" and e["outcome"] == "refused"


@pytest.mark.parametrize("point", ["starting-target", "gate", "committing"])
def test_a_killed_failover_is_finished_by_recover(box: Box, point: str) -> None:
    """kill -9 of the failover itself: recover never starts the backend that failed for good; a fallback killed
    while committing is committed once it passes the gate."""
    switched_to_l(box, fs.DIES_LOADING)
    crash_loop(box, LU)
    out = failover(box, L, kill=point)
    assert out.action == "killed"
    assert box.state()["operation"]["kind"] == "failover"
    out = box.run("recover")
    assert out.action == "recovered", out
    assert box.state()["active_backend"] == (F if point == "committing" else None)
    assert LU not in box.world.active()
    assert_settled(box)


# ------------------------------------------------------------------------------------------------ pure parts

def test_a_stop_job_is_told_from_a_crash() -> None:
    crash = ("Dec 01 13:27:40 systemd[1]: x.service: Main process exited, code=killed, status=9/KILL\n"
             "Dec 01 13:27:41 systemd[1]: Stopped llama.cpp server.\n"
             "Dec 01 13:27:41 systemd[1]: Failed to start llama.cpp server.")
    stop = "Dec 01 13:27:46 systemd[1]: Stopping llama.cpp server...\nDec 01 13:27:46 systemd[1]: Stopped x."
    assert not stopped_by_a_job(crash)
    assert stopped_by_a_job(stop)
    assert not stopped_by_a_job("Dec 01 llama-server[42]: Stopping llama.cpp server...")  # the server's own words


def test_the_last_gate_of_a_backend() -> None:
    ok = {"event": "switch", "ok": True, "outcome": "switched", "from_backend": F, "to_backend": L}
    rolled = {"event": "switch", "ok": False, "outcome": "rolled-back", "from_backend": L, "to_backend": F}
    skipped = {"event": "failover", "result": "skipped", "from_backend": L, "to_backend": F}
    assert last_gate_passed([], F) is None
    assert last_gate_passed([{"event": "install", "ok": True, "backend": F}, ok], F) is True
    assert last_gate_passed([ok, rolled], F) is False  # its last switch was rolled back
    assert last_gate_passed([ok, rolled], L) is True  # restored through the gate
    assert last_gate_passed([ok, rolled, skipped], F) is False
    # a switch refused at its preflight (the config edited, drift) ran no gate: it says nothing of the target
    refused = {"event": "switch", "ok": False, "outcome": "refused", "from_backend": L, "to_backend": F}
    assert last_gate_passed([{"event": "install", "ok": True, "backend": F}, refused], F) is True
    assert last_gate_passed([refused], F) is None
    assert last_gate_passed([rolled, refused], F) is False


def test_the_fallbacks_start_limit_is_reset_before_its_start(box: Box) -> None:
    """A fallback started a few times within StartLimitIntervalSec= (switches back and forth, earlier failovers)
    is reset before its start, as a switch resets its target: no refused start setting off its own OnFailure=."""
    switched_to_l(box, fs.DIES_LOADING)
    crash_loop(box, LU)
    n = len(box.world.calls)
    assert failover(box, L).action == "failed-over"
    calls = [(c.method, c.args[:1]) for c in box.world.calls[n:] if c.method in ("reset_failed", "start")]
    assert calls.index(("reset_failed", (FU,))) < calls.index(("start", (FU,)))
    assert box.world.failed_for_good[-1][1] == LU
