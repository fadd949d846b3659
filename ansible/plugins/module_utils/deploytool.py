# -*- coding: utf-8 -*-
# The part the deploytool.fleet modules share: find deploytool on the host, run it with --json, read what it
# says, and turn a failure into a failed task carrying deploytool's exit code, reason and journal tail.
# Runs on the managed host with its python3 (stdlib and ansible's module_utils only).

from __future__ import annotations

import json
import os

DEFAULT_CONFIG = "/etc/deploytool/deploytool.yaml"
DEFAULT_ROOT = "/opt/deploytool"
FLEET_DIR = "/var/lib/deploytool/fleet"

# `deploytool status` exits with the box's state: these are states, not errors
STATUS_STATES = {0: "serving", 20: "degraded", 21: "pending", 22: "not-serving"}

# the options of every module that runs deploytool on the host (doc_fragments/common.py documents them)
COMMON_ARGS = dict(
    config=dict(type="path", default=DEFAULT_CONFIG),
    deploytool=dict(type="path", default=None),
    root=dict(type="path", default=DEFAULT_ROOT),
)

# the modules that change a host (release, switch, rollback) also take a fleet run id to record what it had
RECORD_ARGS = dict(record_run=dict(type="str", default=None))


def tool_path(module):
    """deploytool's CLI on the host (the installed release's own), or None on a box without deploytool."""
    given = module.params.get("deploytool")
    if given:
        if not os.access(given, os.X_OK):
            module.fail_json(msg="deploytool option: %s is not an executable file" % given,
                             hint="leave the option out to use ROOT/current/tool/bin/deploytool")
        return given
    p = os.path.join(module.params.get("root") or DEFAULT_ROOT, "current", "tool", "bin", "deploytool")
    return p if os.access(p, os.X_OK) else None


def parse_json(stdout):
    """The JSON document deploytool printed (--json), or None."""
    text = (stdout or "").strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        start = text.find("{")  # tolerate lines before the document (a bootstrap's own messages)
        if start > 0:
            try:
                return json.loads(text[start:])
            except ValueError:
                return None
        return None


