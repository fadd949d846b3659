"""The one input: `deploytool.yaml` -> frozen, typed, validated objects.

Validation happens once, here, at load. Every error names the key path, the bad value and the expected form
(`backends.llamacpp-tensor.port: 'abc' is not a valid port (expected an integer 1-65535)`); unknown keys are
errors with a did-you-mean. Past this module only frozen dataclasses travel, never raw dicts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import posixpath
import re
import stat
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from deploy_tool.errors import ConfigError, InputError
from deploy_tool.textsafe import describe, unsafe_char
from deploy_tool.textsafe import key as key_part

CONFIG_VERSION = 1
DEFAULT_CONFIG_PATH = Path("/etc/deploytool/deploytool.yaml")
BACKEND_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,39}$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
EXAMPLES = ("two-2080ti", "cpu-demo")

Device = Literal["cuda", "cpu"]
ArchPolicy = Literal["exact", "compatible"]
KvDtypeFtllm = Literal["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp4"]
KvDtypeLlama = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]
SplitMode = Literal["none", "layer", "row", "tensor"]
FlashAttn = Literal["on", "off", "auto"]


# --------------------------------------------------------------------------------------------------------------
# Schema. Field metadata: "doc" (shown by `deploytool config-reference`), "check" (callable value -> error or None)


def _doc(text: str, check: typing.Callable[[Any], str | None] | None = None, **kw: Any) -> Any:
    meta: dict[str, Any] = {"doc": text}
    if check is not None:
        meta["check"] = check
    return field(metadata=meta, **kw)


def _port(v: int) -> str | None:
    return None if 1 <= v <= 65535 else "is not a valid port (expected an integer 1-65535)"


def _positive(v: float) -> str | None:
    return None if v > 0 else "must be greater than 0"


def _ratio(v: float) -> str | None:
    return None if 0 < v <= 1 else "must be a fraction in (0, 1]"


def _cc(v: str) -> str | None:
    return None if re.fullmatch(r"\d+\.\d+", v) else "is not a compute capability (expected a string like '7.5')"


def _abs_or_placeholder(v: str) -> str | None:
    if v.startswith("{") and not v.startswith(("{current}", "{venv}")):
        return "may only start with the placeholders {current} or {venv}"
    if not v.strip():
        return "must not be empty"
    if v != v.strip():
        return "begins or ends with white space (expected a path)"
    if ".." in v.split("/"):
        return "has a '..' component (expected a path without it: systemd refuses such paths)"
    if v.startswith("{"):
        rest = v[v.index("}") + 1:]
        if rest and (not rest.startswith("/") or rest.endswith("/") or posixpath.normpath(rest) != rest):
            return "is not a normalized path after its placeholder (expected e.g. '{venv}/bin/ftllm')"
    return None


def _gpu_ids(v: tuple[int, ...]) -> str | None:
    if any(not 0 <= g <= 1023 for g in v):
        return "holds a GPU id outside 0-1023 (expected ids such as [0, 1])"
    return "names a GPU twice" if len(set(v)) != len(v) else None


USER_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,30}$")
HOST_NAME_RE = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                          r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")


def _user(v: str) -> str | None:
    if v == "nobody":  # systemd: "Special user nobody configured, this is not safe!"
        return "is the user other services share; systemd refuses it as unsafe (use 'dynamic')"
    if v == "dynamic" or USER_NAME_RE.match(v):
        return None
    return ("is not a user name (expected 'dynamic' or a name of letters, digits, '_' and '-', starting with a "
            "letter or '_', at most 31 characters)")


def _host(v: str) -> str | None:
    import ipaddress  # lazy: only a non-default host needs it

    try:
        ipaddress.ip_address(v)
        return None
    except ValueError:
        pass
    return None if HOST_NAME_RE.match(v) else "is not an IP address or host name (expected e.g. 127.0.0.1)"


def _argument_value(v: str) -> str | None:
    """A value passed after an option (--model_name VALUE): not empty and not taken for an option itself."""
    if not v:
        return "must not be empty"
    return "begins with '-', so the server would take it for an option" if v.startswith("-") else None


def _unit_text(v: str) -> str | None:
    """Free text on a unit line (Description=): systemd strips white space around a value and joins a line that
    ends with a backslash to the next."""
    if v != v.strip(" "):
        return "begins or ends with a space, which systemd would drop"
    return "ends with a backslash, which systemd reads as a line continuation" if v.endswith("\\") else None


@dataclass(frozen=True)
class Host:
    gpus: tuple[int, ...] = _doc("GPU ids given to the services (CUDA_VISIBLE_DEVICES)", _gpu_ids, default=(0,))
    compute_capability: str = _doc("compute capability of the GPUs, e.g. '7.5' for Turing (sm_75)",
                                   _cc, default="7.5")
    vram_mib: int = _doc("memory per GPU in MiB (22528 for a modified 2080 Ti 22G)", _positive, default=22528)


@dataclass(frozen=True)
class Serve:
    host: str = _doc("address both backends bind (one port, one model name, whichever backend runs)",
                     _host, default="127.0.0.1")
    port: int = _doc("TCP port both backends bind", _port, default=8082)
    model_name: str = _doc("the model name clients send; both backends answer to it", _argument_value,
                           default="model")
    api_key_file: str | None = _doc("file holding the API key (kept out of unit files; written 0600)",
                                    default=None)
    user: str = _doc("who the services run as: 'dynamic' (DynamicUser=yes, the safest; model files must be "
                     "world-readable) or a user name such as 'root'", _user, default="dynamic")


@dataclass(frozen=True)
class Paths:
    config: str = _doc("where the config lives on the box (ExecStartPre passes it to `deploytool verify`)",
                       _abs_or_placeholder, default="/etc/deploytool/deploytool.yaml")
    root: str = _doc("install root: releases/<id>/ and the `current` symlink live here", _abs_or_placeholder,
                     default="/opt/deploytool")
    unit_dir: str = _doc("where unit files are installed", _abs_or_placeholder, default="/etc/systemd/system")
    env_dir: str = _doc("where env files are installed", _abs_or_placeholder, default="/etc/deploytool/env")
    state_dir: str = _doc("state.json, history.jsonl and the lock", _abs_or_placeholder,
                          default="/var/lib/deploytool")
    keys_dir: str = _doc("trusted Ed25519 public keys (*.pub)", _abs_or_placeholder, default="/etc/deploytool/keys")
    deploytool: str = _doc("the deploytool the units' ExecStartPre runs (pinned inside the release)",
                           _abs_or_placeholder, default="{current}/tool/bin/deploytool")

    @property
    def releases_dir(self) -> str:
        return self.root.rstrip("/") + "/releases"

    @property
    def current(self) -> str:
        return self.root.rstrip("/") + "/current"


@dataclass(frozen=True)
class SystemdCfg:
    sandbox: str | None = _doc("a `deploytool sandbox` directory: systemctl, journalctl and the unit dir "
                               "then target that sandboxed systemd instead of the host", default=None)
    systemctl: tuple[str, ...] = _doc("the systemctl command (argv prefix)", default=("systemctl",))
    journalctl: tuple[str, ...] = _doc("the journalctl command (argv prefix)", default=("journalctl",))


@dataclass(frozen=True)
class HealthCfg:
    start_timeout_s: float = _doc("how long a backend may take to become ready (a 29 GB load takes minutes)",
                                  _positive, default=900.0)
    interval_s: float = _doc("readiness probe interval while waiting (cheap: a refused connection or a /health "
                             "503; the unit is watched through its main process, not polled)", _positive,
                             default=0.02)
    smoke_timeout_s: float = _doc("timeout of the smoke chat completion", _positive, default=120.0)
    smoke_max_tokens: int = _doc("max_tokens of the smoke chat completion", _positive, default=16)
    perf_gate_fraction: float | None = _doc("after health, a short bench must reach this fraction of the stored "
                                            "baseline's tokens/s (`deploytool bench --save-baseline`), else the "
                                            "switch rolls back; null: off", _ratio, default=None)


@dataclass(frozen=True)
class TemplatePatch:
    find: str = _doc("text that must occur exactly once in the original template",
                     default="is not none else 'medium' %}")
    replace: str = _doc("its replacement", default="is not none else 'low' %}")


@dataclass(frozen=True)
class ChatTemplate:
    source: str = _doc("the original template file (relative to the config file or absolute)")
    sha256: str | None = _doc("SHA-256 of the original; checked before patching", default=None)
    origin: str | None = _doc("where it came from (recorded in the manifest)", default=None)
    commit: str | None = _doc("the pinned upstream commit (recorded in the manifest)", default=None)
    patch: TemplatePatch | None = _doc("one exact substitution; must match exactly once", default=None)


@dataclass(frozen=True)
class Nccl:
    library: str = _doc("the NCCL library to bundle and LD_PRELOAD (libnccl.so.2)")
    arch_policy: ArchPolicy = _doc("'exact': require a cubin for the GPUs' arch (the write-up's fix); "
                                   "'compatible': also accept same-major lower-minor cubins", default="exact")
    force: bool = _doc("bundle it even though the arch check fails (marked in the manifest)", default=False)


@dataclass(frozen=True)
class BundleCfg:
    name: str = _doc("bundle name prefix", default="deploytool")
    python: str = _doc("the Python that builds and runs the release venv", default="/usr/bin/python3")
    requirements: str | None = _doc("requirements input for `deploytool lock` (relative to the config)",
                                    default=None)
    lock_mode: Literal["resolve", "exact"] = _doc("'resolve': `lock` resolves dependencies; 'exact': the "
                                                  "requirements list the whole closure (pip download --no-deps)",
                                                  default="resolve")
    lock: str = _doc("hash-pinned lock file (pip --require-hashes format)", default="requirements.lock")
    wheels_dir: str = _doc("local wheel directory the lock resolves against", default="wheels")
    tool_wheels_dir: str | None = _doc("deploytool's own wheel and its dependencies' wheels (bundled so the "
                                       "box runs a pinned deploytool; `lock` fills it)", default="tool-wheels")
    chat_template: ChatTemplate | None = _doc("the chat template to patch and bundle", default=None)
    nccl: Nccl | None = _doc("the NCCL library to bundle", default=None)


@dataclass(frozen=True)
class Speculative:
    algorithm: Literal["dflash", "mtp", "eagle", "none"] = _doc("ftllm --speculative_algorithm", default="dflash")
    draft_model: str | None = _doc("--speculative_draft_model_path (the DFlash2 draft directory)", default=None)
    num_draft_tokens: int = _doc("--speculative_num_draft_tokens N (drafts N-1 tokens)", _positive, default=8)


@dataclass(frozen=True)
class LlamaSpec:
    type: str = _doc("--spec-type (draft-mtp uses the GGUF's built-in MTP heads)", _argument_value,
                     default="draft-mtp")
    draft_n_max: int = _doc("--spec-draft-n-max", _positive, default=3)


@dataclass(frozen=True)
class BackendBase:
    name: str
    kind: str
    aliases: tuple[str, ...]
    device: Device
    model: str
    threads: int | None
    env: tuple[tuple[str, str], ...]
    extra_args: tuple[str, ...]
    description: str | None
    start_timeout_s: float | None

    @property
    def unit(self) -> str:
        return f"{self.name}.service"


@dataclass(frozen=True)
class FtllmBackend(BackendBase):
    executable: str = "{venv}/bin/ftllm"
    tp: int = 1
    max_batch: int | None = None
    tokens: int | None = None
    gpu_mem_ratio: float | None = None
    kv_cache_dtype: str | None = None
    cuda_embedding: bool = False
    think: bool | None = None
    prefix_cache: bool | None = None
    use_bundle_chat_template: bool = False
    use_bundle_nccl: bool = False
    clients_request_thinking: bool = True
    speculative: Speculative | None = None
    model_config: str | None = None


@dataclass(frozen=True)
class LlamacppBackend(BackendBase):
    binary: str = "/usr/local/bin/llama-server"
    build: str | None = None
    mmproj: str | None = None
    split_mode: str | None = None
    ctx_size: int | None = None
    flash_attn: str | None = None
    cache_type_k: str | None = None
    cache_type_v: str | None = None
    spec: LlamaSpec | None = None
    model_config: str | None = None


Backend = FtllmBackend | LlamacppBackend


# raw-schema classes for the two backend kinds (what the YAML may say); turned into the classes above
@dataclass(frozen=True)
class _BackendCommon:
    kind: Literal["ftllm", "llamacpp"] = _doc("which server: 'ftllm' (FastLLM) or 'llamacpp' (llama-server)")
    model: str = _doc("model directory (ftllm) or GGUF file")
    aliases: tuple[str, ...] = _doc("short names accepted by switch (e.g. 'ftllm')", default=())
    device: Device = _doc("'cuda' (the GPUs) or 'cpu' (ftllm --device cpu -t 1; llama-server on CPU: "
                          "how the demo and the tests run here)", default="cuda")
    threads: int | None = _doc("CPU threads (-t); default 1 on cpu", default=None)
    env: Mapping[str, str] = _doc("extra environment (EnvironmentFile syntax is handled for you)",
                                  default_factory=dict)
    extra_args: tuple[str, ...] = _doc("extra arguments appended to the launch line", default=())
    description: str | None = _doc("unit Description=", _unit_text, default=None)
    model_config: str | None = _doc("the model's config.json (capacity math; default <model>/config.json)",
                                    default=None)
    start_timeout_s: float | None = _doc("this backend's own time to become ready (default: "
                                         "health.start_timeout_s)", _positive, default=None)


@dataclass(frozen=True)
class _FtllmRaw(_BackendCommon):
    executable: str = _doc("the ftllm console script", _abs_or_placeholder, default="{venv}/bin/ftllm")
    tp: int = _doc("--tp tensor parallel degree", _positive, default=1)
    max_batch: int | None = _doc("--max_batch", default=None)
    tokens: int | None = _doc("--tokens: KV cache token budget (context)", default=None)
    gpu_mem_ratio: float | None = _doc("--gpu_mem_ratio (0.95 is the known-good value)", _ratio, default=None)
    kv_cache_dtype: KvDtypeFtllm | None = _doc("--kv_cache_dtype (fp4 for 262K with DFlash2)", default=None)
    cuda_embedding: bool = _doc("--cuda_embedding (pins a 2.4 GB FP16 embedding on GPU0)", default=False)
    think: bool | None = _doc("--think (only prepends '<think>\\n' to output; does not change the model)",
                              default=None)
    prefix_cache: bool | None = _doc("--prefix_cache", default=None)
    chat_template: Literal["bundle"] | None = _doc("'bundle': pass the bundle's patched chat template",
                                                   default=None)
    nccl: Literal["bundle"] | None = _doc("'bundle': LD_PRELOAD the bundle's NCCL", default=None)
    clients_request_thinking: bool = _doc("clients may send enable_thinking: true", default=True)
    speculative: Speculative | None = _doc("speculative decoding", default=None)


@dataclass(frozen=True)
class _LlamacppRaw(_BackendCommon):
    binary: str = _doc("the llama-server binary", _abs_or_placeholder, default="/usr/local/bin/llama-server")
    build: str | None = _doc("the llama.cpp build the settings were proven on (e.g. b10064)", default=None)
    mmproj: str | None = _doc("--mmproj GGUF (vision)", default=None)
    split_mode: SplitMode | None = _doc("-sm (row was removed upstream; use tensor)", default=None)
    ctx_size: int | None = _doc("-c context size (required with -sm tensor: it ignores --fit)", default=None)
    flash_attn: FlashAttn | None = _doc("-fa", default=None)
    cache_type_k: KvDtypeLlama | None = _doc("-ctk (leave unset for f16 main KV: best MTP acceptance)",
                                             default=None)
    cache_type_v: KvDtypeLlama | None = _doc("-ctv", default=None)
    spec: LlamaSpec | None = _doc("speculative decoding with the built-in MTP heads", default=None)


@dataclass(frozen=True)
class Config:
    version: int = _doc("config format version (1)")
    default_backend: str = _doc("the backend install starts")
    backends: Mapping[str, Backend] = _doc("the backends, by name (unit name = <name>.service)")
    host: Host = _doc("the machine", default_factory=Host)
    serve: Serve = _doc("what is served", default_factory=Serve)
    paths: Paths = _doc("system paths (point them at a sandbox to rehearse)", default_factory=Paths)
    systemd: SystemdCfg = _doc("how systemd is reached", default_factory=SystemdCfg)
    health: HealthCfg = _doc("the health gate", default_factory=HealthCfg)
    bundle: BundleCfg = _doc("what `pack` bundles", default_factory=BundleCfg)
    # not from YAML:
    source_path: str | None = None
    source_sha256: str | None = None

    @property
    def base_dir(self) -> Path:
        return Path(self.source_path).parent if self.source_path else Path.cwd()

    def resolve(self, p: str) -> Path:
        """A path from the config, relative paths taken from the config file's directory."""
        path = Path(p).expanduser()
        return path if path.is_absolute() else self.base_dir / path

    def backend(self, name_or_alias: str) -> Backend:
        """Resolve a backend by name, alias or unambiguous prefix; an unknown name lists the backends."""
        return self.backends[resolve_backend_name(self, name_or_alias)]

    def other_backends(self, name: str) -> list[Backend]:
        return [b for n, b in sorted(self.backends.items()) if n != name]


