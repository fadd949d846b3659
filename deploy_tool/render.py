"""Config -> unit files and env files, through strict Jinja2 templates. Pure: no I/O but reading templates.

The launch lines are built here as argv lists (one option beside its value), then quoted for systemd's
ExecStart= syntax; environment values are quoted for EnvironmentFile= syntax. Output is deterministic: the
same config gives the same bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from deploy_tool import __version__
from deploy_tool.config import Backend, Config, FtllmBackend, LlamacppBackend
from deploy_tool.errors import ConfigError

_SAFE_ARG = re.compile(r"^[A-Za-z0-9_./:=,+@-]+$")
BUNDLED_TEMPLATE = "templates/chat_template.jinja"
BUNDLED_NCCL = "nccl/libnccl.so.2"
SECRETS_ENV = "secrets.env"
API_KEY_VAR = "DEPLOYTOOL_API_KEY"


@dataclass(frozen=True)
class RenderedFile:
    name: str  # file name, e.g. "ftllm-dflash.service"
    kind: str  # "unit" | "env"
    content: str
    mode: int


def expand(cfg: Config, path: str) -> str:
    """Expand the {current} and {venv} placeholders to paths under the install root."""
    return path.replace("{venv}", cfg.paths.current + "/venv").replace("{current}", cfg.paths.current)


def systemd_quote(arg: str) -> str:
    """Quote one argument for ExecStart=: specifiers (%) and variables ($) are escaped, odd ones double-quoted."""
    if "\n" in arg or "\x00" in arg:
        raise ConfigError(f"argument {arg!r} contains a newline or NUL byte; systemd cannot pass it")
    esc = arg.replace("%", "%%").replace("$", "$$")
    if _SAFE_ARG.match(arg):
        return esc
    return '"' + esc.replace("\\", "\\\\").replace('"', '\\"') + '"'


def env_quote(name: str, value: str) -> str:
    """One `NAME="value"` line in EnvironmentFile= syntax (no `export`); round-trips any text but NL/NUL."""
    if "\n" in value or "\r" in value or "\x00" in value:
        raise ConfigError(f"environment variable {name}: value contains a newline or NUL byte, which an "
                          f"EnvironmentFile cannot hold", hint="put such data in a file and pass its path")
    esc = "".join("\\" + c if c in '"\\`$' else c for c in value)
    return f'{name}="{esc}"'


def ftllm_argv(cfg: Config, b: FtllmBackend) -> list[str]:
    argv = [expand(cfg, b.executable), "server", "-p", b.model, "--model_name", cfg.serve.model_name]
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
    argv += ["--host", cfg.serve.host, "--port", str(cfg.serve.port)]
    if cfg.serve.api_key_file:
        argv += ["--api_key", "${" + API_KEY_VAR + "}"]
    return argv + list(b.extra_args)


def llamacpp_argv(cfg: Config, b: LlamacppBackend) -> list[str]:
    argv = [expand(cfg, b.binary), "-m", b.model, "--alias", cfg.serve.model_name]
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
    argv += ["--host", cfg.serve.host, "--port", str(cfg.serve.port)]
    return argv + list(b.extra_args)


def launch_argv(cfg: Config, b: Backend) -> list[str]:
    """The backend's launch line as an argv list (placeholders expanded; ${VAR} left for systemd)."""
    return ftllm_argv(cfg, b) if isinstance(b, FtllmBackend) else llamacpp_argv(cfg, b)


def backend_env(cfg: Config, b: Backend) -> list[tuple[str, str]]:
    """The environment the backend runs with, in a stable order: derived variables first, then the config's."""
    env: dict[str, str] = {}
    if b.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in cfg.host.gpus)
    if isinstance(b, FtllmBackend) and b.use_bundle_nccl:
        env["LD_PRELOAD"] = f"{cfg.paths.current}/{BUNDLED_NCCL}"
    for k, v in b.env:
        env[k] = expand(cfg, v)
    return list(env.items())


def verify_argv(cfg: Config, b: Backend) -> list[str]:
    # --await-port: a switch starts the target while the current backend exits; the server execs once the
    # port is free (and a foreign holder fails the start at once, named)
    return [expand(cfg, cfg.paths.deploytool), "--config", cfg.paths.config, "verify", b.name, "--await-port"]


def _env():
    import jinja2  # lazy: keeps `deploytool --version` fast

    from deploy_tool import templates as tpl_pkg

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(Path(tpl_pkg.__file__).parent)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["sq"] = systemd_quote
    return env


def _render(template: str, **ctx: object) -> str:
    import jinja2

    try:
        return _env().get_template(template).render(**ctx)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"template {exc.name or template} line {exc.lineno}: {exc.message}") from None
    except jinja2.UndefinedError as exc:
        raise ConfigError(f"template {template}: {exc.message}") from None


def render_backend(cfg: Config, b: Backend) -> list[RenderedFile]:
    others = [o.unit for o in cfg.other_backends(b.name)]
    argv = launch_argv(cfg, b)
    env_lines = [env_quote(k, v) for k, v in backend_env(cfg, b)]
    ctx = dict(
        version=__version__, cfg=cfg, b=b, conflicts=others, exec_start=" ".join(systemd_quote(a) for a in argv),
        exec_start_pre=" ".join(systemd_quote(a) for a in verify_argv(cfg, b)),
        env_file=f"{cfg.paths.env_dir}/{b.name}.env",
        secrets_file=f"{cfg.paths.env_dir}/{SECRETS_ENV}" if cfg.serve.api_key_file else None,
        gpus=list(cfg.host.gpus) if b.device == "cuda" else [],
        description=b.description or f"{b.kind} inference server {b.name}",
        timeout_start=int(b.start_timeout_s or cfg.health.start_timeout_s),
    )
    unit = _render("backend.service.j2", **ctx)
    envf = _render("backend.env.j2", version=__version__, b=b, lines=env_lines)
    return [RenderedFile(f"{b.name}.service", "unit", unit, 0o644),
            RenderedFile(f"{b.name}.env", "env", envf, 0o644)]


def render_all(cfg: Config) -> list[RenderedFile]:
    """Every unit and env file for every backend, sorted by name."""
    out: list[RenderedFile] = []
    for name in sorted(cfg.backends):
        out += render_backend(cfg, cfg.backends[name])
    return sorted(out, key=lambda f: f.name)


def render_secrets(cfg: Config, api_key: str) -> RenderedFile:
    """The 0600 env file holding the API key (written at install time on the box, never bundled)."""
    return RenderedFile(SECRETS_ENV, "env", env_quote(API_KEY_VAR, api_key) + "\n" + env_quote("LLAMA_API_KEY", api_key)
                        + "\n", 0o600)
