"""The one input: `deploytool.yaml` -> frozen, typed, validated objects.

Validation happens once, here, at load. Every error names the key path, the bad value and the expected form
(`backends.llamacpp-tensor.port: 'abc' is not a valid port (expected an integer 1-65535)`); unknown keys are
errors with a did-you-mean. Past this module only frozen dataclasses travel, never raw dicts.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import ipaddress
import os
import posixpath
import re
import stat
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from deploy_tool import yamlread
from deploy_tool.errors import ConfigError, InputError
from deploy_tool.textsafe import describe, unsafe_char
from deploy_tool.textsafe import key as key_part
from deploy_tool.yamlread import shown as _fmt

CONFIG_VERSION = 1
DEFAULT_CONFIG_PATH = Path("/etc/deploytool/deploytool.yaml")
# node_exporter's textfile collector directory as Debian's and Ubuntu's prometheus-node-exporter package sets it
DEFAULT_METRICS_FILE = "/var/lib/prometheus/node-exporter/deploytool.prom"
BACKEND_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,39}$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
EXAMPLES = ("two-2080ti", "cpu-demo")
# where a release carries the bundled chat template and NCCL (relative to the release, {current})
BUNDLED_TEMPLATE = "templates/chat_template.jinja"
BUNDLED_NCCL = "nccl/libnccl.so.2"
BUNDLED_FTLLM_LAUNCHER = "launch/ftllm_launch.py"  # deploy_tool/box/ftllm_launch.py: ftllm with the API key
BUNDLED_FRONT = "launch/front.py"  # deploy_tool/box/front.py: the public port, held while no backend is ready
BACKEND_HOST = "127.0.0.1"  # the backends' address behind the front
BUNDLED_ENV_LAUNCHER_DIR = "launch/bin"  # deploy_tool/box/env_launch.py per server program: the server with its env

Device = Literal["cuda", "cpu"]
ArchPolicy = Literal["exact", "compatible"]
KvDtypeFtllm = Literal["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp4"]
KvDtypeLlama = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]
SplitMode = Literal["none", "layer", "row", "tensor"]
FlashAttn = Literal["on", "off", "auto"]


# --------------------------------------------------------------------------------------------------------------
# Schema. Field metadata: "doc" (shown by `deploytool config-reference`), "check" (callable value -> error or None),
# "range" (every number: the values it may take and why; a test holds every numeric field to having one)


@dataclass(frozen=True)
class Range:
    """The values a numeric setting may take, and why: what systemd or the server accepts, and what is sane."""

    lo: float
    hi: float
    why: str
    lo_open: bool = False  # lo itself is refused (a fraction must be above 0)

    def admits(self, v: float) -> bool:
        return (self.lo < v if self.lo_open else self.lo <= v) and v <= self.hi

    def text(self, integer: bool) -> str:
        kind = "an integer" if integer else "a number"
        lo, hi = (str(int(x)) if float(x).is_integer() else repr(float(x)) for x in (self.lo, self.hi))
        return f"{kind} above {lo} and at most {hi}" if self.lo_open else f"{kind} from {lo} to {hi}"


def _doc(text: str, check: typing.Callable[[Any], str | None] | None = None, *, rng: Range | None = None,
         **kw: Any) -> Any:
    meta: dict[str, Any] = {"doc": text}
    if check is not None:
        meta["check"] = check
    if rng is not None:
        meta["range"] = rng
    return field(metadata=meta, **kw)


# The ranges, each with its reason (the refusal quotes it).
PORT = Range(1, 65535, "a TCP port")
HOLD_TIMEOUT_S = Range(1, 86400, "seconds a client's request may wait at the front; past a day it is no hold")
GPU_ID = Range(0, 31, "a GPU index as CUDA_VISIBLE_DEVICES and /dev/nvidiaN count them; the NVIDIA driver "
                      "drives at most 32 GPUs per host (NV_MAX_DEVICES)")
VRAM_MIB = Range(256, 1 << 20, "MiB of memory per GPU; 1 TiB is far above the largest GPU made")
START_TIMEOUT_S = Range(1, 86400, "seconds; whole seconds become the unit's TimeoutStartSec= (under 1 renders 0, "
                                  "which systemd takes as no limit at all) and a start that takes a day is stuck")
INTERVAL_S = Range(0.005, 60, "seconds between readiness probes: below 5 ms the wait spins a core, above a minute "
                              "a switch idles")
SMOKE_TIMEOUT_S = Range(1, 3600, "seconds for a completion of a few tokens; after an hour it is hung")
SMOKE_MAX_TOKENS = Range(1, 4096, "tokens of the smoke completion; more only slows the gate")
FRACTION = Range(0, 1, "a fraction", lo_open=True)
DRAFT_TOKENS = Range(1, 64, "ftllm's draft block (N drafts N-1 tokens); 12 already fails to start on the field box")
DRAFT_N_MAX = Range(1, 256, "tokens llama-server drafts per step (its own default is 16)")
TP = Range(1, 32, "GPUs one backend spans; a host has at most 32 (NV_MAX_DEVICES)")
THREADS = Range(1, 4096, "CPU threads; 0 and negative values mean different things to each server (leave the "
                         "key out for the default)")
MAX_BATCH = Range(1, 4096, "requests decoded together")
FAILOVER_WINDOW_S = Range(0, 604800, "seconds during which a failover is not followed by another (0: no limit); a week "
                                     "is the longest a box goes unwatched")
START_LIMIT_BURST = Range(1, 100, "failed starts the unit's StartLimitBurst= allows before it fails for good (1: "
                                  "the first crash already fails over)")
START_LIMIT_INTERVAL_S = Range(1, 86400, "seconds; whole seconds become StartLimitIntervalSec= (0 would turn the "
                                         "limit off, so a crash loop would never end in a failover)")
LIVENESS_INTERVAL_S = Range(1, 3600, "seconds between liveness probes: below a second the probe itself costs a "
                                      "core's percent, above an hour a hang goes unseen")
LIVENESS_TIMEOUT_S = Range(0.1, 600, "seconds a liveness probe waits for an answer; longer than ten minutes is "
                                     "no probe")
LIVENESS_FAILURES = Range(1, 100, "failed probes in a row before the server is restarted")
LIVENESS_RESTARTS = Range(0, 100, "liveness restarts within restart_window_s before it gives up and marks the unit "
                                  "failed (0: the first hang fails the unit at once)")
WINDOW_S = Range(1, 7 * 86400, "seconds (at most a week)")
BUSY_MAX_S = Range(0, 86400, "seconds a server may stay busy without answering a probe (0: no bound; at most a "
                             "day)")
COMPLETION_EVERY_S = Range(0, 86400, "seconds between tiny completions (0: never; at most a day)")
DRAIN_TIMEOUT_S = Range(0, 86400, "seconds a planned stop waits for requests in flight (0: no drain; a request "
                                  "that takes a day is not one to wait for)")
KEEP_RELEASES = Range(1, 1000, "releases kept on the box (at least the current one)")
SEQUENCE = Range(0, (1 << 53) - 1, "a bundle's place in its name's order of releases; up to 2**53-1, which JSON "
                 "carries exactly (a build number, or a UNIX time in seconds)")
CONTEXT = Range(64, 1 << 24, "tokens of KV cache: below 64 no chat fits, above 16777216 no model was trained (a "
                             "digit too many asks for terabytes)")


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


def _metrics_path(v: str) -> str | None:
    if v == "":
        return None  # off
    if v.startswith("{"):
        return "may not use a placeholder (expected a path, or empty for off)"
    return _abs_or_placeholder(v)


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


def _abs_python(v: str) -> str | None:
    if not v.startswith("/") or any(c.isspace() for c in v):
        return "must be an absolute path without white space (the servers' launchers run it from their shebang)"
    return None


def _group(v: str) -> str | None:
    return None if USER_NAME_RE.match(v) else ("is not a group name (letters, digits, '_' and '-', starting with a "
                                               "letter or '_', at most 31 characters)")


def _host(v: str) -> str | None:
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
    """host: the machine's GPUs and memory."""

    gpus: tuple[int, ...] = _doc("the GPUs given to the services, by device minor (/dev/nvidiaN; nvidia-smi's index "
                                 "in PCI order): CUDA_VISIBLE_DEVICES, --device, the nvidia-modprobe nodes and the "
                                 "residency check", rng=GPU_ID, default=(0,))
    compute_capability: str = _doc("compute capability of the GPUs, e.g. '7.5' for Turing (sm_75)",
                                   _cc, default="7.5")
    vram_mib: int = _doc("memory per GPU in MiB (22528 for a modified 2080 Ti 22G)", rng=VRAM_MIB,
                         default=22528)
    gpu_group: str | None = _doc("the group owning the NVIDIA device nodes when they are not world read-writable "
                                 "(e.g. 'video', where the driver is set to NVreg_DeviceFileMode=0660): the cuda "
                                 "units get SupplementaryGroups= with it. `deploytool check` on the box reads the "
                                 "nodes and says when it is needed", _group, default=None)


