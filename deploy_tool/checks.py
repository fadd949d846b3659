"""Every known pitfall of the two-card box, as a named check with a stable id, severity, evidence and fix.

Each check reads a Config (and, with `inspect_files`, the files it names: the NCCL library's fatbin, the
llama-server binary's strings, the chat template, the model's config.json) and returns Findings. The
evidence in the messages is what the field write-ups measured; `source` says which pitfall it comes from.
Checks never run external programs. One import stays inside the checks that use it: binaries (the ELF and
fatbin reader), which only the checks that inspect a library need (`check` and a switch's
preflight of a config without libraries to read do not pay for it).

Files the config names that do not exist: on the machine a backend runs on (a `cpu` backend, or a `cuda`
backend on a machine with an NVIDIA driver) a missing file is an error. On a machine without an NVIDIA GPU a
`cuda` backend's files are expected to live on the box, so their absence is reported once per backend as
info ("not on this machine") instead: checking the box's config on a laptop stays quiet, and the same
config checked on the box itself fails loudly.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from deploy_tool import gguf_header, gpu, portwait
from deploy_tool.config import (
    BUNDLED_NCCL,
    BUNDLED_TEMPLATE,
    Backend,
    Config,
    FtllmBackend,
    LlamacppBackend,
    expand,
)
from deploy_tool.errors import DeployError, InputError
from deploy_tool.gguf_header import GgufHeader
from deploy_tool.render import (
    FRONT_SERVICE,
    NVIDIA_DEVICE_CLASSES,
    NVIDIA_MODPROBE,
    NVIDIA_PERSISTENCED,
    backend_env,
    render_backend,
    server_argv,
)

Severity = Literal["error", "warning", "info"]
SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


@dataclass(frozen=True)
class Finding:
    id: str  # stable id, e.g. "ftllm-cuda-graph-dflash"
    severity: Severity
    backend: str | None  # None for box-wide findings
    message: str  # what is wrong, with the measured evidence
    fix: str  # what to do
    source: str  # where the knowledge comes from, e.g. "field notes, pitfall 2"

    def to_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class CheckInfo:
    """One entry of the catalog: what a check id means (for docs and `--json` consumers)."""

    id: str
    severity: Severity  # the usual severity; some checks downgrade (e.g. nccl.force) or upgrade
    title: str
    source: str


# The catalog of stable ids. Ids never change meaning; new checks get new ids.
CATALOG: tuple[CheckInfo, ...] = (
    CheckInfo("ftllm-cuda-graph-dflash", "error", "DFlash with FASTLLM_CUDA_GRAPH not 0", "field notes, pitfall 2"),
    CheckInfo("ftllm-nccl-arch", "error", "TP>1 speculative decoding with an NCCL lacking the GPUs' arch",
              "field notes, pitfall 1"),
    CheckInfo("ftllm-nccl-system", "warning", "TP>1 speculative decoding with the system NCCL",
              "field notes, pitfall 1"),
    CheckInfo("ftllm-nccl-unreadable", "error", "the NCCL library is not an ELF shared library",
              "field notes, pitfall 1"),
    CheckInfo("ftllm-bundle-missing", "error", "a backend uses the bundle's template or NCCL, which is not configured",
              "config"),
    CheckInfo("ftllm-draft-tokens-max", "error", "--speculative_num_draft_tokens 12 or more does not start",
              "field notes, pitfall 8"),
    CheckInfo("ftllm-draft-tokens-meaning", "info", "--speculative_num_draft_tokens N drafts N-1 tokens",
              "field notes, pitfall 8"),
    CheckInfo("ftllm-draft-missing", "error", "DFlash without a draft model", "field notes, backend A"),
    CheckInfo("ftllm-fp8-kv-dflash", "error", "fp8 KV with DFlash2 above 196,608 tokens OOMs", "field notes, pitfall 3"),
    CheckInfo("ftllm-cuda-embedding", "error", "--cuda_embedding at long context", "field notes, pitfalls 3 and 4"),
    CheckInfo("ftllm-gpu-mem-ratio", "warning", "--gpu_mem_ratio other than 0.95", "field notes, pitfall 3"),
    CheckInfo("ftllm-chat-template-thinking", "warning", "custom chat template while clients request thinking",
              "field notes, pitfall 5"),
    CheckInfo("ftllm-think-flag", "info", "--think only prepends <think>", "field notes, pitfall 6"),
    CheckInfo("ftllm-kv-capacity", "error", "KV cache does not fit the cards", "field notes, pitfall 4"),
    CheckInfo("model-config-unreadable", "warning", "the model's config.json cannot be used for capacity math",
              "field notes, pitfall 4"),
    CheckInfo("llamacpp-split-row", "error", "llama.cpp -sm row was removed upstream", "field notes, pitfall 9"),
    CheckInfo("llamacpp-tensor-ctx", "error", "-sm tensor without an explicit -c", "field notes, pitfall 10"),
    CheckInfo("llamacpp-tensor-allreduce", "error", "-sm tensor without GGML_CUDA_ALLREDUCE=internal",
              "field notes, pitfall 11"),
    CheckInfo("llamacpp-mtp-quantized-kv", "warning", "quantized main KV lowers MTP acceptance",
              "field notes, pitfall 12"),
    CheckInfo("llamacpp-tensor-mixed-kv", "error", "mixed -ctk/-ctv types assert under tensor split",
              "field notes, pitfall 12"),
    CheckInfo("llamacpp-q8-f16-context", "warning", "Q8_0 weights + f16 KV above 196,608 tokens OOMs",
              "field notes, pitfall 12"),
    CheckInfo("llamacpp-spec-depth", "info", "--spec-draft-n-max other than 3 under tensor split",
              "field notes, pitfall 13"),
    CheckInfo("template-patch-match", "error", "the chat-template patch does not match exactly once",
              "field notes, pitfall 7"),
    CheckInfo("template-sha256", "error", "the original chat template's SHA-256 differs", "field notes, pitfall 14"),
    CheckInfo("template-no-patch", "info", "the chat template is bundled without the reasoning-effort patch",
              "field notes, pitfall 7"),
    CheckInfo("file-missing", "error", "a file the config names does not exist", "config"),
    CheckInfo("file-not-on-this-machine", "info", "the box's files are not on this machine (not checked)", "config"),
    CheckInfo("serve-public-no-api-key", "info", "bound to all interfaces without an API key", "config"),
    CheckInfo("api-key-exposed", "error", "an API key in extra_args or env, which every local user can read",
              "config"),
    CheckInfo("serve-allow-local-only", "warning", "bound beyond localhost while serve.allow admits no client",
              "config"),
    CheckInfo("device-cuda-no-gpus", "error", "device cuda with host.gpus empty", "config"),
    CheckInfo("device-cpu-cuda-flags", "warning", "device cpu with CUDA-only settings", "config"),
    CheckInfo("device-tp-gpus", "error", "tensor parallel degree larger than host.gpus", "config"),
    CheckInfo("ftllm-gguf-f32", "error", "ftllm on a GGUF with F32 weight matrices dies with SIGFPE",
              "field notes, facts about the servers"),
    CheckInfo("model-unreadable", "error", "the model file is not a readable GGUF", "config"),
    CheckInfo("llamacpp-tensor-one-device", "error", "-sm tensor with one visible GPU aborts at the first decode",
              "field notes, pitfall 15"),
    CheckInfo("llamacpp-log-verbosity", "info", "llama-server's default verbosity logs no buffer sizes",
              "field notes, pitfall 16"),
    CheckInfo("cuda-devices-not-allowed", "error", "CUDA_VISIBLE_DEVICES names GPUs outside host.gpus, whose nodes "
              "the unit does not prepare",
              "config"),
    CheckInfo("extra-args-override", "error", "extra_args repeat a flag the unit already renders", "config"),
    CheckInfo("threads-beyond-cores", "warning", "more threads than this machine's CPUs", "config"),
    CheckInfo("llamacpp-ctx-over-training", "warning", "-c above the model's training context is capped",
              "config"),
    CheckInfo("front-port-clash", "error", "serve.internal_port is serve.port: the backends need a port of their own "
              "behind the front", "config"),
    CheckInfo("front-hold-too-short", "error", "serve.hold_timeout_s is shorter than a backend's start timeout",
              "config"),
    CheckInfo("serve-port-in-use", "info", "the served port is held now by a process that is not a backend",
              "config"),
    CheckInfo("ftllm-draft-unused", "warning", "a draft model configured while speculative decoding is off",
              "config"),
    CheckInfo("serve-context-differs", "info", "the backends behind one port and model name hold different contexts",
              "config"),
    CheckInfo("unit-path-hidden", "error", "a path the server needs is hidden from it by its unit's sandboxing "
              "(PrivateTmp=, ProtectHome=) or closed to its DynamicUser", "config"),
    CheckInfo("os-library-missing", "error", "a native binary needs an OS library this machine lacks (ELF NEEDED)",
              "issue 13: llama-server needs libgomp.so.1 from the OS on a minimal Debian 12"),
    CheckInfo("gpu-device-classes", "info", "the units allow the NVIDIA devices by class; which classes this "
              "machine's driver registers now", "issue 16: boot can lose the GPU"),
    CheckInfo("nvidia-uvm-not-at-boot", "warning", "nvidia-uvm is not loaded at boot, so its device class may not "
              "resolve when a backend starts", "issue 16: boot can lose the GPU"),
    CheckInfo("nvidia-modprobe-missing", "warning", "no nvidia-modprobe where the units run it before start",
              "issue 16: boot can lose the GPU"),
    CheckInfo("nvidia-persistenced-absent", "info", "no nvidia-persistenced.service for the units to start after",
              "issue 16: boot can lose the GPU"),
    CheckInfo("cuda-no-driver", "error", "a cuda backend on a box without the NVIDIA driver",
              "issue 24: a lost GPU serves on the CPU unnoticed"),
    CheckInfo("gpu-missing", "error", "a host.gpus entry the box does not have",
              "issue 24: a lost GPU serves on the CPU unnoticed"),
    CheckInfo("gpu-nodes-closed", "error", "NVIDIA device nodes the service user cannot open (e.g. 0660 root:video "
              "without host.gpu_group)", "field notes, pitfall 19"),
    CheckInfo("gpu-jit-first-start", "info", "no machine code for this GPU in a binary: the first start compiles "
              "PTX (JIT), kept in the unit's CUDA cache", "field notes, pitfall 20"),
    CheckInfo("gpu-code-missing", "error", "a binary has no code at all that runs on this GPU", "field notes, pitfall 1"),
    CheckInfo("path-not-root-only", "error", "a path a root step reads to run a backend is not owned by root or is "
              "writable by group or other (StrictModes)", "issue 25: files that steer root steps are root's alone"),
)
CHECK_IDS = frozenset(c.id for c in CATALOG)
_SOURCE = {c.id: c.source for c in CATALOG}

# ----------------------------------------------------------------------------------------- measured facts
# Figures from the field write-ups (FIELD-NOTES.md); every message below quotes them.

NCCL_SYSTEM_FACT = ("without a bundled NCCL, FastLLM loads the system libnccl (on the field box `ldd` showed "
                    "Ubuntu's NCCL 2.22.3, which has no sm_75 code); speculative decoding over TP=2 then died "
                    "with 'ncclAllReduce failed on device 0: unhandled cuda error' after throughput dropped to "
                    "19.9 tok/s")
DRAFT_FIGURES = "4: 90.2/85.0/52.3 tok/s, 8: 156.0/134.9/53.1 tok/s (code/math/prose); 12: the server does not start"
FP8_DFLASH_MAX_TOKENS = 196_608
LONG_CONTEXT_EMBEDDING_TOKENS = 156_000  # ~156K fit on GPU0 with --cuda_embedding (1.41 of 2.36 GB per card)
GOOD_GPU_MEM_RATIO = 0.95
FTLLM_DEFAULT_GPU_MEM_RATIO = 0.9  # ftllm 0.1.8.2's argparse default
MTP_KV_FIGURES = ("f16 KV: 59.96 tok/s (acceptance 0.807), q8_0: 52.67 (0.655), q4_0: 57.16 (0.729); "
                  "deep-filled: f16 53.73 (0.726), q8_0 51.20 (0.719), q4_0 45.01 (0.579)")
SPEC_DEPTH_FIGURES = "2: 52.50, 3: 59.44 (best), 4: 57.72, 5: 51.41, 7: 44.36 tok/s"
SPLIT_BUFFER_FIELD = "45 on b9870, 0 on builds after upstream PR #24216 (merged 2026-07-06)"
QUANTIZED_LLAMA_KV = frozenset({"q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"})

# The write-up's Qwen3.8-27B: 16 full-attention layers of 64, 4 KV heads, head dim 256.
FIELD_MODEL_KV = {"full_layers": 16, "layers": 64, "kv_heads": 4, "head_dim": 256}
KV_BYTES_PER_ELEMENT = {"fp4": 0.5, "fp8": 1.0, "fp8_e4m3": 1.0, "float16": 2.0, "bfloat16": 2.0, "auto": 2.0}
# Measured availForKV on the field box (2 x 22G, TP=2, 29 GB FP8 weights, --gpu_mem_ratio 0.95, DFlash2 draft on
# GPU0): without --cuda_embedding GPU0 3.96 GB, GPU1 5.04 GB; with it 1.41 / 2.49 GB. The reserve for temporary
# allocations is (1 - ratio) of the card (1.15 GB at 0.95, 2.31 GB at 0.90: availForKV 1.41 -> 0.26 GB).
FIELD_AVAIL_GB = {"gpu0_dflash": 3.96, "gpu1": 5.04}
FIELD_EMBEDDING_COST_GB = 3.96 - 1.41
FIELD_CARD_GB = 23.07  # 22,000 MiB as FastLLM reports the 22G card: 5% = 1.15 GB, 10% = 2.31 GB
FIELD_VRAM_MIB = 22528
FIELD_WEIGHTS_GB = 29.0
FIELD_TP = 2
GB = 1e9
GIB = float(1 << 30)


# ----------------------------------------------------------------------------------------- context


@dataclass
class _Ctx:
    cfg: Config
    inspect_files: bool
    on_box: bool  # this machine has an NVIDIA driver: cuda backends run here
    # each model's GGUF header, read once per run: three checks use it, and a 27B model's header (its
    # vocabulary arrays) is megabytes that switch's preflight would otherwise parse three times
    headers: dict[str, tuple[object | None, Finding | None]] = field(default_factory=dict)  # by backend
    # the backends whose own checks run (run_checks(backends=)); None: all. A box check whose work is per backend
    # (the OS libraries each loads) does that backend's part only
    scope: frozenset[str] | None = None


def _f(id_: str, severity: Severity, backend: str | None, message: str, fix: str, source: str | None = None) -> Finding:
    assert id_ in CHECK_IDS, id_
    return Finding(id_, severity, backend, message, fix, source or _SOURCE[id_])


def nvidia_present() -> bool:
    """Whether this machine has an NVIDIA driver loaded (so `cuda` backends would run here)."""
    if os.path.exists("/dev/nvidiactl"):
        return True
    try:
        return any(os.scandir("/proc/driver/nvidia/gpus"))
    except OSError:
        return False


def _env(b: Backend) -> dict[str, str]:
    return dict(b.env)


def _has_arg(b: Backend, *names: str) -> bool:
    return any(a in names or any(a.startswith(n + "=") for n in names) for a in b.extra_args)


def _speculative(b: FtllmBackend) -> str | None:
    sp = b.speculative
    return sp.algorithm if sp is not None and sp.algorithm != "none" else None


def _runs_here(ctx: _Ctx, b: Backend) -> bool:
    return b.device == "cpu" or ctx.on_box


def _fmt_int(n: float) -> str:
    return f"{int(n):,}"


# ----------------------------------------------------------------------------------------- ftllm checks


def check_cuda_graph(ctx: _Ctx, b: Backend) -> Iterator[Finding]:
    if not isinstance(b, FtllmBackend) or b.device != "cuda" or _speculative(b) != "dflash":
        return
    val = _env(b).get("FASTLLM_CUDA_GRAPH")
    if val == "0":
        return
    shown = "unset" if val is None else f"{val!r}"
    yield _f("ftllm-cuda-graph-dflash", "error", b.name,
             f"FASTLLM_CUDA_GRAPH is {shown} with --speculative_algorithm dflash: DFlash2 with CUDA Graph "
             f"crashed with cudaErrorIllegalAddress on the first request, every time. FastLLM's docs say to set "
             f"1 on sm_75; that only holds without speculative decoding (built-in MTP works with 0 or 1)",
             f"set backends.{b.name}.env.FASTLLM_CUDA_GRAPH: \"0\"")


def _nccl_paths(cfg: Config, b: FtllmBackend) -> tuple[str | None, str]:
    """(library to inspect, how it is loaded) for an ftllm backend."""
    if b.use_bundle_nccl and cfg.bundle.nccl is not None:
        installed = _installed_copy(cfg, "bundle.nccl.library")
        if not os.path.exists(cfg.bundle.nccl.library) and installed:
            return installed, "the installed release's NCCL (LD_PRELOAD)"
        return cfg.bundle.nccl.library, "bundle.nccl.library (LD_PRELOAD)"
    pre = _env(b).get("LD_PRELOAD", "")
    for part in pre.replace(":", " ").split():
        if "libnccl" in Path(part).name:
            return part, f"backends.{b.name}.env.LD_PRELOAD"
    return None, ""


def check_nccl(ctx: _Ctx, b: Backend) -> Iterator[Finding]:
    cfg = ctx.cfg
    if not isinstance(b, FtllmBackend):
        return
    if b.use_bundle_nccl and cfg.bundle.nccl is None:
        yield _f("ftllm-bundle-missing", "error", b.name,
                 f"backends.{b.name}.nccl is 'bundle' but bundle.nccl is not configured, so LD_PRELOAD would "
                 f"name a library that no bundle contains",
                 "add bundle.nccl.library (an NCCL built with your GPUs' architecture), or drop nccl: bundle")
    if b.device != "cuda" or b.tp <= 1 or _speculative(b) is None:
        return
    lib, how = _nccl_paths(cfg, b)
    cc = cfg.host.compute_capability
    sm = "sm_" + cc.replace(".", "")
    if lib is None:
        yield _f("ftllm-nccl-system", "warning", b.name,
                 f"TP={b.tp} with speculative decoding ({_speculative(b)}) and no bundled NCCL: {NCCL_SYSTEM_FACT}. "
                 f"The error message never names the architecture",
                 f"bundle an NCCL with {sm} code (bundle.nccl.library + backends.{b.name}.nccl: bundle); check one "
                 f"with `cuobjdump --list-elf libnccl.so.2 | grep -oE 'sm_[0-9]+' | sort -u`")
        return
    if not ctx.inspect_files or not os.path.exists(lib):
        return  # the file checks report a missing library
    from deploy_tool import binaries  # lazy: see the module's docstring

    bundled = how.startswith(("bundle", "the installed"))
    policy = cfg.bundle.nccl.arch_policy if (cfg.bundle.nccl is not None and bundled) else "exact"
    force = cfg.bundle.nccl is not None and cfg.bundle.nccl.force and bundled
    try:
        info = binaries.read_fatbin(lib)
        ok, why = binaries.arch_supported(info, cc, policy)
    except DeployError as exc:
        yield _f("ftllm-nccl-unreadable", "error", b.name,
                 f"{how}: {exc.message}", "point it at a real libnccl.so.2 (an ELF64 shared library)")
        return
    if ok:
        return
    yield _f("ftllm-nccl-arch", "warning" if force else "error", b.name,
             f"{how} = {lib}: {why} Under TP={b.tp} speculative decoding an NCCL without {sm} died in the field "
             f"with 'ncclAllReduce failed on device 0: unhandled cuda error'"
             + (" (bundle.nccl.force is set: bundled anyway)" if force else ""),
             f"build NCCL with -gencode arch=compute_{cc.replace('.', '')},code={sm} (the field fix: a self-built "
             f"NCCL 2.31.2) and point bundle.nccl.library at it")


def check_draft_tokens(ctx: _Ctx, b: Backend) -> Iterator[Finding]:
    if not isinstance(b, FtllmBackend) or _speculative(b) is None:
        return
    sp = b.speculative
    assert sp is not None
    if sp.algorithm == "dflash" and not sp.draft_model:
        yield _f("ftllm-draft-missing", "error", b.name,
                 "--speculative_algorithm dflash without --speculative_draft_model_path: DFlash needs its draft "
                 "model (the write-up used z-lab/Qwen3.8-27B-DFlash2, 5 layers, 3.6 GB)",
                 f"set backends.{b.name}.speculative.draft_model")
    n = sp.num_draft_tokens
    if n >= 12:
        yield _f("ftllm-draft-tokens-max", "error", b.name,
                 f"--speculative_num_draft_tokens {n}: at 12 the server did not start ({DRAFT_FIGURES})",
                 "use 8 (drafts 7 tokens: the measured best), at most 11")
    yield _f("ftllm-draft-tokens-meaning", "info", b.name,
             f"--speculative_num_draft_tokens {n} drafts {n - 1} token(s) per round (the block includes the "
             f"anchor). Measured: {DRAFT_FIGURES}",
             "nothing to do if that is what you meant; 8 was the best measured")


def check_fp8_kv_dflash(ctx: _Ctx, b: Backend) -> Iterator[Finding]:
    if not isinstance(b, FtllmBackend) or b.device != "cuda" or _speculative(b) != "dflash":
        return
    if b.kv_cache_dtype in ("fp8", "fp8_e4m3") and b.tokens is not None and b.tokens > FP8_DFLASH_MAX_TOKENS:
        yield _f("ftllm-fp8-kv-dflash", "error", b.name,
                 f"--kv_cache_dtype {b.kv_cache_dtype} with DFlash2 at --tokens {_fmt_int(b.tokens)}: loading the "
                 f"draft ran out of memory at dflash.layers.4.mlp.gateup_proj; {_fmt_int(FP8_DFLASH_MAX_TOKENS)} "
                 f"tokens fit",
                 f"use --kv_cache_dtype fp4 (production: 262,144 tokens), or --tokens "
                 f"{_fmt_int(FP8_DFLASH_MAX_TOKENS).replace(',', '')} or fewer")


def check_cuda_embedding(ctx: _Ctx, b: Backend) -> Iterator[Finding]:
    if not isinstance(b, FtllmBackend) or not (b.cuda_embedding or _has_arg(b, "--cuda_embedding")):
        return
    if b.device != "cuda":
        return  # device-cpu-cuda-flags reports it
    long_ctx = b.tokens is None or b.tokens > LONG_CONTEXT_EMBEDDING_TOKENS
    tokens = "the default --tokens" if b.tokens is None else f"--tokens {_fmt_int(b.tokens)}"
    yield _f("ftllm-cuda-embedding", "error" if long_ctx else "warning", b.name,
             f"--cuda_embedding with {tokens}: it pins a 2.4 GB FP16 embedding (248,320 x 5,120) on GPU0, whose "
             f"availForKV then fell from 3.96 to 1.41 GB; at 262,144 tokens a card needs 2.36 GB of KV pages, so "
             f"only about 156K tokens really fit and a long prompt crashes GPU0 (short prompts never show it: "
             f"pages are allocated on use)",
             f"drop backends.{b.name}.cuda_embedding")


def check_gpu_mem_ratio(ctx: _Ctx, b: Backend) -> Iterator[Finding]:
    if not isinstance(b, FtllmBackend) or b.device != "cuda":
        return
    r = b.gpu_mem_ratio
    if r == GOOD_GPU_MEM_RATIO:
        return
    shown = f"unset (ftllm's default is {FTLLM_DEFAULT_GPU_MEM_RATIO:g})" if r is None else f"{r:g}"
    eff = FTLLM_DEFAULT_GPU_MEM_RATIO if r is None else r
    if eff > GOOD_GPU_MEM_RATIO:
        why = ("0.97 crashed on long prompts: 'CUDA error when allocating 12 MB on device 0! gpuFree: 2 MB / "
               "22000 MB' and 'cublas error in ChunkGatedDeltaRule batched matmul'")
        sev: Severity = "error"
    else:
        reserve = (1 - eff) * FIELD_CARD_GB
        why = (f"below 0.95 the reserve for temporary allocations grows ((1 - {eff:g}) x 23.07 GB = "
               f"{reserve:.2f} GB; 1.15 GB at 0.95, 2.31 GB at 0.90, where availForKV dropped to 0.26 GB)")
        sev = "warning"
    yield _f("ftllm-gpu-mem-ratio", sev, b.name,
             f"--gpu_mem_ratio {shown}: {why}; 0.95 is the known-good value",
             f"set backends.{b.name}.gpu_mem_ratio: 0.95")


def check_chat_template_thinking(ctx: _Ctx, b: Backend) -> Iterator[Finding]:
    if not isinstance(b, FtllmBackend):
        return
    custom = b.use_bundle_chat_template or _has_arg(b, "--chat_template")
    if b.use_bundle_chat_template and ctx.cfg.bundle.chat_template is None:
        yield _f("ftllm-bundle-missing", "error", b.name,
                 f"backends.{b.name}.chat_template is 'bundle' but bundle.chat_template is not configured, so "
                 f"--chat_template would name a file that no bundle contains",
                 "add bundle.chat_template.source, or drop chat_template: bundle")
    if custom and b.clients_request_thinking:
        yield _f("ftllm-chat-template-thinking", "warning", b.name,
                 "a custom --chat_template makes FastLLM set force_chat_template, which disables the Qwen reasoning "
                 "split: a request with enable_thinking: true gets the whole reasoning plus a lone </think> in "
                 "`content` and an empty `reasoning_content` (requests with enable_thinking: false are clean)",
                 f"have clients send enable_thinking: false (then set backends.{b.name}.clients_request_thinking: "
                 f"false), or read the reasoning from `content` up to the lone </think>, or drop the custom "
                 f"template")


def check_think(ctx: _Ctx, b: Backend) -> Iterator[Finding]:
    if isinstance(b, FtllmBackend) and (b.think or _has_arg(b, "--think")):
        yield _f("ftllm-think-flag", "info", b.name,
                 "--think true does not change the model: it only prepends '<think>\\n' to the returned text "
                 "(default false)",
                 "control reasoning per request with enable_thinking (and the template's reasoning effort)")


# ----------------------------------------------------------------------------------------- capacity


@dataclass(frozen=True)
class KvShape:
    full_layers: int
    layers: int
    kv_heads: int
    head_dim: int
    source: str  # "config.json at ..." or "the write-up's Qwen3.8-27B figures"

    @property
    def elements_per_token(self) -> int:
        return self.full_layers * 2 * self.kv_heads * self.head_dim


def kv_shape_from_config(data: object) -> KvShape:
    """Full-attention layers, KV heads and head dim from a Hugging Face config.json (raises ValueError)."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    c = data.get("text_config") if isinstance(data.get("text_config"), dict) else data
    assert isinstance(c, dict)

    def num(key: str, default: int | None = None) -> int:
        v = c.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{key} is {v!r}, not a positive integer")
        return v

    layers = num("num_hidden_layers")
    types = c.get("layer_types")
    if isinstance(types, list) and types:
        full = sum(1 for t in types if t in ("full_attention", "attention"))
    elif c.get("full_attention_interval") is not None:
        full = layers // num("full_attention_interval")
    else:
        full = layers
    heads = num("num_attention_heads")
    kv_heads = num("num_key_value_heads", heads)
    head_dim = c.get("head_dim")
    if head_dim is None:
        head_dim = num("hidden_size") // heads
    elif isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(f"head_dim is {head_dim!r}, not a positive integer")
    return KvShape(full, layers, kv_heads, head_dim, "config.json")


