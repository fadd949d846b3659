"""The config a release was packed with against the box's: which keys differ.

A bundle carries the config it was packed from (`config.json`: defaults filled in, paths resolved), and its units,
env files and paths were rendered from it and signed as such. `install` refuses a bundle packed for another config
than the box's; a switch, a rollback and a failover refuse to start a backend while the box's config differs from the
installed release's in what the gate probes by (`probed`: another port or model name than the units serve would
fail a healthy backend); `status` names such a difference as a degraded box.
"""

from __future__ import annotations

import json
import os
from typing import Any

from deploy_tool.config import Config, Serve, from_resolved
from deploy_tool.render import resolved_config_json

# Keys that say where `pack` found its inputs or how a machine reaches systemd: they may differ between the
# packing machine and the box without changing anything the box runs. Every other key reaches the box (unit and
# env files, paths, the gate, the Python that builds the venv), so it must be what the bundle was packed with.
# (paths.metrics_file and supervision.keep_releases are the box's own: no env file holds them, and a bundle packed
# before they existed must still install. The failover unit holds the directory of the packing config's
# paths.metrics_file as a ReadWritePaths=: on a box that writes its metrics elsewhere, a failover's rewrite of them
# is refused by its sandbox, with a warning in its journal, until a bundle packed with that path is installed.)
PACK_ONLY_KEYS = ("source_sha256", "bundle.name", "bundle.sequence", "bundle.requirements", "bundle.lock_mode",
                  "bundle.lock", "bundle.wheels_dir", "bundle.tool_wheels_dir", "bundle.chat_template.source",
                  "bundle.nccl.library", "bundle.nccl.force", "systemd", "paths.metrics_file",
                  "supervision.keep_releases")

Difference = tuple[str, Any, Any]  # (key path, packed value, box value)
_MISSING = object()


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key path: leaf value} of a config document."""
    if isinstance(d, list) and d and all(isinstance(x, list) and len(x) == 2 and isinstance(x[0], str) for x in d):
        d = dict(d)  # a mapping kept as (key, value) pairs, e.g. a backend's env: compared key by key
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    if d == []:
        return {}  # empty is absent: an empty env or argument list against a filled one names the filled keys
    return {prefix[:-1]: d}


def config_differences(packed: dict[str, Any], box: dict[str, Any]) -> list[Difference]:
    """(key path, packed value, box value) for every key the box runs by that differs; pack-only keys aside."""
    a, b = flatten(packed), flatten(box)

    def pack_only(k: str) -> bool:
        return any(k == p or k.startswith(p + ".") for p in PACK_ONLY_KEYS)

    return [(k, a.get(k, _MISSING), b.get(k, _MISSING)) for k in sorted(set(a) | set(b))
            if not pack_only(k) and a.get(k, _MISSING) != b.get(k, _MISSING)]


def differences(cfg: Config, packed_json: str | os.PathLike[str]) -> list[Difference]:
    """The differences between `cfg` and the config.json at `packed_json`. Raises OSError or ValueError when that
    file cannot be read as a JSON object."""
    with open(packed_json, "rb") as f:
        packed = json.loads(f.read())
    if not isinstance(packed, dict):
        raise ValueError("not a JSON object")
    return config_differences(packed, json.loads(resolved_config_json(cfg)))


def describe(diffs: list[Difference], packed_name: str, limit: int = 4) -> str:
    """`key: <packed_name> value, here value; ...` for the first `limit` differences."""

    def show(v: Any) -> str:
        if not isinstance(v, str | int | float | bool | list | dict | None):
            return "(unset)"
        s = json.dumps(v)
        return s if len(s) <= 60 else "..." + s[-57:]  # a path differs at its end: keep that

    listed = "; ".join(f"{k}: {packed_name} {show(a)}, here {show(b)}" for k, a, b in diffs[:limit])
    return listed + (f" (and {len(diffs) - limit} more)" if len(diffs) > limit else "")


def probed(key: str) -> bool:
    """Whether a switch's gate probes by this key: where and what it asks (serve.*: the port behind the front, the
    model name, the API key), which backends there are and of what kind and device, the GPUs a cuda one must hold.
    The box's own tuning (health.*, supervision.*, a backend's arguments) may differ for a while: an install of a
    new bundle asks the operator to edit the config first (the pins are of what the release runs: installed_config)."""
    parts = key.split(".")
    return key.startswith("serve.") or key == "host.gpus" or \
        (parts[0] == "backends" and len(parts) == 3 and parts[2] in ("kind", "device"))


def installed_differences(cfg: Config) -> list[Difference] | None:
    """The differences, in what the gate probes by (`probed`), between `cfg` and the config the current release
    was packed with; None when there is no release, or its config.json cannot be read (the release's own pins say
    what is wrong with it)."""
    try:
        diffs = differences(cfg, os.path.join(cfg.paths.current, "config.json"))
    except (OSError, ValueError):
        return None
    return [d for d in diffs if probed(d[0])]


def installed_serve(cfg: Config) -> Serve | None:
    """The `serve` section of the config the current release was packed with (where and what its units serve) when
    it differs from the box's; None when they agree, or there is no release or no readable one to ask."""
    released = installed_config(cfg)
    return released.serve if released is not None and released.serve != cfg.serve else None


def installed_config(cfg: Config) -> Config | None:
    """The config the installed release's units run: its config.json, with the keys that are the box's own
    (PACK_ONLY_KEYS: where pack found its inputs, how this machine reaches systemd) taken from `cfg`. None when
    there is no release, or its config.json cannot be read as one (then `cfg` is all there is to go by).

    What the pins are taken of and checked against: after the operator edits the box's config for the next bundle
    (install compares the two and asks for that first), the units still run this release until that bundle is
    installed, and a restart, a failover or a switch must check the files they load, not the next ones."""
    try:
        with open(os.path.join(cfg.paths.current, "config.json"), "rb") as f:
            packed = json.loads(f.read())
        if not isinstance(packed, dict):
            return None
        box = json.loads(resolved_config_json(cfg))
        for key in PACK_ONLY_KEYS:
            *parents, leaf = key.split(".")
            src: Any = box
            dst: Any = packed
            for k in parents:
                src = src.get(k) if isinstance(src, dict) else None
                dst = dst.get(k) if isinstance(dst, dict) else None
            if not isinstance(dst, dict):
                continue  # e.g. no chat template in the release's: nothing of the box's own below it
            if isinstance(src, dict) and leaf in src:
                dst[leaf] = src[leaf]
            else:
                dst.pop(leaf, None)
        return from_resolved(packed, source_path=cfg.source_path)
    except (OSError, ValueError):
        return None
