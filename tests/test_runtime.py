"""Runtime truth: loaded-library pins, CPU fallback and KV capacity read-back (deploy_tool/box/runtime.py).

Library checks run against real processes that dlopen() real ELF files (tests/support/lib_holder.py). Log checks
use the write-up's exact lines and lines in the exact wording of the installed programs (ftllm 0.1.8.2's
format strings, llama-server's load output). Nothing GPU-specific can run here: GPU log lines are text only.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deploy_tool.box import runtime
from deploy_tool.box.runtime import (
    FAIL,
    OK,
    UNKNOWN,
    WARN,
    HashCache,
    InspectError,
    LoadedLib,
    Pin,
    capacity_truth,
    descendants,
    detect_cpu_fallback,
    inspect_runtime,
    loaded_libraries,
    parse_maps,
)
from tests.support.examples import examples
from tests.support.lib_holder import copy_library, holding

REPO = Path(__file__).resolve().parents[1]


def _findings(libs, pins, **kw):
    """The findings (fail / warn / unknown) for the known native libraries in libs against pins."""
    return list(runtime.assess_libraries(libs, pins, **kw).findings)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- the write-up's lines (FIELD-NOTES pitfall 4), verbatim ------------------------------------------------

WRITEUP_ON_PAPER = """\
GPU 0: availForKV=1.41 GB
GPU 1: availForKV=2.49 GB
KV Cache Token limit: 262144 (totalPages=2048, pageLen=128), localKVPerPage=1.18 MB
"""
WRITEUP_FIXED = WRITEUP_ON_PAPER.replace("1.41 GB", "3.96 GB").replace("2.49 GB", "5.04 GB")

# the same facts in ftllm 0.1.8.2's real wording (format strings read from libfastllm_tools.so)
FTLLM_REAL_FORMAT = """\
Load libnuma.so.1
Load libfastllm_tools.so
[Fastllm] AutoWarmup GPU 0: free=3.10 GB, total=21.48 GB, reserved=1.07 GB, runtimeHeadroom=512.00 MB, \
servingReserve=2377.26 MB, availForKV=1.41 GB, localKVPerPage=1.18 MB, tokenGrowingLayers=16.
[Fastllm] AutoWarmup GPU 1: free=4.20 GB, total=21.48 GB, reserved=1.07 GB, runtimeHeadroom=512.00 MB, \
servingReserve=1347.42 MB, availForKV=2.49 GB, localKVPerPage=1.18 MB, tokenGrowingLayers=16.
[Fastllm] KV Cache Token limit: 262144 tokens (totalPages=2048, pageLen=128).
[Fastllm] AddPrefill Pages limit: 1638 pages (80% of 2048).
"""

# captured from the real llama-server (skulk vulkan build) on this CPU-only machine, -lv 4
LLAMA_CPU_LV4 = """\
0.00.002.552 I cmn  common_param: device_info:
0.00.002.563 I cmn  common_param:   - CPU     : Intel(R) Xeon(R) Processor (24105 MiB, 24105 MiB free)
0.00.008.228 I load_tensors: offloading output layer to GPU
0.00.008.235 I load_tensors: offloading 1 repeating layers to GPU
0.00.008.240 I load_tensors: offloaded 3/3 layers to GPU
0.00.008.245 I load_tensors:          AMX model buffer size =     0.14 MiB
0.00.008.250 I load_tensors:   CPU_Mapped model buffer size =     0.23 MiB
0.00.008.690 I llama_context: n_ctx                 = 512
0.00.008.695 I llama_context: n_ctx_seq             = 512
0.00.008.760 I llama_context:        CPU  output buffer size =     0.01 MiB
0.00.008.778 I llama_kv_cache:        CPU KV buffer size =     0.12 MiB
0.00.008.799 I llama_kv_cache: size =    0.12 MiB (   512 cells,   2 layers,  4/1 seqs), K (f16):    0.06 MiB, \
V (f16):    0.06 MiB
0.00.025.004 I srv    load_model: initializing, n_slots = 4, n_ctx_slot = 512, kv_unified = 'true'
"""
LLAMA_CPU_DEFAULT = """\
0.00.004.871 I srv    load_model: loading model '/tmp/rt/tiny.gguf'
0.00.009.674 I cmn          init: llama threadpool init, n_threads = 2
0.00.154.406 I srv    load_model: initializing, n_slots = 4, n_ctx_slot = 512, kv_unified = 'true'
0.00.156.947 I srv  llama_server: model loaded
"""
# llama.cpp's wording for a CUDA run (load_tensors / llama_kv_cache lines, device buffers named CUDA<n>)
LLAMA_CUDA = """\
load_tensors: offloading 64 repeating layers to GPU
load_tensors: offloaded 65/65 layers to GPU
load_tensors:        CUDA0 model buffer size =  7891.45 MiB
load_tensors:        CUDA1 model buffer size =  7702.11 MiB
load_tensors:   CPU_Mapped model buffer size =   682.03 MiB
llama_context: n_ctx         = 262144
llama_context: n_ctx_seq     = 262144
llama_kv_cache:      CUDA0 KV buffer size =  8192.00 MiB
llama_kv_cache:      CUDA1 KV buffer size =  8192.00 MiB
llama_kv_cache: size = 16384.00 MiB (262144 cells,  16 layers,  1/1 seqs), K (f16): 8192.00 MiB, V (f16): 8192.00 MiB
"""
# verbatim from llama.cpp CI output
LLAMA_NO_GPU = ("warning: no usable GPU found, --gpu-layers option will be ignored\n"
                "warning: one possible reason is that llama.cpp was compiled without GPU support\n")


# ---- /proc reading ---------------------------------------------------------------------------------------------


def test_parse_maps_keeps_shared_objects_unique_and_marks_deleted():
    """parse_maps keeps .so/.so.N files once each, drops other mappings, and strips/flags ' (deleted)'."""
    text = (
        "7f00-7f10 r--p 00000000 fe:00 11   /usr/lib/libc.so.6\n"
        "7f10-7f20 r-xp 00001000 fe:00 11   /usr/lib/libc.so.6\n"
        "7f20-7f30 r--p 00000000 fe:00 12   /opt/b/libnccl.so.2 (deleted)\n"
        "7f30-7f40 r--p 00000000 fe:00 13   /usr/bin/python3.11\n"
        "7f40-7f50 rw-p 00000000 00:00 0    [heap]\n"
        "7f50-7f60 r--p 00000000 fe:00 14   /data/model.gguf\n"
        "7f60-7f70 r--p 00000000 fe:00 15   /opt/x/libggml-base.so\n"
    )
    libs = parse_maps(text, 42)
    assert [lib.path for lib in libs] == ["/usr/lib/libc.so.6", "/opt/b/libnccl.so.2", "/opt/x/libggml-base.so"]
    nccl = libs[1]
    assert nccl.deleted and nccl.inode == 12 and nccl.dev == "fe:00" and nccl.pid == 42
    assert nccl.map_file == "/proc/42/map_files/7f20-7f30"
    assert not libs[0].deleted


def test_loaded_libraries_of_a_real_process(tmp_path):
    """loaded_libraries reads a live process's maps and finds the library it dlopen()ed, attributed to it."""
    lib = copy_library(tmp_path / "bundle" / "libnccl.so.2")
    with holding([lib]) as (pid, _):
        libs = loaded_libraries(pid)
    found = [x for x in libs if x.path == str(lib)]
    assert len(found) == 1 and found[0].pid == pid and not found[0].deleted
    assert len({x.path for x in libs}) == len(libs)


