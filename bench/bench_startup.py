"""Startup time of `deploytool --version`, `--help` and `check` against a bare `python -c pass`.

Target: interpreter start plus at most 150 ms. All commands are measured in the same run, interleaved round
by round (so background load hits them alike), median of N rounds (default 10). `check` runs on both embedded
examples, written by `deploytool init` into a temporary directory; cpu-demo's model file is a valid GGUF
header without tensors there (`check` reads only the header).

Bytecode: pip compiles .pyc files on install, so the budget is judged with a bytecode cache (written once,
during the warm-up round, into the git-ignored __pycache__ directories, even when the calling shell sets
PYTHONDONTWRITEBYTECODE=1).

Besides wall time (the budget), the children's CPU time (user + sys) is shown: on a busy machine it moves
far less than wall time, so it tells a slow start from a crowded one.

    python bench/bench_startup.py [--rounds 10] [--json]

Then what the Python processes on a switch's path spend importing (issue 26's switch overhead: the CLI's own
process, and the target unit's ExecStartPre `verify` and ExecStartPost `await-ready`, each an interpreter of its own):
the wall time of importing each one's modules in a fresh interpreter, and how much of it is the creation of
dataclasses (the config's and the reports' frozen classes; `dataclasses._process_class` timed), median of the rounds.

Exit status 1 when a median exceeds the budget (python -c pass + 150 ms).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BUDGET_MS = 150.0


def _deploytool() -> list[str]:
    """The console script next to this interpreter (what users run), else `python -m deploy_tool`."""
    script = Path(sys.executable).with_name("deploytool")
    return [str(script)] if script.exists() else [sys.executable, "-m", "deploy_tool"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPYCACHEPREFIX", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


ENV: dict[str, str] = {}


def _work_base() -> str | None:
    """Where the examples are written: not under /tmp or a home directory, which the units would not see
    (`check` refuses such a box: unit-path-hidden), so the same directory the test boxes use when it can be
    made, else the default temporary directory (check then reports those errors)."""
    base = Path("/var/lib/deploytool-bench")
    try:
        base.mkdir(mode=0o755, exist_ok=True)
        return str(base)
    except OSError:
        return None


def _time(argv: list[str], cwd: Path) -> tuple[float, float]:
    """(wall ms, child CPU ms) of one run."""
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120, env=ENV)
    dt = (time.perf_counter() - t0) * 1000
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime) * 1000
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {r.returncode}: {r.stderr.decode(errors='replace')[-400:]}")
    return dt, cpu


#: the modules each process on a switch's path imports before it does anything (see the command modules' imports)
IMPORT_SETS = {
    "switch (the CLI)": "import deploy_tool.cli; from deploy_tool.box import operations",
    "verify (ExecStartPre)": "import deploy_tool.cli; from deploy_tool.box import fingerprint; "
                             "from deploy_tool import strictmodes, portwait",
    "await-ready (ExecStartPost)": "import deploy_tool.cli; from deploy_tool.box.probe import ready",
}

_IMPORT_PROBE = """
import dataclasses, json, sys, time
orig = dataclasses._process_class
spent = [0.0, 0]
def timed(*a, **k):
    t = time.perf_counter(); r = orig(*a, **k); spent[0] += time.perf_counter() - t; spent[1] += 1; return r
