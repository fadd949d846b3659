"""The box's Prometheus metrics, in the text exposition format node_exporter's textfile collector reads.

`render(cfg, rep, events)` turns a `status` report and the history into the metrics text; `refresh(cfg)` writes
it to `paths.metrics_file` after every install, switch, rollback, recover and failover (best effort: a metrics file that
cannot be written is a warning, never a failed operation); `deploytool metrics` prints or writes it on demand
(a timer can run `deploytool metrics --write` to keep the serving gauge fresh between operations).

After an operation, the report is made from what the operation itself learned (`Learned`: which backend passed
its health gate last and serves, which backends' fingerprints it verified or pinned), state.json, the history,
and for a backend it did not verify, the drift the file said before; only an operation whose outcome says
nothing of the kind (a refusal, a no-op, an undone install) gets a whole `status` collection instead.

The file is written atomically (a temp file `.NAME.tmp-PID` beside it, fsynced, renamed over it), so the
collector never reads a partial file, and the temp name does not end in `.prom`, so the collector never reads
it either. When the file's directory does not exist nothing is written: with the default path that means
node_exporter is not installed (quietly skipped); with a path the config names, a warning says so.

What is counted from history.jsonl (one line per event, appended by the operations):
  gate      the last event that ran the health gate: a switch or rollback (any outcome but "refused", which
            stopped before anything changed), an install that started a backend (it names the backend), a
            failover; an event may also say so itself with a boolean `gate` field, which wins
  failover  events named "failover": ok true counts a failover, ok false a failed one
  liveness  events named "liveness": action "failure" (a probe that found the server not answering) and action
            "restart" (the server restarted because of it)
"""

from __future__ import annotations

import datetime as _dt
import logging
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploy_tool.box import status
from deploy_tool.box.state import Store
from deploy_tool.config import DEFAULT_METRICS_FILE, Config
from deploy_tool.errors import DeployError, ExitCode
from deploy_tool.fsutil import atomic_write

log = logging.getLogger("deploytool")

PREFIX = "deploytool_"
GATE_EVENTS = ("switch", "rollback", "failover")
NO_GATE_OUTCOMES = frozenset({"refused"})  # stopped at the preflight, before anything changed


def escape_label(value: str) -> str:
    """A label value inside double quotes, per the text exposition format: backslash, double quote and line
    feed escaped (`\\\\`, `\\"`, `\\n`); everything else as it is (UTF-8)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(v: float) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(round(v, 3))


class _Out:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str,
               samples: Iterable[tuple[dict[str, str], float]]) -> None:
        samples = list(samples)
        if not samples:
            return
        full = PREFIX + name
        self.lines.append(f"# HELP {full} {_escape_help(help_text)}")
        self.lines.append(f"# TYPE {full} {kind}")
        for labels, value in samples:
            lab = ",".join(f'{k}="{escape_label(v)}"' for k, v in labels.items())
            self.lines.append(f"{full}{{{lab}}} {_number(value)}" if lab else f"{full} {_number(value)}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def gate_result(e: dict[str, Any]) -> bool | None:
    """True/False when the history event `e` records a health gate's result, else None (see the module doc)."""
    if isinstance(e.get("gate"), bool):
        return bool(e["gate"])
    ok = e.get("ok")
    if not isinstance(ok, bool):
        return None
    what = e.get("event")
    if what in GATE_EVENTS and e.get("outcome") not in NO_GATE_OUTCOMES:
        return ok
    if what == "install" and e.get("backend"):
        return ok
    return None


def epoch(iso: object) -> float | None:
    """Seconds since the epoch of a history time stamp ("2026-12-01T13:25:52.123456Z"), None if unreadable."""
    if not isinstance(iso, str):
        return None
    try:
        t = _dt.datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except ValueError:
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=_dt.UTC)
    return t.timestamp()


