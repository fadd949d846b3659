"""Config -> unit files and env files, through strict Jinja2 templates, and the resolved config a bundle
carries (config.json). Pure: no I/O but reading templates.

jinja2 is imported when a template is rendered: the ExecStartPre verify imports this module for its paths and
placeholders, renders nothing, and must not depend on jinja2.

The launch lines are built here as argv lists (one option beside its value), then quoted for systemd's
ExecStart= syntax; environment values are quoted for EnvironmentFile= syntax. Output is deterministic: the
same config gives the same bytes.

The API key (serve.api_key_file) never appears on a command line or in an environment, where any local user
could read it (/proc/PID/cmdline; ProtectProc= hides a service's /proc only from other services' users): install
copies it into a root-only file ({env_dir}/api-key), the unit hands it to the server as a systemd credential
(LoadCredential=api-key:..., readable by the service alone under /run/credentials/UNIT/), llama-server reads it
with `--api-key-file %d/api-key`, and ftllm (which only takes `--api_key KEY`) starts through the release's
launcher (deploy_tool/box/ftllm_launch.py), which reads the credential and hands ftllm the key in memory.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import deploy_tool.templates as tpl_pkg
from deploy_tool import __version__
from deploy_tool.config import (
    ALLOW_KEYWORDS,
    BACKEND_NAME_RE,
    BUNDLED_ENV_LAUNCHER_DIR,
    BUNDLED_FRONT,
    BUNDLED_FTLLM_LAUNCHER,
    BUNDLED_NCCL,
    BUNDLED_TEMPLATE,
    ENV_NAME_RE,
    USER_NAME_RE,
    Backend,
    Config,
    FtllmBackend,
    LlamacppBackend,
    expand,
)
from deploy_tool.errors import ConfigError
from deploy_tool.textsafe import describe, q, unsafe_char

_SAFE_ARG = re.compile(r"^[A-Za-z0-9_./:=,+@-]+$")
API_KEY_FILE = "api-key"  # the root-only copy of the key in paths.env_dir, and the credential's name
LEGACY_SECRETS_ENV = "secrets.env"  # where older deploytools kept the key (as environment); install removes it
FAILOVER_TEMPLATE = "deploytool-failover@.service"  # the template unit each backend's OnFailure= starts

#: Where the NVIDIA driver installs nvidia-modprobe (Debian/Ubuntu, NVIDIA's own packages); a cuda unit's
#: ExecStartPre runs it ("-": skipped on a host without it; `deploytool check` reports nvidia-modprobe-missing).
NVIDIA_MODPROBE = "/usr/bin/nvidia-modprobe"
#: The NVIDIA driver's device classes as /proc/devices names them (major 195 is "nvidia-frontend" in older drivers,
#: "nvidia"/"nvidiactl" in newer ones; nvidia-uvm and nvidia-caps get dynamic majors when their module loads).
NVIDIA_DEVICE_CLASSES = ("char-nvidia-frontend", "char-nvidia", "char-nvidiactl", "char-nvidia-uvm",
                         "char-nvidia-caps")
#: The ordering a cuda unit gets: nvidia-persistenced keeps the driver initialised and creates the nodes at boot.
NVIDIA_PERSISTENCED = "nvidia-persistenced.service"
#: nvidia-modprobe's minor of /dev/nvidiactl (`-c=255` makes it; NVIDIA's driver README, "Device files")
NVIDIACTL_MINOR = 255
#: The credential (LoadCredential=) that carries a backend's env file to its launcher (deploy_tool/box/env_launch.py);
#: `deploytool verify` checks that copy (box/fingerprint.py ENV_CREDENTIAL, the same name)
ENV_CREDENTIAL = "environment"
#: Variables no root step of a unit may run with (UnsetEnvironment=, applied to every command of the unit, after
#: every Environment= of a drop-in too): the dynamic loader's and Python's ways to run code before any check. The
#: server's own environment (its LD_PRELOAD of the bundled NCCL included) comes from its env file, through the
#: launcher, which sets it after this.
UNSAFE_ENV = ("LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "LD_DEBUG_OUTPUT", "LD_PROFILE", "GCONV_PATH",
              "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "PYTHONINSPECT", "PYTHONEXECUTABLE")


@dataclass(frozen=True)
class RenderedFile:
    name: str  # file name, e.g. "ftllm-dflash.service"
    kind: str  # "unit" | "env"
    content: str
    mode: int


class Escaped(str):
    """Text already validated and escaped for the one place in a unit or env file it is rendered into. The
    templates output nothing else (and integers): `_finalize` refuses a plain string, so no config value can
    reach a unit file without passing one of the escaping functions below."""


@dataclass(frozen=True)
class Credential:
    """An ExecStart= argument systemd replaces with the path of one of the unit's credentials (`%d/NAME`: %d is
    $CREDENTIALS_DIRECTORY, /run/credentials/UNIT)."""

    name: str


Arg = str | Credential


# ------------------------------------------------------------------------------------------------------------
# One escaping function per target syntax. Each takes the key path the value came from, refuses what the
# syntax cannot carry (ConfigError naming that key) and returns Escaped text. config.py refuses all of it at
# load already; these are the last line, and what the templates are allowed to print.


def _refuse(key: str, value: str, why: str) -> ConfigError:
    return ConfigError(f"{key}: {q(value)} {why}", hint="fix the value in the config")


def _clean(value: str, key: str) -> str:
    c = unsafe_char(value)
    if c is not None:
        raise _refuse(key, value, f"contains the control character {describe(c)}, which a unit or env file "
                                  f"cannot carry")
    return value


def _specifiers(text: str) -> str:
    """systemd.unit(5) "Specifiers": `%` starts one; `%%` is a literal percent sign."""
    return text.replace("%", "%%")


def unit_text(value: str, key: str) -> Escaped:
    """Free text as the whole value of a unit line (Description=, comments). systemd.syntax(7): the line ends at
    LF or CR, white space around the value is dropped, a trailing backslash joins the next line; the value
    then goes through specifier expansion (no quotes, no C escapes)."""
    _clean(value, key)
    if value != value.strip(" "):
        raise _refuse(key, value, "begins or ends with a space, which systemd would drop")
    if value.endswith("\\"):
        raise _refuse(key, value, "ends with a backslash, which systemd reads as a line continuation")
    return Escaped(_specifiers(value))


def _abs_path(value: str, key: str) -> str:
    """An absolute, normalized path as systemd accepts it (path_is_normalized: no '.', '..' or '//')."""
    _clean(value, key)
    if not value.startswith("/") or (value != "/" and (posixpath.normpath(value) != value or "//" in value)):
        raise _refuse(key, value, "is not an absolute, normalized path")
    return value


def unit_path(value: str, key: str) -> Escaped:
    """An absolute path as the whole value of a unit line (EnvironmentFile=): specifiers escaped, the value
    taken without quotes; systemd 252 reads backslashes in EnvironmentFile= as C escapes (measured in the
    sandbox: `a\\b` names `a<BS>b`), so a path with a backslash is refused."""
    if "\\" in value:
        raise _refuse(key, value, "contains a backslash, which systemd reads as an escape in this setting")
    return unit_text(_abs_path(value, key), key)


def unit_name(name: str) -> Escaped:
    """A unit name made of a backend name (Conflicts=, comments)."""
    if not BACKEND_NAME_RE.match(name):
        raise _refuse("backends", name, "is not a valid backend name")
    return Escaped(f"{name}.service")


def file_url(path: str, key: str) -> Escaped:
    """Documentation=file:PATH. The value is a list of URLs split at white space, each of them ASCII: the path
    is percent-encoded (RFC 3986), then specifier-escaped (%20 -> %%20)."""
    return Escaped("file:" + _specifiers(quote(_abs_path(path, key), safe="/")))


def user_name(value: str, key: str) -> Escaped:
    """User=: a plain user name (no specifiers, no quoting needed)."""
    if not USER_NAME_RE.match(value):
        raise _refuse(key, value, "is not a user name")
    return Escaped(value)


def ip_allow(cfg: Config) -> Escaped:
    """IPAddressAllow=: localhost, serve.host when it names one address (not a wildcard), then serve.allow, each
    address or network in the canonical form Python's ipaddress gives it (which systemd parses alike)."""
    import ipaddress  # lazy: see the module's docstring

    out = ["localhost"]
    try:
        host = ipaddress.ip_address(cfg.serve.host)
    except ValueError:
        host = None  # a host name: resolved by the server at start, not known here
    if host is not None and not host.is_unspecified and not host.is_loopback:
        out.append(str(host))
    for i, a in enumerate(cfg.serve.allow):
        try:
            word = (a if a in ALLOW_KEYWORDS else str(ipaddress.ip_network(a, strict=False)) if "/" in a
                    else str(ipaddress.ip_address(a)))
        except ValueError:
            raise _refuse(f"serve.allow[{i}]", a, "is not an IP address, a network or one of "
                          + ", ".join(ALLOW_KEYWORDS)) from None
        if word not in out:
            out.append(word)
    return Escaped(" ".join(out))