def _model_config_path(b: Backend) -> Path | None:
    if b.model_config:
        return Path(b.model_config)
    p = Path(b.model)
    return p / "config.json" if p.suffix != ".gguf" else None


def _weights_gb(model: str) -> float | None:
    p = Path(model)
    try:
        if p.is_file():
            return p.stat().st_size / GB
        files = [f for f in p.iterdir() if f.suffix in (".safetensors", ".bin", ".gguf") and f.is_file()]
    except OSError:
        return None
    return sum(f.stat().st_size for f in files) / GB if files else None


def check_capacity(ctx: _Ctx, b: Backend) -> Iterator[Finding]:
    if not isinstance(b, FtllmBackend) or b.device != "cuda" or b.tokens is None:
        return
    shape = KvShape(**FIELD_MODEL_KV, source="the write-up's Qwen3.8-27B figures")
    cpath = _model_config_path(b)
    if ctx.inspect_files and cpath is not None and os.path.isfile(cpath):  # isfile: no OSError
        try:
            shape = kv_shape_from_config(json.loads(cpath.read_text("utf-8")))
            shape = KvShape(shape.full_layers, shape.layers, shape.kv_heads, shape.head_dim, f"{cpath}")
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            yield _f("model-config-unreadable", "warning", b.name,
                     f"{cpath}: cannot read the KV shape ({exc}); using the write-up's Qwen3.8-27B figures",
                     "point model_config at the model's config.json")
    dtype = b.kv_cache_dtype or "auto"
    bpe = KV_BYTES_PER_ELEMENT[dtype]
    tp = max(1, b.tp)
    per_token = shape.elements_per_token * bpe
    total = per_token * b.tokens
    per_card = total / tp
    # availability on the tightest card, from the write-up's measurements, adjusted for this config
    ratio = b.gpu_mem_ratio if b.gpu_mem_ratio is not None else FTLLM_DEFAULT_GPU_MEM_RATIO
    dflash = _speculative(b) == "dflash"
    base = FIELD_AVAIL_GB["gpu0_dflash"] if dflash else FIELD_AVAIL_GB["gpu1"]
    terms = [f"{base:.2f} GB measured availForKV on {'GPU0 (the DFlash2 draft runs there)' if dflash else 'GPU1'}"]
    avail = base
    if ratio != GOOD_GPU_MEM_RATIO:
        d = (GOOD_GPU_MEM_RATIO - ratio) * FIELD_CARD_GB
        avail -= d
        terms.append(f"{'-' if d >= 0 else '+'} {abs(d):.2f} GB reserve at ratio {ratio:g}")
    if b.cuda_embedding:
        avail -= FIELD_EMBEDDING_COST_GB
        terms.append(f"- {FIELD_EMBEDDING_COST_GB:.2f} GB --cuda_embedding")
    vram = ctx.cfg.host.vram_mib
    if vram != FIELD_VRAM_MIB:
        d = (vram - FIELD_VRAM_MIB) * (1 << 20) * ratio / GB
        avail += d
        terms.append(f"{'+' if d >= 0 else '-'} {abs(d):.2f} GB for {vram} MiB cards")
    weights = _weights_gb(b.model) if ctx.inspect_files else None
    w = weights if weights is not None else FIELD_WEIGHTS_GB
    if tp != FIELD_TP or weights is not None:
        d = w / tp - FIELD_WEIGHTS_GB / FIELD_TP
        if abs(d) >= 0.01:
            avail -= d
            terms.append(f"{'-' if d >= 0 else '+'} {abs(d):.2f} GB weights ({w:.1f} GB / TP={tp})")
    math = (f"KV per token = {shape.full_layers} full-attention layers (of {shape.layers}) x 2 (K and V) x "
            f"{shape.kv_heads} KV heads x {shape.head_dim} dims = {_fmt_int(shape.elements_per_token)} elements "
            f"x {bpe:g} byte ({dtype}) = {_fmt_int(per_token)} bytes (from {shape.source}); x "
            f"{_fmt_int(b.tokens)} tokens = {total / GIB:.2f} GiB, {per_card / GIB:.2f} GiB ({per_card / GB:.2f} GB) "
            f"per card under TP={tp}; available for KV on the tightest card: {' '.join(terms)} = {avail:.2f} GB")
    if per_card / GB > avail:
        yield _f("ftllm-kv-capacity", "error", b.name,
                 f"the KV cache does not fit: {math}. The startup log would show the shortfall only as a crash on "
                 f"a long prompt (pages are allocated on use)",
                 ("use --kv_cache_dtype fp4 (half of fp8), or" if dtype != "fp4" else "use")
                 + " fewer --tokens" + (", or drop --cuda_embedding" if b.cuda_embedding else ""))
    else:
        yield _f("ftllm-kv-capacity", "info", b.name,
                 f"the KV cache fits: {math}. For comparison the field box's log showed localKVPerPage=1.18 MB "
                 f"(2.36 GB per card at 262,144 tokens in fp4); one prompt is capped at 80% of the pages (about "
                 f"209K tokens of 262,144)",
                 "confirm with the 'availForKV' and 'KV Cache Token limit' lines of the startup log")


