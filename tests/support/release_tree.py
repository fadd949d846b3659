"""An installed release on disk, built from real parts, for the fingerprint tests (and install-like tests).

    tpl = build_template(dir)            # once per module: the slow parts (venv, copies, NCCL build)
    tree = instantiate(tpl, tmp_path)    # per test: a copy with its units and env files rendered

Layout (relative paths in deploytool.yaml, so a copied tree is self-contained):
    deploytool.yaml
    opt/deploytool/current -> releases/r1
    opt/deploytool/releases/r1/venv/            a real venv (`python -m venv --without-pip`) holding the real
                                                ftllm package (its Python files, libfastllm_tools-cpu.so,
                                                libnuma.so.1), dist-info and bin/ftllm copied from the dev venv,
                                                and shortuuid's dist-info; libfastllm_tools.so is a copy of the
                                                CPU library (the 516 MB CUDA one is only benchmarked, never
                                                copied per test)
    opt/deploytool/releases/r1/templates/chat_template.jinja
    opt/deploytool/releases/r1/nccl/libnccl.so.2  MOCK: a tiny library built by the real nvcc with a real sm_75
                                                cubin (a real NCCL built for sm_75 does not exist here)
    opt/deploytool/releases/r1/MANIFEST
    llama/bin/llama-server + lib*.so*           the real llama-server and the libraries it loads, copied
    models/ftllm-model/                         config.json, tokenizer files, two real .safetensors shards
    models/draft/                               config.json, one .safetensors
    models/tiny-f16.gguf, models/mmproj.gguf    real tiny GGUF files (tests.support.tiny_model)
    etc/systemd/system/*.service, etc/deploytool/env/*.env   rendered by deploytool's own renderer
    var/lib/deploytool/                         the state dir

Files larger than 32 MiB (libggml-vulkan) are hard-linked into copies when the file system allows it:
tests must replace them, never modify them in place.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from deploy_tool import config
from tests.support import native, tiny_model

RELEASE = "r1"
BIG = 32 << 20
LLAMA_LIBS = ("libllama-server-impl.so", "libllama-common.so.0", "libmtmd.so.0", "libllama.so.0", "libggml.so.0",
              "libggml-base.so.0", "libggml-cpu.so.0", "libggml-rpc.so.0", "libggml-vulkan.so.0", "libvulkan.so.1")
TEMPLATE_TEXT = ("{%- set effort = reasoning_effort if reasoning_effort is not none else 'low' %}\n"
                 "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}\n")


class MissingPart(RuntimeError):
    """A real part the tree is built from is not installed here."""


def dev_site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def ftllm_dir() -> Path:
    d = dev_site_packages() / "ftllm"
    if not (d / "libfastllm_tools-cpu.so").is_file():
        raise MissingPart(f"ftllm is not installed in {dev_site_packages()}: run `python -m tests.support.backends "
                          "install` (pip install --no-deps ftllm==0.1.8.2)")
    return d


def ftllm_dist_info() -> Path:
    found = sorted(dev_site_packages().glob("ftllm-*.dist-info"))
    if not found:
        raise MissingPart("no ftllm-*.dist-info in the dev venv: run `python -m tests.support.backends install`")
    return found[0]


def llama_bin_dir() -> Path:
    from tests.support.backends import llama_server_binary

    return llama_server_binary().parent


def write_safetensors(path: Path, tensors: dict[str, tuple[int, ...]], seed: int = 0) -> Path:
    """A real .safetensors file (8-byte header length, JSON header, F16 data) with deterministic bytes."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    blobs = []
    for i, (name, shape) in enumerate(sorted(tensors.items())):
        n = 2
        for d in shape:
            n *= d
        blobs.append(bytes((seed + i + k) % 251 for k in range(n)))
        header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + b"".join(blobs))
    return path


def _hf_model(d: Path, *, layers: int, shards: int, seed: int) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "torch_dtype": "float16"},
        indent=2) + "\n")
    (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 2048}) + "\n")
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0.6}) + "\n")
    for s in range(shards):
        name = "model.safetensors" if shards == 1 else f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(d / name, {f"model.layers.{s}.mlp.weight": (64, 32), f"model.layers.{s}.norm": (64,)},
                          seed=seed + s)


