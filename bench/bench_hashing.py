"""How fast does deploytool hash a bundle's files (the MANIFEST build and `bundle verify`)?

One run compares, on the same ~1 GB of files with the page cache warm (hashing is measured, not the disk):
  * manifest.hash_files(workers=all cores)   1 MiB streamed reads, files spread over threads
  * manifest.hash_files(workers=1)           the same on one core
  * `sha256sum FILES...`                      coreutils, one process
  * `openssl speed -evp sha256`               single-core SHA-256 peak (16 KiB and 1 MiB blocks)
Goals: all-core hashing >= 1.2 GB/s and >= 2x sha256sum. Peak RSS growth is printed to show memory stays flat.

Files: the real ftllm 0.1.8.2 package of this venv (its 516 MB libfastllm_tools.so and the Python files
around it) plus generated files (incompressible, 8-96 MB) in .cache/bench-hashing/ up to --size MB.

Usage: python bench/bench_hashing.py [--size MB] [--repeat N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from deploy_tool.manifest import hash_files  # noqa: E402

GEN_SIZES_MB = (96, 64, 64, 48, 32, 32, 16, 16, 8, 8, 8, 8)


def file_set(target_mb: int) -> list[Path]:
    files: list[Path] = []
    ftllm = Path(sysconfig.get_paths()["purelib"]) / "ftllm"
    if ftllm.is_dir():
        files += sorted(p for p in ftllm.rglob("*") if p.is_file() and not p.is_symlink())
    have = sum(p.stat().st_size for p in files)
    gen = REPO / ".cache" / "bench-hashing"
    gen.mkdir(parents=True, exist_ok=True)
    i = 0
    while have < target_mb * 1_000_000:
        mb = GEN_SIZES_MB[i % len(GEN_SIZES_MB)]
        p = gen / f"blob-{i:03d}-{mb}M.bin"
        if not p.exists() or p.stat().st_size != mb << 20:
            with open(p, "wb") as f:
                for _ in range(mb):
                    f.write(os.urandom(1 << 20))
        files.append(p)
        have += p.stat().st_size
        i += 1
    return files


def warm(files: list[Path]) -> None:
    buf = bytearray(1 << 20)
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def openssl_peak() -> dict[str, float]:
    out = {}
    for size in (16384, 1 << 20):
        r = subprocess.run(["openssl", "speed", "-evp", "sha256", "-seconds", "2", "-bytes", str(size)],
                           capture_output=True, text=True, check=True)
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("sha256")][-1]
        kbs = float(re.findall(r"([\d.]+)k", line)[-1])
        out[f"{size}"] = kbs * 1000 / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=1000, help="total MB to hash (default 1000)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    files = file_set(args.size)
    total = sum(p.stat().st_size for p in files)
    warm(files)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cores = os.cpu_count() or 1
    want = hash_files(files, workers=1)
    t_all = best(lambda: hash_files(files), args.repeat)
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t_one = best(lambda: hash_files(files, workers=1), args.repeat)

    def coreutils() -> None:
        r = subprocess.run(["sha256sum", *map(str, files)], capture_output=True, text=True, check=True)
        got = dict(reversed(ln.split("  ", 1)) for ln in r.stdout.splitlines())
        assert got[str(files[0])] == want[files[0]]

    t_sum = best(coreutils, args.repeat)
    peak = openssl_peak()
    res = {
        "files": len(files), "bytes": total, "cores": cores,
        "hash_files_all_cores_s": round(t_all, 3), "hash_files_all_cores_GBps": round(total / t_all / 1e9, 3),
        "hash_files_one_core_s": round(t_one, 3), "hash_files_one_core_GBps": round(total / t_one / 1e9, 3),
        "sha256sum_s": round(t_sum, 3), "sha256sum_GBps": round(total / t_sum / 1e9, 3),
        "openssl_peak_GBps_16KiB": round(peak["16384"], 3), "openssl_peak_GBps_1MiB": round(peak[str(1 << 20)], 3),
        "speedup_vs_sha256sum": round(t_sum / t_all, 2),
        "all_cores_vs_openssl_single_core_peak": round(total / t_all / 1e9 / peak[str(1 << 20)], 2),
        "peak_rss_growth_MiB": round((rss1 - rss0) / 1024, 1),
    }
    if args.json:
        print(json.dumps(res, indent=2))
        return
    gb = total / 1e9
    print(f"{len(files)} files, {gb:.2f} GB, {cores} cores, page cache warm, best of {args.repeat}")
    print(f"  hash_files, {cores} threads   {t_all:6.2f} s  {gb / t_all:5.2f} GB/s")
    print(f"  hash_files, 1 thread    {t_one:6.2f} s  {gb / t_one:5.2f} GB/s")
    print(f"  sha256sum               {t_sum:6.2f} s  {gb / t_sum:5.2f} GB/s")
    print(f"  openssl speed peak (1 core): {peak['16384']:.2f} GB/s at 16 KiB, {peak[str(1 << 20)]:.2f} GB/s at 1 MiB")
    print(f"  speedup vs sha256sum: {t_sum / t_all:.2f}x (goal >= 2x); all cores = "
          f"{res['all_cores_vs_openssl_single_core_peak']:.2f}x one core's openssl peak")
    print(f"  peak RSS growth while hashing: {res['peak_rss_growth_MiB']} MiB (1 MiB buffer per thread)")


if __name__ == "__main__":
    main()
