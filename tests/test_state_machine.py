"""The switch / rollback / recover state machine, fast: every kill point and every scripted unit failure against
a fake systemd (tests.support.fake_systemd: real sockets, fake processes, virtual time), no root, no sandbox,
no backends. Driven through the public interface only: operations.switch / rollback / recover (as the CLI
runs them), state.json and history.jsonl on disk, the DeployError exit codes, DEPLOYTOOL_FAULT=kill:<step> for kill points.

The preflight's config checks and fingerprints are scripted here (checks.run_checks, fingerprint.verify): their
real runs are tested in test_checks, test_fingerprint and, with everything else real, in the e2e suite.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from deploy_tool import checks
from deploy_tool.box import fingerprint, frontctl, operations
from deploy_tool.box.probe import health
from deploy_tool.box.state import Operation, State, Store
from deploy_tool.box.switch import Switcher, run_preflight
from deploy_tool.box.systemd import Systemd
from deploy_tool.errors import DeployError, ExitCode
from tests.support import fake_systemd as fs
from tests.support.backends import free_port
from tests.support.configs import DELETE, example_dict, load_dict, set_key
from tests.support.examples import examples

REPO = Path(__file__).resolve().parents[1]
F, L = "ftllm-dflash", "llamacpp-tensor"
FU, LU = f"{F}.service", f"{L}.service"

#: the kill points of a switch (and of a rollback, which is a switch back), in order
SWITCH_POINTS = ("intent", "preflight", "draining", "stopping-current", "starting-target", "gate", "committing")
ROLLBACK_POINT = "rolling-back"  # reached only when the target failed
#: the install's kill points (tests/test_install_kills.py kills each, on this fake driver with a real bundle)
INSTALL_POINTS = ("signature-checked", "verified", "venv-ready", "native-libs-checked", "tool-ready", "release-laid-down",
                  "units-written", "current-flipped", "pinned", "daemon-reloaded", "started", "healthy")
#: the scripted behaviours a target must fail its start or gate with
FAILING = fs.FAILING


# ------------------------------------------------------------------------------------------------ the box

def make_config(d: Path, port: int) -> Any:
    data = example_dict("cpu-demo")
    set_key(data, "systemd.sandbox", DELETE)
    set_key(data, "paths.unit_dir", str(d / "units"))
    set_key(data, "serve.internal_port", port)
    set_key(data, "health.start_timeout_s", 10)  # virtual seconds: 20 probes
    set_key(data, "health.interval_s", 0.5)
    set_key(data, "health.smoke_timeout_s", 5)
    return load_dict(d, data)


@dataclass
class Preflight:
    """What the preflight finds per backend: nothing, a config check error, or drifted fingerprints."""

    verdict: dict[str, str] = field(default_factory=dict)  # backend -> "check" | "drift"

    def run_checks(self, cfg: Any, **_: Any) -> list[checks.Finding]:
        return [checks.Finding("file-missing", "error", b, f"{b}: the model file does not exist", "restore it",
                               "scripted") for b, v in sorted(self.verdict.items()) if v == "check"]

    def verify(self, cfg: Any, backend: Any, **_: Any) -> fingerprint.VerifyReport:
        name = backend if isinstance(backend, str) else backend.name
        if self.verdict.get(name) != "drift":
            return fingerprint.VerifyReport(ok=True, rows=[], backend=name)
        item = fingerprint.Item("env", "env file", f"/etc/deploytool/env/{name}.env", "b" * 64)
        return fingerprint.VerifyReport(ok=False, rows=[fingerprint.Drift(item, "a" * 64, "b" * 64)], backend=name)


class FakeFront:
    """The front's control socket as deploytool sees it (deploy_tool.box.frontctl.ask), on the world's clock: a
    hold ends by itself after its seconds, as box/front.py's does; every command kept, with the calls to systemd
    made before it (what was stopped or started while requests were held)."""

    def __init__(self, world: fs.World) -> None:
        self.world = world
        self.until = 0.0
        self.log: list[tuple[str, int]] = []  # (command, how many systemd calls came before it)
        self.counters = {"requests": 0, "waited": 0, "failed": 0, "held_s": 0.0, "wait_max_s": 0.0,
                         "since": "2026-12-02T00:00:00Z"}

    @property
    def holding(self) -> bool:
        return self.until > self.world.now

    def ask(self, cfg: Any, command: str, timeout: float = 2.0) -> dict[str, Any] | None:
        if isinstance(sys.exc_info()[1], fs.Killed):
            return None  # a deploytool killed at a kill point runs no `finally`: its release never comes
        self.log.append((command.split()[0], len(self.world.calls)))
        word, *rest = command.split()
        if word == "hold":
            self.until = self.world.now + float(rest[0])
        elif word == "release":
            self.until = 0.0
        return {"ok": True, **self.counters, "holding": self.holding}


class Box:
    """A configured box of two backends on the fake systemd; state on disk in its own directory."""

    def __init__(self, d: Path, mp: pytest.MonkeyPatch) -> None:
        self.dir = d
        self.cfg = make_config(d, free_port())
        self.world = fs.World(self.cfg)
        self.world.install_units()
        self.preflight = Preflight()
        self.front = FakeFront(self.world)
        mp.setattr(frontctl, "ask", self.front.ask)
        # the real preflight over the scripted verdicts: its own messages and exit codes
        self.check = functools.partial(run_preflight, run_checks=self.preflight.run_checks,
                                       verify=self.preflight.verify)
        # and what `status` and the metrics report of the pins (they call fingerprint.verify)
        mp.setattr(fingerprint, "verify", self.preflight.verify)
        self.store = Store(self.cfg.paths.state_dir)
        self.log: list[str] = []

    # what a finished install leaves: `name` serving, enabled, recorded active
    def installed(self, name: str, *behaviours: fs.Behaviour) -> None:
        unit = f"{name}.service"
        if behaviours:
            self.world.script(unit, *behaviours)
        self.world.bring_up(unit)
        self.store.save(State(active_backend=name, release="r1"))

    def switcher(self) -> Switcher:
        return Switcher(self.cfg, log=self.log.append, sd=self.world.systemd(), preflight=self.check)

    def run(self, op: str, *args: Any, kill: str | None = None, **kw: Any) -> Outcome:
        """One deploytool command as the CLI runs it (deploy_tool.box.operations; a fresh process: a new driver
        handle), optionally killed at `kill`."""
        command = {"switch": operations.switch, "rollback": operations.rollback, "recover": operations.recover}[op]
        if op != "recover":  # it runs no preflight
            kw["preflight"] = self.check
        if kill:
            os.environ["DEPLOYTOOL_FAULT"] = f"kill:{kill}"
        try:
            res = command(self.cfg, *args, log=self.log.append, sd=self.world.systemd(), **kw)
        except fs.Killed as exc:
            return Outcome("killed", killed=str(exc))
        except DeployError as exc:
            return Outcome("error", error=exc, code=int(exc.exit_code))
        finally:
            os.environ.pop("DEPLOYTOOL_FAULT", None)
        return Outcome(res.action, result=res)

    # what is on disk
    def state(self) -> dict[str, Any]:
        p = self.dir / "demo-root/var/lib/deploytool/state.json"
        return json.loads(p.read_text()) if p.exists() else {}

    def history(self) -> list[dict[str, Any]]:
        p = self.dir / "demo-root/var/lib/deploytool/history.jsonl"
        return [json.loads(ln) for ln in p.read_text().splitlines()] if p.exists() else []

    def serves(self) -> str:
        """What a client gets on the served port right now: the completion's content (real HTTP)."""
        return health.smoke_completion(health.base_url(self.cfg), self.cfg.serve.model_name,
                                       timeout=5).content

    def calls(self, method: str) -> list[fs.Call]:
        return [c for c in self.world.calls if c.method == method]