def systemd_quote(arg: Arg, key: str = "argument") -> str:
    """One word of an ExecStart= command line (systemd.service(5) "Command lines"): `%` and `$` doubled (no
    specifier, no variable), then, unless the word is plain, double-quoted with backslash and double quote
    C-escaped. A Credential becomes `%d/NAME`, which systemd replaces with the path of the unit's credential."""
    if isinstance(arg, Credential):
        if not re.fullmatch(r"[a-z][a-z0-9-]*", arg.name):
            raise _refuse(key, arg.name, "is not a credential name")
        return "%d/" + arg.name
    esc = _clean(arg, key).replace("%", "%%").replace("$", "$$")
    if _SAFE_ARG.match(arg):
        return esc
    return '"' + esc.replace("\\", "\\\\").replace('"', '\\"') + '"'


def exec_line(argv: list[Arg], key: str) -> Escaped:
    """A whole ExecStart= command line: an absolute, normalized executable path, then the arguments."""
    exe = argv[0]
    if isinstance(exe, Credential):
        raise _refuse(key, exe.name, "cannot be the executable")
    _abs_path(exe, key)
    return Escaped(" ".join(systemd_quote(a, key) for a in argv))


def env_quote(name: str, value: str, key: str | None = None) -> Escaped:
    """One `NAME="value"` line in EnvironmentFile= syntax (systemd.exec(5), no `export`): inside double quotes
    a backslash escapes exactly `"`, `\\`, `` ` `` and `$`; everything else but control characters is taken
    as it is."""
    key = key or f"environment variable {name}"
    if not ENV_NAME_RE.match(name):
        raise _refuse(key, name, "is not an environment variable name")
    esc = "".join("\\" + c if c in '"\\`$' else c for c in _clean(value, key))
    return Escaped(f'{name}="{esc}"')


