"""The health gate a backend must pass after every start: unit watched throughout, readiness, a real chat
completion with the configured model name, and (where it can be read) what the process actually loaded.
After health, a switch may ask for the performance step (perf_gate): a short bench against a stored baseline."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploy_tool import procfs, retry
from deploy_tool.box import fingerprint, runtime
from deploy_tool.box.probe import health, perf
from deploy_tool.box.probe.health import api_key, base_url  # noqa: F401  (re-exported: status, metrics, perf use them from here)
from deploy_tool.box.systemd import Systemd
from deploy_tool.config import Backend, Config
from deploy_tool.errors import DeployError, GpuError, HealthError, InputError, RuntimeTruthError, SandboxError
from deploy_tool.manifest import Manifest
from deploy_tool.progress import waiting
from deploy_tool.render import visible_gpus


@dataclass
class GateReport:
    backend: str
    ready_s: float = 0.0
    smoke_s: float = 0.0
    total_s: float = 0.0
    content: str = ""
    completion_tokens: int = 0
    main_pid: int = 0
    runtime: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def snapshot(sd: Systemd, unit: str, seen: list[str] | None = None) -> health.UnitSnapshot:
    return _snapshot(sd.show(unit), unit, seen)


def _note_invocation(st: Any, seen: list[str] | None) -> None:
    """The first invocation the gate watched, kept in `seen`: the start it is gating."""
    if seen is not None and st.invocation_id and not seen:
        seen.append(st.invocation_id)


def _snapshot(st: Any, unit: str, seen: list[str] | None = None) -> health.UnitSnapshot:
    if getattr(st, "job", "") and (st.active_state in ("inactive", "failed", "deactivating")
                                   or st.sub_state == "auto-restart"):
        # a start queued with --no-block that has not begun (the state, and the invocation, are still the last
        # run's; on a unit waiting to be restarted by Restart=, systemd holds the start until that restart):
        # not dead, not started yet
        return health.UnitSnapshot(active_state="activating", sub_state="queued", name=unit)
    _note_invocation(st, seen)
    code = {1: "exited", 2: "killed", 3: "dumped"}.get(st.exec_main_code, "")
    return health.UnitSnapshot(active_state=st.active_state, sub_state=st.sub_state, result=st.result,
                               exec_main_status=st.exec_main_status if code else None, exec_main_code=code,
                               name=unit)


def queue_start(sd: Systemd, unit: str, *, restart: bool = False) -> None:
    """Start `unit` for the gate to watch: the job is queued, not waited for (it lasts until the unit's
    ExecStartPost sees the server ready, up to TimeoutStartSec=); `restart`: stop it first (and wait for that),
    so the gate never probes the server of the run before."""
    if restart:
        sd.stop(unit)
    sd.start(unit, no_block=True, past_start_limit=True)


class UnitWatch:
    """How the readiness wait watches the started unit, cheaply enough to probe every few tens of milliseconds.

    The first look is a `systemctl show` (state, invocation, MainPID, ControlPID). After that a process of the
    unit is watched through a pidfd (deploy_tool.procfs.ProcessWatch): while the unit is in its ExecStartPre,
    the control process running it (the fingerprint check, the wait for the other backend's exit); from then on,
    the main process. The wait between probes ends the moment the watched process exits, and the unit's state is
    read again right then; otherwise the unit is re-read only every `recheck_s` (a backstop for anything a
    process exit does not show). Without a pidfd (an old kernel, a process that is not the unit's) or a process
    to watch (a start still queued), every look is a `systemctl show`. After the gate's checks, `started()`
    watches the ExecStartPost's control process the same way, until the unit's start job has ended.
    """

    def __init__(self, sd: Systemd, unit: str, *, seen: list[str] | None = None,
                 to_host_pid: Callable[[int], int] = lambda pid: pid, recheck_s: float = 1.0) -> None:
        self.sd, self.unit, self.seen, self.recheck_s = sd, unit, seen, recheck_s
        self.to_host_pid = to_host_pid  # a PID as systemd reports it -> this process's view of the PID
        self.proc: procfs.ProcessWatch | None = None  # the process watched through its pidfd
        self.pid = 0  # that process's PID as systemd reports it
        self.main_pid = 0  # the same, when it is the main process (MainPID)
        self.exited = False  # the watched process has ended
        self._while_alive: health.UnitSnapshot | None = None  # what a look answers while it runs
        self._last = float("-inf")
        self.restarted = ""  # the invocation started() found instead of the gated one (Restart= ran meanwhile)

    @property
    def fd(self) -> int | None:
        """The watched process's pidfd; None while none is watched."""
        return self.proc.fileno() if self.proc is not None else None

    def state(self) -> health.UnitSnapshot | None:
        """The unit's state when it was read now; while the watched process runs, nothing new: None for the main
        process, the last state read (not started yet) for an ExecStartPre's."""
        if self.proc is not None and not self.exited and time.monotonic() - self._last < self.recheck_s:
            self.exited = self.proc.gone(0)
            if not self.exited:
                return self._while_alive
        st = self.sd.show(self.unit)
        self._last = time.monotonic()
        snap = _snapshot(st, self.unit, self.seen)
        if self.main_pid and self.exited and not snap.dead and snap.sub_state in ("start", "start-post") \
                and snap.exec_main_code:
            # the server's process is gone (systemd has its exit status) while systemd still waits for the unit's
            # ExecStartPost (the readiness wait exits at once on it, but may still be starting up itself): dead
            # now, as it will read once that has exited
            return _main_gone(snap)
        if snap.dead or self.main_pid:
            return snap  # nothing more to watch, or the main process is watched already
        if st.main_pid:
            self._follow(st.main_pid, main=True)
            self._while_alive = None
        elif st.control_pid and snap.sub_state == "start-pre":
            self._follow(st.control_pid, main=False)
            self._while_alive = snap
        return snap

    def _follow(self, pid: int, *, main: bool) -> None:
        """Watch `pid` (systemd's view) from now on, instead of the process watched so far."""
        if self.proc is not None and not self.exited and self.pid == pid:
            return  # the same control process, read again at the backstop
        self.close()
        self.exited = False
        try:
            self.proc = _watch(self.to_host_pid(pid), self.unit)
        except DeployError:  # the sandbox could not map the PID: keep asking systemd
            self.proc = None
        self.pid = pid if self.proc is not None else 0
        self.main_pid = self.pid if main else 0

    def main_pid_now(self) -> int:
        """The unit's MainPID as systemd reports it: the watched main process while its pidfd says it runs (the
        same process, however its PID is reused later), else read from systemd."""
        if self.main_pid and self.proc is not None and not self.exited and not self.proc.gone(0):
            return self.main_pid
        st = self.sd.show(self.unit)
        _note_invocation(st, self.seen)
        return st.main_pid

    def started(self, timeout: float, interval: float) -> health.UnitSnapshot:
        """The unit's state once its start job has ended, waiting up to `timeout` seconds.

        The gate's own probes may find the server ready before the unit's ExecStartPost (its readiness wait) has
        seen it and exited; until then the unit is activating, and a stop kills that control process and fails
        the unit (its OnFailure= failover starts). The wait watches the control process through a pidfd, and asks
        systemd again when it exits (every `recheck_s` as a backstop; every `interval` without a pidfd). A unit
        that is not in its start (start, start-post) any more is answered as it is: active, or what went wrong."""

        def look() -> health.UnitSnapshot:
            st = self.sd.show(self.unit)
            if self.seen and st.invocation_id and st.invocation_id != self.seen[0]:
                self.restarted = st.invocation_id  # not the run the gate checked: answered as it is, noted
            snap = _snapshot(st, self.unit, self.seen)
            if self.restarted or not _in_start_job(snap):
                return snap
            if st.control_pid and st.control_pid != self.pid:
                self._follow(st.control_pid, main=False)
            raise _Starting(snap)

        def step() -> float:
            return self.recheck_s if self.proc is not None and not self.exited else interval

        try:
            return retry.start_job(timeout, step, retry_on=_Starting, wait_for=self.sleep)(look)
        except _Starting as exc:
            return exc.snap

    def sleep(self, seconds: float) -> None:
        """Wait up to `seconds`, less if the watched process exits meanwhile."""
        if self.proc is None or self.exited:
            time.sleep(seconds)
        else:
            self.exited = self.proc.gone(seconds)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.close()
            self.proc = None


def _in_start_job(snap: health.UnitSnapshot) -> bool:
    """The unit is running its start job: the server's exec or its ExecStartPost (the readiness wait)."""
    return snap.active_state == "activating" and snap.sub_state in ("start", "start-post")


class _Starting(Exception):
    """The unit's start job has not ended: its state as last read."""

    def __init__(self, snap: health.UnitSnapshot) -> None:
        super().__init__(snap.describe())
        self.snap = snap


def _main_gone(snap: health.UnitSnapshot) -> health.UnitSnapshot:
    """A starting unit whose main process has exited, as it will read once systemd has failed the start."""
    code, status = snap.exec_main_code, snap.exec_main_status
    if code in ("killed", "dumped"):
        return dataclasses.replace(snap, active_state="failed", sub_state="failed", result="signal")
    if status:
        return dataclasses.replace(snap, active_state="failed", sub_state="failed", result="exit-code")
    return dataclasses.replace(snap, active_state="inactive", sub_state="dead", result="success")


def _watch(pid: int, unit: str) -> procfs.ProcessWatch | None:
    """A watch on `pid` through its pidfd if it is a process of `unit` (its cgroup says so), else None (without a
    pidfd too: the unit is then read from systemd at every look)."""
    watch = procfs.ProcessWatch(pid)
    if watch.pidfd:
        try:  # opened after `show` named it: make sure the PID still belongs to the unit (not reused)
            with open(f"/proc/{pid}/cgroup", encoding="utf-8") as f:
                if any(line.rstrip().endswith("/" + unit) for line in f):
                    return watch
        except OSError:
            pass
    watch.close()
    return None


def run_gate(cfg: Config, sd: Systemd, b: Backend, *, invocation: str | None = None, since: float | None = None,
             timeout: float | None = None, on_event: Callable[[str], None] = lambda s: None) -> GateReport:
    """Wait for `b` (already started) to be ready and answer a real completion; raise HealthError otherwise.

    `invocation` and `since` (epoch seconds taken just before the start) select the journal lines of this
    start (failure tails, the runtime-truth read of the startup log). Without `invocation`, the one the gate
    sees first in the unit's state is used (no extra `systemctl show` right after the start)."""
    t0 = time.monotonic()
    seen: list[str] = [invocation] if invocation else []

    def journal() -> str:
        try:
            return sd.journal(b.unit, invocation=seen[0] if seen else None, lines=30, since=since)
        except Exception:  # the journal is evidence, not a precondition
            return ""

    watch = UnitWatch(sd, b.unit, seen=seen, to_host_pid=lambda pid: host_pid(cfg, pid))
    try:  # watched to the end: what the checks after readiness ask of the main process, its pidfd answers
        return _gate_watched(cfg, sd, b, watch, seen=seen, since=since, timeout=timeout, on_event=on_event,
                             journal=journal, t0=t0)
    finally:
        watch.close()


def _gate_watched(cfg: Config, sd: Systemd, b: Backend, watch: UnitWatch, *, seen: list[str], since: float | None,
                  timeout: float | None, on_event: Callable[[str], None], journal: Callable[[], str],
                  t0: float) -> GateReport:
    url, key = base_url(cfg), api_key(cfg)
    limit = timeout if timeout is not None else (b.start_timeout_s or cfg.health.start_timeout_s)
    with waiting(f"{b.name} to be ready (health gate, {url})", limit=limit):
        rep = health.wait_ready(b.kind, url, cfg.serve.model_name, api_key=key, timeout=limit,
                                interval=cfg.health.interval_s, unit_state=watch.state, journal_tail=journal,
                                sleep=watch.sleep)
    on_event(f"{b.name}: ready after {rep.seconds:.1f}s")
    if b.device == "cuda":
        # before the completion: a server that fell back to the CPU answers it (slowly, on the real model), and
        # its unit's readiness wait stops it meanwhile, leaving the completion to run into its timeout
        pid0 = watch.main_pid_now()
        res = runtime.gpu_residency(host_pid(cfg, pid0), visible_gpus(cfg, b)) if pid0 else None
        if res is not None and res.known and not res.ok:
            raise GpuError(res.describe(b.name), hint="its CUDA init failed, so it would serve on the CPU: read "
                           f"its log (journalctl -u {b.unit}) and run `deploytool check` on the box",
                           details={"reason": "gpu-missing", "gpu": res.to_json()})
    try:
        with waiting(f"{b.name}'s smoke completion (health gate)", limit=cfg.health.smoke_timeout_s):
            smoke = health.smoke_completion(url, cfg.serve.model_name, api_key=key,
                                            timeout=cfg.health.smoke_timeout_s,
                                            max_tokens=cfg.health.smoke_max_tokens)
    except HealthError as exc:
        j = journal()
        snap = snapshot(sd, b.unit)
        if snap.dead:
            exc.message += f"\n  unit {b.unit} is {snap.describe()}"
        if "journal tail" not in exc.message:
            exc.message = health.with_journal(exc.message, j, last=15)
        raise
    on_event(f"{b.name}: smoke completion ok ({smoke.completion_tokens} tokens in {smoke.seconds:.2f}s)")
    # what the runtime-truth check below needs: the unit's MainPID (the watched process, still running: no
    # round trip), the startup log (complete: the server is ready), the release's pins and the hashes verify
    # cached. The mapped libraries are read after the smoke (a lazily loaded one counts).
    main_pid = watch.main_pid_now()
    report = GateReport(backend=b.name, ready_s=rep.seconds, smoke_s=smoke.seconds, content=smoke.content,
                        completion_tokens=smoke.completion_tokens, main_pid=main_pid)
    try:
        pins, hash_file = release_pins(cfg, b.kind), verified_hasher(cfg, b)
    except Exception:  # noqa: BLE001 - as before: without them, runtime_truth reads what it can
        pins, hash_file = None, None

    def startup_log() -> str:
        # bounded by the start time, the journal holds only this start's lines: no need to wait for the invocation
        if since is not None:
            return sd.journal(b.unit, lines=2000, since=since)
        return sd.journal(b.unit, invocation=seen[0] if seen else None, lines=2000)

    truth = runtime_truth(cfg, b, main_pid, pins=pins, hash_file=hash_file, journal_text=startup_log)
    report.runtime = truth.get("rows", [])
    fails = truth.get("failures", [])
    if fails:
        raise RuntimeTruthError(f"{b.name} is up but did not load what was pinned: " + "; ".join(fails),
                                hint="the running process maps libraries from other paths or with other hashes "
                                     "than the release (e.g. the system NCCL instead of the bundle's)",
                                details={"reason": "runtime-truth", "runtime": truth})
    for w in truth.get("warnings", []):
        on_event(f"{b.name}: warning: {w}")
    # passed only once systemd says so: the unit's start job (its own readiness wait, and for a cuda server the
    # check that it holds its GPUs) has ended, and the unit is active
    left = max(1.0, limit - (time.monotonic() - t0))
    with waiting(f"{b.unit}'s start job to end (its ExecStartPost, deploytool await-ready)", limit=left):
        snap = watch.started(left, cfg.health.interval_s)
    if watch.restarted or snap.active_state != "active":
        if watch.restarted:
            what = (f"{b.unit} was restarted after the gate's checks (systemd's Restart=; now {snap.describe()}): "
                    "the server the gate checked has exited")
        elif _in_start_job(snap):
            what = f"{b.unit}'s readiness wait (its ExecStartPost) had not finished after {left:.0f} s"
        else:
            what = f"{b.unit}'s start failed after the gate's checks passed: {snap.describe()}"
        raise HealthError(
            health.with_journal(f"{b.name} answered the gate, but {what}", journal(), last=15),
            hint=f"read the unit's log: journalctl -u {b.unit} (the lines of `deploytool await-ready` say what it "
                 "waited for)",
            details={"reason": "restarted" if watch.restarted else "start-job", "unit_state": snap.describe()})
    report.total_s = time.monotonic() - t0
    return report


def verified_hasher(cfg: Config, b: Backend) -> Callable[[str], str]:
    """SHA-256 of a mapped library: the value `deploytool verify` cached for the same file (same dev, inode,
    size, mtime_ns and ctime_ns: the ExecStartPre of this very start hashed the release's libraries) or, for a
    file it never saw, computed."""
    return fingerprint.cached_hasher(cfg, b.name)


#: The native library families each backend kind loads (runtime.KNOWN_LIBRARIES); the other kind's libraries,
#: which share the release's venv, are not expected in its process.
KIND_FAMILIES = {
    "ftllm": ("libfastllm_tools", "libnccl", "libcudart", "libcublas"),
    "llamacpp": ("libggml", "libllama", "libnccl", "libcudart", "libcublas"),
}


def release_pins(cfg: Config, kind: str | None = None) -> dict[str, Any]:
    """runtime.Pin per native library the release knows (venv libraries from the MANIFEST, the bundled NCCL);
    with `kind`, only the families a backend of that kind loads."""
    cur = Path(cfg.paths.current)
    try:
        man = Manifest.from_bytes((cur / "MANIFEST").read_bytes())
    except (OSError, DeployError):
        return {}
    families = KIND_FAMILIES.get(kind or "", tuple(sorted({f for fs in KIND_FAMILIES.values() for f in fs})))
    pins: dict[str, Any] = {}
    for rel, sha in man.native_libs.items():
        name = rel.rsplit("/", 1)[-1]
        if name.startswith(families):
            pins[name] = runtime.Pin(os.path.realpath(cur / "venv" / rel), sha)
    nccl = man.by_path().get("nccl/libnccl.so.2")
    if nccl is not None:
        pins["nccl"] = runtime.Pin(os.path.realpath(cur / "nccl" / "libnccl.so.2"), nccl.sha256)
    return pins


def host_pid(cfg: Config, pid: int) -> int:
    """The host PID of a unit's MainPID (they differ when systemd runs in the sandbox's PID namespace)."""
    if not pid or not cfg.systemd.sandbox:
        return pid
    found = procfs.host_pid(pid, procfs.sandbox_cgroup(cfg.systemd.sandbox))
    if found is None:
        raise SandboxError(f"no process with PID {pid} runs inside sandbox {cfg.systemd.sandbox}")
    return found


def runtime_truth(cfg: Config, b: Backend, main_pid: int, *, journal_text: Callable[[], str],
                  pins: dict[str, Any] | None = None,
                  hash_file: Callable[[str], str] | None = None) -> dict[str, Any]:
    """What the running process actually loaded and what its log says fits; never raises.

    `pins` and `hash_file` default to release_pins(cfg, b.kind) and verified_hasher(cfg, b)."""
    try:
        pid = host_pid(cfg, main_pid)
        ctx = getattr(b, "tokens", None) or getattr(b, "ctx_size", None)
        rep = runtime.inspect_runtime(pid, kind=b.kind, pins=pins if pins is not None else release_pins(cfg, b.kind),
                                      log_text=journal_text, device_profile=b.device, configured_ctx=ctx,
                                      hash_file=hash_file or verified_hasher(cfg, b),
                                      gpus=visible_gpus(cfg, b) if b.device == "cuda" else ())
    except Exception as exc:  # the check must never turn into a crash of the gate
        return {"status": "unknown", "rows": [], "failures": [], "warnings": [f"could not determine: {exc}"]}
    out = rep.to_json()
    out["rows"] = rep.to_rows()
    out["failures"] = [f"{f.check} {f.subject}: {f.message}" for f in rep.failures()]
    out["warnings"] = [f"{f.check} {f.subject}: {f.message}" for f in rep.findings if f.status == runtime.WARN]
    return out


def endpoint_for(cfg: Config, *, timeout: float = perf.DEFAULT_TIMEOUT,
                 max_request_s: float | None = None) -> perf.Endpoint:
    """The live backend of `cfg` behind the front (its internal port, serve.model_name, the API key)."""
    return perf.Endpoint(base_url=base_url(cfg), model=cfg.serve.model_name, api_key=api_key(cfg),
                    timeout=timeout, max_request_s=max_request_s)


def perf_gate(cfg: Config, backend_name: str, release: str, *, fraction: float, max_tokens: int = 128,
              runs: int = 1, warmup: int = 1, timeout: float = 60.0, on_event: Callable[[str], None] = lambda s: None,
              endpoint: perf.Endpoint | None = None, tries: int = 2) -> tuple[bool, dict[str, Any], str]:
    """The performance step of the gate (after health, when health.perf_gate_fraction is set): a short bench
    (`runs` per kind, `max_tokens`) compared with the stored baseline of (release, backend).

    Not ok when any kind's median decode tokens/s falls below `fraction` of the baseline's, or a request failed
    or stalled. A measurement that is only below the fraction (every request answered within its budget) is taken
    again, up to `tries` in all, and the gate passes if one of them does: a backend that is slow is slow every
    time, while one stall of a busy machine in a short request (a second's wait before its first token) is not a
    reason to roll back. No baseline -> ok, with a message saying the gate was skipped. Returns (ok, figures, message);
    figures hold per kind the current and baseline tokens/s and their ratio.
    """
    if not 0 < fraction <= 10:
        raise InputError(f"performance gate fraction {fraction!r} must be a number above 0 (e.g. 0.8)")
    state_dir = cfg.paths.state_dir
    base = perf.load_baseline(state_dir, release, backend_name)
    if base is None:
        return True, {}, (f"performance gate skipped: no baseline for {backend_name} in release {release} "
                          "(save one with `deploytool bench --save-baseline`)")
    kinds = [k for k in base["figures"] if k in perf.PROMPTS] or list(perf.DEFAULT_KINDS)
    budget = perf.request_budget(base["figures"], fraction=fraction, max_tokens=max_tokens)
    if budget is not None:
        timeout = min(timeout, budget)
        on_event(f"performance gate: each request must finish within {budget:.1f}s (twice what {fraction:.2f} "
                 "of the baseline pace needs)")
    ep = endpoint or endpoint_for(cfg, timeout=timeout, max_request_s=budget)
    for attempt in range(1, max(1, tries) + 1):
        res = perf.measure(ep, perf.PROMPTS, kinds, runs=runs, max_tokens=max_tokens,
                           warmup=warmup if attempt == 1 else 0, on_event=on_event)
        cmp = perf.compare(res.figures(), base["figures"])
        low = {k: c for k, c in cmp.items() if c["ratio"] is not None and c["ratio"] < fraction}
        failed = [r for r in res.requests if not r.ok]
        if not low or failed or attempt >= tries:
            break
        on_event(f"performance gate: {', '.join(sorted(low))} below {fraction:.2f} of baseline in try {attempt} "
                 f"of {tries}; measuring again")
    parts = []
    for k, c in cmp.items():
        est = "~" if c["estimated"] else ""
        e2e = " e2e" if c["metric"] == "e2e" else ""
        parts.append(f"{k} {est}{perf.fmt_num(c['tokens_per_s'])}{e2e} tok/s vs baseline "
                     f"{perf.fmt_num(c['baseline_tokens_per_s'])} ({perf.fmt_num(c['ratio'], 2)})")
    figures = {"fraction": fraction, "release": release, "backend": backend_name, "kinds": cmp,
               "failed": [f"{r.kind}: {r.error}" for r in failed], "baseline_started": base.get("started"),
               "tries": attempt}
    ok = not low and not failed
    if ok:
        msg = f"performance gate passed (>= {fraction:.2f} of baseline): " + "; ".join(parts)
    else:
        why = []
        if low:
            why.append("below " + f"{fraction:.2f} of baseline: " + ", ".join(sorted(low))
                       + (f", in each of {attempt} tries" if attempt > 1 else ""))
        if failed:
            why.append(f"{len(failed)} request(s) failed: {failed[0].kind}: {failed[0].error}")
        msg = "performance gate failed (" + "; ".join(why) + "): " + "; ".join(parts)
    return ok, figures, msg