@dataclass
class Outcome:
    action: str  # switched | noop | recovered | killed | error
    result: Any = None
    error: DeployError | None = None
    code: int = 0
    killed: str = ""


def no_real_sleep(mp: pytest.MonkeyPatch) -> list[float]:
    """time.sleep records instead of sleeping: every wait of the state machine must go through the retry
    policies (virtual time); a test asserts the list stays empty. And no fsync: a kill point here is an
    exception, never a power loss, so what was written is read back from the page cache alike (half of a
    switch's time here was fsync on a busy disk)."""
    slept: list[float] = []
    mp.setattr(time, "sleep", slept.append)
    mp.setattr(os, "fsync", lambda fd: None)
    return slept


@pytest.fixture
def mp(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    return monkeypatch


@pytest.fixture
def box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Box]:
    monkeypatch.delenv("DEPLOYTOOL_FAULT", raising=False)
    b = Box(tmp_path, monkeypatch)
    slept = no_real_sleep(monkeypatch)
    try:
        with b.world.running():
            yield b
    finally:
        b.world.close()
    assert slept == [], f"slept for real: {slept}"


def changes_within_touches(box: Box, steps: list[dict[str, Any]], since: int = 0) -> set[str]:
    """Every unit a step changed (the fake's calls since call `since`, each under the step state.json had
    journaled then) is one the plan (`steps`, as --dry-run --json gives them) says that step touches. Returns the
    steps seen changing something, so a caller can show the check saw work."""
    touches = {s["name"]: set(s["touches"]) for s in steps}
    seen: set[str] = set()
    for c in box.world.calls[since:]:
        if c.step in touches and c.units_changed():
            assert set(c.units_changed()) <= touches[c.step], \
                f"step {c.step} {c.method} {c.args}: its plan says it touches {sorted(touches[c.step])}"
            seen.add(c.step)
    return seen


def assert_settled(box: Box, *, after_rollback_failed: bool = False) -> None:
    """No operation pending; the recorded backend serves, alone, and is the one enabled for boot.

    With no backend recorded, nothing passes a gate either, unless a rollback failed earlier
    (`after_rollback_failed`): that start of the previous backend is left as it is, so systemd's
    Restart=on-failure may bring it up later by itself, unrecorded."""
    st = box.state()
    assert st.get("operation") is None, st
    assert not box.front.holding, box.front.log  # no request is held past an operation that ended
    active = st.get("active_backend")
    if active is None:
        if not after_rollback_failed:
            assert box.world.healthy() == set()
        return
    unit = f"{active}.service"
    # active the moment the command has returned: the gate waited for the unit's own readiness wait (its
    # ExecStartPost), so an operator's stop now is a clean one, not the kill of that wait (failed, failover)
    assert box.world.units[unit].sub_state == "running", box.world.units[unit].sub_state
    assert box.world.active() == {unit}
    assert box.world.listening() == unit
    assert box.world.enabled() == {unit}
    assert box.serves()


# ------------------------------------------------------------------------------------------------ the driver

def test_the_fake_implements_every_method_of_the_driver() -> None:
    public = {n for n, v in vars(Systemd).items() if callable(v) and not n.startswith("_")}
    assert public <= set(fs.FAKED), f"not faked: {sorted(public - set(fs.FAKED))}"


def test_every_fault_point_in_the_code_is_known_here() -> None:
    """Every point a run can be killed at (a literal fault("..."), a step a switch journals as it walks its plan,
    the rollback step, an install's journaled steps) is one this suite kills at, or an install point (sandbox
    suite). A new point fails here until it is added to one of the lists."""
    from deploy_tool.box import install, switch

    found: set[str] = set()
    for p in (REPO / "deploy_tool").rglob("*.py"):
        text = p.read_text()
        found |= set(re.findall(r"\bfault\(\"([a-z][a-z-]*)\"", text))
        found |= set(re.findall(r"\badvance\([^,()]+, \"([a-z][a-z-]*)\"", text))
    found |= set(switch.STEPS) | set(install.JOURNALED)
    # a release's removal (between its rename and its delete): tests/test_releases.py kills there
    assert found == set(SWITCH_POINTS) | {ROLLBACK_POINT} | set(INSTALL_POINTS) | {"release-renamed"}, found