def test_loaded_libraries_walks_descendants(tmp_path):
    """A library mapped only by a child process is found with the child's pid, and only with include_children."""
    lib = copy_library(tmp_path / "libcudart.so.12")
    with holding([lib], child=True) as (parent, child):
        assert child in descendants(parent)
        with_children = loaded_libraries(parent)
        without = loaded_libraries(parent, include_children=False)
    hit = [x for x in with_children if x.path == str(lib)]
    assert hit and hit[0].pid == child
    assert all(x.path != str(lib) for x in without)


def test_descendants_without_children_files_scans_stat(tmp_path):
    """Kernels without /proc/<pid>/task/*/children: descendants falls back to the parent field of every stat."""
    proc = tmp_path / "proc"
    for pid, ppid in [(10, 1), (11, 10), (12, 11), (13, 1), (14, 10)]:
        (proc / str(pid) / "task" / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "stat").write_text(f"{pid} (a (b) c) S {ppid} 1 1 0\n")
    assert sorted(descendants(10, proc=str(proc))) == [11, 12, 14]


def test_descendant_vanishing_mid_walk_is_skipped(tmp_path):
    """A child listed in task/*/children that is gone when its maps are read is skipped; the main maps still count."""
    proc = tmp_path / "proc"
    (proc / "10" / "task" / "10").mkdir(parents=True)
    (proc / "10" / "task" / "10" / "children").write_text("11 ")
    (proc / "10" / "stat").write_text("10 (ftllm) S 1 1 1 0\n")
    (proc / "10" / "maps").write_text("7f00-7f10 r--p 00000000 fe:00 5 /opt/b/libnccl.so.2\n")
    libs = loaded_libraries(10, proc=str(proc))  # pid 11 has no /proc entry any more
    assert [(lib.path, lib.pid) for lib in libs] == [("/opt/b/libnccl.so.2", 10)]