# ----------------------------------------------------------------------------------------- llama.cpp checks


def check_split_row(ctx: _Ctx, b: Backend) -> Iterator[Finding]:
    if not isinstance(b, LlamacppBackend) or (b.split_mode != "row" and not _sm_row_in_args(b)):
        return
    binary = expand(ctx.cfg, b.binary)
    count: int | None = None
    where = binary
    if ctx.inspect_files and os.path.isfile(binary):
        from deploy_tool import binaries

        try:
            counts = {f: binaries.count_strings(f, b"split_buffer") for f in llama_files(binary)}
        except DeployError:
            counts = {}
        if counts:
            count = sum(counts.values())
            where = binary if len(counts) == 1 else f"{binary} and the {len(counts) - 1} libraries beside it"
    base = ("-sm row was deleted upstream (PR #24216, merged 2026-07-06); builds without it die at load with "
            "'device CUDA0 does not support split buffers'")
    if count is None:
        yield _f("llamacpp-split-row", "error", b.name,
                 f"{base}. `strings llama-server | grep -c split_buffer`: {SPLIT_BUFFER_FIELD}",
                 f"use backends.{b.name}.split_mode: tensor (with ctx_size and GGML_CUDA_ALLREDUCE=internal)")
    elif count == 0:
        yield _f("llamacpp-split-row", "error", b.name,
                 f"{base}. {where} contain(s) 0 'split_buffer' strings, so this build removed row split "
                 f"({SPLIT_BUFFER_FIELD})",
                 f"use backends.{b.name}.split_mode: tensor (with ctx_size and GGML_CUDA_ALLREDUCE=internal)")
    else:
        yield _f("llamacpp-split-row", "warning", b.name,
                 f"{base}. {where} still contain(s) {count} 'split_buffer' strings ({SPLIT_BUFFER_FIELD}), so this "
                 f"build has row split, but the next upgrade will not",
                 f"move to backends.{b.name}.split_mode: tensor before upgrading llama.cpp")


def llama_files(binary: str) -> list[str]:
    """The llama-server binary plus the llama/ggml shared libraries beside it (or in ../lib): a shared build
    keeps the split-buffer code in libllama/libggml-cuda, not in the executable."""
    b = Path(binary)
    out = {os.path.realpath(b): str(b)}
    for d in (b.parent, b.parent.parent / "lib"):
        try:
            libs = sorted(d.glob("lib*.so*"))
        except OSError:
            continue
        for f in libs:
            if f.name.startswith(("libllama", "libggml")) and f.is_file():
                out.setdefault(os.path.realpath(f), str(f))
    return list(out.values())