# IPAddressAllow= (systemd.resource-control(5)): its keywords besides addresses and networks
ALLOW_KEYWORDS = ("localhost", "link-local", "multicast", "any")
# serve.allow's default: the networks a self-hosted box and its clients usually share (RFC 1918, RFC 4193 unique
# local IPv6, link-local); the servers exchange packets with nothing else
PRIVATE_NETWORKS = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7", "link-local")


def _allow(v: tuple[str, ...]) -> str | None:
    for a in v:
        if a in ALLOW_KEYWORDS:
            continue
        try:
            if "%" in a:  # a scoped IPv6 address (fe80::1%eth0): systemd takes none
                raise ValueError(a)
            ipaddress.ip_network(a, strict=False)
        except ValueError:
            return (f"holds {a!r}, which is not an IP address, a network such as 192.168.0.0/16, or one of "
                    f"{', '.join(ALLOW_KEYWORDS)}")
    return None


@dataclass(frozen=True)
class Serve:
    """serve: the one address, port and model name both backends serve."""

    host: str = _doc("address the public port listens on (deploytool-front.socket); the backends bind "
                     "127.0.0.1:serve.internal_port behind it",
                     _host, default="127.0.0.1")
    port: int = _doc("the public TCP port clients use: held open by the front (deploytool-front.socket) through "
                     "every switch, rollback, failover and restart", rng=PORT, default=8082)
    internal_port: int | None = _doc("the port the backends bind on 127.0.0.1 behind the front, unreachable "
                                     "from other machines (default: serve.port + 1)", rng=PORT, default=None)
    hold_timeout_s: float | None = _doc("how long a request may wait at the front while no backend is ready "
                                        "(then 503 with Retry-After); at least the slowest backend's start "
                                        "timeout (default: that plus health.smoke_timeout_s)",
                                        rng=HOLD_TIMEOUT_S, default=None)
    model_name: str = _doc("the model name clients send; both backends answer to it", _argument_value,
                           default="model")
    api_key_file: str | None = _doc("file holding the API key: install copies it into a root-only file that "
                                    "systemd hands each server as a credential (LoadCredential=), never on a "
                                    "command line or in an environment", default=None)
    user: str = _doc("who the services run as: 'dynamic' (DynamicUser=yes, the safest; model files must be "
                     "world-readable) or a user name such as 'root'", _user, default="dynamic")
    allow: tuple[str, ...] = _doc("who else may connect to the public port (the front socket's IPAddressAllow=; "
                                  "IPAddressDeny=any drops the rest; the backends admit localhost only): addresses, "
                                  "networks such as 192.168.0.0/16, "
                                  "or link-local, multicast, any. localhost and serve.host are always allowed; "
                                  "[] means nothing else. Default: the private networks",
                                  _allow, default=PRIVATE_NETWORKS)


