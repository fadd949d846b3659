"""The Prometheus metrics file: valid text exposition format (a strict parser below), the right values from state
and history, written atomically, rewritten by every operation (on the fake systemd), and llama-server's own
--metrics rendered into its launch line. The real sandbox run is in tests/test_e2e.py."""

from __future__ import annotations

import json
import math
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from deploy_tool import render
from deploy_tool.box import metrics
from deploy_tool.box import systemd as systemd_mod
from deploy_tool.box.state import State, Store
from deploy_tool.cli import main
from deploy_tool.errors import OSFailure
from tests.support import fake_systemd as fs
from tests.support.configs import example_dict, load_dict, set_key
from tests.test_state_machine import LU, Box, F, L, no_real_sleep

# ------------------------------------------------------------------------------------------ a strict parser

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_TYPES = {"counter", "gauge", "histogram", "summary", "untyped"}


class ParseError(AssertionError):
    pass


def _value(text: str) -> float:
    if text in ("NaN", "+Inf", "-Inf"):
        return float(text.replace("Inf", "inf").replace("NaN", "nan"))
    if not re.fullmatch(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?", text):
        raise ParseError(f"not a sample value: {text!r}")
    return float(text)


def _labels(s: str, i: int) -> tuple[dict[str, str], int]:
    """Parse `{a="x",b="y"}` from s[i] == '{'; return the labels and the index after '}'."""
    out: dict[str, str] = {}
    i += 1
    while s[i] != "}":
        m = _LABEL.match(s, i)
        if not m:
            raise ParseError(f"bad label name at {s[i:]!r}")
        name, i = m.group(), m.end()
        if s[i:i + 2] != '="':
            raise ParseError(f"expected =\" after label {name}")
        i += 2
        val = []
        while s[i] != '"':
            if s[i] == "\\":
                esc = s[i + 1]
                if esc not in '\\"n':
                    raise ParseError(f"bad escape \\{esc}")
                val.append("\n" if esc == "n" else esc)
                i += 2
            elif s[i] == "\n":
                raise ParseError("raw line feed in a label value")
            else:
                val.append(s[i])
                i += 1
        i += 1
        if name in out:
            raise ParseError(f"label {name} twice")
        out[name] = "".join(val)
        if s[i] == ",":
            i += 1
        elif s[i] != "}":
            raise ParseError(f"expected , or }} at {s[i:]!r}")
    return out, i + 1


def parse(text: str) -> dict[str, dict[str, Any]]:
    """Prometheus text format 0.0.4, strictly: families {name: {"type", "help", "samples": {labels: value}}}.

    Refuses: no final line feed, blank or unknown lines, HELP/TYPE twice, a TYPE after the family's samples, a
    family's samples not together, a sample of an undeclared family, a duplicate series, a counter not named
    *_total or negative, a bad name, label or escape, a bad value."""
    if not text.endswith("\n"):
        raise ParseError("no final line feed")
    fams: dict[str, dict[str, Any]] = {}
    closed: set[str] = set()
    current: str | None = None
    for line in text[:-1].split("\n"):
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            kw, rest = line[2:6], line[7:]
            name, _, arg = rest.partition(" ")
            if not _NAME.fullmatch(name):
                raise ParseError(f"bad metric name {name!r}")
            if name in closed:
                raise ParseError(f"{name}: its lines are not together")
            f = fams.setdefault(name, {"type": None, "help": None, "samples": {}})
            if current not in (None, name):
                closed.add(current)
            current = name
            if kw == "HELP":
                if f["help"] is not None:
                    raise ParseError(f"{name}: HELP twice")
                f["help"] = arg.replace("\\n", "\n").replace("\\\\", "\\")
            else:
                if f["type"] is not None or f["samples"]:
                    raise ParseError(f"{name}: TYPE twice or after its samples")
                if arg not in _TYPES:
                    raise ParseError(f"{name}: unknown type {arg!r}")
                f["type"] = arg
            continue
        if not line or line.startswith("#"):
            raise ParseError(f"unexpected line {line!r}")
        m = _NAME.match(line)
        if not m:
            raise ParseError(f"bad sample line {line!r}")
        name, i = m.group(), m.end()
        labels: dict[str, str] = {}
        if i < len(line) and line[i] == "{":
            labels, i = _labels(line, i)
        if line[i:i + 1] != " ":
            raise ParseError(f"expected a space before the value in {line!r}")
        parts = line[i + 1:].split(" ")
        if len(parts) not in (1, 2):
            raise ParseError(f"bad value/timestamp in {line!r}")
        value = _value(parts[0])
        if len(parts) == 2 and not re.fullmatch(r"-?\d+", parts[1]):
            raise ParseError(f"bad timestamp in {line!r}")
        if name not in fams or fams[name]["type"] is None:
            raise ParseError(f"sample of undeclared family {name}")
        if name in closed or current != name:
            raise ParseError(f"{name}: its samples are not together")
        key = tuple(sorted(labels.items()))
        if key in fams[name]["samples"]:
            raise ParseError(f"{name}{labels}: duplicate series")
        if fams[name]["type"] == "counter" and (not name.endswith("_total") or value < 0 or math.isnan(value)):
            raise ParseError(f"{name}: a counter named without _total or not a count ({value})")
        fams[name]["samples"][key] = value
    return fams


def value(fams: dict[str, dict[str, Any]], name: str, **labels: str) -> float:
    return fams[f"deploytool_{name}"]["samples"][tuple(sorted(labels.items()))]


def test_the_parser_refuses_what_the_format_does() -> None:
    ok = "# HELP a_total x\n# TYPE a_total counter\na_total 1\n"
    assert parse(ok)["a_total"]["samples"] == {(): 1.0}
    for bad in ("# TYPE a gauge\na 1", "# TYPE a gauge\na 1\n\n", "a 1\n", "# TYPE a gauge\na{b=\"\\x\"} 1\n",
                "# TYPE a gauge\na 1\na 2\n", "# TYPE a counter\na 1\n", "# TYPE a gauge\na one\n",
                "# TYPE a gauge\n# TYPE b gauge\na 1\n", "# TYPE a gauge\na{b=\"1\",b=\"2\"} 1\n"):
        with pytest.raises(ParseError):
            parse(bad)


# ------------------------------------------------------------------------------------------------ rendering

def _cfg(tmp_path: Path, **changes: Any) -> Any:
    data = example_dict("cpu-demo")
    for k, v in changes.items():
        set_key(data, k, v)
    return load_dict(tmp_path, data)


def _rep(active: str | None = F, code: int = 0, release: str | None = "r1", drift: tuple[str, ...] = (),
         interrupted: bool = False) -> dict[str, Any]:
    return {"active_backend": active, "release": release, "verdict": {"exit_code": code},
            "fingerprints": {n: {"ok": n not in drift} for n in (F, L)},
            "interrupted": {"kind": "switch"} if interrupted else None, "operation_running": False}


def test_metrics_of_a_serving_box(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    fams = parse(metrics.render(cfg, _rep(), []))
    assert value(fams, "serving") == 1 and value(fams, "status_code") == 0
    assert value(fams, "active_backend", backend=F) == 1 and value(fams, "active_backend", backend=L) == 0
    assert value(fams, "release_info", release="r1") == 1
    assert value(fams, "drift", backend=F) == 0 and value(fams, "drift", backend=L) == 0
    assert value(fams, "operation_pending") == 0
    for c in ("failovers_total", "failover_failures_total", "liveness_failures_total", "liveness_restarts_total"):
        assert value(fams, c) == 0 and fams[f"deploytool_{c}"]["type"] == "counter"
    assert "deploytool_last_gate_success" not in fams, "no gate has run: no value rather than a made-up one"
    assert all(f["help"] for f in fams.values())


def test_metrics_follow_state_and_history(tmp_path: Path) -> None:
    """The last gate is the last event that ran one (a refused switch did not; a pin is no gate); failovers
    and liveness events are counted by name and outcome."""
    cfg = _cfg(tmp_path)
    store = Store(cfg.paths.state_dir)
    store.record("install", ok=True, release="r1", backend=F, action="started")
    store.record("switch", ok=False, from_backend=F, to_backend=L, outcome="rolled-back", reason="crash")
    gate_failed = store.history()[-1]["time"]
    store.record("switch", ok=False, from_backend=F, to_backend=L, outcome="refused", reason="drift")
    store.record("pin", backend=L, reason="re-pinned")
    for ok in (True, True, False):
        store.record("failover", ok=ok, from_backend=F, to_backend=L)
    for action in ("failure", "failure", "failure", "restart", "probe-ok"):
        store.record("liveness", action=action, backend=L)
    fams = parse(metrics.render(cfg, _rep(active=L, code=22, drift=(F,), interrupted=True), []))
    assert value(fams, "serving") == 0 and value(fams, "status_code") == 22
    assert value(fams, "operation_pending") == 1 and value(fams, "drift", backend=F) == 1
    fams = parse(metrics.render(cfg, _rep(active=L), store.history()))
    assert value(fams, "active_backend", backend=L) == 1
    assert value(fams, "failovers_total") == 2 and value(fams, "failover_failures_total") == 1
    assert value(fams, "liveness_failures_total") == 3 and value(fams, "liveness_restarts_total") == 1
    # the failovers ran gates (the last one failed)
    assert value(fams, "last_gate_success") == 0
    last_failover = [e for e in store.history() if e["event"] == "failover"][-1]["time"]
    assert value(fams, "last_gate_timestamp_seconds") == pytest.approx(metrics.epoch(last_failover), abs=1e-3)
    # without the failovers, the failed switch's gate is the last one (the refusal after it ran none)
    events = [e for e in store.history() if e["event"] != "failover"]
    fams = parse(metrics.render(cfg, _rep(active=L), events))
    assert value(fams, "last_gate_success") == 0
    assert value(fams, "last_gate_timestamp_seconds") == pytest.approx(metrics.epoch(gate_failed), abs=1e-3)
    store.record("rollback", ok=True, from_backend=L, to_backend=F, outcome="switched")
    fams = parse(metrics.render(cfg, _rep(), store.history()))
    assert value(fams, "last_gate_success") == 1


PROMTOOL = Path(__file__).resolve().parents[1] / ".cache" / "promtool" / "promtool"


def test_what_clients_saw_per_operation_and_the_front_counters(tmp_path: Path) -> None:
    """The clients' figures of each operation's history event add up per kind of operation; the front's own
    counters come from status; events without them (before the front) count nothing; and Prometheus's own
    checker, promtool (Debian's prometheus package, unpacked by make setup), finds nothing to say."""
    cfg = _cfg(tmp_path)
    store = Store(cfg.paths.state_dir)
    store.record("install", ok=True, release="r1", backend=F, action="started")  # no front yet: no clients
    store.record("switch", ok=True, from_backend=F, to_backend=L, outcome="switched",
                 clients={"requests": 40, "waited": 6, "failed": 0, "held_s": 1.25, "wait_max_s": 1.3})
    store.record("switch", ok=False, from_backend=L, to_backend=F, outcome="rolled-back",
                 clients={"requests": 70, "waited": 20, "failed": 2, "held_s": 3.5, "wait_max_s": 3.6})
    store.record("failover", ok=True, from_backend=L, to_backend=F,
                 clients={"requests": 9, "waited": 9, "failed": 0, "held_s": 0.0, "wait_max_s": 12.0})
    rep = {**_rep(), "front": {"installed": True, "socket": "active",
                               "counters": {"requests": 500, "waited": 35, "failed": 2, "held_s": 4.75}}}
    text = metrics.render(cfg, rep, store.history())
    fams = parse(text)
    assert value(fams, "operation_held_seconds_total", operation="switch") == 4.75
    assert value(fams, "operation_requests_waited_total", operation="switch") == 26
    assert value(fams, "operation_requests_failed_total", operation="switch") == 2
    assert value(fams, "operation_requests_failed_total", operation="failover") == 0
    assert ("operation", "install") not in {k for s in fams["deploytool_operation_held_seconds_total"]["samples"]
                                            for k in s}
    assert value(fams, "front_requests_total") == 500 and value(fams, "front_requests_failed_total") == 2
    assert value(fams, "front_held_seconds_total") == 4.75
    # before any front or operation with clients: none of these families
    bare = parse(metrics.render(cfg, _rep(), []))
    assert not any(n.startswith(("deploytool_front_", "deploytool_operation_held", "deploytool_operation_requests"))
                   for n in bare), sorted(bare)
    import subprocess

    assert PROMTOOL.is_file(), f"{PROMTOOL} is missing: run `make setup`"
    r = subprocess.run([str(PROMTOOL), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr


def test_an_explicit_gate_field_wins() -> None:
    assert metrics.gate_result({"event": "failover", "ok": False, "gate": True}) is True
    assert metrics.gate_result({"event": "failover", "ok": False, "outcome": "refused"}) is None
    assert metrics.gate_result({"event": "install", "ok": True, "release": "r1"}) is None  # --no-start
    assert metrics.gate_result({"event": "recover", "ok": True}) is None


@given(st.text())
def test_any_label_value_survives_escaping(text: str) -> None:
    """Whatever a release or backend name holds (quotes, backslashes, line feeds), the line parses back to it."""
    line = f'# TYPE x gauge\nx{{v="{metrics.escape_label(text)}"}} 1\n'
    assert parse(line)["x"]["samples"] == {(("v", text),): 1.0}


def test_a_release_with_quotes_renders_valid_text(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    rel = 'odd "release"\\\nname'
    fams = parse(metrics.render(cfg, _rep(release=rel), []))
    assert value(fams, "release_info", release=rel) == 1


# ------------------------------------------------------------------------------------------------ writing

def test_write_is_atomic_for_a_reader(tmp_path: Path) -> None:
    """A reader polling the file while it is rewritten 300 times always sees one whole version, never a part,
    and no temp file is left (nor matched by the collector's *.prom glob meanwhile)."""
    path = tmp_path / "deploytool.prom"
    versions = {("# TYPE deploytool_x gauge\n" + f"deploytool_x {i}\n" * 400) for i in range(3)}
    metrics.write(path, sorted(versions)[0])
    stop = threading.Event()
    seen: list[str] = []
    prom_files: set[str] = set()

    def reader() -> None:
        while not stop.is_set():
            seen.append(path.read_text())
            prom_files.update(p.name for p in tmp_path.glob("*.prom"))

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(300):
            metrics.write(path, sorted(versions)[i % 3])
    finally:
        stop.set()
        t.join()
    assert len(seen) > 10 and set(seen) <= versions
    assert prom_files == {"deploytool.prom"}
    assert os.listdir(tmp_path) == ["deploytool.prom"]
    assert (path.stat().st_mode & 0o777) == 0o644


def test_a_failed_write_leaves_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Disk full half-way through: the previous file stays whole, the temp file is removed, one clear error."""
    path = tmp_path / "deploytool.prom"
    metrics.write(path, "# TYPE deploytool_x gauge\ndeploytool_x 1\n")
    real_write = os.write
    calls = {"n": 0}

    def full(fd: int, data: Any) -> int:
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError(28, "No space left on device")
        return real_write(fd, bytes(data)[:10])

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSFailure, match="no space left on device"):
        metrics.write(path, "# TYPE deploytool_x gauge\ndeploytool_x 2\n" * 10)
    monkeypatch.undo()
    assert path.read_text() == "# TYPE deploytool_x gauge\ndeploytool_x 1\n"
    assert os.listdir(tmp_path) == ["deploytool.prom"]


def test_refresh_skips_a_missing_directory(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The default path without node_exporter's directory: skipped quietly; a configured path whose directory
    is missing: a warning, and the operation's result stands (no exception); off: nothing."""
    default = _cfg(tmp_path / "a", **{"paths.metrics_file": metrics.DEFAULT_METRICS_FILE})
    if not Path(metrics.DEFAULT_METRICS_FILE).parent.is_dir():
        assert metrics.refresh(default) is None and not caplog.records
    missing = _cfg(tmp_path / "b", **{"paths.metrics_file": str(tmp_path / "nope" / "x.prom")})
    assert metrics.refresh(missing) is None
    assert "does not exist" in caplog.text and not (tmp_path / "nope").exists()
    off = _cfg(tmp_path / "c", **{"paths.metrics_file": ""})
    assert off.paths.metrics_file is None and metrics.refresh(off) is None


# ------------------------------------------------------------------------------ operations and the CLI write it

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


def _prom(box: Box) -> dict[str, dict[str, Any]]:
    assert box.cfg.paths.metrics_file, "the cpu-demo example writes its metrics into its state dir"
    return parse(Path(box.cfg.paths.metrics_file).read_text())


def test_switch_rollback_and_recover_rewrite_the_metrics(box: Box) -> None:
    box.installed(F)
    assert box.run("switch", L).action == "switched"
    fams = _prom(box)
    assert value(fams, "active_backend", backend=L) == 1 and value(fams, "serving") == 1
    assert value(fams, "last_gate_success") == 1 and value(fams, "release_info", release="r1") == 1
    box.world.script(f"{F}.service", fs.NEVER_READY)
    out = box.run("rollback")
    assert out.action == "error" and out.code == 10  # rolled back to L
    fams = _prom(box)
    assert value(fams, "active_backend", backend=L) == 1 and value(fams, "last_gate_success") == 0
    out = box.run("recover")
    assert Path(box.cfg.paths.metrics_file).exists() and value(_prom(box), "operation_pending") == 0


def test_metrics_after_a_switch_come_from_the_switch_itself(box: Box, monkeypatch: pytest.MonkeyPatch) -> None:
    """A switch and a rollback write the metrics from what they learned (the gate that passed, the fingerprints
    the preflight verified, the drift the file said for the other backend), not from a second status."""
    from deploy_tool.box import status

    box.installed(F)
    assert box.run("switch", L).action == "switched"  # a first file, from the switch
    collected: list[str] = []
    monkeypatch.setattr(status, "collect", lambda *a, **k: collected.append("collect") or {})
    assert box.run("switch", F).action == "switched"
    fams = _prom(box)
    assert value(fams, "active_backend", backend=F) == 1 and value(fams, "serving") == 1
    assert value(fams, "status_code") == 0
    assert value(fams, "drift", backend=F) == 0 and value(fams, "drift", backend=L) == 0
    box.world.script(f"{L}.service", fs.NEVER_READY)
    assert box.run("rollback").code == 10  # rolled back to F
    fams = _prom(box)
    assert value(fams, "active_backend", backend=F) == 1 and value(fams, "serving") == 1
    assert value(fams, "last_gate_success") == 0
    assert collected == []


def test_a_refused_lock_writes_nothing(box: Box) -> None:
    """Another operation holds the lock: the refused one leaves the metrics to the holder."""
    from tests.test_state_lock import holding

    box.installed(F)
    with holding(Path(box.cfg.paths.state_dir), "install"):
        out = box.run("switch", L)
    assert out.code == 12
    assert not Path(box.cfg.paths.metrics_file).exists()


def test_status_metrics_file_and_the_metrics_command(box: Box, tmp_path: Path) -> None:
    box.installed(F)
    box.store.save(State(active_backend=F, release="r1"))
    out = tmp_path / "m" / "deploytool.prom"
    out.parent.mkdir()
    cfg = box.cfg.source_path
    r = CliRunner().invoke(main, ["--config", cfg, "status", "--metrics-file", str(out)])
    assert r.exit_code == 0, r.output
    assert value(parse(out.read_text()), "active_backend", backend=F) == 1
    r = CliRunner().invoke(main, ["--config", cfg, "metrics"])
    assert r.exit_code == 0 and value(parse(r.output), "serving") == 1
    r = CliRunner().invoke(main, ["--config", cfg, "metrics", "--write"])
    assert r.exit_code == 0, r.output
    assert value(_prom(box), "serving") == 1
    box.world.systemd().stop(f"{F}.service")
    r = CliRunner().invoke(main, ["--config", cfg, "metrics", "--out", str(out)])
    assert r.exit_code == 0, "metrics exits 0: the file carries the state"
    fams = parse(out.read_text())
    assert value(fams, "serving") == 0 and value(fams, "status_code") == 22
    for args in (["metrics", "--out"], ["status", "--metrics-file"]):
        r = CliRunner().invoke(main, ["--config", cfg, *args, str(tmp_path / "nope" / "x.prom")])
        assert r.exit_code == 5 and "its directory does not exist" in r.output, r.output
        assert not (tmp_path / "nope").exists()
    r = CliRunner().invoke(main, ["--config", cfg, "metrics", "--write", "--out", str(out)])
    assert r.exit_code == 5 and "both" in r.output


def test_a_dry_run_writes_no_metrics_file(box: Box, tmp_path: Path) -> None:
    """--dry-run (or -n, before or after the command) with --write, --out or status --metrics-file: says where it
    would write and writes nothing."""
    box.installed(F)
    box.store.save(State(active_backend=F, release="r1"))
    cfg = box.cfg.source_path
    out = tmp_path / "deploytool.prom"
    prom = Path(box.cfg.paths.metrics_file)
    before = prom.read_bytes() if prom.exists() else None
    for argv in (["--dry-run", "metrics", "--write"], ["metrics", "-n", "--out", str(out)],
                 ["status", "--metrics-file", str(out), "--dry-run"]):
        r = CliRunner().invoke(main, ["--config", cfg, *argv])
        assert r.exit_code == 0, r.output
        assert "would write" in r.output, r.output
        assert not out.exists(), argv
        assert (prom.read_bytes() if prom.exists() else None) == before, argv


# ------------------------------------------------------------------------------------ llama-server --metrics

def test_llama_server_is_launched_with_its_metrics_endpoint(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    argv = render.launch_argv(cfg, cfg.backends[L])
    assert argv.count("--metrics") == 1
    assert "--metrics" not in render.launch_argv(cfg, cfg.backends[F])  # ftllm has no such endpoint
    cfg2 = _cfg(tmp_path / "x", **{f"backends.{L}.extra_args": ["--metrics"]})
    assert render.launch_argv(cfg2, cfg2.backends[L]).count("--metrics") == 1
    assert LU in {f.name for f in render.render_all(cfg)}


def test_an_operation_that_cannot_write_the_state_writes_no_metrics(box: Box, monkeypatch: pytest.MonkeyPatch) -> None:
    """A switch refused because this user cannot write the state dir (not root) changed nothing: no metrics line
    before its own error."""
    from deploy_tool.box import operations

    box.installed(F)
    calls: list[object] = []
    monkeypatch.setattr(metrics, "refresh", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(operations.os, "access", lambda p, mode: False)
    monkeypatch.setattr(Store, "lock", lambda *a, **k: (_ for _ in ()).throw(OSFailure("state: permission denied")))
    out = box.run("switch", L)
    assert out.code == 17 and calls == []


def test_a_damaged_state_still_gives_metrics_and_exit_0(tmp_path: Path) -> None:
    """state.json damaged (status exits 13): `metrics` still exits 0 (a timer keeps writing), the file says
    deploytool_status_code 13 and claims nothing of what serves; `--json metrics` is one JSON object."""
    data = example_dict("cpu-demo")
    set_key(data, "paths.state_dir", str(tmp_path / "state"))
    cfg = load_dict(tmp_path, data)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "state.json").write_text("{not json")
    out = tmp_path / "m.prom"
    r = CliRunner().invoke(main, ["--config", str(cfg.source_path), "metrics", "-o", str(out)])
    assert r.exit_code == 0, r.output
    fams = parse(out.read_text())
    assert value(fams, "status_code") == 13 and "deploytool_serving" not in fams
    r = CliRunner().invoke(main, ["--config", str(cfg.source_path), "--json", "metrics"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert value(parse(doc["metrics"]), "status_code") == 13
