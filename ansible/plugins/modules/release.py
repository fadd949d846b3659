#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: deploytool maintainers; MIT License (see LICENSE)
# deploytool.fleet.release: install a release from a bundle directory on the host.

from __future__ import annotations

DOCUMENTATION = r"""
---
module: release
short_description: Install a deploytool release from a bundle directory on the host
version_added: 0.1.0
author: deploytool maintainers (@deploytool)
description:
  - Installs the bundle directory O(bundle) on the host with deploytool's own C(install) (verify, unpack, units,
    pins, start the default backend behind the health gate). A host without deploytool is bootstrapped from the
    bundle (C(python3 BUNDLE/bootstrap)), with no network and no pip; so is a host whose deploytool does not read
    the bundle's MANIFEST format (deploytool 0.1.0 and a bundle of format 2, packed by 0.2.0 or later, whose venv
    comes as one archive per distribution), so that the bundle installs with the deploytool it carries. That
    needs the bundle to carry deploytool's wheel (C(tool/wheels/deploytool-*.whl)); without it the host's refusal
    is the task's failure.
  - Idempotent - the release already installed and serving is C(changed=false) (install says "no-op").
  - The config - a bundle is packed for one config and install refuses it under another. With O(config_content)
    (the fleet's config, e.g. C(lookup('file', 'deploytool.yaml'))) the module puts it at O(config) first (only
    when it differs; put back as it was if the install fails).
options:
  bundle:
    description: The bundle directory on the host (what M(deploytool.fleet.ship) returns as C(path)).
    type: path
    required: true
  config_content:
    description: The config to install at O(config) before the release (text); omitted, the host's own is used.
    type: str
  record_run:
    description:
      - A fleet run id - before changing the host, record what it had (release, backend, config) in
        C(/var/lib/deploytool/fleet/last-run.json) for the C(deploytool.fleet.revert) playbook.
    type: str
  dest:
    description: Where the host keeps bundles (O(dest)/<release id>; the record names the previous one there).
    type: path
    default: /var/lib/deploytool/bundles
  keys_dir:
    description: Trusted public keys on the host to check the bundle with (default the config's C(paths.keys_dir)).
    type: path
  python:
    description: The interpreter that runs the bundle's bootstrap on a host without deploytool (3.11 or newer).
    type: str
    default: python3
  start:
    description: Start the default backend behind the health gate (V(false) - C(install --no-start)).
    type: bool
    default: true
extends_documentation_fragment:
  - deploytool.fleet.common
attributes:
  check_mode:
    support: full
    description: Runs C(deploytool install --dry-run) (with O(config_content) in a file beside O(config)) and changes
      nothing; a bundle not shipped yet is reported as planned.
  diff_mode:
    support: full
    description: The release, active backend and unit states before and after.
  platform:
    support: full
    platforms: posix
    description: A Linux box with systemd, python3 and the bundle directory.
seealso:
  - module: deploytool.fleet.ship
"""

RETURN = r"""
release:
  description: The release installed (the bundle's id; in check mode, the one that would be).
  type: str
  returned: success
  sample: 1be71fe02a5d08cc
backend:
  description: The backend serving after the install.
  type: str
  returned: success
action:
  description:
    - What install did - V(installed), V(started), V(noop) (already installed and serving), V(planned) (check
      mode) or V(bootstrap-planned) (check mode on a host without deploytool).
  type: str
  returned: success
bootstrapped:
  description: The host had no deploytool, or one that does not read the bundle's format, and was bootstrapped from the bundle.
  type: bool
  returned: always
config_changed:
  description: O(config_content) differed from the host's config and was written (in check mode, would be).
  type: bool
  returned: when the bundle is on the host
bundle:
  description: The bundle directory installed from.
  type: str
  returned: always
config:
  description: The config on the host.
  type: str
  returned: always
install:
  description: C(deploytool install --json)'s own report.
  type: dict
  returned: success
plan:
  description: The steps the install would take.
  type: list
  elements: str
  returned: check mode
before:
  description: Release, active backend and unit states before.
  type: dict
  returned: always
  sample: {release: 1be71fe02a5d08cc, active_backend: ftllm-dflash, units: {ftllm-dflash: active}}
after:
  description: The same after (or as planned in check mode).
  type: dict
  returned: success
exit_code:
  description: deploytool's exit code.
  type: int
  returned: failure
reason:
  description: deploytool's reason for the failure.
  type: str
  returned: failure
journal_tail:
  description: The backend's journal tail.
  type: str
  returned: failure
"""

