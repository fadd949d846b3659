"""The env launcher (deploy_tool/box/env_launch.py): it reads a unit's env file as systemd reads EnvironmentFile=
and execs the server with it, so the server's environment never reaches the unit's root steps.

Proven three ways: every env file render.py writes parses back to exactly its values (a property over any
printable value); the launcher really execs the program with them over its own environment; and, on the real
sandboxed systemd, for arbitrary env-file text (quotes, escapes, comments, continuations, odd names), the launcher
reads exactly what systemd's own EnvironmentFile= parser reads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from deploy_tool import render
from deploy_tool.box import env_launch
from deploy_tool.textsafe import unsafe_char
from tests.support.examples import examples

REPO = Path(__file__).resolve().parents[1]
NAME = st.from_regex(r"\A[A-Za-z_][A-Za-z0-9_]{0,12}\Z")
PRINTABLE = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30).filter(lambda v: unsafe_char(v) is None)


@settings(max_examples=examples(300), deadline=None)
@given(env=st.dictionaries(NAME, PRINTABLE, max_size=6))
def test_every_rendered_env_file_parses_back_to_its_values(env: dict[str, str]) -> None:
    text = "# a comment\n" + "".join(render.env_quote(k, v) + "\n" for k, v in env.items())
    assert dict(env_launch.parse(text)) == env


def test_the_forms_systemd_documents() -> None:
    """systemd.exec(5) EnvironmentFile=: comments, quotes, escapes, bare values trimmed, continuation lines."""
    text = ('# comment\n; also\nA=plain value  \nB="dq \\"x\\" \\$HOME \\\\ \\n"\nC=\'sq \\n "\'\n'
            'D=one\\\ntwo\nnot a line\n 1BAD=x\nE=\nF="multi\nline"\n')
    assert env_launch.parse(text) == [("A", "plain value"), ("B", 'dq "x" $HOME \\ \\n'), ("C", 'sq \\n "'),
                                      ("D", "onetwo"), ("E", ""), ("F", "multi\nline")]


def test_the_launcher_execs_the_program_with_the_file_over_its_own_environment(tmp_path: Path) -> None:
    envf = tmp_path / "environment"
    envf.write_text(render.env_quote("LD_PRELOAD", "/x y/libnccl.so.2") + "\n" + render.env_quote("KEEP", "new") + "\n")
    prog = [sys.executable, "-c", "import json, os; print(json.dumps({k: os.environ.get(k) for k in "
                                  "('LD_PRELOAD', 'KEEP', 'OTHER')}))"]
    out = subprocess.run([sys.executable, "-I", "-S", str(REPO / "deploy_tool/box/env_launch.py"), str(envf), *prog],
                         capture_output=True, text=True, env={**os.environ, "KEEP": "old", "OTHER": "kept"},
                         timeout=30)
    assert out.returncode == 0, out.stderr
    # LD_PRELOAD of a missing file: the loader says so on stderr and goes on, as it would on a box without it
    assert json.loads(out.stdout) == {"LD_PRELOAD": "/x y/libnccl.so.2", "KEEP": "new", "OTHER": "kept"}


def test_a_missing_file_or_program_is_one_line_and_exit_2(tmp_path: Path) -> None:
    launcher = str(REPO / "deploy_tool/box/env_launch.py")
    r = subprocess.run([sys.executable, "-I", "-S", launcher, str(tmp_path / "none"), "/bin/true"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "cannot read the environment file" in r.stderr
    (tmp_path / "e").write_text("")
    r = subprocess.run([sys.executable, "-I", "-S", launcher, str(tmp_path / "e"), str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "cannot run" in r.stderr and r.stderr.count("\n") == 1


# Lines as an operator might edit them, and as an attacker would try: every quoting form, escapes before any
# character, comments, continuations, names systemd skips, CR, trailing blanks.
PIECE = st.sampled_from(["A", "B_1", "x", "1X", "-", "=", " ", "\t", "'", '"', "\\", "\\\n", "#", ";", "$", "`",
                         "\r", "é", "v", "\n", "ab", "\\x", "\"q\"", "'s'"])
LINE = st.lists(PIECE, max_size=8).map("".join)
FILE = st.lists(st.tuples(st.sampled_from(["RT_A", "RT_B", "RT_C", " RT_D", "RT_E "]), LINE), max_size=5).map(
    lambda kv: "".join(f"{k}={v}\n" for k, v in kv))


@pytest.mark.sandbox
@settings(max_examples=examples(80), deadline=30000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=FILE)
@example(text="RT_A='\n")  # an unclosed quote at the end of the file: systemd keeps what it holds
@example(text='RT_B="x\\')
def test_the_launcher_reads_an_env_file_as_systemd_does(sandbox_env: Any, visible_dir: Path, text: str) -> None:
    """The same env file through systemd's EnvironmentFile= and through the launcher, in one real sandbox."""
    envf = visible_dir / "rt.env"
    envf.write_bytes(text.encode())
    show = ("import json, os; print('RTJSON=' + json.dumps({k: v for k, v in os.environ.items() "
            "if k.startswith('RT_')}), flush=True)")
    unit = (f"[Service]\nType=oneshot\nEnvironmentFile={envf}\nExecStart=/usr/bin/python3 -c \"{show}\"\n")
    sd = sandbox_env.systemd
    sd.install_file("rtenv.service", unit.encode())
    sd.daemon_reload()
    cursor = sd.journal_cursor()
    sd.start("rtenv.service")
    sd.sync_journal()
    got: list[str] = []
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        got = [ln.split("RTJSON=", 1)[1] for ln in sd.journal("rtenv.service", since_cursor=cursor).splitlines()
               if "RTJSON=" in ln]
        if not got:
            time.sleep(0.05)
    assert got, "the unit printed nothing"
    theirs = json.loads(got[0])
    ours = {k: v for k, v in env_launch.parse(text) if k.startswith("RT_")}
    assert ours == theirs, (text, ours, theirs)