def counts(events: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """What the history says: the last gate (ok, time), failovers (ok / failed), liveness failures and restarts."""
    c: dict[str, Any] = {"failovers": 0, "failover_failures": 0, "liveness_failures": 0, "liveness_restarts": 0,
                         "last_gate_ok": None, "last_gate_time": None, "clients": {}}
    for e in events:
        what = e.get("event")
        seen = e.get("clients")
        if isinstance(seen, dict) and isinstance(what, str):
            mine = c["clients"].setdefault(what, {"held_s": 0.0, "waited": 0, "failed": 0})
            for k in mine:
                v = seen.get(k)
                if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0:
                    mine[k] += v
        if what == "failover" and isinstance(e.get("ok"), bool):
            c["failovers" if e["ok"] else "failover_failures"] += 1
        elif what == "liveness":
            if e.get("action") == "failure":
                c["liveness_failures"] += 1
            elif e.get("action") == "restart":
                c["liveness_restarts"] += 1
        g = gate_result(e)
        if g is not None:
            c["last_gate_ok"], c["last_gate_time"] = g, epoch(e.get("time"))
    return c


def render(cfg: Config, rep: dict[str, Any], events: Iterable[dict[str, Any]]) -> str:
    """The metrics text for the status report `rep` (status.collect) and the whole history `events`."""
    v = rep.get("verdict") or {}
    code = int(v.get("exit_code", ExitCode.NOT_SERVING))
    c = counts(events)
    active = rep.get("active_backend")
    names = sorted(cfg.backends)
    if active and active not in cfg.backends:
        names.append(active)  # recorded, but no longer in the config: still shown
    out = _Out()
    out.family("serving", "gauge", "1 when the active backend's unit is active and it answers its health check "
               "(deploytool status exits 0, 20 or 21)", [({}, int(code != ExitCode.NOT_SERVING))])
    out.family("status_code", "gauge", "the exit code of deploytool status: 0 serving, 20 degraded, 21 "
               "interrupted operation pending, 22 not serving", [({}, code)])
    out.family("active_backend", "gauge", "1 for the backend deploytool recorded as active, 0 for the others",
               [({"backend": n}, int(n == active)) for n in names])
    if rep.get("release"):
        out.family("release_info", "gauge", "the installed release (bundle id)", [({"release": rep["release"]}, 1)])
    out.family("operation_pending", "gauge", "1 when an interrupted operation awaits deploytool recover",
               [({}, int(bool(rep.get("interrupted")) and not rep.get("operation_running")))])
    fps = rep.get("fingerprints") or {}
    out.family("drift", "gauge", "1 when the backend's fingerprints differ from its pins (or cannot be read)",
               [({"backend": n}, int(not fps[n].get("ok"))) for n in sorted(fps)])
    if c["last_gate_ok"] is not None:
        out.family("last_gate_success", "gauge", "1 when the last health gate (install, switch, rollback, "
                   "failover) passed", [({}, int(c["last_gate_ok"]))])
    if c["last_gate_time"] is not None:
        out.family("last_gate_timestamp_seconds", "gauge", "when the last health gate ended (Unix time)",
                   [({}, float(c["last_gate_time"]))])
    out.family("failovers_total", "counter", "automatic failovers that brought a fallback backend up",
               [({}, c["failovers"])])
    out.family("failover_failures_total", "counter", "automatic failovers whose fallback did not come up",
               [({}, c["failover_failures"])])
    out.family("liveness_failures_total", "counter", "liveness probes that found the active backend not answering",
               [({}, c["liveness_failures"])])
    out.family("liveness_restarts_total", "counter", "restarts of the active backend by the liveness probe",
               [({}, c["liveness_restarts"])])
    clients = c["clients"]
    if clients:
        ops = sorted(clients)
        out.family("operation_held_seconds_total", "counter", "seconds the front held new requests during "
                   "deploytool's operations, by kind (switch, rollback, failover, ...)",
                   [({"operation": k}, float(clients[k]["held_s"])) for k in ops])
        out.family("operation_requests_waited_total", "counter", "client requests that waited at the front for a "
                   "backend during deploytool's operations, by kind", [({"operation": k}, clients[k]["waited"])
                                                                      for k in ops])
        out.family("operation_requests_failed_total", "counter", "client requests the front could not answer "
                   "from a backend (503 past serve.hold_timeout_s, or an answer cut off) during deploytool's "
                   "operations, by kind", [({"operation": k}, clients[k]["failed"]) for k in ops])
    front = rep.get("front") or {}
    counters = front.get("counters") if isinstance(front.get("counters"), dict) else None
    if counters is not None:
        out.family("front_requests_total", "counter", "requests the front answered from a backend since it "
                   "started", [({}, int(counters.get("requests", 0)))])
        out.family("front_requests_waited_total", "counter", "of those and the failed, the requests that waited "
                   "for a backend", [({}, int(counters.get("waited", 0)))])
        out.family("front_requests_failed_total", "counter", "requests answered 503 past the hold bound or cut "
                   "off mid-answer since the front started", [({}, int(counters.get("failed", 0)))])
        out.family("front_held_seconds_total", "counter", "seconds the front held new requests for deploytool "
                   "since it started", [({}, float(counters.get("held_s", 0.0)))])
    return out.text()


def unreadable_text(exc: DeployError) -> str:
    """The metrics when the box's state cannot be read at all (a damaged state.json: `status` exits 13): its exit
    code as deploytool_status_code, so an alert sees it (a file left as it was would still say serving); nothing is
    claimed of what serves, which is not known."""
    out = _Out()
    out.family("status_code", "gauge", "the exit code of deploytool status: 0 serving, 20 degraded, 21 "
               "interrupted operation pending, 22 not serving; here the box's state could not be read: "
               + exc.message.splitlines()[0], [({}, int(exc.exit_code))])
    return out.text()


def collect_text(cfg: Config, *, sd: Any = None) -> tuple[str, dict[str, Any]]:
    """(the metrics text, the status report it was made from)."""
    rep = status.collect(cfg, sd=sd, boot=False)
    return render(cfg, rep, Store(cfg.paths.state_dir).history()), rep


@dataclass(frozen=True)
class Learned:
    """What an operation found out on its way: `serving`, the backend whose health gate passed last and that
    serves now (None: nothing serves); `verified`, each backend whose fingerprints it compared or pinned, with
    whether they matched."""

    serving: str | None
    verified: Mapping[str, bool] = field(default_factory=dict)


_DRIFT_LINE = re.compile(r'^deploytool_drift\{backend="((?:[^"\\]|\\.)*)"\} ([01])$', re.M)


def _previous_drift(path: str) -> dict[str, bool]:
    """backend -> drifted, as the metrics file at `path` says (empty when there is none)."""
    try:
        text = Path(path).read_text("utf-8", errors="replace")
    except OSError:
        return {}
    return {re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), m.group(1)): m.group(2) == "1"
            for m in _DRIFT_LINE.finditer(text)}


