"""`deploytool check`: every pitfall check fires on its bad case, with its evidence, and stays quiet on the examples.

The NCCL checks read real fatbins: libraries built here with the real nvcc for chosen architectures, and the
real libnccl.so.2 of the nvidia-nccl-cu12==2.32.3 wheel (no sm_75). The GPU itself cannot exist here: the
"box" is simulated only by `run_checks(on_box=True)`, which decides whether a cuda backend's missing files
are errors; nothing else about a GPU is mocked.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy_tool import checks
from deploy_tool.cli import main
from deploy_tool.config import Config
from tests.support import native
from tests.support.configs import DELETE, example_dict, load_dict, set_key
from tests.support.examples import examples

FT = "backends.ftllm-dflash"
LL = "backends.llamacpp-tensor"
FIELD_TEMPLATE_LINE = "{%- set effort = reasoning_effort if reasoning_effort is not none else 'medium' %}\n"

# Findings the examples are expected to show (everything else must stay quiet). The warning on two-2080ti is
# the real box's accepted trade-off: its custom template puts reasoning into `content` for thinking clients.
EXAMPLE_FINDINGS = {
    "two-2080ti": {
        ("ftllm-chat-template-thinking", "warning", "ftllm-dflash"),
        ("ftllm-draft-tokens-meaning", "info", "ftllm-dflash"),
        ("ftllm-kv-capacity", "info", "ftllm-dflash"),
        ("serve-public-no-api-key", "info", None),
        ("file-not-on-this-machine", "info", "ftllm-dflash"),
        ("file-not-on-this-machine", "info", "llamacpp-tensor"),
        ("llamacpp-log-verbosity", "info", "llamacpp-tensor"),
    },
    "cpu-demo": set(),
}


# ----------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def libs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real CUDA shared libraries built with nvcc for chosen architectures, plus a non-ELF file."""
    d = tmp_path_factory.mktemp("libs")
    out = {
        "sm75": native.build_cuda_so(d / "sm75.so", "arch=compute_75,code=sm_75"),
        "sm80": native.build_cuda_so(d / "sm80.so", "arch=compute_80,code=sm_80"),
    }
    text = d / "libnccl.so.2"
    text.write_text("not a library\n")
    out["text"] = text
    return out


def _two(tmp: Path, *changes: tuple[str, Any], on_box: bool = False, inspect: bool = True,
         example: str = "two-2080ti") -> list[checks.Finding]:
    data = example_dict(example)
    for k, v in changes:
        set_key(data, k, v)
    cfg = load_dict(tmp, data)
    return checks.run_checks(cfg, inspect_files=inspect, on_box=on_box)


def _only(findings: list[checks.Finding], id_: str) -> list[checks.Finding]:
    return [f for f in findings if f.id == id_]


def _one(findings: list[checks.Finding], id_: str, severity: str) -> checks.Finding:
    got = [f for f in findings if f.id == id_ and f.severity == severity]
    assert len(got) == 1, f"expected one {severity} {id_}, got {[(f.id, f.severity) for f in findings]}"
    return got[0]


def _write_template(tmp: Path, text: str) -> Path:
    p = tmp / "chat_template.jinja"
    p.write_text(text)
    return p


# ----------------------------------------------------------------------------------------- the table
# (case id, example, changes, expected check id, severity, evidence substrings)

