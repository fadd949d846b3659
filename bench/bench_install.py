#!/usr/bin/env python3
"""Install time from a bundle (no model load: --no-start) against the hand-made ways, in one run.

Packs its own cpu-demo bundle (ftllm 0.1.8.2 + llama-server venv) under .cache/, then, interleaved, --runs times
each, on a fresh box every time (page cache warm for all):

  install        `deploytool install --no-start BUNDLE`: verify the signature and every file hash, lay the
                 release down, unpack and relocate the venv (its bytecode built at pack time, as checked-hash
                 .pyc in the archive), check the native library hashes and the OS libraries they need,
                 bootstrap deploytool's own venv, write units and env files, flip `current`, pin fingerprints
  install-rebuild  the same with --rebuild (the venv from the wheels with pip --no-index --require-hashes)
  zstd|tar       `zstd -d -c BUNDLE.tar.zst | tar -x`, then `zstd -d -c venv.tar.zst | tar -x` of the venv
                 archive it holds: the same bytes laid down with no checks at all (the speed goal: install at
                 most 2x this)
  pip            `python -m venv` + a plain `pip install --no-index --no-deps --find-links wheels -r
                 requirements.lock` of the bundle's wheels (pip's defaults otherwise, so it byte-compiles; --no-deps
                 because the lock is the closure deploytool installs: ftllm's declared CUDA extras are left out)

systemctl is /bin/true here (nothing is started), as on a box where --no-start is used. Median per method,
the install's own step breakdown, and ratios are printed.

Usage: python bench/bench_install.py [--runs 3] [--json] [--keep] [--no-rebuild]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from deploy_tool.venv import pip_env  # noqa: E402
from tests.support.demo_box import Box, bundle_in, dt, make_demo  # noqa: E402


def say(*x: object) -> None:
    print(*x, file=sys.stderr, flush=True)


def timed(argv: list[str], **kw) -> float:
    t0 = time.monotonic()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, **kw)
    return time.monotonic() - t0


def fresh_box(box: Box) -> None:
    for p in (box.root, box.env_dir, box.state_dir, box.unit_dir):
        shutil.rmtree(p, ignore_errors=True)


def run_install(cfg: Path, box: Box, bundle: Path, rebuild: bool) -> tuple[float, dict[str, float]]:
    fresh_box(box)
    t0 = time.monotonic()
    r = dt(cfg, "--json", "install", "--no-start", *(["--rebuild"] if rebuild else []), str(bundle))
    wall = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(r.stdout)
    steps = rep.get("steps") or []
    split, prev = {}, None
    for s in steps:  # step times are monotonic stamps of the CLI process: durations between consecutive steps
        if prev is not None:
            split[s["step"]] = s["t"] - prev
        prev = s["t"]
    if steps:  # before the first mark: verify the bundle into staging, unpack and relocate the venv
        split = {f"start..{steps[0]['step']}": rep["seconds"] - (steps[-1]["t"] - steps[0]["t"]), **split}
    split["CLI start and exit"] = wall - rep["seconds"]
    return wall, split


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the bundle directory under .cache/")
    ap.add_argument("--no-rebuild", action="store_true", help="skip the install --rebuild method")
    a = ap.parse_args()
    d = REPO / ".cache" / f"bench-install-{os.getpid()}"
    work = d / "work"
    try:
        say("packing the cpu-demo bundle ...")
        cfg = make_demo(d, sandbox_dir=None, unit_dir=d / "box-units", port=18099)
        data = yaml.safe_load(cfg.read_text())
        data["systemd"]["systemctl"] = ["/bin/true"]
        cfg.write_text(yaml.safe_dump(data, sort_keys=False))
        box = Box(cfg)
        bundle = bundle_in(d / "artifacts")
        bdir = bundle.parent / bundle.name.split(".tar")[0]
        assert (bdir / "venv.tar.zst").is_file(), bdir
        python = data["bundle"]["python"]
        times: dict[str, list[float]] = {"install": [], "zstd|tar": [], "pip": []}
        if not a.no_rebuild:
            times["install-rebuild"] = []
        splits: list[dict[str, float]] = []
        for i in range(a.runs):
            wall, split = run_install(cfg, box, bundle, rebuild=False)
            times["install"].append(wall)
            splits.append(split)
            if not a.no_rebuild:
                times["install-rebuild"].append(run_install(cfg, box, bundle, rebuild=True)[0])
            fresh_box(box)
            shutil.rmtree(work, ignore_errors=True)
            (work / "tar").mkdir(parents=True)
            times["zstd|tar"].append(timed(["sh", "-c", 'zstd -d -q -c "$1" | tar -x -C "$2" && mkdir "$2/v" && '
                                             'zstd -d -q -c "$2/venv.tar.zst" | tar -x -C "$2/v"', "sh",
                                             str(bundle), str(work / "tar")]))
            t = timed([python, "-m", "venv", str(work / "pip")], env=pip_env())
            t += timed([str(work / "pip" / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
                        "--no-index", "--no-deps", "--find-links", str(bdir / "wheels"), "-r",
                        str(bdir / "requirements.lock")], env=pip_env())
            times["pip"].append(t)
            say(f"  run {i + 1}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()))
            shutil.rmtree(work, ignore_errors=True)
    finally:
        if not a.keep:
            shutil.rmtree(d, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    steps = {k: statistics.median(s.get(k, 0.0) for s in splits) for k in splits[0]} if splits else {}
    res = {"runs": a.runs, "median_s": med, "all_s": times, "install_steps_s": steps,
           "bundle_bytes": bundle.stat().st_size if bundle.exists() else None, "loadavg": os.getloadavg()}
    if a.json:
        print(json.dumps(res, indent=2))
        return 0
    base = med["zstd|tar"]
    print(f"install from a bundle (--no-start, no model load), median of {a.runs} runs, warm page cache; "
          f"load {os.getloadavg()[0]:.2f}:")
    for k, v in med.items():
        print(f"  {k:16} {v:7.2f}s  {v / base:5.2f}x zstd|tar  {v / med['pip']:5.2f}x pip")
    if steps:
        print("  install steps (seconds between step marks, in the CLI process):")
        for k, v in steps.items():
            print(f"    {k:22} {v:6.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
