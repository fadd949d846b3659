# -*- coding: utf-8 -*-
# Copyright: deploytool maintainers; MIT License (see LICENSE)
"""Controller side of deploytool.fleet.gate: read what the gate needs from the box (its config, its credential)
over the play's connection, then ask for the completion from here, the controller (see the module's doc)."""

from __future__ import annotations

import base64

from ansible.errors import AnsibleActionFail
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from ansible_collections.deploytool.fleet.plugins.module_utils import gate as g

from ansible.plugins.action import ActionBase


class ActionModule(ActionBase):

    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(g.ARGUMENT_SPEC)

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        del tmp
        task_vars = task_vars or {}
        checked = ArgumentSpecValidator(g.ARGUMENT_SPEC).validate(dict(self._task.args))
        if checked.error_messages:
            raise AnsibleActionFail("deploytool.fleet.gate: %s" % "; ".join(checked.error_messages))
        p = dict(checked.validated_parameters)
        if not p.get("url") and not p.get("host"):
            p["host"] = self._box_address(task_vars)
        if p.get("api_key_file"):
            p["api_key_file"] = self._find_here(p["api_key_file"])

        def read_box(path):
            return self._read_box(path, task_vars)

        try:
            gate = g.inputs(p, read_box, g.read_file)
        except g.GateError as exc:
            return dict(result, failed=True, changed=False, msg=str(exc), reason=exc.reason)
        res = g.wait(gate, timeout=p["timeout"], interval=p["interval"], request_timeout=p["request_timeout"],
                     max_tokens=p["max_tokens"])
        ok = res.pop("ok")
        result.update(res, changed=False)
        if not ok:
            result["failed"] = True
        return result

    def _box_address(self, task_vars):
        """The address the connection reaches the box at (ansible_host), else its inventory name."""
        try:
            host = self._connection.get_option("host")
        except Exception:  # pylint: disable=broad-exception-caught  # a connection without a host option (local)
            host = None
        return str(host or task_vars.get("inventory_hostname") or "127.0.0.1")

    def _find_here(self, path):
        """A controller path relative to the playbook's directory, as copy's src is."""
        return path if path.startswith("/") else self._loader.path_dwim(path)

    def _read_box(self, path, task_vars):
        """The bytes of a file on the box (slurp over the play's connection), or None."""
        out = self._execute_module(module_name="ansible.legacy.slurp", module_args={"src": path},
                                   task_vars=task_vars)
        if out.get("unreachable"):
            raise AnsibleActionFail("the box is unreachable: %s" % out.get("msg"))
        if out.get("failed") or "content" not in out:
            return None
        return base64.b64decode(out["content"])
