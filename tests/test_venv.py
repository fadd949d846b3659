"""The build side's runner (proc.run_tool, through sh): one clear line naming the program, the right exit codes;
the venv helpers' pip environment."""

from __future__ import annotations

import base64
import csv
import hashlib
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


def test_relocate_venv_rewrites_prefix_and_keeps_record_true(tmp_path):
    """The old prefix goes from pyvenv.cfg and bin/ text files; binaries and symlinks stay; RECORD's hash and
    size of a rewritten file match its new bytes."""
    old, new = "/build/tmp/venv", "/opt/box/releases/r1/venv"
    v = tmp_path / "venv"
    (v / "bin").mkdir(parents=True)
    (v / "pyvenv.cfg").write_text(f"home = /usr/bin\ncommand = /usr/bin/python3 -m venv {old}\n")
    script = v / "bin" / "tool"
    script.write_text(f"#!{old}/bin/python\nimport sys\n")
    script.chmod(0o755)
    (v / "bin" / "blob").write_bytes(b"\0ELF" + old.encode())
    (v / "bin" / "python").symlink_to("/usr/bin/python3")
    dist = v / "lib" / "python3.11" / "site-packages" / "tool-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "RECORD").write_text("../../../bin/tool,sha256=stale,10\ntool-1.0.dist-info/RECORD,,\n")

    assert venv.relocate_venv(v, old, new) == 2
    assert script.read_text().startswith(f"#!{new}/bin/python") and script.stat().st_mode & 0o777 == 0o755
    assert old not in (v / "pyvenv.cfg").read_text()
    assert (v / "bin" / "blob").read_bytes() == b"\0ELF" + old.encode()
    rows = list(csv.reader((dist / "RECORD").read_text().splitlines()))
    data = script.read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    assert rows[0] == ["../../../bin/tool", f"sha256={digest}", str(len(data))]
    assert rows[1] == ["tool-1.0.dist-info/RECORD", "", ""]
