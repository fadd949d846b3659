"""proc.run behaves the same with and without a timeout (two runners inside), and a timeout costs no 0.1 s."""

from __future__ import annotations

import statistics
import time

import pytest

from deploy_tool import proc
from deploy_tool.errors import DeployError, ExitCode, MissingTool

BOTH = pytest.mark.parametrize("timeout", [None, 30.0], ids=["no-timeout", "timeout"])


@BOTH
def test_output_exit_code_and_ok_codes(timeout):
    """stdout, stderr and the exit code come back; a declared code is fine, another raises CommandFailed (17)."""
    r = proc.run(["sh", "-c", "echo out; echo err >&2; exit 3"], ok=(0, 3), timeout=timeout)
    assert (r.returncode, r.stdout, r.stderr) == (3, "out\n", "err\n")
    assert r.argv == ("sh", "-c", "echo out; echo err >&2; exit 3")
    with pytest.raises(proc.CommandFailed) as ei:
        proc.run(["sh", "-c", "echo boom >&2; exit 4"], timeout=timeout)
    assert ei.value.result.returncode == 4 and "boom" in ei.value.message
    assert ei.value.exit_code == ExitCode.OS


@BOTH
def test_input_env_cwd(timeout, tmp_path):
    """input (str or bytes), env (replacing the environment) and cwd reach the program."""
    assert proc.run(["cat"], input="héllo", timeout=timeout).stdout == "héllo"
    assert proc.run(["cat"], input=b"\x00\x01", timeout=timeout).stdout == "\x00\x01"
    r = proc.run(["sh", "-c", 'echo "$FOO:${HOME:-unset}"; pwd'], env={"FOO": "bar", "PATH": "/usr/bin:/bin"},
                 cwd=tmp_path, timeout=timeout)
    assert r.stdout.splitlines() == ["bar:unset", str(tmp_path)]


@BOTH
def test_no_stdin_inherited(timeout):
    """Without input the program reads end-of-file at once (it never waits on the caller's terminal)."""
    assert proc.run(["cat"], timeout=timeout).stdout == ""


@BOTH
def test_killed_by_signal_is_128_plus_signal(timeout):
    """A program killed by SIGKILL is reported as exit 137 and always raises, even with every code declared ok."""
    with pytest.raises(proc.CommandFailed) as ei:
        proc.run(["sh", "-c", "kill -9 $$"], ok=range(256), timeout=timeout)
    assert ei.value.result.returncode == 137


@BOTH
def test_missing_and_not_executable_programs(timeout, tmp_path):
    """A missing program is MissingTool (16) naming it; so is a file that is not executable."""
    with pytest.raises(MissingTool) as ei:
        proc.run(["deploytool-no-such-program"], timeout=timeout)
    assert "deploytool-no-such-program" in ei.value.message and ei.value.exit_code == ExitCode.MISSING_TOOL
    f = tmp_path / "not-exec"
    f.write_text("#!/bin/sh\n")
    with pytest.raises(MissingTool):
        proc.run([str(f)], timeout=timeout)


def test_undecodable_output_is_replaced():
    """Bytes that are not UTF-8 come back replaced, not as an exception."""
    for t in (None, 30.0):
        assert proc.run(["printf", r"\377ok"], timeout=t).stdout == "\ufffdok"


def test_timeout_kills_and_says_so():
    """A program running past its timeout is killed and a DeployError names the command and the limit."""
    t0 = time.monotonic()
    with pytest.raises(DeployError) as ei:
        proc.run(["sleep", "30"], timeout=0.3)
    assert time.monotonic() - t0 < 5
    assert "timed out after 0.3s" in ei.value.message and "sleep 30" in ei.value.message


def test_a_timeout_costs_no_extra_tenth_of_a_second():
    """With a timeout, a trivial command takes about what it takes without one (was +0.1 s: sh's watcher)."""
    def median(timeout):
        proc.run(["true"], timeout=timeout)
        runs = []
        for _ in range(15):
            t0 = time.perf_counter()
            proc.run(["true"], timeout=timeout)
            runs.append(time.perf_counter() - t0)
        return statistics.median(runs)

    with_timeout, without = median(30.0), median(None)
    assert with_timeout < 0.05, f"proc.run with a timeout took {with_timeout * 1000:.1f} ms"
    assert with_timeout < without + 0.03