def ftllm_launcher_argv(cfg: Config, b: FtllmBackend) -> list[Arg]:
    """What runs ftllm when the box has an API key: the Python beside the ftllm console script (its venv's) on
    the release's launcher, which reads the key from the unit's credential, appends `--api_key KEY` to ftllm's
    argv in memory and runs the console script in the same process (see deploy_tool/box/ftllm_launch.py)."""
    exe = expand(cfg, b.executable)
    return [posixpath.join(posixpath.dirname(exe), "python"), f"{cfg.paths.current}/{BUNDLED_FTLLM_LAUNCHER}",
            Credential(API_KEY_FILE), exe]


def tool_argv(cfg: Config, *args: Arg) -> list[Arg]:
    """`deploytool ARGS` as a unit's root step runs it: the release's own deploytool, whose console script runs
    its interpreter with -I (written so by the bootstrap installer: no PYTHON* variables, no user site)."""
    return [expand(cfg, cfg.paths.deploytool), "--config", cfg.paths.config, *args]


def launcher_name(b: Backend) -> str:
    """The file name of a backend's env launcher: its server program's (`llama-server`, `ftllm`), so that systemd,
    which names a command's journal lines after the program it runs, tags the server's lines as before."""
    return posixpath.basename(b.executable if isinstance(b, FtllmBackend) else b.binary)


def launcher_path(cfg: Config, b: Backend) -> str:
    return f"{cfg.paths.current}/{BUNDLED_ENV_LAUNCHER_DIR}/{launcher_name(b)}"