def test_exited_process_is_could_not_determine():
    """A process gone before inspection gives InspectError, and inspect_runtime an 'unknown' finding, no crash."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    with pytest.raises(InspectError, match=f"process {proc.pid} is not running"):
        loaded_libraries(proc.pid)
    report = inspect_runtime(proc.pid, kind="ftllm", pins={"nccl": Pin("/opt/n/libnccl.so.2", "0" * 64)})
    assert report.status == UNKNOWN
    assert report.findings[0].check == "inspect" and "could not determine" in report.findings[0].message


def test_zombie_process_is_could_not_determine():
    """A process that exited but is not yet reaped (empty maps) is reported as exited, never as 'nothing loaded'."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            state = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state == "Z":
                break
            time.sleep(0.02)
        assert state == "Z"
        with pytest.raises(InspectError, match="exited"):
            loaded_libraries(proc.pid)
    finally:
        proc.wait()


def test_unreadable_maps_is_could_not_determine(tmp_path):
    """Run as an unprivileged user against a root-owned process: permission denied becomes 'unknown', no traceback."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a check as another user")
    from tests.support.nobody import REPO_AS_SEEN, run_python

    lib = copy_library(tmp_path / "libnccl.so.2")
    code = ("import json, sys; sys.path.insert(0, sys.argv[2]); from deploy_tool.box.runtime import inspect_runtime; "
            "print(json.dumps(inspect_runtime(int(sys.argv[1]), kind='ftllm', pins={}).to_json()))")
    with holding([lib]) as (pid, _):
        out = run_python(["-c", code, str(pid), REPO_AS_SEEN])  # as uid 65534, the checkout reachable
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["status"] == "unknown"
    assert "permission denied" in data["findings"][0]["message"]


# ---- library pins ----------------------------------------------------------------------------------------------


def test_correct_pin_gives_no_findings(tmp_path):
    """The bundle's NCCL, loaded from the pinned path with the pinned hash, gives no findings and a pinned 'ok' row."""
    lib = copy_library(tmp_path / "bundle" / "lib" / "libnccl.so.2")
    pins = {"nccl": Pin(str(lib), sha256(lib))}
    with holding([lib]) as (pid, _):
        libs = loaded_libraries(pid)
        assert _findings(libs, pins, hash_file=HashCache()) == []
        report = runtime.assess_libraries(libs, pins, hash_file=HashCache())
    row = [r for r in report.rows if r.path == str(lib)][0]
    assert row.pinned and row.status == OK and row.sha256 == sha256(lib)


def test_system_nccl_instead_of_bundle_fails_naming_both_paths(tmp_path):
    """Pitfall 1: a system libnccl.so.2.22.3 mapped where the pin names the bundle's libnccl.so.2 fails, both paths named."""
    bundle = copy_library(tmp_path / "bundle" / "libnccl.so.2")
    system = copy_library(tmp_path / "usr" / "lib" / "libnccl.so.2.22.3")
    pins = {"libnccl.so.2": Pin(str(bundle), sha256(bundle))}
    with holding([system]) as (pid, _):
        findings = _findings(loaded_libraries(pid), pins, hash_file=HashCache())
    fails = [f for f in findings if f.status == FAIL]
    assert len(fails) == 1
    assert str(system) in fails[0].message and str(bundle) in fails[0].message
    assert fails[0].loaded_path == str(system) and fails[0].pinned_path == str(bundle)