def learned_report(cfg: Config, learned: Learned, *, previous_drift: Mapping[str, bool]) -> dict[str, Any]:
    """The part of a status report the metrics show, from state.json and what the operation learned."""
    st = Store(cfg.paths.state_dir).load()
    drift = {n: d for n, d in previous_drift.items() if n in cfg.backends}
    drift.update({n: not ok for n, ok in learned.verified.items()})
    serves = learned.serving is not None and learned.serving == st.active_backend
    rep: dict[str, Any] = {
        "installed": True, "active_backend": st.active_backend, "release": st.release,
        "interrupted": st.operation.__dict__ if st.operation else None, "operation_running": False,
        "units": {}, "health": {"ok": serves, "detail": "its health gate passed" if serves else "not gated"},
        "fingerprints": {n: {"ok": not d} for n, d in sorted(drift.items())},
    }
    code, reasons = status.verdict(rep)
    rep["verdict"] = {"exit_code": int(code), "state": status.STATES[code], "reasons": reasons}
    return rep


def write(path: str | os.PathLike[str], text: str) -> Path:
    """Write the metrics text to `path` atomically (0644: node_exporter runs as its own user)."""
    p = Path(path)
    atomic_write(p, text.encode("utf-8"), 0o644)
    return p


def refresh(cfg: Config, *, sd: Any = None, quiet: bool = False, learned: Learned | None = None) -> Path | None:
    """After an operation: rewrite paths.metrics_file if it is on and its directory exists, from what the
    operation `learned` (else from a whole status collection). Never raises: a failure is logged as a warning
    (the operation's own result stands). A missing directory is worth a warning only for a path the config names,
    and not with `quiet` (after a failed operation, whose own error is the message: an install refused before it
    laid anything down leaves no state directory)."""
    path = cfg.paths.metrics_file
    if not path:
        return None
    if not Path(path).parent.is_dir():
        if path != DEFAULT_METRICS_FILE and not quiet:
            log.warning("metrics: not written: the directory of paths.metrics_file %s does not exist", path)
        return None
    try:
        st = Store(cfg.paths.state_dir).load()
        if not (os.path.lexists(cfg.paths.current) or st.release or st.active_backend or st.operation):
            return None  # nothing installed (an uninstall removed the file, and a recover finishing one keeps it so)
        if learned is None:
            text, _ = collect_text(cfg, sd=sd)
        else:
            rep = learned_report(cfg, learned, previous_drift=_previous_drift(path))
            text = render(cfg, rep, Store(cfg.paths.state_dir).history())
        return write(path, text)
    except DeployError as exc:
        log.warning("metrics: %s not written: %s", path, exc.message.splitlines()[0])
    except Exception as exc:  # a bug here must not turn a finished operation into a failed one
        log.warning("metrics: %s not written (internal error %s: %s)", path, type(exc).__name__, exc)
    return None