def env_launcher_argv(cfg: Config, b: Backend) -> list[Arg]:
    """What heads every backend's ExecStart=: the launcher that reads the unit's env-file credential and execs the
    server with it (deploy_tool/box/env_launch.py, packed as launch/bin/NAME with a `python -I -S` shebang)."""
    return [launcher_path(cfg, b), Credential(ENV_CREDENTIAL)]


def launcher_script(cfg: Config, source: bytes) -> bytes:
    """A backend's launcher file in the bundle (one per server program name, the same bytes): env_launch.py's
    source under a shebang that runs the box's Python (bundle.python) isolated and without site (-I -S: the
    launcher needs the standard library alone)."""
    return f"#!{cfg.bundle.python} -IS\n".encode() + source


def ftllm_argv(cfg: Config, b: FtllmBackend) -> list[Arg]:
    head = ftllm_launcher_argv(cfg, b) if cfg.serve.api_key_file else [expand(cfg, b.executable)]
    argv: list[Arg] = [*head, "server", "-p", b.model, "--model_name", cfg.serve.model_name]
    if b.device == "cpu":
        argv += ["--device", "cpu"]
    if b.threads is not None:
        argv += ["-t", str(b.threads)]
    if b.tp > 1:
        argv += ["--tp", str(b.tp)]
    if b.max_batch is not None:
        argv += ["--max_batch", str(b.max_batch)]
    if b.tokens is not None:
        argv += ["--tokens", str(b.tokens)]
    if b.gpu_mem_ratio is not None:
        argv += ["--gpu_mem_ratio", f"{b.gpu_mem_ratio:g}"]
    if b.kv_cache_dtype is not None:
        argv += ["--kv_cache_dtype", b.kv_cache_dtype]
    if b.cuda_embedding:
        argv += ["--cuda_embedding"]
    sp = b.speculative
    if sp is not None and sp.algorithm != "none":
        argv += ["--speculative_algorithm", sp.algorithm]
        if sp.draft_model:
            argv += ["--speculative_draft_model_path", sp.draft_model]
        argv += ["--speculative_num_draft_tokens", str(sp.num_draft_tokens)]
    if b.prefix_cache is not None:
        argv += ["--prefix_cache", "true" if b.prefix_cache else "false"]
    if b.think is not None:
        argv += ["--think", "true" if b.think else "false"]
    if b.use_bundle_chat_template:
        argv += ["--chat_template", f"{cfg.paths.current}/{BUNDLED_TEMPLATE}"]
    argv += ["--host", cfg.backend_host, "--port", str(cfg.backend_port)]
    return argv + list(b.extra_args)


def llamacpp_argv(cfg: Config, b: LlamacppBackend) -> list[Arg]:
    argv: list[Arg] = [expand(cfg, b.binary), "-m", b.model, "--alias", cfg.serve.model_name]
    if b.split_mode is not None:
        argv += ["-sm", b.split_mode]
    if b.flash_attn is not None:
        argv += ["-fa", b.flash_attn]
    if b.ctx_size is not None:
        argv += ["-c", str(b.ctx_size)]
    if b.cache_type_k is not None:
        argv += ["-ctk", b.cache_type_k]
    if b.cache_type_v is not None:
        argv += ["-ctv", b.cache_type_v]
    if b.spec is not None:
        argv += ["--spec-type", b.spec.type, "--spec-draft-n-max", str(b.spec.draft_n_max)]
    if b.mmproj:
        argv += ["--mmproj", b.mmproj]
    if b.threads is not None:
        argv += ["-t", str(b.threads)]
    if b.device == "cpu":
        argv += ["-ngl", "0"]
    elif not any(a in ("--device", "-dev") or a.startswith(("--device=", "-dev=")) for a in b.extra_args):
        # the GPUs pinned: without them llama-server serves on the CPU after a failed CUDA init, with /health 200
        # (measured on an H200); with them it exits ("invalid device: CUDA0") and the start fails
        argv += ["--device", llama_devices(cfg, b)]
    if "--metrics" not in b.extra_args:  # its own Prometheus metrics at /metrics on the serving port
        argv += ["--metrics"]
    argv += ["--host", cfg.backend_host, "--port", str(cfg.backend_port)]
    if cfg.serve.api_key_file:
        argv += ["--api-key-file", Credential(API_KEY_FILE)]
    return argv + list(b.extra_args)