def _sm_row_in_args(b: LlamacppBackend) -> bool:
    a = list(b.extra_args)
    return any(x in ("-sm", "--split-mode") and i + 1 < len(a) and a[i + 1] == "row" for i, x in enumerate(a)) \
        or "--split-mode=row" in a


def check_tensor(ctx: _Ctx, b: Backend) -> Iterator[Finding]:
    if not isinstance(b, LlamacppBackend) or b.split_mode != "tensor":
        return
    if b.ctx_size is None and not _has_arg(b, "-c", "--ctx-size") and "LLAMA_ARG_CTX_SIZE" not in _env(b):
        yield _f("llamacpp-tensor-ctx", "error", b.name,
                 "-sm tensor ignores --fit: without an explicit -c the server silently runs at the default "
                 "context while you believe it is at 262K",
                 f"set backends.{b.name}.ctx_size (the field box: 262144 with Q4_K weights, 196608 with Q8_0)")
    if b.device == "cuda" and _env(b).get("GGML_CUDA_ALLREDUCE") != "internal":
        val = _env(b).get("GGML_CUDA_ALLREDUCE")
        yield _f("llamacpp-tensor-allreduce", "error", b.name,
                 f"GGML_CUDA_ALLREDUCE is {'unset' if val is None else repr(val)} with -sm tensor: the default "
                 f"(NCCL) died on the first real ncclAllReduce with 'unhandled cuda error'",
                 f"set backends.{b.name}.env.GGML_CUDA_ALLREDUCE: internal")
    k = b.cache_type_k or "f16"
    v = b.cache_type_v or "f16"
    if k != v:
        yield _f("llamacpp-tensor-mixed-kv", "error", b.name,
                 f"-ctk {k} -ctv {v}: mixed K/V cache types assert in tensor split (seen with -ctk f16 -ctv q8_0)",
                 "use the same type for both (f16 when it fits: best MTP acceptance)")
    if b.spec is not None and b.spec.draft_n_max != 3:
        yield _f("llamacpp-spec-depth", "info", b.name,
                 f"--spec-draft-n-max {b.spec.draft_n_max} under -sm tensor; measured: {SPEC_DEPTH_FIGURES}",
                 f"set backends.{b.name}.spec.draft_n_max: 3 unless you measured better")


def check_mtp_kv(ctx: _Ctx, b: Backend) -> Iterator[Finding]:
    if not isinstance(b, LlamacppBackend) or b.spec is None or "mtp" not in b.spec.type:
        return
    q = [t for t in (b.cache_type_k, b.cache_type_v) if t in QUANTIZED_LLAMA_KV]
    if q:
        yield _f("llamacpp-mtp-quantized-kv", "warning", b.name,
                 f"quantized main KV ({', '.join(sorted(set(q)))}) with MTP lowers draft acceptance: {MTP_KV_FIGURES}",
                 "keep f16 main KV (leave cache_type_k/v unset) when it fits")


def _gguf(ctx: _Ctx, b: Backend) -> tuple[object | None, Finding | None]:
    """The model's GGUF header when the model is a .gguf file here (or a finding saying why it is unreadable)."""
    if not ctx.inspect_files or not b.model.endswith(".gguf") or not os.path.isfile(b.model):
        return None, None
    if b.name not in ctx.headers:
        try:
            ctx.headers[b.name] = gguf_header.read_header(b.model), None
        except DeployError as exc:
            ctx.headers[b.name] = None, _f("model-unreadable", "error", b.name,
                                            f"backends.{b.name}.model: {exc.message}",
                                            "point it at a GGUF model file (llama.cpp's format)")
    return ctx.headers[b.name]


def check_gguf(ctx: _Ctx, b: Backend) -> Iterator[Finding]:
    header, problem = _gguf(ctx, b)
    if problem is not None:
        yield problem
    if header is None or not isinstance(b, FtllmBackend):
        return
    assert isinstance(header, GgufHeader)
    f32 = header.f32_matrices()
    if f32:
        names = ", ".join(t.name for t in f32[:3]) + (f" and {len(f32) - 3} more" if len(f32) > 3 else "")
        yield _f("ftllm-gguf-f32", "error", b.name,
                 f"{b.model} stores {len(f32)} weight matrices as F32 ({names}; file type "
                 f"{header.file_type_name or 'unknown'}): ftllm dies with SIGFPE on an F32 GGUF",
                 "convert the weights to F16 (or a quantized type) first, e.g. with llama-quantize or "
                 "gguf's convert tools")


def check_q8_f16_context(ctx: _Ctx, b: Backend) -> Iterator[Finding]:
    if not isinstance(b, LlamacppBackend) or b.device != "cuda" or b.ctx_size is None:
        return
    header, _problem = _gguf(ctx, b)  # check_gguf reports an unreadable file
    ftype = getattr(header, "file_type_name", None)
    q8 = ftype == "MOSTLY_Q8_0" if ftype else "q8_0" in Path(b.model).name.lower()
    if q8 and (b.cache_type_k or "f16") == "f16" and b.ctx_size > FP8_DFLASH_MAX_TOKENS:
        how = f"general.file_type {ftype}" if ftype else "the file name"
        yield _f("llamacpp-q8-f16-context", "warning", b.name,
                 f"Q8_0 weights ({how}) with f16 KV at -c {_fmt_int(b.ctx_size)}: on the field box 262,144 ran "
                 f"out of memory and 196,608 fit",
                 f"set backends.{b.name}.ctx_size: 196608, or use Q4_K weights")


# ----------------------------------------------------------------------------------------- box-wide checks


def check_device(ctx: _Ctx, b: Backend) -> Iterator[Finding]:
    cfg = ctx.cfg
    if b.device == "cuda" and not cfg.host.gpus:
        yield _f("device-cuda-no-gpus", "error", b.name,
                 "device is cuda but host.gpus is empty, so CUDA_VISIBLE_DEVICES and the unit's DeviceAllow= "
                 "would give the service no GPU",
                 "list the GPU ids in host.gpus (e.g. [0, 1]), or set device: cpu")
    if b.device == "cuda" and cfg.host.gpus and isinstance(b, FtllmBackend) and b.tp > len(cfg.host.gpus):
        yield _f("device-tp-gpus", "error", b.name,
                 f"--tp {b.tp} needs {b.tp} GPUs but host.gpus lists {len(cfg.host.gpus)} "
                 f"({', '.join(map(str, cfg.host.gpus))}), so CUDA_VISIBLE_DEVICES hides the others",
                 f"list {b.tp} GPU ids in host.gpus, or set backends.{b.name}.tp: {len(cfg.host.gpus)}")
    if b.device != "cpu":
        return
    flags: list[str] = []
    if isinstance(b, FtllmBackend):
        if b.tp > 1:
            flags.append(f"tp {b.tp}")
        if b.cuda_embedding:
            flags.append("cuda_embedding")
        if b.gpu_mem_ratio is not None:
            flags.append("gpu_mem_ratio")
        if b.kv_cache_dtype == "fp4":
            flags.append("kv_cache_dtype fp4 (Qwen3.5 CUDA only)")
        if b.use_bundle_nccl:
            flags.append("nccl: bundle")
        if _speculative(b) == "dflash":
            flags.append("speculative dflash")
    else:
        if b.split_mode in ("row", "tensor"):
            flags.append(f"split_mode {b.split_mode}")
    flags += [f"env {k}" for k, _ in b.env if k.startswith(("CUDA_", "FASTLLM_CUDA", "GGML_CUDA", "NCCL_"))]
    if flags:
        yield _f("device-cpu-cuda-flags", "warning", b.name,
                 f"device is cpu but CUDA-only settings are present: {', '.join(flags)}; they do nothing on the "
                 f"CPU or fail at startup",
                 "remove them, or set device: cuda")


def front_errors(cfg: Config) -> list[Finding]:
    """The front's settings that contradict each other (check reports them, install and switch refuse them)."""
    s, out = cfg.serve, []
    if cfg.backend_port == s.port:
        out.append(_f("front-port-clash", "error", None,
                      f"serve.internal_port is {s.port}, which is serve.port: the front holds that port, and the "
                      f"backends must listen on one of their own behind it",
                      "leave serve.internal_port unset (serve.port + 1), or pick a free port"))
    if s.hold_timeout_s is not None and s.hold_timeout_s < cfg.slowest_start_s:
        out.append(_f("front-hold-too-short", "error", None,
                      f"serve.hold_timeout_s is {s.hold_timeout_s:g} s, less than the slowest backend's start timeout "
                      f"({cfg.slowest_start_s:g} s): clients would get 503 while a switch can still succeed",
                      f"set it to at least {cfg.slowest_start_s:g} (or leave it unset: that plus "
                      f"health.smoke_timeout_s)"))
    return out


def check_serve(ctx: _Ctx) -> Iterator[Finding]:
    s = ctx.cfg.serve
    yield from front_errors(ctx.cfg)
    if s.host not in ("127.0.0.1", "::1", "localhost") and not s.api_key_file:
        yield _f("serve-public-no-api-key", "info", None,
                 f"serve.host is {s.host} (reachable from the network) and serve.api_key_file is not set: anyone "
                 f"who reaches port {s.port} can use the model",
                 "set serve.api_key_file, or bind 127.0.0.1 behind a proxy")
    if s.host not in ("127.0.0.1", "::1", "localhost") and not [a for a in s.allow if a != "localhost"]:
        yield _f("serve-allow-local-only", "warning", None,
                 f"serve.host is {s.host} but serve.allow is empty: the units drop every packet that is not from "
                 f"localhost or {s.host} itself (IPAddressDeny=any), so no other machine reaches port {s.port}",
                 "list the clients' addresses or networks in serve.allow (e.g. 192.168.0.0/16), or bind "
                 "127.0.0.1")


API_KEY_FLAGS = ("--api_key", "--api-key")  # ftllm, llama-server
API_KEY_ENV = ("LLAMA_API_KEY", "LLAMA_ARG_API_KEY")  # llama-server reads the key from these as well


def check_api_key_exposed(ctx: _Ctx, b: Backend) -> Iterator[Finding]:
    """The key given some other way than serve.api_key_file: in extra_args it stands in the unit file and in
    /proc/PID/cmdline, in env it stands in the world-readable env file; every local user can read either."""
    flags = [_flag_name(a) for a in b.extra_args if _flag_name(a) in API_KEY_FLAGS]  # the flag, never the key
    envs = [k for k, _ in b.env if k in API_KEY_ENV]
    if not flags and not envs:
        return
    parts = ([f"extra_args pass {flags[0]}: the key would stand in the unit file and in /proc/PID/cmdline"]
             if flags else [])
    parts += [f"env sets {envs[0]}: the key would stand in the world-readable env file"] if envs else []
    yield _f("api-key-exposed", "error", b.name,
             f"backends.{b.name}.{'; '.join(parts)}, which every local user can read (serve.api_key_file keeps it "
             f"out of both)",
             "remove it and set serve.api_key_file: each server then gets the key as a systemd credential only "
             "it can read")


def check_template(ctx: _Ctx) -> Iterator[Finding]:
    ct = ctx.cfg.bundle.chat_template
    if ct is None:
        return
    if ct.patch is None:
        yield _f("template-no-patch", "info", None,
                 "the chat template is bundled unpatched: froggeric v22.3 defaults to reasoning effort 'medium', "
                 "whose branch injects nothing, so hard questions (MuSR) ran into the 8,192-token limit; 'low' "
                 "finishes",
                 "add bundle.chat_template.patch (find \"is not none else 'medium' %}\", replace with 'low')")
    if not ctx.inspect_files or not os.path.isfile(ct.source):
        return
    try:
        data = Path(ct.source).read_bytes()
    except OSError as exc:
        yield _f("file-missing", "error", None, f"bundle.chat_template.source {ct.source}: cannot read it "
                 f"({exc.strerror})", "make the file readable")
        return
    if ct.sha256:
        got = hashlib.sha256(data).hexdigest()
        if got != ct.sha256.lower():
            yield _f("template-sha256", "error", None,
                     f"{ct.source} has SHA-256 {got}, not the pinned {ct.sha256}: this is not the template the "
                     f"patch was written for (the patch is only valid for v22.3"
                     f"{', commit ' + ct.commit if ct.commit else ''}; upstream moved on to v22.5)",
                     "fetch the pinned commit again, or update bundle.chat_template.sha256 after reviewing the patch")
    if ct.patch is not None:
        text = data.decode("utf-8", errors="replace")
        n = text.count(ct.patch.find)
        if n != 1:
            yield _f("template-patch-match", "error", None,
                     f"the patch's find text {ct.patch.find!r} occurs {n} times in {ct.source}; it must occur "
                     f"exactly once (the substitution is only valid for froggeric v22.3, commit "
                     f"492315ea6d7343bcfb32598d6a898c34e0d69ed8)",
                     "use the pinned template version, or rewrite bundle.chat_template.patch.find to match once")


