"""Configs for tests: the embedded examples as dicts, mutated by key path, written beside their files.

    data = example_dict("two-2080ti")
    set_key(data, "backends.ftllm-dflash.env.FASTLLM_CUDA_GRAPH", "1")
    cfg = load_dict(tmp_path, data)
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from deploy_tool import config

_DELETE = object()


def example_dict(name: str) -> dict[str, Any]:
    """The embedded example `name` parsed into a plain dict (a fresh copy each call)."""
    return copy.deepcopy(yaml.safe_load(config.example_text(name)))


def set_key(data: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """Set (or with value=DELETE remove) the key at a dotted path; backend names contain no dots."""
    *parents, last = dotted.split(".")
    d = data
    for p in parents:
        d = d.setdefault(p, {})
    if value is _DELETE:
        d.pop(last, None)
    else:
        d[last] = value
    return data


DELETE = _DELETE


def write_dict(directory: Path, data: dict[str, Any], name: str = "deploytool.yaml") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    p = directory / name
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return p


def load_dict(directory: Path, data: dict[str, Any]) -> config.Config:
    """Write `data` as deploytool.yaml into `directory` and load it through the real loader."""
    return config.load(write_dict(directory, data))


def load_example(directory: Path, name: str, **changes: Any) -> config.Config:
    """Load example `name` with dotted-key changes: load_example(p, 'two-2080ti', **{'serve.port': 1})."""
    data = example_dict(name)
    for k, v in changes.items():
        set_key(data, k, v)
    return load_dict(directory, data)