def visible_gpus(cfg: Config, b: Backend) -> tuple[int, ...]:
    """The GPUs (minors) a cuda backend's server sees: its own CUDA_VISIBLE_DEVICES when its env sets one of plain
    numbers (a subset of host.gpus: `check` refuses others), else host.gpus."""
    own = dict(b.env).get("CUDA_VISIBLE_DEVICES")
    if own is not None:
        parts = [p.strip() for p in own.split(",") if p.strip()]
        if parts and all(p.isdigit() for p in parts):
            return tuple(int(p) for p in parts)
    return tuple(int(g) for g in cfg.host.gpus)


def llama_devices(cfg: Config, b: Backend) -> str:
    """llama-server's --device for the GPUs it sees: CUDA numbers the visible GPUs (CUDA_VISIBLE_DEVICES) from 0."""
    return ",".join(f"CUDA{i}" for i in range(len(visible_gpus(cfg, b))))


def server_argv(cfg: Config, b: Backend) -> list[Arg]:
    """The server's own command line (placeholders expanded; a Credential left for systemd)."""
    return ftllm_argv(cfg, b) if isinstance(b, FtllmBackend) else llamacpp_argv(cfg, b)


def launch_argv(cfg: Config, b: Backend) -> list[Arg]:
    """The unit's ExecStart=: the env launcher, then the server's command line."""
    return [*env_launcher_argv(cfg, b), *server_argv(cfg, b)]


def cache_dir(b: Backend) -> str:
    """CacheDirectory= of a cuda backend (under /var/cache): the CUDA JIT cache that lasts across starts."""
    return f"deploytool-{b.name}"


def backend_env(cfg: Config, b: Backend) -> list[tuple[str, str]]:
    """The environment the backend runs with, in a stable order: derived variables first, then the config's."""
    env: dict[str, str] = {"HOME": "/tmp"}  # PrivateTmp=yes: a writable home of its own
    if b.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in cfg.host.gpus)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA numbers the GPUs as nvidia-smi and /dev/nvidiaN do
        # the driver's JIT cache (PTX compiled for this GPU): $HOME/.nv under PrivateTmp is thrown away at every
        # stop (25 MB on the H200); the unit's CacheDirectory= lasts
        env["CUDA_CACHE_PATH"] = f"/var/cache/{cache_dir(b)}/cuda"
    if isinstance(b, FtllmBackend) and b.use_bundle_nccl:
        env["LD_PRELOAD"] = f"{cfg.paths.current}/{BUNDLED_NCCL}"
    for k, v in b.env:
        env[k] = expand(cfg, v)
    return list(env.items())


def verify_argv(cfg: Config, b: Backend) -> list[Arg]:
    # --await-port: a switch starts the target while the current backend exits; the server execs once the
    # port is free (and a foreign holder fails the start at once, named)
    return tool_argv(cfg, "verify", b.name, "--await-port")


def nvidia_modprobe_argvs(cfg: Config, b: Backend) -> list[list[Arg]]:
    """The ExecStartPre command lines that load the NVIDIA modules and create the nodes before a cuda backend
    starts (none for a cpu backend). nvidia-modprobe's -c=MINOR means two things (its source, main()): without
    -u it makes /dev/nvidia<MINOR> (255 is /dev/nvidiactl); with -u it is the base minor of /dev/nvidia-uvm and
    /dev/nvidia-uvm-tools, which must be 0 (`-u -c=1` rewrote them as 238:1 and 238:2 on an H200, and CUDA init
    then failed for every non-root process of the box). So: one line for the GPUs' nodes and nvidiactl, one for
    nvidia-uvm."""
    if b.device != "cuda" or not cfg.host.gpus:
        return []
    return [[NVIDIA_MODPROBE, *(f"-c={int(g)}" for g in cfg.host.gpus), f"-c={NVIDIACTL_MINOR}"],
            [NVIDIA_MODPROBE, "-u", "-c=0"]]


def await_ready_argv(cfg: Config, b: Backend) -> list[Arg]:
    # the ExecStartPost: the start job ends once the server answers (see cli await-ready)
    return tool_argv(cfg, "await-ready", b.name)


