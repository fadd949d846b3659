#!/usr/bin/env python3
"""Control overhead of `deploytool switch` and crash-to-rollback latency, on a real sandboxed systemd.

Sets up its own cpu-demo box (packed bundle, sandboxed systemd, `deploytool install`) under .cache/, then:

1. Control overhead = switch wall time (the installed CLI as a user on the box runs it, interpreter start to
   exit) minus the target's own time to ready, measured in the same run: the target's ExecStart line from its
   installed unit, run directly as a process (same binary, model, env file; another free port) while the other
   backend serves, polled every 20 ms until ready (/health for llama-server, /v1/models for ftllm). Median of --runs switches each way.
   Goal: <= 0.5 s. Also shown: the replaced backend's own exit time (run directly: SIGTERM to exit). A switch
   must wait for it (the target's server execs only once the other backend is gone), but the target's start,
   with its ExecStartPre fingerprint check, runs while it exits.
2. Crash to rollback: a drop-in makes the target's ExecStart print its exit time (CLOCK_REALTIME, ns) and exit 3
   after --crash-ms; the rollback's start is the manager's "Starting ftllm-dflash.service" entry in the
   journal (the first thing the rollback does after stopping the dead target is start the previous backend;
   the journal's realtime stamps share the clock). Median of --runs. Goal: <= 1 s.

Usage: python bench/bench_switch.py [--runs 3] [--crash-ms 300] [--json] [--keep] [--trace] [--timeline] [--profile]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pstats
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from deploy_tool import proc  # noqa: E402
from deploy_tool.box.probe.health import UnitSnapshot, wait_ready  # noqa: E402
from deploy_tool.box.systemd import Systemd  # noqa: E402
from deploy_tool.rehearsal.sandbox import Sandbox  # noqa: E402
from tests.support.demo_box import Box, active_units, dt, make_demo  # noqa: E402
from tests.support.sandbox import free_port, new_run_dir  # noqa: E402

UNITS = {"ftllm-dflash": "ftllm", "llamacpp-tensor": "llamacpp"}


def env_file(path: Path) -> dict[str, str]:
    out = {}
    for ln in path.read_text().splitlines():
        if ln.strip() and not ln.lstrip().startswith("#") and "=" in ln:
            k, v = ln.split("=", 1)
            out[k.strip()] = (shlex.split(v) or [""])[0]
    return out


def direct_ready(box: Box, backend: str, model_name: str) -> tuple[float, float]:
    """Seconds from spawning the unit's own ExecStart (on a free port) to ready, polled every 20 ms; and from
    SIGTERM to its exit (what stopping it costs when a switch leaves it)."""
    unit = (box.unit_dir / f"{backend}.service").read_text()
    line = next(ln for ln in unit.splitlines() if ln.startswith("ExecStart=") and ln != "ExecStart=")
    argv = shlex.split(line.split("=", 1)[1])
    port = free_port()
    argv[argv.index("--port") + 1] = str(port)
    # the launcher reads the env file systemd hands it as a credential (%d/environment): here, the file itself
    argv = [str(box.env_dir / f"{backend}.env") if a == "%d/environment" else a for a in argv]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", **env_file(box.env_dir / f"{backend}.env")}
    with tempfile.TemporaryFile() as log:
        t0 = time.monotonic()
        p = proc.spawn(argv, env=env, stdout=log, stderr=subprocess.STDOUT)

        def exited() -> UnitSnapshot | None:  # a server that died ends the wait at once, its own output the reason
            return None if p.poll() is None else UnitSnapshot(
                "failed", "failed", "exit-code", p.returncode, "exited", name=f"{backend} (run directly)")

        def output() -> str:
            log.seek(0)
            return log.read()[-2000:].decode(errors="replace")

        try:
            wait_ready(UNITS[backend], f"http://127.0.0.1:{port}", model_name, timeout=120, interval=0.02,
                       unit_state=exited, journal_tail=output)
            ready = time.monotonic() - t0
            t1 = time.monotonic()
            os.killpg(p.pid, 15)
            p.wait(30)
            return ready, time.monotonic() - t1
        finally:
            if p.poll() is None:  # only the process this function started, by its own group
                os.killpg(p.pid, 15)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, 9)
                    p.wait()


def installed_cli(cfg: Path) -> list[str]:
    """The deploytool a user on the box runs: the installed release's tool venv (`{current}/tool/bin/deploytool`),
    the same program as the units' ExecStartPre. (Not this checkout's venv: besides being another program, its
    PyYAML is another file, so it and the ExecStartPre would keep re-parsing the config and rewriting its parse
    cache for each other.)"""
    return [str(Box(cfg).current / "tool" / "bin" / "deploytool")]


def timed(cfg: Path, *args: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    e = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    t0 = time.monotonic()
    r = subprocess.run([*installed_cli(cfg), "--config", str(cfg), *args], capture_output=True, text=True,
                       timeout=600, env=e, cwd=cfg.parent)
    return time.monotonic() - t0, r


def trace(cfg: Path, *args: str) -> list[tuple[float, str]]:
    """The CLI's stderr lines (with -v: every external command) stamped with seconds since it was spawned."""
    e = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    t0 = time.monotonic()
    p = subprocess.Popen([*installed_cli(cfg), "-v", "--config", str(cfg), *args], text=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=e, cwd=cfg.parent)
    assert p.stderr is not None
    # only the CLI's own lines ("  message") and commands ("+ argv"): -v also turns on the `sh` library's debug log
    out = [(time.monotonic() - t0, ln.rstrip()) for ln in p.stderr if ln.startswith(("+ ", "  ")) and
           ": warning: library " not in ln]
    p.wait()
    out.append((time.monotonic() - t0, f"(exit {p.returncode})"))
    return out