@dataclass(frozen=True)
class Paths:
    """paths: where the config, releases, env files, state, keys and units live on the box."""

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
    metrics_file: str | None = _doc("Prometheus metrics in node_exporter's textfile format, rewritten after every "
                                    "install, switch, rollback, recover and failover (`deploytool metrics`); written only "
                                    "when its directory exists (the default is the textfile directory of "
                                    "Debian's prometheus-node-exporter); empty or null: off", _metrics_path,
                                    default=DEFAULT_METRICS_FILE)

    @property
    def releases_dir(self) -> str:
        return self.root.rstrip("/") + "/releases"

    @property
    def current(self) -> str:
        return self.root.rstrip("/") + "/current"


@dataclass(frozen=True)
class SystemdCfg:
    """systemd: how deploytool reaches systemd (the box's own, or a sandbox's)."""

    sandbox: str | None = _doc("a `deploytool sandbox` directory: systemctl, journalctl and the unit dir "
                               "then target that sandboxed systemd instead of the host", default=None)
    systemctl: tuple[str, ...] = _doc("the systemctl command (argv prefix)", default=("systemctl",))
    journalctl: tuple[str, ...] = _doc("the journalctl command (argv prefix)", default=("journalctl",))


@dataclass(frozen=True)
class HealthCfg:
    """health: the gate every start and switch passes."""

    start_timeout_s: float = _doc("how long a backend may take to become ready (a 29 GB load takes minutes)",
                                  rng=START_TIMEOUT_S, default=900.0)
    interval_s: float = _doc("readiness probe interval while waiting (cheap: a refused connection or a /health "
                             "503; the unit is watched through its processes, not polled)", rng=INTERVAL_S,
                             default=0.02)
    smoke_timeout_s: float = _doc("timeout of the smoke chat completion", rng=SMOKE_TIMEOUT_S, default=120.0)
    smoke_max_tokens: int = _doc("max_tokens of the smoke chat completion", rng=SMOKE_MAX_TOKENS, default=16)
    perf_gate_fraction: float | None = _doc("after health, a short bench must reach this fraction of the stored "
                                            "baseline's tokens/s (`deploytool bench --save-baseline`; a figure only "
                                            "below it is measured once more), else the switch rolls back; null: off",
                                            rng=FRACTION, default=None)


@dataclass(frozen=True)
class FailoverCfg:
    """supervision.failover: what happens when the active backend fails for good."""

    enabled: bool = _doc("when the active backend fails for good (its restarts gave up: start_limit_burst starts "
                         "within start_limit_interval_s), systemd runs `deploytool failover` (OnFailure=), which "
                         "switches through the same health gate to the last backend that passed it; false: the "
                         "units carry no OnFailure= and a failed backend stays failed", default=True)
    window_s: float = _doc("at most one failover within this many seconds: a failover of a failover is not "
                           "attempted (both stay stopped, and status says so)", rng=FAILOVER_WINDOW_S,
                           default=3600.0)
    start_limit_burst: int = _doc("starts a backend unit may make within start_limit_interval_s (StartLimitBurst=); "
                                  "Restart=on-failure restarts it until then", rng=START_LIMIT_BURST, default=3)
    start_limit_interval_s: float = _doc("the window of start_limit_burst (StartLimitIntervalSec=)",
                                         rng=START_LIMIT_INTERVAL_S, default=1800.0)