def _finalize(value: object) -> object:
    """What a template may print: Escaped text and integers; anything else is a template bug."""
    if isinstance(value, Escaped) or (type(value) is int):
        return value
    raise TypeError(f"a template printed an unescaped {type(value).__name__} ({value!r}); pass it through one "
                    f"of render.py's escaping functions")


@functools.cache
def _env():
    """The one Jinja environment of the process (Jinja keeps each template compiled in it)."""
    import jinja2  # lazy: see the module's docstring

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(Path(tpl_pkg.__file__).parent)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
        finalize=_finalize,
    )


def _render(template: str, **ctx: object) -> str:
    import jinja2  # lazy: see the module's docstring

    try:
        return _env().get_template(template).render(**ctx)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"template {exc.name or template} line {exc.lineno}: {exc.message}") from None
    except jinja2.UndefinedError as exc:
        raise ConfigError(f"template {template}: {exc.message}") from None


def render_backend(cfg: Config, b: Backend) -> list[RenderedFile]:
    """The unit and the env file of one backend. Every value the templates print went through the escaping
    function of the syntax it lands in, with the key path it came from (see Escaped)."""
    key = f"backends.{b.name}"
    fo = cfg.supervision.failover
    own = dict(b.env)
    env_lines = [env_quote(k, v, f"{key}.env.{k}" if k in own else f"{key} (environment {k})")
                 for k, v in backend_env(cfg, b)]
    description = (unit_text(b.description, f"{key}.description") if b.description
                   else unit_text(f"{b.kind} inference server {b.name}", key))
    ctx = dict(
        version=unit_text(__version__, "version"), unit=unit_name(b.name),
        description=description, documentation=file_url(cfg.paths.config, "paths.config"),
        conflicts=[unit_name(o.name) for o in cfg.other_backends(b.name)],
        exec_start=exec_line(launch_argv(cfg, b), f"{key} (ExecStart=)"),
        exec_start_pre=exec_line(verify_argv(cfg, b), f"{key} (ExecStartPre=)"),
        exec_start_post=exec_line(await_ready_argv(cfg, b), f"{key} (ExecStartPost=)"),
        nvidia_modprobe=[exec_line(a, f"{key} (ExecStartPre=)") for a in nvidia_modprobe_argvs(cfg, b)],
        nvidia_classes=[Escaped(c) for c in NVIDIA_DEVICE_CLASSES] if b.device == "cuda" else [],
        env_file=unit_path(f"{cfg.paths.env_dir}/{b.name}.env", "paths.env_dir"),
        env_credential=Escaped(ENV_CREDENTIAL), unsafe_env=Escaped(" ".join(UNSAFE_ENV)),
        cache_dir=Escaped(cache_dir(b)) if b.device == "cuda" else None,
        gpu_group=(user_name(cfg.host.gpu_group, "host.gpu_group")
                   if b.device == "cuda" and cfg.host.gpu_group else None),
        api_key_file=(unit_path(f"{cfg.paths.env_dir}/{API_KEY_FILE}", "paths.env_dir")
                      if cfg.serve.api_key_file else None),
        # behind the front, on loopback: nothing but this machine reaches a backend (the clients' list is the front's)
        ip_allow=Escaped("localhost"),
        netlink=b.device == "cuda",
        gpus=[int(g) for g in cfg.host.gpus] if b.device == "cuda" else [],
        timeout_start=int(b.start_timeout_s or cfg.health.start_timeout_s),
        user=None if cfg.serve.user == "dynamic" else user_name(cfg.serve.user, "serve.user"),
        start_limit_burst=int(fo.start_limit_burst), start_limit_interval=int(fo.start_limit_interval_s),
        # %N: this unit's name without ".service" (the backend's name) becomes the failover unit's instance
        on_failure=Escaped(FAILOVER_TEMPLATE.replace("@", "@%N")) if fo.enabled else None,
    )
    unit = _render("backend.service.j2", **ctx)
    envf = _render("backend.env.j2", version=ctx["version"], unit=ctx["unit"], lines=env_lines)
    return [RenderedFile(f"{b.name}.service", "unit", unit, 0o644),
            RenderedFile(f"{b.name}.env", "env", envf, 0o644)]


