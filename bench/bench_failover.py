#!/usr/bin/env python3
"""Failover latency: from the active backend's final failure to the fallback serving, on a real sandboxed systemd.

Sets up its own cpu-demo box (packed bundle, sandboxed systemd, `deploytool install`: ftllm-dflash serves) under
the test run root, then for each run:

1. `deploytool switch llamacpp` (committed), then a crash loop as a box meets one: llama-server's main process is
   SIGKILLed (as the out-of-memory killer does) each time systemd has restarted it, until systemd gives up
   (StartLimitBurst=3 starts within StartLimitIntervalSec=, RestartSec=10 apart) and starts the rendered
   `deploytool-failover@llamacpp-tensor.service` (OnFailure=).
2. Final failure: the moment systemd gave up, the unit's InactiveEnterTimestampMonotonic (CLOCK_MONOTONIC, which
   the sandbox shares). Serving: the first chat completion answered on the port (polled every 20 ms).
   Also shown: from the last SIGKILL (the last crash; systemd waits RestartSec= before its restart finds the
   start limit hit), and where the time goes (systemd starting the failover unit, the failover's own run).
3. Side by side: the fallback's own time to ready, run directly in the same run (its unit's ExecStart line, same
   binary, model and env file, another free port), as bench_switch.py measures it.

Between runs the last failover is dropped from state.json (standing in for supervision.failover.window_s
passing). Goal: failure to serving <= the fallback's own time to ready + 1 s.

Usage: python bench/bench_failover.py [--runs 3] [--json] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import yaml  # noqa: E402
from bench_switch import direct_ready, journal  # noqa: E402

from deploy_tool.box.systemd import Systemd  # noqa: E402
from deploy_tool.rehearsal.sandbox import Sandbox  # noqa: E402
from tests.support.demo_box import Box, active_units, chat, dt, make_demo  # noqa: E402
from tests.support.sandbox import free_port, new_run_dir  # noqa: E402

F, L = "ftllm-dflash", "llamacpp-tensor"
FU, LU = f"{F}.service", f"{L}.service"
GOAL_S = 1.0


def say(*x: object) -> None:
    print(*x, file=sys.stderr, flush=True)


def prop(sd: Systemd, unit: str, name: str) -> str:
    return sd._ctl("show", "-p", name, "--value", unit).stdout.strip()


def crash_loop(sd: Systemd, unit: str, timeout: float = 150) -> tuple[float, float]:
    """SIGKILL `unit`'s main process each time systemd has (re)started it, until it fails for good; (monotonic
    time of the last SIGKILL, monotonic time systemd gave up)."""
    deadline = time.monotonic() + timeout
    last_pid, last_kill = 0, 0.0
    while time.monotonic() < deadline:
        st = sd.show(unit)
        if st.active_state == "failed":
            return last_kill, int(prop(sd, unit, "InactiveEnterTimestampMonotonic")) / 1e6
        if st.active_state == "active" and st.main_pid and st.main_pid != last_pid:
            sd.kill(unit, "SIGKILL", who="main")
            last_pid, last_kill = st.main_pid, time.monotonic()
        time.sleep(0.01)
    raise SystemExit(f"{unit} never failed for good: {sd.show(unit)}")


def serving(port: int, model: str, timeout: float = 120) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if chat(port, model)["choices"][0]["message"]["content"]:
                return time.monotonic()
        except (OSError, ValueError, KeyError, IndexError):
            pass
        time.sleep(0.02)
    raise SystemExit("the fallback never served")


def forget_last_failover(box: Box) -> None:
    p = box.state_dir / "state.json"
    st = json.loads(p.read_text())
    st.setdefault("extra", {}).pop("failover", None)
    p.write_text(json.dumps(st, indent=2, sort_keys=True) + "\n")


def unit_started(sb: Sandbox, unit: str, since: float, word: str = "Starting") -> float | None:
    """Realtime of the manager's first "<word> <unit>..." entry for `unit` at or after `since` (epoch seconds):
    "Starting" when its start job begins, "Started" once its server was exec'd (after ExecStartPre)."""
    for e in journal(sb, unit):
        t = int(e["__REALTIME_TIMESTAMP"]) / 1e6
        if t >= since and isinstance(e.get("MESSAGE"), str) and e["MESSAGE"].startswith(word) \
                and e.get("SYSLOG_IDENTIFIER") == "systemd":
            return t
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the box directory (the sandbox always goes down)")
    a = ap.parse_args()
    root = new_run_dir("bench-failover")
    sb = Sandbox(root / "sandbox")
    d = root / "box"
    runs: list[dict] = []
    try:
        sb.up()
        sd = Systemd(sb.systemctl_prefix(), sb.journalctl_prefix(), sb.unit_dir)
        say("packing the cpu-demo bundle ...")
        port = free_port()
        cfg = make_demo(d, sandbox_dir=sb.dir, unit_dir=sb.unit_dir, port=port)
        box = Box(cfg)
        model = yaml.safe_load(cfg.read_text())["serve"]["model_name"]
        say("installing ...")
        r = dt(cfg, "install")
        assert r.returncode == 0, r.stdout + r.stderr
        for i in range(a.runs):
            forget_last_failover(box)
            r = dt(cfg, "switch", "llamacpp")
            assert r.returncode == 0, r.stdout + r.stderr
            own, _ = direct_ready(box, F, model)  # the fallback's own time to ready, while llama.cpp serves
            n = len(box.history())
            wall0 = time.time() - 1
            say(f"  run {i + 1}: crash loop of {L} (RestartSec=10 between its restarts) ...")
            last_kill, failed = crash_loop(sd, LU)
            served = serving(port, model)
            deadline = time.monotonic() + 60
            while not [e for e in box.history()[n:] if e["event"] == "failover"] and time.monotonic() < deadline:
                time.sleep(0.05)
            ev = [e for e in box.history()[n:] if e["event"] == "failover" and e["result"] == "ok"]
            assert ev, box.history()[n:]
            assert active_units(sd) == {FU}
            # where the time goes: systemd starting the failover unit (realtime; the offset to monotonic now)
            off = time.time() - time.monotonic()
            unit_at = unit_started(sb, f"deploytool-failover@{L}.service", wall0)
            f_starting = unit_started(sb, FU, wall0)
            f_started = unit_started(sb, FU, wall0, "Started")
            row = {"failure_to_serving_s": served - failed, "own_ready_s": own,
                   "overhead_s": served - failed - own, "last_crash_to_serving_s": served - last_kill,
                   "failover_unit_start_s": (unit_at - off - failed) if unit_at else None,
                   "fallback_start_job_s": (f_starting - off - failed) if f_starting else None,
                   "fallback_exec_s": (f_started - off - failed) if f_started else None,
                   "failover_run_s": ev[-1].get("seconds"), "gate_ready_s": ev[-1].get("ready_s")}
            row["skipped_failovers"] = len([e for e in box.history()[n:] if e["event"] == "failover"]) - 1
            runs.append(row)
            say(f"  run {i + 1}: failover unit at {row['failover_unit_start_s'] or float('nan'):.3f}s, start job of "
                f"{F} at {row['fallback_start_job_s'] or float('nan'):.3f}s, exec'd at "
                f"{row['fallback_exec_s'] or float('nan'):.3f}s; other failover runs (skipped): "
                f"{row['skipped_failovers']}")
            say(f"  run {i + 1}: final failure to {F} serving {row['failure_to_serving_s']:.3f}s, its own ready "
                f"{own:.3f}s, overhead {row['overhead_s']:.3f}s; from the last crash "
                f"{row['last_crash_to_serving_s']:.1f}s")
    finally:
        if (d / "deploytool.yaml").exists() and sb.status().state == "up":
            Box(d / "deploytool.yaml").reset(Systemd(sb.systemctl_prefix(), sb.journalctl_prefix(), sb.unit_dir))
        sb.down()
        if a.keep:
            shutil.rmtree(root / "sandbox", ignore_errors=True)
            print(f"box kept in {d}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in runs if r[k] is not None) for k in runs[0]
           if any(r[k] is not None for r in runs)}
    res = {"runs": runs, "median": med, "goal_overhead_s": GOAL_S, "loadavg": os.getloadavg()}
    if a.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"failover from {L} (crash loop after a committed switch) to {F}, median of {a.runs} (CPU backends, "
          f"tiny model, sandboxed systemd; load {os.getloadavg()[0]:.2f}):")
    print(f"  {'final failure -> serving':28} {'fallback own ready':>19} {'overhead':>9} {'goal':>6}")
    print(f"  {med['failure_to_serving_s']:27.3f}s {med['own_ready_s']:18.3f}s {med['overhead_s']:8.3f}s "
          f"{GOAL_S:5.1f}s  ({'met' if med['overhead_s'] <= GOAL_S else 'NOT met'})")
    print("  runs: " + ", ".join(f"{r['failure_to_serving_s']:.3f}s (own {r['own_ready_s']:.3f}s)" for r in runs))
    if "failover_unit_start_s" in med:
        print(f"  after the final failure: the failover unit starts at {med['failover_unit_start_s']:.3f}s, "
              f"its start job of {F} at {med.get('fallback_start_job_s', float('nan')):.3f}s, {F}'s server is "
              f"exec'd (after its ExecStartPre check) at {med.get('fallback_exec_s', float('nan')):.3f}s; the "
              f"failover's switch (intent to commit): {med.get('failover_run_s', float('nan')):.3f}s")
    print(f"  from the last crash (systemd waits RestartSec=10 before its restart finds the start limit hit): "
          f"{med['last_crash_to_serving_s']:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