# ------------------------------------------------------------------------------------------------ switch

def test_switch_hands_the_port_over(box: Box) -> None:
    box.installed(F)
    out = box.run("switch", L)
    assert out.action == "switched", out
    assert_settled(box)
    st = box.state()
    assert st["active_backend"] == L and st["previous_backend"] == F
    h = box.history()[-1]
    assert (h["event"], h["ok"], h["outcome"], h["from_backend"], h["to_backend"]) == \
        ("switch", True, "switched", F, L)
    # the current backend's stop is only queued: the target's ExecStartPre waits for it (--await-port)
    assert [c.kwargs.get("no_block") for c in box.calls("stop")] == [True]
    # new requests are held from the drain, before the current backend stops, until the target passed its gate
    commands = [c for c, _ in box.front.log if c != "stats"]
    assert commands == ["hold", "release"], box.front.log
    held_at = next(n for c, n in box.front.log if c == "hold")
    released_at = next(n for c, n in box.front.log if c == "release")
    stop_at = next(i for i, c in enumerate(box.world.calls) if c.method == "stop")
    start_at = next(i for i, c in enumerate(box.world.calls) if c.method == "start" and c.args[0] == LU)
    assert held_at <= stop_at < start_at < released_at, (box.front.log, box.world.calls)
    assert [c.args[0] for c in box.calls("enable")] == [LU] and box.calls("disable")[0].args == (FU,)


def test_switch_to_what_serves_is_a_noop(box: Box) -> None:
    box.installed(F)
    n = len(box.world.calls)
    out = box.run("switch", F)
    assert out.action == "noop"
    looked = [c.method for c in box.world.calls[n:]]
    assert "show" in looked and set(looked) <= {"show", "unit_path"}  # looked, changed nothing
    assert box.history() == []


def test_first_switch_on_a_box_with_nothing_running(box: Box) -> None:
    out = box.run("switch", L)
    assert out.action == "switched"
    assert_settled(box)
    assert box.state()["previous_backend"] is None


@pytest.mark.parametrize("behaviour", [fs.SLOW, fs.SLOW_STOP, fs.HANGS_ON_STOP])
def test_slow_but_healthy_is_switched(box: Box, behaviour: fs.Behaviour) -> None:
    """A target ready after seconds, a current backend slow to stop or SIGKILLed after TimeoutStopSec: the
    switch waits (virtual time) and succeeds."""
    if behaviour is fs.SLOW:
        box.installed(F)
        box.world.script(LU, behaviour)
    else:
        box.installed(F, behaviour)
    t0 = box.world.now
    out = box.run("switch", L)
    assert out.action == "switched", out
    assert_settled(box)
    waited = box.world.now - t0
    if behaviour is fs.HANGS_ON_STOP:
        assert fs.TIMEOUT_STOP_S <= waited < fs.TIMEOUT_STOP_S + 5
        assert box.world.units[FU].result == "timeout"  # SIGKILLed
    elif behaviour is fs.SLOW_STOP:
        assert behaviour.stop_s <= waited < behaviour.stop_s + 5


@pytest.mark.parametrize("then", ["ok", "never-ready", "crash-at-start"])
@pytest.mark.parametrize("start", ["from-ftllm", "from-none", "rollback"])
def test_each_step_changes_only_what_its_plan_says_it_touches(box: Box, start: str, then: str) -> None:
    """What --dry-run shows a step touches is what it changes: every start, stop, enable and disable a switch,
    a rollback or a rollback after a failed gate makes falls within its step's `touches`."""
    if start != "from-none":
        box.installed(F)
    if start == "rollback":
        assert box.run("switch", L).action == "switched"
        box.world.script(FU, fs.BEHAVIOURS[then])
        op, args, to = "rollback", (), F
    else:
        box.world.script(LU, fs.BEHAVIOURS[then])
        op, args, to = "switch", (L,), L
    plan = box.run(op, *args, dry_run=True)
    assert plan.action == "planned", plan
    n = len(box.world.calls)
    box.run(op, *args)
    seen = changes_within_touches(box, plan.result.steps, n)
    assert {"starting-target", "gate"} <= seen, seen  # it started the target and flipped its enablement
    if then != "ok":
        assert "rolling-back" in seen
    if start != "from-none":
        assert "stopping-current" in seen
    assert box.state()["operation"] is None and to


@pytest.mark.parametrize("conflicts", [True, False], ids=["conflicts", "no-conflicts"])
@pytest.mark.parametrize("name", FAILING)
def test_failing_target_is_rolled_back(box: Box, name: str, conflicts: bool) -> None:
    """Every way a target can fail its start or gate: exit 10, the previous backend serves again, enabled for
    boot, history says rolled-back with the target's own journal lines. Also with units whose Conflicts= were
    edited away: the rollback itself stops the target."""
    if not conflicts:
        box.world.install_units(conflicts=False)
    box.installed(F)
    box.world.script(LU, fs.BEHAVIOURS[name])
    out = box.run("switch", L)
    assert out.code == ExitCode.ROLLED_BACK, (out, box.log)
    assert_settled(box)
    st = box.state()
    assert st["active_backend"] == F
    assert box.world.units[LU].active_state != "active" and box.world.units[LU].sub_state != "auto-restart"
    h = box.history()[-1]
    assert (h["event"], h["ok"], h["outcome"], h["from_backend"], h["to_backend"]) == \
        ("switch", False, "rolled-back", F, L)
    assert f"{F} was restored" in out.error.message
    words = {"refused-by-check": "fingerprint(s) differ", "crash-at-start": "203/EXEC",
             "dies-while-loading": "out of memory", "exits-0": "Unsupport graph model type"}.get(name)
    if words:
        assert words in h["journal_tail"] and words in out.error.message
    # the target's journal lines are shown once, whether the gate's message carried them already or not
    shown = [ln.strip() for ln in out.error.message.splitlines() if ln.strip() in h["journal_tail"] and ln.strip()]
    assert len(shown) == len(set(shown)), out.error.message
    # never-ready: the gate's own deadline, or the unit's TimeoutStartSec= (the same 10 s) that ends its start
    reasons = {"wrong-model": "serves model 'some-other-model'", "never-ready": "not ready",
               "empty-completion": "empty content", "refused-by-check": "refused to start",
               "exits-0": "status 0 before ready is still a failure"}
    if name in reasons:
        assert reasons[name] in h["reason"] or reasons[name] in out.error.message


