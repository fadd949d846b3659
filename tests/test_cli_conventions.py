"""The command line keeps its ecosystem's conventions: usage errors exit 2 with a did-you-mean, names are checked
before anything probes the system, NO_COLOR and --color, shell completion of backend and example names, one line
per wait on a terminal (and nothing without one), deploytool's events in the journal, and `logs`."""

from __future__ import annotations

import io
import json
import socket
import stat
import struct
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from deploy_tool import config, progress
from deploy_tool.box import journal
from deploy_tool.cli import main, names
from tests.support.configs import example_dict, set_key


def _cfg(tmp_path: Path, **systemd: object) -> Path:
    data = example_dict("cpu-demo")
    for key in ("state_dir", "root", "unit_dir", "env_dir", "keys_dir"):
        set_key(data, f"paths.{key}", str(tmp_path / key))
    for k, v in systemd.items():
        set_key(data, f"systemd.{k}", v)
    p = tmp_path / "deploytool.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def run(*args: str, env: dict[str, str] | None = None, color: bool = False):
    return CliRunner().invoke(main, list(args), env=env, color=color)


# ------------------------------------------------------------------------------------------------ names, exits


def test_unknown_example_is_a_usage_error_with_did_you_mean(tmp_path: Path) -> None:
    r = run("init", "--example", "2080", "--out", str(tmp_path / "d.yaml"))
    assert r.exit_code == 2
    assert "unknown example '2080' (examples: two-2080ti, cpu-demo); did you mean 'two-2080ti'?" in r.output
    assert "Traceback" not in r.output and not (tmp_path / "d.yaml").exists()
    assert names.EXAMPLES == config.EXAMPLES


def test_unknown_command_is_a_usage_error_with_did_you_mean() -> None:
    r = run("swich", "llamacpp")
    assert r.exit_code == 2 and "no such command 'swich'; did you mean 'switch'?" in r.output
    r = run("releases", "prnue")
    assert r.exit_code == 2 and "did you mean 'prune'?" in r.output


@pytest.mark.parametrize("argv", [["switch", "xyz", "--dry-run"], ["switch", "xyz"], ["verify", "xyz"],
                                  ["logs", "xyz"], ["failover", "--from", "xyz"], ["await-ready", "xyz"]])
def test_an_unknown_backend_fails_on_its_name_before_any_system_probe(tmp_path: Path, argv: list[str]) -> None:
    """Off a systemd box too: the name is checked first (exit 3, the backends listed), never 'PID 1 is not
    systemd' (exit 8)."""
    cfg = _cfg(tmp_path)
    r = run("--config", str(cfg), *argv)
    assert r.exit_code == 3, r.output
    assert f"error: unknown backend 'xyz' in {cfg}" in r.stderr and "PID 1" not in r.output
    assert "the backends are: ftllm-dflash (ftllm), llamacpp-tensor (llamacpp)" in r.stderr


def test_a_misspelt_backend_gets_a_did_you_mean(tmp_path: Path) -> None:
    r = run("--config", str(_cfg(tmp_path)), "verify", "lama")
    assert r.exit_code == 3 and "hint: did you mean 'llamacpp'?" in r.stderr


def test_a_config_error_names_file_line_column_and_key(tmp_path: Path) -> None:
    p = tmp_path / "deploytool.yaml"
    p.write_text("version: 1\ndefault_backend: a\nbackends:\n  a:\n    kind: ftllm\n    model: /m\nserve:\n  prot: 5\n")
    r = run("--config", str(p), "check")
    assert r.exit_code == 3
    assert r.stderr == f"error: {p}:8:3: serve: unknown key 'prot'\nhint: did you mean 'port'?\n"


# ------------------------------------------------------------------------------------------------ color


def _check_output(cfg: Path, *opts: str, env: dict[str, str] | None = None) -> str:
    r = run("--config", str(cfg), *opts, "check", "--no-files", env=env, color=True)
    return r.output


