"""Benchmark: systemd sandbox up and down times (median of N runs), plus a unit start and a SIGKILL-to-failed time.

Run as root: .venv/bin/python bench/bench_sandbox.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import tempfile
import time
from pathlib import Path

from deploy_tool.box.systemd import Systemd
from deploy_tool.rehearsal.sandbox import Sandbox


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="deploytool-bench-sandbox-"))
    ups, downs, starts, kills = [], [], [], []
    try:
        for _ in range(args.runs):
            sb = Sandbox(root / "sb")
            t0 = time.perf_counter()
            sb.up()
            ups.append(time.perf_counter() - t0)
            try:
                sd = Systemd(sb.systemctl_prefix(), sb.journalctl_prefix(), sb.unit_dir)
                port = _free_port()
                sd.install_file("bench-web.service", (
                    f"[Service]\nExecStart=/usr/bin/python3 -m http.server --bind 127.0.0.1 {port}\n").encode())
                sd.daemon_reload()
                t0 = time.perf_counter()
                sd.start("bench-web.service")
                starts.append(time.perf_counter() - t0)
                host_pid = sb.host_pid(sd.show("bench-web.service").main_pid)
                t0 = time.perf_counter()
                os.kill(host_pid, signal.SIGKILL)
                while not sd.is_failed("bench-web.service"):
                    time.sleep(0.005)
                kills.append(time.perf_counter() - t0)
                sd.remove_file("bench-web.service")
            finally:
                t0 = time.perf_counter()
                sb.down()
                downs.append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def fmt(xs: list[float]) -> str:
        return (f"median {statistics.median(xs) * 1000:7.1f} ms   min {min(xs) * 1000:7.1f}   "
                f"max {max(xs) * 1000:7.1f}   (n={len(xs)})")

    print(f"sandbox up                        {fmt(ups)}")
    print(f"sandbox down                      {fmt(downs)}")
    print(f"unit start (systemctl start)      {fmt(starts)}")
    print(f"SIGKILL -> unit seen failed       {fmt(kills)}")


if __name__ == "__main__":
    main()