Case = tuple[str, str, list[tuple[str, Any]], str, str, list[str]]
CASES: list[Case] = [
    ("cuda-graph-1", "two-2080ti", [(f"{FT}.env.FASTLLM_CUDA_GRAPH", "1")], "ftllm-cuda-graph-dflash", "error",
     ["'1'", "cudaErrorIllegalAddress", "sm_75", "only holds without speculative decoding"]),
    ("cuda-graph-unset", "two-2080ti", [(f"{FT}.env", {})], "ftllm-cuda-graph-dflash", "error",
     ["unset", "cudaErrorIllegalAddress"]),
    ("nccl-system", "two-2080ti", [(f"{FT}.nccl", DELETE)], "ftllm-nccl-system", "warning",
     ["2.22.3", "unhandled cuda error", "19.9 tok/s"]),
    ("nccl-bundle-missing", "two-2080ti", [("bundle.nccl", DELETE)], "ftllm-bundle-missing", "error",
     ["bundle.nccl is not configured"]),
    ("template-bundle-missing", "two-2080ti", [("bundle.chat_template", DELETE)], "ftllm-bundle-missing", "error",
     ["bundle.chat_template is not configured"]),
    ("draft-12", "two-2080ti", [(f"{FT}.speculative.num_draft_tokens", 12)], "ftllm-draft-tokens-max", "error",
     ["12", "does not start", "156.0/134.9/53.1"]),
    ("draft-4-meaning", "two-2080ti", [(f"{FT}.speculative.num_draft_tokens", 4)], "ftllm-draft-tokens-meaning",
     "info", ["drafts 3 token(s)", "4: 90.2/85.0/52.3", "8: 156.0/134.9/53.1"]),
    ("draft-missing", "two-2080ti", [(f"{FT}.speculative.draft_model", None)], "ftllm-draft-missing", "error",
     ["DFlash2"]),
    ("fp8-dflash", "two-2080ti", [(f"{FT}.kv_cache_dtype", "fp8")], "ftllm-fp8-kv-dflash", "error",
     ["262,144", "dflash.layers.4.mlp.gateup_proj", "196,608"]),
    ("cuda-embedding-long", "two-2080ti", [(f"{FT}.cuda_embedding", True)], "ftllm-cuda-embedding", "error",
     ["2.4 GB", "248,320 x 5,120", "1.41 GB", "156K"]),
    ("cuda-embedding-short", "two-2080ti", [(f"{FT}.cuda_embedding", True), (f"{FT}.tokens", 65536)],
     "ftllm-cuda-embedding", "warning", ["2.4 GB"]),
    ("ratio-097", "two-2080ti", [(f"{FT}.gpu_mem_ratio", 0.97)], "ftllm-gpu-mem-ratio", "error",
     ["0.97", "12 MB on device 0", "ChunkGatedDeltaRule"]),
    ("ratio-090", "two-2080ti", [(f"{FT}.gpu_mem_ratio", 0.90)], "ftllm-gpu-mem-ratio", "warning",
     ["0.9", "2.31 GB", "0.26 GB"]),
    ("ratio-unset", "two-2080ti", [(f"{FT}.gpu_mem_ratio", None)], "ftllm-gpu-mem-ratio", "warning",
     ["unset (ftllm's default is 0.9)"]),
    ("template-thinking", "cpu-demo", [(f"{FT}.clients_request_thinking", True)], "ftllm-chat-template-thinking",
     "warning", ["force_chat_template", "lone </think>", "reasoning_content"]),
    ("think", "two-2080ti", [(f"{FT}.think", True)], "ftllm-think-flag", "info", ["<think>\\n", "does not change"]),
    ("capacity-fp8", "two-2080ti", [(f"{FT}.kv_cache_dtype", "fp8")], "ftllm-kv-capacity", "error",
     ["16 full-attention layers (of 64) x 2 (K and V) x 4 KV heads x 256 dims = 32,768 elements", "x 1 byte (fp8)",
      "8.00 GiB", "4.00 GiB (4.29 GB) per card under TP=2", "3.96 GB"]),
    ("capacity-auto", "two-2080ti", [(f"{FT}.kv_cache_dtype", None)], "ftllm-kv-capacity", "error",
     ["x 2 byte (auto)", "16.00 GiB"]),
    ("capacity-embedding", "two-2080ti", [(f"{FT}.cuda_embedding", True)], "ftllm-kv-capacity", "error",
     ["- 2.55 GB --cuda_embedding = 1.41 GB"]),
    ("row", "two-2080ti", [(f"{LL}.split_mode", "row")], "llamacpp-split-row", "error",
     ["PR #24216", "does not support split buffers", "45 on b9870"]),
    ("tensor-no-ctx", "two-2080ti", [(f"{LL}.ctx_size", None)], "llamacpp-tensor-ctx", "error",
     ["ignores --fit", "default context"]),
    ("tensor-no-allreduce", "two-2080ti", [(f"{LL}.env", {})], "llamacpp-tensor-allreduce", "error",
     ["unset", "unhandled cuda error"]),
    ("tensor-nccl-allreduce", "two-2080ti", [(f"{LL}.env", {"GGML_CUDA_ALLREDUCE": "nccl"})],
     "llamacpp-tensor-allreduce", "error", ["'nccl'"]),
    ("mtp-q8", "two-2080ti", [(f"{LL}.cache_type_k", "q8_0"), (f"{LL}.cache_type_v", "q8_0")],
     "llamacpp-mtp-quantized-kv", "warning", ["q8_0", "59.96", "0.807", "52.67", "0.655", "57.16", "0.729"]),
    ("mixed-kv", "two-2080ti", [(f"{LL}.cache_type_v", "q8_0")], "llamacpp-tensor-mixed-kv", "error",
     ["-ctk f16 -ctv q8_0", "assert"]),
    ("spec-depth", "two-2080ti", [(f"{LL}.spec.draft_n_max", 5)], "llamacpp-spec-depth", "info",
     ["2: 52.50", "3: 59.44", "7: 44.36"]),
    ("q8-f16-262k", "two-2080ti", [(f"{LL}.model", "/models/gguf/Qwen3.8-27B-Q8_0.gguf")],
     "llamacpp-q8-f16-context", "warning", ["262,144", "196,608"]),
    ("template-no-patch", "two-2080ti", [("bundle.chat_template.patch", None)], "template-no-patch", "info",
     ["MuSR", "8,192"]),
    ("public-no-key", "cpu-demo", [("serve.host", "0.0.0.0")], "serve-public-no-api-key", "info",
     ["0.0.0.0", "18082"]),
    ("allow-local-only", "cpu-demo", [("serve.host", "0.0.0.0"), ("serve.allow", [])], "serve-allow-local-only",
     "warning", ["0.0.0.0", "serve.allow is empty", "IPAddressDeny=any", "18082"]),
    ("key-in-extra-args", "cpu-demo", [(f"{FT}.extra_args", ["--api_key", "s3cret"])], "api-key-exposed", "error",
     ["extra_args pass --api_key", "/proc/PID/cmdline", "serve.api_key_file"]),
    ("key-in-extra-args-llama", "cpu-demo", [(f"{LL}.extra_args", ["--api-key=s3cret"])], "api-key-exposed", "error",
     ["extra_args pass --api-key:", "/proc/PID/cmdline"]),
    ("key-in-env", "cpu-demo", [(f"{LL}.env", {"LLAMA_API_KEY": "s3cret"})], "api-key-exposed", "error",
     ["env sets LLAMA_API_KEY", "world-readable env file"]),
    ("cuda-no-gpus", "two-2080ti", [("host.gpus", [])], "device-cuda-no-gpus", "error", ["host.gpus is empty"]),
    ("tp-gpus", "two-2080ti", [("host.gpus", [1])], "device-tp-gpus", "error", ["--tp 2 needs 2 GPUs", "lists 1 (1)"]),
    ("cpu-cuda-flags", "cpu-demo", [(f"{FT}.tp", 2), (f"{FT}.env", {"FASTLLM_CUDA_GRAPH": "0"})],
     "device-cpu-cuda-flags", "warning", ["tp 2", "env FASTLLM_CUDA_GRAPH"]),
    ("cpu-llama-tensor", "cpu-demo", [(f"{LL}.split_mode", "tensor")], "device-cpu-cuda-flags", "warning",
     ["split_mode tensor"]),
    ("tensor-one-gpu", "two-2080ti", [("host.gpus", [0])], "llamacpp-tensor-one-device", "error",
     ["host.gpus [0]", "llama_params_fit is not implemented for SPLIT_MODE_TENSOR",
      "SPLIT_MODE_TENSOR being used for a single device is not recommended", "unsupported mul_mat split states"]),
    ("tensor-one-visible", "two-2080ti",
     [(f"{LL}.env", {"GGML_CUDA_ALLREDUCE": "internal", "CUDA_VISIBLE_DEVICES": "1"})],
     "llamacpp-tensor-one-device", "error", ["CUDA_VISIBLE_DEVICES='1'", "crash-loops"]),
    ("tensor-one-dev", "two-2080ti", [(f"{LL}.extra_args", ["-dev", "CUDA0"])], "llamacpp-tensor-one-device",
     "error", ["--device CUDA0"]),
    ("tensor-in-extra-args", "two-2080ti", [(f"{LL}.split_mode", None), (f"{LL}.extra_args", ["-sm", "tensor"]),
                                            ("host.gpus", [0])], "llamacpp-tensor-one-device", "error", ["one device"]),
    ("llama-default-verbosity", "two-2080ti", [], "llamacpp-log-verbosity", "info",
     ["default verbosity (3)", "KV buffer size", "n_ctx_slot", "could not determine"]),
    ("visible-not-allowed", "two-2080ti",
     [(f"{LL}.env", {"GGML_CUDA_ALLREDUCE": "internal", "CUDA_VISIBLE_DEVICES": "0,2"})],
     "cuda-devices-not-allowed", "error", ["GPU 2", "host.gpus", "/dev/nvidia2", "nvidia-modprobe -c=N"]),
    ("tp-visible", "two-2080ti", [(f"{FT}.env", {"FASTLLM_CUDA_GRAPH": "0", "CUDA_VISIBLE_DEVICES": "0"})],
     "device-tp-gpus", "error", ["--tp 2 needs 2 GPUs", "CUDA_VISIBLE_DEVICES='0' leaves 1"]),
    ("extra-port", "cpu-demo", [(f"{LL}.extra_args", ["--port", "9000"])], "extra-args-override", "error",
     ["--port", "18083", "listen on 9000", "only last value will be used"]),
    ("front-port-clash", "cpu-demo", [("serve.internal_port", 18082)], "front-port-clash", "error",
     ["serve.internal_port is 18082", "which is serve.port"]),
    ("front-hold-short", "cpu-demo", [("serve.hold_timeout_s", 5)], "front-hold-too-short", "error",
     ["serve.hold_timeout_s is 5 s", "clients would get 503"]),
    ("extra-model-name", "cpu-demo", [(f"{FT}.extra_args", ["--model_name=other"])], "extra-args-override", "error",
     ["--model_name=other", "answer to 'other'"]),
    ("threads", "cpu-demo", [(f"{FT}.threads", 4096)], "threads-beyond-cores", "warning", ["-t 4096", "15 s"]),
    ("draft-unused", "two-2080ti", [(f"{FT}.speculative.algorithm", "none")], "ftllm-draft-unused", "warning",
     ["never loaded", "33.7 tok/s"]),
    ("context-differs", "two-2080ti", [(f"{LL}.ctx_size", 196608)], "serve-context-differs", "info",
     ["ftllm-dflash 262,144", "llamacpp-tensor 196,608", "after a switch to llamacpp-tensor"]),
    ("context-differs-extra", "two-2080ti", [(f"{FT}.extra_args", ["--tokens", "131072"])],
     "serve-context-differs", "info", ["ftllm-dflash 131,072"]),
    ("ctx-over-training", "cpu-demo", [(f"{LL}.ctx_size", 8192)], "llamacpp-ctx-over-training", "warning",
     ["-c 8,192", "2,048 tokens", "capping", "only on paper"]),
    ("root-in-tmp", "cpu-demo", [("paths.root", "/tmp/deploytool-box/opt/deploytool")], "unit-path-hidden", "error",
     ["paths.root", "/tmp/deploytool-box/opt/deploytool", "PrivateTmp=yes", "cannot see it"]),
    ("model-in-var-tmp", "two-2080ti", [(f"{LL}.model", "/var/tmp/m.gguf")], "unit-path-hidden", "error",
     [f"{LL}.model", "/var/tmp/m.gguf", "llamacpp-tensor.service", "PrivateTmp=yes"]),
]


