"""Golden plans: the steps install, switch, rollback and recover build (what --dry-run prints and the run walks),
pinned for the main cases from the two-2080ti example (production paths: the text is the same on any machine).
No systemd: the plans are pure functions of the config, the state and the facts the box reports."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from deploy_tool.box import install, switch
from deploy_tool.box.state import Operation, State, Step, Store
from deploy_tool.cli import main
from deploy_tool.config import Config
from deploy_tool.errors import StateError
from tests.support.configs import example_dict, load_example, write_dict

FT, LL = "ftllm-dflash", "llamacpp-tensor"
STATE = "/var/lib/deploytool/state.json"


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> Config:
    return load_example(tmp_path_factory.mktemp("plans"), "two-2080ti")


def rows(steps: list[Step]) -> list[tuple[str, str]]:
    return [(s.name, s.text()) for s in steps]


def _switch(cfg: Config, st: State, to: str, *, running: bool = False, awaits_port: bool = True,
            action: str = "switch") -> list[Step]:
    target = cfg.backends[to]
    facts = switch.switch_facts(cfg, st, target, target_running=running, awaits_port=awaits_port)
    return switch.switch_plan(cfg, st, target, facts, action=action)


def test_switch_ftllm_to_llamacpp(cfg: Config) -> None:
    st = State(active_backend=FT, release="r1")
    steps = Store(cfg.paths.state_dir).lock_steps(st) + _switch(cfg, st, LL)
    assert rows(steps) == [
        ("lock", "lock /var/lib/deploytool/lock"),
        ("intent", f"record intent: switch {FT} -> {LL}"),
        ("preflight", f"preflight {LL}: config checks, fingerprints (deploytool verify {LL})"),
        ("draining", f"drain {FT}.service: the front holds new requests; wait until no request is in flight on port 8083 (its TCP "
                     "connections), at most 60s"),
        ("stopping-current", f"stop {FT}.service (it serves until here)"),
        ("starting-target", f"start {LL}.service: its ExecStartPre checks the fingerprints while the current "
                            "backend exits, then waits until it is gone and the port is free"),
        ("gate", f"health gate: llamacpp readiness on port 8083, smoke completion as 'qwen38-27b-ud'; meanwhile "
                 f"{LL}.service enabled for boot, the others disabled"),
        ("committing", "commit: write state and history (refused if the enablement failed)"),
        ("rolling-back", f"on failure: stop {LL}.service, start {FT}.service through the same gate, exit 10"),
    ]
    assert steps[6].touches == (f"{LL}.service", f"{FT}.service")  # the gate flips the boot-time enablement
    assert steps[7].touches == (STATE,)
    assert steps[3].touches == ()  # draining changes nothing: the current backend serves on meanwhile
    assert steps[-1].when == "on failure"
    # the journal names are the state machine's steps, in its order
    assert [s.name for s in steps[1:]] == list(switch.STEPS)


def test_switch_to_the_active_backend_is_a_noop(cfg: Config) -> None:
    st = State(active_backend=FT, release="r1")
    assert rows(_switch(cfg, st, FT, running=True)) == [("noop", f"nothing to do: {FT} is already active")]
    # recorded active but its unit stopped: started, with nothing to stop or roll back to
    steps = _switch(cfg, st, FT, running=False)
    assert [s.name for s in steps] == ["intent", "preflight", "starting-target", "gate", "committing",
                                       "rolling-back"]
    assert steps[2].text() == f"start {FT}.service once nothing answers on port 8083"
    assert steps[-1].text() == f"on failure: stop {FT}.service, leave no backend running, exit 9"


def test_switch_drain_bound_and_no_drain(cfg: Config) -> None:
    """--drain-timeout sets the bound the plan shows; --no-drain (0) plans no draining step: stopped at once."""
    st = State(active_backend=FT, release="r1")
    target = cfg.backends[LL]
    facts = switch.switch_facts(cfg, st, target, target_running=False, awaits_port=True)
    steps = switch.switch_plan(cfg, st, target, facts, drain_s=7.5)
    assert steps[2].name == "draining" and steps[2].text().endswith("at most 7.5s")
    steps = switch.switch_plan(cfg, st, target, facts, drain_s=0)
    assert [s.name for s in steps] == ["intent", "preflight", "stopping-current", "starting-target", "gate",
                                       "committing", "rolling-back"]


def test_switch_on_a_box_whose_unit_does_not_wait_for_the_port(cfg: Config) -> None:
    steps = _switch(cfg, State(active_backend=FT), LL, awaits_port=False)
    assert steps[4] == Step("starting-target", f"start {LL}.service once nothing answers on port 8083",
                            (f"{LL}.service",))


def test_rollback(cfg: Config) -> None:
    st = State(active_backend=LL, previous_backend=FT, release="r1")
    to = switch.rollback_target(cfg, st)
    assert to == FT
    assert rows(_switch(cfg, st, to, action="rollback")) == [
        ("intent", f"record intent: rollback {LL} -> {FT}"),
        ("preflight", f"preflight {FT}: config checks, fingerprints (deploytool verify {FT})"),
        ("draining", f"drain {LL}.service: the front holds new requests; wait until no request is in flight on port 8083 (its TCP "
                     "connections), at most 60s"),
        ("stopping-current", f"stop {LL}.service (it serves until here)"),
        ("starting-target", f"start {FT}.service: its ExecStartPre checks the fingerprints while the current "
                            "backend exits, then waits until it is gone and the port is free"),
        ("gate", f"health gate: ftllm readiness on port 8083, smoke completion as 'qwen38-27b-ud'; meanwhile "
                 f"{FT}.service enabled for boot, the others disabled"),
        ("committing", "commit: write state and history (refused if the enablement failed)"),
        ("rolling-back", f"on failure: stop {FT}.service, start {LL}.service through the same gate, exit 10"),
    ]
    # with no previous backend recorded, the only other one
    assert switch.rollback_target(cfg, State(active_backend=LL)) == FT


def test_interrupted_operation_is_finished_first(cfg: Config) -> None:
    op = Operation(kind="switch", op_id="x", started="t", step="gate", from_backend=FT, to_backend=LL)
    steps = Store(cfg.paths.state_dir).lock_steps(State(active_backend=FT, operation=op))
    assert rows(steps)[1] == ("finish-interrupted",
                              "finish the interrupted switch (step gate) first, as `deploytool recover` does")


def _op(step: str, kind: str = "switch") -> Operation:
    return Operation(kind=kind, op_id="x", started="t", step=step, from_backend=FT, to_backend=LL, release="r1")


def test_recover_an_interrupted_switch(cfg: Config) -> None:
    st = State(active_backend=FT, release="r1", operation=_op("gate"))
    assert rows(switch.recover_plan(cfg, st, target_running=True)) == [
        ("stop-target", f"stop {LL}.service"),
        ("restart-previous", f"start {FT}.service through the health gate, enable it for boot (the others "
                             "disabled), write state"),
    ]
    st = replace(st, operation=_op("committing"))
    assert rows(switch.recover_plan(cfg, st, target_running=True)) == [
        ("finish-commit", f"health gate of {LL}; if it passes, commit: enable {LL}.service, disable the others, "
                          "write state"),
        ("stop-target", f"if the gate fails: stop {LL}.service"),
        ("restart-previous", f"if the gate fails: start {FT}.service through the health gate, enable it for boot "
                             "(the others disabled), write state"),
    ]
    # killed while committing with the target not running: straight back
    assert [s.name for s in switch.recover_plan(cfg, st, target_running=False)] == ["stop-target",
                                                                                    "restart-previous"]
    for step in ("intent", "preflight", "draining"):
        st = replace(st, operation=_op(step))
        assert rows(switch.recover_plan(cfg, st, target_running=False)) == [
            ("nothing-changed", f"clear the interrupted switch (step {step}): it had changed nothing")]
    # a fresh box: nothing served before, nothing to go back to
    st = State(operation=replace(_op("starting-target"), from_backend=None))
    assert rows(switch.recover_plan(cfg, st, target_running=False)) == [
        ("stop-target", f"stop {LL}.service"),
        ("leave-stopped", "no backend served before: leave none running")]


BUNDLE, KEYS = "/srv/bundles/box-abc123.tar.zst", "/etc/deploytool/keys"
FRESH_INSTALL = [
    ("verified", f"verify {BUNDLE} against keys in {KEYS}{install.VERIFY_ALSO}"),
    ("venv-ready", "unpack to /opt/deploytool/releases/.staging-abc123, unpack venv (bytecode included), relocate"),
    ("native-libs-checked", "check the OS libraries the native binaries need, check native library hashes"),
    ("tool-ready", "build deploytool's own venv from the bundle's tool wheels"),
    ("release-laid-down", "move it to /opt/deploytool/releases/abc123"),
    ("units-written", "write units to /etc/systemd/system, env files to /etc/deploytool/env"),
    ("current-flipped", "flip /opt/deploytool/current"),
    ("pinned", "pin fingerprints"),
    ("daemon-reloaded", "daemon-reload"),
    ("started", f"stop the other backends, hold the public port 8082 (deploytool-front.socket), start {FT}"),
    ("healthy", f"health gate, then enable {FT}.service for boot and disable the others"),
    ("committed", "commit state"),
    ("undo", "on failure: undo every step in reverse, start the backend that served, exit 14"),
]


def _install(cfg: Config, st: State, facts: install.InstallFacts | None, **kw: bool) -> list[Step]:
    return install.install_plan(cfg, st, bundle=BUNDLE, keys=KEYS, facts=facts, **kw)


def test_fresh_install(cfg: Config) -> None:
    steps = _install(cfg, State(), install.InstallFacts(release="abc123"))
    assert rows(steps) == FRESH_INSTALL
    # what it journals is what the crash tests kill at (tests/test_install_faults.py), in that order
    assert [s.name for s in steps if s.name in install.JOURNALED] == list(install.JOURNALED)
    # --no-start: nothing started, nothing gated; a bundle without deploytool's wheels: no tool venv
    steps = _install(cfg, State(), install.InstallFacts(release="abc123", tool=False), start=False)
    assert [s.name for s in steps] == ["verified", "venv-ready", "native-libs-checked", "release-laid-down",
                                       "units-written", "current-flipped", "pinned", "daemon-reloaded",
                                       "committed", "undo"]


def test_install_dry_run_before_the_bundle_is_verified(cfg: Config) -> None:
    steps = _install(cfg, State(), None, rebuild=True)
    assert rows(steps)[1] == ("venv-ready", "unpack to /opt/deploytool/releases/.staging-<id>, rebuild the venv "
                                            "from the wheels (--no-index --require-hashes), compile, relocate")
    assert rows(steps)[3] == ("tool-ready", "if the bundle carries them: build deploytool's own venv from the "
                                            "bundle's tool wheels")
    assert rows(steps)[4] == ("release-laid-down", "move it to /opt/deploytool/releases/<id>")


def test_reinstall_of_the_same_release(cfg: Config) -> None:
    st = State(active_backend=LL, release="abc123")
    installed = install.InstallFacts(release="abc123", installed=True, laid_down=True, running=True)
    assert rows(_install(cfg, st, installed)) == [FRESH_INSTALL[0],
                                                  ("noop", "nothing to do: release abc123 is already installed")]
    # installed, but nothing runs: the recorded active backend is started behind the gate
    assert rows(_install(cfg, st, replace(installed, running=False)))[1:] == [
        ("start-installed", f"release abc123 is installed but no backend runs: start {LL} behind the health gate, "
                            "enable it for boot, disable the others")]
    # laid down by an earlier install that did not finish (or another config): the directory is kept
    steps = _install(cfg, st, install.InstallFacts(release="abc123", laid_down=True))
    assert rows(steps)[1] == ("release-kept", "/opt/deploytool/releases/abc123 is laid down already: keep it")
    assert [s.name for s in steps][2:5] == ["units-written", "current-flipped", "pinned"]


def test_recover_an_interrupted_install(cfg: Config) -> None:
    op = Operation(kind="install", op_id="x", started="t", step="started", from_backend=FT, to_backend=FT,
                   release="r2", previous_release="r1")
    st = State(active_backend=FT, release="r1", operation=op)
    assert rows(install.recover_plan(cfg, st, prev_laid_down=True, prev_running=False)) == [
        ("clean-staging", "remove /opt/deploytool/releases/.verify-* and /opt/deploytool/releases/.staging-r2"),
        ("restore-release", "point /opt/deploytool/current to /opt/deploytool/releases/r1, write its env files and "
                            "units back"),
        ("repin", "pin fingerprints of release r1"),
        ("remove-release", "remove /opt/deploytool/releases/r2"),
        ("daemon-reload", "daemon-reload"),
        ("restart-previous", f"restart {FT}.service of release r1 behind the health gate"),
        ("undone", "clear the interrupted install from state (release r1), record it in history"),
    ]
    # killed before anything started: the previous backend still serves and is left alone
    st = replace(st, operation=replace(op, step="units-written"))
    assert "restart-previous" not in [s.name for s in install.recover_plan(cfg, st, prev_laid_down=True,
                                                                            prev_running=True)]
    # a release that was laid down before this install (an earlier install of it, kept on the box): it stays
    st = State(active_backend=FT, release="r1", operation=replace(op, release_kept=True))
    assert "remove-release" not in [s.name for s in install.recover_plan(cfg, st, prev_laid_down=True,
                                                                          prev_running=False)]
    # a fresh box: everything it laid down goes
    st = State(operation=replace(op, from_backend=None, previous_release=None, step="pinned"))
    assert [s.name for s in install.recover_plan(cfg, st, prev_laid_down=False, prev_running=False)] == [
        "clean-staging", "remove-units", "remove-release", "daemon-reload", "undone"]


def _bare(cls: type) -> object:
    """A run object without its state (no box behind it): only its methods are bound into a plan."""
    return object.__new__(cls)


def test_every_step_of_every_plan_carries_what_it_runs(cfg: Config) -> None:
    """Built for running, every step a run walks carries one of that run object's own methods, and the plan's
    data (text, JSON) is the --dry-run plan's; built for --dry-run, no step carries anything. The steps done
    before the plan (an install's verification) and the failure steps (run with the error) carry none."""

    def check(dry: list[Step], bound: list[Step], run: object, *, skip: tuple[str, ...] = ()) -> None:
        assert dry == bound and [s.to_json() for s in dry] == [s.to_json() for s in bound]
        assert all(s.run is None for s in dry)
        for s in bound:
            if s.name in skip or (s.when and s.name in ("rolling-back", "undo")):
                assert s.run is None, s.name
                continue
            assert s.run is not None and getattr(s.run, "__self__", None) is run, s.name
            assert getattr(type(run), s.run.__name__) is s.run.__func__  # type: ignore[attr-defined]

    st = State(active_backend=FT, release="r1")
    sr = _bare(switch.SwitchRun)
    for args in ((st, LL, True), (st, FT, True), (State(), LL, False), (st, LL, False)):
        s0, to, awaits = args
        target = cfg.backends[to]
        facts = switch.switch_facts(cfg, s0, target, target_running=False, awaits_port=awaits)
        for drain_s in (None, 0.0):
            check(switch.switch_plan(cfg, s0, target, facts, drain_s=drain_s),
                  switch.switch_plan(cfg, s0, target, facts, drain_s=drain_s, run=sr), sr)  # type: ignore[arg-type]
    ir = _bare(install._Install)
    facts_i = install.InstallFacts(release="abc123")
    for f in (facts_i, replace(facts_i, laid_down=True), replace(facts_i, tool=False)):
        for start in (True, False):
            check(_install(cfg, State(), f, start=start),
                  install.install_plan(cfg, State(), bundle=BUNDLE, keys=KEYS, facts=f, start=start,
                                       run=ir), ir, skip=("verified",))  # type: ignore[arg-type]
    rr = _bare(switch._RecoverRun)
    for step in ("preflight", "draining", "stopping-current", "gate", "committing"):
        for kind in ("switch", "failover"):
            for running in (False, True):
                s1 = replace(st, operation=_op(step, kind))
                check(switch.recover_plan(cfg, s1, target_running=running),
                      switch.recover_plan(cfg, s1, target_running=running, run=rr), rr)  # type: ignore[arg-type]
    ur = _bare(install._UndoInstall)
    op = Operation(kind="install", op_id="x", started="t", step="started", from_backend=FT, to_backend=LL,
                   release="r2", previous_release="r1")
    for o in (op, replace(op, step="pinned"), replace(op, from_backend=None, previous_release=None),
              replace(op, from_backend=None)):
        for laid_down in (False, True):
            for prev_running in (False, True):
                kw = {"prev_laid_down": laid_down, "prev_running": prev_running}
                check(install.recover_plan(cfg, State(operation=o), **kw),
                      install.recover_plan(cfg, State(operation=o), run=ur, **kw), ur)  # type: ignore[arg-type]


def test_dry_run_json_carries_the_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--dry-run --json switch` and `recover` on a box with nothing installed: the plan as text and as data,
    and nothing written (a systemctl that fails: a plan of a box with nothing active needs none). The dry run
    runs the preflight the run would (here it refuses: the model file is missing, nothing is pinned), so the plan
    is shown with a preflight that passes."""
    data = example_dict("cpu-demo")
    data["systemd"] = {"systemctl": ["/bin/false"], "journalctl": ["/bin/false"]}
    cfg_path = write_dict(tmp_path, data)
    r = CliRunner().invoke(main, ["--config", str(cfg_path), "--json", "--dry-run", "switch", "llamacpp"])
    assert r.exit_code == 4 and json.loads(r.output)["error"] == "CheckFailed", r.output  # the run's refusal
    monkeypatch.setattr(switch, "run_preflight", lambda cfg, target: None)
    r = CliRunner().invoke(main, ["--config", str(cfg_path), "--json", "--dry-run", "switch", "llamacpp"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["action"] == "planned"
    assert [s["name"] for s in out["steps"]] == ["lock", "intent", "preflight", "starting-target", "gate",
                                                 "committing", "rolling-back"]
    assert out["plan"][0].startswith("lock ") and out["steps"][-1]["when"] == "on failure"
    r = CliRunner().invoke(main, ["--config", str(cfg_path), "--dry-run", "switch", "llamacpp"])
    assert r.exit_code == 0 and r.output.startswith("plan:\n  1. lock "), r.output
    r = CliRunner().invoke(main, ["--config", str(cfg_path), "--dry-run", "recover"])
    assert r.exit_code == 0 and "nothing to recover" in r.output, r.output
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "MANIFEST").write_text("{}")
    # a dry-run install checks the bundle as the install would (tests/test_trust.py plans a real one): refused, exit 6
    r = CliRunner().invoke(main, ["--config", str(cfg_path), "--dry-run", "install", str(tmp_path / "b")])
    assert r.exit_code == 6, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "deploytool.yaml"]


def test_a_bare_switcher_leaves_an_interrupted_install_to_recover(cfg: Config) -> None:
    """Only the operations layer knows both kinds: a Switcher without its finisher refuses an install (exit 13)."""
    st = State(operation=_op("verified", kind="install"))
    with pytest.raises(StateError, match="deploytool recover") as exc:
        switch.Switcher(cfg, sd=object()).recover_locked(st)  # type: ignore[arg-type]
    assert exc.value.exit_code == 13


def test_failover(cfg: Config) -> None:
    from deploy_tool.box import failover

    st = State(active_backend=LL, previous_backend=FT, release="r1")
    f = failover.Failure(LL, f"{LL}.service", "failed", "signal", False, "")
    fallback, why = failover.decide(cfg, st, f, [], now=1e9)
    assert fallback is not None and fallback.name == FT and why == ""
    steps = Store(cfg.paths.state_dir).lock_steps(st) + failover.failover_steps(cfg, st, f, fallback, why)
    assert rows(steps) == [
        ("lock", "lock /var/lib/deploytool/lock"),
        ("guard", f"check {LL}.service failed for good (the active backend, failed, no stop job, no failover "
                  f"within 3600 s) and pick the last backend that passed the health gate"),
        ("journal-kept", f"keep {LL}.service's last 40 journal lines for history"),
        ("intent", f"record intent: failover {LL} -> {FT}"),
        ("preflight", f"preflight {FT}: config checks, fingerprints (deploytool verify {FT})"),
        ("starting-target", f"start {FT}.service once nothing answers on port 8083"),
        ("gate", f"health gate: ftllm readiness on port 8083, smoke completion as 'qwen38-27b-ud'; meanwhile "
                 f"{FT}.service enabled for boot, the others disabled"),
        ("committing", "commit: write state and history (refused if the enablement failed)"),
        ("rolling-back", f"on failure: stop {FT}.service, leave both stopped ({LL} enabled for boot again), state "
                         "and status say nothing is serving, exit 9"),
    ]
    # the guard's refusals: the plan is the skip, recorded
    stop = replace(f, stop_job=True)
    fallback, why = failover.decide(cfg, st, stop, [], now=1e9)
    assert fallback is None and "a deliberate stop" in why
    assert rows(failover.failover_steps(cfg, st, stop, None, why))[-1] == (
        "skip", f"record the failover as skipped, change nothing: {why}")
    recent = replace(st, extra={"failover": {"epoch": 1e9 - 60, "from": FT, "to": LL, "result": "ok", "at": "t"}})
    assert "at most one per 3600 s" in failover.decide(cfg, recent, f, [], now=1e9)[1]


def test_recover_an_interrupted_failover(cfg: Config) -> None:
    op = replace(_op("gate", kind="failover"))
    st = State(active_backend=FT, release="r1", operation=op)
    # the backend that failed for good is never started again: the fallback is stopped, nothing left running
    assert rows(switch.recover_plan(cfg, st, target_running=True)) == [
        ("stop-target", f"stop {LL}.service"),
        ("leave-stopped", f"{FT} had failed: leave none running")]


def test_a_drifted_value_is_shown_whole_enough_to_read() -> None:
    """The preflight's drift line: a SHA-256 by its start, as verify's table shows it; any other value (a build
    line, a mode) up to 80 characters, never cut to a hash's length in the middle of a word."""
    from deploy_tool.box.fingerprint import short

    digest = "ab" * 32
    assert short(digest, switch.DRIFT_WIDTH) == digest[:12]
    line = "build 1, commit 0123abc (the ggml backend), CUDA 12.4"
    assert short(line, switch.DRIFT_WIDTH) == line
    assert len(short("x" * 200, switch.DRIFT_WIDTH)) == 80