dataclasses._process_class = timed
t0 = time.perf_counter()
exec(sys.argv[1])
print(json.dumps([time.perf_counter() - t0, spent[0], spent[1]]))
"""


def import_costs(rounds: int) -> list[dict[str, Any]]:
    """Per IMPORT_SETS entry: median import wall (ms), of it dataclass creation (ms), and how many classes."""
    got: dict[str, list[list[float]]] = {k: [] for k in IMPORT_SETS}
    for _ in range(rounds + 1):  # the first round warms the page cache and the .pyc files
        for name, code in IMPORT_SETS.items():
            r = subprocess.run([sys.executable, "-c", _IMPORT_PROBE, code], capture_output=True, text=True,
                               check=True, env=ENV)
            got[name].append(json.loads(r.stdout))
    out = []
    for name, runs in got.items():
        runs = runs[1:]
        out.append({"process": name, "imports_ms": round(statistics.median(x[0] for x in runs) * 1000, 1),
                    "dataclasses_ms": round(statistics.median(x[1] for x in runs) * 1000, 1),
                    "dataclasses": int(runs[0][2])})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    ENV.update(_env())
    dt = _deploytool()
    with tempfile.TemporaryDirectory(prefix="bench-startup-", dir=_work_base()) as td:
        work = Path(td)
        os.chmod(work, 0o755)  # a DynamicUser server must pass through it (check: unit-path-hidden)
        cmds: dict[str, list[str]] = {"python -c pass": [sys.executable, "-c", "pass"],
                                      "deploytool --version": [*dt, "--version"],
                                      "deploytool --help": [*dt, "--help"]}
        for ex in ("two-2080ti", "cpu-demo"):
            d = work / ex
            d.mkdir()
            subprocess.run([*dt, "init", "--example", ex, "--out", str(d / "deploytool.yaml")], check=True,
                           stdout=subprocess.DEVNULL, env=ENV)
            if ex == "cpu-demo":
                (d / "models").mkdir()
                # an empty but valid GGUF (magic, version 3, no tensors, no metadata): check reads its header
                (d / "models" / "tiny-f16.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))
            cmds[f"deploytool check ({ex})"] = [*dt, "--config", str(d / "deploytool.yaml"), "check"]
        for argv_ in cmds.values():  # warm the page cache and .pyc files once
            _time(argv_, work)
        samples: dict[str, list[float]] = {k: [] for k in cmds}
        cpu: dict[str, list[float]] = {k: [] for k in cmds}
        for _ in range(args.rounds):
            for name, argv_ in cmds.items():
                wall, c = _time(argv_, work)
                samples[name].append(wall)
                cpu[name].append(c)
    base = statistics.median(samples["python -c pass"])
    base_cpu = statistics.median(cpu["python -c pass"])
    rows: list[dict[str, Any]] = []
    for name, s in samples.items():
        med = statistics.median(s)
        mc = statistics.median(cpu[name])
        rows.append({"command": name, "median_ms": round(med, 1), "min_ms": round(min(s), 1),
                     "max_ms": round(max(s), 1), "ratio": round(med / base, 2),
                     "over_python_ms": round(med - base, 1), "cpu_median_ms": round(mc, 1),
                     "cpu_over_python_ms": round(mc - base_cpu, 1)})
    worst = max(r["over_python_ms"] for r in rows)
    ok = worst <= BUDGET_MS
    imports = import_costs(args.rounds)
    if args.json:
        print(json.dumps({"rounds": args.rounds, "budget_ms": BUDGET_MS, "ok": ok, "cpus": os.cpu_count(),
                          "rows": rows, "imports": imports}, indent=2))
    else:
        print(f"{'command':32} {'median':>9} {'min':>8} {'max':>8} {'ratio':>6} {'+python':>9} {'cpu':>8} "
              f"{'cpu+py':>8}")
        for r in rows:
            print(f"{r['command']:32} {r['median_ms']:7.1f}ms {r['min_ms']:6.1f}ms {r['max_ms']:6.1f}ms "
                  f"{r['ratio']:5.2f}x {r['over_python_ms']:7.1f}ms {r['cpu_median_ms']:6.1f}ms "
                  f"{r['cpu_over_python_ms']:6.1f}ms")
        print(f"budget: python -c pass + {BUDGET_MS:.0f} ms = {base + BUDGET_MS:.1f} ms; worst +{worst:.1f} ms: "
              f"{'OK' if ok else 'OVER BUDGET'} (median of {args.rounds}, same run, interleaved)")
        print("importing what each process on a switch's path imports, in a fresh interpreter "
              f"(median of {args.rounds}):")
        for r in imports:
            print(f"  {r['process']:28} {r['imports_ms']:6.1f} ms, of which creating {r['dataclasses']} dataclasses "
                  f"{r['dataclasses_ms']:.1f} ms ({r['dataclasses_ms'] / r['imports_ms']:.0%})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