@dataclass(frozen=True)
class LivenessCfg:
    """supervision.liveness: the probe of the active backend between switches (deploytool-liveness.service)."""

    enabled: bool = _doc("probe the active backend and restart it when it hangs; false: the probe's unit is "
                         "installed but stopped and disabled", default=True)
    interval_s: float = _doc("seconds between probes (readiness: llama-server /health, ftllm /v1/models)",
                             rng=LIVENESS_INTERVAL_S, default=10.0)
    timeout_s: float = _doc("a probe that gets no answer within this many seconds has failed", rng=LIVENESS_TIMEOUT_S,
                            default=5.0)
    failures: int = _doc("failed probes in a row (not counting ticks where a request is in flight and the server "
                         "uses CPU: busy is not hung) before the server is killed and systemd restarts it",
                         rng=LIVENESS_FAILURES, default=3)
    busy_max_s: float = _doc("busy (requests in flight, CPU used, no answer to the probe) counts as not hung for "
                             "at most this many seconds in a row; past it the probes count as failed (a GPU server "
                             "whose host thread spins on a hung kernel uses CPU too); 0: no bound", rng=BUSY_MAX_S,
                             default=900.0)
    completion_every_s: float = _doc("seconds between tiny chat completions (1 token) on top of the readiness "
                                     "probe; 0: never", rng=COMPLETION_EVERY_S, default=300.0)
    restarts: int = _doc("liveness restarts within restart_window_s that may not help before it gives up: the "
                         "next hang kills the server for good and leaves its unit failed (OnFailure= runs)",
                         rng=LIVENESS_RESTARTS, default=2)
    restart_window_s: float = _doc("the window the restarts are counted in", rng=WINDOW_S, default=1800.0)


@dataclass(frozen=True)
class SupervisionCfg:
    """supervision: what keeps the box serving between operations (failover, liveness), and how planned stops
    treat requests in flight."""

    failover: FailoverCfg = _doc("failover to the last good backend", default_factory=FailoverCfg)
    liveness: LivenessCfg = _doc("the liveness probe", default_factory=LivenessCfg)
    drain_timeout_s: float = _doc("a planned stop (switch, rollback) first waits this long at most until the "
                                  "backend has no request in flight (`--drain-timeout`, `--no-drain`); 0: no drain",
                                  rng=DRAIN_TIMEOUT_S, default=60.0)
    keep_releases: int = _doc("releases kept on the box: a committed install or switch (and `deploytool releases "
                              "prune`) removes the ones beyond the newest N, never the current, the previous or the "
                              "last one that passed the health gate", rng=KEEP_RELEASES, default=3)


@dataclass(frozen=True)
class TemplatePatch:
    """One find/replace applied to the chat template at pack time."""

    find: str = _doc("text that must occur exactly once in the original template",
                     default="is not none else 'medium' %}")
    replace: str = _doc("its replacement", default="is not none else 'low' %}")


@dataclass(frozen=True)
class ChatTemplate:
    """bundle.chat_template: the template file and its patches."""

    source: str = _doc("the original template file (relative to the config file or absolute)")
    sha256: str | None = _doc("SHA-256 of the original; checked before patching", default=None)
    origin: str | None = _doc("where it came from (recorded in the manifest)", default=None)
    commit: str | None = _doc("the pinned upstream commit (recorded in the manifest)", default=None)
    patch: TemplatePatch | None = _doc("one exact substitution; must match exactly once", default=None)


@dataclass(frozen=True)
class Nccl:
    """bundle.nccl: the NCCL library bundled and preloaded."""

    library: str = _doc("the NCCL library to bundle and LD_PRELOAD (libnccl.so.2)")
    arch_policy: ArchPolicy = _doc("'exact': require a cubin for the GPUs' arch (the write-up's fix); "
                                   "'compatible': also accept same-major lower-minor cubins", default="exact")
    force: bool = _doc("bundle it even though the arch check fails (marked in the manifest)", default=False)


@dataclass(frozen=True)
class BundleCfg:
    """bundle: what pack puts in a bundle."""

    name: str = _doc("bundle name prefix; a box keeps the highest sequence it installed per name", default="deploytool")
    sequence: int | None = _doc("the bundle's sequence, signed in its MANIFEST: a box refuses a bundle of this name "
                                "with a lower sequence than it installed (exit 24). `pack --sequence N` overrides it; "
                                "null: SOURCE_DATE_EPOCH (0 when unset), so `SOURCE_DATE_EPOCH=$(git log -1 "
                                "--format=%ct) deploytool pack` orders the bundles by commit time",
                                rng=SEQUENCE, default=None)
    python: str = _doc("the Python that builds and runs the release venv, and runs the servers' env launchers "
                       "(their shebang)", _abs_python, default="/usr/bin/python3")
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
    """An ftllm backend's speculative decoding."""

    algorithm: Literal["dflash", "mtp", "eagle", "none"] = _doc("ftllm --speculative_algorithm", default="dflash")
    draft_model: str | None = _doc("--speculative_draft_model_path (the DFlash2 draft directory)", default=None)
    num_draft_tokens: int = _doc("--speculative_num_draft_tokens N (drafts N-1 tokens)", rng=DRAFT_TOKENS,
                                 default=8)