@pytest.mark.parametrize("name", ["crash-at-start", "never-ready", "dies-during-smoke"])
def test_rollback_that_fails_too_exits_11(box: Box, name: str) -> None:
    box.installed(F, fs.OK, fs.BEHAVIOURS[name])  # F's next start (the rollback's) fails the same way
    box.world.script(LU, fs.BEHAVIOURS[name])
    out = box.run("switch", L)
    assert out.code == ExitCode.ROLLBACK_FAILED, out
    assert_settled(box)
    assert box.state()["active_backend"] is None
    h = box.history()[-1]
    assert h["outcome"] == "rollback-failed" and h["rollback_error"]
    assert box.world.enabled() == {FU}  # what served before boots again
    # the previous backend's failed start is not stopped: one that never became ready is still loading, or
    # restarted by Restart=on-failure once its TimeoutStartSec= ended that start
    assert box.world.active() == set()
    if name == "never-ready":
        assert box.world.units[FU].sub_state in ("start-post", "auto-restart")


@pytest.mark.parametrize("name", ["never-ready", "wrong-model"])
def test_failing_first_start_leaves_nothing_running(box: Box, name: str) -> None:
    box.world.script(LU, fs.BEHAVIOURS[name])
    out = box.run("switch", L)
    assert out.code == ExitCode.HEALTH, out
    assert_settled(box)
    assert box.world.active() == set() and box.world.enabled() == set()
    assert box.history()[-1]["outcome"] == "failed"


@pytest.mark.parametrize(("verdict", "code"), [("check", ExitCode.CHECK_FAILED), ("drift", ExitCode.DRIFT)])
def test_refused_preflight_changes_nothing(box: Box, verdict: str, code: int) -> None:
    box.installed(F)
    pid = box.world.units[FU].proc.pid
    box.preflight.verdict[L] = verdict
    n = len(box.world.calls)
    assert box.run("switch", L, dry_run=True).code == code  # the dry run previews the refusal
    out = box.run("switch", L)
    assert out.code == code
    assert_settled(box)
    assert box.world.units[FU].proc.pid == pid  # never stopped
    assert not [c for c in box.world.calls[n:] if c.method in ("stop", "start", "enable", "disable")]
    assert box.history()[-1]["outcome"] == "refused"


def _packed_with(box: Box, key: str, value: Any) -> None:
    """The installed release was packed from the box's config but for `key` (its config.json says `value`)."""
    from deploy_tool.render import resolved_config_json

    doc = json.loads(resolved_config_json(box.cfg))
    *parents, leaf = key.split(".")
    node = doc
    for k in parents:
        node = node[k]
    node[leaf] = value
    Path(box.cfg.paths.current).mkdir(parents=True, exist_ok=True)
    (Path(box.cfg.paths.current) / "config.json").write_text(json.dumps(doc))


@pytest.mark.parametrize(("key", "value"), [("serve.model_name", "the-packed-name"), ("serve.internal_port", 1),
                                            (f"backends.{L}.device", "cuda"), ("host.gpus", [0, 1])])
def test_a_config_edited_after_install_is_refused_before_anything_changes(box: Box, key: str, value: Any) -> None:
    """The box's config is no longer the one the release was packed with, which its units run (a changed port or
    model name would make the gate probe what no unit serves, fail the target and then the rollback): a switch
    and a rollback refuse at the preflight, exit 7 naming the key, and never stop the serving backend; status names
    it first."""
    from deploy_tool.box import status

    box.installed(F)
    pid = box.world.units[FU].proc.pid
    _packed_with(box, key, value)
    n = len(box.world.calls)
    for op, args in (("switch", (L,)), ("rollback", ())):
        box.store.save(State(active_backend=F, previous_backend=L, release="r1"))
        assert box.run(op, *args, dry_run=True).code == ExitCode.DRIFT  # the dry run previews it
        out = box.run(op, *args)
        assert out.code == ExitCode.DRIFT, out
        assert key in out.error.message and "config.json" in (out.error.hint or ""), out.error.message
    assert box.world.units[FU].proc.pid == pid  # never stopped
    assert not [c for c in box.world.calls[n:] if c.method in ("stop", "start", "enable", "disable")]
    assert box.history()[-1]["outcome"] == "refused"
    reasons = status.collect(box.cfg, sd=box.world.systemd(), boot=False)["verdict"]["reasons"]
    assert reasons[0].startswith("the config differs") and key in reasons[0], reasons


@pytest.mark.parametrize(("key", "value"), [("paths.metrics_file", "/elsewhere/deploytool.prom"),
                                            ("health.smoke_max_tokens", 3), (f"backends.{L}.threads", 7),
                                            ("supervision.drain_timeout_s", 1.0)])