def failover_argv(cfg: Config) -> list[Arg]:
    """`deploytool failover`'s command line in the failover unit, but its `--from %i` (see render_failover)."""
    return tool_argv(cfg, "failover")


def render_failover(cfg: Config) -> RenderedFile:
    """The template unit `deploytool-failover@.service` the backends' OnFailure= start (instance: the backend)."""
    slowest = max(int(b.start_timeout_s or cfg.health.start_timeout_s) for b in cfg.backends.values())
    ctx = dict(version=unit_text(__version__, "version"),
               documentation=file_url(cfg.paths.config, "paths.config"),
               # %i: the instance, i.e. the failed backend's name (a backend name needs no unescaping)
               exec_start=Escaped(exec_line(failover_argv(cfg), "paths.deploytool (failover unit)") + " --from %i"),
               timeout_start=slowest + int(cfg.health.smoke_timeout_s) + 300,
               rw_paths=failover_rw_paths(cfg))
    return RenderedFile(FAILOVER_TEMPLATE, "unit", _render("failover.service.j2", **ctx), 0o644)


def failover_rw_paths(cfg: Config) -> list[Escaped]:
    """What the failover unit may write under ProtectSystem=strict: the state dir, and the directory of
    paths.metrics_file where it lies outside it (a failover rewrites the metrics as every operation does; `-`:
    node_exporter's directory need not exist, and then nothing is written there)."""
    out = [rw_path(cfg.paths.state_dir, "paths.state_dir")]
    metrics = cfg.paths.metrics_file
    if metrics:
        d = posixpath.dirname(metrics)  # not / (config.load refuses it)
        if posixpath.commonpath([d, cfg.paths.state_dir]) != cfg.paths.state_dir:
            out.append(rw_path(d, "paths.metrics_file", missing_ok=True))
    return out


LIVENESS_UNIT = "deploytool-liveness.service"


def liveness_argv(cfg: Config) -> list[Arg]:
    return tool_argv(cfg, "liveness", "--watch")


def rw_path(value: str, key: str, *, missing_ok: bool = False) -> Escaped:
    """One word of ReadWritePaths= (a list split at white space, each word unquoted: systemd.exec(5)): the path
    (with `-`, ignored where it does not exist, when `missing_ok`) in double quotes where it holds white space,
    specifiers escaped; a quote or a backslash in the path is refused (either would be read as quoting)."""
    if any(c in value for c in "\"'"):
        raise _refuse(key, value, "contains a quote, which ReadWritePaths= would read as quoting")
    word = ("-" if missing_ok else "") + unit_path(value, key)
    return Escaped(f'"{word}"' if any(c.isspace() for c in word) else word)


def render_liveness(cfg: Config) -> list[RenderedFile]:
    """The liveness probe's service: one process probing every interval (install enables and starts it when
    supervision.liveness.enabled, and stops and disables it otherwise)."""
    lc = cfg.supervision.liveness
    doc = file_url(cfg.paths.config, "paths.config")
    version = unit_text(__version__, "version")
    rw = [rw_path(cfg.paths.state_dir, "paths.state_dir", missing_ok=True),
          rw_path(cfg.paths.unit_dir, "paths.unit_dir", missing_ok=True)]
    host = cfg.serve.host
    allow = [Escaped(host)] if host not in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "::") \
        and re.fullmatch(r"[0-9a-fA-F.:]+", host) else []
    svc = _render("liveness.service.j2", version=version, unit=Escaped(LIVENESS_UNIT), documentation=doc,
                  exec_start=exec_line(liveness_argv(cfg), "supervision.liveness (ExecStart=)"),
                  interval=Escaped(f"{lc.interval_s:g}"), rw_paths=rw, allow=allow)
    return [RenderedFile(LIVENESS_UNIT, "unit", svc, 0o644)]


FRONT_SOCKET = "deploytool-front.socket"
FRONT_SERVICE = "deploytool-front.service"
FRONT_UNITS = (FRONT_SOCKET, FRONT_SERVICE)
FRONT_RUNTIME_DIR = "deploytool-front"
FRONT_CONTROL = f"/run/{FRONT_RUNTIME_DIR}/control"  # box/frontctl.py CONTROL, the same path