@dataclass(frozen=True)
class LlamaSpec:
    """A llama-server backend's speculative decoding."""

    type: str = _doc("--spec-type (draft-mtp uses the GGUF's built-in MTP heads)", _argument_value,
                     default="draft-mtp")
    draft_n_max: int = _doc("--spec-draft-n-max", rng=DRAFT_N_MAX, default=3)


@dataclass(frozen=True)
class BackendBase:
    """What every backend has: name, unit, model, extra arguments."""

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
    """A FastLLM `ftllm server` backend."""

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
    """A llama.cpp `llama-server` backend."""

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
    """The config file's keys every backend has (validated, then made a BackendBase)."""

    kind: Literal["ftllm", "llamacpp"] = _doc("which server: 'ftllm' (FastLLM) or 'llamacpp' (llama-server)")
    model: str = _doc("model directory (ftllm) or GGUF file")
    aliases: tuple[str, ...] = _doc("short names accepted by switch (e.g. 'ftllm')", default=())
    device: Device = _doc("'cuda' (the GPUs) or 'cpu' (ftllm --device cpu -t 1; llama-server on CPU: "
                          "how the demo and the tests run here)", default="cuda")
    threads: int | None = _doc("CPU threads (-t); default 1 on cpu", rng=THREADS, default=None)
    env: Mapping[str, str] = _doc("extra environment (EnvironmentFile syntax is handled for you)",
                                  default_factory=dict)
    extra_args: tuple[str, ...] = _doc("extra arguments appended to the launch line", default=())
    description: str | None = _doc("unit Description=", _unit_text, default=None)
    model_config: str | None = _doc("the model's config.json (capacity math; default <model>/config.json)",
                                    default=None)
    start_timeout_s: float | None = _doc("this backend's own time to become ready (default: "
                                         "health.start_timeout_s)", rng=START_TIMEOUT_S,
                                         default=None)


@dataclass(frozen=True)
class _FtllmRaw(_BackendCommon):
    """The config file's keys of an ftllm backend."""

    executable: str = _doc("the ftllm console script", _abs_or_placeholder, default="{venv}/bin/ftllm")
    tp: int = _doc("--tp tensor parallel degree", rng=TP, default=1)
    max_batch: int | None = _doc("--max_batch", rng=MAX_BATCH, default=None)
    tokens: int | None = _doc("--tokens: KV cache token budget (context)", rng=CONTEXT, default=None)
    gpu_mem_ratio: float | None = _doc("--gpu_mem_ratio (0.95 is the known-good value)", rng=FRACTION,
                                        default=None)
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
    """The config file's keys of a llamacpp backend."""

    binary: str = _doc("the llama-server binary", _abs_or_placeholder, default="/usr/local/bin/llama-server")
    build: str | None = _doc("the llama.cpp build the settings were proven on (e.g. b10064)", default=None)
    mmproj: str | None = _doc("--mmproj GGUF (vision)", default=None)
    split_mode: SplitMode | None = _doc("-sm (row was removed upstream; use tensor)", default=None)
    ctx_size: int | None = _doc("-c context size (required with -sm tensor: it ignores --fit)", rng=CONTEXT,
                                default=None)
    flash_attn: FlashAttn | None = _doc("-fa", default=None)
    cache_type_k: KvDtypeLlama | None = _doc("-ctk (leave unset for f16 main KV: best MTP acceptance)",
                                             default=None)
    cache_type_v: KvDtypeLlama | None = _doc("-ctv", default=None)
    spec: LlamaSpec | None = _doc("speculative decoding with the built-in MTP heads", default=None)


@dataclass(frozen=True)
class Config:
    """The whole config, validated (load() and from_dict() make one)."""

    version: int = _doc("config format version (1)")
    default_backend: str = _doc("the backend install starts")
    backends: Mapping[str, Backend] = _doc("the backends, by name (unit name = <name>.service)")
    host: Host = _doc("the machine", default_factory=Host)
    serve: Serve = _doc("what is served", default_factory=Serve)
    paths: Paths = _doc("system paths (point them at a sandbox to rehearse)", default_factory=Paths)
    systemd: SystemdCfg = _doc("how systemd is reached", default_factory=SystemdCfg)
    health: HealthCfg = _doc("the health gate", default_factory=HealthCfg)
    bundle: BundleCfg = _doc("what `pack` bundles", default_factory=BundleCfg)
    supervision: SupervisionCfg = _doc("what keeps the box serving between operations: failover, liveness, drain",
                                       default_factory=SupervisionCfg)
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

    @property
    def backend_host(self) -> str:
        """Where the backends listen, behind the front: loopback, whatever serve.host is."""
        return BACKEND_HOST

    @property
    def backend_port(self) -> int:
        if self.serve.internal_port is not None:
            return self.serve.internal_port
        return self.serve.port + 1 if self.serve.port < 65535 else self.serve.port - 1

    @property
    def slowest_start_s(self) -> float:
        return max(float(b.start_timeout_s or self.health.start_timeout_s) for b in self.backends.values())

    @property
    def hold_timeout_s(self) -> float:
        """serve.hold_timeout_s, or the slowest start plus the smoke completion: a switch's whole wait."""
        h = self.serve.hold_timeout_s
        return float(h) if h is not None else self.slowest_start_s + float(self.health.smoke_timeout_s)


