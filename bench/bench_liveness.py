#!/usr/bin/env python3
"""What liveness probing costs: CPU time of the probe process against wall time.

Sets up, under a run directory of its own: a sandboxed real systemd, a unit `llamacpp-tensor.service` that runs
the real llama-server on the tiny model (on CPU, a free port), a config naming it (the cpu-demo example's shape)
and a state that records it active. Then runs the probe as deploytool-liveness.service does, one
`python -m deploy_tool --config CFG liveness --watch` process, with bytecode as on the box, at a short interval
(--interval, 1 s: many ticks in little time) for --seconds, and reads the CPU time of that process and of its
children (systemctl through the sandbox's nsenter; /proc/PID/stat utime, stime, cutime, cstime) once it has
started up and at the end: CPU per tick = CPU used / ticks (wall time / interval). At the default interval
(supervision.liveness.interval_s: 10 s) the probe then costs

    CPU per tick / 10 s, plus the tiny completion (measured alone: one tick of a fresh `deploytool liveness`,
    once with it and once without) every completion_every_s (300 s)

of one core. Goal: under 1%. The interpreter's start and imports are paid once per process, not per tick (shown
apart). From the host the `systemctl` call goes through nsenter; on a box it runs plainly (cheaper): the figure
is an upper bound.

Usage: python bench/bench_liveness.py [--seconds 30] [--interval 1] [--json] [--keep]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from deploy_tool.box.probe.health import wait_ready  # noqa: E402
from deploy_tool.box.state import State, Store  # noqa: E402
from deploy_tool.box.systemd import Systemd  # noqa: E402
from deploy_tool.config import LivenessCfg, example_text  # noqa: E402
from deploy_tool.rehearsal.sandbox import Sandbox  # noqa: E402
from tests.support.backends import llama_server_binary  # noqa: E402
from tests.support.sandbox import free_port, new_run_dir  # noqa: E402
from tests.support.tiny_model import write_model  # noqa: E402

UNIT = "llamacpp-tensor.service"
MODEL = "qwen38-27b-ud"


TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int) -> float:
    """CPU seconds of `pid` and its reaped children (utime + stime + cutime + cstime)."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in f[11:15]) / TICK


def child_env(cfg: Path) -> dict[str, str]:
    """As on the box: with bytecode (the release's venvs carry it), here cached under the run directory
    (PYTHONPYCACHEPREFIX) whatever PYTHONDONTWRITEBYTECODE says in this environment."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(PYTHONPATH=str(REPO), PYTHONPYCACHEPREFIX=str(cfg.parent / "pycache"))
    return env


def one_tick(cfg: Path) -> float:
    """CPU seconds of one fresh `deploytool liveness` process (and its children), start to exit."""
    import resource

    def used() -> float:
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        return ru.ru_utime + ru.ru_stime

    c0 = used()
    r = subprocess.run([sys.executable, "-m", "deploy_tool", "--config", str(cfg), "--json", "liveness"],
                       capture_output=True, text=True, timeout=60, cwd=cfg.parent, env=child_env(cfg))
    if r.returncode != 0 or json.loads(r.stdout)["action"] != "ok":
        raise SystemExit(f"liveness tick failed ({r.returncode}): {r.stdout}{r.stderr}")
    return used() - c0


def write_cfg(cfg: Path, data: dict, **liveness: float) -> None:
    data = {**data, "supervision": {"liveness": dict(liveness)}}
    cfg.write_text(yaml.safe_dump(data, sort_keys=False))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="how long the watcher runs (after its start)")
    ap.add_argument("--interval", type=float, default=1.0, help="its interval here (the default is 10 s)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the run directory")
    args = ap.parse_args()

    root = new_run_dir("bench-liveness")
    sb = Sandbox(root / "sandbox")
    sd: Systemd | None = None
    watcher: subprocess.Popen[str] | None = None
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
        Store(root / "demo-root/var/lib/deploytool").save(State(active_backend="llamacpp-tensor"))

        # one-shot ticks: the bytecode written (warm-up), then a tick without and one with the completion
        write_cfg(cfg, data, completion_every_s=0)
        one_tick(cfg)
        fresh = min(one_tick(cfg) for _ in range(3))
        write_cfg(cfg, data, completion_every_s=1)
        time.sleep(1.1)
        with_completion = one_tick(cfg)
        completion = max(0.0, with_completion - fresh)

        # the watcher, as the service runs it
        write_cfg(cfg, data, interval_s=args.interval, completion_every_s=0)
        watcher = subprocess.Popen([sys.executable, "-m", "deploy_tool", "--config", str(cfg), "liveness",
                                    "--watch"], cwd=cfg.parent, env=child_env(cfg), stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)
        time.sleep(max(3.0, 3 * args.interval))  # started up, a few ticks in
        c0, t0 = proc_cpu(watcher.pid), time.monotonic()
        time.sleep(args.seconds)
        c1, t1 = proc_cpu(watcher.pid), time.monotonic()
        if watcher.poll() is not None:
            raise SystemExit(f"the watcher exited: {watcher.stderr.read() if watcher.stderr else ''}")
        lc = LivenessCfg()
        ticks = (t1 - t0) / args.interval
        per_tick = (c1 - c0) / ticks
        share = per_tick / lc.interval_s + (completion / lc.completion_every_s if lc.completion_every_s else 0.0)
        out = {
            "watch_seconds": round(t1 - t0, 1), "watch_interval_s": args.interval, "ticks": round(ticks),
            "watch_cpu_s": round(c1 - c0, 3), "watch_share_at_its_interval_pct": round((c1 - c0) / (t1 - t0) * 100, 2),
            "cpu_per_tick_ms": round(per_tick * 1e3, 2),
            "fresh_process_tick_cpu_ms": round(fresh * 1e3, 1), "completion_cpu_ms": round(completion * 1e3, 1),
            "default_interval_s": lc.interval_s, "completion_every_s": lc.completion_every_s,
            "cpu_share_of_one_core_pct": round(share * 100, 3), "goal_pct": 1.0,
            "load_average": os.getloadavg()[0],
        }
        if args.json:
            print(json.dumps(out, indent=2))
        else:
            print(f"liveness --watch at a {args.interval:g} s interval, {out['watch_seconds']} s "
                  f"(~{out['ticks']} ticks): {out['watch_cpu_s']} s CPU = "
                  f"{out['watch_share_at_its_interval_pct']}% of one core at that interval")
            print(f"  CPU per tick        {out['cpu_per_tick_ms']} ms (readiness probe, systemctl show, /proc reads)")
            print(f"  a one-shot process  {out['fresh_process_tick_cpu_ms']} ms per tick (interpreter and imports "
                  f"each time: why the unit is one long-running process)")
            print(f"  tiny completion     +{out['completion_cpu_ms']} ms every {lc.completion_every_s:g} s")
            print(f"  at the default interval ({lc.interval_s:g} s): {out['cpu_share_of_one_core_pct']}% of one "
                  f"core (goal: under 1%; load average {out['load_average']:.1f})")
        return 0 if share < 0.01 else 1
    finally:
        if watcher is not None and watcher.poll() is None:
            watcher.terminate()
            watcher.wait(10)
        if sd is not None:
            with contextlib.suppress(Exception):  # the sandbox's teardown stops what is left
                sd.stop(UNIT)
        sb.down()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