# ----------------------------------------------------------------------------------------- files


DOWNLOAD_DANGER = ("ftllm treats a -p path that does not exist as a model NAME: it searches a model hub for a "
                   "similar one and downloads it (ftllm/util.py, HFDNormalDownloader), so a typo becomes a "
                   "multi-GB download of some other model")


def _named_files(cfg: Config, b: Backend) -> list[tuple[str, str, str]]:
    """(what, path, kind) for the files a backend needs; kind 'dir', 'file' or 'any'."""
    out: list[tuple[str, str, str]] = []
    if isinstance(b, FtllmBackend):
        out.append((f"backends.{b.name}.model", b.model, "any"))
        if b.speculative is not None and b.speculative.draft_model and _speculative(b):
            out.append((f"backends.{b.name}.speculative.draft_model", b.speculative.draft_model, "dir"))
        out.append((f"backends.{b.name}.executable", expand(cfg, b.executable), "file"))
    else:
        out.append((f"backends.{b.name}.model", b.model, "file"))
        if b.mmproj:
            out.append((f"backends.{b.name}.mmproj", b.mmproj, "file"))
        out.append((f"backends.{b.name}.binary", expand(cfg, b.binary), "file"))
    if b.model_config:
        out.append((f"backends.{b.name}.model_config", b.model_config, "file"))
    return out


def _bundle_files(cfg: Config) -> list[tuple[str, str, list[Backend]]]:
    out: list[tuple[str, str, list[Backend]]] = []
    if cfg.bundle.chat_template is not None:
        users: list[Backend] = [b for b in cfg.backends.values()
                                if isinstance(b, FtllmBackend) and b.use_bundle_chat_template]
        out.append(("bundle.chat_template.source", cfg.bundle.chat_template.source, users))
    if cfg.bundle.nccl is not None:
        users = [b for b in cfg.backends.values() if isinstance(b, FtllmBackend) and b.use_bundle_nccl]
        out.append(("bundle.nccl.library", cfg.bundle.nccl.library, users))
    return out


def _installed_copy(cfg: Config, what: str) -> str | None:
    """The installed release's copy of a bundle input, if this machine has one (the box after `install`)."""
    rel = {"bundle.chat_template.source": BUNDLED_TEMPLATE, "bundle.nccl.library": BUNDLED_NCCL}[what]
    p = os.path.join(cfg.paths.current, rel)
    return p if os.path.isfile(p) else None


def _installed_only(cfg: Config, path: str) -> bool:
    """A path under the install root that exists only after `install` (skipped until then)."""
    cur = cfg.paths.current
    return (path == cur or path.startswith(cur.rstrip("/") + "/")) and not os.path.exists(cur)


def _missing_reason(path: str, kind: str) -> str | None:
    p = Path(path)
    try:
        if not p.exists():
            return "does not exist"
        if kind == "file" and not p.is_file():
            return "is not a file"
        if kind == "dir" and not p.is_dir():
            return "is not a directory"
        if not os.access(p, os.R_OK):
            return "is not readable"
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    return None


def check_files(ctx: _Ctx) -> Iterator[Finding]:
    if not ctx.inspect_files:
        return
    cfg = ctx.cfg
    remote: dict[str, list[str]] = {}
    for name in sorted(cfg.backends):
        b = cfg.backends[name]
        for what, path, kind in _named_files(cfg, b):
            if _installed_only(cfg, path):
                continue
            reason = _missing_reason(path, kind)
            if reason is None:
                continue
            if not _runs_here(ctx, b):
                if reason == "does not exist":
                    remote.setdefault(name, []).append(path)
                continue
            danger = f". {DOWNLOAD_DANGER}" if what.endswith(".model") and isinstance(b, FtllmBackend) else ""
            yield _f("file-missing", "error", name, f"{what}: {path} {reason}{danger}",
                     f"fix {what}, or create the file" + (" (or run `check --no-files` elsewhere)" if not danger
                                                          else " before starting the service"))
    for what, path, users in _bundle_files(cfg):
        reason = _missing_reason(path, "file")
        if reason is None or (reason == "does not exist" and _installed_copy(cfg, what)):
            continue  # present, or only `pack` needs it and the installed release carries its copy
        if users and not any(_runs_here(ctx, u) for u in users):
            if reason == "does not exist":
                for u in users:
                    remote.setdefault(u.name, []).append(path)
            continue
        yield _f("file-missing", "error", None, f"{what}: {path} {reason}; `deploytool pack` bundles it",
                 f"fix {what}, or create the file")
    for name, paths in sorted(remote.items()):
        uniq = list(dict.fromkeys(paths))
        yield _f("file-not-on-this-machine", "info", name,
                 f"not checked here (no NVIDIA driver on this machine, so it is not the box that runs this cuda "
                 f"backend): {', '.join(uniq)}. On the box a missing model is an error: {DOWNLOAD_DANGER}"
                 if isinstance(cfg.backends[name], FtllmBackend) else
                 f"not checked here (no NVIDIA driver on this machine, so it is not the box that runs this cuda "
                 f"backend): {', '.join(uniq)}",
                 "run `deploytool check` on the box itself")


# ----------------------------------------------------------------------------------------- what the server gets
# The unit's launch line is the rendered flags followed by extra_args, and both servers take the LAST value of a
# repeated flag; CUDA_VISIBLE_DEVICES from a backend's env replaces the one derived from host.gpus. These checks
# judge what the server will actually be given, not what the config's typed keys say.

# the flags render.py writes, by server; each group lists the spellings of one option (llama-server --help,
# ftllm's argparse)
LLAMA_FLAG_GROUPS: tuple[tuple[str, ...], ...] = (
    ("-m", "--model"), ("-a", "--alias"), ("-sm", "--split-mode"), ("-fa", "--flash-attn"), ("-c", "--ctx-size"),
    ("-ctk", "--cache-type-k"), ("-ctv", "--cache-type-v"), ("--spec-type",), ("--spec-draft-n-max",),
    ("-mm", "--mmproj"), ("-t", "--threads"), ("-ngl", "--gpu-layers", "--n-gpu-layers"), ("--host",),
    ("--port",), ("--api-key-file",))
FTLLM_FLAG_GROUPS: tuple[tuple[str, ...], ...] = (
    ("-p", "--path"), ("--model_name",), ("--device",), ("-t", "--threads"), ("--tp",), ("--max_batch",),
    ("--tokens",), ("--gpu_mem_ratio",), ("--kv_cache_dtype",), ("--cuda_embedding",),
    ("--speculative_algorithm", "--speculative-algorithm"),
    ("--speculative_draft_model_path", "--speculative-draft-model-path"),
    ("--speculative_num_draft_tokens", "--speculative-num-draft-tokens"), ("--prefix_cache", "--prefix-cache"),
    ("--think",), ("--chat_template",), ("--host",), ("--port",), ("--api_key",))
# which config key a rendered flag comes from (for the message), by its first spelling
FLAG_KEYS = {"--host": "serve.internal_port", "--port": "serve.internal_port", "-a": "serve.model_name",
             "--model_name": "serve.model_name", "-m": "model", "-p": "model", "--api_key": "serve.api_key_file",
             "--api-key-file": "serve.api_key_file",
             "-sm": "split_mode", "-fa": "flash_attn", "-c": "ctx_size", "-ctk": "cache_type_k",
             "-ctv": "cache_type_v", "--spec-type": "spec.type", "--spec-draft-n-max": "spec.draft_n_max",
             "-mm": "mmproj", "-t": "threads", "-ngl": "device", "--device": "device", "--tp": "tp",
             "--max_batch": "max_batch", "--tokens": "tokens", "--gpu_mem_ratio": "gpu_mem_ratio",
             "--kv_cache_dtype": "kv_cache_dtype", "--cuda_embedding": "cuda_embedding",
             "--speculative_algorithm": "speculative.algorithm",
             "--speculative_draft_model_path": "speculative.draft_model",
             "--speculative_num_draft_tokens": "speculative.num_draft_tokens", "--prefix_cache": "prefix_cache",
             "--think": "think", "--chat_template": "chat_template"}
LAST_WINS = ("the server takes the last value of a repeated flag (the real llama-server logs \"argument '-c' "
             "specified multiple times ... (only last value will be used)\"; ftllm's argparse keeps the last one "
             "silently)")


def _flag_groups(b: Backend) -> tuple[tuple[str, ...], ...]:
    return FTLLM_FLAG_GROUPS if isinstance(b, FtllmBackend) else LLAMA_FLAG_GROUPS


def _flag_name(arg: str) -> str:
    return arg.split("=", 1)[0] if arg.startswith("--") else arg


def _last_flag_value(argv: list[str], names: tuple[str, ...]) -> str | None:
    """The value the server ends up with for an option spelled `names` in `argv` (the last one wins)."""
    val = None
    for i, a in enumerate(argv):
        if a in names and i + 1 < len(argv):
            val = argv[i + 1]
        elif a.startswith("--") and "=" in a and a.split("=", 1)[0] in names:
            val = a.split("=", 1)[1]
    return val


def _launch(cfg: Config, b: Backend) -> list[str]:
    # an argument systemd fills in (the API key's credential path) is no flag and no value a check compares
    return [a if isinstance(a, str) else "%d/" + a.name for a in server_argv(cfg, b)]


def check_extra_args_override(ctx: _Ctx, b: Backend) -> Iterator[Finding]:
    """extra_args repeating a flag the unit renders from a typed key: two values, the server silently takes the
    extra one, while the health gate, the checks and the pins judge the config's."""
    argv = _launch(ctx.cfg, b)
    rendered = argv[: len(argv) - len(b.extra_args)]
    extra = list(b.extra_args)
    for group in _flag_groups(b):
        if not any(a in group for a in rendered[1:]):
            continue
        dups = [a for a in extra if _flag_name(a) in group]
        if not dups:
            continue
        key = FLAG_KEYS.get(group[0], group[0])
        key = key if key.startswith("serve.") else f"backends.{b.name}.{key}"
        ours = _last_flag_value(rendered, group)
        theirs = _last_flag_value(rendered + extra, group)
        effect = ""
        if group[0] == "--port":
            effect = (f": it would listen on {theirs} while the front and the health gate use "
                      f"{ctx.cfg.backend_port}")
        elif group[0] in ("-a", "--model_name"):
            effect = (f": it would answer to {theirs!r}, and requests for {ctx.cfg.serve.model_name!r} (the gate's "
                      f"smoke test, every client) fail")
        elif group[0] == "--host":
            effect = (f": it would bind {theirs} instead of {ctx.cfg.backend_host} behind the front, and be reachable "
                      f"past it")
        shown = f"{ours!r} from {key}" if ours is not None else f"{group[0]} from {key}"
        yield _f("extra-args-override", "error", b.name,
                 f"backends.{b.name}.extra_args repeat {' '.join(dups)}, which the unit already passes ({shown}); "
                 f"{LAST_WINS}{effect}",
                 f"remove {dups[0]} from backends.{b.name}.extra_args and set {key} instead")