def test_color_follows_no_color_and_the_color_option(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    assert "\x1b[" in _check_output(cfg)  # a terminal (CliRunner with color=True), nothing said: colors
    assert "\x1b[" not in _check_output(cfg, env={"NO_COLOR": "1"})
    assert "\x1b[" in _check_output(cfg, "--color", "always", env={"NO_COLOR": "1"})
    assert "\x1b[" not in _check_output(cfg, "--color=never")
    r = run("--config", str(cfg), "check", "--no-files", "--color", "never", color=True)
    assert "\x1b[" not in r.output  # after the command name too
    assert run("--color", "sometimes", "check").exit_code == 2


# ------------------------------------------------------------------------------------------------ completion


def _complete(words: str, env: dict[str, str] | None = None) -> list[str]:
    e = {"_DEPLOYTOOL_COMPLETE": "bash_complete", "COMP_WORDS": words, "COMP_CWORD": str(len(words.split()) - 1
                                                                                       + words.endswith(" "))}
    r = CliRunner().invoke(main, [], env={**e, **(env or {})}, prog_name="deploytool")
    return [ln.split(",", 1)[1] for ln in r.output.splitlines() if "," in ln]


def test_shell_completion_of_examples_and_backends(tmp_path: Path) -> None:
    assert _complete("deploytool init --example c") == ["cpu-demo"]
    assert _complete("deploytool init --example ") == ["two-2080ti", "cpu-demo"]
    cfg = _cfg(tmp_path)
    assert _complete("deploytool switch ", {"DEPLOYTOOL_CONFIG": str(cfg)}) == [
        "ftllm", "ftllm-dflash", "llamacpp", "llamacpp-tensor"]
    assert _complete(f"deploytool --config {cfg} logs ll") == ["llamacpp", "llamacpp-tensor"]
    assert _complete("deploytool switch ", {"DEPLOYTOOL_CONFIG": str(tmp_path / "none.yaml")}) == []
    assert "switch" in _complete("deploytool sw")


# ------------------------------------------------------------------------------------------------ progress


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_wait_shows_what_elapsed_and_limit_on_a_terminal_only() -> None:
    tty = Tty()
    w = progress.Wait("llamacpp-tensor to be ready", 900, tty, show_after=0.05, interval=0.02)
    with w:
        time.sleep(0.2)
        w.note("attempt 3")
    out = tty.getvalue()
    assert "waiting for llamacpp-tensor to be ready: 0s (limit 15m00s)" in out
    assert out.endswith("\r\x1b[K")  # erased when the wait ends
    quick = Tty()
    with progress.Wait("x", 1, quick, show_after=1.0):
        pass
    assert quick.getvalue() == ""  # under the threshold: nothing
    try:
        progress.enable_waits(Tty(), when=lambda: False)  # --json
        assert progress.waiting("x").stream is None
        progress.enable_waits(io.StringIO())  # not a terminal
        assert progress.waiting("x").stream is None
        progress.enable_waits(Tty())
        assert progress.waiting("x").stream is not None
    finally:
        progress.disable_waits()
    assert progress.waiting("x").stream is None


# ------------------------------------------------------------------------------------------------ journal


@pytest.fixture
def journald(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A datagram socket standing in for journald's; yields a function returning the entries received."""
    path = str(tmp_path / "journal.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(path)
    srv.settimeout(0.2)
    monkeypatch.setenv(journal.ENV_SOCKET, path)

    def entries() -> list[dict[str, str]]:
        out = []
        while True:
            try:
                out.append(decode(srv.recv(1 << 16)))
            except TimeoutError:
                return out

    yield entries
    srv.close()


def decode(data: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    while data:
        nl = data.index(b"\n")
        line = data[:nl]
        if b"=" in line:
            k, v = line.split(b"=", 1)
            out[k.decode()] = v.decode()
            data = data[nl + 1:]
        else:
            (n,) = struct.unpack("<Q", data[nl + 1:nl + 9])
            out[line.decode()] = data[nl + 9:nl + 9 + n].decode()
            data = data[nl + 9 + n + 1:]
    return out


def test_native_protocol_encoding() -> None:
    assert journal.encode({"MESSAGE": "a b", "PRIORITY": "6"}) == b"MESSAGE=a b\nPRIORITY=6\n"
    blob = journal.encode({"MESSAGE": "two\nlines"})
    assert blob == b"MESSAGE\n" + struct.pack("<Q", 9) + b"two\nlines\n" and decode(blob) == {"MESSAGE": "two\nlines"}


def test_an_operation_journals_its_start_steps_and_result(journald) -> None:
    with journal.operation(None, "switch", "switch to llamacpp", backend="llamacpp-tensor") as ev:
        ev.tee(lambda s: None)("stop ftllm-dflash.service")
        ev.result(True, "switched to llamacpp-tensor")
    got = journald()
    assert [(e["DEPLOYTOOL_PHASE"], e["MESSAGE"]) for e in got] == [
        ("start", "switch: start switch to llamacpp"), ("step", "switch: stop ftllm-dflash.service"),
        ("result", "switch: switched to llamacpp-tensor")]
    assert {e["SYSLOG_IDENTIFIER"] for e in got} == {"deploytool"}
    assert {e["DEPLOYTOOL_BACKEND"] for e in got} == {"llamacpp-tensor"}
    assert got[-1]["DEPLOYTOOL_OK"] == "1" and got[0]["PRIORITY"] == "5"


def test_a_failed_operation_journals_its_error_and_exit_code(journald) -> None:
    from deploy_tool.errors import RolledBack

    with pytest.raises(RolledBack), journal.operation(None, "switch", "switch to llamacpp"):
        raise RolledBack("llamacpp-tensor failed its gate; ftllm-dflash restored")
    res = journald()[-1]
    assert res["DEPLOYTOOL_PHASE"] == "result" and res["DEPLOYTOOL_OK"] == "0" and res["PRIORITY"] == "3"
    assert res["DEPLOYTOOL_EXIT_CODE"] == "10" and "failed: llamacpp-tensor failed its gate" in res["MESSAGE"]


def test_a_dry_run_or_a_missing_journal_sends_nothing_and_fails_nothing(journald, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    with journal.operation(None, "switch", "x", dry_run=True) as ev:
        ev.step("y")
    assert journald() == []
    monkeypatch.setenv(journal.ENV_SOCKET, str(tmp_path / "no-such.sock"))
    with journal.operation(None, "install", "x") as ev:
        ev.step("y")
        ev.result(True, "done")  # nothing to write to: silently nothing
    monkeypatch.setenv(journal.ENV_SOCKET, "")
    assert journal.Journal.for_config(None).path is None


def test_the_journal_a_config_writes_to(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine's socket for the machine's own systemctl; none for a fake or remote one, nor for a sandbox
    that is not up (one that is: through its systemd's root, tests/test_e2e.py)."""
    monkeypatch.delenv(journal.ENV_SOCKET, raising=False)
    assert journal.socket_for(config.load(_cfg(tmp_path))) is None  # cpu-demo names a sandbox: not up here
    host = config.load(_cfg(tmp_path, sandbox=None))
    assert journal.socket_for(host) == journal.HOST_SOCKET
    fake = config.load(_cfg(tmp_path, sandbox=None, systemctl=["/opt/fake/systemctl-stub"]))
    assert journal.socket_for(fake) is None


def test_uninstall_journals_through_the_operation_hook(journald, tmp_path: Path) -> None:
    """A real operation (uninstall of a box with nothing installed) journals its start and result."""
    from deploy_tool.box import releases

    cfg = config.load(_cfg(tmp_path))
    releases.uninstall(cfg, sd=object())  # type: ignore[arg-type]  # nothing installed: systemd is not asked
    got = journald()
    assert [(e["DEPLOYTOOL_OPERATION"], e["DEPLOYTOOL_PHASE"]) for e in got] == [("uninstall", "start"),
                                                                                  ("uninstall", "result")]
    assert got[-1]["MESSAGE"] == "uninstall: nothing installed, nothing to do"


# ------------------------------------------------------------------------------------------------ logs


def _fake_tools(tmp_path: Path) -> tuple[Path, Path]:
    """A journalctl that records its argv and prints two lines, and a systemctl that answers nothing."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    rec = tmp_path / "argv.json"
    jc = bin_ / "journalctl"
    jc.write_text("#!/usr/bin/env python3\nimport json, sys\n"
                  f"json.dump(sys.argv[1:], open({str(rec)!r}, 'w'))\n"
                  "print('2026-01-01T10:00:00+0000 box deploytool[7]: switch: start switch to llamacpp')\n"
                  "print('2026-01-01T10:00:01+0000 box llama-server[9]: main: server is listening')\n")
    sc = bin_ / "fake-systemctl"
    sc.write_text("#!/bin/sh\nexit 0\n")
    for f in (jc, sc):
        f.chmod(f.stat().st_mode | stat.S_IXUSR)
    return bin_, rec


def test_logs_reads_the_active_backends_unit_and_deploytools_events(tmp_path: Path) -> None:
    bin_, rec = _fake_tools(tmp_path)
    cfg = _cfg(tmp_path, sandbox=None, systemctl=[str(bin_ / "fake-systemctl")], journalctl=[str(bin_ / "journalctl")])
    state_dir = tmp_path / "state_dir"
    state_dir.mkdir()
    r = run("--config", str(cfg), "logs")  # nothing active: the default backend's unit
    assert r.exit_code == 0, r.output
    assert "switch: start switch to llamacpp" in r.output and "server is listening" in r.output
    argv = json.loads(rec.read_text())
    assert argv[-6:] == ["_SYSTEMD_UNIT=ftllm-dflash.service", "+", "UNIT=ftllm-dflash.service", "_PID=1", "+",
                         "SYSLOG_IDENTIFIER=deploytool"]
    assert "-n" in argv and argv[argv.index("-n") + 1] == "50" and "-f" not in argv
    (state_dir / "state.json").write_text(json.dumps({"format": 1, "active_backend": "llamacpp-tensor"}))
    r = run("--config", str(cfg), "logs", "-l", "5", "--no-events")
    argv = json.loads(rec.read_text())
    assert r.exit_code == 0, r.output
    assert "_SYSTEMD_UNIT=llamacpp-tensor.service" in argv and "SYSLOG_IDENTIFIER=deploytool" not in argv
    assert argv[argv.index("-n") + 1] == "5"
    r = run("--config", str(cfg), "logs", "ftllm", "-f", "--json")
    argv = json.loads(rec.read_text())
    assert "-f" in argv and argv[argv.index("-o") + 1] == "json" and "_SYSTEMD_UNIT=ftllm-dflash.service" in argv


def test_logs_dry_run_prints_the_journalctl_command(tmp_path: Path) -> None:
    r = run("--config", str(_cfg(tmp_path)), "logs", "llamacpp", "--dry-run")
    assert r.exit_code == 0
    assert r.output.startswith("would run: journalctl --no-pager -o short-iso -n 50 "
                               "_SYSTEMD_UNIT=llamacpp-tensor.service")


def test_logs_names_a_failing_journalctl(tmp_path: Path) -> None:
    bin_, _ = _fake_tools(tmp_path)
    (bin_ / "journalctl").write_text("#!/bin/sh\necho 'Failed to open journal' >&2\nexit 1\n")
    cfg = _cfg(tmp_path, sandbox=None, systemctl=[str(bin_ / "fake-systemctl")], journalctl=[str(bin_ / "journalctl")])
    r = run("--config", str(cfg), "logs")
    assert r.exit_code == 8 and "journalctl exited 1 reading the journal of ftllm-dflash.service" in r.stderr
    assert "Failed to open journal" in r.stderr  # journalctl's own line, passed on
    assert "Traceback" not in r.output


def test_a_time_journalctl_cannot_read_is_a_usage_error(tmp_path: Path) -> None:
    """`logs --since garbage`: journalctl refuses the time (as the real one words it), which is the caller's
    mistake, not the journal's: exit 2 naming --since, not exit 8 asking whether journald runs."""
    bin_, _ = _fake_tools(tmp_path)
    (bin_ / "journalctl").write_text("#!/bin/sh\necho 'Failed to parse timestamp: garbage' >&2\nexit 1\n")
    cfg = _cfg(tmp_path, sandbox=None, systemctl=[str(bin_ / "fake-systemctl")], journalctl=[str(bin_ / "journalctl")])
    r = run("--config", str(cfg), "logs", "--since", "garbage")
    assert r.exit_code == 2 and "--since" in r.output and "garbage" in r.output, r.output


# ------------------------------------------------------------------------------------------------ paths given as output


@pytest.mark.parametrize(("argv", "code", "words"), [
    (["render", "-o", "{cfg}"], 2, "is a file"),  # a file where a directory is wanted
    (["render", "-o", "/dev/null"], 5, "is not a directory"),
    (["init", "-e", "cpu-demo", "--out", "", "--force"], 2, "names no file"),
    (["init", "-e", "cpu-demo", "--out", "{dir}", "--force"], 2, "is a directory"),
    (["sandbox", "up", "{cfg}"], 15, "not a directory"),
])
@pytest.mark.parametrize("as_json", [False, True])
def test_an_output_path_of_the_wrong_kind_is_one_clear_error(tmp_path: Path, argv: list[str], code: int, words: str,
                                                            as_json: bool) -> None:
    """A file where a directory is wanted, a directory or nothing where a file is: the exit code of its kind, the
    path named, never a traceback or an internal error (exit 70); under --json one JSON object; nothing written."""
    cfg = _cfg(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    full = ["--config", str(cfg), *(["--json"] if as_json else []),
            *[a.replace("{cfg}", str(cfg)).replace("{dir}", str(tmp_path)) for a in argv]]
    r = run(*full)
    assert r.exit_code == code, r.output
    assert "Traceback" not in r.output and "internal error" not in r.output
    out = json.loads(r.stdout) if as_json else None
    assert words in (out["message"] if out else r.output), r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_bug_under_json_is_still_one_json_object(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An internal error (a bug: exit 70) under --json: one JSON object on stdout naming it, not an empty stdout."""
    from deploy_tool import render

    def boom(cfg: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(render, "render_all", boom)
    r = run("--config", str(_cfg(tmp_path)), "--json", "render")
    assert r.exit_code == 70, r.output
    out = json.loads(r.stdout)
    assert out["error"] == "InternalError" and "a bug" in out["message"] and out["exit_code"] == 70


@pytest.mark.parametrize("cmd", [["switch", "llamacpp"], ["rollback"], ["install"], ["releases", "prune"],
                                 ["uninstall", "--yes"]])
@pytest.mark.parametrize("wait", ["nan", "inf", "-5", "soon"])
def test_a_wait_that_is_not_a_finite_number_of_seconds_is_a_usage_error(tmp_path: Path, cmd: list[str],
                                                                         wait: str) -> None:
    """--wait nan would wait for the lock forever (no deadline is ever reached), -5 is a mistake: exit 2, before
    anything is read of the box."""
    r = run("--config", str(_cfg(tmp_path)), *cmd, "--wait", wait)
    assert r.exit_code == 2 and "--wait" in r.output, r.output


@pytest.mark.parametrize(("argv", "prepare"), [
    (["pack"], "key"),  # no requirements.lock: the run refuses it first
    (["lock"], "no-requirements"),
    (["keygen", "--out", "{dir}/keys"], "keys"),  # a key pair there already, no --force
    (["pin", "ftllm", "--reason", "  "], None),
])
def test_a_dry_run_refuses_what_its_run_refuses_first(tmp_path: Path, argv: list[str], prepare: str | None) -> None:
    """--dry-run as a script's preflight: the same refusal and exit code (5) as the run, and nothing written."""
    from deploy_tool.manifest import generate_keypair

    cfg = _cfg(tmp_path)
    if prepare in ("key", "keys"):
        (tmp_path / "keys").mkdir()
        generate_keypair(tmp_path / "keys" / "deploytool.key", tmp_path / "keys" / "deploytool.pub")
    if prepare == "no-requirements":
        data = yaml.safe_load(cfg.read_text())
        data["bundle"]["requirements"] = str(tmp_path / "nowhere.in")
        cfg.write_text(yaml.safe_dump(data))
    full = [a.replace("{dir}", str(tmp_path)) for a in argv]
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    dry = run("--config", str(cfg), "--dry-run", *full)
    real = run("--config", str(cfg), *full) if argv[0] != "lock" else dry  # lock would reach for the index
    assert dry.exit_code == real.exit_code == 5, (dry.output, real.output)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