def test_wrong_hash_fails(tmp_path):
    """The pinned path is loaded but its bytes differ from the pinned SHA-256: a failure naming the library."""
    lib = copy_library(tmp_path / "bundle" / "libfastllm_tools.so")
    pins = {"fastllm_tools": Pin(str(lib), "ab" * 32)}
    with holding([lib]) as (pid, _):
        findings = _findings(loaded_libraries(pid), pins, hash_file=HashCache())
    assert [f.status for f in findings] == [FAIL]
    assert "SHA-256" in findings[0].message and str(lib) in findings[0].message


def test_library_replaced_under_running_process_fails(tmp_path):
    """Replacing the .so on disk after it was loaded shows '(deleted)' in maps: a failure, hash taken of the old bytes."""
    lib = copy_library(tmp_path / "bundle" / "libnccl.so.2")
    old_sha = sha256(lib)
    pins = {"nccl": Pin(str(lib), old_sha)}
    with holding([lib]) as (pid, _):
        new = lib.with_name("new.so")
        new.write_bytes(lib.read_bytes() + b"\0patched")
        os.replace(new, lib)  # what an in-place upgrade does
        libs = loaded_libraries(pid)
        report = runtime.assess_libraries(libs, pins, hash_file=HashCache())
    mapped = [x for x in libs if x.path == str(lib)]
    assert mapped and mapped[0].deleted
    assert any(f.status == FAIL and "(deleted)" in f.message for f in report.findings)
    row = [r for r in report.rows if r.path == str(lib)][0]
    assert row.deleted and row.status == FAIL
    assert row.sha256 == old_sha  # read through /proc/<pid>/map_files: the bytes the process runs


def test_hash_cache_reads_each_file_once_until_it_changes(tmp_path):
    """HashCache keys on (dev, inode, size, mtime_ns, ctime_ns): a second hash is free, a modified file is hashed
    again."""
    f = tmp_path / "libx.so"
    f.write_bytes(b"a" * 1000)
    time.sleep(0.15)  # older than the racy margin: a value computed now is trusted
    cache = HashCache()
    assert cache(str(f)) == cache(str(f)) == sha256(f)
    assert cache.computed == 1
    f.write_bytes(b"b" * 1000)
    os.utime(f, ns=(time.time_ns(), time.time_ns() + 10_000_000))
    assert cache(str(f)) == sha256(f) and cache.computed == 2


def test_multi_file_family_other_member_is_unpinned_not_failed(tmp_path):
    """libggml-cpu mapped beside the pinned libggml-base is listed as unpinned, not failed; the pinned one passes."""
    base = tmp_path / "libggml-base.so.0.20.0"
    cpu = tmp_path / "libggml-cpu.so.0.20.0"
    base.write_bytes(b"base")
    cpu.write_bytes(b"cpu")
    (tmp_path / "libggml-base.so.0").symlink_to(base.name)
    libs = [LoadedLib(str(base), 1, inode=base.stat().st_ino), LoadedLib(str(cpu), 1, inode=cpu.stat().st_ino)]
    pins = {"libggml-base.so.0": Pin(str(tmp_path / "libggml-base.so.0"), sha256(base))}
    report = runtime.assess_libraries(libs, pins, hash_file=HashCache())
    assert report.findings == ()
    status = {r.name: (r.pinned, r.status) for r in report.rows}
    assert status == {base.name: (True, OK), cpu.name: (False, "unpinned")}


def test_system_copy_of_multi_file_member_fails(tmp_path):
    """A libggml-base from another directory than the pinned one fails, naming both paths."""
    pinned = tmp_path / "bundle" / "libggml-base.so"
    other = tmp_path / "usr" / "libggml-base.so.0"
    for p in (pinned, other):
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"same")
    libs = [LoadedLib(str(other), 7, inode=other.stat().st_ino)]
    findings = _findings(libs, {"libggml-base.so": Pin(str(pinned), sha256(pinned))}, hash_file=HashCache())
    assert [f.status for f in findings] == [FAIL]
    assert str(other) in findings[0].message and str(pinned) in findings[0].message


