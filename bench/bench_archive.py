"""How fast does deploytool archive a venv, against `tar -c | zstd -T0 -3` and gzip -6 of the same tree?

Interleaved runs on the same tree with the page cache warm, best of --repeat:
  * archive.archive_tree(tree)            reproducible tar.zst: sorted, normalized headers, zstd -3 on all
                                          cores through the zstandard library
  * pack.archive_venv_parts(tree)         the same, as a bundle carries the venv since 2026-12-06: one archive
                                          per installed distribution (a venv tree only; skipped otherwise)
  * the same tar stream piped into `zstd -T0 -3` (the design not taken: the CLI instead of the library)
  * tar -c | zstd -T0 -3                  (GNU tar with `-I "zstd -T0 -3"`: the same pipe)
  * tar -c | gzip -6                      the classic, for the compression choice
  * archive.extract_archive vs tar -x     the safe extractor against GNU tar
Goal: archive_tree within 1.2x of tar|zstd. Peak RSS growth of this process while archiving is printed to show
memory stays flat (streamed 1 MiB reads, 4 MiB batches into the compressor).

Default tree: this interpreter's venv (the dev venv, with the real ftllm 0.1.8.2 package and its 516 MB
libfastllm_tools.so, about 1 GB). Absolute symlinks (the venv's bin/python3 -> base interpreter) are left out
of ours, since a bundle's venv archive only carries relative links.

Usage: python bench/bench_archive.py [--tree DIR] [--repeat N] [--no-gzip] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from deploy_tool import archive  # noqa: E402
from deploy_tool.builder.pack import archive_venv_parts  # noqa: E402
from deploy_tool.progress import ByteCounter  # noqa: E402


def absolute_links(tree: Path) -> set[str]:
    out = set()
    for dirpath, dirnames, filenames in os.walk(tree):
        for n in dirnames + filenames:
            p = Path(dirpath, n)
            if p.is_symlink() and os.readlink(p).startswith("/"):
                out.add(str(p.relative_to(tree)))
    return out


def ours_through_zstd_cli(tree: Path, skip: set[str], out: Path) -> None:
    """The same reproducible tar stream, compressed by `zstd -T0 -3` through a pipe instead of the library."""
    members = archive.members_from_tree(tree, exclude=lambda n: n in skip)
    sizes = {m.name: os.stat(m.source).st_size for m in members if m.kind == "file"}  # type: ignore[arg-type]
    with open(out, "wb") as f:
        p = subprocess.Popen(["zstd", "-T0", "-3", "-q", "-c"], stdin=subprocess.PIPE, stdout=f)
        assert p.stdin is not None
        archive._write_stream(members, sizes, p.stdin, compression="none", threads=1, mtime=0,
                              counter=ByteCounter(None, "", 0))
        p.stdin.close()
        if p.wait() != 0:
            raise SystemExit("zstd failed")


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", type=Path, default=Path(sys.prefix))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-gzip", action="store_true", help="skip the (slow) gzip -6 run")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    tree = args.tree.resolve()
    skip = absolute_links(tree)
    nbytes = sum(p.stat().st_size for p in tree.rglob("*") if p.is_file() and not p.is_symlink())
    with tempfile.TemporaryDirectory(prefix="bench-archive-", dir=REPO / ".cache" if (REPO / ".cache").is_dir()
                                     else None) as tmp:
        t = Path(tmp)
        ours_p, zst_p, gz_p = t / "ours.tar.zst", t / "ref.tar.zst", t / "ref.tar.gz"
        subprocess.run(["tar", "-C", str(tree), "-cf", "/dev/null", "."], check=True)  # warm the page cache
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        ours, ref, cli, parts = [], [], [], []
        is_venv = any(tree.glob("lib/python*/site-packages"))
        for _ in range(args.repeat):
            ours.append(timed(lambda: archive.archive_tree(tree, ours_p, exclude=lambda n: n in skip)))
            if is_venv:
                shutil.rmtree(t / "parts", ignore_errors=True)
                parts.append(timed(lambda: archive_venv_parts(tree, t / "parts")))
            ref.append(timed(lambda: subprocess.run(["tar", "-I", "zstd -T0 -3 -q", "-C", str(tree), "-cf",
                                                     str(zst_p), "."], check=True)))
            cli.append(timed(lambda: ours_through_zstd_cli(tree, skip, t / "cli.tar.zst")))
        rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        gz = None
        if not args.no_gzip:
            gz = timed(lambda: subprocess.run(["tar", "-I", "gzip -6", "-C", str(tree), "-cf", str(gz_p), "."],
                                              check=True))
        ex_ours, ex_tar = [], []
        for i in range(args.repeat):
            d1, d2 = t / f"x-ours-{i}", t / f"x-tar-{i}"
            ex_ours.append(timed(lambda d=d1: archive.extract_archive(ours_p, d)))
            d2.mkdir()
            ex_tar.append(timed(lambda d=d2: subprocess.run(["tar", "-I", "zstd -T0", "-xf", str(zst_p), "-C",
                                                             str(d)], check=True)))
            shutil.rmtree(d1)
            shutil.rmtree(d2)
        rss2 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        res = {
            "tree": str(tree), "bytes": nbytes, "cores": os.cpu_count(),
            "ours_s": round(min(ours), 3), "tar_zstd_s": round(min(ref), 3),
            "ratio_ours_vs_tar_zstd": round(min(ours) / min(ref), 3),
            "ours_via_zstd_cli_pipe_s": round(min(cli), 3),
            "parts_s": round(min(parts), 3) if parts else None,
            "parts": len(list((t / "parts").iterdir())) if parts else None,
            "parts_size": sum(p.stat().st_size for p in (t / "parts").iterdir()) if parts else None,
            "ratio_parts_vs_tar_zstd": round(min(parts) / min(ref), 3) if parts else None,
            "ours_size": ours_p.stat().st_size, "tar_zstd_size": zst_p.stat().st_size,
            "gzip6_s": round(gz, 3) if gz is not None else None,
            "gzip6_size": gz_p.stat().st_size if gz is not None else None,
            "extract_ours_s": round(min(ex_ours), 3), "extract_tar_s": round(min(ex_tar), 3),
            "peak_rss_growth_archiving_MiB": round((rss1 - rss0) / 1024, 1),
            "peak_rss_growth_extracting_MiB": round((rss2 - rss1) / 1024, 1),
            "runs_ours_s": [round(x, 3) for x in ours], "runs_tar_zstd_s": [round(x, 3) for x in ref],
        }
    if args.json:
        print(json.dumps(res, indent=2))
        return
    gb = nbytes / 1e9
    print(f"tree {tree}: {gb:.2f} GB, {os.cpu_count()} cores, best of {args.repeat} (interleaved)")
    print(f"  archive_tree (tar.zst -3, all cores)  {res['ours_s']:6.2f} s  {res['ours_size'] / 1e6:7.1f} MB")
    if parts:
        print(f"  archive_venv_parts ({res['parts']} archives)      {res['parts_s']:6.2f} s  "
              f"{res['parts_size'] / 1e6:7.1f} MB")
    print(f"  same stream piped to the zstd CLI     {res['ours_via_zstd_cli_pipe_s']:6.2f} s  (the alternative design)")
    print(f"  tar -c | zstd -T0 -3                  {res['tar_zstd_s']:6.2f} s  {res['tar_zstd_size'] / 1e6:7.1f} MB")
    if gz is not None:
        print(f"  tar -c | gzip -6                      {gz:6.2f} s  {res['gzip6_size'] / 1e6:7.1f} MB")
    print(f"  ratio ours / tar|zstd: {res['ratio_ours_vs_tar_zstd']:.2f}x (goal <= 1.2x)"
          + (f"; in parts {res['ratio_parts_vs_tar_zstd']:.2f}x" if parts else ""))
    print(f"  extract: safe extractor {res['extract_ours_s']:.2f} s, GNU tar -x {res['extract_tar_s']:.2f} s")
    print(f"  peak RSS growth: archiving {res['peak_rss_growth_archiving_MiB']} MiB, "
          f"extracting {res['peak_rss_growth_extracting_MiB']} MiB (for {gb:.2f} GB of input)")


if __name__ == "__main__":
    main()
