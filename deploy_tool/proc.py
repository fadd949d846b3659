"""The only module that runs external programs (and the only importer of `sh`).

`run` is the box's runner (subprocess wherever a timeout is given: install, verify and switch wait on it);
`run_tool` runs the build side's programs (pip, `python -m venv` for lock, pack and rebuild) through `sh`.
Commands are argv lists, never shell strings. Expected non-zero exits are declared by the caller
(`ok=(0, 3)` for `systemctl is-active`). A missing program gets its own error. With verbose logging on,
every command is logged as `+ argv...`.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from deploy_tool.errors import DeployError, ExitCode, MissingTool

log = logging.getLogger("deploytool.proc")


@dataclass(frozen=True)
class Result:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


class CommandFailed(DeployError):
    """A command exited with a code the caller did not declare as expected."""

    exit_code = ExitCode.OS

    def __init__(self, result: Result) -> None:
        tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
        super().__init__(
            f"command failed (exit {result.returncode}): {shlex.join(result.argv)}"
            + (("\n  " + "\n  ".join(tail)) if tail else ""),
        )
        self.result = result


def _sh():
    import sh  # lazy: keeps `deploytool --version` fast

    return sh


def run(
    argv: Sequence[str],
    *,
    ok: Sequence[int] = (0,),
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    input: str | bytes | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> Result:
    """Run argv to completion and return its exit code and output; raise CommandFailed unless the code is in `ok`.

    A program killed by a signal is reported like a shell would (128 + signal) and always raises CommandFailed.
    With `timeout`, the program is killed (SIGKILL) once it runs longer and a DeployError says so.
    """
    argv = tuple(str(a) for a in argv)
    if not argv:
        raise ValueError("empty argv")
    log.debug("+ %s", shlex.join(argv))
    if timeout is not None:
        # `sh` enforces _timeout with a watcher thread that costs ~0.1 s per call; subprocess waits on the pipes
        # with a deadline instead, at the cost of a plain fork/exec.
        return _run_subprocess(argv, ok=ok, timeout=timeout, env=env, input=input, cwd=cwd)
    sh = _sh()
    try:
        cmd = sh.Command(argv[0])
    except sh.CommandNotFound as exc:
        raise _not_found(argv[0]) from exc
    kwargs: dict[str, object] = {"_ok_code": list(range(256)), "_return_cmd": True, "_tty_out": False,
                                 "_decode_errors": "replace"}
    if env is not None:
        kwargs["_env"] = dict(env)
    if input is not None:
        kwargs["_in"] = input
    if cwd is not None:
        kwargs["_cwd"] = str(cwd)
    try:
        proc = cmd(*argv[1:], **kwargs)
    except sh.SignalException as exc:  # killed by a signal: report like a shell would
        res = Result(argv, 128 + abs(exc.exit_code), _dec(exc.stdout), _dec(exc.stderr))
        raise CommandFailed(res) from exc
    except PermissionError as exc:
        raise MissingTool(f"program not executable: {argv[0]}") from exc
    res = Result(argv, proc.exit_code, _dec(proc.stdout), _dec(proc.stderr))
    if res.returncode not in ok:
        raise CommandFailed(res)
    return res


def tool_name(argv: Sequence[str]) -> str:
    """How a failure names the program: `pip download` for `python -m pip download ...`, else the program."""
    args = [str(a) for a in argv]
    if len(args) >= 3 and args[1] == "-m":
        return " ".join(args[2:4]) if args[2] == "pip" and len(args) > 3 else args[2]
    return os.path.basename(args[0]) if args else "?"


def run_tool(argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float | None = None,
             cwd: str | os.PathLike[str] | None = None) -> None:
    """Run a build-side program (pip, `python -m venv`) through `sh`, where its start time does not matter
    (`sh` watches the timeout with a thread, ~0.1 s a call); its output is kept for the error only.

    A failure is one line naming the program and the tail of its error output (CommandFailed, exit 17); a
    missing program is MissingTool (16); running past `timeout` a DeployError that says so."""
    sh = _sh()
    args = [str(a) for a in argv]
    log.debug("+ %s", shlex.join(args))
    try:
        cmd = sh.Command(args[0])
    except sh.CommandNotFound as exc:
        raise _not_found(args[0]) from exc
    try:
        cmd(*args[1:], _env=dict(env) if env is not None else None, _timeout=timeout,
            _cwd=str(cwd) if cwd is not None else None, _tty_out=False, _decode_errors="replace")
    except sh.TimeoutException as exc:
        raise DeployError(f"{tool_name(args)} timed out after {timeout:g}s: {shlex.join(args)}") from exc
    except (sh.ErrorReturnCode, sh.SignalException) as exc:
        out, err = _dec(exc.stdout), _dec(exc.stderr)
        code = exc.exit_code if exc.exit_code >= 0 else 128 - exc.exit_code
        failed = CommandFailed(Result(tuple(args), code, out, err))
        tail = next((ln.strip() for ln in reversed((err or out).splitlines()) if ln.strip()), "no output")
        failed.message = f"{tool_name(args)} failed (exit {code}): {tail[:300]}"
        raise failed from None


def _not_found(prog: str) -> MissingTool:
    return MissingTool(f"program not found: {prog}",
                       hint="install it, or set its path in the config (paths: section)")


def _run_subprocess(argv: tuple[str, ...], *, ok: Sequence[int], timeout: float, env: Mapping[str, str] | None,
                    input: str | bytes | None, cwd: str | os.PathLike[str] | None) -> Result:
    """The timeout path of run(): same resolution (the caller's PATH), errors and Result as the `sh` path."""
    exe = shutil.which(argv[0]) if os.sep not in argv[0] else argv[0]
    if exe is None or not os.path.exists(exe):
        raise _not_found(argv[0])
    data = input.encode() if isinstance(input, str) else input
    try:
        cp = subprocess.run([exe, *argv[1:]], input=data, stdin=subprocess.DEVNULL if data is None else None,
                            capture_output=True, timeout=timeout, env=dict(env) if env is not None else None,
                            cwd=cwd)
    except subprocess.TimeoutExpired as exc:
        raise DeployError(f"command timed out after {timeout}s: {shlex.join(argv)}") from exc
    except PermissionError as exc:
        raise MissingTool(f"program not executable: {argv[0]}") from exc
    except FileNotFoundError as exc:  # vanished between the lookup and exec, or a broken interpreter line
        raise _not_found(argv[0]) from exc
    except OSError as exc:  # e.g. ENOEXEC: not a program at all
        raise MissingTool(f"program cannot be run: {argv[0]}: {exc.strerror}") from exc
    rc = cp.returncode
    res = Result(argv, 128 - rc if rc < 0 else rc, _dec(cp.stdout), _dec(cp.stderr))
    if rc < 0 or res.returncode not in ok:
        raise CommandFailed(res)
    return res


def _dec(b: bytes | str | None) -> str:
    if b is None:
        return ""
    if isinstance(b, bytes):
        return b.decode("utf-8", "replace")
    return b


def spawn(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    stdout: object = subprocess.DEVNULL,
    stderr: object = subprocess.DEVNULL,
    new_session: bool = True,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start argv in the background (for long-lived helpers like the sandbox launcher); the caller owns the PID."""
    argv = [str(a) for a in argv]
    log.debug("+ (background) %s", shlex.join(argv))
    try:
        return subprocess.Popen(argv, env=dict(env) if env is not None else None,  # type: ignore[call-overload]
                                stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                                start_new_session=new_session, cwd=cwd)
    except FileNotFoundError as exc:
        raise MissingTool(f"program not found: {argv[0]}") from exc
