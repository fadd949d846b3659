"""A packed cpu-demo box of its own, for install fault tests and the switch/install benchmarks.

Same recipe as the e2e `demo` fixture (init --example cpu-demo, a tiny f16 GGUF, keygen, lock, pack, the public
key trusted by the box), in a directory of the caller's choosing, with a port and systemd sandbox of its own, so
it never touches another suite's box. The rendered units hold absolute paths of this directory (config, demo-root),
so a bundle packed here is installed here.

    make_demo(d, sandbox_dir=, unit_dir=, port=) -> config path (bundle in d/artifacts, keys in d/keys)
    variant(cfg, name, env=) -> a second config beside the first whose ftllm-dflash env differs (another bundle id)
    pack(cfg, out, key=) -> the signed bundle archive packed from cfg into out
    dt(cfg, *args) -> the CLI run as a user types it (python -m deploy_tool --config cfg ...)
    Box(cfg) -> the box's paths; Box.reset(systemd) takes every trace of an install away
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DT = [sys.executable, "-m", "deploy_tool"]
BACKEND_UNITS = ("ftllm-dflash.service", "llamacpp-tensor.service")


def dt(cfg: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 600,
       wrap: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    """`deploytool --config cfg ARGS` in a child process, as a user runs it (cwd: the config's directory)."""
    e = dict(os.environ)
    e.pop("DEPLOYTOOL_JOURNAL_SOCKET", None)  # the box's own journal (its sandbox's), as on a box (tests/conftest.py)
    e.update(env or {})
    e["PYTHONPATH"] = str(REPO)
    return subprocess.run([*(wrap or []), *DT, "--config", str(cfg), *args], capture_output=True, text=True,
                          timeout=timeout, env=e, cwd=cfg.parent)


def _ok(r: subprocess.CompletedProcess[str], what: str) -> None:
    assert r.returncode == 0, f"{what} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"


#: Where make_demo's box keeps its Prometheus metrics, relative to its directory (see make_demo).
METRICS_FILE = "demo-root/var/lib/prometheus/node-exporter/deploytool.prom"


def make_demo(d: Path, *, sandbox_dir: Path | None, unit_dir: Path, port: int,
              serve: dict | None = None) -> Path:
    """A fresh cpu-demo directory at `d`, packed and signed; returns its config. Wheels come from .cache/wheels-demo.
    `serve`: keys set in the config's serve section before it is packed (e.g. api_key_file)."""
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    cfg = d / "deploytool.yaml"
    _ok(subprocess.run([*DT, "init", "--example", "cpu-demo", "--out", str(cfg)], capture_output=True, text=True,
                       cwd=d, env={**os.environ, "PYTHONPATH": str(REPO)}), "init")
    data = yaml.safe_load(cfg.read_text())
    data["systemd"]["sandbox"] = str(sandbox_dir) if sandbox_dir else None
    data["paths"]["unit_dir"] = str(unit_dir)
    data["serve"]["port"] = port
    data["serve"].update(serve or {})
    # the metrics where a real box keeps them, in node_exporter's textfile directory outside the state dir (made
    # here as its package makes it), so that every unit that rewrites them must be allowed to write there
    data["paths"]["metrics_file"] = METRICS_FILE
    (d / METRICS_FILE).parent.mkdir(parents=True)
    cfg.write_text(yaml.safe_dump(data, sort_keys=False))
    cache = REPO / ".cache" / "wheels-demo"
    cache.mkdir(parents=True, exist_ok=True)
    (d / "wheels").symlink_to(cache)
    (d / "models").mkdir()
    from tests.support.tiny_model import write_model

    write_model(d / "models" / "tiny-f16.gguf", size="tiny", f16=True)
    from tests.support import lock_cache

    _ok(dt(cfg, "keygen", "--out", str(d / "keys")), "keygen")
    lock_cache.lock(cfg, lambda: _ok(dt(cfg, "lock"), "lock"))  # the run's first box locks for real
    _ok(dt(cfg, "pack"), "pack")
    box = Box(cfg)
    box.keys.mkdir(parents=True, exist_ok=True)
    for p in (d / "keys").glob("*.pub"):
        shutil.copy(p, box.keys / p.name)
    return cfg


def variant(cfg: Path, name: str, env: dict[str, str]) -> Path:
    """A second config beside `cfg` (same box, same paths) whose ftllm-dflash backend has extra environment."""
    data = yaml.safe_load(cfg.read_text())
    b = data["backends"]["ftllm-dflash"]
    b["env"] = {**(b.get("env") or {}), **env}
    out = cfg.with_name(name)
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def pack(cfg: Path, out: Path, key: Path | None = None) -> Path:
    """Pack `cfg` into `out` (signed with `key`, default the config's own) and return the archive."""
    args = ["pack", "--out", str(out)] + (["--key", str(key)] if key else [])
    _ok(dt(cfg, *args), "pack")
    return bundle_in(out)


def bundle_in(d: Path) -> Path:
    found = sorted(p for p in d.iterdir() if p.is_file() and p.name.endswith((".tar", ".tar.zst")))
    assert len(found) == 1, f"expected one bundle archive in {d}, found {found}"
    return found[0]


@dataclass(frozen=True)
class Box:
    """Where an install on this config's box puts things."""

    cfg: Path

    @functools.cached_property
    def _paths(self) -> dict[str, str]:  # read once: every path property below comes from it
        data = yaml.safe_load(self.cfg.read_text())
        return {k: str((self.cfg.parent / v).resolve()) if not str(v).startswith("/") else str(v)
                for k, v in data["paths"].items() if isinstance(v, str)}

    @property
    def root(self) -> Path:
        return Path(self._paths["root"])

    @property
    def releases(self) -> Path:
        return self.root / "releases"

    @property
    def current(self) -> Path:
        return self.root / "current"

    @property
    def env_dir(self) -> Path:
        return Path(self._paths["env_dir"])

    @property
    def state_dir(self) -> Path:
        return Path(self._paths["state_dir"])

    @property
    def unit_dir(self) -> Path:
        return Path(self._paths["unit_dir"])

    @property
    def keys(self) -> Path:
        return Path(self._paths["keys_dir"])

    def state(self) -> dict:
        p = self.state_dir / "state.json"
        return json.loads(p.read_text()) if p.is_file() else {}

    def history(self) -> list[dict]:
        p = self.state_dir / "history.jsonl"
        return [json.loads(ln) for ln in p.read_text().splitlines()] if p.is_file() else []

    def release_entries(self) -> list[str]:
        return sorted(os.listdir(self.releases)) if self.releases.is_dir() else []

    def current_release(self) -> str | None:
        return Path(os.readlink(self.current)).name if self.current.is_symlink() else None

    def traces(self) -> dict[str, list[str]]:
        """Everything an install leaves on the box (empty lists on a clean box)."""
        return {
            "units": sorted(u for u in os.listdir(self.unit_dir) if u.startswith(BACKEND_UNITS))
            if self.unit_dir.is_dir() else [],
            "env": sorted(os.listdir(self.env_dir)) if self.env_dir.is_dir() else [],
            "current": [str(self.current)] if self.current.is_symlink() or self.current.exists() else [],
            "releases": self.release_entries(),
            "pins": sorted(os.listdir(self.state_dir / "pins")) if (self.state_dir / "pins").is_dir() else [],
        }

    def reset(self, systemd) -> None:
        """Back to a fresh box: backend units stopped and removed, env, state, releases and current deleted."""
        from deploy_tool.errors import DeployError

        for u in BACKEND_UNITS:
            with contextlib.suppress(DeployError):
                systemd.stop(u)
            with contextlib.suppress(DeployError):
                systemd.disable(u)
            (self.unit_dir / u).unlink(missing_ok=True)
        for d in (self.env_dir, self.state_dir, self.releases):
            shutil.rmtree(d, ignore_errors=True)
        if self.current.is_symlink():
            self.current.unlink()
        with contextlib.suppress(DeployError):
            systemd.reset_failed()
        systemd.daemon_reload()


def active_units(systemd) -> set[str]:
    return {u for u in BACKEND_UNITS if systemd.show(u).active_state in ("active", "activating")}


def chat(port: int, model: str = "qwen38-27b-ud") -> dict:
    """One tiny chat completion on the served port."""
    import urllib.request

    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def server_uid(systemd, sandbox_run, unit: str) -> tuple[int, int]:
    """(real uid, effective uid) of `unit`'s main process, read from /proc inside the sandbox (its PID namespace)."""
    pid = systemd.show(unit).main_pid
    assert pid > 0, f"{unit} has no main process"
    status = sandbox_run("cat", f"/proc/{pid}/status").stdout
    uids = next(ln.split()[1:] for ln in status.splitlines() if ln.startswith("Uid:"))
    return int(uids[0]), int(uids[1])


def access_problems(paths: list[Path]) -> list[str]:
    """What keeps a DynamicUser server from reading `paths` (and everything below the directories among them), or
    lets someone other than root change them. Every parent directory up to / must be root-owned, o+x and not
    group/other-writable (a sticky, world-writable /tmp-like parent is reported too: no box path belongs there).
    [] when all is well. (The API key file env/api-key is not for this: systemd reads it as root, and it must stay 0600.)"""
    import stat as st_

    out: list[str] = []
    seen: set[Path] = set()

    def look(p: Path, *, what: str) -> None:
        if p in seen:
            return
        seen.add(p)
        try:
            s = os.lstat(p)
        except FileNotFoundError:  # gone meanwhile (another test's tree under /tmp): nothing to report
            return
        mode = s.st_mode & 0o7777
        if st_.S_ISLNK(s.st_mode):
            if s.st_uid != 0:
                out.append(f"{p}: symlink owned by uid {s.st_uid}")
            return
        if s.st_uid != 0:
            out.append(f"{p}: owned by uid {s.st_uid}, not root")
        if mode & 0o022:
            out.append(f"{p}: mode {mode:04o} lets group/other write")
        if st_.S_ISDIR(s.st_mode):
            need = 0o001 if what == "parent" else 0o005
            if mode & need != need:
                out.append(f"{p}: directory mode {mode:04o}, a DynamicUser cannot "
                           + ("pass through" if what == "parent" else "list and enter") + " it")
        elif mode & 0o004 != 0o004:
            out.append(f"{p}: file mode {mode:04o}, a DynamicUser cannot read it")

    for top in paths:
        for parent in reversed(top.parents):
            look(parent, what="parent")
        look(top, what="top")
        if top.is_dir() and not top.is_symlink():
            for d, dirs, files in os.walk(top):
                for n in dirs + files:
                    look(Path(d) / n, what="tree")
    return out