_RAW_TOP = {"version", "default_backend", "backends", "host", "serve", "paths", "systemd", "health", "bundle",
            "supervision"}


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
    close = did_you_mean(name, backend_names(cfg))
    raise ConfigError(f"unknown backend {name!r} in {cfg.source_path or 'the config'}",
                      hint=(f"did you mean {close!r}? " if close else "") + f"the backends are: {choices}")


def backend_names(cfg: Config) -> list[str]:
    """Every name a backend answers to: its name and its aliases (what completion offers)."""
    return sorted({*cfg.backends, *(a for b in cfg.backends.values() for a in b.aliases)})


def did_you_mean(word: str, names: list[str] | tuple[str, ...]) -> str | None:
    """The one name `word` most likely meant: a close spelling (difflib), else the single name containing it."""
    close = _close_matches(word, list(names), n=1, cutoff=0.6)
    if close:
        return close[0]
    holding = [n for n in names if word and word.lower() in n.lower()]
    if len(holding) == 1:
        return holding[0]
    close = _close_matches(word, list(names), n=1, cutoff=0.4)
    return close[0] if close else None


# --------------------------------------------------------------------------------------------------------------
# Generic loader


def _close_matches(word: str, possibilities: list[str] | tuple[str, ...], n: int = 1,
                   cutoff: float = 0.6) -> list[str]:
    return difflib.get_close_matches(word, possibilities, n=n, cutoff=cutoff)


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
        if not isinstance(value, str) or value not in allowed:
            close = _close_matches(value, [str(a) for a in allowed], n=1) if isinstance(value, str) else None
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
            raise ConfigError(f"{path}: {_fmt(value)} is not an integer",
                              hint=_NUMBER_HINT if isinstance(value, str) else None)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: {_fmt(value)} is not a number",
                              hint=_NUMBER_HINT if isinstance(value, str) else None)
        try:
            f = float(value)
        except OverflowError:  # an integer beyond any float
            f = float("inf")
        if f != f or f in (float("inf"), float("-inf")):
            raise ConfigError(f"{path}: {_fmt(value)} is not a finite number")
        return f
    if tp is str:
        if isinstance(value, bool | float) or not isinstance(value, str | int):
            raise ConfigError(f"{path}: {_fmt(value)} is not a string",
                              hint="quote it if you mean the text" if isinstance(value, bool | float) else None)
        if isinstance(value, int) and value.bit_length() > 256:
            raise ConfigError(f"{path}: {_fmt(value)} is not a string (and too long to be one)")
        s = str(value)
        if "\x00" in s:
            raise ConfigError(f"{path}: contains a NUL byte")
        if any("\ud800" <= c <= "\udfff" for c in s):  # YAML's "\ud800": no file name or UTF-8 file holds it
            raise ConfigError(f"{path}: {_fmt(s)} is not valid Unicode text (it holds a lone surrogate)")
        return s
    raise AssertionError(f"unsupported schema type {tp!r}")


_NUMBER_HINT = "write numbers in plain decimal (8082, 0.95, 900); yes/no, 0x1F, 1e3 and 1_000 are not numbers here"