@pytest.fixture()
def cpu_demo_files(visible_dir: Path) -> Path:
    """The files cpu-demo names (the template from `init`, a tiny real GGUF model), where its units can see them
    (not tmp_path: /tmp is hidden from them by PrivateTmp=yes, which `check` reports)."""
    from deploy_tool import config
    from tests.support.tiny_model import write_model

    for name, data in config.example_companions("cpu-demo").items():
        (visible_dir / name).write_bytes(data)
    (visible_dir / "models").mkdir()
    write_model(visible_dir / "models" / "tiny-f16.gguf", f16=True)
    return visible_dir


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_check_fires_on_its_bad_case(case: Case, tmp_path: Path, cpu_demo_files: Path) -> None:
    """The check fires with its severity, its source and the measured evidence in the message."""
    _name, example, changes, id_, severity, evidence = case
    found = _two(cpu_demo_files, *changes, example=example)
    hits = [f for f in found if f.id == id_ and f.severity == severity]
    assert hits, f"no {severity} {id_} in {[(f.id, f.severity) for f in found]}"
    f = hits[0]
    for piece in evidence:
        assert piece in f.message, f"{piece!r} not in {f.message!r}"
    assert f.fix and f.source == next(c.source for c in checks.CATALOG if c.id == id_)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_checks_of_one_backend_find_what_the_whole_run_finds_of_it(case: Case, tmp_path: Path,
                                                                   cpu_demo_files: Path) -> None:
    """A switch's preflight runs the checks of its target only (`backends=`): on every bad case, for each
    backend, that finds exactly the findings of the whole run that name that backend or none (the box's)."""
    _name, example, changes, _id, _sev, _ev = case
    data = example_dict(example)
    for k, v in changes:
        set_key(data, k, v)
    cfg = load_dict(cpu_demo_files, data)
    whole = checks.run_checks(cfg, on_box=False)
    for name in cfg.backends:
        mine = checks.run_checks(cfg, on_box=False, backends=[name])
        assert [f for f in mine if f.backend in (None, name)] == [f for f in whole if f.backend in (None, name)]


