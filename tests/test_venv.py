"""The build side's runner (proc.run_tool, through sh): one clear line naming the program, the right exit codes;
the venv helpers' pip environment."""

from __future__ import annotations

import sys
import time

import pytest

from deploy_tool import proc, venv
from deploy_tool.errors import DeployError, ExitCode, MissingTool


def test_failure_is_one_line_naming_the_tool_and_its_stderr_tail():
    """pip that exits 1 is named `pip download`, with the last line it wrote to stderr; exit code 17."""
    argv = [sys.executable, "-m", "pip", "download", "--no-index", "-d", "/nonexistent-dir", "surely-no-such-pkg"]
    with pytest.raises(proc.CommandFailed) as ei:
        proc.run_tool(argv, env=venv.pip_env(), timeout=120)
    msg = ei.value.message
    assert "\n" not in msg
    assert msg.startswith("pip download failed (exit 1): ")
    assert "surely-no-such-pkg" in msg or "No matching distribution" in msg
    assert ei.value.exit_code == ExitCode.OS
    assert ei.value.result.returncode == 1 and ei.value.result.argv[0] == sys.executable


def test_tail_is_the_last_non_empty_line_of_stderr():
    with pytest.raises(proc.CommandFailed) as ei:
        proc.run_tool(["sh", "-c", "echo first >&2; echo 'the real reason' >&2; echo >&2; exit 3"])
    assert ei.value.message == "sh failed (exit 3): the real reason"


def test_missing_program_and_timeout():
    with pytest.raises(MissingTool) as ei:
        proc.run_tool(["/nonexistent/python3", "-m", "venv", "x"])
    assert ei.value.exit_code == ExitCode.MISSING_TOOL and "/nonexistent/python3" in ei.value.message
    t0 = time.monotonic()
    with pytest.raises(DeployError, match=r"^sleep timed out after 0.5s"):
        proc.run_tool(["sleep", "30"], timeout=0.5)
    assert time.monotonic() - t0 < 10


def test_tool_name():
    assert proc.tool_name(["/usr/bin/python3", "-m", "pip", "wheel", "x"]) == "pip wheel"
    assert proc.tool_name(["python3", "-m", "venv", "/tmp/v"]) == "venv"
    assert proc.tool_name(["/usr/bin/zstd", "-d"]) == "zstd"


def test_pip_env_drops_the_machines_pip_settings(monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "http://example.invalid/simple")
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    env = venv.pip_env({"SOURCE_DATE_EPOCH": "1"})
    assert "PIP_INDEX_URL" not in env and "PYTHONPATH" not in env
    assert env["PIP_CONFIG_FILE"] == "/dev/null" and env["SOURCE_DATE_EPOCH"] == "1"