def listen_address(host: str, port: int) -> str:
    """ListenStream= of serve.host and serve.port (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def front_argv(cfg: Config) -> list[Arg]:
    """The front's ExecStart=: the box's Python, isolated and without site, on the release's launch/front.py."""
    return [cfg.bundle.python, "-I", "-S", f"{cfg.paths.current}/{BUNDLED_FRONT}",
            "--backend", f"{cfg.backend_host}:{cfg.backend_port}", "--hold", f"{cfg.hold_timeout_s:g}",
            "--control", FRONT_CONTROL]


def render_front(cfg: Config) -> list[RenderedFile]:
    """The front's socket and service: the public port (serve.host:serve.port), which systemd keeps open, and the
    process that passes requests to the active backend and holds them while none is ready (box/front.py)."""
    version = unit_text(__version__, "version")
    doc = file_url(cfg.paths.config, "paths.config")
    listen = unit_text(listen_address(cfg.serve.host, cfg.serve.port), "serve.host")
    sock = _render("front.socket.j2", version=version, unit=Escaped(FRONT_SOCKET), documentation=doc,
                   listen=listen, ip_allow=ip_allow(cfg))
    svc = _render("front.service.j2", version=version, unit=Escaped(FRONT_SERVICE), documentation=doc,
                  listen=listen, socket=Escaped(FRONT_SOCKET),
                  backend=Escaped(f"{cfg.backend_host}:{cfg.backend_port}"),
                  hold=Escaped(f"{cfg.hold_timeout_s:g}"),
                  exec_start=exec_line(front_argv(cfg), "bundle.python (the front's ExecStart=)"),
                  exec_start_pre=exec_line(tool_argv(cfg, "verify-front"), "paths.deploytool (the front's ExecStartPre=)"),
                  unsafe_env=Escaped(" ".join(UNSAFE_ENV)),
                  control=Escaped(FRONT_CONTROL), runtime_dir=Escaped(FRONT_RUNTIME_DIR))
    return [RenderedFile(FRONT_SOCKET, "unit", sock, 0o644), RenderedFile(FRONT_SERVICE, "unit", svc, 0o644)]


def render_all(cfg: Config) -> list[RenderedFile]:
    """Every unit and env file for every backend, the front's socket and service, the liveness probe's unit, and
    the failover unit when failover is on; sorted by name."""
    out: list[RenderedFile] = []
    for name in sorted(cfg.backends):
        out += render_backend(cfg, cfg.backends[name])
    out += render_front(cfg)
    out += render_liveness(cfg)
    if cfg.supervision.failover.enabled:
        out.append(render_failover(cfg))
    return sorted(out, key=lambda f: f.name)


def render_api_key(cfg: Config, api_key: str) -> RenderedFile:
    """The root-only (0600) copy of the API key the units load as their credential: the key on one line (what
    llama-server's --api-key-file and the ftllm launcher read). Written at install time on the box, never bundled.
    A key with a control character or white space at either end is refused: a line cannot carry the first, and the
    servers would compare the second differently from the clients."""
    where = f"the API key in {q(cfg.serve.api_key_file)} (serve.api_key_file)"
    if not api_key or unsafe_char(api_key) is not None or api_key != api_key.strip():
        raise ConfigError(f"{where} is empty, spans lines, holds a control character or begins or ends with white "
                          f"space", hint="write the key alone on the file's first line")
    return RenderedFile(API_KEY_FILE, "credential", api_key + "\n", 0o600)


def _plain(o: Any) -> Any:
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return {f.name: _plain(getattr(o, f.name)) for f in dataclasses.fields(o)}
    if hasattr(o, "items"):
        return {str(k): _plain(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_plain(x) for x in o]
    return o


def resolved_config_json(cfg: Config) -> bytes:
    """The config as loaded (defaults filled in, paths resolved), canonical JSON: the bundle's config.json, and
    what install compares the box's config with."""
    d = _plain(cfg)
    d.pop("source_path", None)
    return (json.dumps(d, indent=1, sort_keys=True) + "\n").encode()
