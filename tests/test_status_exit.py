"""`deploytool status` exits with the box's state (0 serving, 20 degraded, 21 pending, 22 not serving), fast:
the verdict as a property over every combination of a report's facts, then each situation through the CLI on the
fake systemd (tests.support.fake_systemd: real sockets answering the health check, fake processes). The real
sandbox runs are in tests/test_e2e.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from deploy_tool.box import status as st_mod
from deploy_tool.box import systemd as systemd_mod
from deploy_tool.box.state import Operation, State
from deploy_tool.cli import main
from deploy_tool.errors import ExitCode
from tests.support import fake_systemd as fs
from tests.test_state_machine import FU, LU, Box, F, L, no_real_sleep

SEVERITY = [ExitCode.OK, ExitCode.DEGRADED, ExitCode.PENDING, ExitCode.NOT_SERVING]
UNIT_STATES = [("active", "running"), ("inactive", "dead"), ("failed", "failed"), ("activating", "start"),
               ("deactivating", "stop-sigterm")]


# ------------------------------------------------------------------------------------------- the verdict, pure

@st.composite
def reports(draw: st.DrawFn) -> dict[str, Any]:
    """A status report as collect() builds it, with every fact the verdict reads drawn independently."""
    names = [F, L]
    active = draw(st.sampled_from([None, F, L]))
    units: dict[str, Any] = {}
    for n in names:
        if draw(st.integers(0, 9)) == 0:
            units[n] = {"error": f"cannot show {n}.service"}
        else:
            a, sub = draw(st.sampled_from(UNIT_STATES))
            units[n] = {"active": a, "sub": sub, "result": "success", "enabled": "enabled", "main_pid": 1,
                        "restarts": 0}
    fps = {}
    for n in names:
        kind = draw(st.sampled_from(["ok", "ok", "drift", "error"]))
        fps[n] = ({"ok": True, "drift": []} if kind == "ok" else
                  {"ok": False, "drift": [{"label": "env file"}]} if kind == "drift" else
                  {"ok": False, "error": "no pins"})
    op = draw(st.sampled_from([None, {"kind": "switch", "step": "gate", "from_backend": F, "to_backend": L,
                                      "pid": 1}]))
    rep: dict[str, Any] = {"active_backend": active, "units": units, "fingerprints": fps,
                           "health": {"ok": draw(st.booleans()), "detail": "probe"},
                           "interrupted": op, "operation_running": draw(st.booleans()) if op else False}
    if draw(st.integers(0, 9)) == 0:
        rep["systemd_error"] = "systemctl not found"
    if draw(st.booleans()):
        rep["runtime"] = {"failures": draw(st.sampled_from([[], ["library libggml.so: not pinned"]]))}
    if draw(st.integers(0, 4)) == 0:  # StrictModes: a path a root step reads is not root's alone
        rep["unsafe_paths"] = [{"path": "/etc/deploytool/env", "what": "env dir", "uid": 0, "gid": 0, "mode": "0775",
                                "problems": ["writable by group"], "fix": "chmod go-w /etc/deploytool/env"}]
    return rep


def _serving(rep: dict[str, Any]) -> bool:
    a = rep["active_backend"]
    u = rep["units"].get(a, {}) if a else {}
    return bool(a) and rep["health"]["ok"] and ("error" in u or u.get("active") == "active")


@given(reports())
def test_every_report_gets_the_code_of_its_worst_situation(rep: dict[str, Any]) -> None:
    """22 exactly when the active backend does not serve; else 21 exactly when an operation was interrupted (not
    one running now); else 20 exactly when something is off; 0 only for a box serving as recorded. A reason is
    given for every non-zero code, none for 0."""
    code, reasons = st_mod.verdict(rep)
    interrupted = rep["interrupted"] is not None and not rep["operation_running"]
    off = (any(not fp["ok"] for fp in rep["fingerprints"].values()) or "systemd_error" in rep
           or any("error" in u or (n != rep["active_backend"] and u["active"] == "failed")
                  for n, u in rep["units"].items())
           or bool((rep.get("runtime") or {}).get("failures")) or bool(rep.get("unsafe_paths")))
    if not _serving(rep):
        assert code == ExitCode.NOT_SERVING
    elif interrupted:
        assert code == ExitCode.PENDING
    elif off:
        assert code == ExitCode.DEGRADED
    else:
        assert code == ExitCode.OK
    assert bool(reasons) == (code != ExitCode.OK)


@given(reports(), st.sampled_from(["stop", "unhealthy", "drift", "interrupt", "fail-other", "systemd", "unsafe"]))
def test_a_new_fault_never_makes_the_code_better(rep: dict[str, Any], fault: str) -> None:
    """Adding any fault to any report gives a code at least as severe (0 < 20 < 21 < 22), and never 0."""
    before, _ = st_mod.verdict(rep)
    worse = json.loads(json.dumps(rep))
    active = worse["active_backend"]
    if fault == "stop" and active:
        worse["units"][active] = {"active": "inactive", "sub": "dead", "result": "success"}
    elif fault == "unhealthy":
        worse["health"] = {"ok": False, "detail": "connection refused"}
    elif fault == "drift":
        worse["fingerprints"][F] = {"ok": False, "drift": [{"label": "unit file"}]}
    elif fault == "interrupt":
        worse["interrupted"] = {"kind": "rollback", "step": "intent", "pid": 2}
        worse["operation_running"] = False
    elif fault == "fail-other":
        other = L if active == F else F
        worse["units"][other] = {"active": "failed", "sub": "failed", "result": "exit-code"}
    elif fault == "unsafe":
        worse["unsafe_paths"] = [{"path": "/x", "what": "keys dir", "uid": 1000, "gid": 0, "mode": "0755",
                                  "problems": ["owned by uid 1000, not root"], "fix": "chown root /x"}]
    else:
        worse["systemd_error"] = "systemctl not found"
    after, _ = st_mod.verdict(worse)
    assert SEVERITY.index(after) >= SEVERITY.index(before)
    assert after != ExitCode.OK


# ------------------------------------------------------------------------------- each situation, through the CLI

@pytest.fixture
def box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Box]:
    b = Box(tmp_path, monkeypatch)
    no_real_sleep(monkeypatch)
    monkeypatch.setattr(systemd_mod, "for_config", lambda cfg: b.world.systemd())
    try:
        with b.world.running():
            yield b
    finally:
        b.world.close()


def status(box: Box, *args: str) -> tuple[int, dict[str, Any], str]:
    """`deploytool status` (JSON and text) as the CLI runs it: (exit code, report, text)."""
    cfg = box.cfg.source_path
    js = CliRunner().invoke(main, ["--config", cfg, "--json", "status", *args])
    text = CliRunner().invoke(main, ["--config", cfg, "status", *args])
    assert js.exception is None or isinstance(js.exception, SystemExit), js.output
    assert js.exit_code == text.exit_code, (js.output, text.output)
    rep = json.loads(js.output)
    assert rep["verdict"]["exit_code"] == js.exit_code
    assert text.output.startswith(f"verdict   {rep['verdict']['state'].upper()} (exit {js.exit_code})")
    return js.exit_code, rep, text.output


def test_a_box_serving_as_recorded_exits_0(box: Box) -> None:
    box.installed(F)
    code, rep, text = status(box)
    assert code == 0 and rep["verdict"] == {"exit_code": 0, "state": "serving", "reasons": []}
    assert rep["gpu"]["cpu"] and "runs on the CPU (device: cpu): no GPU" in text  # a CPU box says so


def test_a_box_with_nothing_installed_is_not_serving(box: Box) -> None:
    """Nothing installed: says so, not "drifted from its pins" (nothing was ever pinned), no row called serving,
    and metrics without a false drift."""
    code, rep, text = status(box)
    assert code == ExitCode.NOT_SERVING == 22
    assert rep["installed"] is False and rep["fingerprints"] == {}
    assert rep["verdict"]["reasons"] == ["nothing is installed on this box (deploytool install BUNDLE sets it up)"]
    assert "nothing is installed" in text and "drift" not in text and "\nserving " not in text
    from deploy_tool.box import metrics

    prom = metrics.collect_text(box.cfg, sd=box.world.systemd())[0]
    assert "deploytool_drift{" not in prom and "deploytool_status_code 22" in prom


def test_a_stopped_backend_is_not_serving(box: Box) -> None:
    box.installed(F)
    box.world.systemd().stop(FU)
    code, rep, _ = status(box)
    assert code == 22
    assert rep["verdict"]["reasons"][0] == f"{F} is inactive/dead"


def test_a_backend_that_does_not_answer_is_not_serving(box: Box) -> None:
    """The server never gets ready (its unit never leaves activating: the readiness wait, then the restarts its
    start timeout brings): not serving, and the health check says so."""
    box.installed(F, fs.NEVER_READY)
    code, rep, _ = status(box)
    assert rep["units"][F]["active"] == "activating"
    assert code == 22 and any(r.startswith(f"{F} fails its health check") for r in rep["verdict"]["reasons"])


def test_drift_on_any_backend_is_degraded(box: Box) -> None:
    box.installed(F)
    box.preflight.verdict[L] = "drift"
    code, rep, _ = status(box)
    assert code == ExitCode.DEGRADED == 20
    assert rep["verdict"]["reasons"] == [f"{L} drifted from its pins: env file"]


def test_a_path_that_is_not_roots_alone_is_degraded(box: Box) -> None:
    """StrictModes through the CLI: the state directory made world-writable while ftllm-dflash serves: exit 20,
    the reason naming the path and its fix, the text an `unsafe` line with owner and mode."""
    import os

    box.installed(F)
    state = Path(box.cfg.paths.state_dir)
    os.chmod(state, 0o777)
    try:
        code, rep, text = status(box)
    finally:
        os.chmod(state, 0o755)
    assert code == ExitCode.DEGRADED
    assert rep["verdict"]["reasons"] == [f"{state} is not root's alone (writable by group and others), so no backend "
                                         f"may start: chmod go-w {state}"]
    assert f"unsafe    {state} (state dir): owner 0:0, mode 0777" in text
    assert status(box)[0] == 0


def test_a_failed_fallback_is_degraded(box: Box) -> None:
    """The other backend's unit failed (it hit its start limit, as the old backend does after a failover): it
    could not take over."""
    box.installed(F)
    box.world._set(box.world.units[LU], "failed", "failed", result="start-limit-hit")
    code, rep, _ = status(box)
    assert rep["units"][L]["active"] == "failed", rep["units"]
    assert code == 20 and rep["verdict"]["reasons"][0].startswith(f"{L} is failed")


def test_an_interrupted_operation_is_pending_while_serving(box: Box) -> None:
    """A switch killed at its gate left its intent in state.json; the target serves: exit 21 until recover."""
    box.installed(F)
    op = Operation(kind="switch", op_id="x", started="2026-12-01T00:00:00Z", step="gate", from_backend=L,
                   to_backend=F, pid=999_999_999)
    box.store.save(State(active_backend=F, release="r1", operation=op))
    code, rep, text = status(box)
    assert code == ExitCode.PENDING == 21
    assert "awaits `deploytool recover`" in rep["verdict"]["reasons"][0] and "INTERRUPTED" in text
    box.run("recover")
    assert status(box)[0] == 0


def test_a_running_operation_is_not_pending(box: Box) -> None:
    """An operation whose deploytool still holds the lock is in progress, not interrupted: no 21 for it."""
    from tests.test_state_lock import holding

    box.installed(F)
    op = Operation(kind="switch", op_id="x", started="2026-12-01T00:00:00Z", step="gate", from_backend=L,
                   to_backend=F, pid=1)
    box.store.save(State(active_backend=F, release="r1", operation=op))
    with holding(Path(box.cfg.paths.state_dir), "switch"):
        code, rep, text = status(box)
    assert rep["operation_running"] is True and "IN PROGRESS" in text
    assert code == 0
    # named first among the reasons, so a not-serving verdict during a switch says why
    assert rep["verdict"]["reasons"][0].startswith("a switch is in progress (step gate"), rep["verdict"]
    # and the address clients use comes first, the backend's own behind it
    assert f"at {rep['public_endpoint']} (backend {rep['endpoint']})" in text and \
        rep["public_endpoint"] != rep["endpoint"]


def test_not_serving_wins_over_pending_and_degraded(box: Box) -> None:
    box.installed(F)
    box.preflight.verdict[L] = "drift"
    op = Operation(kind="switch", op_id="x", started="2026-12-01T00:00:00Z", step="stopping-current",
                   from_backend=F, to_backend=L, pid=999_999_999)
    box.store.save(State(active_backend=F, release="r1", operation=op))
    box.world.systemd().stop(FU)
    code, rep, _ = status(box)
    assert code == 22
    reasons = rep["verdict"]["reasons"]
    assert reasons[0] == f"{F} is inactive/dead" and "health check" in reasons[1]  # worst first
    assert "recover" in reasons[2] and "drifted" in reasons[3] and len(reasons) == 4


def test_status_help_documents_the_codes() -> None:
    out = CliRunner().invoke(main, ["status", "--help"]).output
    for code, word in ((0, "serving as recorded"), (20, "degraded"), (21, "pending"), (22, "not serving")):
        assert f"{code}  " in out and word in out, out
    assert "20 degraded" in CliRunner().invoke(main, ["--help"]).output


def test_thousands_of_drifted_files_are_counted_not_listed() -> None:
    """A release half laid down drifts in thousands of files: the verdict names the first few and counts the rest
    (it was 126 KB of paths), the JSON's fingerprints keep them all."""
    from deploy_tool.box import status as st_mod

    rows = [{"label": f"release/tool/venv/f{i}.pyc"} for i in range(3000)]
    rep = {"installed": True, "active_backend": F, "units": {F: {"active": "active", "sub": "running"}},
           "health": {"ok": True}, "fingerprints": {F: {"ok": False, "drift": rows}}}
    code, reasons = st_mod.verdict(rep)
    assert code == ExitCode.DEGRADED
    (reason,) = [r for r in reasons if "drifted" in r]
    assert "f4.pyc" in reason and "f5.pyc" not in reason and "and 2995 more" in reason and len(reason) < 400
