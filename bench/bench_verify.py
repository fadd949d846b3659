"""How fast is `deploytool verify` (the ExecStartPre check) on the real ftllm 0.1.8.2 install?

One run compares, on the same files (page cache warm, so hashing is measured, not the disk):
  * `deploytool verify ftllm-dflash --no-cache`   every file hashed (parallel threads, 1 MiB reads)
  * `sha256sum FILES...`                           the hand-made way (the write-up's verify.sh)
  * `openssl speed -evp sha256`                    single-core SHA-256 peak: bytes / peak is the floor
  * `openssl dgst -sha256 FILES...`                the fastest hand-made way (openssl's own read + hash)
  * a read pass (1 MiB reads, one thread)          the copy out of the page cache every reader pays, which
                                                   bytes / peak leaves out
  * `deploytool verify ftllm-dflash`               with the (dev, ino, size, mtime, ctime) cache warm
  * the same through deploy_tool.entry, the console entry whose verify path skips click
Goals: no-cache verify <= 0.5x the sha256sum time and <= 1.3x (bytes / openssl peak) + interpreter start;
cached verify under 100 ms. The openssl dgst and read figures do not change the goals; they show how far below
bytes / peak a real reader can get on this machine (openssl dgst is read + hash in one thread).

The release is a temp dir whose `current/venv` is a symlink to this interpreter's venv (where ftllm 0.1.8.2 is
installed with its 516 MB libfastllm_tools.so), with a small chat template, a small model directory and units
rendered by deploytool. With --nccl PATH (default: the 474 MB libnccl.so.2 of the nvidia-nccl-cu12 wheel if
tests/support/native.py already fetched it into .cache/), a second round adds that library as the bundled NCCL.

Usage: python bench/bench_verify.py [--repeat N] [--nccl PATH|none] [--strict]
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from deploy_tool import config, fingerprint  # noqa: E402
from deploy_tool.render import render_all  # noqa: E402

HEX64 = re.compile(r"[0-9a-f]{64}")
DEFAULT_NCCL = REPO / ".cache/native/nccl-2.32.3/libnccl.so.2"


# An installed deploytool has its modules byte-compiled (pip does it); a shell with PYTHONDONTWRITEBYTECODE=1
# would make every run compile deploy_tool from source (~40 ms), so the commands run without it (the first,
# warm-up run writes the .pyc files).
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def timed(argv: list[str], ok: tuple[int, ...] = (0,)) -> float:
    t = time.perf_counter()
    r = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    dt = time.perf_counter() - t
    if r.returncode not in ok:
        raise SystemExit(f"{argv[:4]}... exited {r.returncode}: {r.stderr.strip()[-400:]}")
    return dt


def best_of(n: int, argv: list[str]) -> float:
    """The fastest of n runs: on a shared machine the others measure the neighbours, not the command."""
    return min(timed(argv) for _ in range(n))


def openssl_peak() -> float:
    """Single-core SHA-256 peak in bytes/s (the best block size of `openssl speed -evp sha256`)."""
    out = subprocess.run(["openssl", "speed", "-evp", "sha256", "-seconds", "2"], capture_output=True, text=True,
                         check=True).stdout
    line = [ln for ln in out.splitlines() if ln.lower().startswith("sha256")][-1]
    return max(float(v.rstrip("k")) * 1000 for v in line.split()[1:])


def read_pass(files: list[str]) -> float:
    """Seconds to read the files once (1 MiB readinto, one thread, page cache warm): the copy floor."""
    buf = bytearray(1 << 20)
    t = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    return time.perf_counter() - t


def build_release(d: Path, venv: Path, nccl: Path | None) -> Path:
    rel = d / "opt/releases/r1"
    (rel / "templates").mkdir(parents=True)
    (rel / "templates/chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}\n")
    os.symlink(venv, rel / "venv")
    os.symlink("releases/r1", d / "opt/current")
    if nccl is not None:
        (rel / "nccl").mkdir()
        os.symlink(nccl, rel / "nccl/libnccl.so.2")
    model = d / "models/m"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2}) + "\n")
    (model / "model.safetensors").write_bytes(b"\0" * 4096)
    for sub in ("units", "env", "state"):
        (d / sub).mkdir()
    backend: dict = {"kind": "ftllm", "device": "cuda", "model": "models/m", "chat_template": "bundle"}
    if nccl is not None:
        backend["nccl"] = "bundle"
    cfg_doc = {"version": 1, "default_backend": "ftllm-dflash",
               "paths": {"root": "opt", "unit_dir": "units", "env_dir": "env", "state_dir": "state"},
               "backends": {"ftllm-dflash": backend}}
    cp = d / "deploytool.yaml"
    cp.write_text(json.dumps(cfg_doc))  # JSON is YAML
    cfg = config.load(cp)
    for f in render_all(cfg):
        (Path(cfg.paths.unit_dir if f.kind == "unit" else cfg.paths.env_dir) / f.name).write_text(f.content)
    return cp


def record_files(cfg: config.Config) -> set[str]:
    """The files verify checks against ftllm's RECORD (Python files, console script), for sha256sum too."""
    sp = Path(sysconfig.get_paths()["purelib"].replace(sys.prefix, str(Path(cfg.paths.current) / "venv"), 1))
    dist = next(sp.glob("ftllm-*.dist-info"))
    out = set()
    for line in (dist / "RECORD").read_text().splitlines():
        rel, _, rest = line.partition(",")
        name = rel.rsplit("/", 1)[-1]
        if rest.startswith("sha256=") and not rel.startswith(dist.name) and not (name.endswith(".so") or ".so." in name):
            out.add(os.path.normpath(sp / rel))
    return out


