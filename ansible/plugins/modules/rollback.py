#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: deploytool maintainers; MIT License (see LICENSE)
# deploytool.fleet.rollback: switch back to the previous backend through the same health gate.

from __future__ import annotations

DOCUMENTATION = r"""
---
module: rollback
short_description: Switch a deploytool box back to its previous backend, health-gated
version_added: 0.1.0
author: deploytool maintainers (@deploytool)
description:
  - Runs C(deploytool rollback) on the host (drained and gated like a switch).
  - C(changed=false) when the previous backend is already the active one.
  - A rollback that fails its gate and is restored is a failed task with RV(rolled_back=true); every failure
    carries RV(exit_code), RV(reason) and RV(journal_tail).
options:
  wait:
    description: Wait this long (seconds) for another operation's lock.
    type: float
    default: 0
  drain_timeout:
    description: Wait at most this long (seconds) for requests in flight (V(0) - no drain).
    type: float
  record_run:
    description:
      - A fleet run id - before changing the host, record what it had in C(/var/lib/deploytool/fleet/last-run.json)
        for the C(deploytool.fleet.revert) playbook.
    type: str
extends_documentation_fragment:
  - deploytool.fleet.common
attributes:
  check_mode:
    support: full
    description: Runs C(deploytool rollback --dry-run) and reports the plan; changes nothing.
  diff_mode:
    support: full
    description: The release, active backend and unit states before and after.
  platform:
    support: full
    platforms: posix
    description: A Linux box with systemd and a deploytool release installed.
seealso:
  - module: deploytool.fleet.switch
"""

RETURN = r"""
action:
  description: What deploytool did - V(switched), V(noop) or V(planned) (check mode).
  type: str
  returned: success
backend:
  description: The backend active afterwards (in check mode, the one it would go back to).
  type: str
  returned: success
  sample: ftllm-dflash
from_backend:
  description: The backend active before.
  type: str
  returned: success
seconds:
  description: How long the rollback took on the host.
  type: float
  returned: success
gate:
  description: The health gate as deploytool reports it.
  type: dict
  returned: when the rollback ran its gate
drain:
  description: How the drain of the stopped backend went.
  type: dict
  returned: when a backend was drained
plan:
  description: The steps the rollback would take.
  type: list
  elements: str
  returned: check mode
before:
  description: Release, active backend and unit states before.
  type: dict
  returned: success
after:
  description: The same after (or as planned in check mode).
  type: dict
  returned: always
rolled_back:
  description: The rollback failed its gate and was undone (then the task has failed).
  type: bool
  returned: always
restored:
  description: The backend deploytool restored after a failed rollback.
  type: str
  returned: when rolled_back
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
- name: Back to the backend before the last switch
  deploytool.fleet.rollback:
    drain_timeout: 30
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.deploytool.fleet.plugins.module_utils import deploytool as dtu


def main():
    spec = dict(dtu.COMMON_ARGS, **dtu.RECORD_ARGS)
    spec.update(wait=dict(type="float", default=0.0), drain_timeout=dict(type="float", default=None))
    module = AnsibleModule(argument_spec=spec, supports_check_mode=True)
    p = module.params
    args = ["rollback", "--wait", str(p["wait"])]
    if p["drain_timeout"] is not None:
        args += ["--drain-timeout", str(p["drain_timeout"])]
    dtu.switch_like(module, "rollback", args)


if __name__ == "__main__":
    main()