def test_what_the_gate_does_not_probe_by_may_differ(box: Box, key: str, value: Any) -> None:
    """A pack-only key (the metrics file is the box's own) and the box's own tuning, which an operator edits before
    installing the bundle packed with it (install compares every key): a switch, and so a failover, goes ahead."""
    from deploy_tool.box import status

    box.installed(F)
    _packed_with(box, key, value)
    assert box.run("switch", L).action == "switched"
    assert "config_differs" not in status.collect(box.cfg, sd=box.world.systemd(), boot=False)


def _running_unrecorded(box: Box, unit: str) -> int:
    """`unit` runs while state.json records no active backend (a failed rollback or failover left none, then
    systemd or a person started it); its main PID."""
    box.world.bring_up(unit)
    box.store.save(State(active_backend=None, release="r1"))
    return box.world.units[unit].proc.pid


def test_the_target_running_unrecorded_is_gated_as_it_runs_not_blamed_or_stopped(box: Box) -> None:
    pid = _running_unrecorded(box, FU)
    box.store.save(State(active_backend=None, previous_backend=L, release="r1"))
    n = len(box.world.calls)
    out = box.run("switch", F)
    assert out.action == "switched", out
    assert box.world.units[FU].proc.pid == pid  # the same process: never stopped, never restarted
    assert not [c for c in box.world.calls[n:] if c.method in ("stop", "start")]
    assert box.state()["active_backend"] == F and box.world.enabled() == {FU}
    assert box.state()["previous_backend"] == L  # the fallback a failover would take is kept
    assert_settled(box)


def test_an_adopted_target_that_fails_its_gate_is_left_running_as_found(box: Box) -> None:
    box.world.script(FU, fs.EMPTY_SMOKE)
    pid = _running_unrecorded(box, FU)
    out = box.run("switch", F)
    assert out.code == ExitCode.HEALTH and "left running as it was found" in out.error.message, out
    assert box.world.units[FU].proc.pid == pid and box.world.active() == {FU}
    assert box.state()["active_backend"] is None and box.state()["operation"] is None
    assert box.history()[-1]["outcome"] == "failed"


@pytest.mark.parametrize("point", ["starting-target", "gate", "committing"])
def test_an_adoption_killed_midway_is_recovered_to_the_target_serving(box: Box, point: str) -> None:
    """A kill while the running target is gated: recover brings it back serving and recorded (the intent names it
    as what it replaced), never leaves the box without a backend."""
    _running_unrecorded(box, FU)
    assert box.run("switch", F, kill=point).action == "killed"
    assert box.state()["operation"]["from_backend"] == F
    out = box.run("recover")
    assert out.action == "recovered", out
    assert box.state()["active_backend"] == F and box.world.active() == {FU}
    assert_settled(box)


def test_a_switch_from_an_unrecorded_backend_killed_at_committing_recovers_with_it_as_previous(box: Box) -> None:
    _running_unrecorded(box, FU)
    assert box.run("switch", L, kill="committing").action == "killed"
    assert box.run("recover").action == "recovered"
    st = box.state()
    assert (st["active_backend"], st["previous_backend"]) == (L, F)


@pytest.mark.parametrize("target_fails", [False, True])
def test_another_backend_running_unrecorded_is_the_current_one(box: Box, target_fails: bool) -> None:
    """It is drained and stopped as the current backend is, and restored if the target fails its gate (exit 10),
    never taken for a foreign process on the port."""
    _running_unrecorded(box, FU)
    if target_fails:
        box.world.script(LU, fs.NEVER_READY)
    out = box.run("switch", L)
    if target_fails:
        assert out.code == ExitCode.ROLLED_BACK, out
        assert box.state()["active_backend"] == F and box.world.active() == {FU}
    else:
        assert out.action == "switched", out
        assert (box.state()["active_backend"], box.state()["previous_backend"]) == (L, F)
        assert box.world.active() == {LU}
    assert "another process" not in str(out.error and out.error.message)
    assert box.history()[-1]["from_backend"] == F
    assert_settled(box)


def test_port_held_by_a_foreign_process_fails_fast_naming_it(box: Box) -> None:
    """ftllm stopped by hand and a foreign server on the port: the target's ExecStartPre names the holder, and
    so does the rollback's: exit 11 at once (no timeout waited out), nothing recorded active."""
    import socket

    box.installed(F)
    box.world.systemd().stop(FU)
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", box.cfg.backend_port))
        squatter.listen()
        t0 = box.world.now
        out = box.run("switch", L)
    assert out.code == ExitCode.ROLLBACK_FAILED, out
    assert f"port {box.cfg.backend_port} is held by pid {os.getpid()}" in out.error.message
    assert box.world.now - t0 < 1
    assert box.state()["active_backend"] is None and box.world.active() == set()


def test_nothing_running_and_the_port_taken_is_refused_before_the_start(box: Box) -> None:
    import socket

    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", box.cfg.backend_port))
        squatter.listen()
        out = box.run("switch", L)
    assert out.code == ExitCode.HEALTH and "is taken by another process" in out.error.message
    assert not box.calls("start")
    assert_settled(box)


def test_a_failed_enable_rolls_back(box: Box) -> None:
    """The boot-time enablement flipped during the gate failed: the switch is not committed half-done."""
    box.installed(F)
    box.world.failing[("enable", LU)] = "Failed to enable unit: Unit file llamacpp-tensor.service is masked."
    out = box.run("switch", L)
    assert out.code == ExitCode.ROLLED_BACK, out
    assert "masked" in out.error.message
    assert_settled(box)


def test_units_without_await_port_get_stop_then_start(box: Box) -> None:
    """Units rendered before --await-port: the stop is waited for, then the port is checked, then the start."""
    box.world.install_units(await_port=False)
    box.installed(F, fs.SLOW_STOP)
    out = box.run("switch", L)
    assert out.action == "switched"
    assert_settled(box)
    assert [c.kwargs.get("no_block") for c in box.calls("stop")] == [False]


