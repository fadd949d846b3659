"""Liveness and drain with real parts: the cpu-demo bundle installed into the sandboxed real systemd (the
session's `installed` box), both real CPU backends, the CLI as a user runs it, and the liveness probe's unit
as install arms it.

* a stream in flight when `switch` begins completes (every token, [DONE]), and only then is its backend stopped
  (the manager's own "Stopping" line comes after the stream's end); from ftllm and from llama-server;
* `--no-drain` cuts it, as before;
* a SIGSTOPped server (systemd keeps saying "active/running") is killed by the installed liveness probe after
  three failures in a row and restarted by Restart=on-failure; then it serves again;
* when restarts do not help (restarts: 0 here), the probe gives up: the unit is left failed (Result=signal), the
  state OnFailure= reacts to, and restarting is not switched off for good.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.clients import client_loop
from tests.support.e2e import dt
from tests.test_e2e import _manager_stamps, chat, history, state

pytestmark = [pytest.mark.sandbox, pytest.mark.backends, pytest.mark.slow, pytest.mark.e2e]

FU, LU = "ftllm-dflash.service", "llamacpp-tensor.service"
PROBE = "deploytool-liveness.service"
MODEL = "qwen38-27b-ud"
# streams of several seconds on this machine's CPU with the tiny model (measured: ftllm 400 tokens 2.2 s and 1500
# tokens 30 s; llama-server 1900 tokens with 100 candidate probabilities each 4.2 s, ~5 KB a chunk: read 10 ms
# apart, ~19 s, most of it with the answer generated and on its way to this slow reader). ftllm: long enough to
# outlast the switch's own start (CLI, lock, preflight) on a loaded machine: 700 tokens once ended before the drain)
STREAM = {"ftllm": {"max_tokens": 1100}, "llamacpp": {"max_tokens": 1900, "n_probs": 100}}
# a slow reader keeps each stream open well past the switch's own start (CLI, lock, preflight: ~2 s here), however
# fast the server generates: an ftllm stream read at full speed had ended before the drain looked
READ_DELAY = {"ftllm": 0.01, "llamacpp": 0.01}


def port_of(cfg: Path) -> int:
    return int(yaml.safe_load(cfg.read_text())["serve"]["port"])


class Stream(threading.Thread):
    """One streaming chat completion read to its end on a thread; `first` is set at its first chunk."""

    def __init__(self, port: int, read_delay: float = 0.0, **extra: Any) -> None:
        super().__init__(daemon=True)
        self.port, self.extra, self.read_delay = port, extra, read_delay
        self.first = threading.Event()
        self.chunks, self.done, self.finish, self.error = 0, False, None, ""
        self.ended = 0.0

    def run(self) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count from one to one thousand."}],
                "temperature": 0, "stream": True, "ignore_eos": True, **self.extra}
        try:
            c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
            c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            r = c.getresponse()
            assert r.status == 200, r.status
            for line in r:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    self.done = True
                    break
                self.chunks += 1
                self.first.set()
                if self.read_delay:
                    time.sleep(self.read_delay)
                ch = json.loads(data).get("choices") or [{}]
                self.finish = ch[0].get("finish_reason") or self.finish
        except Exception as exc:  # noqa: BLE001 - a cut stream is an outcome the tests look at
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.ended = time.time()
            self.first.set()


def serving(cfg: Path, env: Any, name: str) -> None:
    """`name` serving (switched to through the CLI when it is not), the liveness probe running."""
    if state(cfg).get("operation"):
        dt(cfg, "recover")
    unit = f"{name}.service"
    st = env.systemd.show(unit)
    if state(cfg)["active_backend"] != name or (st.active_state, st.sub_state) != ("active", "running"):
        r = dt(cfg, "switch", name)
        assert r.returncode == 0, r.stdout + r.stderr
    if not env.systemd.is_active(PROBE):
        env.systemd.start(PROBE)


@pytest.mark.parametrize("frm,to", [
    ("ftllm-dflash", "llamacpp"),
    ("llamacpp-tensor", "ftllm")])
def test_a_stream_in_flight_completes_then_the_switch_proceeds(installed, systemd_sandbox, frm, to):
    env = systemd_sandbox
    serving(installed, env, frm)
    kind = frm.split("-")[0]
    s = Stream(port_of(installed), READ_DELAY[kind], **STREAM[kind])
    since = time.time()
    s.start()
    assert s.first.wait(60) and not s.error, s.error
    r = dt(installed, "switch", to)
    s.join(120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert s.done and s.finish == "length" and not s.error, (s.chunks, s.finish, s.error)
    h = [e for e in history(installed) if e["event"] == "switch"][-1]
    # the stream goes through the front, which reads the backend's answer as it comes: with a slow reader
    # (READ_DELAY) the backend may have sent its last byte, into the front's buffer, before the drain looks, and
    # then finds nothing in flight on its port; the stream completes from the front all the same (asserted above)
    assert h["ok"] and h["drain"]["outcome"] in ("drained", "idle"), h
    if h["drain"]["outcome"] == "drained" or not s.read_delay:
        assert h["drain"]["outcome"] == "drained" and h["drain"]["in_flight"] >= 1, h
        assert h["drain"]["waited_s"] > 0
        assert "request(s) in flight" in r.stderr, r.stderr
    stop = _manager_stamps(env, since)[f"Stopping {frm}.service"] / 1e6
    if not s.read_delay:  # the manager stopped the backend only after the stream's last byte
        assert stop >= s.ended - 0.05, (stop, s.ended)
    # (a slow reader may still be reading what its kernel holds when the server, done sending, is stopped)
    assert chat(installed)["choices"][0]["message"]["content"]


def test_no_drain_cuts_the_stream(installed, systemd_sandbox):
    """llama-server exits on SIGTERM at once, cutting what it still has to send. (ftllm's server finishes its
    requests on SIGTERM by itself, within TimeoutStopSec=, measured here: a --no-drain switch from it waits for
    them in the stop instead.)"""
    env = systemd_sandbox
    serving(installed, env, "llamacpp-tensor")
    # ~19 s for this reader; 400 alternatives a token make the stream (about 54 MB) larger than all the socket
    # buffers between the server and the reader, so the server is still sending when it is stopped, however fast
    # the build generates (one does the 1900 tokens in 2 s, before the switch's stop)
    s = Stream(port_of(installed), READ_DELAY["llamacpp"], **dict(STREAM["llamacpp"], n_probs=400))
    s.start()
    assert s.first.wait(60) and not s.error, s.error
    r = dt(installed, "switch", "ftllm", "--no-drain")
    assert r.returncode == 0, r.stdout + r.stderr
    s.join(60)
    assert not s.done and s.chunks < 1900, "the stream was not cut"
    assert "drain" not in [e for e in history(installed) if e["event"] == "switch"][-1]
    r = dt(installed, "--json", "--dry-run", "switch", "llamacpp")
    assert "draining" in [st["name"] for st in json.loads(r.stdout)["steps"]], r.stdout


def _events(cfg: Path, since: str) -> list[dict[str, Any]]:
    return [e for e in history(cfg) if e["event"] == "liveness" and e["time"] > since]


def _now_iso() -> str:
    from deploy_tool.clock import iso_utc

    return iso_utc(micro=True)


def test_a_stopped_server_is_restarted_by_the_liveness_probe(installed, systemd_sandbox):
    """SIGSTOP ftllm: systemd keeps reporting it active/running while nothing answers. The installed
    probe (every 10 s, 5 s timeout, 3 failures in a row: the defaults) kills it; Restart=on-failure brings it
    back; it serves again. Bound: 3 ticks + 3 timeouts + RestartSec + the load of the tiny model."""
    env = systemd_sandbox
    serving(installed, env, "ftllm-dflash")
    assert env.systemd.is_enabled(PROBE) == "enabled" and env.systemd.is_active(PROBE)
    before = env.systemd.show(FU)
    mark = _now_iso()
    env.systemd.kill(FU, "SIGSTOP", who="main")
    # a client from the moment the server hangs: its requests wait at the front (the stopped server's backlog
    # takes the front's tries and answers none) until the restarted server answers them. Started after the stop:
    # a request the server had accepted just before it counts as its work while the unit's CPU time still grows
    # (the probe's `busy`), which would keep the probe from restarting it (a race this test does not pose)
    loop = client_loop(installed, models_every=0.25, chat_every=1.0).start()
    try:
        t0 = time.monotonic()
        deadline = t0 + 150
        while time.monotonic() < deadline and not any(e["action"] == "restart" for e in _events(installed, mark)):
            st = env.systemd.show(FU)
            if (st.active_state, st.sub_state) != ("active", "running"):
                # the probe records its restart right after its SIGKILL: a look between the two sees the unit
                # restarting first; nothing else may end the stopped server
                assert st.sub_state in ("auto-restart", "stop-sigterm", "stop-sigkill", "start-pre", "start",
                                        "start-post", "running", "dead", "failed"), st
                deadline_ev = time.monotonic() + 10
                while time.monotonic() < deadline_ev and not any(e["action"] == "restart"
                                                                 for e in _events(installed, mark)):
                    time.sleep(0.2)
                break
            time.sleep(1)
        restarted = time.monotonic() - t0
        ev = _events(installed, mark)
        assert [e["action"] for e in ev][-4:] == ["failure", "failure", "failure", "restart"], ev
        assert all(e["backend"] == "ftllm-dflash" for e in ev)
        assert restarted < 60, restarted
        while time.monotonic() < deadline:
            st = env.systemd.show(FU)
            if st.main_pid and st.main_pid != before.main_pid and (st.active_state, st.sub_state) == ("active",
                                                                                                    "running"):
                try:
                    chat(installed)
                    break
                except OSError:
                    pass
            time.sleep(0.5)
        after = env.systemd.show(FU)
        loop.stop()
        print(f"SIGSTOP to the restart: {restarted:.1f} s; to serving again: {time.monotonic() - t0:.1f} s; "
              f"clients: {loop.summary()}")
        # the stopped server took the front's tries into its backlog and never answered them; the kill closed
        # them unanswered, the front tried again, and the restarted server answered every one
        # (each of the loop's two clients waits on its request: a few requests, each held through the hang)
        assert not loop.failed and len(loop.seen) >= 2, loop.summary()
        assert max(x.seconds for x in loop.seen) > 5, loop.summary()  # held through the hang, then answered
        assert after.n_restarts == before.n_restarts + 1 and after.main_pid != before.main_pid
        assert chat(installed)["choices"][0]["message"]["content"]
        assert state(installed)["active_backend"] == "ftllm-dflash"
    finally:
        st = env.systemd.show(FU)
        if st.main_pid == before.main_pid:  # the test failed before the restart: let it run again
            env.systemd.kill(FU, "SIGCONT", who="main")
        loop.stop()


def _failover_in_the_window(cfg: Path) -> None:
    """A failover recorded a moment ago (state.json's extra.failover, which the failover's window counts from)."""
    p = cfg.parent / "demo-root/var/lib/deploytool/state.json"
    st = json.loads(p.read_text())
    st.setdefault("extra", {})["failover"] = {"from": "llamacpp-tensor", "to": "ftllm-dflash", "result": "ok",
                                              "at": _now_iso(), "epoch": time.time()}
    p.write_text(json.dumps(st, indent=2, sort_keys=True) + "\n")


def test_liveness_gives_up_and_leaves_the_unit_failed(installed, systemd_sandbox):
    """restarts: 0 (a config beside the box's, driven from the CLI with the installed probe stopped): the first hang gives
    up: the server killed with restarting off for this once, its unit failed with Result=signal (what OnFailure=
    reacts to), the runtime drop-in gone; a later start restarts on failure again."""
    env = systemd_sandbox
    serving(installed, env, "ftllm-dflash")
    data = yaml.safe_load(installed.read_text())
    data["supervision"] = {"liveness": {"failures": 2, "restarts": 0, "timeout_s": 2}}
    fast = installed.with_name("liveness-fast.yaml")
    fast.write_text(yaml.safe_dump(data, sort_keys=False))
    env.systemd.stop(PROBE)
    _failover_in_the_window(installed)  # the unit's OnFailure= failover then stands aside: this test is the give-up
    mark = _now_iso()
    try:
        r = dt(fast, "--json", "liveness")
        assert r.returncode == 0 and json.loads(r.stdout)["action"] == "ok", r.stdout + r.stderr
        env.systemd.kill(FU, "SIGSTOP", who="main")
        acts = [json.loads(dt(fast, "--json", "liveness").stdout)["action"] for _ in range(2)]
        assert acts == ["failure", "gave-up"], acts
        st = env.systemd.show(FU)
        assert (st.active_state, st.result) == ("failed", "signal"), st
        assert not (env.unit_dir / f"{FU}.d" / "zz-deploytool-liveness-gave-up.conf").exists()
        assert [e["action"] for e in _events(installed, mark)] == ["failure", "failure", "gave-up"]
        time.sleep(12)  # past RestartSec: it stays failed
        assert env.systemd.show(FU).active_state == "failed"
        assert json.loads(dt(fast, "--json", "liveness").stdout)["action"] == "not-running"
        r = dt(installed, "switch", "ftllm")  # recorded active, not running: started again
        assert r.returncode == 0, r.stdout + r.stderr
        env.systemd.kill(FU, "SIGKILL", who="main")  # and a crash is restarted again (no drop-in left)
        time.sleep(1)
        assert env.systemd.show(FU).sub_state == "auto-restart"
    finally:
        fast.unlink(missing_ok=True)
        p = installed.parent / "demo-root/var/lib/deploytool/state.json"
        st = json.loads(p.read_text())
        st.get("extra", {}).pop("failover", None)
        p.write_text(json.dumps(st, indent=2, sort_keys=True) + "\n")
        env.systemd.start(PROBE)