def run(module, argv, check_rc=False):
    """Run argv on the host; returns (rc, parsed JSON or None, stdout, stderr). Never a shell."""
    env = {"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    rc, out, err = module.run_command(argv, environ_update=env, check_rc=check_rc)
    return rc, parse_json(out), out, err


def dt(module, tool, *args, config=None):
    """`deploytool --config CONFIG --json ARGS...`."""
    cfg = config or module.params.get("config") or DEFAULT_CONFIG
    return run(module, [tool, "--config", cfg, "--json"] + list(args))


def status(module, tool, config=None):
    """`deploytool status --json` as a dict, with `state` (serving, degraded, pending, not-serving) and
    `exit_code`; None when the box has no deploytool; {"error": ...} when status itself failed."""
    if tool is None:
        return None
    rc, data, out, err = dt(module, tool, "status", config=config)
    if rc in STATUS_STATES and isinstance(data, dict) and "verdict" in data:
        data = dict(data)
        data["state"] = STATUS_STATES[rc]
        data["exit_code"] = rc
        return data
    return {"error": _reason(data, out, err), "exit_code": rc, "state": "unknown"}


def summary(st):
    """What diff mode shows of a box: release, active backend, each backend unit's state."""
    if not st or "error" in st:
        return {"release": None, "active_backend": None, "units": {}}
    units = {}
    for name, u in sorted((st.get("units") or {}).items()):
        units[name] = u.get("active") if isinstance(u, dict) else u
    return {"release": st.get("release"), "active_backend": st.get("active_backend"), "units": units}


def _reason(data, out, err):
    if isinstance(data, dict) and data.get("message"):
        return str(data["message"])
    text = (err or "").strip() or (out or "").strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    errs = [ln for ln in lines if ln.startswith("error:")]
    return (errs[-1][len("error:"):].strip() if errs else (lines[-1] if lines else "no output"))


def journal_tail(module, tool, data, config=None):
    """The failed backend's journal tail: the last history event's (switch, rollback, install record it), else
    the lines deploytool put in its message after "journal tail:"."""
    if tool is not None:
        rc, events = dt(module, tool, "history", "--limit", "1", config=config)[:2]
        if rc == 0 and isinstance(events, list) and events and events[-1].get("journal_tail"):
            return str(events[-1]["journal_tail"])
    msg = str(data.get("message", "")) if isinstance(data, dict) else ""
    if "journal tail:" in msg:
        return msg.split("journal tail:", 1)[1].strip()
    st = status(module, tool, config) if tool is not None else None
    units = []
    for name in sorted((st or {}).get("units") or {}):
        units += ["-u", "%s.service" % name]
    if not units:
        return ""
    rc, out = module.run_command(["journalctl", "--no-pager", "-q", "-n", "20"] + units)[:2]
    return out.strip() if rc == 0 else ""


def fail(module, what, rc, data, out, err, tool=None, config=None, **extra):
    """A failed task: deploytool's exit code, its reason (message), hint, details and the journal tail."""
    reason = _reason(data, out, err)
    res = dict(extra)
    res.update(msg="%s failed (deploytool exit %d): %s" % (what, rc, reason), exit_code=rc, reason=reason,
               journal_tail=journal_tail(module, tool, data, config) if rc not in (0, 2, 3, 5, 6, 12) else "",
               stderr_lines=(err or "").splitlines()[-20:])
    if isinstance(data, dict):
        for k in ("error", "hint", "details"):
            if k in data:
                res[k] = data[k]
    module.fail_json(**res)


def write_record(module, playbook, before, **extra):
    """Before a fleet run (record_run = its id) changes this host: what the host had (release, backend, the config
    it ran with), in FLEET_DIR/last-run.json, for revert.yml. Not in check mode."""
    run_id = module.params.get("record_run")
    if not run_id or module.check_mode:
        return None
    rundir = os.path.join(FLEET_DIR, "runs", run_id)
    os.makedirs(rundir, mode=0o755, exist_ok=True)
    cfg_copy = None
    config = module.params.get("config") or DEFAULT_CONFIG
    if before.get("release") and os.path.isfile(config):
        cfg_copy = os.path.join(rundir, "deploytool.yaml")
        with open(config, "rb") as src, open(cfg_copy + ".tmp", "wb") as dst:
            dst.write(src.read())
        os.replace(cfg_copy + ".tmp", cfg_copy)
    dest = module.params.get("dest") or "/var/lib/deploytool/bundles"
    rec = dict(run_id=run_id, playbook=playbook, release=before.get("release"), backend=before.get("active_backend"),
               bundle=os.path.join(dest, before["release"]) if before.get("release") else None, config=cfg_copy,
               reverted=False)
    rec.update(extra)
    path = os.path.join(FLEET_DIR, "last-run.json")
    with open(path + ".tmp", "w") as f:
        json.dump(rec, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    return rec


def switch_like(module, what, args):
    """switch / rollback: `deploytool [--dry-run] ARGS --json`; changed false when already on the target; a
    rolled-back switch (exit 10) and a failed rollback (11) are failed tasks with rolled_back true. status is read
    only for diff mode and failures (a switch's own result names the backends: it is the fleet switch's hot path)."""
    tool = tool_path(module)
    if tool is None:
        module.fail_json(msg="%s: deploytool is not installed on this host (no %s)" % (
            what, os.path.join(module.params.get("root") or DEFAULT_ROOT, "current/tool/bin/deploytool")),
            exit_code=5, reason="deploytool not installed", hint="install a release first (deploytool.fleet.release)")
    before = summary(status(module, tool)) if module._diff else None
    if module.params.get("record_run") and not module.check_mode:
        rc, plan, out, err = dt(module, tool, "--dry-run", *args)
        if rc != 0 or not isinstance(plan, dict):
            fail(module, what, rc if rc != 0 else 70, plan, out, err, tool=tool)
        if not any(s.get("name") == "noop" for s in plan.get("steps") or []):
            st = before or dict(release=None, active_backend=plan.get("from_backend"), units={})
            write_record(module, what, st, to_backend=plan.get("to_backend"))
    argv = (["--dry-run"] if module.check_mode else []) + list(args)
    rc, data, out, err = dt(module, tool, *argv)
    res = dict(changed=False, rolled_back=False)
    if rc != 0 or not isinstance(data, dict):
        res["rolled_back"] = rc in (10, 11)
        if isinstance(data, dict) and isinstance(data.get("details"), dict):
            res["restored"] = data["details"].get("restored")
        res["after"] = summary(status(module, tool))
        fail(module, what, rc if rc != 0 else 70, data, out, err, tool=tool, **res)
    action = data.get("action")
    target = data.get("to_backend")
    res.update(action=action, backend=target, from_backend=data.get("from_backend"),
               seconds=data.get("seconds"), gate=data.get("gate"), drain=data.get("drain"))
    if before is None:
        before = dict(release=None, active_backend=data.get("from_backend"), units={})
    res["before"] = before
    if action == "planned":
        res["changed"] = not any(s.get("name") == "noop" for s in data.get("steps") or [])
        res["plan"] = data.get("plan")
        res["after"] = dict(before, active_backend=target)
        res["msg"] = "check mode: " + ("nothing to do: %s is active" % target if not res["changed"]
                                       else "would %s to %s" % (what, target))
    else:
        res["changed"] = action != "noop"
        res["after"] = summary(status(module, tool)) if module._diff else dict(before, active_backend=target)
        res["msg"] = data.get("message") or action
    if module._diff:
        res["diff"] = dict(before=before, after=res["after"])
    module.exit_json(**res)