def test_rollback_command_goes_back_and_needs_a_previous(box: Box) -> None:
    out = box.run("rollback")
    assert out.code == ExitCode.STATE
    box.installed(F)
    assert box.run("switch", L).action == "switched"
    out = box.run("rollback")
    assert out.action == "switched" and box.state()["active_backend"] == F
    assert box.history()[-1]["event"] == "rollback"
    assert_settled(box)


def test_a_held_lock_refuses_with_exit_12(box: Box) -> None:
    box.installed(F)
    with box.store.lock(what="install r2"):
        out = box.run("switch", L)
    assert out.code == ExitCode.LOCKED and "install r2" in out.error.message
    assert_settled(box)


# ------------------------------------------------------------------------------------------------ kill points

RECOVERED_TO = {"intent": F, "preflight": F, "draining": F, "stopping-current": F, "starting-target": F, "gate": F,
                "committing": L}


@pytest.mark.parametrize("point", SWITCH_POINTS)
@pytest.mark.parametrize("then", ["recover", "switch", "status-quo-later"])
def test_kill_at_each_switch_point(box: Box, point: str, then: str) -> None:
    """kill -9 at each step: state.json names the step; recover (or the next switch, which finishes it first)
    ends with exactly one healthy backend, the one enabled for boot."""
    box.installed(F)
    out = box.run("switch", L, kill=point)
    assert out.action == "killed" and box.world.kills == [f"kill:{point}"]
    op = box.state()["operation"]
    assert op["step"] == point and op["kind"] == "switch" and (op["from_backend"], op["to_backend"]) == (F, L)
    if then == "status-quo-later":
        box.world.advance(600)  # the operator comes back ten minutes later
    if then == "switch":
        out = box.run("switch", F)
        assert out.action in ("noop", "switched"), out
        assert box.state()["active_backend"] == F
    else:
        out = box.run("recover")
        assert out.action == "recovered", out
        assert box.state()["active_backend"] == RECOVERED_TO[point]
    assert_settled(box)
    rec = [h for h in box.history() if h["event"] == "recover"][-1]
    assert rec["step"] == point and rec["ok"]
    assert rec["outcome"] == {"intent": "nothing-changed", "preflight": "nothing-changed",
                              "draining": "nothing-changed", "committing": "committed"}.get(point, "rolled-back")


@pytest.mark.parametrize("name", ["crash-at-start", "never-ready", "dies-during-smoke", "refused-by-check"])
def test_kill_while_rolling_back(box: Box, name: str) -> None:
    box.installed(F)
    box.world.script(LU, fs.BEHAVIOURS[name])
    out = box.run("switch", L, kill=ROLLBACK_POINT)
    assert out.action == "killed" and box.state()["operation"]["step"] == ROLLBACK_POINT
    out = box.run("recover")
    assert out.action == "recovered" and box.state()["active_backend"] == F
    assert_settled(box)


def test_kill_at_committing_with_a_target_that_died_meanwhile_rolls_back(box: Box) -> None:
    box.installed(F)
    box.world.script(LU, fs.Behaviour("dies-later", dies_after=100.0))
    assert box.run("switch", L, kill="committing").action == "killed"
    box.world.advance(105)  # it died at 100 s; systemd restarts it RestartSec (10 s) later
    assert box.world.units[LU].sub_state == "auto-restart"
    out = box.run("recover")
    assert out.action == "recovered" and box.state()["active_backend"] == F
    assert_settled(box)


@pytest.mark.parametrize("point", ["gate", "committing"])
def test_status_after_a_switch_killed_past_its_start_says_pending_and_serving(box: Box, point: str) -> None:
    """Killed after the target started, before the commit: the target serves and the recorded one is stopped;
    status says pending (exit 21), names the target as serving, and its health check probes the target's kind."""
    from deploy_tool.box import status

    box.installed(F)
    assert box.run("switch", L, kill=point).action == "killed"
    box.world.advance(30)  # its start, queued before the kill, ends
    assert box.world.active() == {LU}
    rep = status.collect(box.cfg, sd=box.world.systemd(), boot=False)
    assert rep["serving_backend"] == L and rep["health"]["ok"], rep["health"]
    assert rep["verdict"]["exit_code"] == ExitCode.PENDING, rep["verdict"]
    assert box.run("recover").action == "recovered"
    rep = status.collect(box.cfg, sd=box.world.systemd(), boot=False)
    assert "serving_backend" not in rep and rep["verdict"]["exit_code"] == ExitCode.OK, rep["verdict"]


def test_recover_without_an_interrupted_operation_is_a_noop(box: Box) -> None:
    box.installed(F)
    assert box.run("recover").action == "noop"
    assert_settled(box)


@pytest.mark.parametrize("point", ["units-written", "daemon-reloaded", "started", "healthy"])
def test_recover_an_interrupted_first_install(box: Box, point: str) -> None:
    """An install killed on a fresh box: recover leaves no half-installed unit behind."""
    if point in ("started", "healthy"):
        box.world.bring_up(LU)
    box.store.save(State(operation=Operation(kind="install", op_id="x", started="t", step=point, to_backend=L,
                                             release="r2")))
    out = box.run("recover")
    assert out.action == "recovered"
    assert box.state()["operation"] is None and box.state()["active_backend"] is None
    assert box.world.active() == set() and box.world.enabled() == set()
    assert not list((box.dir / "units").glob("*.service"))
    assert box.history()[-1]["outcome"] == "undone"


def test_rollback_with_an_interrupted_operation_and_nothing_before_it_names_recover(box: Box) -> None:
    """Nothing to roll back to while an install is pending: exit 13, the operation left as it was, and the
    refusal says what to run."""
    pending = Operation(kind="install", op_id="x", started="t", step="units-written", to_backend=L, release="r2")
    box.store.save(State(operation=pending))
    out = box.run("rollback")
    assert out.code == ExitCode.STATE and out.error is not None
    assert "interrupted install" in out.error.message and "deploytool recover" in (out.error.hint or "")
    assert box.state()["operation"]["step"] == "units-written"
    assert box.run("recover").action == "recovered"