@pytest.mark.parametrize("example", sorted(EXAMPLE_FINDINGS))
def test_examples_quiet_through_cli(example: str, visible_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`init` + `check --json` on each embedded example: exit 0, no errors, and only the expected findings.

    The machine is pinned as "not the box" (no NVIDIA driver), which is what it is here; on a GPU machine the
    box's missing model files would rightly be errors. The config lives where its units can see it.
    """
    tmp_path = visible_dir
    monkeypatch.setattr(checks, "nvidia_present", lambda: False)
    runner = CliRunner()
    cfg = tmp_path / "deploytool.yaml"
    r = runner.invoke(main, ["init", "--example", example, "--out", str(cfg)])
    assert r.exit_code == 0, r.output
    if example == "cpu-demo":
        from tests.support.tiny_model import write_model

        (tmp_path / "models").mkdir()
        write_model(tmp_path / "models" / "tiny-f16.gguf", f16=True)
    r = runner.invoke(main, ["--json", "--config", str(cfg), "check"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["ok"] is True
    got = {(f["id"], f["severity"], f["backend"]) for f in doc["findings"]}
    assert got == EXAMPLE_FINDINGS[example]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_case_not_on_examples(case: Case, tmp_path: Path, cpu_demo_files: Path) -> None:
    """No bad case's finding (id + severity) appears on either example unless listed as expected."""
    _name, _example, _changes, id_, severity, _ev = case
    for example in EXAMPLE_FINDINGS:
        found = {(f.id, f.severity) for f in _two(cpu_demo_files / example, example=example)
                 if f.id == id_ and f.severity == severity}
        expected = {(i, s) for i, s, _b in EXAMPLE_FINDINGS[example]}
        assert found <= expected, f"{id_} fires on {example}"


def test_every_catalog_id_is_tested() -> None:
    """Every check id in the catalog appears in this file's bad cases or in a dedicated test below."""
    dedicated = {"ftllm-nccl-arch", "ftllm-nccl-unreadable", "model-config-unreadable", "template-patch-match",
                 "template-sha256", "file-missing", "file-not-on-this-machine", "ftllm-gguf-f32", "model-unreadable",
                 "serve-port-in-use", "os-library-missing",  # serve-port-in-use: test_checks_contradictions.py, a real listener
                 # test_checks_gpu_host.py, on a fake host tree:
                 "gpu-device-classes", "nvidia-uvm-not-at-boot", "nvidia-modprobe-missing", "nvidia-persistenced-absent",
                 "cuda-no-driver", "gpu-missing", "gpu-nodes-closed",
                 # test_checks_gpu_host.py, on real fatbins made by nvcc:
                 "gpu-jit-first-start", "gpu-code-missing",
                 "path-not-root-only"}  # test_strictmodes.py, on a box's tree
    tested = {c[3] for c in CASES} | dedicated
    assert tested == checks.CHECK_IDS


def test_ids_are_unique_and_kebab() -> None:
    """Check ids are unique, lowercase kebab-case (stable, greppable)."""
    ids = [c.id for c in checks.CATALOG]
    assert len(ids) == len(set(ids))
    assert all(i == i.lower() and " " not in i and "_" not in i for i in ids)


# ----------------------------------------------------------------------------------------- NCCL, real fatbins


def test_nccl_without_sm75_real_wheel(tmp_path: Path) -> None:
    """The real nvidia-nccl-cu12 2.32.3 libnccl.so.2 has no sm_75: error naming the archs found and the CUDA rule."""
    lib = native.nccl_lib()
    f = _one(_two(tmp_path, ("bundle.nccl.library", str(lib))), "ftllm-nccl-arch", "error")
    assert "no sm_75 cubin" in f.message and "policy 'exact'" in f.message
    assert "unhandled cuda error" in f.message and "sm_70 on 7.5" in f.message
    assert "sm_80" in f.message  # an arch the wheel really carries, as the real cuobjdump lists it


def test_nccl_exact_sm75_passes(tmp_path: Path, libs: dict[str, Path]) -> None:
    """A library built with code=sm_75 satisfies the exact policy: no NCCL finding at all."""
    found = _two(tmp_path, ("bundle.nccl.library", str(libs["sm75"])))
    assert not [f for f in found if f.id.startswith("ftllm-nccl")]


def test_nccl_sm80_only_fails_both_policies(tmp_path: Path, libs: dict[str, Path]) -> None:
    """An sm_80-only library cannot run on 7.5: error under exact and under compatible."""
    for policy in ("exact", "compatible"):
        f = _one(_two(tmp_path / policy, ("bundle.nccl.library", str(libs["sm80"])),
                      ("bundle.nccl.arch_policy", policy)), "ftllm-nccl-arch", "error")
        assert "sm_80" in f.message and "nothing else that runs on a 7.5 device" in f.message


def test_nccl_same_major_exact_vs_compatible(tmp_path: Path, libs: dict[str, Path]) -> None:
    """On 8.6 cards an sm_80 cubin: exact policy errors (naming CUDA's same-major rule); compatible passes."""
    cc = ("host.compute_capability", "8.6")
    f = _one(_two(tmp_path / "e", cc, ("bundle.nccl.library", str(libs["sm80"]))), "ftllm-nccl-arch", "error")
    assert "no sm_86 cubin" in f.message and "policy 'compatible' would accept it" in f.message
    ok = _two(tmp_path / "c", cc, ("bundle.nccl.library", str(libs["sm80"])), ("bundle.nccl.arch_policy", "compatible"))
    assert not _only(ok, "ftllm-nccl-arch")


def test_nccl_force_downgrades(tmp_path: Path, libs: dict[str, Path]) -> None:
    """bundle.nccl.force turns the arch error into a warning that says it is bundled anyway."""
    f = _one(_two(tmp_path, ("bundle.nccl.library", str(libs["sm80"])), ("bundle.nccl.force", True)),
             "ftllm-nccl-arch", "warning")
    assert "force is set" in f.message


def test_nccl_ld_preload_inspected(tmp_path: Path, libs: dict[str, Path]) -> None:
    """Without the bundle, an NCCL named in env LD_PRELOAD is inspected instead of warning about the system one."""
    found = _two(tmp_path, (f"{FT}.nccl", DELETE), (f"{FT}.env.LD_PRELOAD", str(libs["sm80"])))
    # the file is not named libnccl*, so it is not recognised as NCCL: the system-NCCL warning stands
    assert _only(found, "ftllm-nccl-system")
    nccl = tmp_path / "libnccl.so.2"
    nccl.write_bytes(libs["sm80"].read_bytes())
    found = _two(tmp_path / "b", (f"{FT}.nccl", DELETE), (f"{FT}.env.LD_PRELOAD", str(nccl)))
    f = _one(found, "ftllm-nccl-arch", "error")
    assert "LD_PRELOAD" in f.message and not _only(found, "ftllm-nccl-system")


def test_nccl_not_elf(tmp_path: Path, libs: dict[str, Path]) -> None:
    """A text file posing as libnccl.so.2 gives one clear error naming the path, not a traceback."""
    f = _one(_two(tmp_path, ("bundle.nccl.library", str(libs["text"]))), "ftllm-nccl-unreadable", "error")
    assert str(libs["text"]) in f.message


def test_nccl_not_checked_without_speculation_or_tp(tmp_path: Path, libs: dict[str, Path]) -> None:
    """TP=1, or no speculative decoding: the NCCL arch does not matter for the crash, so no NCCL finding."""
    for i, change in enumerate([(f"{FT}.tp", 1), (f"{FT}.speculative", None)]):
        found = _two(tmp_path / str(i), ("bundle.nccl.library", str(libs["sm80"])), change)
        assert not [f for f in found if f.id.startswith("ftllm-nccl")]


# ----------------------------------------------------------------------------------------- llama.cpp -sm row


def test_row_on_binary_without_split_buffer(tmp_path: Path) -> None:
    """-sm row with a binary that has 0 'split_buffer' strings: error saying this build removed row split."""
    binary = tmp_path / "bin" / "llama-server"
    binary.parent.mkdir()
    binary.write_bytes(b"\x7fELF" + b"\0" * 100 + b"ggml_backend_cuda_buffer" + b"\0" * 100)
    binary.chmod(0o755)
    f = _one(_two(tmp_path, (f"{LL}.split_mode", "row"), (f"{LL}.binary", str(binary))), "llamacpp-split-row",
             "error")
    assert "0 'split_buffer' strings" in f.message and "removed row split" in f.message


def test_row_on_real_shared_build(tmp_path: Path) -> None:
    """The real llama-server (shared build): split-buffer code lives in libllama beside it, so it is counted there."""
    from tests.support.backends import llama_server_binary

    binary = llama_server_binary()
    f = _one(_two(tmp_path, (f"{LL}.split_mode", "row"), (f"{LL}.binary", str(binary))), "llamacpp-split-row",
             "warning")
    assert "libraries beside it still contain(s)" in f.message and "next upgrade" in f.message
    files = checks.llama_files(str(binary))
    assert any("libllama" in p for p in files) and len(files) > 2


# ----------------------------------------------------------------------------------------- chat template


def test_template_patch_must_match_once(tmp_path: Path) -> None:
    """The patch's find text occurring 0 or 2 times is an error with the count; exactly once is quiet."""
    for text, n in (("no such line\n", 0), (FIELD_TEMPLATE_LINE * 2, 2)):
        d = tmp_path / str(n)
        d.mkdir()
        _write_template(d, text)
        f = _one(_two(d), "template-patch-match", "error")
        assert f"occurs {n} times" in f.message and "492315ea" in f.message
    d = tmp_path / "once"
    d.mkdir()
    _write_template(d, FIELD_TEMPLATE_LINE)
    assert not _only(_two(d), "template-patch-match")


def test_template_sha256(tmp_path: Path) -> None:
    """A pinned SHA-256 that differs from the file is an error naming both hashes; a matching one is quiet."""
    p = _write_template(tmp_path, FIELD_TEMPLATE_LINE)
    good = hashlib.sha256(p.read_bytes()).hexdigest()
    assert not _only(_two(tmp_path, ("bundle.chat_template.sha256", good)), "template-sha256")
    f = _one(_two(tmp_path, ("bundle.chat_template.sha256", "0" * 64)), "template-sha256", "error")
    assert good in f.message and "0" * 64 in f.message


# ----------------------------------------------------------------------------------------- files


def test_missing_files_on_the_box_are_errors(tmp_path: Path) -> None:
    """On the box (on_box=True) every missing file is an error; the ftllm model's says ftllm would download."""
    found = _two(tmp_path, on_box=True)
    missing = _only(found, "file-missing")
    assert all(f.severity == "error" for f in missing)
    text = "\n".join(f.message for f in missing)
    for path in ("/models/Qwen3.8-27B-Uncensored-FP8", "/models/Qwen3.8-27B-DFlash2",
                 "/opt/llama.cpp-b10064/bin/llama-server", "/models/gguf/mmproj-Qwen3.8-27B-F16.gguf",
                 "/opt/nccl-2.31.2-sm75/lib/libnccl.so.2", "chat_template.jinja"):
        assert path in text
    model = next(f for f in missing if "backends.ftllm-dflash.model:" in f.message)
    assert "download" in model.message and "HFDNormalDownloader" in model.message
    assert not _only(found, "file-not-on-this-machine")


def test_missing_files_elsewhere_are_info(tmp_path: Path) -> None:
    """Off the box the cuda backends' files are listed once per backend as info, never as errors."""
    found = _two(tmp_path, on_box=False)
    assert not _only(found, "file-missing")
    infos = _only(found, "file-not-on-this-machine")
    assert {f.backend for f in infos} == {"ftllm-dflash", "llamacpp-tensor"}
    assert all(f.severity == "info" for f in infos)


def test_cpu_backend_missing_model_is_error(tmp_path: Path) -> None:
    """A cpu backend runs here, so its missing model is an error even off the box."""
    found = _two(tmp_path, example="cpu-demo", on_box=False)
    errs = [f for f in _only(found, "file-missing") if f.backend is not None]
    assert {f.backend for f in errs} == {"ftllm-dflash", "llamacpp-tensor"}
    assert all("models/tiny-f16.gguf does not exist" in f.message for f in errs)
    tpl = [f for f in _only(found, "file-missing") if f.backend is None]
    assert len(tpl) == 1 and "chat_template.jinja does not exist; `deploytool pack` bundles it" in tpl[0].message


def test_no_files_skips_inspection(tmp_path: Path) -> None:
    """inspect_files=False reads no file: no file findings at all."""
    found = _two(tmp_path, example="cpu-demo", inspect=False)
    assert not [f for f in found if f.id.startswith("file-")]


def test_installed_paths_skipped_until_install(tmp_path: Path) -> None:
    """{venv}/{current} paths exist only after install: not reported while the install root is absent."""
    found = _two(tmp_path, (f"{LL}.binary", "{venv}/bin/llama-server"), on_box=True)
    assert "llama-server" not in " ".join(f.message for f in _only(found, "file-missing") if "binary" in f.message)


# ----------------------------------------------------------------------------------------- capacity


def _model_dir(tmp: Path, cfg_json: object) -> Path:
    d = tmp / "model"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg_json) if not isinstance(cfg_json, str) else cfg_json)
    return d