def deploytool_argv() -> list[str]:
    script = Path(sys.executable).parent / "deploytool"
    return [str(script)] if script.exists() else [sys.executable, "-m", "deploy_tool"]


def round_(label: str, cp: Path, repeat: int, peak: float, start: float) -> list[tuple[str, bool]]:
    cfg = config.load(cp)
    fingerprint.pin(cfg, "ftllm-dflash", "benchmark")
    items = fingerprint.collect(cfg, "ftllm-dflash", use_cache=False, cache_file=False)
    files = sorted({i.path for i in items if i.path and HEX64.fullmatch(i.value)} | record_files(cfg))
    nbytes = sum(os.path.getsize(f) for f in files)
    for f in files:  # warm the page cache: measure hashing, not the disk
        with open(f, "rb") as fh:
            while fh.read(8 << 20):
                pass
    dt = deploytool_argv()
    verify = [*dt, "--config", str(cp), "verify", "ftllm-dflash"]
    t_sum = best_of(repeat, ["sha256sum", *files])
    t_dgst = best_of(repeat, ["openssl", "dgst", "-sha256", *files])
    t_read = min(read_pass(files) for _ in range(repeat))
    t_nocache = best_of(repeat, [*verify, "--no-cache"])
    timed(verify)  # fills the cache (and byte-compiles the verify path)
    t_cached = best_of(max(repeat, 5), verify)
    fast = [sys.executable, "-c", "from deploy_tool.entry import main; main()", "--config", str(cp), "verify",
            "ftllm-dflash"]
    timed(fast)  # byte-compiles the fast path
    t_fast = best_of(max(repeat, 5), fast)
    t_fast_nc = best_of(repeat, [*fast, "--no-cache"])
    t_inproc = min(_inproc(cfg) for _ in range(max(repeat, 5)))
    t_inproc_nc = min(_inproc(cfg, use_cache=False) for _ in range(repeat))
    floor = nbytes / peak
    biggest = max(files, key=os.path.getsize)
    print(f"\n[{label}] {len(files)} files hashed, {nbytes / 1e6:.0f} MB "
          f"(largest {Path(biggest).name}: {os.path.getsize(biggest) / 1e6:.0f} MB)")
    print(f"  sha256sum of the same files            {t_sum:7.3f} s")
    print(f"  deploytool verify --no-cache           {t_nocache:7.3f} s   {t_nocache / t_sum:.2f}x sha256sum "
          f"(in-process verify(): {t_inproc_nc:.3f} s)")
    print(f"  bytes / openssl peak                   {floor:7.3f} s   verify = {t_nocache / floor:.2f}x "
          f"(minus interpreter start: {(t_nocache - start) / floor:.2f}x)")
    print(f"  openssl dgst -sha256 of the same files {t_dgst:7.3f} s   verify = {t_nocache / t_dgst:.2f}x openssl dgst "
          f"(openssl dgst = {t_dgst / floor:.2f}x bytes / peak)")
    print(f"  read pass alone (1 MiB reads, 1 thread){t_read:7.3f} s   = {t_read / floor:.2f}x bytes / peak")
    print("  (bytes / peak counts hashing only; every reader also pays the page-cache copy (the read pass), which is "
          "why even openssl dgst is well above it)")
    print(f"  deploytool verify (cache warm)         {t_cached:7.3f} s   (in-process verify(): "
          f"{t_inproc * 1000:.1f} ms)")
    print(f"  fast entry (deploy_tool.entry), cache  {t_fast:7.3f} s   --no-cache {t_fast_nc:.3f} s")
    best_nc = min(t_nocache, t_fast_nc)
    g1 = best_nc <= 0.5 * t_sum
    g2 = best_nc <= 1.3 * floor + start
    g3 = min(t_cached, t_fast) < 0.100
    print(f"  goal no-cache <= 0.5x sha256sum                              {'PASS' if g1 else 'MISS'} "
          f"({best_nc:.3f} <= {0.5 * t_sum:.3f})")
    print(f"  goal no-cache <= 1.3x bytes/peak + interpreter start         {'PASS' if g2 else 'MISS'} "
          f"({best_nc:.3f} <= {1.3 * floor + start:.3f})")
    print(f"  goal cached verify < 100 ms (whole command)                  {'PASS' if g3 else 'MISS'} "
          f"({min(t_cached, t_fast) * 1000:.0f} ms)")
    return [(f"{label}: no-cache vs sha256sum", g1), (f"{label}: no-cache vs openssl", g2),
            (f"{label}: cached", g3)]


