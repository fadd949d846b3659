#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: deploytool maintainers; MIT License (see LICENSE)
# deploytool.fleet.gate: is the box serving? One real chat completion, seen from the controller.

from __future__ import annotations

DOCUMENTATION = r"""
---
module: gate
short_description: Gate a deploytool box on one real chat completion, seen from the controller
version_added: 0.1.0
author: deploytool maintainers (@deploytool)
description:
  - Asks the box's server for a one-token chat completion (temperature 0) of the model it serves, with the API key
    it was given, and retries until one comes or O(timeout) seconds have passed. C(GET /v1/models) alone is not
    enough - a hung engine keeps answering it.
  - Runs on the controller (an action plugin), so the answer is what a client on the controller's network gets;
    the box's files it needs are read over the play's connection.
  - What it asks, unless given - the model, port and whether a key is needed from the box's config O(config)
    (C(serve.model_name), C(serve.port), C(serve.api_key_file)); the key from O(api_key), else O(api_key_file),
    else the box's own credential (C(paths.env_dir)/api-key, the root-only copy deploytool install made of
    C(serve.api_key_file), which the servers load; reading it needs root on the box).
  - An HTTP 401 or 403 fails at once with RV(reason=key-wrong) - "the gate's key is wrong" - and says nothing of the
    box's health; no completion before O(timeout) fails with RV(reason=unhealthy).
  - The playbooks C(deploytool.fleet.rollout), C(deploytool.fleet.switch) and C(deploytool.fleet.revert) gate every
    host with it.
options:
  host:
    description:
      - The box's address as the controller reaches it (default the host's C(ansible_host), else its inventory name).
    type: str
  port:
    description: The served port (default the box's C(serve.port), else 8082).
    type: int
  url:
    description:
      - The server's base URL instead of O(host) and O(port), e.g. C(https://box.example:8443). A trailing C(/v1/models)
        or C(/v1/chat/completions) is dropped.
    type: str
  model:
    description: The model name to ask for (default the box's C(serve.model_name)).
    type: str
  api_key:
    description: The API key to send (e.g. from a vault).
    type: str
  api_key_file:
    description: A file where the gate runs (the controller) whose first line is the API key.
    type: path
  config:
    description: The box's deploytool config on the box.
    type: path
    default: /etc/deploytool/deploytool.yaml
  timeout:
    description: Give up after this many seconds without a completion.
    type: float
    default: 60
  interval:
    description: Seconds between attempts.
    type: float
    default: 0.5
  request_timeout:
    description: Seconds one attempt may take.
    type: float
    default: 10
  max_tokens:
    description: Tokens to ask for.
    type: int
    default: 1
attributes:
  action:
    support: full
    description: Runs on the controller as an action plugin; the box's config and credential are read over the
      connection.
  check_mode:
    support: full
    description: It only asks; check mode runs it as usual (the playbooks skip their gates in check mode).
  diff_mode:
    support: none
    description: Nothing changes.
  platform:
    support: full
    platforms: posix
    description: A box running a deploytool backend, reachable from the controller over HTTP.
notes:
  - The key never appears in the task's result, only where it came from (RV(key_source)).
seealso:
  - module: deploytool.fleet.switch
  - module: deploytool.fleet.release
"""

EXAMPLES = r"""
- name: The box serves, with the key and model from its own config
  deploytool.fleet.gate:

- name: Judged with the key the clients use
  deploytool.fleet.gate:
    api_key: "{{ vault_inference_key }}"
    timeout: 120
"""

RETURN = r"""
url:
  description: The completion URL asked.
  type: str
  returned: always
  sample: http://10.0.0.11:8082/v1/chat/completions
model:
  description: The model name asked for.
  type: str
  returned: always
status:
  description: The last HTTP status (null when nothing answered).
  type: int
  returned: always
  sample: 200
content:
  description: The completion's text.
  type: str
  returned: success
usage:
  description: The completion's token counts, as the server reports them.
  type: dict
  returned: success
attempts:
  description: Requests sent.
  type: int
  returned: always
seconds:
  description: Time until the answer (or the failure).
  type: float
  returned: always
key_source:
  description: Where the key came from - the api_key option, the api_key_file, the box's credential, or none.
  type: str
  returned: always
  sample: the box's credential /etc/deploytool/env/api-key
reason:
  description: Why it failed - V(key-wrong) (HTTP 401/403), V(unhealthy) (no completion in time), V(key-missing) or
    V(bad-input).
  type: str
  returned: failure
last_error:
  description: The last attempt's error.
  type: str
  returned: when unhealthy
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.deploytool.fleet.plugins.module_utils import gate as g


def main():
    # run as a module (not through the action plugin), the gate is seen from where it runs and reads files there
    module = AnsibleModule(argument_spec=g.ARGUMENT_SPEC, supports_check_mode=True)
    p = module.params
    try:
        gate = g.inputs(p, g.read_file, g.read_file)
    except g.GateError as exc:
        module.fail_json(msg=str(exc), reason=exc.reason)
    res = g.wait(gate, timeout=p["timeout"], interval=p["interval"], request_timeout=p["request_timeout"],
                 max_tokens=p["max_tokens"])
    if res.pop("ok"):
        module.exit_json(changed=False, **res)
    module.fail_json(**res)


if __name__ == "__main__":
    main()
