#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: deploytool maintainers; MIT License (see LICENSE)
# deploytool.fleet.switch: swap the backend behind the port, health-gated, rolled back on failure.

from __future__ import annotations

DOCUMENTATION = r"""
---
module: switch
short_description: Switch a deploytool box to another backend, health-gated
version_added: 0.1.0
author: deploytool maintainers (@deploytool)
description:
  - Runs C(deploytool switch BACKEND) on the host - the current backend drains, the target starts behind the
    health gate, and a target that fails is rolled back to the previous backend automatically.
  - C(changed=false) when O(backend) is already the active, running backend.
  - A rolled-back switch is a failed task with RV(rolled_back=true) (deploytool exit 10; 11 when the rollback
    failed too); every failure carries RV(exit_code), RV(reason) and the target's RV(journal_tail).
  - Check mode runs C(deploytool switch --dry-run); diff mode shows the active backend and units before and after.
options:
  backend:
    description: The backend - a name, an alias or an unambiguous prefix (C(llamacpp)).
    type: str
    required: true
  reason:
    description: Why (kept in the box's history).
    type: str
  drain_timeout:
    description: Wait at most this long (seconds) for requests in flight on the current backend (V(0) - no drain).
    type: float
  wait:
    description: Wait this long (seconds) for another operation's lock.
    type: float
    default: 0
  record_run:
    description:
      - A fleet run id - before changing the host, record what it had in C(/var/lib/deploytool/fleet/last-run.json)
        for the C(deploytool.fleet.revert) playbook. Nothing is recorded when the host is already on O(backend).
    type: str
extends_documentation_fragment:
  - deploytool.fleet.common
attributes:
  check_mode:
    support: full
    description: Runs C(deploytool switch --dry-run) and reports the plan; changes nothing.
  diff_mode:
    support: full
    description: The release, active backend and unit states before and after.
  platform:
    support: full
    platforms: posix
    description: A Linux box with systemd and a deploytool release installed.
seealso:
  - module: deploytool.fleet.rollback
  - module: deploytool.fleet.release
"""

RETURN = r"""
action:
  description: What deploytool did - V(switched), V(noop) (already on the backend) or V(planned) (check mode).
  type: str
  returned: success
  sample: switched
backend:
  description: The backend active after the switch (in check mode, the one it would switch to).
  type: str
  returned: success
  sample: llamacpp-tensor
from_backend:
  description: The backend active before.
  type: str
  returned: success
  sample: ftllm-dflash
seconds:
  description: How long the switch took on the host.
  type: float
  returned: success
gate:
  description: The target's health gate as deploytool reports it (readiness, smoke completion).
  type: dict
  returned: when the switch ran its gate
drain:
  description: How the drain of the stopped backend went (requests in flight, seconds).
  type: dict
  returned: when a backend was drained
plan:
  description: The steps the switch would take.
  type: list
  elements: str
  returned: check mode
before:
  description: Release, active backend and unit states before (from C(deploytool status) in diff mode).
  type: dict
  returned: success
after:
  description: The same after (or as planned in check mode).
  type: dict
  returned: always
rolled_back:
  description: The switch failed and the previous backend was restored (then the task has failed).
  type: bool
  returned: always
restored:
  description: The backend deploytool restored after a failed switch.
  type: str
  returned: when rolled_back
exit_code:
  description: deploytool's exit code (10 rolled back, 11 the rollback failed too, others as C(deploytool --help)).
  type: int
  returned: failure
reason:
  description: deploytool's reason for the failure.
  type: str
  returned: failure
journal_tail:
  description: The target backend's journal tail.
  type: str
  returned: failure
"""

EXAMPLES = r"""
- name: Serve with llama.cpp
  deploytool.fleet.switch:
    backend: llamacpp
    reason: ftllm regression in 0.1.8.2

- name: Plan only
  deploytool.fleet.switch:
    backend: ftllm
  check_mode: true
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.deploytool.fleet.plugins.module_utils import deploytool as dtu


def main():
    spec = dict(dtu.COMMON_ARGS, **dtu.RECORD_ARGS)
    spec.update(backend=dict(type="str", required=True), reason=dict(type="str", default=None),
                drain_timeout=dict(type="float", default=None), wait=dict(type="float", default=0.0))
    module = AnsibleModule(argument_spec=spec, supports_check_mode=True)
    p = module.params
    args = ["switch", p["backend"], "--wait", str(p["wait"])]
    if p["reason"]:
        args += ["--reason", p["reason"]]
    if p["drain_timeout"] is not None:
        args += ["--drain-timeout", str(p["drain_timeout"])]
    dtu.switch_like(module, "switch", args)


if __name__ == "__main__":
    main()
