#!/usr/bin/env python3
"""Time-to-ready of each real CPU backend on the tiny model (median of N runs), printed.

For each backend: spawn the server (127.0.0.1, free port), wait with deploy_tool.box.probe.health.wait_ready (20 ms
interval), then run one smoke completion, then stop it by PID. Reports spawn->ready, the first completion,
and SIGTERM->exit.

Usage: python bench/bench_ready.py [--runs 3] [--size tiny|24m] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy_tool.box.probe.health import smoke_completion, wait_ready  # noqa: E402
from tests.support import backends  # noqa: E402
from tests.support.tiny_model import write_model  # noqa: E402


def one_run(kind: str, model: Path, log_dir: Path) -> dict[str, float]:
    srv = backends.start(kind, model, model_name="tiny", log_dir=log_dir)
    try:
        wait_ready(kind, srv.base_url, "tiny", timeout=120, interval=0.02, unit_state=srv.unit_state,
                   journal_tail=srv.log_text)
        ready = time.monotonic() - srv.started
        smoke = smoke_completion(srv.base_url, "tiny", timeout=60, max_tokens=16)
        t0 = time.monotonic()
    finally:
        srv.stop()
    return {"ready_s": ready, "first_completion_s": smoke.seconds, "stop_s": time.monotonic() - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--size", choices=("tiny", "24m"), default="tiny")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-ready-") as tmp:
        model = write_model(Path(tmp) / f"{a.size}-f16.gguf", size=a.size, f16=True)
        for kind in ("llamacpp", "ftllm"):
            runs = [one_run(kind, model, Path(tmp) / "logs") for _ in range(a.runs)]
            results[kind] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            results[kind]["runs"] = a.runs
    if a.json:
        print(json.dumps({"model": a.size, "results": results}, indent=2))
        return 0
    print(f"time to ready on the {a.size} F16 model, median of {a.runs} runs (CPU, 127.0.0.1):")
    print(f"  {'backend':10} {'spawn->ready':>13} {'1st completion':>15} {'SIGTERM->exit':>14}")
    for kind, r in results.items():
        print(f"  {kind:10} {r['ready_s']:12.3f}s {r['first_completion_s']:14.3f}s {r['stop_s']:13.3f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
