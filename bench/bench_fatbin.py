#!/usr/bin/env python3
"""Time deploy_tool.binaries.read_fatbin against NVIDIA's cuobjdump on the same real libraries.

For each library (default: PyPI's 474 MB libnccl.so.2 from nvidia-nccl-cu12 2.32.3, plus ftllm's
libfastllm_tools.so when installed): one untimed warm-up of each tool (so both read from the page cache),
then N alternating runs of `read_fatbin(path)` in this process and `cuobjdump --list-elf path` (plus
`--list-ptx` with --ptx). Prints medians and the ratio cuobjdump / read_fatbin, and checks that both found
the same cubin architectures.

Usage: python bench/bench_fatbin.py [--runs 5] [--ptx] [--json] [LIB ...]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy_tool import proc  # noqa: E402
from deploy_tool.binaries import read_fatbin  # noqa: E402
from tests.support import native  # noqa: E402


def _cuobjdump(tool: Path, lib: Path, ptx: bool) -> set[str]:
    archs: set[str] = set()
    for flag in ("--list-elf", "--list-ptx") if ptx else ("--list-elf",):
        r = proc.run([str(tool), flag, str(lib)], ok=(0, 255), timeout=600)
        archs |= set(re.findall(r"\.(sm_\d+[a-z]?)\.(?:cubin|ptx)\s*$", r.stdout, re.M))
    return archs


def bench(lib: Path, tool: Path, runs: int, ptx: bool) -> dict[str, Any]:
    info = read_fatbin(lib)
    oracle = _cuobjdump(tool, lib, ptx)
    ours = set(info.cubin_archs) | (set(info.ptx_archs) if ptx else set())
    py, co = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        read_fatbin(lib)
        py.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        _cuobjdump(tool, lib, ptx)
        co.append(time.perf_counter() - t0)
    py_med, co_med = statistics.median(py), statistics.median(co)
    return {"library": str(lib), "size_mb": round(lib.stat().st_size / 1e6, 1), "entries": info.entry_count,
            "runs": runs, "read_fatbin_s": round(py_med, 4), "cuobjdump_s": round(co_med, 3),
            "ratio": round(co_med / py_med, 1), "same_archs": ours == oracle,
            "archs": list(info.cubin_archs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("libs", nargs="*", type=Path)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--ptx", action="store_true", help="also time cuobjdump --list-ptx (read_fatbin reads both anyway)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    libs = args.libs or [native.nccl_lib()]
    if not args.libs and (ftllm := native.site_file("ftllm", "libfastllm_tools.so")):
        libs.append(ftllm)
    tool = native.cuobjdump()
    results = [bench(lib, tool, args.runs, args.ptx) for lib in libs]
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            print(f"{r['library']} ({r['size_mb']} MB, {r['entries']} fatbin entries, median of {r['runs']}):")
            print(f"  read_fatbin {r['read_fatbin_s'] * 1000:8.1f} ms")
            print(f"  cuobjdump   {r['cuobjdump_s'] * 1000:8.1f} ms  ({'--list-elf --list-ptx' if args.ptx else '--list-elf'})")
            print(f"  ratio       {r['ratio']:8.1f}x  same archs: {r['same_archs']}")
    return 0 if all(r["same_archs"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