_RAW_TOP = {"version", "default_backend", "backends", "host", "serve", "paths", "systemd", "health", "bundle"}


def resolve_backend_name(cfg: Config, name: str) -> str:
    if name in cfg.backends:
        return name
    by_alias = [n for n, b in cfg.backends.items() if name in b.aliases]
    if len(by_alias) == 1:
        return by_alias[0]
    pref = sorted({n for n, b in cfg.backends.items()
                   if n.startswith(name) or any(a.startswith(name) for a in b.aliases)}) if name else []
    if len(pref) == 1:
        return pref[0]
    choices = ", ".join(f"{n} ({', '.join(b.aliases)})" if b.aliases else n for n, b in sorted(cfg.backends.items()))
    if len(pref) > 1:
        raise ConfigError(f"backend name {name!r} is ambiguous: it could be {', '.join(pref)}",
                          hint=f"use one of: {choices}")
    raise ConfigError(f"unknown backend {name!r}", hint=f"the backends are: {choices}")


# --------------------------------------------------------------------------------------------------------------
# Generic loader


def _close_matches(word: str, possibilities: list[str] | tuple[str, ...], n: int = 1,
                   cutoff: float = 0.6) -> list[str]:
    import difflib  # lazy: only an error needs a did-you-mean, and verify runs before every start

    return difflib.get_close_matches(word, possibilities, n=n, cutoff=cutoff)