def build_template(d: Path) -> Path:
    """Build the slow parts once (real venv, copies, nvcc-built NCCL stand-in, tiny GGUFs); return `d`."""
    d.mkdir(parents=True, exist_ok=True)
    rel = d / "opt/deploytool/releases" / RELEASE
    rel.mkdir(parents=True)
    os.symlink(f"releases/{RELEASE}", d / "opt/deploytool/current")
    # a real venv with the real ftllm dist-info and native libraries
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(rel / "venv")], check=True)
    sp = next((rel / "venv/lib").glob("python3*/site-packages"))
    shutil.copytree(ftllm_dist_info(), sp / ftllm_dist_info().name)
    src = ftllm_dir()
    shutil.copytree(src, sp / "ftllm", ignore=shutil.ignore_patterns("libfastllm_tools.so", "__pycache__"))
    shutil.copy2(src / "libfastllm_tools-cpu.so", sp / "ftllm" / "libfastllm_tools.so")
    script = dev_site_packages().parents[2] / "bin" / "ftllm"  # as pip wrote it (RECORD holds its hash)
    if script.is_file():
        shutil.copy2(script, rel / "venv/bin/ftllm")
    for dist in sorted(dev_site_packages().glob("shortuuid-*.dist-info"))[:1]:  # one more real distribution
        shutil.copytree(dist, sp / dist.name)
    (rel / "templates").mkdir()
    (rel / "templates/chat_template.jinja").write_text(TEMPLATE_TEXT)
    (rel / "nccl").mkdir()
    native.build_cuda_so(d / "build/nccl75/libnccl.so.2", "arch=compute_75,code=sm_75")
    native.build_cuda_so(d / "build/nccl80/libnccl.so.2", "arch=compute_80,code=sm_80")
    shutil.copy2(d / "build/nccl75/libnccl.so.2", rel / "nccl/libnccl.so.2")
    (rel / "MANIFEST").write_text('{"bundle_id": "0000000000000000"}\n')
    # the servers' env launchers, as pack writes them (render.launcher_script: bundle.python's shebang, -I -S)
    (rel / "launch/bin").mkdir(parents=True)
    source = (Path(__file__).resolve().parents[2] / "deploy_tool/box/env_launch.py").read_bytes()
    for name in ("ftllm", "llama-server"):
        (rel / "launch/bin" / name).write_bytes(b"#!/usr/bin/python3 -IS\n" + source)
        (rel / "launch/bin" / name).chmod(0o755)
    # the real llama-server and the libraries it loads
    lb = d / "llama/bin"
    lb.mkdir(parents=True)
    src_bin = llama_bin_dir()
    shutil.copy2(src_bin / "llama-server", lb / "llama-server")
    for name in LLAMA_LIBS:
        if (src_bin / name).exists():
            _link_or_copy(str(src_bin / name), str(lb / name))
    # models
    m = d / "models"
    _hf_model(m / "ftllm-model", layers=2, shards=2, seed=1)
    _hf_model(m / "draft", layers=1, shards=1, seed=7)
    tiny_model.write_model(m / "tiny-f16.gguf", size="tiny", f16=True, seed=0)
    tiny_model.write_model(m / "mmproj.gguf", size="tiny", f16=True, seed=3)
    for sub in ("etc/systemd/system", "etc/deploytool/env", "var/lib/deploytool"):
        (d / sub).mkdir(parents=True)
    (d / "deploytool.yaml").write_text(yaml.safe_dump(config_dict(), sort_keys=False))
    return d


def config_dict() -> dict:
    return {
        "version": 1,
        "default_backend": "ftllm-dflash",
        "host": {"gpus": [0], "compute_capability": "7.5", "vram_mib": 22528},
        "serve": {"host": "127.0.0.1", "port": 18082, "model_name": "tiny", "user": "root"},
        "paths": {"root": "opt/deploytool", "unit_dir": "etc/systemd/system", "env_dir": "etc/deploytool/env",
                  "state_dir": "var/lib/deploytool", "keys_dir": "etc/deploytool/keys",
                  "config": "deploytool.yaml"},
        "bundle": {"nccl": {"library": "build/nccl75/libnccl.so.2", "arch_policy": "exact"}},
        "backends": {
            "ftllm-dflash": {
                "kind": "ftllm", "aliases": ["ftllm"], "device": "cuda", "model": "models/ftllm-model",
                "chat_template": "bundle", "nccl": "bundle",
                "speculative": {"algorithm": "dflash", "draft_model": "models/draft", "num_draft_tokens": 8},
                "env": {"FASTLLM_CUDA_GRAPH": "0"},
            },
            "llamacpp-tensor": {
                "kind": "llamacpp", "aliases": ["llamacpp"], "device": "cpu", "binary": "llama/bin/llama-server",
                "model": "models/tiny-f16.gguf", "mmproj": "models/mmproj.gguf", "ctx_size": 2048,
            },
        },
    }


def _link_or_copy(src: str, dst: str) -> str:
    if os.path.getsize(src) > BIG:
        try:
            os.link(src, dst)
            return dst
        except OSError:
            pass
    shutil.copy2(src, dst)
    return dst


@dataclass
class Tree:
    root: Path
    config_path: Path
    cfg: config.Config

    @property
    def release(self) -> Path:
        return self.root / "opt/deploytool/releases" / RELEASE

    @property
    def site_packages(self) -> Path:
        return next((self.release / "venv/lib").glob("python3*/site-packages"))

    def reload(self) -> config.Config:
        self.cfg = config.load(self.config_path)
        return self.cfg


def render_units(cfg: config.Config) -> None:
    from deploy_tool.render import render_all

    servers = {f"{name}.service" for name in cfg.backends}
    for f in render_all(cfg):
        if f.kind == "unit" and f.name not in servers:
            # the tool's own units (liveness, failover) have fixed names: written into a sandbox this tree shares,
            # they would replace those of the box installed there
            continue
        d = Path(cfg.paths.unit_dir if f.kind == "unit" else cfg.paths.env_dir)
        (d / f.name).write_text(f.content)


def instantiate(template: Path, dest: Path, edit: Callable[[dict], None] | None = None) -> Tree:
    """A private copy of the template tree with units and env files rendered for its own paths.

    `edit` may change the config dict first (e.g. point paths.unit_dir at a sandbox, rename backends).
    """
    shutil.copytree(template, dest, symlinks=True, copy_function=_link_or_copy, dirs_exist_ok=True)
    cp = dest / "deploytool.yaml"
    if edit is not None:
        data = yaml.safe_load(cp.read_text())
        edit(data)
        cp.write_text(yaml.safe_dump(data, sort_keys=False))
    cfg = config.load(cp)
    render_units(cfg)
    return Tree(dest, cp, cfg)