def _visible_cuda_devices(cfg: Config, b: Backend) -> tuple[list[str], str]:
    """The CUDA devices the process will see, and where that comes from: a backend's own CUDA_VISIBLE_DEVICES
    replaces the one derived from host.gpus (the env file lists the config's env after the derived values)."""
    env = _env(b)
    if "CUDA_VISIBLE_DEVICES" in env:
        val = env["CUDA_VISIBLE_DEVICES"]
        return [x.strip() for x in val.split(",") if x.strip()], f"backends.{b.name}.env.CUDA_VISIBLE_DEVICES={val!r}"
    gpus = [str(g) for g in cfg.host.gpus]
    return gpus, f"host.gpus [{', '.join(gpus)}]"


def _llama_devices(cfg: Config, b: LlamacppBackend) -> tuple[int, str]:
    """How many GPUs llama-server will split over: its -dev/--device list (or LLAMA_ARG_DEVICE) when given,
    else every visible CUDA device."""
    # the --device the unit renders follows the visible GPUs; one the config adds (extra_args) decides
    dev = _last_flag_value(list(b.extra_args), ("-dev", "--device"))
    if dev is None and "LLAMA_ARG_DEVICE" in _env(b):
        dev = _env(b)["LLAMA_ARG_DEVICE"]
        where = f"backends.{b.name}.env.LLAMA_ARG_DEVICE={dev!r}"
    else:
        where = f"--device {dev} in backends.{b.name}.extra_args"
    if dev is not None:
        devs = [d.strip() for d in dev.split(",") if d.strip() and d.strip().lower() != "none"]
        return len(devs), where
    visible, src = _visible_cuda_devices(cfg, b)
    return len(visible), src


def _split_mode(cfg: Config, b: LlamacppBackend) -> str | None:
    sm = _last_flag_value(_launch(cfg, b), ("-sm", "--split-mode"))
    return sm if sm is not None else _env(b).get("LLAMA_ARG_SPLIT_MODE")


def check_tensor_one_device(ctx: _Ctx, b: Backend) -> Iterator[Finding]:
    if not isinstance(b, LlamacppBackend) or b.device != "cuda" or _split_mode(ctx.cfg, b) != "tensor":
        return
    n, where = _llama_devices(ctx.cfg, b)
    if n != 1:
        return
    yield _f("llamacpp-tensor-one-device", "error", b.name,
             f"-sm tensor with one device ({where}): measured on a real GPU, llama-server warns "
             f"'llama_params_fit is not implemented for SPLIT_MODE_TENSOR' and 'SPLIT_MODE_TENSOR being used for a "
             f"single device is not recommended', then aborts at the first decode ('ggml-backend-meta.cpp: "
             f"unsupported mul_mat split states'), so the unit crash-loops",
             f"give it two or more GPUs (host.gpus, or backends.{b.name}.env.CUDA_VISIBLE_DEVICES), or use "
             f"backends.{b.name}.split_mode: none on one GPU")


def check_visible_devices_allowed(ctx: _Ctx, b: Backend) -> Iterator[Finding]:
    if b.device != "cuda" or "CUDA_VISIBLE_DEVICES" not in _env(b):
        return
    visible, where = _visible_cuda_devices(ctx.cfg, b)
    allowed = {str(g) for g in ctx.cfg.host.gpus}
    denied = [v for v in visible if v.isdigit() and v not in allowed]
    if denied:
        yield _f("cuda-devices-not-allowed", "error", b.name,
                 f"{where} names GPU {', '.join(denied)}, but the unit prepares only host.gpus /dev/nvidia{{"
                 f"{','.join(sorted(allowed)) or ''}}} (its ExecStartPre nvidia-modprobe -c=N): /dev/nvidia"
                 f"{denied[0]} may not exist when the server starts (after a cold boot it is made by whoever "
                 f"opens it first, and the server's own lazy nvidia-modprobe is blocked by NoNewPrivileges=yes), "
                 f"so CUDA can find no such device",
                 f"add {', '.join(denied)} to host.gpus, or drop CUDA_VISIBLE_DEVICES from backends.{b.name}.env")
        return
    if isinstance(b, FtllmBackend) and b.tp > len(visible):
        yield _f("device-tp-gpus", "error", b.name,
                 f"--tp {b.tp} needs {b.tp} GPUs but {where} leaves {len(visible)}",
                 f"list {b.tp} GPUs in CUDA_VISIBLE_DEVICES, or set backends.{b.name}.tp: {len(visible)}")


LLAMA_DEFAULT_VERBOSITY = 3
LLAMA_LV4_LINES = "185 startup lines and about 33 per request instead of 13 and 7"  # the real llama-server here


def _llama_verbosity(cfg: Config, b: LlamacppBackend) -> int:
    v = _last_flag_value(_launch(cfg, b), ("-lv", "--verbosity", "--log-verbosity"))
    if v is None:
        v = _env(b).get("LLAMA_ARG_LOG_VERBOSITY")
    try:
        return int(v) if v is not None else LLAMA_DEFAULT_VERBOSITY
    except ValueError:
        return LLAMA_DEFAULT_VERBOSITY


def check_llama_verbosity(ctx: _Ctx, b: Backend) -> Iterator[Finding]:
    if not isinstance(b, LlamacppBackend) or b.device != "cuda" or _llama_verbosity(ctx.cfg, b) >= 4:
        return
    yield _f("llamacpp-log-verbosity", "info", b.name,
             f"llama-server at its default verbosity ({LLAMA_DEFAULT_VERBOSITY}) logs no buffer sizes: no 'CUDA0 KV "
             f"buffer size' or model buffer lines, only n_slots, n_ctx_slot and the capped context (measured on a "
             f"real GPU). The gate and `status --deep` then report the context it runs at, but whether the "
             f"model and KV cache live on the GPUs as 'could not determine'",
             f"to have them checked, add [\"-lv\", \"4\"] to backends.{b.name}.extra_args (costs "
             f"{LLAMA_LV4_LINES} in the journal)")


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_threads(ctx: _Ctx, b: Backend) -> Iterator[Finding]:
    if b.threads is None or not _runs_here(ctx, b):
        return  # only this machine's CPU count is known, and only a backend that runs here uses it
    n = _cpus()
    if b.threads > n:
        yield _f("threads-beyond-cores", "warning", b.name,
                 f"-t {b.threads} but this machine gives the process {n} CPU(s): the threads only contend for them (on "
                 f"this project's 2-core test machines ftllm took 15 s per request even at -t 2, which is why the "
                 f"tests run it at -t 1)",
                 f"set backends.{b.name}.threads to {n} or fewer")


def check_ctx_over_training(ctx: _Ctx, b: Backend) -> Iterator[Finding]:
    if not isinstance(b, LlamacppBackend) or b.ctx_size is None:
        return
    header, _problem = _gguf(ctx, b)  # check_gguf reports an unreadable file
    if header is None:
        return
    meta = getattr(header, "metadata", {})
    arch = meta.get("general.architecture")
    train = meta.get(f"{arch}.context_length") if isinstance(arch, str) else None
    if not isinstance(train, int) or isinstance(train, bool) or train <= 0 or b.ctx_size <= train:
        return
    yield _f("llamacpp-ctx-over-training", "warning", b.name,
             f"-c {_fmt_int(b.ctx_size)} but {b.model} was trained for {_fmt_int(train)} tokens "
             f"({arch}.context_length): llama-server caps each slot at the training context ('the slot context "
             f"({b.ctx_size}) exceeds the training context of the model ({train}) - capping', then n_ctx_slot = "
             f"{train}), so the configured context is only on paper",
             f"set backends.{b.name}.ctx_size: {train}, or use a model (or RoPE scaling) made for the longer context")


def check_draft_unused(ctx: _Ctx, b: Backend) -> Iterator[Finding]:
    if not isinstance(b, FtllmBackend) or b.speculative is None or not b.speculative.draft_model:
        return
    if b.speculative.algorithm == "none":
        yield _f("ftllm-draft-unused", "warning", b.name,
                 f"backends.{b.name}.speculative.draft_model is {b.speculative.draft_model} but the algorithm is "
                 f"'none': the unit passes no --speculative_* flag, so the draft is never loaded and the server "
                 f"decodes without speculation (on the field box 33.7 tok/s for code instead of 156.0 with DFlash2)",
                 f"set backends.{b.name}.speculative.algorithm: dflash, or remove draft_model")


def check_port_in_use(ctx: _Ctx) -> Iterator[Finding]:
    """Something other than a backend listens on the served port now. Only on the box (a machine with an NVIDIA
    driver): elsewhere the port is some other machine's, and a shared test or demo machine has its own
    listeners."""
    cfg = ctx.cfg
    if not ctx.inspect_files or not ctx.on_box:
        return
    # the front: PID 1 holds its socket, the front service a copy
    backends = tuple(f"/{b.unit}" for b in cfg.backends.values())
    for port, key, ours, whose in (
            (cfg.serve.port, "serve.port", (f"/{FRONT_SERVICE}", "/init.scope"), "the front (deploytool-front)"),
            (cfg.backend_port, "serve.internal_port", backends, "one of the backends")):
        inodes = portwait.listening_inodes(port)
        held = portwait.holders(inodes)
        foreign = [h for h in held if not h.cgroup.endswith(ours) and h.pid != 1]
        if foreign or (inodes and not held):
            who = ", ".join(h.describe() for h in foreign) or "a process this user cannot see"
            yield _f("serve-port-in-use", "info", None,
                     f"port {port} ({key}) is held now by {who}, not by {whose}: "
                     + ("the front's socket could not take it, so clients would reach that process"
                        if key == "serve.port" else
                        "a backend's start would be refused by its ExecStartPre (deploytool verify --await-port "
                        "names the holder), and a switch would roll back"),
                     f"stop that process, or choose another {key}")


def _context(cfg: Config, b: Backend) -> int | None:
    """The context the server is told to hold (ftllm --tokens, llama-server -c; extra_args' last value wins)."""
    names = ("--tokens",) if isinstance(b, FtllmBackend) else ("-c", "--ctx-size")
    v = _last_flag_value(_launch(cfg, b), names)
    try:
        n = int(v) if v is not None else None
    except ValueError:
        return None
    return n if n is not None and n > 0 else None


def check_context_differs(ctx: _Ctx) -> Iterator[Finding]:
    cfg = ctx.cfg
    sizes = {n: c for n, b in sorted(cfg.backends.items()) if (c := _context(cfg, b)) is not None}
    if len(set(sizes.values())) < 2:
        return
    small = min(sizes, key=lambda n: sizes[n])
    listed = ", ".join(f"{n} {_fmt_int(c)}" for n, c in sizes.items())
    yield _f("serve-context-differs", "info", None,
             f"the backends answer on one port to one model name ({cfg.serve.model_name!r}) but hold different "
             f"contexts ({listed} tokens): after a switch to {small}, a prompt that worked before can fail",
             "give the backends the same context, or tell clients the smaller one")


# ----------------------------------------------------------------------------------------- what the units see

_TRUE = ("yes", "true", "on", "1")
_HIDDEN_BY = (  # directive, the values that hide, the trees hidden, what the server sees there instead
    ("PrivateTmp", _TRUE, ("/tmp", "/var/tmp"), "an empty private /tmp and /var/tmp"),
    ("ProtectHome", (*_TRUE, "tmpfs"), ("/home", "/root", "/run/user"), "empty or inaccessible home directories"),
)


def _unit_settings(cfg: Config, b: Backend) -> dict[str, str]:
    """The [Service] settings of the backend's rendered unit (the last value of each), DynamicUser's implications
    added: DynamicUser=yes implies PrivateTmp=yes, ProtectSystem=strict and ProtectHome=read-only."""
    unit = next(f.content for f in render_backend(cfg, b) if f.kind == "unit")
    out: dict[str, str] = {}
    section = ""
    for line in unit.splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith(("#", ";")):
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip().lower()
    if out.get("DynamicUser") in _TRUE:
        out.setdefault("PrivateTmp", "yes")
        out.setdefault("ProtectHome", "read-only")
        out.setdefault("ProtectSystem", "strict")
    return out