def _fmt(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        inner = " or ".join(_type_name(a) for a in args)
        return inner + " (or null)" if len(args) < len(get_args(tp)) else inner
    if origin is tuple:
        return f"a list of {_type_name(get_args(tp)[0])}"
    if origin in (Mapping, dict):
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:
            return _convert(non_none[0], value, path)
        raise AssertionError("unions of several types are not used in the schema")
    if value is None:
        raise ConfigError(f"{path}: null is not allowed (expected {_type_name(tp)})")
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            close = _close_matches(str(value), [str(a) for a in allowed], n=1)
            hint = f"did you mean {close[0]!r}?" if close else None
            raise ConfigError(f"{path}: {_fmt(value)} is not valid (expected {_type_name(tp)})", hint=hint)
        return value
    if origin is tuple:
        (item_tp, *_rest) = get_args(tp)
        if isinstance(value, str | bytes) or not isinstance(value, list):
            raise ConfigError(f"{path}: {_fmt(value)} is not a list (expected {_type_name(tp)})")
        return tuple(_convert(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin in (Mapping, dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: {_fmt(value)} is not a mapping")
        k_tp, v_tp = get_args(tp)
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"{path}: key {_fmt(k)} is not a string")
            out[k] = _convert(v_tp, v, f"{path}.{key_part(k)}")
        return types.MappingProxyType(out)
    if dataclasses.is_dataclass(tp):
        return _load_dataclass(tp, value, path)  # type: ignore[arg-type]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: {_fmt(value)} is not true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: {_fmt(value)} is not an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: {_fmt(value)} is not a number")
        if value != value or value in (float("inf"), float("-inf")):
            raise ConfigError(f"{path}: {_fmt(value)} is not a finite number")
        return float(value)
    if tp is str:
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise ConfigError(f"{path}: {_fmt(value)} is not a string")
        s = str(value)
        if "\x00" in s:
            raise ConfigError(f"{path}: contains a NUL byte")
        if any("\ud800" <= c <= "\udfff" for c in s):  # YAML's "\ud800": no file name or UTF-8 file holds it
            raise ConfigError(f"{path}: {_fmt(s)} is not valid Unicode text (it holds a lone surrogate)")
        return s
    raise AssertionError(f"unsupported schema type {tp!r}")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _load_dataclass(cls: type, raw: Any, path: str) -> Any:
    where = path or "the config"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: {_fmt(raw)} is not a mapping (expected keys: "
                          f"{', '.join(f.name for f in dataclasses.fields(cls) if f.init and 'doc' in f.metadata)})")
    hints = _hints(cls)
    known = [f.name for f in dataclasses.fields(cls) if "doc" in f.metadata]
    for key in raw:
        if not isinstance(key, str) or key not in known:
            close = _close_matches(str(key), known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
            raise ConfigError(f"{where}: unknown key {_fmt(key)}", hint=hint)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if "doc" not in f.metadata:
            continue
        sub = f"{path}.{f.name}" if path else f.name
        if f.name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{sub}: missing (expected {_type_name(hints[f.name])}: {f.metadata['doc']})")
            continue
        val = _convert(hints[f.name], raw[f.name], sub)
        check = f.metadata.get("check")
        if check is not None and val is not None:
            msg = check(val)
            if msg:
                raise ConfigError(f"{sub}: {_fmt(raw[f.name])} {msg}")
        kwargs[f.name] = val
    return cls(**kwargs)


def _backend_from_raw(name: str, raw: Any) -> Backend:
    path = f"backends.{key_part(name)}"
    if not BACKEND_NAME_RE.match(name):
        raise ConfigError(f"{path}: {name!r} is not a valid backend name (expected lowercase letters, digits and "
                          f"'-', starting with a letter, at most 40 characters; it becomes the unit name)")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: {_fmt(raw)} is not a mapping")
    kind = raw.get("kind")
    if kind not in ("ftllm", "llamacpp"):
        raise ConfigError(f"{path}.kind: {_fmt(kind)} is not valid (expected one of 'ftllm', 'llamacpp')")
    r = _load_dataclass(_FtllmRaw if kind == "ftllm" else _LlamacppRaw, raw, path)
    for k, v in r.env.items():
        if not ENV_NAME_RE.match(k):
            raise ConfigError(f"{path}.env: {k!r} is not a valid environment variable name",
                              hint="use letters, digits and '_', not starting with a digit")
        if "\n" in v or "\r" in v:
            raise ConfigError(f"{path}.env.{k}: the value contains a line break, which an EnvironmentFile "
                              f"cannot hold", hint="put such data in a file and pass its path")
    threads = r.threads if r.threads is not None else (1 if r.device == "cpu" else None)
    common = dict(name=name, kind=kind, aliases=r.aliases, device=r.device, model=r.model, threads=threads,
                  env=tuple(sorted(r.env.items())), extra_args=r.extra_args, description=r.description,
                  model_config=r.model_config, start_timeout_s=r.start_timeout_s)
    if kind == "ftllm":
        return FtllmBackend(**common, executable=r.executable, tp=r.tp, max_batch=r.max_batch, tokens=r.tokens,
                            gpu_mem_ratio=r.gpu_mem_ratio, kv_cache_dtype=r.kv_cache_dtype,
                            cuda_embedding=r.cuda_embedding, think=r.think, prefix_cache=r.prefix_cache,
                            use_bundle_chat_template=r.chat_template == "bundle",
                            use_bundle_nccl=r.nccl == "bundle",
                            clients_request_thinking=r.clients_request_thinking, speculative=r.speculative)
    return LlamacppBackend(**common, binary=r.binary, build=r.build, mmproj=r.mmproj, split_mode=r.split_mode,
                           ctx_size=r.ctx_size, flash_attn=r.flash_attn, cache_type_k=r.cache_type_k,
                           cache_type_v=r.cache_type_v, spec=r.spec)


def from_dict(raw: Any, *, source_path: str | None = None, source_sha256: str | None = None) -> Config:
    """Validate a parsed YAML document and build the Config (raises ConfigError naming the key path)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"the config must be a YAML mapping at the top level, not {type(raw).__name__}",
                          hint="start from `deploytool init --example cpu-demo`")
    for key in raw:
        if key not in _RAW_TOP:
            close = _close_matches(str(key), sorted(_RAW_TOP), n=1, cutoff=0.6)
            raise ConfigError(f"unknown key {_fmt(key)} at the top level",
                              hint=f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(sorted(_RAW_TOP))}")
    if "version" not in raw:
        raise ConfigError("version: missing (expected 1)", hint="add `version: 1` at the top")
    if raw["version"] != CONFIG_VERSION or isinstance(raw["version"], bool):
        raise ConfigError(f"version: {_fmt(raw['version'])} is not a supported config version (expected 1)")
    backends_raw = raw.get("backends")
    if not isinstance(backends_raw, dict) or not backends_raw:
        raise ConfigError("backends: missing or empty (expected a mapping of backend name -> settings)")
    backends = {}
    for name, b in backends_raw.items():
        if not isinstance(name, str):
            raise ConfigError(f"backends: key {_fmt(name)} is not a string")
        backends[name] = _backend_from_raw(name, b)
    rest = {k: v for k, v in raw.items() if k not in ("backends", "version", "default_backend")}
    parts = _load_dataclass(_ConfigRest, rest, "")
    default = raw.get("default_backend")
    if not isinstance(default, str):
        raise ConfigError(f"default_backend: {_fmt(default)} is not a string (expected one of "
                          f"{', '.join(sorted(backends))})")
    if default not in backends:
        close = _close_matches(default, sorted(backends), n=1)
        raise ConfigError(f"default_backend: {default!r} is not one of the backends ({', '.join(sorted(backends))})",
                          hint=f"did you mean {close[0]!r}?" if close else None)
    # aliases must be unique and must not shadow a backend name
    seen: dict[str, str] = {}
    for name, b in backends.items():
        for a in b.aliases:
            if a in backends and a != name:
                raise ConfigError(f"backends.{name}.aliases: {a!r} is the name of another backend")
            if a in seen and seen[a] != name:
                raise ConfigError(f"backends.{name}.aliases: {a!r} is already an alias of {seen[a]}")
            seen[a] = name
    cfg = Config(version=CONFIG_VERSION, default_backend=default, backends=types.MappingProxyType(backends),
                 host=parts.host, serve=parts.serve, paths=parts.paths, systemd=parts.systemd,
                 health=parts.health, bundle=parts.bundle, source_path=source_path, source_sha256=source_sha256)
    _refuse_unsafe_text(cfg, "")  # as written (before paths are resolved, which could fail on such text)
    cfg = _resolve_paths(cfg, raw)
    _refuse_unsafe_text(cfg, "")  # as resolved: the config's own directory is part of relative paths
    _check_programs(cfg)
    return cfg


def expand(cfg: Config, path: str) -> str:
    """Expand the {current} and {venv} placeholders to paths under the install root."""
    return path.replace("{venv}", cfg.paths.current + "/venv").replace("{current}", cfg.paths.current)


def _check_programs(cfg: Config) -> None:
    """The programs the units run, as expanded: absolute, normalized, without `$`. systemd takes the program
    path of an Exec*= line as it is but substitutes variables in its argv[0], so no escaping of `$` is right
    for both."""
    progs = [("paths.deploytool", cfg.paths.deploytool)]
    progs += [(f"backends.{n}.executable", b.executable) if isinstance(b, FtllmBackend)
              else (f"backends.{n}.binary", b.binary) for n, b in sorted(cfg.backends.items())]
    if "\\" in cfg.paths.env_dir:  # EnvironmentFile= reads backslashes as C escapes (measured: systemd 252)
        raise ConfigError(f"paths.env_dir: {_fmt(cfg.paths.env_dir)} contains a backslash, which systemd reads as "
                          f"an escape in EnvironmentFile=", hint="use a directory without a backslash (the "
                          "config's directory too, when paths.env_dir is relative)")
    for key, p in progs:
        e = expand(cfg, p)
        bad = sorted(set(e) & set("$\"'\\"))
        if bad:  # '$': see above; quotes and backslashes: systemd's string_is_safe() refuses them
            raise ConfigError(f"{key}: {_fmt(e)} contains {', '.join(map(repr, bad))}, which systemd refuses in "
                              f"a program path", hint="install the program under a path without them (paths.root "
                              "and the config's directory too)")
        if not e.startswith("/") or e.endswith("/") or "//" in e or posixpath.normpath(e) != e:
            raise ConfigError(f"{key}: {_fmt(e)} is not an absolute, normalized path to a program")


# Free text that never reaches a unit file, an env file or a message line (a chat-template substitution).
_MULTILINE_TEXT = frozenset({"bundle.chat_template.patch.find", "bundle.chat_template.patch.replace"})


def _refuse_unsafe_text(obj: Any, path: str) -> None:
    """Every string of the loaded config (paths as resolved, the config file's own path among them) is free of
    control characters and the like (textsafe.unsafe_char); else a ConfigError naming the key path. A unit file
    line ends at LF and at CR, so such a character in any value could start a directive of its own."""
    if isinstance(obj, str):
        c = unsafe_char(obj)
        if c is not None and path not in _MULTILINE_TEXT:
            raise ConfigError(f"{path}: {_fmt(obj)} contains the control character {describe(c)}",
                              hint="remove it: unit files, env files and messages cannot carry it")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            if f.name not in ("source_sha256", "kind"):
                sub = f"{path}.{f.name}" if path else f.name
                sub = "the config file's own path" if sub == "source_path" else sub
                if f.name == "env" and isinstance(obj, BackendBase):
                    for k, v in obj.env:
                        _refuse_unsafe_text(v, f"{sub}.{k}")
                else:
                    _refuse_unsafe_text(getattr(obj, f.name), sub)
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _refuse_unsafe_text(k, f"{path} key {_fmt(k)}")
            _refuse_unsafe_text(v, f"{path}.{key_part(k)}")
    elif isinstance(obj, tuple):
        for i, v in enumerate(obj):
            _refuse_unsafe_text(v, f"{path}[{i}]")


def _abs(base: Path, p: str | None) -> str | None:
    """Relative paths are taken from the config file's directory; {current}/{venv} placeholders stay."""
    if p is None or p.startswith("{"):
        return p
    try:
        q = Path(p).expanduser()
        return str(q if q.is_absolute() else (base / q).resolve())
    except RuntimeError as exc:  # '~name/...' for a user this machine does not have; a symlink loop
        raise ConfigError(f"{_fmt(p)}: cannot resolve this path ({exc})",
                          hint="write the path out (absolute, or relative to the config file)") from None


def _resolve_paths(cfg: Config, raw: dict[str, Any]) -> Config:
    base = cfg.base_dir
    rp = dataclasses.replace
    paths_raw = raw.get("paths") or {}
    sandbox = _abs(base, cfg.systemd.sandbox)
    paths = cfg.paths
    paths = rp(paths, **{f.name: _abs(base, getattr(paths, f.name)) for f in dataclasses.fields(paths)})
    if "config" not in paths_raw and cfg.source_path:
        paths = rp(paths, config=cfg.source_path)
    if sandbox and "unit_dir" not in paths_raw:
        paths = rp(paths, unit_dir=str(Path(sandbox) / "etc-systemd-system"))
    b = cfg.bundle
    ct = b.chat_template and rp(b.chat_template, source=_abs(base, b.chat_template.source))
    nc = b.nccl and rp(b.nccl, library=_abs(base, b.nccl.library))
    bundle = rp(b, requirements=_abs(base, b.requirements), lock=_abs(base, b.lock),
                wheels_dir=_abs(base, b.wheels_dir), tool_wheels_dir=_abs(base, b.tool_wheels_dir),
                chat_template=ct, nccl=nc)
    backends: dict[str, Backend] = {}
    for name, be in cfg.backends.items():
        upd: dict[str, Any] = {"model": _abs(base, be.model), "model_config": _abs(base, be.model_config)}
        if isinstance(be, FtllmBackend):
            upd["executable"] = _abs(base, be.executable)
            if be.speculative is not None:
                upd["speculative"] = rp(be.speculative, draft_model=_abs(base, be.speculative.draft_model))
        else:
            upd["binary"] = _abs(base, be.binary)
            upd["mmproj"] = _abs(base, be.mmproj)
        backends[name] = rp(be, **upd)
    return rp(cfg, paths=paths, systemd=rp(cfg.systemd, sandbox=sandbox), bundle=bundle,
              backends=types.MappingProxyType(backends))


@dataclass(frozen=True)
class _ConfigRest:
    host: Host = _doc("the machine", default_factory=Host)
    serve: Serve = _doc("what is served", default_factory=Serve)
    paths: Paths = _doc("system paths", default_factory=Paths)
    systemd: SystemdCfg = _doc("how systemd is reached", default_factory=SystemdCfg)
    health: HealthCfg = _doc("the health gate", default_factory=HealthCfg)
    bundle: BundleCfg = _doc("what `pack` bundles", default_factory=BundleCfg)


def parse_yaml(text: str | bytes, *, name: str = "config") -> Any:
    import yaml  # lazy

    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{name}: malformed YAML{where}: {exc.problem or exc}",
                          hint="fix the YAML syntax (indentation, quotes, colons)") from None
    except (yaml.YAMLError, ValueError, RecursionError) as exc:
        raise ConfigError(f"{name}: malformed YAML: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                          hint="fix the YAML syntax") from None


def load(path: str | Path, *, parse_cache: bool = False, refresh: bool = False) -> Config:
    """Read, parse and validate the config file at `path`.

    With `parse_cache` (verify, before every start), the YAML parse comes from the parse cache beside the file
    when that cache is valid for exactly these bytes, and a fresh parse is stored there (see `_ParseCache`);
    `refresh` parses afresh and only writes the cache. Everything else (errors, validation, paths) is the same.
    """
    p = Path(path)
    try:
        with open(p, "rb") as f:
            data = f.read()
            st = os.fstat(f.fileno()) if parse_cache else None
    except FileNotFoundError:
        raise InputError(f"config file not found: {p}",
                         hint="write one with `deploytool init --example cpu-demo` or pass --config PATH") from None
    except IsADirectoryError:
        raise InputError(f"config path is a directory, not a file: {p}") from None
    except OSError as exc:
        raise InputError(f"cannot read config file {p}: {exc.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not UTF-8 text") from None
    cache = _ParseCache(p.resolve(), st, data) if st is not None and stat.S_ISREG(st.st_mode) else None
    hit = cache.get() if cache is not None and not refresh else None
    blob: bytes | None = None
    if hit is not None:
        raw, sha256 = hit
    else:
        import hashlib  # lazy: a cached load needs no hashing

        raw = parse_yaml(text, name=str(p))
        sha256 = hashlib.sha256(data).hexdigest()
        if cache is not None:
            blob = cache.blob(text, raw, sha256)
    cfg = from_dict(raw, source_path=cache.config if cache is not None else str(p.resolve()), source_sha256=sha256)
    if cache is not None and blob is not None:
        cache.put(blob)  # only a document that validated is stored
    return cfg


# --------------------------------------------------------------------------------------------------------------
# The parse cache


PARSE_CACHE_FORMAT = 1
PARSE_CACHE_MAX_BYTES = 4 << 20


def parse_cache_path(config_path: str | os.PathLike[str]) -> Path:
    """Where the parse cache of a config file lives: `.NAME.cache.json` beside the (resolved) file."""
    p = Path(config_path)
    return p.with_name(f".{p.name}.cache.json")


def _stat_key(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _yaml_origin() -> tuple[str, list[int]] | None:
    """The file `import yaml` would load and its stat key, found without importing it (as the import system
    does: the first finder on sys.meta_path that knows the name)."""
    try:
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find("yaml", None) if find is not None else None
            if spec is not None:
                return (spec.origin, _stat_key(os.stat(spec.origin))) if spec.origin else None
    except Exception:  # a finder's failure only costs the cache
        return None
    return None


def _same(a: Any, b: Any, depth: int = 0) -> bool:
    """`a` and `b` are the same document: the same types (bool is not int, int is not float), values, key order."""
    if type(a) is not type(b) or depth > 100:
        return False
    if type(a) is dict:
        return len(a) == len(b) and all(_same(ka, kb, depth + 1) and _same(va, vb, depth + 1)
                                        for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True))
    if type(a) is list:
        return len(a) == len(b) and all(_same(x, y, depth + 1) for x, y in zip(a, b, strict=True))
    if type(a) is float:
        return repr(a) == repr(b)  # -0.0 is not 0.0
    return type(a) in (str, int, bool, type(None)) and a == b


class _ParseCache:
    """The YAML parse of a config file, kept beside it, so verify (run before every start) skips importing and
    running the YAML parser (about 25 ms of its start-up). It replaces nothing but `yaml.safe_load` of the
    same bytes: the document still goes through from_dict (validation, error messages with key paths,
    placeholders, relative paths), and the config file itself is always read.

    Where: `.NAME.cache.json` beside the config file (parse_cache_path), because it is the one place known
    before the config is parsed (the state dir is a setting inside it); it is on the same file system, so the
    rename that writes it is atomic; the config's directory is writable by whoever may edit the config
    (root for /etc/deploytool, where the units' ExecStartPre verify runs as root) and by no one else.

    Why it can be trusted (the same argument as the fingerprint hash cache, fingerprint.py's module doc, plus a
    content check that makes racy timestamps irrelevant):
      * it is used only when the config file's (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns), taken
        with fstat on the descriptor the bytes were just read from, equals the recorded one: any write,
        truncate, chmod/chown or rename over the path changes ctime (which no system call can set) or the
        inode, so an edited config misses, even one given back its old size and mtime;
      * and only when the recorded text is byte for byte the bytes just read: a change in the same timestamp
        tick as the parse that wrote the cache, which the stat key alone could miss, misses here;
      * and only when the recorded parser is the one `import yaml` would load now (same file, same stat key):
        a PyYAML upgrade re-parses;
      * the cache file is opened without following symlinks and used only when it is a regular file owned by
        the config file's owner or by root and not group- or world-writable: only someone who can already
        change the config (or root) can have written it, and it is written only by this code, from
        yaml.safe_load of the recorded text, after that document validated;
      * a document is stored only when it survives JSON exactly (same types, values, key order: no dates,
        binary, non-string keys, NaN or infinities, which JSON would change); a parse error or a document
        that fails validation (a non-mapping top level among them) is never stored;
      * a missing, unreadable, corrupt or foreign cache file is ignored (the YAML is parsed); writing is best
        effort (temp file + rename; an unwritable directory or a read-only file system just means no cache),
        and only by the config's owner or root, with the config file's permission bits minus any write or
        execute bit for group and others, so the cache is readable by no one who cannot read the config.
    `deploytool verify --no-cache` parses afresh (and rewrites the cache).
    """

    def __init__(self, real: Path, st: os.stat_result, data: bytes) -> None:
        self.config = str(real)
        self.path = parse_cache_path(real)
        self.st = st
        self.data = data

    def get(self) -> tuple[dict[str, Any], str] | None:
        """(document, SHA-256 of the config bytes) when the cache is valid for these bytes, else None."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if (not stat.S_ISREG(st.st_mode) or st.st_uid not in (self.st.st_uid, 0) or st.st_mode & 0o022
                    or st.st_size > PARSE_CACHE_MAX_BYTES):
                return None
            import json

            with open(fd, "rb", closefd=False) as f:
                d = json.loads(f.read())
        except (OSError, ValueError, RecursionError):
            return None
        finally:
            os.close(fd)
        try:
            if (not isinstance(d, dict) or d.get("format") != PARSE_CACHE_FORMAT or d.get("config") != self.config
                    or d.get("key") != _stat_key(self.st) or not isinstance(d.get("text"), str)
                    or d["text"].encode("utf-8") != self.data or not isinstance(d.get("document"), dict)
                    or not isinstance(d.get("sha256"), str) or not re.fullmatch(r"[0-9a-f]{64}", d["sha256"])):
                return None
        except UnicodeError:  # a lone surrogate in the recorded text: not these bytes
            return None
        parser = d.get("parser")
        origin = _yaml_origin()
        if not isinstance(parser, dict) or origin is None or [parser.get("origin"), parser.get("key")] != list(origin):
            return None
        return d["document"], d["sha256"]

    def blob(self, text: str, raw: Any, sha256: str) -> bytes | None:
        """The cache file's bytes for a fresh parse, or None when it cannot or may not be stored."""
        if not isinstance(raw, dict) or os.geteuid() not in (self.st.st_uid, 0):
            return None
        import json

        import yaml

        origin = getattr(yaml, "__file__", None)
        try:
            parser = {"yaml": getattr(yaml, "__version__", None), "origin": origin,
                      "key": _stat_key(os.stat(origin)) if origin else None}
            out = json.dumps({"format": PARSE_CACHE_FORMAT, "config": self.config, "key": _stat_key(self.st),
                              "parser": parser, "sha256": sha256, "text": text, "document": raw},
                             allow_nan=False, separators=(",", ":")).encode()
            if not origin or not _same(json.loads(out)["document"], raw):
                return None
        except (OSError, TypeError, ValueError, RecursionError):
            return None
        return out

    def put(self, blob: bytes) -> None:
        """Write the cache file atomically (temp file + rename); best effort, failures only cost speed."""
        if len(blob) > PARSE_CACHE_MAX_BYTES:
            return
        mode = stat.S_IMODE(self.st.st_mode) & 0o644
        tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            try:
                fd = os.open(tmp, flags, mode)
            except FileExistsError:  # left by a crashed run with this pid
                os.unlink(tmp)
                fd = os.open(tmp, flags, mode)
        except OSError:
            return
        try:
            try:
                os.fchmod(fd, mode)
                view = memoryview(blob)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.rename(tmp, self.path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def example_text(name: str) -> str:
    if name not in EXAMPLES:
        close = _close_matches(name, EXAMPLES, n=1)
        raise ConfigError(f"unknown example {name!r} (examples: {', '.join(EXAMPLES)})",
                          hint=f"did you mean {close[0]!r}?" if close else None)
    from importlib import resources  # lazy: 5 ms of startup for `check` and `--version`

    return resources.files("deploy_tool.examples").joinpath(f"{name}.yaml").read_text("utf-8")


def example_companions(name: str) -> dict[str, bytes]:
    """Files that come with an example (requirements.in, a chat template), written beside the config by init."""
    example_text(name)  # validates the name
    from importlib import resources

    d = resources.files("deploy_tool.examples").joinpath(name)
    if not d.is_dir():
        return {}
    return {f.name: f.read_bytes() for f in sorted(d.iterdir(), key=lambda f: f.name)
            if f.is_file() and not f.name.startswith(("_", "."))}


def reference_rows() -> list[tuple[str, str, str, str]]:
    """(key path, type, default, doc) for every setting: the README's config reference and `config-reference`."""
    rows: list[tuple[str, str, str, str]] = []

    def walk(cls: type, prefix: str) -> None:
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            if "doc" not in f.metadata:
                continue
            tp = hints[f.name]
            key = f"{prefix}{f.name}"
            inner = [a for a in get_args(tp) if a is not type(None)] if get_origin(tp) in (Union, types.UnionType) else [tp]
            if f.default is not dataclasses.MISSING:
                default = "null" if f.default is None else repr(f.default)
            elif f.default_factory is not dataclasses.MISSING:
                default = "(see below)" if dataclasses.is_dataclass(inner[0]) else "{}"
            else:
                default = "required"
            rows.append((key, _type_name(tp), default, f.metadata["doc"]))
            if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
                walk(inner[0], key + ".")  # type: ignore[arg-type]

    rows.append(("version", "an integer", "required", "config format version (1)"))
    rows.append(("default_backend", "a string", "required", "the backend install starts"))
    walk(_ConfigRest, "")
    walk(_FtllmRaw, "backends.<name>.  (kind: ftllm) ")
    walk(_LlamacppRaw, "backends.<name>.  (kind: llamacpp) ")
    return rows
