"""`deploytool history` / `status` event lines, as a person reads them at the terminal."""

from __future__ import annotations

from deploy_tool.box.status import format_history


def test_history_lines_name_the_backend_of_each_event() -> None:
    """Two pins at install (one per backend) are told apart; a switch shows from -> to and a failure is marked."""
    events = [
        {"time": "2026-11-29T12:54:22.1Z", "event": "pin", "backend": "ftllm-dflash", "release": "r1",
         "reason": "install of release r1"},
        {"time": "2026-11-29T12:54:22.2Z", "event": "pin", "backend": "llamacpp-tensor", "release": "r1",
         "reason": "install of release r1"},
        {"time": "2026-11-29T12:54:33.0Z", "event": "switch", "ok": False, "from_backend": "ftllm-dflash",
         "to_backend": "llamacpp-tensor", "outcome": "rolled-back", "release": "r1", "reason": "crashed"},
    ]
    lines = format_history(events).splitlines()
    assert lines[0] == "2026-11-29T12:54:22      pin ftllm-dflash release r1: install of release r1"
    assert lines[1] == "2026-11-29T12:54:22      pin llamacpp-tensor release r1: install of release r1"
    assert lines[2] == ("2026-11-29T12:54:33 FAIL switch ftllm-dflash -> llamacpp-tensor rolled-back release r1: "
                        "crashed")
    assert format_history([]) == "no events yet"
