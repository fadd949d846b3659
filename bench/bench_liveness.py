#!/usr/bin/env python3
"""What liveness probing costs: CPU time of the probe per tick, against the wall time between ticks.

Sets up, under a run directory of its own: a sandboxed real systemd, a unit `llamacpp-tensor.service` that runs
the real llama-server on the tiny model (on CPU, a free port), a config naming it (the cpu-demo example's shape)
and a state that records it active. Then runs `--ticks` ticks as the timer's service does, each a fresh
`python -m deploy_tool --config CFG liveness` process (interpreter start, imports, one `systemctl show` through
the sandbox's nsenter, the readiness probe, /proc reads, exit), and takes the CPU time of those processes and
their children (getrusage RUSAGE_CHILDREN: user + system) over all ticks. The first tick also sends the tiny
completion (completion_every_s: 300 by default), which is reported on its own.

    cost = (CPU per readiness tick + CPU of a completion tick * interval / completion_every_s) / interval

at the default interval (supervision.liveness.interval_s: 10 s). Goal: under 1% of one core. From the host the
`systemctl` call goes through nsenter; on a box it runs plainly (cheaper): the figure is an upper bound.

Usage: python bench/bench_liveness.py [--ticks 30] [--json] [--keep]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from deploy_tool.box.health import wait_ready  # noqa: E402
from deploy_tool.box.state import State, Store  # noqa: E402
from deploy_tool.box.systemd import Systemd  # noqa: E402
from deploy_tool.config import LivenessCfg, example_text  # noqa: E402
from deploy_tool.rehearsal.sandbox import Sandbox  # noqa: E402
from tests.support.backends import llama_server_binary  # noqa: E402
from tests.support.sandbox import free_port, new_run_dir  # noqa: E402
from tests.support.tiny_model import write_model  # noqa: E402

UNIT = "llamacpp-tensor.service"
MODEL = "qwen38-27b-ud"


def children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def tick(cfg: Path) -> tuple[float, float, dict]:
    """One tick as the timer runs it: (CPU seconds of it and its children, wall seconds, its JSON result)."""
    c0, t0 = children_cpu(), time.monotonic()
    r = subprocess.run([sys.executable, "-m", "deploy_tool", "--config", str(cfg), "--json", "liveness"],
                       capture_output=True, text=True, timeout=60, cwd=cfg.parent,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    wall, cpu = time.monotonic() - t0, children_cpu() - c0
    if r.returncode != 0:
        raise SystemExit(f"liveness tick failed ({r.returncode}): {r.stdout}{r.stderr}")
    return cpu, wall, json.loads(r.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ticks", type=int, default=30)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the run directory")
    args = ap.parse_args()

    root = new_run_dir("bench-liveness")
    sb = Sandbox(root / "sandbox")
    sd: Systemd | None = None
    try:
        sb.up()
        sd = Systemd(sb.systemctl_prefix(), sb.journalctl_prefix(), sb.unit_dir)
        port = free_port()
        model = root / "tiny-f16.gguf"
        write_model(model, size="tiny", f16=True)
        os.chmod(root, 0o755)
        binary = llama_server_binary()
        unit = (f"[Unit]\nDescription=bench llama-server\n[Service]\nType=exec\nExecStart={binary} -m {model} "
                f"--alias {MODEL} -c 512 -t 1 -ngl 0 --host 127.0.0.1 --port {port}\nRestart=on-failure\n")
        sd.install_file(UNIT, unit.encode())
        sd.daemon_reload()
        sd.start(UNIT)
        wait_ready("llamacpp", f"http://127.0.0.1:{port}", MODEL, timeout=120)
        data = yaml.safe_load(example_text("cpu-demo"))
        data["systemd"]["sandbox"] = str(sb.dir)
        data["paths"]["unit_dir"] = str(sb.unit_dir)
        data["serve"]["port"] = port
        data["backends"]["llamacpp-tensor"]["binary"] = str(binary)
        cfg = root / "deploytool.yaml"
        cfg.write_text(yaml.safe_dump(data, sort_keys=False))
        state_dir = root / "demo-root/var/lib/deploytool"
        Store(state_dir).save(State(active_backend="llamacpp-tensor"))

        first_cpu, first_wall, first = tick(cfg)  # with the tiny completion (none done yet)
        assert first["action"] == "ok", first
        cpus, walls = [], []
        for _ in range(args.ticks):
            cpu, wall, res = tick(cfg)
            assert res["action"] == "ok", res
            cpus.append(cpu)
            walls.append(wall)
        lc = LivenessCfg()
        per_tick = statistics.mean(cpus)
        completion_extra = max(0.0, first_cpu - per_tick)
        per_s = per_tick / lc.interval_s + (completion_extra / lc.completion_every_s if lc.completion_every_s else 0)
        out = {
            "ticks": args.ticks, "interval_s": lc.interval_s, "completion_every_s": lc.completion_every_s,
            "cpu_per_tick_ms": round(per_tick * 1e3, 1), "cpu_per_tick_ms_max": round(max(cpus) * 1e3, 1),
            "wall_per_tick_ms": round(statistics.median(walls) * 1e3, 1),
            "completion_tick_cpu_ms": round(first_cpu * 1e3, 1), "completion_tick_wall_ms": round(first_wall * 1e3, 1),
            "cpu_share_of_one_core_pct": round(per_s * 100, 3), "goal_pct": 1.0,
        }
        if args.json:
            print(json.dumps(out, indent=2))
        else:
            print(f"liveness tick (a fresh `deploytool liveness` process, as the timer runs it), {args.ticks} ticks:")
            print(f"  CPU per tick       {out['cpu_per_tick_ms']} ms (max {out['cpu_per_tick_ms_max']} ms), "
                  f"wall {out['wall_per_tick_ms']} ms")
            print(f"  tick with the completion: CPU {out['completion_tick_cpu_ms']} ms, wall "
                  f"{out['completion_tick_wall_ms']} ms (every {lc.completion_every_s:g} s)")
            print(f"  at the default interval ({lc.interval_s:g} s): {out['cpu_share_of_one_core_pct']}% of one core "
                  f"(goal: under 1%)")
        return 0 if per_s < 0.01 else 1
    finally:
        if sd is not None:
            with contextlib.suppress(Exception):  # the sandbox's teardown stops what is left
                sd.stop(UNIT)
        sb.down()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
