"""`deploytool await-ready BACKEND`: the units' ExecStartPost, so a start job ends when the server serves.

systemd runs it once the server's process has been executed (Type=exec); the unit stays "activating" until it
exits, so `systemctl start` returns, and units ordered After= the backend start, only once the server answers:
readiness as the health gate probes it (llama-server's /health, then /v1/models naming the configured model,
with the API key when one is configured). The unit's TimeoutStartSec= bounds the whole start: a server that
never gets ready fails the start when it runs out, and Restart=on-failure takes over as for any failed start.

The server's main process is watched through a pidfd (deploy_tool.procfs.ProcessWatch; its PID is $MAINPID,
which systemd sets for the control processes it runs while the main process is known): when it exits, this exits
at once, non-zero, naming it.
systemd would otherwise wait for this control process before it fails the start. The switch's own gate does
not wait for this: it watches the unit itself and keeps its own checks (smoke completion, runtime truth).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from deploy_tool import gpu, procfs
from deploy_tool.box import runtime
from deploy_tool.box.probe import health
from deploy_tool.config import Backend, Config
from deploy_tool.errors import GpuError
from deploy_tool.progress import waiting
from deploy_tool.render import visible_gpus


def main_pid_from_env(environ: dict[str, str] | None = None) -> int | None:
    """$MAINPID as systemd sets it for a unit's control processes; None when unset or not a PID."""
    raw = (os.environ if environ is None else environ).get("MAINPID", "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else None


class MainProcess:
    """The server's process watched until it ends (deploy_tool.procfs.ProcessWatch: a pidfd where there are
    pidfds): `state()` for health.wait_ready's unit_state (a dead snapshot the moment it exited), `sleep()` for its
    sleep (it wakes when the process exits)."""

    def __init__(self, pid: int | None, label: str) -> None:
        self.pid, self.label = pid, label
        self.watch = procfs.ProcessWatch(pid) if pid is not None else None

    def _exited(self, timeout: float) -> bool:
        if self.watch is None:
            if timeout > 0:
                time.sleep(timeout)
            return False
        return self.watch.gone(timeout)

    def state(self) -> health.UnitSnapshot | None:
        if self.pid is None or not self._exited(0):
            return None
        return health.UnitSnapshot(active_state="failed", sub_state="exited", result="exit-code",
                                   name=f"{self.label}'s main process (PID {self.pid})")

    def sleep(self, seconds: float) -> None:
        self._exited(seconds)

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()


def await_ready(cfg: Config, b: Backend, *, main_pid: int | None, timeout: float | None = None,
                clock: Callable[[], float] | None = None, proc: str = "/proc") -> health.ReadyReport:
    """Wait until `b` serves the configured model; HealthError when its process exits first or time runs out;
    GpuError when a cuda backend's server is ready without holding its GPUs (it fell back to the CPU).

    `timeout` defaults to the backend's start timeout (what the unit's TimeoutStartSec= is rendered from, so
    systemd's own timeout, counted from the start of the job, normally ends the start first)."""
    watch = MainProcess(main_pid, b.unit)
    limit = timeout if timeout is not None else (b.start_timeout_s or cfg.health.start_timeout_s)
    try:
        with waiting(f"{b.name} to be ready ({health.base_url(cfg)})", limit=limit):  # a terminal only, not systemd
            rep = health.wait_ready(b.kind, health.base_url(cfg), cfg.serve.model_name, api_key=health.api_key(cfg),
                                    timeout=limit, interval=cfg.health.interval_s, unit_state=watch.state,
                                    sleep=watch.sleep, clock=clock)
    finally:
        watch.close()
    check_gpus(cfg, b, main_pid, proc=proc)
    return rep


def check_gpus(cfg: Config, b: Backend, main_pid: int | None, *, proc: str = "/proc") -> gpu.Residency | None:
    """A ready cuda server must hold /dev/nvidia<N> of each of host.gpus (deploy_tool.gpu: residency); GpuError
    naming the missing ones otherwise. None for a cpu backend, or without a main PID to look at."""
    if b.device != "cuda" or main_pid is None:
        return None
    res = runtime.gpu_residency(main_pid, visible_gpus(cfg, b), proc=proc)
    if res.known and not res.ok:
        raise GpuError(res.describe(b.name),
                       hint="its CUDA init failed, so it serves on the CPU: read its log (journalctl -u "
                            f"{b.unit}) and run `deploytool check` on the box (device nodes, their group, "
                            "nvidia-uvm)", details={"reason": "gpu-missing", "gpu": res.to_json()})
    return res