def _server_paths(cfg: Config, b: Backend) -> list[tuple[str, str, bool]]:
    """(what, path, executable) for everything the server process itself opens: model files, the binary, the
    install root (venv, bundled chat template and NCCL under current/), preloaded libraries. Not the env files,
    config, state or units: systemd and the ExecStartPre (run as root, outside the sandboxing) read those."""
    out = [(what, path, kind == "file" and what.endswith((".executable", ".binary")))
           for what, path, kind in _named_files(cfg, b) if not what.endswith(".model_config")]
    out.append(("paths.root", cfg.paths.root, False))
    for k, v in backend_env(cfg, b):
        if k == "LD_PRELOAD":
            out += [(f"backends.{b.name} LD_PRELOAD", p, False) for p in v.replace(":", " ").split()
                    if p.startswith("/")]
    return out


def _closed_on_the_way(path: str, executable: bool) -> tuple[str, int] | None:
    """The first directory on the way to `path` that a DynamicUser cannot pass (no o+x), or `path` itself if it
    cannot read it (no o+r; o+x too for a directory or an executable): (that path, its mode). Only what exists is
    looked at (a release path before install: its existing parents)."""
    p = Path(path)
    chain = [*reversed(p.parents), p]
    for i, d in enumerate(chain):
        try:
            st = os.stat(d)
        except OSError:
            return None
        mode = st.st_mode & 0o7777
        last = i == len(chain) - 1
        if not last and not mode & 0o001:
            return str(d), mode
        if last:
            need = 0o005 if (os.path.isdir(d) or executable) else 0o004
            if mode & need != need:
                return str(d), mode
    return None


def _under(path: str, tops: tuple[str, ...]) -> str | None:
    return next((t for t in tops if path == t or path.startswith(t + "/")), None)


def check_unit_visibility(ctx: _Ctx) -> Iterator[Finding]:
    """Box paths the rendered units cannot see: under a tree their sandboxing hides (PrivateTmp=, ProtectHome=),
    or, for servers run as a DynamicUser, behind a directory that is not world-traversable. Such a server fails
    at its first start (203/EXEC, or a model it cannot open) while the ExecStartPre, which runs as root outside
    the sandboxing, passes. ProtectSystem=strict only makes the file system read-only, and the servers write
    none of these paths, so it hides nothing here."""
    cfg = ctx.cfg
    for name in sorted(cfg.backends if ctx.scope is None else ctx.scope & set(cfg.backends)):
        b = cfg.backends[name]
        unit = _unit_settings(cfg, b)  # rendered: only for the backends in scope
        dynamic = unit.get("DynamicUser") in _TRUE
        groups: dict[tuple[str, str], list[tuple[str, str]]] = {}  # (why, fix) -> [(what, path)]
        for what, path, executable in _server_paths(cfg, b):
            path = os.path.normpath(path)
            hidden = False
            for directive, hiding, tops, instead in _HIDDEN_BY:
                top = _under(path, tops)
                if top and unit.get(directive, "no") in hiding:
                    hidden = True
                    groups.setdefault((f"{directive}={unit[directive]} gives the server {instead}",
                                       f"move it out of {top} (e.g. under /srv or /var/lib; keep the whole box "
                                       f"there)"), []).append((what, path))
            if not hidden and dynamic and ctx.inspect_files and _runs_here(ctx, b) and not _installed_only(cfg, path):
                closed = _closed_on_the_way(path, executable)
                if closed:
                    where, mode = closed
                    home = _under(path, ("/home", "/root", "/run/user"))
                    why = (f"{where} is mode {mode:04o}: the server runs as a DynamicUser (DynamicUser=yes, "
                           f"serve.user: dynamic), which cannot " + ("read it" if where == path else "pass through it")
                           + (f" (ProtectHome={unit.get('ProtectHome')} leaves {home} visible, not open)"
                              if home else ""))
                    fix = (f"chmod o+r{'x' if executable or os.path.isdir(where) else ''} {where} (root-owned, "
                           f"not group/other-writable)" if where == path else
                           f"chmod o+x {where} (root-owned, not group/other-writable), or move the box out of it "
                           f"(e.g. under /srv or /var/lib)")
                    groups.setdefault((why, fix), []).append((what, path))
        for (why, fix), items in sorted(groups.items()):
            whats = ", ".join(dict.fromkeys(w for w, _ in items))
            yield _f("unit-path-hidden", "error", name, f"{whats} ({items[0][1]}): {b.unit} cannot see it: {why}",
                     fix)


def check_os_libraries(ctx: _Ctx) -> Iterator[Finding]:
    """Every OS library the installed release's native binaries (and a llama-server outside it) need, resolved
    as the dynamic loader would; a missing one is named with the Debian package that provides it, attributed to
    the backend that loads it (llama-server's own closure, else the ftllm backends that run the venv)."""
    if not ctx.inspect_files:
        return
    from deploy_tool import binaries

    cfg = ctx.cfg
    venv = os.path.join(cfg.paths.current, "venv")
    runs = [b for b in cfg.backends.values() if _runs_here(ctx, b) and (ctx.scope is None or b.name in ctx.scope)]
    llama = {b.name: expand(cfg, b.binary) for b in runs if isinstance(b, LlamacppBackend)}
    llama = {n: p for n, p in llama.items() if os.path.isfile(p)}
    extra = [p for p in llama.values() if not p.startswith(venv + "/")]
    nccl = os.path.join(cfg.paths.current, BUNDLED_NCCL)
    ftllm = [b for b in runs if isinstance(b, FtllmBackend)]
    if ftllm and os.path.isfile(nccl):
        extra.append(nccl)
    try:
        files = binaries.venv_elf_files(venv) if os.path.isdir(venv) else []
        provided = binaries.provided_names(files)  # what the venv's libraries offer, read once
        closures: dict[str, set[str]] = {}  # each llama-server's own closure (to name the backend a finding is of)
        own: dict[str, binaries.MissingLibrary] = {}  # and what those closures miss
        for name, path in llama.items():
            closures[name] = set()
            for m in binaries.missing_libraries([path], provided, closure=closures[name]):
                own.setdefault(m.name, m)
        if os.path.isdir(venv) and (ftllm or ctx.scope is None):
            missing = binaries.release_missing_libraries(venv, extra=extra, ftllm_devices={b.device for b in ftllm},
                                                         files=files)
        elif llama and not ftllm:  # llama-server's own closure is all a llamacpp backend loads
            missing = sorted(own.values(), key=lambda m: m.name)
        elif extra:
            missing = binaries.missing_libraries(extra)
        else:
            return
    except InputError:
        return  # an unreadable binary is reported by the checks that name files
    for m in missing:
        owners: list[str | None] = [n for n, c in closures.items() if m.needed_by in c] or [b.name for b in ftllm] \
            or [None]
        pkg = f" (Debian package: {m.package})" if m.package else ""
        for owner in owners:
            yield _f("os-library-missing", "error", owner,
                     f"{m.name} is not on this machine{pkg}; {m.needed_by} needs it, so the service would fail "
                     f"at its start", f"apt-get install {m.package}" if m.package and " " not in m.package
                     else f"install {m.name} on this machine" + (f": {m.package}" if m.package else ""))


# ----------------------------------------------------------------------------------------- driver

BackendCheck = Callable[[_Ctx, Backend], Iterator[Finding]]
BoxCheck = Callable[[_Ctx], Iterator[Finding]]

# ----------------------------------------------------------------------------------------- boot-safe GPU access

#: The root the GPU host checks read (/proc/devices, /dev, nvidia-modprobe, unit and modules-load.d dirs) under;
#: tests point it at a fake host tree.
HOST_ROOT = "/"
_UNIT_DIRS = ("etc/systemd/system", "run/systemd/system", "usr/lib/systemd/system", "lib/systemd/system")
_MODULES_LOAD = ("etc/modules-load.d", "run/modules-load.d", "usr/lib/modules-load.d", "lib/modules-load.d")


def _host(path: str) -> Path:
    return Path(HOST_ROOT) / path.lstrip("/")


def _char_devices() -> set[str] | None:
    """The character device names in /proc/devices (what systemd matches DeviceAllow=char-NAME against)."""
    try:
        text = _host("/proc/devices").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    names: set[str] = set()
    section = ""
    for line in text.splitlines():
        if line.strip().endswith(":"):
            section = line.strip()
            continue
        parts = line.split()
        if section.startswith("Character") and len(parts) == 2 and parts[0].isdigit():
            names.add(parts[1])
    return names


def _uvm_at_boot() -> str | None:
    """Where nvidia-uvm is listed to be loaded at boot (a modules-load.d file, /etc/modules), or None."""
    files = [p for d in _MODULES_LOAD if _host(d).is_dir() for p in sorted(_host(d).glob("*.conf"))]
    files.append(_host("/etc/modules"))
    for f in files:
        try:
            lines = f.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            continue
        if any(ln.split("#", 1)[0].strip() in ("nvidia-uvm", "nvidia_uvm") for ln in lines):
            return "/" + str(f.relative_to(_host("/")))
    return None


def check_gpu_boot(ctx: _Ctx) -> Iterator[Finding]:
    """Boot-safe GPU access of the cuda backends' units, on the machine that runs them (see the unit template):
    the device classes the driver registers, nvidia-uvm loaded at boot, nvidia-modprobe where the units run it,
    nvidia-persistenced to start after."""
    cuda = sorted(b.name for b in ctx.cfg.backends.values() if b.device == "cuda")
    if not cuda or not ctx.on_box:
        return
    who = ", ".join(cuda)
    classes = " ".join(NVIDIA_DEVICE_CLASSES)
    names = _char_devices()
    if names is None:
        seen = "/proc/devices cannot be read here"
        found: list[str] = []
    else:
        found = [c for c in NVIDIA_DEVICE_CLASSES if c.removeprefix("char-") in names]
        missing = [c for c in NVIDIA_DEVICE_CLASSES if c not in found]
        seen = (f"/proc/devices lists {', '.join(c.removeprefix('char-') for c in found) or 'none of them'}"
                + (f" (not {', '.join(c.removeprefix('char-') for c in missing)}: a name another driver "
                   "version uses, or a module not loaded now)" if missing else ""))
    yield _f("gpu-device-classes", "info", None,
             f"the units of {who} allow the NVIDIA devices by class (DeviceAllow= {classes}, rwm), not by path: "
             f"systemd resolves a path when the unit starts and silently drops one whose node does not exist yet "
             f"(/dev/nvidia-uvm on a cold boot), while a class matches every node of that driver major; "
             f"CUDA_VISIBLE_DEVICES (host.gpus) picks the cards. Here {seen}",
             "nothing to do; at least the driver's main class (nvidia-frontend or nvidia) and nvidia-uvm must be "
             "listed in /proc/devices when a backend starts")
    uvm_now = names is not None and "nvidia-uvm" in names
    boot = _uvm_at_boot()
    if boot is None:
        yield _f("nvidia-uvm-not-at-boot", "warning", None,
                 f"nvidia-uvm is not listed in any modules-load.d file or /etc/modules, and it is "
                 f"{'loaded now (by an earlier CUDA program or nvidia-modprobe)' if uvm_now else 'not loaded now'}: "
                 f"systemd reads /proc/devices when it sets up the unit's cgroup, before any ExecStartPre, so on a "
                 f"cold boot char-nvidia-uvm may resolve to nothing for {who}'s first start (the ExecStartPre's "
                 f"nvidia-modprobe loads the module for the starts after it) and CUDA init fails",
                 "load it at boot: echo nvidia-uvm > /etc/modules-load.d/nvidia-uvm.conf "
                 "(systemd-modules-load.service runs before the backends)")
    modprobe = _host(NVIDIA_MODPROBE)
    if not (modprobe.is_file() and os.access(modprobe, os.X_OK)):
        import shutil

        elsewhere = shutil.which("nvidia-modprobe") if HOST_ROOT == "/" else None
        mk = " ".join(f"-c={int(g)}" for g in ctx.cfg.host.gpus) + " -c=255"
        nodes = ["/dev/nvidiactl", "/dev/nvidia-uvm", *(f"/dev/nvidia{int(g)}" for g in ctx.cfg.host.gpus)]
        absent = [n for n in nodes if not _host(n).exists()]
        yield _f("nvidia-modprobe-missing", "warning", None,
                 f"{NVIDIA_MODPROBE} does not exist{f' ({elsewhere} does)' if elsewhere else ''}: the units of "
                 f"{who} skip their ExecStartPre=-+{NVIDIA_MODPROBE} {mk} (the GPUs' nodes and /dev/nvidiactl) and "
                 f"-u -c=0 (nvidia-uvm and /dev/nvidia-uvm), so nothing loads the modules and creates the device "
                 f"nodes before the server starts, and CUDA's own lazy call of the setuid nvidia-modprobe is blocked "
                 f"by NoNewPrivileges=yes: after a cold boot the server can fail CUDA init. Now "
                 + (f"missing: {', '.join(absent)}" if absent else f"all of {', '.join(nodes)} exist"),
                 (f"add a drop-in ({cuda[0]}.service.d/nvidia.conf) with ExecStartPre=-+{elsewhere} {mk} and "
                  f"ExecStartPre=-+{elsewhere} -u -c=0 (with -u, -c is the uvm node's minor, not a GPU)"
                  if elsewhere else "install nvidia-modprobe (Debian/Ubuntu: apt install nvidia-modprobe; it comes "
                  "with NVIDIA's driver packages)") + ", or create the nodes at boot (NVIDIA's udev rules, "
                 "nvidia-persistenced)")
    if not any(_host(f"{d}/{NVIDIA_PERSISTENCED}").exists() for d in _UNIT_DIRS):
        yield _f("nvidia-persistenced-absent", "info", None,
                 f"no {NVIDIA_PERSISTENCED} is installed: the units' After={NVIDIA_PERSISTENCED} orders nothing "
                 f"here (harmless), and without the daemon the driver is torn down whenever no program holds a GPU "
                 f"and the device nodes are made only by whoever opens them first",
                 "install and enable nvidia-persistenced (it ships with NVIDIA's driver packages): it keeps the "
                 "driver initialised and creates /dev/nvidia0.. and /dev/nvidiactl at boot, before the backends")