@pytest.mark.parametrize("name", ["crash-at-start", "never-ready", "dies-during-smoke", "wrong-model"])
def test_recover_whose_previous_backend_does_not_come_back_exits_11(box: Box, name: str) -> None:
    box.installed(F, fs.OK, fs.BEHAVIOURS[name])
    assert box.run("switch", L, kill="gate").action == "killed"
    out = box.run("recover")
    assert out.code == ExitCode.ROLLBACK_FAILED, out
    assert "did not come back" in out.error.message
    assert box.state()["operation"] is None and box.state()["active_backend"] is None
    assert box.world.active() & {LU} == set() and box.world.enabled() == {FU}
    h = box.history()[-1]
    assert (h["event"], h["ok"], h["outcome"], h["step"]) == ("recover", False, "rollback-failed", "gate")


@pytest.mark.parametrize("point", SWITCH_POINTS)
def test_kill_during_the_rollback_command(box: Box, point: str) -> None:
    """`deploytool rollback` is a switch back to the previous backend: killed at each step, recover settles it
    (on the backend it left, or, killed while committing, on the one it went back to)."""
    box.installed(F)
    assert box.run("switch", L).action == "switched"
    out = box.run("rollback", kill=point)
    assert out.action == "killed"
    op = box.state()["operation"]
    assert (op["kind"], op["step"], op["from_backend"], op["to_backend"]) == ("rollback", point, L, F)
    out = box.run("recover")
    assert out.action == "recovered"
    assert box.state()["active_backend"] == (F if point == "committing" else L)
    assert_settled(box)


def test_the_journal_tail_is_the_failed_invocations(box: Box) -> None:
    """The rolled-back target's tail in the history holds its failed start's lines, not an earlier start's."""
    box.installed(F)
    box.world.script(LU, fs.OK, fs.DIES_LOADING)
    assert box.run("switch", L).action == "switched"
    assert box.run("switch", F).action == "switched"
    box.world.advance(30)
    out = box.run("switch", L)
    assert out.code == ExitCode.ROLLED_BACK
    tail = box.history()[-1]["journal_tail"]
    assert "out of memory" in tail and tail.count("Starting llamacpp-tensor.service") == 1


@pytest.mark.parametrize("back", ["ok", "never-ready"])
@pytest.mark.parametrize("point", ["units-written", "current-flipped", "pinned", "started", "healthy"])
def test_recover_an_interrupted_upgrade(box: Box, mp: pytest.MonkeyPatch, point: str, back: str) -> None:
    """An install of release r2 killed over release r1 (ftllm serving): recover puts r1's units back, points
    current at r1 and brings ftllm back through the gate (restarted if r2's units had started it), or exits 11
    naming it if it does not come back."""
    pins: list[str] = []
    mp.setattr(fingerprint, "pin", lambda cfg, b, reason, **kw: pins.append(f"{b.name}: {reason}"))
    releases = Path(box.cfg.paths.releases_dir)
    for rid in ("r1", "r2"):
        (releases / rid / "env").mkdir(parents=True)
        (releases / rid / "units").mkdir()
        for u in (FU, LU):
            (releases / rid / "units" / u).write_text((box.dir / "units" / u).read_text() + f"# {rid}\n")
    Path(box.cfg.paths.current).symlink_to("releases/r2")
    box.installed(F, fs.OK, fs.BEHAVIOURS[back])
    box.store.save(State(active_backend=F, release="r1", operation=Operation(
        kind="install", op_id="x", started="t", step=point, from_backend=F, to_backend=F, release="r2",
        previous_release="r1")))
    out = box.run("recover")
    st_ = box.state()
    assert st_["operation"] is None and st_["release"] == "r1"
    assert os.readlink(box.cfg.paths.current) == "releases/r1" and not (releases / "r2").exists()
    assert (box.dir / "units" / FU).read_text().endswith("# r1\n")
    assert pins == [f"{F}: recover: back to release r1", f"{L}: recover: back to release r1"]
    restarted = point in ("started", "healthy")
    if back == "ok" or not restarted:
        assert out.action == "recovered" and st_["active_backend"] == F
        assert box.history()[-1]["outcome"] == "undone"
        assert_settled(box)
        # restarted: stopped, then its start queued for the gate to watch
        assert [c.method for c in box.world.calls if c.method in ("restart", "start")] == \
            (["start"] if restarted else [])
    else:
        assert out.code == ExitCode.ROLLBACK_FAILED and "did not come back" in out.error.message
        assert st_["active_backend"] is None and box.history()[-1]["outcome"] == "rollback-failed"


# ------------------------------------------------------------------------------------------------ hypothesis

BEHAVIOUR = st.sampled_from(sorted(fs.BEHAVIOURS))
BACKEND = st.sampled_from([F, L])
KILL = st.one_of(st.none(), st.sampled_from([*SWITCH_POINTS, ROLLBACK_POINT]))


HEALTHY = ("ok", "slow", "slow-stop", "hangs-on-stop")


def reached(point: str, target: str) -> bool:
    """Whether a switch from a serving backend to a target behaving as `target` reaches kill point `point`."""
    # every target reaches the gate: its start is queued, and the gate finds a start that failed (refused by its
    # ExecStartPre, or its server failing to exec)
    return {"committing": target in HEALTHY, ROLLBACK_POINT: target not in HEALTHY}.get(point, True)


@settings(max_examples=examples(30), deadline=None, suppress_health_check=list(HealthCheck))
@given(point=st.sampled_from([*SWITCH_POINTS, ROLLBACK_POINT]), target=BEHAVIOUR,
       current=st.sampled_from(["ok", "slow-stop", "hangs-on-stop"]),
       back=BEHAVIOUR, later=st.sampled_from([0.0, 5.0, 600.0]), then=st.sampled_from(["recover", "switch"]))