def test_pinned_but_not_mapped_warns(tmp_path):
    """A pin the process does not map is a warning row '(not mapped)', so status shows it."""
    report = runtime.assess_libraries([], {"nccl": Pin("/opt/n/libnccl.so.2", "0" * 64)}, hash_file=HashCache())
    assert [f.status for f in report.findings] == [WARN]
    assert report.rows[0].path is None and report.rows[0].pinned


def test_unmapped_copies_and_variants_of_a_mapped_library_do_not_warn(tmp_path):
    """A wheel stores libllama.so, libllama.so.0 and libllama.so.0.1.0 as three copies; the process maps one. The
    CPU and CUDA builds of one-file libfastllm_tools are alternatives; the process maps one. Neither other name
    is a warning. A distinct pinned file the process does not map still is."""
    d = tmp_path / "bin"
    d.mkdir()
    for n in ("libllama.so", "libllama.so.0", "libllama.so.0.1.0"):
        (d / n).write_bytes(b"llama build 1")
    (d / "libggml-base.so.0").write_bytes(b"ggml base")
    (d / "libfastllm_tools-cpu.so").write_bytes(b"cpu build")
    (d / "libfastllm_tools.so").write_bytes(b"cuda build")
    pins = {p.name: Pin(str(p), sha256(p)) for p in d.iterdir()}
    mapped = [d / "libllama.so.0", d / "libfastllm_tools-cpu.so"]
    libs = [LoadedLib(str(p), 7, inode=p.stat().st_ino, dev=_maps_dev(p)) for p in mapped]
    report = runtime.assess_libraries(libs, pins, hash_file=HashCache())
    warned = sorted(f.subject for f in report.findings if f.status == WARN)
    assert warned == ["libggml-base.so.0"], report.findings
    assert not [f for f in report.findings if f.status != WARN]


def _maps_dev(p: Path) -> str:
    st = p.stat()
    return f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"


def test_unknown_libraries_are_ignored(tmp_path):
    """Libraries outside the known families (libc, libm...) produce neither rows nor findings."""
    libs = [LoadedLib("/usr/lib/libc.so.6", 1), LoadedLib("/usr/lib/libm.so.6", 1)]
    report = runtime.assess_libraries(libs, {}, hash_file=HashCache())
    assert report.rows == () and report.findings == ()


# ---- CPU fallback ----------------------------------------------------------------------------------------------


def test_ftllm_cpu_library_on_cuda_profile_fails():
    """ftllm's loader line 'Load libfastllm_tools-cpu.so' on a cuda backend is a CPU-fallback failure."""
    log = "Load libnuma.so.1\nCPU Instruction Info: [AVX2: ON]\nLoad libfastllm_tools-cpu.so\nWarmup...\n"
    f = detect_cpu_fallback("ftllm", log, "cuda")
    assert f is not None and f.status == FAIL and "libfastllm_tools-cpu.so" in f.message


def test_journal_prefixed_lines_are_read():
    """Lines as journalctl prints them (timestamp, unit, pid prefix) are recognised by every check."""
    prefix = "Nov 29 08:56:10 box ftllm[6567]: "
    log = "".join(prefix + line + "\n" for line in
                  ["Load libfastllm_tools-cpu.so", *FTLLM_REAL_FORMAT.splitlines()[2:]])
    f = detect_cpu_fallback("ftllm", log, "cuda")
    assert f is not None and f.status == FAIL
    assert capacity_truth("ftllm", log, 262144).ceiling_tokens == 156544


def test_ftllm_cuda_library_passes_and_cpu_profile_is_not_checked():
    """'Load libfastllm_tools.so' on cuda passes; a cpu-profile backend is never a fallback."""
    assert detect_cpu_fallback("ftllm", FTLLM_REAL_FORMAT, "cuda") is None
    assert detect_cpu_fallback("ftllm", "Load libfastllm_tools-cpu.so\n", "cpu") is None


