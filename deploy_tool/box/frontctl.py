"""Talk to the front (deploy_tool/box/front.py) over its control socket: hold new requests, release them, read its
counters. Best effort by design: a box without its front running (an older install, a stopped socket) switches as
before, and what could not be said is reported, never raised."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from deploy_tool.config import Config

CONTROL = "/run/deploytool-front/control"  # the front unit's RuntimeDirectory= (render.FRONT_RUNTIME_DIR)


def control_path(cfg: Config) -> str:
    """The control socket as this process reaches it: through the sandbox's root when the config targets one."""
    if cfg.systemd.sandbox:
        from deploy_tool.box.sandbox_handle import SandboxHandle

        sb = SandboxHandle(cfg.systemd.sandbox)
        if not sb.contains_self():
            try:
                return f"/proc/{sb.pid}/root{CONTROL}"
            except Exception:  # noqa: BLE001 - a sandbox that is down has no front either
                return CONTROL
    return CONTROL


def ask(cfg: Config, command: str, timeout: float = 2.0) -> dict | None:
    """One command (`hold SECONDS`, `release`, `stats`); the front's answer, or None when it cannot be reached."""
    path = control_path(cfg)
    if not Path(path).exists():
        return None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(path)
            s.sendall(command.encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(4096)
                if not chunk:
                    break
                buf += chunk
        out = json.loads(buf)
        return out if isinstance(out, dict) and out.get("ok") else None
    except (OSError, ValueError):
        return None


def hold(cfg: Config) -> dict | None:
    """Hold new requests for at most the hold bound (the front ends the hold itself after it)."""
    return ask(cfg, f"hold {cfg.hold_timeout_s:g}")


def release(cfg: Config) -> dict | None:
    return ask(cfg, "release")


def stats(cfg: Config) -> dict | None:
    return ask(cfg, "stats")


def delta(before: dict | None, after: dict | None) -> dict[str, object] | None:
    """What clients saw between two readings of the counters: requests answered, waited, failed; seconds held."""
    if before is None or after is None or after.get("since") != before.get("since"):
        return None if after is None else {k: after.get(k) for k in ("requests", "waited", "failed", "held_s",
                                                                     "wait_max_s")}
    out: dict[str, object] = {k: round(float(after.get(k, 0)) - float(before.get(k, 0)), 4)
                              for k in ("requests", "waited", "failed", "held_s")}
    for k in ("requests", "waited", "failed"):
        out[k] = int(out[k])  # type: ignore[call-overload]
    out["wait_max_s"] = after.get("wait_max_s")  # since the front started: a maximum has no difference
    return out