def test_kill_point_by_unit_behaviour(tmp_path_factory: pytest.TempPathFactory, point: str, target: str,
                                      current: str, back: str, later: float, then: str) -> None:
    """kill point x how the target behaves x how the current backend stops x how it starts again x how long
    until the operator comes back x recover or the next switch: the outcome is the one the state machine
    promises, and the box ends settled."""
    d = tmp_path_factory.mktemp("sm")
    mp = pytest.MonkeyPatch()
    box = Box(d, mp)
    slept = no_real_sleep(mp)
    try:
        with box.world.running():
            box.installed(F, fs.BEHAVIOURS[current], fs.BEHAVIOURS[back])
            box.world.script(LU, fs.BEHAVIOURS[target])
            out = box.run("switch", L, kill=point)
            if not reached(point, target):
                assert out.action != "killed"
                want = ("switched" if target in HEALTHY else
                        ExitCode.ROLLED_BACK if back in HEALTHY else ExitCode.ROLLBACK_FAILED)
                assert out.action == want or out.code == want, (out, box.log)
                assert_settled(box)
                return
            assert out.action == "killed" and box.state()["operation"]["step"] == point
            box.world.advance(later)
            out = box.run(then, *((F,) if then == "switch" else ()))
            assert_settled(box)
            st_ = box.state()
            # a switch killed while committing is finished if the target is healthy; anything else goes back
            target_up = point == "committing" and LU in box.world.healthy()
            if target_up or (then == "switch" and point == "committing" and st_["active_backend"] == F):
                return  # committed (then maybe switched back on purpose)
            if point in ("intent", "preflight", "draining", "stopping-current"):  # F was never stopped: it serves on
                assert st_["active_backend"] == F and out.code == 0, out
            elif back in HEALTHY or then == "switch":
                # rolled back; with `switch F`, F is started through its own gate even if its rollback failed
                assert st_["active_backend"] == F or out.code in (ExitCode.ROLLBACK_FAILED, ExitCode.HEALTH), out
            else:
                assert out.code == ExitCode.ROLLBACK_FAILED and st_["active_backend"] is None, out
    finally:
        box.world.close()
        mp.undo()
    assert slept == []


class Operations(RuleBasedStateMachine):
    """Any sequence of switches, rollbacks, recovers, kills, scripted unit behaviours and passing time keeps
    the box consistent: after every command that ran to its end, no operation is pending and the recorded
    backend serves alone and is the one enabled; a killed command leaves its step in state.json; every error
    is a DeployError with its exit code."""

    def __init__(self) -> None:
        super().__init__()
        self.mp = pytest.MonkeyPatch()
        self.dir = Path(tempfile.mkdtemp(prefix="dt-sm-"))
        self.box = Box(self.dir, self.mp)
        self.slept = no_real_sleep(self.mp)
        self.ctx = self.box.world.running()
        self.ctx.__enter__()
        self.box.installed(F)
        self.pending: str | None = None
        self.rollback_failed = False

    def teardown(self) -> None:
        try:
            self.ctx.__exit__(None, None, None)
        finally:
            self.box.world.close()
            self.mp.undo()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _check(self, out: Outcome, kill: str | None, before: dict[str, Any]) -> None:
        if out.action == "killed":
            assert kill and out.killed == f"kill:{kill}"
            op = self.box.state()["operation"]
            assert op is not None and op["step"] == kill
            self.pending = kill
            return
        if out.code == ExitCode.STATE and self.pending is not None:
            # `rollback` with no previous backend refuses before it takes the lock: the interrupted operation is
            # left for `recover`, which the refusal names (exit 13 is also "an interrupted operation needs recover")
            assert self.box.state()["operation"] == before["operation"]
            assert out.error is not None and "deploytool recover" in f"{out.error.message} {out.error.hint}"
            return
        self.pending = None
        if out.action == "error":
            assert out.code in (ExitCode.HEALTH, ExitCode.ROLLED_BACK, ExitCode.ROLLBACK_FAILED, ExitCode.STATE,
                                ExitCode.CHECK_FAILED, ExitCode.DRIFT), out
            if out.code == ExitCode.ROLLBACK_FAILED:
                assert self.box.state()["active_backend"] is None
                self.rollback_failed = True
        if self.box.state().get("active_backend"):
            self.rollback_failed = False
        assert_settled(self.box, after_rollback_failed=self.rollback_failed)

    @rule(to=BACKEND, behaviour=BEHAVIOUR, kill=KILL)
    def switch(self, to: str, behaviour: str, kill: str | None) -> None:
        self.box.world.script(f"{to}.service", fs.BEHAVIOURS[behaviour])
        before = self.box.state()
        self._check(self.box.run("switch", to, kill=kill), kill, before)

    @rule(behaviour=BEHAVIOUR, kill=KILL)
    def rollback(self, behaviour: str, kill: str | None) -> None:
        for u in (FU, LU):
            self.box.world.script(u, fs.BEHAVIOURS[behaviour])
        before = self.box.state()
        self._check(self.box.run("rollback", kill=kill), kill, before)

    @precondition(lambda self: self.pending is not None)
    @rule()
    def recover(self) -> None:
        before = self.box.state()
        self._check(self.box.run("recover"), None, before)

    @rule(seconds=st.sampled_from([1.0, 15.0, 120.0]))
    def time_passes(self, seconds: float) -> None:
        self.box.world.advance(seconds)

    @invariant()
    def never_slept_for_real(self) -> None:
        assert self.slept == []

    @invariant()
    def one_listener_at_most(self) -> None:
        listening = [u for u in self.box.world.units.values() if u.proc and u.proc.server]
        assert len(listening) <= 1


TestOperations = Operations.TestCase
TestOperations.settings = settings(max_examples=examples(25), stateful_step_count=6, deadline=None,
                                   suppress_health_check=list(HealthCheck))