def _inproc(cfg: config.Config, use_cache: bool = True) -> float:
    t = time.perf_counter()
    r = fingerprint.verify(cfg, "ftllm-dflash", use_cache=use_cache)
    assert r.ok, fingerprint.format_report(r)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement (the best counts); default 3")
    ap.add_argument("--nccl", default=str(DEFAULT_NCCL), help="a large NCCL library for the second round, or 'none'")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a goal is missed")
    args = ap.parse_args()
    sp = Path(sysconfig.get_paths()["purelib"])
    so = sp / "ftllm/libfastllm_tools.so"
    if not so.is_file():
        print(f"ftllm is not installed in {sp}: run `python -m tests.support.backends install`", file=sys.stderr)
        return 2
    venv = Path(sys.prefix)
    print(f"ftllm install: {so.parent} (libfastllm_tools.so {so.stat().st_size / 1e6:.0f} MB); "
          f"{os.cpu_count()} CPUs")
    timed([*deploytool_argv(), "--version"])  # warm-up: writes the .pyc files
    peak = openssl_peak()
    start = best_of(5, [sys.executable, "-c", "pass"])
    cli_start = best_of(5, [*deploytool_argv(), "--version"])
    print(f"every figure is the best of {args.repeat} runs (5 for the short ones); page cache warm; "
          f"load average at start {os.getloadavg()[0]:.2f} (other work on the machine slows the hashing)")
    print(f"openssl speed -evp sha256 single-core peak: {peak / 1e9:.2f} GB/s")
    print(f"interpreter start (python -c pass): {start * 1000:.0f} ms; deploytool --version: {cli_start * 1000:.0f} ms")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-verify-") as tmp:
        d = Path(tmp) / "a"
        d.mkdir()
        results += round_("ftllm 0.1.8.2 venv", build_release(d, venv, None), args.repeat, peak, start)
        nccl = None if args.nccl == "none" else Path(args.nccl)
        if nccl is not None and nccl.is_file():
            d2 = Path(tmp) / "b"
            d2.mkdir()
            results += round_("ftllm venv + bundled NCCL", build_release(d2, venv, nccl), args.repeat, peak, start)
        elif nccl is not None:
            print(f"\n(no NCCL round: {nccl} not found; `python -m tests.support.native fetch` provides it)")
    shutil.rmtree(Path(tmp), ignore_errors=True)
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")
    missed = [name for name, ok in results if not ok]
    print("\nall goals met" if not missed else "\nmissed: " + "; ".join(missed))
    return 1 if (missed and args.strict) else 0


if __name__ == "__main__":
    sys.exit(main())