def _check_range(rng: Range, val: Any, path: str, tp: Any) -> None:
    """Every number within its range; a list of numbers (host.gpus) item by item, each listed once."""
    integer = int in (get_args(tp) or (tp,))  # int, int | None, tuple[int, ...]
    items = list(enumerate(val)) if isinstance(val, tuple) else [(None, val)]
    seen: dict[Any, int] = {}
    for i, v in items:
        where = path if i is None else f"{path}[{i}]"
        if not rng.admits(v):
            raise ConfigError(f"{where}: {_fmt(v)} is out of range (expected {rng.text(integer)}: {rng.why})")
        if i is not None:
            if v in seen:
                raise ConfigError(f"{where}: {v} is listed twice (also {path}[{seen[v]}])", hint="list each once")
            seen[v] = i


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
        rng = f.metadata.get("range")
        if rng is not None and val is not None:
            _check_range(rng, val, sub, hints[f.name])
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
    if type(raw["version"]) is not int or raw["version"] != CONFIG_VERSION:
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
                 health=parts.health, bundle=parts.bundle, supervision=parts.supervision, source_path=source_path,
                 source_sha256=source_sha256)
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
    for both. Then the directories the failover and liveness units write (ReadWritePaths=): no quote or backslash."""
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
    rw = [("paths.state_dir", cfg.paths.state_dir), ("paths.unit_dir", cfg.paths.unit_dir)]
    if cfg.paths.metrics_file:  # its directory: the failover unit's too
        rw.append(("paths.metrics_file", posixpath.dirname(cfg.paths.metrics_file)))
        if posixpath.dirname(cfg.paths.metrics_file) == "/":
            raise ConfigError(f"paths.metrics_file: {_fmt(cfg.paths.metrics_file)} lies in /, which the failover unit "
                              "would then be allowed to write whole (ReadWritePaths=)",
                              hint="give the metrics file a directory of its own (e.g. node_exporter's)")
    for key, d in rw:
        bad = sorted(set(d) & set("\"'\\"))
        if bad:  # the failover and liveness units' ReadWritePaths= unquote words and read escapes
            raise ConfigError(f"{key}: {_fmt(d)} contains {', '.join(map(repr, bad))}, which ReadWritePaths= would "
                              f"read as quoting", hint="use a directory without quotes or backslashes (the "
                              "config's directory too, when the path is relative)")


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


def _abs(base: Path, p: str | None, key: str = "") -> str | None:
    """Relative paths are taken from the config file's directory; {current}/{venv} placeholders stay. `key`: the
    config key the path came from, named in the error."""
    if p is None or p.startswith("{"):
        return p
    try:
        q = Path(p).expanduser()
        return str(q if q.is_absolute() else (base / q).resolve())
    except RuntimeError as exc:  # '~name/...' for a user this machine does not have; a symlink loop
        raise ConfigError(f"{key + ': ' if key else ''}{_fmt(p)}: cannot resolve this path ({exc})",
                          hint="write the path out (absolute, or relative to the config file)") from None


def _resolve_paths(cfg: Config, raw: dict[str, Any]) -> Config:
    base = cfg.base_dir
    rp = dataclasses.replace
    paths_raw = raw.get("paths") or {}
    sandbox = _abs(base, cfg.systemd.sandbox, "systemd.sandbox")
    paths = cfg.paths
    paths = rp(paths, **{f.name: _abs(base, getattr(paths, f.name), f"paths.{f.name}") for f in dataclasses.fields(paths)
                         if getattr(paths, f.name) != ""})
    if paths.metrics_file == "":  # off
        paths = rp(paths, metrics_file=None)
    if "config" not in paths_raw and cfg.source_path:
        paths = rp(paths, config=cfg.source_path)
    if sandbox and "unit_dir" not in paths_raw:
        paths = rp(paths, unit_dir=str(Path(sandbox) / "etc-systemd-system"))
    b = cfg.bundle
    ct = b.chat_template and rp(b.chat_template, source=_abs(base, b.chat_template.source, "bundle.chat_template.source"))
    nc = b.nccl and rp(b.nccl, library=_abs(base, b.nccl.library, "bundle.nccl.library"))
    bundle = rp(b, requirements=_abs(base, b.requirements, "bundle.requirements"), lock=_abs(base, b.lock, "bundle.lock"),
                wheels_dir=_abs(base, b.wheels_dir, "bundle.wheels_dir"),
                tool_wheels_dir=_abs(base, b.tool_wheels_dir, "bundle.tool_wheels_dir"),
                chat_template=ct, nccl=nc)
    backends: dict[str, Backend] = {}
    for name, be in cfg.backends.items():
        k = f"backends.{name}"
        upd: dict[str, Any] = {"model": _abs(base, be.model, f"{k}.model"),
                               "model_config": _abs(base, be.model_config, f"{k}.model_config")}
        if isinstance(be, FtllmBackend):
            upd["executable"] = _abs(base, be.executable, f"{k}.executable")
            if be.speculative is not None:
                upd["speculative"] = rp(be.speculative, draft_model=_abs(base, be.speculative.draft_model,
                                                                          f"{k}.speculative.draft_model"))
        else:
            upd["binary"] = _abs(base, be.binary, f"{k}.binary")
            upd["mmproj"] = _abs(base, be.mmproj, f"{k}.mmproj")
        backends[name] = rp(be, **upd)
    return rp(cfg, paths=paths, systemd=rp(cfg.systemd, sandbox=sandbox), bundle=bundle,
              backends=types.MappingProxyType(backends))


@dataclass(frozen=True)
class _ConfigRest:
    """The config file's top-level sections besides backends."""

    host: Host = _doc("the machine", default_factory=Host)
    serve: Serve = _doc("what is served", default_factory=Serve)
    paths: Paths = _doc("system paths", default_factory=Paths)
    systemd: SystemdCfg = _doc("how systemd is reached", default_factory=SystemdCfg)
    health: HealthCfg = _doc("the health gate", default_factory=HealthCfg)
    bundle: BundleCfg = _doc("what `pack` bundles", default_factory=BundleCfg)
    supervision: SupervisionCfg = _doc("what keeps the box serving between operations: failover, liveness, drain",
                                       default_factory=SupervisionCfg)


# --------------------------------------------------------------------------------------------------------------
# Reading and parsing: bounded in size here; in nesting, number length, no anchors, aliases, tags or duplicate keys
# by deploy_tool/yamlread.py


MAX_CONFIG_BYTES = 1 << 20  # a real config is a few KB; this bounds the parse to well under a second


def _too_big(p: Path, size: int | None) -> ConfigError:
    got = f"is {size} bytes" if size is not None else "holds more than that"
    return ConfigError(f"{p}: a config file may be at most {MAX_CONFIG_BYTES} bytes (1 MiB); this one {got}",
                       hint="a deploytool config is a few KB: check that --config names the config, not a model, an "
                            "archive or a log")