def test_ftllm_log_without_load_line_is_unknown():
    """No loader line at all (log cut, newer ftllm): 'unknown', not a pass."""
    f = detect_cpu_fallback("ftllm", "Warmup...\nfinish.\n", "cuda")
    assert f is not None and f.status == UNKNOWN


def test_llama_no_usable_gpu_fails():
    """llama.cpp's 'no usable GPU found' warning on a cuda backend fails."""
    f = detect_cpu_fallback("llamacpp", LLAMA_NO_GPU, "cuda")
    assert f is not None and f.status == FAIL and "no usable GPU found" in f.message


def test_llama_zero_offload_fails():
    """'offloaded 0/29 layers to GPU' fails on a cuda backend."""
    f = detect_cpu_fallback("llamacpp", "load_tensors: offloaded 0/29 layers to GPU\n", "cuda")
    assert f is not None and f.status == FAIL and "0/29" in f.message


def test_llama_host_only_buffers_fail_despite_offload_line():
    """The real CPU log says 'offloaded 3/3 layers to GPU' yet all buffers are host memory: that is a failure."""
    f = detect_cpu_fallback("llamacpp", LLAMA_CPU_LV4, "cuda")
    assert f is not None and f.status == FAIL and "CPU_Mapped" in f.message


def test_llama_cuda_buffers_pass():
    """Model and KV buffers on CUDA0/CUDA1 prove GPU use."""
    assert detect_cpu_fallback("llamacpp", LLAMA_CUDA, "cuda") is None


def test_llama_default_verbosity_is_unknown():
    """At llama-server's default verbosity the load lines are absent: 'unknown' with the -lv 4 hint."""
    f = detect_cpu_fallback("llamacpp", LLAMA_CPU_DEFAULT, "cuda")
    assert f is not None and f.status == UNKNOWN and "-lv 4" in (f.hint or "")


# ---- capacity --------------------------------------------------------------------------------------------------


def test_writeup_262k_on_paper_warns_with_the_arithmetic():
    """1.41/2.49 GB, 2048 pages x 1.18 MB: warn; GPU0 holds 1223 pages = 156,544 tokens; 2.36 GB needed per card."""
    rep = capacity_truth("ftllm", WRITEUP_ON_PAPER, 262144)
    assert rep.status == WARN
    assert rep.ceiling_tokens == 156544  # floor(1.41*1024/1.18) * 128: the write-up's "about 156K"
    gpu0, gpu1 = rep.per_card
    assert gpu0.card == "GPU 0" and gpu0.ok is False and gpu0.ceiling_tokens == 156544
    assert gpu1.ok is True and gpu1.ceiling_tokens == 262144
    assert gpu0.kv_needed_mb == pytest.approx(2416.64)
    for text in ("262,144", "156,544", "1.41 GB", "2.36 GB", "2,048 pages x 1.18 MB", "GPU 0"):
        assert text in rep.message


def test_writeup_fixed_config_passes():
    """Without --cuda_embedding (3.96/5.04 GB) the full 262,144-token pool fits on both cards."""
    rep = capacity_truth("ftllm", WRITEUP_FIXED, 262144)
    assert rep.status == OK and rep.ceiling_tokens == 262144
    assert all(c.ok for c in rep.per_card)


def test_on_paper_fails_by_policy():
    """policy='fail' turns the on-paper context into a failure."""
    assert capacity_truth("ftllm", WRITEUP_ON_PAPER, 262144, policy=FAIL).status == FAIL


def test_real_ftllm_wording_parses_same_and_reports_prefill_cap():
    """ftllm 0.1.8.2's own line format gives the same verdict, plus the 1638-page (209,664-token) prompt cap."""
    rep = capacity_truth("ftllm", FTLLM_REAL_FORMAT, 262144)
    assert rep.status == WARN and rep.ceiling_tokens == 156544 and rep.paper_tokens == 262144
    assert rep.prefill_cap_tokens == 1638 * 128
    assert "209,664" in rep.message


