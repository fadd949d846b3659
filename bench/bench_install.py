#!/usr/bin/env python3
"""Install time from a bundle (no model load: --no-start) against the unpack it has to do, in one run.

Packs its own cpu-demo bundle (ftllm 0.1.8.2 + llama-server venv, wheels from .cache/wheels-demo) once, into
/var/lib/deploytool-test/bench-install-cache (kept: a rerun installs the same cached bundle; --fresh packs again),
with a sandboxed systemd 252 there as the box's (as `make demo` has it; --no-sandbox: systemctl is /bin/true), then, interleaved, --runs times each, on a fresh box every time (page cache warm for all):

  install        `deploytool install --no-start BUNDLE`: verify the signature and every file hash into a private
                 copy, unpack and relocate the venv (bytecode built at pack time), check the OS libraries and the
                 native library hashes, bootstrap deploytool's own venv (in parallel), write units and env files,
                 flip `current`, pin the whole release, daemon-reload. The system's zstd and GNU tar do the
                 decompressing and the writing where present, every header checked by deploytool first
  install-py     the same with DEPLOYTOOL_UNPACK=python: the Python writer, as on a box without zstd or GNU tar
  zstd|tar       `zstd -d -c BUNDLE.tar.zst | tar -x`, then `zstd -d -c PART | tar -x` of each of the venv's
                 archives it holds (venv-parts/*.tar.zst, or a bundle's one venv.tar.zst before 2026-12-06): the same
                 bytes laid down with no checks at all (the goal: install at most 2x this)
  upgrade        `deploytool install --no-start B` onto the box `install` left, B one wheel apart from the bundle
                 (tests/support/ship_bundles.py's rebuilt wheel, packed once beside it): the venv parts B shares
                 with the installed release are hard-linked from it and hashed against its pins, the changed one
                 unpacked (deploy_tool.box.venvreuse)
  install-rebuild  (--rebuild) the same install with --rebuild (pip --no-index --require-hashes from the wheels)
  pip            (--pip) `python -m venv` + `pip install --no-index --no-deps` of the bundle's wheels

Printed: the median per method and its ratio to zstd|tar, and where install's time goes (the CLI's own step
marks: verify, unpack, venv finish and relocation, native library hashes, the tool venv wait, laying down, units,
pin, daemon-reload, commit, CLI start and exit), with the load average before and after.

Usage: python bench/bench_install.py [--runs 3] [--json] [--no-sandbox] [--rebuild] [--pip] [--fresh] [--no-upgrade]
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


def run_install(cfg: Path, reset, bundle: Path, *, rebuild: bool = False,
                env: dict[str, str] | None = None) -> tuple[float, dict[str, float]]:
    if reset is not None:
        reset()
    t0 = time.monotonic()
    r = dt(cfg, "--json", "install", "--no-start", *(["--rebuild"] if rebuild else []), str(bundle), env=env)
    wall = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(r.stdout)
    return wall, breakdown(rep, wall)


LINKED: list[tuple[int, int]] = []  # (venv parts linked, files linked) of each install, in order


def breakdown(rep: dict, wall: float) -> dict[str, float]:
    """Where one install's wall time went, from its step marks (monotonic stamps of the CLI process)."""
    steps = rep.get("steps") or []
    if not steps or steps[0]["step"] != "verified":
        return {}
    out = {"verify (lock, signature, every file hashed into a private copy)": steps[0].get("since_start_s", 0.0)}
    prev = steps[0]["t"]
    for s in steps[1:]:
        d = s["t"] - prev
        prev = s["t"]
        if s["step"] == "venv-ready" and "unpack_s" in s:
            out["unpack the venv's archives"] = s["unpack_s"]
            out["venv finish (python -m venv) + relocate"] = s["finish_s"] + s["relocate_s"]
            out["link the shared parts, hash them against the pins"] = s.get("link_s", 0.0)
            out["venv-ready: rest (staging rename)"] = (d - s["unpack_s"] - s["finish_s"] - s["relocate_s"]
                                                        - s.get("link_s", 0.0))
            LINKED.append((s.get("reused_parts", 0), s.get("linked_files", 0)))
        else:
            name = {"native-libs-checked": "OS libraries + native library hashes", "tool-ready": "tool venv (wait)",
                    "release-laid-down": "lay down (rename, modes)", "units-written": "units + env files",
                    "current-flipped": "flip current", "pinned": "pin the whole release (hash)",
                    "daemon-reloaded": "daemon-reload"}.get(s["step"], s["step"])
            out[name] = d
    out["commit (state, history, prune)"] = rep["seconds"] - out[next(iter(out))] - (steps[-1]["t"] - steps[0]["t"])
    out["CLI start and exit"] = wall - rep["seconds"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--fresh", action="store_true", help="pack the bundle again (it is cached between runs)")
    ap.add_argument("--no-sandbox", action="store_true", help="systemctl is /bin/true instead of a sandboxed systemd")
    ap.add_argument("--rebuild", action="store_true", help="also time install --rebuild")
    ap.add_argument("--pip", action="store_true", help="also time a plain pip install of the wheels")
    ap.add_argument("--no-upgrade", action="store_true", help="do not time the install of a release one wheel apart")
    a = ap.parse_args()
    from deploy_tool.archive import UNPACK_ENV, unpack_tools
    from tests.support.sandbox import RUN_PARENT, free_port, new_run_dir

    # the box (its config, keys and packed bundle: the units hold its paths) is kept between runs at a fixed place,
    # so a rerun installs the cached bundle; --fresh packs again
    cache = RUN_PARENT / "bench-install-cache"
    if a.fresh:
        shutil.rmtree(cache, ignore_errors=True)
    root = new_run_dir("bench-install")
    d, work = cache / "box", root / "work"
    sb = None
    load0 = os.getloadavg()
    try:
        if not a.no_sandbox:
            from deploy_tool.box.systemd import Systemd
            from deploy_tool.rehearsal.sandbox import Sandbox

            sb = Sandbox(cache / "sandbox")
            sb.up()
            sd = Systemd(sb.systemctl_prefix(), sb.journalctl_prefix(), sb.unit_dir)
        cfg = d / "deploytool.yaml"
        unit_dir = sb.unit_dir if sb else d / "box-units"
        if not (d / "artifacts").is_dir() or not (d / ".packed").is_file():
            say("packing the cpu-demo bundle (cached for the next run) ...")
            cache.mkdir(parents=True, exist_ok=True)
            os.chmod(cache, 0o755)
            cfg = make_demo(d, sandbox_dir=cache / "sandbox", unit_dir=cache / "sandbox" / "etc-systemd-system",
                            port=free_port())
            (d / ".packed").write_text(time.strftime("%Y-%m-%dT%H:%M:%S\n"))
        else:
            say(f"the cached cpu-demo bundle in {d / 'artifacts'} (packed {(d / '.packed').read_text().strip()})")
        if not a.no_upgrade and not (d / ".packed-b").is_file():
            from tests.support.ship_bundles import one_wheel_variant

            say("packing a bundle one wheel apart (cached for the next run) ...")
            for stale in ("wheels-b", "artifacts-b"):
                shutil.rmtree(d / stale, ignore_errors=True)
            one_wheel_variant(cfg)
            (d / ".packed-b").write_text(time.strftime("%Y-%m-%dT%H:%M:%S\n"))
        data = yaml.safe_load(cfg.read_text())
        assert data["paths"]["unit_dir"] == str(cache / "sandbox" / "etc-systemd-system") or sb is None, unit_dir
        data["systemd"]["systemctl"] = ["/bin/true"] if sb is None else ["systemctl"]
        data["systemd"]["sandbox"] = str(sb.dir) if sb else None
        cfg.write_text(yaml.safe_dump(data, sort_keys=False))
        cfg_b = d / "deploytool-b.yaml"  # B's config (its own paths.config, else the same box)
        if not a.no_upgrade:
            data_b = yaml.safe_load(cfg_b.read_text())
            data_b["systemd"] = data["systemd"]
            cfg_b.write_text(yaml.safe_dump(data_b, sort_keys=False))
        box = Box(cfg)

        def reset() -> None:
            if sb is not None:
                box.reset(sd)
            else:
                for p in (box.root, box.env_dir, box.state_dir, box.unit_dir):
                    shutil.rmtree(p, ignore_errors=True)

        bundle = bundle_in(d / "artifacts")
        bdir = bundle.parent / bundle.name.split(".tar")[0]
        assert (bdir / "venv-parts").is_dir() or (bdir / "venv.tar.zst").is_file(), bdir
        python = data["bundle"]["python"]
        times: dict[str, list[float]] = {"install": [], "install-py": [], "zstd|tar": [], "zstd|tar venv only": []}
        if not a.no_upgrade:
            times["upgrade"] = []
            bundle_b = bundle_in(d / "artifacts-b")
        splits_up: list[dict[str, float]] = []
        up_linked = (0, 0)
        if a.rebuild:
            times["install-rebuild"] = []
        if a.pip:
            times["pip"] = []
        splits: list[dict[str, float]] = []
        splits_py: list[dict[str, float]] = []
        for i in range(a.runs):
            wall, split = run_install(cfg, reset, bundle)
            times["install"].append(wall)
            splits.append(split)
            if not a.no_upgrade:
                wall, split = run_install(cfg_b, None, bundle_b)  # onto what install left
                assert LINKED[-1][0] > 0, f"the upgrade linked no venv part: {LINKED[-1]}"
                up_linked = LINKED[-1]
                times["upgrade"].append(wall)
                splits_up.append(split)
            wall, split = run_install(cfg, reset, bundle, env={UNPACK_ENV: "python"})
            times["install-py"].append(wall)
            splits_py.append(split)
            if a.rebuild:
                times["install-rebuild"].append(run_install(cfg, reset, bundle, rebuild=True)[0])
            reset()
            shutil.rmtree(work, ignore_errors=True)
            (work / "tar").mkdir(parents=True)
            t0 = time.monotonic()
            subprocess.run(["sh", "-c", 'zstd -d -q -c "$1" | tar -x -C "$2"', "sh", str(bundle), str(work / "tar")],
                           check=True)
            t1 = time.monotonic()
            subprocess.run(["sh", "-c", 'mkdir "$1/v" && for p in "$1"/venv-parts/*.tar.zst "$1"/venv.tar.zst; do '
                            '[ ! -f "$p" ] || zstd -d -q -c "$p" | tar -x -C "$1/v" || exit 1; done', "sh",
                            str(work / "tar")], check=True)
            t2 = time.monotonic()
            times["zstd|tar"].append(t2 - t0)
            times["zstd|tar venv only"].append(t2 - t1)
            if a.pip:
                t = timed([python, "-m", "venv", str(work / "pip")], env=pip_env())
                t += timed([str(work / "pip" / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
                            "--no-index", "--no-deps", "--find-links", str(bdir / "wheels"), "-r",
                            str(bdir / "requirements.lock")], env=pip_env())
                times["pip"].append(t)
            say(f"  run {i + 1} (load {os.getloadavg()[0]:.2f}): "
                + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()))
            shutil.rmtree(work, ignore_errors=True)
        bundle_bytes = bundle.stat().st_size
        release_bytes = sum(f["size"] for f in json.loads((bdir / "MANIFEST").read_text())["files"])
    finally:
        if sb is not None:
            if (d / "deploytool.yaml").exists() and sb.status().state == "up":
                Box(d / "deploytool.yaml").reset(sd)
            sb.down()
        shutil.rmtree(root, ignore_errors=True)
    load1 = os.getloadavg()
    med = {k: statistics.median(v) for k, v in times.items()}

    def med_steps(ss: list[dict[str, float]]) -> dict[str, float]:
        return {k: statistics.median(s.get(k, 0.0) for s in ss) for k in ss[0]} if ss and ss[0] else {}

    steps, steps_py, steps_up = med_steps(splits), med_steps(splits_py), med_steps(splits_up)
    base = med["zstd|tar"]
    res = {"runs": a.runs, "median_s": med, "all_s": times, "install_steps_s": steps, "install_py_steps_s": steps_py,
           "upgrade_steps_s": steps_up,
           "ratio_install_vs_zstd_tar": med["install"] / base, "ratio_install_py_vs_zstd_tar": med["install-py"] / base,
           "bundle_bytes": bundle_bytes, "manifest_bytes": release_bytes, "unpack_tools": unpack_tools(),
           "sandbox": sb is not None, "loadavg_before": load0, "loadavg_after": load1, "cpus": os.cpu_count()}
    if a.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"install --no-start of a cpu-demo bundle ({bundle_bytes / 1e6:.0f} MB archive) into a fresh "
          f"{'sandboxed ' if sb else ''}box, median of {a.runs} runs, warm page cache; load "
          f"{load0[0]:.2f} before, {load1[0]:.2f} after, {os.cpu_count()} cores; system tools: {unpack_tools()}")
    for k, v in med.items():
        print(f"  {k:20} {v:7.2f}s  {v / base:5.2f}x zstd|tar   (runs: {', '.join(f'{x:.2f}' for x in times[k])})")
    print(f"install / zstd|tar: {med['install'] / base:.2f}x (goal <= 2x); with the Python writer "
          f"{med['install-py'] / base:.2f}x")
    if "upgrade" in med:
        print(f"upgrade / install: {med['upgrade'] / med['install']:.2f}x (a release one wheel apart onto the first;"
              f" it linked {up_linked[0]} venv parts, {up_linked[1]} files, and unpacked the rest)")
    if steps:
        print("where install's time goes (median seconds between the CLI's step marks; the Python writer, and the"
              " upgrade, beside):")
        for k, v in steps.items():
            print(f"    {k:62} {v:6.2f}s   {steps_py.get(k, 0.0):6.2f}s   {steps_up.get(k, 0.0):6.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
