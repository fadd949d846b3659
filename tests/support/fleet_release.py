"""cpu-demo releases packed for the fleet test bed's hosts (tests/test_fleet_*.py).

The same recipe as tests/support/demo_box.py (init --example cpu-demo, wheels from .cache/wheels-demo, keygen,
lock, pack), but the config is one a fleet host runs as is: the default paths (/etc/deploytool, /opt/deploytool,
/var/lib/deploytool: each host has a root of its own), the host's own systemd (no sandbox), the servers bound to
0.0.0.0 inside the host's network namespace (its only interfaces are lo and its bridge veth), so that the gate on
the controller reaches them on the host's bridge address, and the model at MODEL on the host (the test puts it
there). Every path is absolute: the config is the same file on every host and on the controller. With `api_key`,
the config sets serve.api_key_file to API_KEY_FILE on the hosts (the test puts the key there, root-only, as an
operator would; install makes the units' credential of it) and the key is in Release.api_key_file on the controller.

    make_release(d, env=..., keys=..., api_key=...) -> Release (config, bundle directory, public key, model and
                                                       API key file on the controller)
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.support.demo_box import DT, REPO, dt

MODEL = "/srv/deploytool-models/tiny-f16.gguf"  # where the model is on every fleet host
PORT = 18082
API_KEY_FILE = "/etc/fleet-secrets/api-key"  # where the API key is on every fleet host (outside /etc/deploytool)


@dataclass(frozen=True)
class Release:
    config: Path        # the fleet config on the controller (what each host gets at /etc/deploytool/deploytool.yaml)
    bundle: Path        # the packed bundle directory (artifacts/<name>-<id>)
    pubkey: Path        # the signer's public key (what each host trusts in /etc/deploytool/keys)
    model: Path         # the tiny model on the controller
    api_key_file: Path | None = None  # the API key on the controller (what each host gets at API_KEY_FILE)

    @property
    def id(self) -> str:
        return self.bundle.name

    @property
    def bundle_id(self) -> str:
        """The release id (the MANIFEST's bundle_id): what status reports and the host's DEST/<id>."""
        import json

        return str(json.loads((self.bundle / "MANIFEST").read_text())["bundle_id"])


def _ok(r: subprocess.CompletedProcess[str], what: str) -> None:
    assert r.returncode == 0, f"{what} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"


def fleet_config(d: Path, *, env: dict[str, str] | None = None, api_key: bool = False) -> Path:
    """A cpu-demo config in `d` for the fleet hosts (see the module doc); `env`: extra ftllm-dflash environment
    (another release of the same box); `api_key`: the servers want the key at API_KEY_FILE."""
    d.mkdir(parents=True, exist_ok=True)
    cfg = d / "deploytool.yaml"
    _ok(subprocess.run([*DT, "init", "--example", "cpu-demo", "--out", str(cfg)], capture_output=True, text=True,
                       cwd=d, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}), "init")
    data = yaml.safe_load(cfg.read_text())
    data["systemd"]["sandbox"] = None
    data["paths"] = {"config": "/etc/deploytool/deploytool.yaml", "metrics_file": None}
    data["serve"].update(host="0.0.0.0", port=PORT)
    if api_key:
        data["serve"]["api_key_file"] = API_KEY_FILE
    for key in ("requirements", "lock", "wheels_dir"):
        data["bundle"][key] = str(d / data["bundle"][key])
    data["bundle"]["chat_template"]["source"] = str(d / data["bundle"]["chat_template"]["source"])
    for b in data["backends"].values():
        b["model"] = MODEL
    if env:
        b = data["backends"]["ftllm-dflash"]
        b["env"] = {**(b.get("env") or {}), **env}
    cfg.write_text(yaml.safe_dump(data, sort_keys=False))
    return cfg


def make_release(d: Path, *, env: dict[str, str] | None = None, keys: Path | None = None,
                 api_key: str | None = None) -> Release:
    """A fleet release packed in `d` (a fresh directory); `keys`: an existing key directory to sign with (another
    release of the same fleet), else a new key pair in d/keys; `api_key`: the servers' API key (d/api-key)."""
    shutil.rmtree(d, ignore_errors=True)
    cfg = fleet_config(d, env=env, api_key=api_key is not None)
    cache = REPO / ".cache" / "wheels-demo"
    cache.mkdir(parents=True, exist_ok=True)
    (d / "wheels").symlink_to(cache)
    (d / "models").mkdir()
    from tests.support.tiny_model import write_model

    write_model(d / "models" / "tiny-f16.gguf", size="tiny", f16=True)
    if keys is None:
        keys = d / "keys"
        _ok(dt(cfg, "keygen", "--out", str(keys)), "keygen")
    from tests.support import lock_cache

    lock_cache.lock(cfg, lambda: _ok(dt(cfg, "lock"), "lock"))  # the run's first box locks for real
    _ok(dt(cfg, "pack", "--key", str(keys / "deploytool.key"), "--out", str(d / "artifacts")), "pack")
    bundles = [p for p in (d / "artifacts").iterdir() if p.is_dir() and (p / "MANIFEST").is_file()]
    assert len(bundles) == 1, bundles
    key_file = None
    if api_key is not None:
        key_file = d / "api-key"
        key_file.write_text(api_key + "\n")
        key_file.chmod(0o600)
    return Release(cfg, bundles[0], keys / "deploytool.pub", d / "models" / "tiny-f16.gguf", key_file)
