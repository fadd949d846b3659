"""Start a backend's server with its environment file, so that the environment reaches the server alone.

systemd applies a unit's EnvironmentFile= and Environment= to every command of the unit, the `+` ones that run
as root included: a line `LD_PRELOAD=/x.so` in an env file would make the dynamic loader run x.so's constructor
as root inside the ExecStartPre verify, before verify could refuse the changed file (measured on the sandbox).
So the units name no EnvironmentFile=. They hand the env file to this launcher as a credential
(`LoadCredential=environment:ENV_FILE`: systemd copies it when the unit starts into
/run/credentials/UNIT/environment, readable by the service alone, and the root verify checks that very copy),
and the launcher, running as the service's user inside its sandbox, reads it and execs the server:

    ExecStart={tool}/python -I -S {current}/launch/env_launch.py %d/environment SERVER ARGS...

The file is read as systemd reads an EnvironmentFile= (systemd 252's env-file.c, state by state below): lines
`NAME=value`, comments starting with # or ;, a value in double quotes (a backslash escapes `"`, `\\`, `` ` ``
and `$`, before any other character it is kept), in single quotes (taken as it is), or bare (a backslash escapes
the next character, trailing white space dropped), a backslash before a newline joining lines; names that are
not environment variable names are skipped, as systemd skips them. The result is laid over the environment
systemd gave the service, then the server is exec'd in this same process (its PID stays $MAINPID).

Standard library only, run with `-I -S` (no PYTHON* variables, no user site, no site-packages). Exit 2 with one
line on stderr when the file cannot be read or the command is missing.
"""

from __future__ import annotations

import os
import re
import sys

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_NEED_ESCAPE = '"\\`$'
_NEWLINE = "\n\r"
_WHITESPACE = " \t\n\r"


def parse(text: str) -> list[tuple[str, str]]:
    """The (name, value) pairs of an EnvironmentFile= text, in order (a later assignment wins in a dict)."""
    out: list[tuple[str, str]] = []
    state = "pre_key"
    key: list[str] = []
    value: list[str] = []
    last_ws = 0  # trailing white space of a bare value, dropped at its end

    def emit() -> None:
        name = "".join(key).rstrip(_WHITESPACE)
        val = "".join(value)
        if _NAME.match(name):
            out.append((name, val))

    for c in text:
        if state == "pre_key":
            if c in "#;":
                state = "comment"
            elif c not in _WHITESPACE:
                state, key = "key", [c]
        elif state == "key":
            if c in _NEWLINE:
                state = "pre_key"  # a line without '=' is ignored
            elif c == "=":
                state, value, last_ws = "pre_value", [], 0
            else:
                key.append(c)
        elif state == "pre_value":
            if c in _NEWLINE:
                state = "pre_key"
                emit()
            elif c == "'":
                state = "single"
            elif c == '"':
                state = "double"
            elif c == "\\":
                state = "value_escape"
            elif c not in _WHITESPACE:
                state, last_ws = "value", 0
                value.append(c)
        elif state == "value":
            if c in _NEWLINE:
                state = "pre_key"
                if last_ws:
                    del value[-last_ws:]
                emit()
            elif c == "\\":
                state, last_ws = "value_escape", 0
            else:
                last_ws = last_ws + 1 if c in _WHITESPACE else 0
                value.append(c)
        elif state == "value_escape":
            state = "value"
            if c not in _NEWLINE:
                value.append(c)
        elif state == "single":
            if c == "'":
                state = "pre_value"
            else:
                value.append(c)
        elif state == "double":
            if c == '"':
                state = "pre_value"
            elif c == "\\":
                state = "double_escape"
            else:
                value.append(c)
        elif state == "double_escape":
            state = "double"
            if c in _NEED_ESCAPE:
                value.append(c)
            elif c != "\n":
                value += ["\\", c]
        elif state == "comment":
            if c == "\\":
                state = "comment_escape"
            elif c in _NEWLINE:
                state = "pre_key"
        elif state == "comment_escape":
            state = "comment"
    # the end of the file ends a value as a newline would, with what the value holds so far (an unclosed quote
    # included, as systemd takes it)
    if state in ("pre_value", "value", "value_escape", "single", "double", "double_escape"):
        if state == "value" and last_ws:
            del value[-last_ws:]
        emit()
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print("usage: env_launch.py ENV_FILE PROGRAM [ARGS...]", file=sys.stderr)
        return 2
    env_file, cmd = argv[1], argv[2:]
    try:
        with open(env_file, encoding="utf-8", errors="surrogateescape") as f:
            pairs = parse(f.read())
    except OSError as exc:
        print(f"env_launch: cannot read the environment file {env_file}: {exc.strerror}; is the unit's "
              f"LoadCredential=environment:... there and the env file installed?", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env.update(pairs)
    try:
        os.execve(cmd[0], cmd, env)
    except OSError as exc:
        print(f"env_launch: cannot run {cmd[0]}: {exc.strerror}", file=sys.stderr)
        return 2
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv))