EXAMPLES = r"""
- name: Install the release shipped before
  deploytool.fleet.release:
    bundle: /var/lib/deploytool/bundles/1be71fe02a5d08cc
    config_content: "{{ lookup('file', 'deploytool.yaml') }}"
    record_run: "{{ run_id }}"
"""

import os
import tempfile

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.deploytool.fleet.plugins.module_utils import deploytool as dtu


def _manifest_id(bundle):
    """The bundle id its MANIFEST names (read, not verified: only for what check mode reports)."""
    import json

    try:
        with open(os.path.join(bundle, "MANIFEST"), "rb") as f:
            obj = json.loads(f.read().decode("utf-8"))
        return str(obj["bundle_id"]) if isinstance(obj, dict) and obj.get("bundle_id") else None
    except (OSError, ValueError, KeyError):
        return None


def _read(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _write_atomic(path, data):
    d = os.path.dirname(path) or "."
    os.makedirs(d, mode=0o755, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".fleet-", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def main():
    spec = dict(dtu.COMMON_ARGS, **dtu.RECORD_ARGS)
    spec.update(bundle=dict(type="path", required=True), dest=dict(type="path", default="/var/lib/deploytool/bundles"),
                config_content=dict(type="str", default=None),
                keys_dir=dict(type="path", default=None), start=dict(type="bool", default=True),
                python=dict(type="str", default="python3"))
    module = AnsibleModule(argument_spec=spec, supports_check_mode=True)
    p = module.params
    bundle, config = p["bundle"].rstrip("/"), p["config"]
    tool = dtu.tool_path(module)
    before_st = dtu.status(module, tool)
    before = dtu.summary(before_st)
    res = dict(changed=False, bundle=bundle, config=config, before=before, bootstrapped=False)

    if not os.path.isdir(bundle) or not os.path.isfile(os.path.join(bundle, "MANIFEST")):
        if module.check_mode:
            # the ship before it did not run in check mode either: report what would be installed
            # the bundle directory is named by its release id (DEST/<release id>)
            rid = os.path.basename(bundle)
            res.update(changed=before["release"] != rid, action="planned", release=rid,
                       msg="check mode: bundle %s is not on the host yet; it would be shipped and installed" % bundle,
                       after=dict(before, release=rid))
            if module._diff:
                res["diff"] = dict(before=before, after=res["after"])
            module.exit_json(**res)
        module.fail_json(msg="bundle %s: no bundle directory (with a MANIFEST) on the host" % bundle, exit_code=5,
                         reason="bundle not found", hint="ship it first (deploytool.fleet.ship), or fix `bundle`",
                         **res)

    # the config: the fleet's one at `config`, only when it differs (put back if the install fails)
    old_cfg = _read(config)
    new_cfg = p["config_content"].encode() if p["config_content"] is not None else None
    if new_cfg is not None and not new_cfg.endswith(b"\n"):
        new_cfg += b"\n"
    cfg_changes = new_cfg is not None and new_cfg != old_cfg
    if new_cfg is None and old_cfg is None:
        module.fail_json(msg="config %s not found on the host and no config_content given" % config, exit_code=5,
                         reason="config not found", hint="pass config_content (the fleet's deploytool.yaml)", **res)
    if not module.check_mode and module.params.get("record_run"):
        rid = _manifest_id(bundle) or os.path.basename(bundle)
        serving = before["active_backend"] and before["units"].get(before["active_backend"]) == "active"
        if cfg_changes or before["release"] != rid or not serving:
            dtu.write_record(module, "rollout", before, to_release=rid)
    run_cfg, tmp_cfg = config, None
    if cfg_changes and module.check_mode:
        # the dry-run reads the new config from a file beside the real one (relative paths resolve alike)
        d = os.path.dirname(config)
        fd, tmp_cfg = tempfile.mkstemp(prefix=".fleet-check-", suffix=".yaml", dir=d if os.path.isdir(d) else None)
        with os.fdopen(fd, "wb") as f:
            f.write(new_cfg)
        run_cfg = tmp_cfg
    elif cfg_changes:
        _write_atomic(config, new_cfg)
    res["config_changed"] = bool(cfg_changes)

    try:
        extra = (["--keys", p["keys_dir"]] if p["keys_dir"] else []) + ([] if p["start"] else ["--no-start"])
        why = None if tool is not None else "the host has no deploytool"
        if tool is not None:
            args = (["--dry-run"] if module.check_mode else []) + ["install", bundle] + extra
            rc, data, out, err = dtu.dt(module, tool, *args, config=run_cfg)
            tool_after = dtu.tool_path(module) or tool
            if rc == 6 and _format_too_new(data, dtu._reason(data, out, err)) and _carries_deploytool(bundle):
                why = "the host's deploytool does not read this bundle's format"
        if why is not None:
            # the bundle installs itself with the deploytool it carries (a host without one, or with one older
            # than the bundle's MANIFEST format: a format-2 bundle on deploytool 0.1.0)
            if module.check_mode:
                rid = _manifest_id(bundle) or os.path.basename(bundle)
                res.update(changed=True, action="bootstrap-planned", release=rid, bootstrapped=False,
                           msg="check mode: %s; it would be bootstrapped from %s" % (why, bundle),
                           after=dict(release=rid, active_backend=before["active_backend"] or
                                      "(the config's default_backend)", units=before["units"]))
                if module._diff:
                    res["diff"] = dict(before=before, after=res["after"])
                module.exit_json(**res)
            argv = [p["python"], os.path.join(bundle, "bootstrap"),
                    "--config", config] + extra + ["--json"]
            rc, data, out, err = dtu.run(module, argv)
            res["bootstrapped"] = True
            tool_after = dtu.tool_path(module)
        if rc != 0 or not isinstance(data, dict):
            if cfg_changes and not module.check_mode:
                after_st = dtu.status(module, tool_after)
                if dtu.summary(after_st)["release"] == before["release"]:
                    if old_cfg is None:
                        os.unlink(config)
                    else:
                        _write_atomic(config, old_cfg)
                    res["config_changed"] = False
            dtu.fail(module, "install of %s" % os.path.basename(bundle), rc if rc != 0 else 70, data, out, err,
                     tool=tool_after, **res)
        action = data.get("action")
        res.update(action=action, install=data, release=data.get("release"), backend=data.get("backend"))
        if action == "planned":
            steps = [s.get("name") or s.get("step") for s in data.get("steps") or []]
            rid = _manifest_id(bundle) or os.path.basename(bundle)
            same = before["release"] is not None and before["release"] in (rid, os.path.basename(bundle))
            res["changed"] = bool(cfg_changes) or not same or \
                before["units"].get(before["active_backend"]) != "active"
            res["release"] = rid if not same else before["release"]
            res["plan"] = steps
            res["after"] = dict(release=res["release"], active_backend=before["active_backend"] if same
                                else data.get("backend"), units=before["units"])
            res["msg"] = "check mode: " + ("nothing to do" if not res["changed"] else
                                           "would install %s" % res["release"])
        else:
            res["changed"] = action != "noop" or bool(cfg_changes)
            res["after"] = dtu.summary(dtu.status(module, tool_after))
            res["msg"] = data.get("message") or action
        if module._diff:
            res["diff"] = dict(before=before, after=res["after"])
        module.exit_json(**res)
    finally:
        if tmp_cfg and os.path.exists(tmp_cfg):
            os.unlink(tmp_cfg)


def _format_too_new(data, message):
    """Whether an install failed only because the host's deploytool predates the bundle's MANIFEST format: the
    reason its --json error carries (deploy_tool/manifest.py, since format 1), else the words of its message."""
    details = data.get("details") if isinstance(data, dict) else None
    if isinstance(details, dict) and details.get("reason"):
        return details["reason"] == "format-version-unsupported"
    return "format_version" in message and "is not supported" in message


def _carries_deploytool(bundle):
    """Whether the bundle's MANIFEST lists deploytool's own wheel (tool/wheels/deploytool-*.whl), which its
    bootstrap installs with (read, not verified: the bootstrap verifies the signature before it uses any)."""
    import json

    try:
        with open(os.path.join(bundle, "MANIFEST"), "rb") as f:
            obj = json.loads(f.read().decode("utf-8"))
        return any(str(e.get("path", "")).startswith("tool/wheels/deploytool-") and str(e["path"]).endswith(".whl")
                   for e in obj["files"] if isinstance(e, dict))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


if __name__ == "__main__":
    main()
