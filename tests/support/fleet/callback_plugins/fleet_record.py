"""An ansible callback for the fleet test bed: every task result and the recap of a run, as JSON, in $FLEET_RESULTS.

ansible-core ships no JSON callback (ansible.posix has one); the tests read this file instead of parsing the
default callback's screen output, which stays as it is for people reading the logs. Enabled by
tests/support/fleet.py through ANSIBLE_CALLBACK_PLUGINS and ANSIBLE_CALLBACKS_ENABLED.

    {"tasks": [{"name": TASK, "hosts": {HOST: {..module result.., "_status": "ok|changed|failed|unreachable|
                skipped"}}}, ...],
     "stats": {HOST: {"ok": N, "changed": N, "failures": N, "unreachable": N, "skipped": N, ...}}}
"""

from __future__ import annotations

import json
import os
from typing import Any

from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
name: fleet_record
type: aggregate
short_description: task results and the recap as JSON in $FLEET_RESULTS
description:
  - Writes every task result and the final recap of a run to the file named by the FLEET_RESULTS environment variable.
requirements:
  - enabled in configuration (ANSIBLE_CALLBACKS_ENABLED=fleet_record)
"""


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "fleet_record"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tasks: list[dict[str, Any]] = []

    def _record(self, result: Any, status: str) -> None:
        name = result.task.get_name()
        if not self.tasks or self.tasks[-1]["name"] != name:
            self.tasks.append({"name": name, "hosts": {}})
        res = json.loads(self._dump_results(result.result))
        if status == "ok" and res.get("changed"):
            status = "changed"
        res["_status"] = status
        self.tasks[-1]["hosts"][result.host.get_name()] = res

    def v2_playbook_on_task_start(self, task: Any, is_conditional: Any) -> None:
        self.tasks.append({"name": task.get_name(), "hosts": {}})

    def v2_runner_on_ok(self, result: Any) -> None:
        self._record(result, "ok")

    def v2_runner_on_failed(self, result: Any, ignore_errors: bool = False) -> None:
        self._record(result, "ignored" if ignore_errors else "failed")

    def v2_runner_on_unreachable(self, result: Any) -> None:
        self._record(result, "unreachable")

    def v2_runner_on_skipped(self, result: Any) -> None:
        self._record(result, "skipped")

    def v2_playbook_on_stats(self, stats: Any) -> None:
        path = os.environ.get("FLEET_RESULTS")
        if not path:
            return
        doc = {"tasks": self.tasks, "stats": {h: stats.summarize(h) for h in sorted(stats.processed)}}
        with open(path, "w") as f:
            json.dump(doc, f, indent=1, default=str)
