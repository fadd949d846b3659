"""`deploytool status` and `history`: what runs, how it is, and what happened, for people and for machines.

`status` ends with a verdict and exits with its code, like `systemctl is-active`, so a monitor can act on the
code alone (the worst situation found wins):
  0   serving as recorded: the active backend's unit is active, it answers its health check, every backend's
      fingerprints match their pins, no operation is pending
  20  degraded: it serves, but a backend's fingerprints drifted (or cannot be read), another backend's unit is
      failed (the fallback would not come), the running process loaded something unpinned (--deep), a cuda
      backend serves without holding its GPUs (it fell back to the CPU), a path a root step reads is not root's
      alone (deploy_tool.strictmodes: no backend may start until it is fixed), or systemd cannot be asked
  21  pending: an interrupted install, switch or rollback awaits `deploytool recover` (an operation running now,
      its holder alive, is not pending)
  22  not serving: no active backend is recorded, its unit is not active, or it fails its health check
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from deploy_tool import gpu, proc, strictmodes
from deploy_tool.box import fingerprint, frontctl, packedconfig, runtime
from deploy_tool.box import systemd as systemd_mod
from deploy_tool.box.probe import health
from deploy_tool.box.probe.gate import api_key, base_url, host_pid, runtime_truth
from deploy_tool.box.state import State, Store
from deploy_tool.config import Config
from deploy_tool.errors import DeployError, ExitCode
from deploy_tool.render import FRONT_SOCKET, visible_gpus

# a unit whose server runs while its readiness wait (ExecStartPost) has not ended yet
STARTING_SERVER = ("activating", "start-post")
# the verdict's states, by exit code
STATES = {ExitCode.OK: "serving", ExitCode.DEGRADED: "degraded", ExitCode.PENDING: "pending",
          ExitCode.NOT_SERVING: "not-serving"}


def collect(cfg: Config, *, deep: bool = False, sd: Any = None, boot: bool = True) -> dict[str, Any]:
    """Everything `status` shows, ending with its "verdict" (see the module doc). `sd`: the systemd driver
    (default: the config's); boot=False leaves out each unit's boot enablement (the metrics do not show it)."""
    store = Store(cfg.paths.state_dir)
    st = store.load()
    cur = Path(cfg.paths.current)
    rep: dict[str, Any] = {
        "config": cfg.source_path, "active_backend": st.active_backend, "previous_backend": st.previous_backend,
        "release": st.release, "previous_release": st.previous_release,
        "current": os.readlink(cur) if cur.is_symlink() else None,
        "interrupted": st.operation.__dict__ if st.operation else None,
        "operation_running": bool(st.operation) and _holder_alive(store),
        "endpoint": base_url(cfg), "public_endpoint": health.public_url(cfg), "model_name": cfg.serve.model_name,
        "units": {}, "fingerprints": {},
        "events": store.history(5),
        "nothing_serving": nothing_serving(st),
        # a box no install has reached: no release, nothing to compare with pins, nothing serving
        "installed": bool(st.release or st.active_backend or st.operation) or cur.is_symlink(),
    }
    try:
        sd = sd or systemd_mod.for_config(cfg)
        for name in sorted(cfg.backends):
            b = cfg.backends[name]
            try:
                u = sd.show(b.unit)
                rep["units"][name] = {"active": u.active_state, "sub": u.sub_state, "result": u.result,
                                      "enabled": boot_enablement(sd, b.unit) if boot else None,
                                      "main_pid": u.main_pid,
                                      "restarts": u.n_restarts}
            except DeployError as exc:
                rep["units"][name] = {"error": exc.message}
        rep["front"] = _front(cfg, sd, store)
    except DeployError as exc:
        rep["systemd_error"] = exc.message
    serving = _serving(rep, st)
    if serving != st.active_backend:
        rep["serving_backend"] = serving
    # where the installed release's units serve: a config edited since (another port or model name) must not make a
    # box that serves look down; the edit itself is named first below
    released = packedconfig.installed_serve(cfg) if rep["installed"] else None
    asked = replace(cfg, serve=released) if released is not None else cfg
    rep["health"] = _health(asked, serving)
    if released is not None:
        rep["health"]["detail"] += f" (asked as the installed release serves: {released.model_name!r} on port " \
                                   f"{asked.backend_port})"
    for name in sorted(cfg.backends) if rep["installed"] else ():  # no pins before the first install: no drift
        try:
            v = fingerprint.verify(cfg, cfg.backends[name])
            rep["fingerprints"][name] = {"ok": v.ok, "drift": [r.to_json() for r in v.rows]}
            moved = v.config_moved()
            if moved:
                rep["fingerprints"][name]["config_moved"] = moved
        except DeployError as exc:
            rep["fingerprints"][name] = {"ok": False, "error": exc.message.splitlines()[0]}
    active = cfg.backends.get(st.active_backend or "")
    if active is not None and active.device == "cuda" and st.active_backend in rep["units"]:
        rep["gpu"] = _gpu(cfg, visible_gpus(cfg, active), rep["units"][st.active_backend].get("main_pid", 0))
    elif active is not None:
        rep["gpu"] = {"cpu": True, "known": False, "detail": f"{active.name} runs on the CPU (device: cpu): no GPU"}
    rep["unsafe_paths"] = [u.to_json() for u in strictmodes.scan(cfg)]
    diffs = packedconfig.installed_differences(cfg) if rep["installed"] else None
    if diffs:  # the units run the release's config, which the health check above asked by
        rep["config_differs"] = packedconfig.describe(diffs, "release")
    if deep and st.active_backend and st.active_backend in rep["units"]:
        rep["runtime"] = _runtime(cfg, st.active_backend, rep["units"][st.active_backend].get("main_pid", 0))
    code, reasons = verdict(rep)
    rep["verdict"] = {"exit_code": int(code), "state": STATES[code], "reasons": reasons}
    return rep


def _serving(rep: dict[str, Any], st: State) -> str | None:
    """The backend that serves: the recorded active one; but while an interrupted switch, rollback or failover
    awaits `recover` (its deploytool gone), its target when that one's unit runs and the recorded one's does not
    (the kill came after the start, before the commit)."""
    op = st.operation
    if op is None or rep["operation_running"] or op.kind == "install" or not op.to_backend:
        return st.active_backend
    units = rep["units"]

    def up(name: str | None) -> bool:
        return bool(name) and (units.get(name) or {}).get("active") in ("active", "activating")

    return op.to_backend if up(op.to_backend) and not up(st.active_backend) else st.active_backend


def verdict(rep: dict[str, Any]) -> tuple[ExitCode, list[str]]:
    """The exit code of `status` for the report `rep` (the worst situation found wins) and every reason found,
    worst first. Pure: the report's fields only."""
    active = rep.get("serving_backend") or rep.get("active_backend")
    units = rep.get("units") or {}
    down: list[str] = []
    if rep.get("installed") is False:
        down.append("nothing is installed on this box (deploytool install BUNDLE sets it up)")
    elif not active:
        down.append("no active backend is recorded")
    else:
        u = units.get(active)
        # activating/start-post: the server runs and its unit's readiness wait (ExecStartPost) has not ended yet;
        # the health check below says whether it serves
        if u is not None and "error" not in u and u.get("active") != "active" and \
                (u.get("active"), u.get("sub")) != STARTING_SERVER:
            down.append(f"{active} is {u.get('active')}/{u.get('sub')}")
        if not (rep.get("health") or {}).get("ok"):
            down.append(f"{active} fails its health check: {(rep.get('health') or {}).get('detail')}")
    pending: list[str] = []
    op = rep.get("interrupted")
    if op and not rep.get("operation_running"):
        pending.append(f"an interrupted {op.get('kind')} (step {op.get('step')}) awaits `deploytool recover`")
    degraded: list[str] = []
    first: list[str] = []  # the cause of what else is found: named before it, whatever the verdict
    note: list[str] = []  # and what explains it without being wrong itself
    if op and rep.get("operation_running"):  # a backend stopped or starting is this operation's doing
        note.append(f"a {op.get('kind')} is in progress (step {op.get('step')}, pid {op.get('pid')}): the front "
                     "holds new requests until a backend is ready")
    if rep.get("config_differs"):
        first.append(f"the config differs from the one the installed release was packed with, which its units "
                     f"run (a switch refuses to start a backend until it matches): {rep['config_differs']}")
    if rep.get("systemd_error"):
        degraded.append(f"systemd cannot be asked: {rep['systemd_error']}")
    for name, u in sorted(units.items()):
        if "error" in u:
            degraded.append(f"{name}: {u['error']}")
        elif name != active and u.get("active") == "failed":
            degraded.append(f"{name} is failed ({u.get('result')}): the fallback's last start failed (why: "
                            f"`deploytool logs {name}`; once fixed, `systemctl reset-failed {name}.service` clears it)")
    front = rep.get("front")
    if front and front.get("installed") and front.get("socket") != "active" and rep.get("installed"):
        degraded.append(f"the public port is not held: {FRONT_SOCKET} is {front.get('socket')} (clients are refused "
                        f"while no backend is ready; `systemctl start {FRONT_SOCKET}`)")
    for name, fp in sorted((rep.get("fingerprints") or {}).items()):
        if not fp.get("ok"):
            what = fp.get("error") or _drifted(fp.get("drift") or []) or "drifted"
            degraded.append(f"{name} drifted from its pins: {what}"
                            + (f" ({fp['config_moved']})" if fp.get("config_moved") else ""))
    g = rep.get("gpu")
    if g and g.get("known") and not g.get("ok"):
        degraded.append(f"{active} serves without its GPUs: no process of it holds {', '.join(g.get('missing', []))}")
    for u in rep.get("unsafe_paths") or []:
        degraded.append(f"{u['path']} is not root's alone ({' and '.join(u['problems'])}), so no backend may start: "
                        f"{u['fix']}")
    rt = rep.get("runtime")
    if rt and rt.get("failures"):
        degraded.append(f"{active} loaded something unpinned: {rt['failures'][0]}")
    code = (ExitCode.NOT_SERVING if down else ExitCode.PENDING if pending else ExitCode.DEGRADED if degraded or first
            else ExitCode.OK)
    return code, note + first + down + pending + degraded


def _front(cfg: Config, sd: Any, store: Store) -> dict[str, Any]:
    """The public port: whether its socket unit is installed and active, the front's counters since it started,
    and what the clients saw in the last operation that recorded them (its history event's `clients`)."""
    installed = sd.unit_path(FRONT_SOCKET).exists()
    out: dict[str, Any] = {"installed": installed, "port": cfg.serve.port, "backend_port": cfg.backend_port,
                           "hold_timeout_s": cfg.hold_timeout_s}
    if not installed:
        return out
    out["socket"] = sd.show(FRONT_SOCKET).active_state
    out["counters"] = frontctl.stats(cfg)
    last = next((e for e in reversed(store.history(50)) if isinstance(e.get("clients"), dict)), None)
    if last is not None:
        out["last_operation"] = {"event": last.get("event"), "time": last.get("time"), **last["clients"]}
    return out


def _holder_alive(store: Store) -> bool:
    """Whether a live deploytool holds the lock (an operation running now, not one a kill left behind)."""
    try:
        return store.holder() is not None
    except DeployError:
        return False


def nothing_serving(st: State) -> str | None:
    """The plain line after a failover that failed, while nothing is recorded active (deploy_tool.box.failover
    keeps its last attempt in state.json's extra.failover)."""
    last = st.extra.get("failover")
    if st.active_backend is not None or not isinstance(last, dict) or last.get("result") != "failed":
        return None
    return (f"nothing serving: {last.get('from')} failed, failover to {last.get('to')} failed at {last.get('at')}"
            + (f" ({last['error']})" if last.get("error") else ""))


def boot_enablement(sd: Any, unit: str) -> str:
    """Whether systemd will start `unit` at the next boot: enabled, disabled, masked, static, not-found, ...

    Not `systemctl show -p UnitFileState`: the manager caches that per unit until a daemon-reload, and switch
    flips the [Install] symlinks with `enable/disable --no-reload`, so after a switch it still names the old
    backend as enabled. `systemctl is-enabled` asks the manager's GetUnitFileState, which reads the unit
    directories' symlinks (the *.wants/ links that boot acts on, masks in /etc and /run) afresh on every call,
    with systemd's own install logic: true without a reload (status must not reload the manager), and one
    call per backend.
    """
    try:
        return str(sd.is_enabled(unit))
    except DeployError:
        return "unknown"


#: drifted items a reason or a unit's row names; the rest are counted (the JSON's `fingerprints` has them all)
DRIFT_NAMED = 5


def _drifted(rows: list[dict[str, Any]]) -> str:
    """The first DRIFT_NAMED drifted items by label, and how many more (a release half laid down drifts in
    thousands of files: the verdict stays readable)."""
    labels = [str(d.get("label", "?")) for d in rows]
    more = len(labels) - DRIFT_NAMED
    return ", ".join(labels[:DRIFT_NAMED]) + (f" and {more} more (`deploytool verify` lists them)" if more > 0 else "")


def _health(cfg: Config, active: str | None) -> dict[str, Any]:
    if not active or active not in cfg.backends:
        return {"ok": False, "detail": "no active backend"}
    b = cfg.backends[active]
    try:
        r = health.wait_ready(b.kind, base_url(cfg), cfg.serve.model_name, api_key=api_key(cfg),
                              timeout=0, interval=0.1)
        return {"ok": True, "detail": f"ready, serving {', '.join(r.served_models) or cfg.serve.model_name}"}
    except DeployError as exc:
        return {"ok": False, "detail": exc.message.splitlines()[0]}


def _gpu(cfg: Config, gpus: tuple[int, ...], main_pid: int) -> dict[str, Any]:
    """The active cuda backend's hold on its GPUs (deploy_tool.gpu), and the GPU memory its processes use as the
    driver's nvidia-smi lists it (when the box has nvidia-smi)."""
    out: dict[str, Any] = {"gpus": list(gpus)}
    if not main_pid:
        return {**out, "known": False, "detail": "no main process"}
    try:
        hp = host_pid(cfg, main_pid)
    except DeployError as exc:
        return {**out, "known": False, "detail": exc.message}
    res = runtime.gpu_residency(hp, gpus)
    out.update(res.to_json())
    out["detail"] = res.describe("the server")
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            r = proc.run([smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         timeout=10, ok=range(256))
            apps = gpu.parse_compute_apps(r.stdout) if r.returncode == 0 else {}
            out["memory_mib"] = sum(apps.get(p, 0) for p in res.pids)
        except DeployError:
            pass
    return out


def _runtime(cfg: Config, name: str, pid: int) -> dict[str, Any]:
    if not pid:
        return {"status": "unknown", "rows": [], "detail": "no main process"}
    b = cfg.backends[name]

    def journal() -> str:
        try:
            return systemd_mod.for_config(cfg).journal(b.unit, lines=2000)
        except DeployError:
            return ""

    return runtime_truth(cfg, b, pid, journal_text=journal)


def format_status(rep: dict[str, Any]) -> str:
    def ok(flag: bool) -> str:
        return click.style("ok", fg="green") if flag else click.style("FAIL", fg="red", bold=True)

    v = rep.get("verdict")
    lines = []
    if v:
        color = "green" if v["exit_code"] == 0 else "red" if v["exit_code"] == ExitCode.NOT_SERVING else "yellow"
        head = click.style(f"{v['state'].upper()} (exit {v['exit_code']})", fg=color, bold=v["exit_code"] != 0)
        lines.append(f"verdict   {head}" + (f": {'; '.join(v['reasons'])}" if v["reasons"] else ""))
    lines += [f"config    {rep['config']}",
             f"{'serving' if rep.get('installed', True) else 'endpoint':9} {rep['model_name']!r} at "
             f"{rep.get('public_endpoint') or rep['endpoint']} (backend {rep['endpoint']})"
             f"  health: {ok(rep['health']['ok'])} "
             f"({rep['health']['detail']})",
             f"active    {rep['active_backend'] or '(none)'}   previous: {rep['previous_backend'] or '-'}"
             + (f"   serving: {rep['serving_backend']} (the interrupted operation's target: `deploytool recover` "
                "commits or undoes it)" if rep.get("serving_backend") else ""),
             f"release   {rep['release'] or '(none)'}   current -> {rep['current'] or '-'}"]
    if rep.get("nothing_serving"):
        lines.append(click.style(rep["nothing_serving"], fg="red", bold=True))
    if rep.get("interrupted"):
        op = rep["interrupted"]
        if rep.get("operation_running"):
            lines.append(click.style(f"IN PROGRESS {op['kind']} {op.get('from_backend') or '-'} -> {op.get('to_backend') or '-'} "
                                     f"at step {op['step']} (pid {op['pid']})", fg="yellow"))
        else:
            lines.append(click.style(f"INTERRUPTED {op['kind']} {op.get('from_backend') or '-'} -> {op.get('to_backend') or '-'} "
                                     f"at step {op['step']} (pid {op['pid']}): run `deploytool recover`", fg="yellow"))
    if rep.get("systemd_error"):
        lines.append(click.style(f"systemd: {rep['systemd_error']}", fg="red"))
    for u in rep.get("unsafe_paths") or []:
        lines.append(click.style(f"unsafe    {u['path']} ({u['what']}): owner {u['uid']}:{u['gid']}, mode {u['mode']}, "
                                 f"{' and '.join(u['problems'])}; fix: {u['fix']}", fg="red"))
    lines.append("units")
    for name, u in rep["units"].items():
        if "error" in u:
            lines.append(f"  {name:20} {u['error']}")
            continue
        fp = rep["fingerprints"].get(name)
        fps = "" if fp is None else ("  fingerprints " + (ok(True) if fp.get("ok") else
                                                          ok(False) + " " + (fp.get("error") or
                                                                             _drifted(fp["drift"]))))
        lines.append(f"  {name:20} {u['active']}/{u['sub']:10} {u['enabled']:9} pid {u['main_pid'] or '-':>7}"
                     f"  restarts {u['restarts']}{fps}")
    if rep.get("gpu"):
        g = rep["gpu"]
        mem = f", {g['memory_mib']} MiB in use" if g.get("memory_mib") is not None else ""
        mark = "-" if g.get("cpu") else ok(bool(g.get("ok")))
        lines.append(f"gpus      {mark} {g.get('detail', '')}{mem}")
    if rep.get("runtime"):
        rt = rep["runtime"]
        lines.append(f"runtime   {rt.get('status')}")
        for row in rt.get("rows", [])[:20]:
            lines.append(f"  {row.get('what', ''):10} {row.get('name', ''):28} {row.get('status', ''):8} "
                         f"{row.get('detail', '')}")
    if rep["events"]:
        lines.append("last events")
        lines += ["  " + ln for ln in format_history(rep["events"]).splitlines()]
    return "\n".join(lines)


def format_history(events: list[dict[str, Any]]) -> str:
    if not events:
        return "no events yet"
    out = []
    for e in events:
        what = e.get("event", "?")
        ok = e.get("ok")
        mark = "ok  " if ok else ("FAIL" if ok is False else "    ")
        move = ""
        if e.get("from_backend") or e.get("to_backend"):
            move = f" {e.get('from_backend') or '-'} -> {e.get('to_backend') or '-'}"
        elif e.get("backend"):  # pin: which backend's fingerprints
            move = f" {e['backend']}"
        extra = e.get("outcome") or ""
        rel = f" release {e['release']}" if e.get("release") else ""
        reason = f": {e['reason']}" if e.get("reason") else ""
        out.append(f"{e.get('time', '')[:19]} {mark} {what}{move}{f' {extra}' if extra else ''}{rel}{reason}".rstrip())
    return "\n".join(out)