def test_capacity_production_passes_failing_case_fails(tmp_path: Path) -> None:
    """fp4 at 262,144 fits (4 GiB, 2 per card); fp8 at 262,144 does not (8 GiB, 4 per card); arithmetic shown."""
    ok = _one(_two(tmp_path / "fp4"), "ftllm-kv-capacity", "info")
    assert "4.00 GiB, 2.00 GiB (2.15 GB) per card under TP=2" in ok.message
    bad = _one(_two(tmp_path / "fp8", (f"{FT}.kv_cache_dtype", "fp8")), "ftllm-kv-capacity", "error")
    assert "8.00 GiB, 4.00 GiB (4.29 GB) per card" in bad.message and "= 3.96 GB" in bad.message


def test_capacity_from_model_config_layer_types(tmp_path: Path) -> None:
    """config.json with layer_types (Qwen3.5-class, under text_config): full-attention layers counted from it."""
    types = (["linear_attention"] * 3 + ["full_attention"]) * 16
    d = _model_dir(tmp_path, {"text_config": {"num_hidden_layers": 64, "layer_types": types,
                                              "num_attention_heads": 24, "num_key_value_heads": 4,
                                              "head_dim": 256, "hidden_size": 5120}})
    f = _one(_two(tmp_path, (f"{FT}.model", str(d))), "ftllm-kv-capacity", "info")
    assert "16 full-attention layers (of 64)" in f.message and str(d / "config.json") in f.message


