"""How much of a venv archive does rsync resend when one package of the venv changes?

A box that has release A gets release B shipped by rsync (delta transfer against A's files). B's venv archive
differs from A's in one package only, but a zstd stream cut into one frame diverges from the first changed byte
to the end, so rsync resends everything after it. deploytool cuts its archives into frames at content-defined
member boundaries (deploy_tool/archive.py, frame_boundary_before): the frames away from the change stay
identical, byte for byte. Side by side, on the same two trees, in one run:
  * frames  deploytool's archive (content-defined frames)
  * single  the same archive with one frame (the writer with boundaries switched off)
For each: archive size and write time, then `rsync --no-whole-file --stats` of B's archive onto a copy of A's
(the delta rsync does over ssh), whose "Literal data" is what crosses the wire.
Goal (issue 17): shipping a release that differs by one wheel sends at most 10% of the first shipping's bytes.

Tree A: this interpreter's venv (the dev venv with the real ftllm 0.1.8.2, about 1 GB). Tree B: A with every
file of one package (--package, default jinja2) changed, as a version bump does.

Usage: python bench/bench_archive_delta.py [--tree DIR] [--package NAME] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from deploy_tool import archive  # noqa: E402


def _bump(tree: Path, package: str) -> int:
    """Change every regular file of site-packages/<package> (one byte appended); return how many."""
    sp = next(tree.glob("lib/python3*/site-packages"), None)
    pkg = sp / package if sp else None
    if pkg is None or not pkg.is_dir():
        sys.exit(f"bench_archive_delta: no package {package!r} under {tree}/lib/python3*/site-packages")
    n = 0
    for p in sorted(pkg.rglob("*")):
        if p.is_file() and not p.is_symlink():
            with open(p, "ab") as f:
                f.write(b"\n")
            n += 1
    return n


def _literal(old: Path, new: Path, work: Path) -> tuple[int, float]:
    """Bytes rsync sends to turn a copy of `old` into `new` with its delta algorithm, and the time it took."""
    dest = work / "dest" / new.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(old, dest)
    t0 = time.perf_counter()
    r = subprocess.run(["rsync", "--no-whole-file", "--stats", str(new), str(dest)], capture_output=True,
                       text=True, check=True)
    took = time.perf_counter() - t0
    m = re.search(r"Literal data: ([\d,]+)", r.stdout)
    assert m, r.stdout
    return int(m.group(1).replace(",", "")), took


def _write(tree: Path, out: Path, frames: bool) -> float:
    t0 = time.perf_counter()
    if frames:
        archive.archive_tree(tree, out, symlinks=True, exclude=_absolute_links(tree))
    else:
        with mock.patch.object(archive, "frame_boundary_before", lambda *a: False):
            archive.archive_tree(tree, out, symlinks=True, exclude=_absolute_links(tree))
    return time.perf_counter() - t0


def _absolute_links(tree: Path):  # a bundle's venv archive carries relative links only
    def exclude(rel: str) -> bool:
        p = tree / rel
        return p.is_symlink() and os.path.isabs(os.readlink(p))
    return exclude


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=Path, default=Path(sysconfig.get_paths()["data"]))
    ap.add_argument("--package", default="jinja2")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if not shutil.which("rsync"):
        sys.exit("bench_archive_delta: rsync not found (make setup installs it)")
    with tempfile.TemporaryDirectory(prefix="bench-delta-", dir=os.environ.get("TMPDIR")) as tmp:
        work = Path(tmp)
        ta, tb = work / "a", work / "b"
        shutil.copytree(a.tree, ta, symlinks=True)
        shutil.copytree(ta, tb, symlinks=True)
        changed = _bump(tb, a.package)
        rows = {}
        for kind in ("frames", "single"):
            arch_a, arch_b = work / f"{kind}-a.tar.zst", work / f"{kind}-b.tar.zst"
            wa = _write(ta, arch_a, kind == "frames")
            _write(tb, arch_b, kind == "frames")
            sent, took = _literal(arch_a, arch_b, work / kind)
            size = arch_b.stat().st_size
            rows[kind] = {"archive_bytes": size, "write_s": round(wa, 2), "rsync_literal_bytes": sent,
                          "rsync_s": round(took, 2), "sent_fraction": round(sent / size, 4)}
    if a.json:
        print(json.dumps({"tree": str(a.tree), "package": a.package, "files_changed": changed, **rows}, indent=2))
        return 0
    print(f"tree {a.tree}; B changes {changed} files of {a.package}")
    print(f"{'':8} {'archive':>12} {'write':>8} {'rsync sends':>14} {'of archive':>11} {'rsync':>7}")
    for kind, r in rows.items():
        print(f"{kind:8} {r['archive_bytes'] / 1e6:10.1f}MB {r['write_s']:7.2f}s {r['rsync_literal_bytes'] / 1e6:12.2f}MB "
              f"{100 * r['sent_fraction']:10.2f}% {r['rsync_s']:6.2f}s")
    f, s = rows["frames"], rows["single"]
    print(f"frames vs single: size {f['archive_bytes'] / s['archive_bytes']:.3f}x, write "
          f"{f['write_s'] / s['write_s']:.2f}x, bytes resent {f['rsync_literal_bytes'] / max(1, s['rsync_literal_bytes']):.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
