"""Failover with real parts only: the cpu-demo bundle installed into the sandboxed real systemd (the shared
`installed` box), both real CPU backends, the rendered units' Restart=/StartLimitBurst=/OnFailure= and the rendered
`deploytool-failover@.service` started by systemd itself. A crash loop is made the way a box meets one: the
server's main process is SIGKILLed (as the out-of-memory killer does) each time systemd has restarted it, until
systemd gives up (3 starts in 30 minutes, RestartSec=10 apart).

The bound stated and measured: from the moment systemd gives up on the active backend (the unit's
InactiveEnterTimestampMonotonic) to the fallback answering a chat completion on the port, at most
FAILOVER_BOUND_S. The goal is the fallback's own time to ready + 1 s (bench/bench_failover.py measures the two
side by side); the bound here leaves room for a shared 2-core machine under load (measured at load 8-11: 5-11 s,
ftllm alone taking 3-4 s to ready), and still fails a failover that waits out a timeout or a RestartSec=.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from tests.support.clients import client_loop
from tests.support.demo_box import METRICS_FILE
from tests.support.e2e import dt
from tests.test_metrics import parse, value

pytestmark = [pytest.mark.sandbox, pytest.mark.backends, pytest.mark.slow, pytest.mark.e2e]

F, L = "ftllm-dflash", "llamacpp-tensor"
FU, LU = f"{F}.service", f"{L}.service"
FAILOVER_BOUND_S = 20.0


def state(cfg: Path) -> dict:
    return json.loads((cfg.parent / "demo-root/var/lib/deploytool/state.json").read_text())


def history(cfg: Path) -> list[dict]:
    p = cfg.parent / "demo-root/var/lib/deploytool/history.jsonl"
    return [json.loads(ln) for ln in p.read_text().splitlines()]


def failovers(cfg: Path, source: str | None = None) -> list[dict]:
    """The failover events, all or those of one failed backend (a fallback stopped while a failover is rolled back
    can start its own failover unit, which finds the lock held and records a skip)."""
    return [e for e in history(cfg) if e["event"] == "failover" and source in (None, e["from_backend"])]


def forget_last_failover(cfg: Path) -> None:
    """Stand in for the failover window passing (an hour by default): drop the last attempt from state.json."""
    p = cfg.parent / "demo-root/var/lib/deploytool/state.json"
    st = json.loads(p.read_text())
    st.setdefault("extra", {}).pop("failover", None)
    p.write_text(json.dumps(st, indent=2, sort_keys=True) + "\n")


def serves(cfg: Path) -> bool:
    import urllib.request

    import yaml

    port = yaml.safe_load(cfg.read_text())["serve"]["port"]
    body = json.dumps({"model": "qwen38-27b-ud", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 2, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return bool(json.loads(resp.read())["choices"][0]["message"]["content"])
    except (OSError, ValueError, KeyError, IndexError):
        return False


def active_units(env) -> set[str]:
    return {u for u in (FU, LU) if env.systemd.show(u).active_state in ("active", "activating")}


def prop(env, unit: str, name: str) -> str:
    return env.run("systemctl", "show", "-p", name, "--value", unit).stdout.strip()


def crash_loop(env, unit: str, timeout: float = 150) -> float:
    """SIGKILL `unit`'s server each time systemd has (re)started it, until systemd gives up on it; the
    CLOCK_MONOTONIC time it did (seconds; the sandbox shares the clock)."""
    deadline = time.monotonic() + timeout
    last_pid = 0
    while time.monotonic() < deadline:
        st = env.systemd.show(unit)
        if st.active_state == "failed":
            return int(prop(env, unit, "InactiveEnterTimestampMonotonic")) / 1e6
        if st.active_state == "active" and st.main_pid and st.main_pid != last_pid:
            env.systemd.kill(unit, "SIGKILL", who="main")
            last_pid = st.main_pid
        time.sleep(0.1)  # each look is a systemctl process: faster polling only burns the CPU the servers need
    raise AssertionError(f"{unit} never failed for good: {env.systemd.show(unit)}")


def wait_for(pred, timeout: float, what: str) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return time.monotonic()
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def failover_unit_journal(env, backend: str) -> str:
    return env.run("journalctl", "--no-pager", "-u", f"deploytool-failover@{backend}.service", ok=(0, 1)).stdout


@pytest.fixture(autouse=True)
def _ftllm_serving(installed, systemd_sandbox):
    """Each test starts from ftllm-dflash serving, with no failover in the window; and leaves it so."""
    cfg, env = installed, systemd_sandbox

    def settle() -> None:
        env.systemd.reset_failed()
        if state(cfg).get("operation"):
            dt(cfg, "recover")
        forget_last_failover(cfg)
        if active_units(env) != {FU} or state(cfg)["active_backend"] != F:
            r = dt(cfg, "switch", "ftllm")
            assert r.returncode == 0, r.stdout + r.stderr

    settle()
    yield
    settle()


def _dropin(env, cfg: Path, unit: str, text: str) -> Path:
    """A drop-in is drift: it is added and then pinned on purpose, as a person would (deploytool pin)."""
    d = env.unit_dir / f"{unit}.d"
    d.mkdir(exist_ok=True)
    (d / "50-test.conf").write_text(text)
    env.systemd.daemon_reload()
    r = dt(cfg, "pin", unit.removesuffix(".service"), "--reason", "test: inject a fault")
    assert r.returncode == 0, r.stdout + r.stderr
    return d


def _clear_dropin(env, cfg: Path, d: Path) -> None:
    shutil.rmtree(d, ignore_errors=True)
    env.systemd.daemon_reload()
    r = dt(cfg, "pin", d.name.removesuffix(".service.d"), "--reason", "test: fault removed")
    assert r.returncode == 0, r.stdout + r.stderr


def test_units_carry_the_failover(installed, systemd_sandbox):
    env = systemd_sandbox
    for u in (FU, LU):
        assert prop(env, u, "OnFailure") == f"deploytool-failover@{u.removesuffix('.service')}.service"
        assert prop(env, u, "StartLimitBurst") == "3"
    assert (env.unit_dir / "deploytool-failover@.service").is_file()


def test_crash_loop_after_a_committed_switch_fails_over(installed, systemd_sandbox):
    cfg, env = installed, systemd_sandbox
    r = dt(cfg, "switch", "llamacpp")
    assert r.returncode == 0, r.stdout + r.stderr
    n, n_all = len(failovers(cfg, L)), len(failovers(cfg))
    # a client of the public port all along: its requests wait at the front through the crash loop and the
    # failover, and every one is answered (tests/test_held_port_e2e.py has the switches and a single crash)
    with client_loop(cfg, models_every=0.25, chat_every=1.0) as loop:
        failed_at = crash_loop(env, LU)
        serving_at = wait_for(lambda: serves(cfg), 120, "ftllm serving after the failover")
    took = serving_at - failed_at
    print(f"failover: {took:.2f} s from {L} failing for good to {F} answering; clients: {loop.summary()}")
    assert not loop.failed and len(loop.seen) > 20, loop.summary()
    assert took < FAILOVER_BOUND_S, took
    wait_for(lambda: len(failovers(cfg, L)) > n, 30, "the failover event")
    e = failovers(cfg, L)[-1]
    # on a failure, its error line first (the event's repr cuts it short) and its outcome
    assert (e["result"], e["from_backend"], e["to_backend"]) == ("ok", L, F), \
        (e.get("error"), e.get("outcome"), e.get("reason"))
    assert len(failovers(cfg)) == n_all + 1  # no other failover unit ran (the fallback was never refused)
    assert e["reason"].startswith(f"failover: {LU} failed for good")
    assert "Start request repeated too quickly" in e["journal_tail"], e["journal_tail"]
    assert e["clients"]["failed"] == 0, e["clients"]  # what the clients saw while it ran, counted by the front
    st = state(cfg)
    assert (st["active_backend"], st["previous_backend"], st["operation"]) == (F, L, None)
    assert active_units(env) == {FU}
    assert env.systemd.is_enabled(FU) == "enabled" and env.systemd.is_enabled(LU) == "disabled"
    # the unit's last line follows the history event (the metrics are rewritten in between)
    wait_for(lambda: "failed over to ftllm-dflash" in failover_unit_journal(env, L), 30, "the failover's last line")
    # ... by the failover unit itself, in node_exporter's directory outside the state dir (its sandbox lets it)
    assert "metrics:" not in failover_unit_journal(env, L), failover_unit_journal(env, L)[-2000:]
    fams = parse((cfg.parent / METRICS_FILE).read_text())
    assert value(fams, "active_backend", backend=F) == 1 and value(fams, "active_backend", backend=L) == 0
    assert value(fams, "failovers_total") == sum(1 for e in failovers(cfg) if e.get("ok") is True)


def test_an_operators_stop_is_not_failed_over(installed, systemd_sandbox):
    """`systemctl stop` of the active backend: a clean stop starts no failover unit at all; a stop that ends the
    unit failed (the server ignores the stop signal and is SIGKILLed at TimeoutStopSec=) starts it, and it
    records the stop as deliberate and starts nothing."""
    cfg, env = installed, systemd_sandbox
    r = dt(cfg, "switch", "llamacpp")
    assert r.returncode == 0, r.stdout + r.stderr
    n = len(failovers(cfg))
    env.systemd.stop(LU)
    time.sleep(2)
    assert env.systemd.show(LU).active_state == "inactive"
    assert len(failovers(cfg)) == n and active_units(env) == set()
    r = dt(cfg, "switch", "llamacpp")
    assert r.returncode == 0, r.stdout + r.stderr
    # llama-server takes no action on SIGWINCH: the stop runs into TimeoutStopSec= and ends in SIGKILL, failed
    d = _dropin(env, cfg, LU, "[Service]\nKillSignal=SIGWINCH\nTimeoutStopSec=2\n")
    try:
        r = dt(cfg, "switch", "llamacpp")  # pinned with the drop-in: it runs under it
        assert r.returncode == 0, r.stdout + r.stderr
        env.systemd.stop(LU)
        assert env.systemd.show(LU).result == "timeout"
        wait_for(lambda: len(failovers(cfg)) > n, 30, "the failover unit's verdict")
        e = failovers(cfg)[-1]
        assert (e["result"], e["from_backend"]) == ("skipped", L), e
        assert "deliberate stop" in e["reason"]
        time.sleep(1)
        assert active_units(env) == set() and state(cfg)["active_backend"] == L
    finally:
        _clear_dropin(env, cfg, d)


def test_a_failover_of_a_failover_does_not_loop(installed, systemd_sandbox):
    """llama.cpp crash-loops: failed over to ftllm; ftllm crash-loops too, within the window: not failed over
    again, both stay stopped, the reason in history."""
    cfg, env = installed, systemd_sandbox
    r = dt(cfg, "switch", "llamacpp")
    assert r.returncode == 0, r.stdout + r.stderr
    n = len(failovers(cfg))
    crash_loop(env, LU)
    wait_for(lambda: serves(cfg) and len(failovers(cfg)) > n, 120, "the first failover")
    assert failovers(cfg)[-1]["result"] == "ok"
    crash_loop(env, FU)
    wait_for(lambda: len(failovers(cfg)) > n + 1, 60, "the second failover unit's verdict")
    e = failovers(cfg)[-1]
    assert (e["result"], e["from_backend"]) == ("skipped", F), e
    assert "at most one per 3600 s" in e["reason"]
    time.sleep(2)
    assert active_units(env) == set() and not serves(cfg)
    assert len(failovers(cfg)) == n + 2


def test_a_fallback_that_fails_too_leaves_both_stopped_and_status_says_so(installed, systemd_sandbox):
    cfg, env = installed, systemd_sandbox
    r = dt(cfg, "switch", "llamacpp")
    assert r.returncode == 0, r.stdout + r.stderr
    d = _dropin(env, cfg, FU, '[Service]\nExecStart=\nExecStart=/bin/sh -c "echo simulated CUDA error >&2; exit 3"\n')
    try:
        n = len(failovers(cfg, L))
        crash_loop(env, LU)
        wait_for(lambda: len(failovers(cfg, L)) > n, 120, "the failover's verdict")
        e = failovers(cfg, L)[-1]
        assert (e["result"], e["from_backend"], e["to_backend"]) == ("failed", L, F), e
        assert "simulated CUDA error" in e.get("fallback_journal_tail", ""), e
        assert active_units(env) == set() and state(cfg)["active_backend"] is None
        r = dt(cfg, "status")
        assert f"nothing serving: {L} failed, failover to {F} failed at " in r.stdout, r.stdout
    finally:
        _clear_dropin(env, cfg, d)
