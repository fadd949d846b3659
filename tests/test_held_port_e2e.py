"""The held port, seen from a client of it: the shared installed cpu-demo box (real systemd, both real CPU
backends, the rendered deploytool-front.socket and .service) with a client loop running through each operation.

The client is an application with a sane timeout, as in the issue that asked for the front: GET /v1/models every
50 ms and a 4-token chat completion every 0.5 s. Before the front, a switch to llama.cpp failed 7 of 58 of these
requests and a crash of the active server 261 of 284, all as refused connections. Now every request must be
answered 200, however long it waited (at most the hold bound), through a switch, a switch back, a switch whose
target crashes at start (rolled back) and a crash of the active server (restarted by Restart=on-failure); and the
operation's history event counts what the clients saw.
"""

from __future__ import annotations

import contextlib
import time

import pytest

from deploy_tool.errors import SystemdError
from tests.support.clients import ClientLoop, client_loop
from tests.support.demo_box import Box
from tests.support.e2e import dt
from tests.test_e2e import _clear_dropin, _dropin, active_units, history, state

pytestmark = [pytest.mark.sandbox, pytest.mark.backends, pytest.mark.slow, pytest.mark.e2e]

FU, LU = "ftllm-dflash.service", "llamacpp-tensor.service"


def _clients_counted(event: dict, loop: ClientLoop) -> None:
    """The operation's history event says what its clients saw: none failed, and no more waited than asked."""
    c = event.get("clients")
    assert c is not None, event
    assert c["failed"] == 0 and 0 <= c["waited"] <= c["requests"] <= len(loop.seen) + 5, (c, loop.summary())


@pytest.fixture(autouse=True)
def _ftllm_serving(installed):
    if state(installed).get("operation"):
        dt(installed, "recover")
    if state(installed)["active_backend"] != "ftllm-dflash":
        r = dt(installed, "switch", "ftllm")
        assert r.returncode == 0, r.stdout + r.stderr


def test_clients_see_no_switch_and_no_switch_back(installed, systemd_sandbox) -> None:
    for target, unit in (("llamacpp", LU), ("ftllm", FU)):
        with client_loop(installed) as loop:
            r = dt(installed, "switch", target)
        assert r.returncode == 0, r.stdout + r.stderr
        assert active_units(systemd_sandbox) == {unit}
        print(f"switch {target}: {loop.summary()}")
        assert not loop.failed, loop.summary()
        assert len(loop.seen) > 20, loop.summary()  # the loop ran through the whole switch
        _clients_counted(history(installed)[-1], loop)


def test_clients_see_no_rolled_back_switch(installed, systemd_sandbox) -> None:
    d = _dropin(systemd_sandbox, LU, '[Service]\nExecStart=\nExecStart=/bin/sh -c "echo simulated CUDA crash >&2; '
                                     'exit 3"\n', installed)
    try:
        with client_loop(installed) as loop:
            r = dt(installed, "switch", "llamacpp")
        assert r.returncode == 10, r.stdout + r.stderr
        assert active_units(systemd_sandbox) == {FU}
        print(f"rolled-back switch: {loop.summary()}")
        assert not loop.failed, loop.summary()
        last = history(installed)[-1]
        assert last["outcome"] == "rolled-back", last
        _clients_counted(last, loop)
    finally:
        _clear_dropin(systemd_sandbox, d, installed)


def test_clients_see_no_crash_of_the_active_server(installed, systemd_sandbox) -> None:
    """SIGKILL of ftllm's server (as the out-of-memory killer does): Restart=on-failure starts it again while the
    clients' requests wait at the front; some of them waited for it, none failed."""
    sd = systemd_sandbox.systemd
    before = sd.show(FU).invocation_id
    with client_loop(installed) as loop:
        sd.kill(FU, "SIGKILL", who="main")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            st = sd.show(FU)
            if st.invocation_id != before and (st.active_state, st.sub_state) == ("active", "running"):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"{FU} was not restarted: {sd.show(FU)}")
        time.sleep(2.0)  # the restarted server answers the held requests
    print(f"crash of the active server: {loop.summary()}")
    assert not loop.failed, loop.summary()
    assert max(s.seconds for s in loop.seen) > 0.3, loop.summary()  # the crash was felt as a wait, not an error


FRONT = "deploytool-front.service"


def test_a_changed_front_program_does_not_start(installed, systemd_sandbox) -> None:
    """The front checks its own program before it starts (ExecStartPre=+deploytool verify-front): with the release's
    launch/front.py changed, a restart of the front fails in that step, its journal names the file, and not one
    line of the changed program runs; restored, the front starts again and clients are served through it."""
    sd = systemd_sandbox.systemd
    prog = Box(installed).current / "launch" / "front.py"
    original = prog.read_bytes()
    try:
        prog.write_bytes(original + b"\nprint('changed front ran', flush=True)\n")
        before = sd.show(FRONT).invocation_id
        with contextlib.suppress(SystemdError):  # the restart job fails: that is the point
            sd.restart(FRONT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            st = sd.show(FRONT)
            if st.invocation_id != before and st.result == "exit-code" and not st.is_active:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"{FRONT} was not refused: {sd.show(FRONT)}")
        log = sd.journal(FRONT, lines=80)
        assert "launch/front.py" in log and "DRIFT" in log, log
        assert "changed front ran" not in log, log
    finally:
        prog.write_bytes(original)
        sd.reset_failed(FRONT)
        sd.restart(FRONT, past_start_limit=True)
    assert sd.is_active(FRONT), sd.show(FRONT)
    with client_loop(installed) as loop:
        time.sleep(2.0)
    assert loop.seen and not loop.failed, loop.summary()
