"""Runtime truth against the real CPU backends: the real ftllm and llama-server, their real maps and logs.

Each server runs once per module on a tiny F16 GGUF written on the spot, bound to 127.0.0.1 on a free port,
and is stopped by PID afterwards (tests/support/backends.py). No GPU exists here: the CUDA side is covered by
log-text tests in test_runtime.py; these tests prove the /proc and log reading on the real programs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy_tool.box import runtime
from deploy_tool.box.probe.health import Kind, wait_ready
from deploy_tool.box.runtime import (
    FAIL,
    OK,
    UNKNOWN,
    WARN,
    HashCache,
    Pin,
    assess_libraries,
    capacity_truth,
    detect_cpu_fallback,
    inspect_runtime,
    library_family,
    loaded_libraries,
)
from tests.support import backends
from tests.support.tiny_model import write_model

pytestmark = pytest.mark.backends

CTX = 1024


def _findings(libs, pins, **kw):
    """The findings (fail / warn / unknown) for the known native libraries in libs against pins."""
    return list(runtime.assess_libraries(libs, pins, **kw).findings)


def sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("models") / "tiny-f16.gguf", f16=True)


def _serve(kind: Kind, model: Path, log_dir: Path, extra: list[str]) -> Iterator[backends.Server]:
    with backends.running(kind, model, model_name="tiny", log_dir=log_dir, extra=extra) as srv:
        wait_ready(kind, srv.base_url, "tiny", timeout=90, interval=0.2, unit_state=srv.unit_state,
                   journal_tail=srv.log_text)
        yield srv
    assert srv.proc.poll() is not None


@pytest.fixture(scope="module")
def ftllm(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[backends.Server]:
    """The real `ftllm server --device cpu` with --tokens CTX, ready."""
    yield from _serve("ftllm", model, tmp_path_factory.mktemp("ftllm-logs"), ["--tokens", str(CTX)])


@pytest.fixture(scope="module")
def llama(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[backends.Server]:
    """The real llama-server at -c 2048 with -lv 4 (so the load lines are logged), ready."""
    yield from _serve("llamacpp", model, tmp_path_factory.mktemp("llama-logs"), ["-lv", "4"])


def _fastllm_lib(server: backends.Server) -> str:
    libs = loaded_libraries(server.pid)
    found = [lib.path for lib in libs if library_family(lib.name) == "fastllm_tools"]
    assert len(found) == 1, found
    return found[0]


def test_ftllm_maps_cpu_library(ftllm: backends.Server) -> None:
    """The real ftllm with --device cpu maps libfastllm_tools-cpu.so from its package directory."""
    path = _fastllm_lib(ftllm)
    assert os.path.basename(path) == "libfastllm_tools-cpu.so"
    assert os.path.isfile(path) and "site-packages/ftllm" in path


def test_ftllm_correct_pin_passes(ftllm: backends.Server) -> None:
    """Pinning the mapped libfastllm_tools-cpu.so with its real SHA-256: no findings, row pinned and ok."""
    path = _fastllm_lib(ftllm)
    pins = {"fastllm_tools": Pin(path, sha256(path))}
    report = assess_libraries(loaded_libraries(ftllm.pid), pins, hash_file=HashCache())
    assert report.findings == ()
    row = [r for r in report.rows if r.path == path][0]
    assert row.pinned and row.status == OK


def test_ftllm_pin_elsewhere_fails_naming_both(ftllm: backends.Server, tmp_path: Path) -> None:
    """A pin naming an identical copy in another directory fails: the process runs a file outside the bundle."""
    path = _fastllm_lib(ftllm)
    elsewhere = tmp_path / "bundle" / "libfastllm_tools-cpu.so"
    elsewhere.parent.mkdir()
    shutil.copyfile(path, elsewhere)
    findings = _findings(loaded_libraries(ftllm.pid), {"fastllm_tools": Pin(str(elsewhere), sha256(elsewhere))},
                            hash_file=HashCache())
    fails = [f for f in findings if f.status == FAIL]
    assert len(fails) == 1 and path in fails[0].message and str(elsewhere) in fails[0].message


def test_ftllm_cuda_pin_fails_when_cpu_library_runs(ftllm: backends.Server, tmp_path: Path) -> None:
    """Pinned CUDA libfastllm_tools.so but the CPU one is mapped: a family substitute, failed with both paths."""
    path = _fastllm_lib(ftllm)
    cuda = os.path.join(os.path.dirname(path), "libfastllm_tools.so")
    findings = _findings(loaded_libraries(ftllm.pid), {"libfastllm_tools.so": Pin(cuda, "0" * 64)},
                            hash_file=HashCache())
    assert any(f.status == FAIL and path in f.message and cuda in f.message for f in findings)


def test_ftllm_wrong_hash_fails(ftllm: backends.Server) -> None:
    """The right path with a wrong SHA-256 fails on the hash of the bytes the process maps."""
    path = _fastllm_lib(ftllm)
    findings = _findings(loaded_libraries(ftllm.pid), {"fastllm_tools": Pin(path, "0" * 64)},
                            hash_file=HashCache())
    assert [f.status for f in findings] == [FAIL] and "SHA-256" in findings[0].message


def test_ftllm_real_log_fallback_and_capacity(ftllm: backends.Server) -> None:
    """On the real CPU log: a cuda profile would be a CPU fallback; capacity is definite (the per-session window)."""
    log = ftllm.log_text()
    assert "Load libfastllm_tools-cpu.so" in log
    fallback = detect_cpu_fallback("ftllm", log, "cuda")
    assert fallback is not None and fallback.status == FAIL
    assert detect_cpu_fallback("ftllm", log, "cpu") is None
    cap = capacity_truth("ftllm", log, CTX)
    assert cap.status in (OK, UNKNOWN)
    if cap.status == OK:
        assert cap.ceiling_tokens == CTX
    assert capacity_truth("ftllm", log, 4 * CTX).status in (WARN, UNKNOWN)


def test_ftllm_inspect_runtime_report(ftllm: backends.Server) -> None:
    """inspect_runtime on the live ftllm gives rows with the loaded CPU library and JSON that round-trips."""
    path = _fastllm_lib(ftllm)
    rep = inspect_runtime(ftllm.pid, kind="ftllm", pins={"fastllm_tools": Pin(path, sha256(path))},
                          log_text=ftllm.log_text(), device_profile="cpu", configured_ctx=CTX)
    assert rep.status in (OK, WARN, UNKNOWN) and not rep.failures()
    rows = rep.to_rows()
    assert {"what": "library", "name": "libfastllm_tools-cpu.so", "detail": path, "pinned": "yes",
            "status": OK} in rows
    assert any(r["what"] == "capacity" for r in rows)
    assert json.loads(json.dumps(rep.to_json()))["pid"] == ftllm.pid


def _ggml_pins(server: backends.Server) -> dict[str, Pin]:
    """Pins for every ggml/llama library file shipped beside the llama-server binary, keyed by real file name."""
    bindir = Path(server.argv[0]).parent
    pins: dict[str, Pin] = {}
    for f in sorted(bindir.iterdir()):
        real = f.resolve()
        if library_family(real.name) in ("ggml", "llama") and real.name not in pins:
            pins[real.name] = Pin(str(real), sha256(real))
    return pins


def test_llama_maps_ggml_and_llama_libraries(llama: backends.Server) -> None:
    """The real llama-server maps its bundled libggml* and libllama* libraries."""
    names = {lib.name for lib in loaded_libraries(llama.pid)}
    assert any(n.startswith("libggml-base") for n in names), names
    assert any(n.startswith("libllama") for n in names), names


def test_llama_correct_pins_pass(llama: backends.Server) -> None:
    """Pins of the shipped ggml/llama files: every mapped one is pinned and ok; nothing fails."""
    pins = _ggml_pins(llama)
    report = assess_libraries(loaded_libraries(llama.pid), pins, hash_file=HashCache())
    assert not [f for f in report.findings if f.status in (FAIL, UNKNOWN)], report.findings
    mapped = [r for r in report.rows if r.path]
    assert mapped and all(r.pinned and r.status == OK for r in mapped)


def test_llama_system_copy_fails(llama: backends.Server, tmp_path: Path) -> None:
    """Pinning libggml-base at another directory (as if the bundle's copy were elsewhere) fails naming both paths."""
    libs = loaded_libraries(llama.pid)
    base = [lib for lib in libs if lib.name.startswith("libggml-base")][0]
    other = tmp_path / base.name
    shutil.copyfile(base.path, other)
    findings = _findings(libs, {base.name: Pin(str(other), sha256(other))}, hash_file=HashCache())
    assert any(f.status == FAIL and base.path in f.message and str(other) in f.message for f in findings)


def test_llama_real_log_fallback_and_capacity(llama: backends.Server) -> None:
    """Real llama-server log: a cuda profile is a CPU fallback; capacity reads n_ctx_seq (2048) definitely."""
    log = llama.log_text()
    f = detect_cpu_fallback("llamacpp", log, "cuda")
    assert f is not None and f.status == FAIL
    ok = capacity_truth("llamacpp", log, 2048)
    assert ok.status == OK and ok.ceiling_tokens == 2048
    short = capacity_truth("llamacpp", log, 262144)
    assert short.status == WARN and "only on paper" in short.message