def test_capacity_from_model_config_interval(tmp_path: Path) -> None:
    """full_attention_interval 2 on 64 layers gives 32 full layers: fp4 needs 4.00 GiB per card, which fails."""
    d = _model_dir(tmp_path, {"num_hidden_layers": 64, "full_attention_interval": 2, "num_attention_heads": 24,
                              "num_key_value_heads": 4, "hidden_size": 6144})
    f = _one(_two(tmp_path, (f"{FT}.model", str(d))), "ftllm-kv-capacity", "error")
    assert "32 full-attention layers (of 64)" in f.message and "256 dims" in f.message


def test_capacity_unreadable_model_config(tmp_path: Path) -> None:
    """A broken config.json is a warning and the write-up's figures are used instead."""
    d = _model_dir(tmp_path, "{not json")
    found = _two(tmp_path, (f"{FT}.model", str(d)))
    w = _one(found, "model-config-unreadable", "warning")
    assert "config.json" in w.message
    assert "write-up's Qwen3.8-27B figures" in _one(found, "ftllm-kv-capacity", "info").message


@pytest.mark.parametrize("bad", [{"num_hidden_layers": "64"}, [], {"num_hidden_layers": 64, "num_attention_heads": 0},
                                 {"num_hidden_layers": 64, "num_attention_heads": 8, "head_dim": True}])
def test_kv_shape_rejects_bad_config(bad: object) -> None:
    """kv_shape_from_config raises ValueError (never anything else) on malformed configs."""
    with pytest.raises(ValueError):
        checks.kv_shape_from_config(bad)


# ----------------------------------------------------------------------------------------- CLI


def test_check_cli_exit_4_and_json(tmp_path: Path) -> None:
    """`check` with an error exits 4, prints the table, and `--json` lists the finding with all its fields."""
    data = example_dict("two-2080ti")
    set_key(data, f"{FT}.env.FASTLLM_CUDA_GRAPH", "1")
    cfg: Config = load_dict(tmp_path, data)
    runner = CliRunner()
    r = runner.invoke(main, ["--config", cfg.source_path, "check"])
    assert r.exit_code == 4
    assert "ftllm-cuda-graph-dflash" in r.stdout and "fix:" in r.stdout
    assert "Traceback" not in r.output
    r = runner.invoke(main, ["--json", "--config", cfg.source_path, "check"])
    assert r.exit_code == 4
    doc = json.loads(r.stdout)
    f = next(x for x in doc["findings"] if x["id"] == "ftllm-cuda-graph-dflash")
    assert set(f) == {"id", "severity", "backend", "message", "fix", "source"} and f["source"].endswith("pitfall 2")


def test_findings_sorted_errors_first(tmp_path: Path) -> None:
    """Findings come errors first, then warnings, then info."""
    found = _two(tmp_path, (f"{FT}.env.FASTLLM_CUDA_GRAPH", "1"), (f"{FT}.gpu_mem_ratio", 0.9))
    order = [checks.SEVERITY_ORDER[f.severity] for f in found]
    assert order == sorted(order) and order[0] == 0



def test_installed_box_uses_bundled_copies(tmp_path: Path, libs: dict[str, Path]) -> None:
    """After install the pack-time sources may be gone: the release's NCCL is inspected, nothing is 'missing'."""
    current = tmp_path / "opt" / "deploytool" / "current"
    (current / "nccl").mkdir(parents=True)
    (current / "templates").mkdir()
    (current / "nccl" / "libnccl.so.2").write_bytes(libs["sm80"].read_bytes())
    (current / "templates" / "chat_template.jinja").write_text("patched\n")
    found = _two(tmp_path, ("paths.root", str(tmp_path / "opt" / "deploytool")),
                 ("bundle.nccl.library", str(tmp_path / "gone" / "libnccl.so.2")), on_box=True)
    assert not [f for f in _only(found, "file-missing") if f.backend is None]
    f = _one(found, "ftllm-nccl-arch", "error")
    assert "the installed release's NCCL" in f.message and str(current / "nccl" / "libnccl.so.2") in f.message


def test_hostile_paths_never_raise(tmp_path: Path) -> None:
    """Over-long names, directories and devices in every path the checks read: findings, never an exception."""
    for i, bad in enumerate(["/tmp/" + "a" * 300, "/dev/null", "/etc", str(tmp_path)]):
        found = _two(tmp_path / str(i), (f"{FT}.model", bad), (f"{FT}.model_config", bad), (f"{LL}.binary", bad),
                     (f"{LL}.split_mode", "row"), ("bundle.nccl.library", bad), ("bundle.chat_template.source", bad),
                     on_box=True)
        assert _only(found, "file-missing"), bad


# ----------------------------------------------------------------------------------------- GGUF models