def test_newer_ftllm_format_is_unknown():
    """AutoWarmup lines whose fields were renamed: 'could not determine', never a pass."""
    log = ("[Fastllm] AutoWarmup GPU 0: free=3.10 GB, kvBudget=1.41 GiB, pagesMB=1.18\n"
           "[Fastllm] KV Cache Token limit: 262144 tokens (totalPages=2048, pageLen=128).\n")
    rep = capacity_truth("ftllm", log, 262144)
    assert rep.status == UNKNOWN and "could not determine" in rep.message and rep.ceiling_tokens is None


def test_missing_token_limit_is_unknown():
    """availForKV present but no token-limit line: unknown, naming the missing line."""
    rep = capacity_truth("ftllm", "GPU 0: availForKV=1.41 GB\n", 262144)
    assert rep.status == UNKNOWN and "KV Cache Token limit" in rep.message


def test_ftllm_cpu_run_uses_context_window_line():
    """A CPU ftllm run has no page pool; its 'Model context window' line decides: below the configured value warns."""
    line = ("2026-11-29 08:56:10,565 6567 server.py[line:326] INFO: Model context window: 1024 tokens per session "
            "(model=2048, shared KV cache=1024, configured limit=None)\n")
    assert capacity_truth("ftllm", line, 1024).status == OK
    rep = capacity_truth("ftllm", line, 4096)
    assert rep.status == WARN and rep.ceiling_tokens == 1024


def test_llama_context_read_back():
    """llama.cpp: n_ctx_seq is the real per-sequence context; -c 262144 honoured passes, a silent default warns."""
    rep = capacity_truth("llamacpp", LLAMA_CUDA, 262144)
    assert rep.status == OK and rep.ceiling_tokens == 262144
    assert {c.card for c in rep.per_card} == {"CUDA0", "CUDA1"}
    small = capacity_truth("llamacpp", LLAMA_CPU_LV4, 262144)
    assert small.status == WARN and small.ceiling_tokens == 512 and "only on paper" in small.message
    assert capacity_truth("llamacpp", LLAMA_CPU_DEFAULT, 512).ceiling_tokens == 512  # n_ctx_slot at -lv 3


def test_unknown_kind_and_empty_log_are_unknown():
    """Empty logs and unknown kinds give 'unknown', not 'ok'."""
    assert capacity_truth("ftllm", "", 1024).status == UNKNOWN
    assert capacity_truth("llamacpp", "", 1024).status == UNKNOWN
    assert capacity_truth("vllm", WRITEUP_FIXED, 1024).status == UNKNOWN


@settings(max_examples=examples(200), deadline=None)
@given(st.text(alphabet=st.sampled_from(list("GPU 0123456789.:=,()availForKVlocalKVPerPageMBGtokens\n-")),
               max_size=300))
def test_log_parsers_never_crash(text):
    """Any log text gives a result with a known status, never an exception."""
    for kind in ("ftllm", "llamacpp"):
        assert capacity_truth(kind, text, 262144).status in (OK, WARN, FAIL, UNKNOWN)
        f = detect_cpu_fallback(kind, text, "cuda")
        assert f is None or f.status in (FAIL, UNKNOWN)


# ---- report ----------------------------------------------------------------------------------------------------


def test_inspect_runtime_rows_and_json(tmp_path):
    """inspect_runtime gives status rows (path, pinned yes/no, capacity truth) and JSON-serialisable output."""
    lib = copy_library(tmp_path / "bundle" / "libnccl.so.2")
    pins = {"nccl": Pin(str(lib), sha256(lib))}
    with holding([lib]) as (pid, _):
        rep = inspect_runtime(pid, kind="ftllm", pins=pins, log_text=WRITEUP_ON_PAPER + "Load libfastllm_tools.so\n",
                              device_profile="cuda", configured_ctx=262144, hash_file=HashCache())
    assert rep.status == WARN  # capacity only; the library is fine
    rows = rep.to_rows()
    lib_row = [r for r in rows if r["what"] == "library"][0]
    assert lib_row == {"what": "library", "name": "libnccl.so.2", "detail": str(lib), "pinned": "yes", "status": OK}
    cap_row = [r for r in rows if r["what"] == "capacity"][0]
    assert cap_row["name"] == "156,544 tokens" and cap_row["status"] == WARN
    data = json.loads(json.dumps(rep.to_json()))
    assert data["capacity"]["ceiling_tokens"] == 156544 and data["libraries"][0]["pinned"] is True