def _service_groups(cfg: Config) -> tuple[str, ...] | None:
    """The groups the backends' user is in, by name (None: root, which opens every node)."""
    groups = [cfg.host.gpu_group] if cfg.host.gpu_group else []
    user = cfg.serve.user
    if user == "root":
        return None
    if user != "dynamic":
        import grp
        import pwd

        try:
            pw = pwd.getpwnam(user)
            groups.append(grp.getgrgid(pw.pw_gid).gr_name)
        except KeyError:
            pass
        groups += [g.gr_name for g in grp.getgrall() if user in g.gr_mem]
    return tuple(groups)


def check_gpu_box(ctx: _Ctx) -> Iterator[Finding]:
    """The cuda backends' GPUs as the box has them: the driver loaded, every host.gpus entry a GPU of it, and the
    nodes open to the service user (world read-writable, or through host.gpu_group): each failure otherwise makes
    the server fall back to the CPU (llama-server) or fail CUDA init, without a word from systemd."""
    cuda = sorted(b.name for b in ctx.cfg.backends.values() if b.device == "cuda")
    if not cuda or not ctx.on_box:
        return
    who, cfg = ", ".join(cuda), ctx.cfg
    gpus = gpu.driver_gpus(HOST_ROOT)
    if gpus is None:
        yield _f("cuda-no-driver", "error", None,
                 f"{who} run on the GPUs (device: cuda), but this machine has no NVIDIA driver loaded "
                 f"(/proc/driver/nvidia is missing): they would fail CUDA init at every start, and llama-server would "
                 f"serve on the CPU", "install and load the NVIDIA driver (e.g. apt install nvidia-driver, then reboot), "
                 "or set device: cpu for a machine without a GPU")
        return
    minors = {g.minor: g for g in gpus}
    have = ", ".join(f"{g.minor} ({g.model}, {g.bus})" for g in gpus) or "none"
    lost = [int(g) for g in cfg.host.gpus
            if not (int(g) in minors if minors else gpu.node(gpu.gpu_node(g), HOST_ROOT) is not None)]
    if lost:
        yield _f("gpu-missing", "error", None,
                 f"host.gpus lists GPU{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))}, but the driver has "
                 f"no GPU of {'those minors' if len(lost) > 1 else 'that minor'} "
                 f"({', '.join(gpu.gpu_node(g) for g in lost)}); it has: {have}",
                 "list the box's GPUs in host.gpus by their minor (`nvidia-smi -L` in PCI order, or "
                 "`grep 'Device Minor' /proc/driver/nvidia/gpus/*/information`)")
    groups = _service_groups(cfg)
    if groups is None:
        return
    nodes = gpu.box_nodes(cfg.host.gpus, HOST_ROOT)
    closed = gpu.closed_nodes(nodes, groups=groups)
    if closed:
        need = sorted({n.group for n in closed if n.mode & 0o060 == 0o060})
        user = "the DynamicUser" if cfg.serve.user == "dynamic" else f"user {cfg.serve.user}"
        fix = (f"set host.gpu_group: {need[0]} (the units get SupplementaryGroups={need[0]}), then pack and install "
               f"again" if len(need) == 1 else "make the nodes world read-writable (NVreg_DeviceFileMode=0666) or "
               "owned by one group, and set host.gpu_group to it")
        yield _f("gpu-nodes-closed", "error", None,
                 f"{user} of {who} cannot open {', '.join(n.describe() for n in closed)}"
                 + (f" (host.gpu_group is {cfg.host.gpu_group})" if cfg.host.gpu_group else " (host.gpu_group unset)")
                 + ": CUDA init fails and llama-server serves on the CPU (measured on an H200 with 0660 root:video "
                   "nodes, with or without PrivateUsers=)", fix)


def _gpu_binaries(cfg: Config, b: Backend) -> list[str]:
    """The files with GPU code a cuda backend runs: llama-server and its libraries, or ftllm's CUDA library."""
    if isinstance(b, LlamacppBackend):
        return [f for f in llama_files(expand(cfg, b.binary)) if os.path.isfile(f)]
    venv = Path(cfg.paths.current) / "venv" / "lib"
    return sorted(str(p) for p in venv.glob("python3*/site-packages/ftllm/libfastllm_tools*.so")
                  if "-cpu" not in p.name)


def check_gpu_code(ctx: _Ctx, b: Backend) -> Iterator[Finding]:
    """Whether the backend's binaries carry machine code for host.compute_capability, or only PTX the driver
    compiles at start (the JIT, kept in the unit's CacheDirectory= across starts)."""
    if b.device != "cuda" or not ctx.inspect_files or not ctx.on_box:
        return
    from deploy_tool import binaries  # lazy: see the module's docstring

    cc = ctx.cfg.host.compute_capability
    sm = "sm_" + cc.replace(".", "")
    for path in _gpu_binaries(ctx.cfg, b):
        try:
            info = binaries.read_fatbin(path)
        except DeployError:
            continue
        if not info.has_fatbin:
            continue
        code = binaries.runnable_code(info, cc)
        name = Path(path).name
        if code == "ptx":
            yield _f("gpu-jit-first-start", "info", b.name,
                     f"{name} has no {sm} machine code (cubins: {', '.join(info.cubin_archs) or 'none'}; PTX: "
                     f"{', '.join(info.ptx_archs)}): the driver compiles its PTX at the first start on this GPU, which "
                     f"can take minutes for a large build; the unit's CUDA cache (CacheDirectory=, "
                     f"CUDA_CACHE_PATH=/var/cache/deploytool-{b.name}/cuda) keeps the result across starts until the "
                     f"driver changes or the cache passes CUDA_CACHE_MAXSIZE",
                     f"nothing to do, or build it with {sm} code to skip the JIT")
        elif code is None:
            yield _f("gpu-code-missing", "error", b.name,
                     f"{name} has no code that runs on a {cc} GPU (cubins: {', '.join(info.cubin_archs) or 'none'}; "
                     f"PTX: {', '.join(info.ptx_archs) or 'none'}): CUDA fails with 'no kernel image is available'",
                     f"use a build with {sm} code (or PTX of an architecture at most {sm})")


BACKEND_CHECKS: tuple[BackendCheck, ...] = (
    check_device, check_cuda_graph, check_nccl, check_draft_tokens, check_fp8_kv_dflash, check_cuda_embedding,
    check_gpu_mem_ratio, check_chat_template_thinking, check_think, check_capacity, check_split_row, check_tensor,
    check_mtp_kv, check_q8_f16_context, check_gguf, check_extra_args_override, check_tensor_one_device,
    check_visible_devices_allowed, check_llama_verbosity, check_threads, check_ctx_over_training,
    check_draft_unused, check_api_key_exposed, check_gpu_code,
)
def check_strict_modes(ctx: _Ctx) -> Iterator[Finding]:
    """On a box where this config's install exists (`current` is there), every path a root step reads that is not
    root's alone (deploy_tool.strictmodes), one finding each; verify refuses every start until they are fixed. A
    packaging machine (no install of the config) is not held to it: its checkout is the builder's own."""
    if not os.path.lexists(ctx.cfg.paths.current):
        return
    from deploy_tool import strictmodes

    for u in strictmodes.scan(ctx.cfg):
        yield _f("path-not-root-only", "error", None, f"{u.path} ({u.what}): owner {u.uid}:{u.gid}, mode "
                 f"{u.mode & 0o7777:04o}, {' and '.join(u.problems)}: every start of a backend is refused until "
                 "it is root's alone", u.fix)


BOX_CHECKS: tuple[BoxCheck, ...] = (check_serve, check_template, check_files, check_unit_visibility,
                                    check_port_in_use, check_context_differs, check_os_libraries, check_gpu_boot,
                                    check_gpu_box, check_strict_modes)


def gpu_box_errors(cfg: Config) -> list[Finding]:
    """What install refuses before it changes anything: the errors of the cuda backends' GPU checks, on this box
    (whatever nvidia_present() says: a box without the driver is the first such error)."""
    ctx = _Ctx(cfg, inspect_files=True, on_box=True)
    out = [*check_gpu_box(ctx)]
    for name in sorted(cfg.backends):
        out += check_gpu_code(ctx, cfg.backends[name])
    return [f for f in out if f.severity == "error"]


def run_checks(cfg: Config, *, inspect_files: bool = True, on_box: bool | None = None,
               backends: Iterable[str] | None = None) -> list[Finding]:
    """Run every check; sorted by severity (errors first), then backend, then id.

    `on_box`: whether this machine runs the config's cuda backends (default: an NVIDIA driver is present);
    it decides whether a missing file of a cuda backend is an error or "not on this machine".
    `backends`: the backends whose own checks run (default: all); the box's checks always run.
    """
    ctx = _Ctx(cfg, inspect_files, nvidia_present() if on_box is None else on_box,
               scope=None if backends is None else frozenset(backends))
    out: list[Finding] = []
    for name in sorted(cfg.backends if backends is None else set(backends) & set(cfg.backends)):
        for chk in BACKEND_CHECKS:
            out.extend(chk(ctx, cfg.backends[name]))
    for box in BOX_CHECKS:
        out.extend(box(ctx))
    uniq = list(dict.fromkeys(out))
    return sorted(uniq, key=lambda f: (SEVERITY_ORDER[f.severity], f.backend or "", f.id, f.message))