def _read(p: Path) -> bytes:
    """The file's bytes, at most MAX_CONFIG_BYTES (a FIFO or a device is read up to the limit, never without end)."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO without a writer must not block open
    except FileNotFoundError:
        raise InputError(f"config file not found: {p}",
                         hint="write one with `deploytool init --example cpu-demo` or pass --config PATH") from None
    except OSError as exc:
        raise InputError(f"cannot read config file {p}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise InputError(f"config path is a directory, not a file: {p}")
        if stat.S_ISREG(st.st_mode) and st.st_size > MAX_CONFIG_BYTES:
            raise _too_big(p, st.st_size)
        os.set_blocking(fd, True)
        chunks: list[bytes] = []
        n = 0
        while n <= MAX_CONFIG_BYTES:
            b = os.read(fd, MAX_CONFIG_BYTES + 1 - n)
            if not b:
                break
            chunks.append(b)
            n += len(b)
        if n > MAX_CONFIG_BYTES:
            raise _too_big(p, None if not stat.S_ISREG(st.st_mode) else n)
        return b"".join(chunks)
    except OSError as exc:
        raise InputError(f"cannot read config file {p}: {exc.strerror}") from None
    finally:
        os.close(fd)


def load(path: str | Path) -> Config:
    """Read (at most MAX_CONFIG_BYTES), parse (yamlread.read) and validate (from_dict) the config file at `path`."""
    p = Path(path)
    data = _read(p)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"{p}: not UTF-8 text (line {line}, byte {exc.start})", hint="save the file as UTF-8") from None
    places: dict[str, tuple[int, int]] = {}
    try:
        raw = yamlread.read(text, source=str(p), places=places)
        return from_dict(raw, source_path=str(p.resolve()), source_sha256=hashlib.sha256(data).hexdigest())
    except ConfigError as exc:
        raise yamlread.place(exc, str(p), places, text) from None


def from_resolved(doc: Any, *, source_path: str | None = None) -> Config:
    """The Config a bundle's config.json holds (deploy_tool.render.resolved_config_json: every field as loaded,
    defaults filled in, paths resolved), rebuilt field by field from the classes' own types: the inverse of that
    file, not a second parse of YAML (it was validated when it was packed; an installed release's copy is signed
    and pinned with the release). ValueError when `doc` does not have that shape (a file of another version)."""
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    try:
        cfg = _rebuilt(Config, {k: v for k, v in doc.items() if k != "source_path"})
    except (KeyError, TypeError, ValueError, AttributeError, StopIteration) as exc:
        raise ValueError(f"not a resolved deploytool config: {type(exc).__name__}: {exc}") from None
    return dataclasses.replace(cfg, source_path=source_path)


def _rebuilt(tp: Any, v: Any) -> Any:
    origin, args = get_origin(tp), get_args(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(v, dict):
            raise TypeError(f"{tp.__name__}: {type(v).__name__}, not an object")
        hints = _hints(tp)
        return tp(**{f.name: _rebuilt(hints[f.name], v[f.name]) for f in dataclasses.fields(tp)
                     if f.init and f.name in v})
    if origin in (Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        kinds = [a for a in args if a is not type(None)]
        if len(kinds) > 1 and all(dataclasses.is_dataclass(a) for a in kinds):  # a backend: by its kind
            return _rebuilt(FtllmBackend if v["kind"] == "ftllm" else LlamacppBackend, v)
        return _rebuilt(kinds[0], v) if len(kinds) == 1 else v
    if origin is tuple:
        if not isinstance(v, list):
            raise TypeError(f"{type(v).__name__}, not a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_rebuilt(args[0], x) for x in v)
        return tuple(_rebuilt(a, x) for a, x in zip(args, v, strict=True))
    if origin in (dict, Mapping):
        if not isinstance(v, dict):
            raise TypeError(f"{type(v).__name__}, not an object")
        return types.MappingProxyType({k: _rebuilt(args[1], x) for k, x in v.items()})
    return v


def example_text(name: str) -> str:
    if name not in EXAMPLES:
        close = did_you_mean(name, EXAMPLES)
        raise ConfigError(f"unknown example {name!r} (examples: {', '.join(EXAMPLES)})",
                          hint=f"did you mean {close!r}?" if close else None)
    return resources.files("deploy_tool.examples").joinpath(f"{name}.yaml").read_text("utf-8")


def example_companions(name: str) -> dict[str, bytes]:
    """Files that come with an example (requirements.in, a chat template), written beside the config by init."""
    example_text(name)  # validates the name

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
            kind = _type_name(tp)
            rng = f.metadata.get("range")
            if rng is not None:  # "an integer from 1 to 65535 (or null)", "a list of an integer from 0 to 31"
                kind = kind.replace("an integer" if int in (get_args(tp) or (tp,)) else "a number",
                                    rng.text(int in (get_args(tp) or (tp,))), 1)
            rows.append((key, kind, default, f.metadata["doc"] + (f" (range: {rng.why})" if rng is not None else "")))
            if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
                walk(inner[0], key + ".")  # type: ignore[arg-type]

    rows.append(("version", "an integer", "required", "config format version (1)"))
    rows.append(("default_backend", "a string", "required", "the backend install starts"))
    walk(_ConfigRest, "")
    walk(_FtllmRaw, "backends.<name>.  (kind: ftllm) ")
    walk(_LlamacppRaw, "backends.<name>.  (kind: llamacpp) ")
    return rows
