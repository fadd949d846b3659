#!/usr/bin/python
# -*- coding: utf-8 -*-
# deploytool.fleet.rollback: switch back to the previous backend through the same health gate.

from __future__ import annotations

DOCUMENTATION = r"""
module: rollback
short_description: Switch a deploytool box back to its previous backend, health-gated
description:
  - Runs C(deploytool rollback) on the host (drained and gated like a switch).
  - C(changed=false) when the previous backend is already the active one.
  - A rollback that fails its gate and is restored is a failed task with C(rolled_back=true); every failure
    carries C(exit_code), C(reason) and C(journal_tail). Check mode - C(--dry-run); diff mode as for switch.
options:
  wait:
    description: Wait this long (seconds) for another operation's lock.
    type: float
    default: 0
  drain_timeout:
    description: Wait at most this long (seconds) for requests in flight (0 - no drain).
    type: float
  record_run:
    description: A fleet run id - before changing the host, record what it had in
      /var/lib/deploytool/fleet/last-run.json for revert.yml.
    type: str
extends_documentation_fragment:
  - deploytool.fleet.common
"""

RETURN = r"""
backend: {description: The backend active afterwards., type: str}
rolled_back: {description: The rollback failed its gate and was undone (a failed task)., type: bool}
exit_code: {description: deploytool's exit code (failures)., type: int}
"""

EXAMPLES = r"""
- deploytool.fleet.rollback:
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.deploytool.fleet.plugins.module_utils import deploytool as dtu


def main():
    spec = dict(dtu.COMMON_ARGS)
    spec.update(wait=dict(type="float", default=0.0), drain_timeout=dict(type="float", default=None))
    module = AnsibleModule(argument_spec=spec, supports_check_mode=True)
    p = module.params
    args = ["rollback", "--wait", str(p["wait"])]
    if p["drain_timeout"] is not None:
        args += ["--drain-timeout", str(p["drain_timeout"])]
    dtu.switch_like(module, "rollback", args)


if __name__ == "__main__":
    main()
