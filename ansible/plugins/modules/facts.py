#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: deploytool maintainers; MIT License (see LICENSE)
# deploytool.fleet.facts: `deploytool status --json` as ansible_facts.deploytool.

from __future__ import annotations

DOCUMENTATION = r"""
---
module: facts
short_description: deploytool's status of a box as ansible_facts.deploytool
version_added: 0.1.0
author: deploytool maintainers (@deploytool)
description:
  - Runs C(deploytool status --json) on the host and returns it as C(ansible_facts.deploytool), with C(state)
    (serving, degraded, pending, not-serving) and C(exit_code) (0, 20, 21, 22) added.
  - Never fails on a box that is not serving - that is a state, reported in the facts. A host without deploytool
    gets C(installed=false) and C(state=absent). It fails only when status itself cannot run (a broken config).
  - The facts also carry the host's last fleet run record as C(ansible_facts.deploytool_fleet_run) (what the
    C(deploytool.fleet.revert) playbook reads), or null.
options:
  deep:
    description: Also read what the running process loaded (C(status --deep)).
    type: bool
    default: false
extends_documentation_fragment:
  - deploytool.fleet.common
attributes:
  check_mode:
    support: full
    description: It only reads; check mode runs it as usual.
  diff_mode:
    support: none
    description: Nothing changes, so there is no diff.
  facts:
    support: full
    description: Returns C(ansible_facts.deploytool) and C(ansible_facts.deploytool_fleet_run).
  platform:
    support: full
    platforms: posix
    description: A Linux box with systemd (with or without deploytool).
"""

RETURN = r"""
ansible_facts:
  description: What the box reports.
  type: dict
  returned: always
  contains:
    deploytool:
      description:
        - The report of C(deploytool status --json) (release, active_backend, units, verdict, ...) plus
          C(state) (serving, degraded, pending, not-serving, absent), C(exit_code) and C(installed).
      type: dict
      returned: always
    deploytool_fleet_run:
      description: The host's last fleet run record (C(/var/lib/deploytool/fleet/last-run.json)), or null.
      type: dict
      returned: always
"""

EXAMPLES = r"""
- name: Read the box's status
  deploytool.fleet.facts:

- name: Show it
  ansible.builtin.debug:
    msg: "{{ ansible_facts.deploytool.release }} {{ ansible_facts.deploytool.state }}"
"""

import json
import os

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.deploytool.fleet.plugins.module_utils import deploytool as dtu


def main():
    spec = dict(dtu.COMMON_ARGS)
    spec.update(deep=dict(type="bool", default=False))
    module = AnsibleModule(argument_spec=spec, supports_check_mode=True)
    tool = dtu.tool_path(module)
    record = None
    try:
        with open(os.path.join(dtu.FLEET_DIR, "last-run.json")) as f:
            record = json.load(f)
    except (OSError, ValueError):
        record = None
    if tool is None:
        facts = dict(installed=False, state="absent", exit_code=None, release=None, active_backend=None,
                     units={}, config=module.params["config"])
    else:
        args = ["status"] + (["--deep"] if module.params["deep"] else [])
        rc, data, out, err = dtu.dt(module, tool, *args)
        if rc not in dtu.STATUS_STATES or not isinstance(data, dict) or "verdict" not in data:
            dtu.fail(module, "deploytool status", rc if rc else 70, data, out, err)
        facts = dict(data, installed=True, state=dtu.STATUS_STATES[rc], exit_code=rc)
    module.exit_json(changed=False, ansible_facts=dict(deploytool=facts, deploytool_fleet_run=record))


if __name__ == "__main__":
    main()