def profile(cfg: Path, *args: str, top: int = 30) -> list[tuple[float, str]]:
    """One CLI run under cProfile: the deploytool functions with the most cumulative (wall) time."""
    with tempfile.NamedTemporaryFile(suffix=".prof") as f:
        e = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
        python = Box(cfg).current / "tool" / "venv" / "bin" / "python"  # the installed tool's interpreter
        t0 = time.monotonic()
        subprocess.run([str(python), "-m", "cProfile", "-o", f.name, "-m", "deploy_tool", "--config", str(cfg),
                        *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=e, cwd=cfg.parent,
                       check=True)
        wall = time.monotonic() - t0
        out = io.StringIO()
        st = pstats.Stats(f.name, stream=out)
        st.sort_stats("cumulative").print_stats(r"deploy_tool|subprocess.py.*\(run\)|importlib", top)
    rows = [(wall, f"wall {wall:.3f}s (profiled: slower than a plain run)")]
    for ln in out.getvalue().splitlines():
        if ln.strip() and ln.lstrip()[0].isdigit():
            # the installed tool's venv path says nothing: the module and function after site-packages/ do
            rows.append((wall, re.sub(r"\S*/site-packages/", "", ln.strip())[:150]))
    return rows


#: Run by the installed tool's interpreter: the CLI under a profile hook that stamps (wall clock) the calls into
#: and returns from the switch's steps named in TIMELINE_STEPS, then exits as the CLI does.
TIMELINE = r"""
import os, runpy, sys, time
want = set(os.environ["DT_TIMELINE"].split(","))
def hook(frame, event, arg):
    if event in ("call", "return"):
        co = frame.f_code
        where = co.co_filename.rpartition("deploy_tool/")[2] + ":" + co.co_name
        if where in want:
            sys.stderr.write(f"@@ {time.time():.6f} {'>' if event == 'call' else '<'} {where}\n")
sys.setprofile(hook)
sys.argv = ["deploytool", *sys.argv[1:]]
try:
    runpy.run_module("deploy_tool", run_name="__main__")
finally:
    sys.setprofile(None)
"""
TIMELINE_STEPS = ("cli/ops.py:switch", "box/operations.py:switch", "box/switch.py:run_preflight",
                  "checks.py:run_checks", "box/fingerprint.py:verify", "box/switch.py:stop_current",
                  "box/switch.py:start_target", "box/switch.py:set_enabled", "box/probe/health.py:wait_ready",
                  "box/probe/health.py:smoke_completion", "box/probe/gate.py:runtime_truth",
                  "box/probe/gate.py:started", "box/switch.py:commit")


def timeline(cfg: Path, *args: str) -> list[tuple[float, str]]:
    """One CLI run with its steps stamped: seconds since the process was spawned at each step's start and end
    (the profile hook slows Python-heavy steps, the checks and verify, by about a third)."""
    e = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    e["DT_TIMELINE"] = ",".join(TIMELINE_STEPS)
    python = Box(cfg).current / "tool" / "venv" / "bin" / "python"
    t0 = time.time()
    r = subprocess.run([str(python), "-I", "-c", TIMELINE, "--config", str(cfg), *args], capture_output=True,
                       text=True, env=e, cwd=cfg.parent, timeout=600)
    end = time.time() - t0
    rows = []
    for ln in r.stderr.splitlines():
        if ln.startswith("@@ "):
            _, stamp, edge, where = ln.split(" ", 3)
            rows.append((float(stamp) - t0, f"{'start' if edge == '>' else 'end  '} {where}"))
    rows.append((end, f"(exit {r.returncode})"))
    return rows


def unit_commands(cfg: Path, backend: str, runs: int = 5) -> dict[str, float]:
    """Median wall seconds of the unit's own deploytool commands run by hand while `backend` serves: its
    ExecStartPre (`verify BACKEND`, warm cache) and its ExecStartPost (`await-ready BACKEND`, the server ready)."""
    out = {}
    for name, args in (("verify", ("verify", backend)), ("await_ready", ("await-ready", backend))):
        walls = []
        for _ in range(runs):
            wall, r = timed(cfg, *args)
            assert r.returncode == 0, r.stdout + r.stderr
            walls.append(wall)
        out[name] = statistics.median(walls)
    return out


def journal(sb: Sandbox, unit: str) -> list[dict]:
    res = proc.run([*sb.journalctl_prefix(), "-o", "json", "-n", "400", "-u", unit, "--no-pager"], ok=(0, 1),
                   timeout=30)
    return [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")]


def crash_to_rollback(cfg: Path, sd: Systemd, sb: Sandbox, box: Box, crash_ms: int, runs: int) -> list[dict]:
    d = box.unit_dir / "llamacpp-tensor.service.d"
    d.mkdir(exist_ok=True)
    # systemd expands %-specifiers and $: %% and $$ are the literal characters
    script = f"sleep {crash_ms / 1000:.3f}; echo BENCH-CRASH-AT $$(date +%%s%%N) >&2; exit 3"
    (d / "50-bench-crash.conf").write_text(f"[Service]\nExecStart=\nExecStart=/bin/sh -c '{script}'\n")
    sd.daemon_reload()
    out = []
    try:
        r = dt(cfg, "pin", "llamacpp-tensor", "--reason", "bench: crash after N ms")
        assert r.returncode == 0, r.stdout + r.stderr
        for _ in range(runs):
            since = time.time()
            wall, r = timed(cfg, "switch", "llamacpp")
            assert r.returncode == 10, f"expected a rollback (exit 10): {r.returncode}\n{r.stdout}\n{r.stderr}"
            crash = [int(e["MESSAGE"].split()[1]) / 1e9 for e in journal(sb, "llamacpp-tensor.service")
                     if isinstance(e.get("MESSAGE"), str) and e["MESSAGE"].startswith("BENCH-CRASH-AT")]
            starting = [int(e["__REALTIME_TIMESTAMP"]) / 1e6 for e in journal(sb, "ftllm-dflash.service")
                        if isinstance(e.get("MESSAGE"), str) and e["MESSAGE"].startswith("Starting")
                        and int(e["__REALTIME_TIMESTAMP"]) / 1e6 >= since]
            crash = [c for c in crash if c >= since]
            assert crash and starting, "crash or rollback start not found in the journal"
            out.append({"crash_to_rollback_s": starting[0] - crash[-1], "switch_wall_s": wall})
            assert active_units(sd) == {"ftllm-dflash.service"}
    finally:
        shutil.rmtree(d, ignore_errors=True)
        sd.daemon_reload()
        dt(cfg, "pin", "llamacpp-tensor", "--reason", "bench: crash drop-in removed")
    return out


def say(*x: object) -> None:
    print(*x, file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--crash-ms", type=int, default=300)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--trace", action="store_true", help="also print one timestamped -v run of each switch")
    ap.add_argument("--keep", action="store_true", help="keep the box directory (the sandbox always goes down)")
    ap.add_argument("--timeline", action="store_true",
                    help="also run one switch each way with its steps stamped (preflight, stop, start, gate, commit), "
                         "and time the units' own verify and await-ready by hand")
    ap.add_argument("--profile", action="store_true",
                    help="also run one switch each way under cProfile and print where its wall time goes")
    a = ap.parse_args()
    root = new_run_dir("bench-switch")
    sb = Sandbox(root / "sandbox")
    d = root / "box"  # where the units can see it, wherever the checkout is
    try:
        sb.up()
        sd = Systemd(sb.systemctl_prefix(), sb.journalctl_prefix(), sb.unit_dir)
        say("packing the cpu-demo bundle ...")
        cfg = make_demo(d, sandbox_dir=sb.dir, unit_dir=sb.unit_dir, port=free_port())
        box = Box(cfg)
        model_name = yaml.safe_load(cfg.read_text())["serve"]["model_name"]
        say("installing ...")
        r = dt(cfg, "install")
        assert r.returncode == 0, r.stdout + r.stderr
        rows: dict[str, list[dict]] = {"llamacpp-tensor": [], "ftllm-dflash": []}
        stops: dict[str, float] = {}
        for i in range(a.runs):
            for target, alias in (("llamacpp-tensor", "llamacpp"), ("ftllm-dflash", "ftllm")):
                other = "ftllm-dflash" if target == "llamacpp-tensor" else "llamacpp-tensor"
                if other not in stops:  # the current backend's own exit time, once (it varies little)
                    stops[other] = direct_ready(box, other, model_name)[1]
                own, _ = direct_ready(box, target, model_name)
                wall, r = timed(cfg, "switch", alias)
                assert r.returncode == 0, r.stdout + r.stderr
                gate_ready = box.history()[-1].get("ready_s")
                rows[target].append({"switch_wall_s": wall, "target_ready_s": own, "overhead_s": wall - own,
                                     "gate_ready_s": gate_ready, "current_stop_s": stops[other]})
                say(f"  run {i + 1}: switch to {target}: {wall:.3f}s, its own ready {own:.3f}s, "
                    f"overhead {wall - own:.3f}s (of which {other}'s own exit {stops[other]:.3f}s)")
        traces = {}
        if a.trace:
            for alias in ("llamacpp", "ftllm"):
                traces[alias] = trace(cfg, "switch", alias)
        units: dict[str, dict[str, float]] = {}
        if a.timeline:
            for target, alias in (("llamacpp-tensor", "llamacpp"), ("ftllm-dflash", "ftllm")):
                traces[f"timeline {alias}"] = timeline(cfg, "switch", alias)
                units[target] = unit_commands(cfg, target)  # it serves now
        if a.profile:
            for alias in ("llamacpp", "ftllm"):
                traces[f"profile {alias}"] = profile(cfg, "switch", alias)
        say("crash-to-rollback ...")
        crashes = crash_to_rollback(cfg, sd, sb, box, a.crash_ms, a.runs)
    finally:
        if (d / "deploytool.yaml").exists() and sb.status().state == "up":
            Box(d / "deploytool.yaml").reset(Systemd(sb.systemctl_prefix(), sb.journalctl_prefix(), sb.unit_dir))
        sb.down()
        if a.keep:
            shutil.rmtree(root / "sandbox", ignore_errors=True)
            print(f"box kept in {d}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    med = {t: {k: statistics.median(r[k] for r in rs) for k in ("switch_wall_s", "target_ready_s", "overhead_s",
                                                                "current_stop_s")}
           for t, rs in rows.items()}
    c2r = statistics.median(c["crash_to_rollback_s"] for c in crashes)
    res = {"runs": a.runs, "switch": med, "crash_ms": a.crash_ms, "crash_to_rollback_s": c2r,
           "crash_runs": crashes, "goal_overhead_s": 0.5, "goal_crash_to_rollback_s": 1.0,
           "unit_commands": units, "loadavg": os.getloadavg()}
    if a.json:
        print(json.dumps({**res, "traces": traces}, indent=2))
        return 0
    for alias, lines in traces.items():
        what = alias if alias.startswith(("timeline", "profile")) else f"trace of `deploytool -v switch {alias}`"
        print(f"{what}:")
        for t, ln in lines:
            print(f"  {t:7.3f}  {ln[:160]}")
    print(f"switch control overhead, median of {a.runs} switches each way (CPU backends, tiny model, sandboxed "
          f"systemd; load {os.getloadavg()[0]:.2f}):")
    print(f"  {'target':16} {'switch wall':>12} {'own ready':>10} {'overhead':>9} {'overhead/goal':>14} "
          f"{'current exit':>13}")
    for t, m in med.items():
        print(f"  {t:16} {m['switch_wall_s']:11.3f}s {m['target_ready_s']:9.3f}s {m['overhead_s']:8.3f}s "
              f"{m['overhead_s'] / 0.5:13.2f}x {m['current_stop_s']:12.3f}s")
    print("  (current exit: the backend being replaced, run directly, from SIGTERM to its exit; the target's start "
          "and its ExecStartPre check run while it exits, its server execs once it is gone)")
    if units:
        print("the units' own deploytool commands, run by hand while the backend serves, median of 5: "
              + "; ".join(f"{t}: verify (ExecStartPre, cache warm) {u['verify']:.3f}s, await-ready (ExecStartPost, "
                          f"server ready) {u['await_ready']:.3f}s" for t, u in units.items()))
    print(f"crash to rollback start (target exits {a.crash_ms} ms after start), median of {a.runs}: "
          f"{c2r:.3f}s ({c2r / 1.0:.2f}x the 1 s goal); runs: "
          + ", ".join(f"{c['crash_to_rollback_s']:.3f}s" for c in crashes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