def _gguf_with_file_type(path: Path, file_type: int) -> Path:
    """A real (tensor-less) GGUF written by the gguf package, carrying only general.file_type."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_file_type(file_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_ftllm_f32_gguf(cpu_demo_files: Path) -> None:
    """A real F32 GGUF for ftllm is an error naming the F32 matrices (ftllm dies with SIGFPE); F16 is quiet."""
    from tests.support.tiny_model import write_model

    f32 = write_model(cpu_demo_files / "models" / "tiny-f32.gguf", f16=False)
    found = _two(cpu_demo_files, (f"{FT}.model", str(f32)), example="cpu-demo")
    f = _one(found, "ftllm-gguf-f32", "error")
    assert "16 weight matrices as F32" in f.message and "token_embd.weight" in f.message
    assert "ALL_F32" in f.message and "SIGFPE" in f.message
    assert not [x for x in found if x.backend == "llamacpp-tensor" and x.severity != "info"]  # llama.cpp takes F32
    assert not _only(_two(cpu_demo_files, example="cpu-demo"), "ftllm-gguf-f32")  # the F16 tiny model


def test_gguf_header_matches_gguf_reader(tmp_path: Path) -> None:
    """The pure-Python header reader agrees with the gguf package's reader on every tensor's shape and type."""
    import gguf

    from deploy_tool.gguf_header import read_header
    from tests.support.tiny_model import write_model

    for f16 in (True, False):
        p = write_model(tmp_path / f"m{int(f16)}.gguf", f16=f16)
        ours = {t.name: (t.shape, t.ggml_type) for t in read_header(p).tensors}
        theirs = {t.name: (tuple(int(x) for x in t.shape), int(t.tensor_type)) for t in gguf.GGUFReader(str(p)).tensors}
        assert ours == theirs and len(ours) == 21


def test_model_not_gguf(tmp_path: Path) -> None:
    """A .gguf that is not GGUF (or is truncated) is one error naming the file, never an exception."""
    from tests.support.tiny_model import write_model

    bad = tmp_path / "bad.gguf"
    bad.write_text("not a model\n")
    good = write_model(tmp_path / "good.gguf", f16=True)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:300])
    for p, words in ((bad, "no GGUF magic"), (cut, "truncated at byte")):
        f = _one(_two(tmp_path / p.stem, (f"{FT}.model", str(p)), example="cpu-demo"), "model-unreadable", "error")
        assert str(p) in f.message and words in f.message


def test_q8_detected_from_gguf_header(tmp_path: Path) -> None:
    """llama.cpp Q8_0 + f16 KV at 262,144 is detected from general.file_type, which wins over the file name."""
    q8 = _gguf_with_file_type(tmp_path / "model.gguf", 7)
    f = _one(_two(tmp_path / "a", (f"{LL}.model", str(q8))), "llamacpp-q8-f16-context", "warning")
    assert "general.file_type MOSTLY_Q8_0" in f.message
    q4 = _gguf_with_file_type(tmp_path / "Qwen-Q8_0-named.gguf", 15)
    assert not _only(_two(tmp_path / "b", (f"{LL}.model", str(q4))), "llamacpp-q8-f16-context")


# ----------------------------------------------------------------------------------------- what the units see


def _hidden(cfg_dir: Path, *changes: tuple[str, Any]) -> list[checks.Finding]:
    return _only(_two(cfg_dir, *changes, example="cpu-demo"), "unit-path-hidden")


@settings(max_examples=examples(40), deadline=5000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(min_value=0, max_value=0o777), min_size=3, max_size=3))
def test_dynamic_user_needs_every_directory_on_the_way_open(cpu_demo_files: Path, modes: list[int]) -> None:
    """serve.user dynamic (DynamicUser=yes): whatever modes the directories between the box and the model have,
    `check` reports the first one without o+x by path and mode, naming DynamicUser, and nothing when all have it;
    run as root (serve.user: root), the same tree is fine."""
    chain = [cpu_demo_files / "a", cpu_demo_files / "a" / "b", cpu_demo_files / "a" / "b" / "c"]
    chain[-1].mkdir(parents=True, exist_ok=True)
    model = chain[-1] / "m.gguf"
    if not model.exists():
        shutil.copy(cpu_demo_files / "models" / "tiny-f16.gguf", model)
    for d, m in zip(chain, modes, strict=True):
        os.chmod(d, m)
    try:
        found = _hidden(cpu_demo_files, (f"{LL}.model", str(model)))
        closed = next((d for d, m in zip(chain, modes, strict=True) if not m & 0o001), None)
        if closed is None:
            assert found == []
        else:
            assert len(found) == 1, found
            f = found[0]
            assert f.backend == "llamacpp-tensor" and f.severity == "error"
            assert f"{closed} is mode {modes[chain.index(closed)]:04o}" in f.message
            assert "DynamicUser" in f.message and f"{LL}.model" in f.message and "pass through" in f.message
        assert _hidden(cpu_demo_files, (f"{LL}.model", str(model)), ("serve.user", "root")) == []
    finally:
        for d in chain:
            os.chmod(d, 0o755)


def test_dynamic_user_cannot_read_a_private_model(cpu_demo_files: Path) -> None:
    """A model file of mode 0600 (the directories open): the server's DynamicUser cannot read it."""
    model = cpu_demo_files / "models" / "tiny-f16.gguf"
    os.chmod(model, 0o600)
    found = _hidden(cpu_demo_files)
    assert {f.backend for f in found} == {"ftllm-dflash", "llamacpp-tensor"} and len(found) == 2
    for f in found:
        assert f"{model} is mode 0600" in f.message and "cannot read it" in f.message
        assert f.fix.startswith(f"chmod o+r {model}")
    os.chmod(model, 0o644)
    assert _hidden(cpu_demo_files) == []


def test_a_scoped_run_looks_at_the_units_of_its_backends_only(tmp_path: Path) -> None:
    """A switch's preflight runs the checks scoped to its target: a unit of the other backend that cannot see its
    model is that backend's finding, reported by an unscoped `check`, not rendered for the target's preflight."""
    data = example_dict("two-2080ti")
    set_key(data, f"{LL}.model", "/var/tmp/m.gguf")
    cfg = load_dict(tmp_path, data)
    whole = _only(checks.run_checks(cfg, inspect_files=False, on_box=False), "unit-path-hidden")
    assert [f.backend for f in whole] == ["llamacpp-tensor"]
    assert _only(checks.run_checks(cfg, inspect_files=False, on_box=False, backends=["ftllm-dflash"]),
                 "unit-path-hidden") == []
    assert _only(checks.run_checks(cfg, inspect_files=False, on_box=False, backends=["llamacpp-tensor"]),
                 "unit-path-hidden") == whole


def test_a_box_in_a_home_is_reported_with_protecthome_named(cpu_demo_files: Path) -> None:
    """The box under /root: the units' ProtectHome=yes leaves the servers an empty /root, whatever its mode;
    reported for each backend, naming the directive and where to move the box."""
    found = _hidden(cpu_demo_files, ("paths.root", "/root/deploytool-box/opt"))
    assert {f.backend for f in found} == {"ftllm-dflash", "llamacpp-tensor"}
    for f in found:
        assert "ProtectHome=yes gives the server empty or inaccessible home directories" in f.message
        assert "paths.root" in f.message and f.fix.startswith("move it out of /root")


