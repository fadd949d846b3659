#!/usr/bin/python
# -*- coding: utf-8 -*-
# deploytool.fleet.switch: swap the backend behind the port, health-gated, rolled back on failure.

from __future__ import annotations

DOCUMENTATION = r"""
module: switch
short_description: Switch a deploytool box to another backend, health-gated
description:
  - Runs C(deploytool switch BACKEND) on the host - the current backend drains, the target starts behind the
    health gate, and a target that fails is rolled back to the previous backend automatically.
  - C(changed=false) when BACKEND is already the active, running backend.
  - A rolled-back switch is a failed task with C(rolled_back=true) (deploytool exit 10; 11 when the rollback
    failed too); every failure carries C(exit_code), C(reason) and the target's C(journal_tail).
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
    description: Wait at most this long (seconds) for requests in flight on the current backend (0 - no drain).
    type: float
  wait:
    description: Wait this long (seconds) for another operation's lock.
    type: float
    default: 0
  record_run:
    description: A fleet run id - before changing the host, record what it had in
      /var/lib/deploytool/fleet/last-run.json for revert.yml.
    type: str
extends_documentation_fragment:
  - deploytool.fleet.common
"""

RETURN = r"""
backend: {description: The backend active after the switch., type: str}
from_backend: {description: The backend before., type: str}
action: {description: switched, noop or planned., type: str}
rolled_back: {description: The switch failed and the previous backend was restored (a failed task)., type: bool}
exit_code: {description: deploytool's exit code (failures)., type: int}
reason: {description: deploytool's reason (failures)., type: str}
journal_tail: {description: The target's journal tail (failures)., type: str}
"""

EXAMPLES = r"""
- deploytool.fleet.switch:
    backend: llamacpp
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.deploytool.fleet.plugins.module_utils import deploytool as dtu


def main():
    spec = dict(dtu.COMMON_ARGS)
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