def test_a_box_in_a_closed_home_is_reported_with_protecthome_named(cpu_demo_files: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """With a drop-in's ProtectHome=read-only, the box under a 0700 home (as /root is): reported for each backend,
    naming the home and the read-only view (visible, not open); paths.root and the models are listed."""
    home = Path("/root")
    if os.stat(home).st_mode & 0o001:
        pytest.skip("/root is world-traversable on this machine")
    real = checks._unit_settings
    monkeypatch.setattr(checks, "_unit_settings", lambda cfg, b: {**real(cfg, b), "ProtectHome": "read-only"})
    found = _hidden(cpu_demo_files, ("paths.root", "/root/deploytool-box/opt"))
    assert {f.backend for f in found} == {"ftllm-dflash", "llamacpp-tensor"}
    for f in found:
        assert "/root is mode" in f.message and "ProtectHome=read-only leaves /root visible" in f.message
        assert "paths.root" in f.message


def test_protect_home_yes_and_private_tmp_off(cpu_demo_files: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rules follow the unit's directives (a fake unit for the cases the template does not render):
    ProtectHome=yes hides /home; PrivateTmp=no and no DynamicUser leave /tmp visible."""
    real = checks._unit_settings
    monkeypatch.setattr(checks, "_unit_settings", lambda cfg, b: {**real(cfg, b), "ProtectHome": "yes"})
    f = _hidden(cpu_demo_files, (f"{LL}.model", "/home/alice/m.gguf"))
    assert len(f) == 1 and "ProtectHome=yes" in f[0].message and "/home/alice/m.gguf" in f[0].message
    monkeypatch.setattr(checks, "_unit_settings", lambda cfg, b: {"PrivateTmp": "no", "User": "root"})
    assert _hidden(cpu_demo_files, (f"{LL}.model", "/tmp/m.gguf")) == []


def test_the_demo_box_layout_is_visible(cpu_demo_files: Path) -> None:
    """cpu-demo as the demo and the e2e suite lay it out (a run directory under /var/lib): nothing to report."""
    assert str(cpu_demo_files).startswith("/var/lib/") or os.environ.get("DEPLOYTOOL_TEST_ROOT")
    assert _hidden(cpu_demo_files) == []


# ----------------------------------------------------------------------------------------- OS libraries


def _gcc(*args: str) -> None:
    import shutil
    import subprocess

    gcc = shutil.which("gcc")
    assert gcc, "gcc is part of the setup"
    subprocess.run([gcc, *args], check=True, timeout=120)


def _llama_server(d: Path, soname: str) -> tuple[Path, Path]:
    """(a real gcc-built llama-server in `d`, the shared library `soname` beside it that it loads via $ORIGIN)."""
    d.mkdir(exist_ok=True)
    (d / "g.c").write_text("int g(void) { return 0; }\n")
    (d / "m.c").write_text("int g(void); int main(void) { return g(); }\n")
    lib = d / soname
    _gcc("-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", str(lib), str(d / "g.c"))
    exe = d / "llama-server"
    _gcc("-o", str(exe), str(d / "m.c"), str(lib), "-Wl,-rpath,$ORIGIN")
    return exe, lib


def test_os_library_missing_is_named_with_its_backend(tmp_path: Path) -> None:
    """A llama-server (a real gcc-built executable) whose shared library is not on this machine: `check` names
    the library and the binary, as an error of that backend; with the library back, the check is quiet."""
    exe, lib = _llama_server(tmp_path / "build", "libgompish.so.1")
    cfg_changes = ((f"{LL}.binary", str(exe)),)
    assert not [f for f in _two(tmp_path, *cfg_changes, example="cpu-demo") if f.id == "os-library-missing"]
    lib.unlink()
    f = _one(_two(tmp_path, *cfg_changes, example="cpu-demo"), "os-library-missing", "error")
    assert f.backend == "llamacpp-tensor" and "libgompish.so.1" in f.message and str(exe) in f.message
    assert not [f for f in _two(tmp_path, *cfg_changes, example="cpu-demo", inspect=False)
                if f.id == "os-library-missing"]


def test_os_libraries_scoped_to_the_backends_checked(tmp_path: Path) -> None:
    """A switch's preflight checks its target alone (run_checks(backends=[...])): for llama-server, its own
    closure, not every ELF file of the release's venv (3.7 GB on the real box); for ftllm, the whole venv. Real
    gcc-built files: a venv library that needs a library nowhere on this machine, and a llama-server outside the
    venv with its own library beside it."""
    exe, lib = _llama_server(tmp_path / "build", "libllamaish.so.1")
    d = tmp_path / "venv-build"
    d.mkdir()
    (d / "n.c").write_text("int n(void) { return 0; }\n")
    (d / "c.c").write_text("int n(void); int c(void) { return n(); }\n")
    gone = d / "libgonefromos.so.7"
    _gcc("-shared", "-fPIC", "-Wl,-soname,libgonefromos.so.7", "-o", str(gone), str(d / "n.c"))
    root = tmp_path / "root"
    site = root / "current" / "venv" / "lib" / "python3.11" / "site-packages" / "ftllm"
    site.mkdir(parents=True)
    _gcc("-shared", "-fPIC", "-o", str(site / "_engine.so"), str(d / "c.c"), str(gone))
    gone.unlink()  # the library the venv's file needs is on no path of this machine
    data = example_dict("cpu-demo")
    set_key(data, f"{LL}.binary", str(exe))
    set_key(data, "paths.root", str(root))
    cfg = load_dict(tmp_path, data)

    def missing(backends: list[str] | None) -> set[tuple[str | None, str]]:
        return {(f.backend, f.message.split(" ", 1)[0])
                for f in checks.run_checks(cfg, on_box=False, backends=backends) if f.id == "os-library-missing"}

    assert missing(None) == {("ftllm-dflash", "libgonefromos.so.7")}
    assert missing(["ftllm-dflash"]) == {("ftllm-dflash", "libgonefromos.so.7")}
    assert missing(["llamacpp-tensor"]) == set()
    lib.unlink()
    assert missing(["llamacpp-tensor"]) == {("llamacpp-tensor", "libllamaish.so.1")}
    assert missing(None) == {("ftllm-dflash", "libgonefromos.so.7"), ("llamacpp-tensor", "libllamaish.so.1")}
