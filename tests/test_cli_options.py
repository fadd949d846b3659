"""Every global option (--config, --json, --dry-run, --verbose, --debug, --color) is accepted after every subcommand of
the click group too, found by walking the group (a new command or a new global option is covered without
editing this file), and means the same as before the command."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from click.testing import CliRunner

from deploy_tool import cli
from deploy_tool.cli import main
from deploy_tool.cli.context import Ctx
from tests.support.configs import example_dict, set_key


def walk(group: click.Group, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    """Every command under `group` (groups themselves included), depth first."""
    for name in sorted(group.commands):
        cmd = group.commands[name]
        yield (*path, name), cmd
        if isinstance(cmd, click.Group):
            yield from walk(cmd, (*path, name))


COMMANDS = list(walk(main))
# the global options: everything main takes but its eager --version (and --help, which click adds)
GLOBALS = [p for p in main.params if isinstance(p, click.Option) and not p.is_eager]


def _value_args(opt: click.Option) -> tuple[list[str], Any]:
    """Arguments that give `opt` a non-default value, and the value the Ctx field must then hold."""
    if opt.is_flag:
        return [], True
    if isinstance(opt.type, click.Choice):  # --color
        return ["never"], "never"
    return ["elsewhere.yaml"], Path("elsewhere.yaml")


def test_the_walk_finds_the_nested_commands() -> None:
    """The walk reaches nested groups' commands (so the tests below cover them), and every global option has
    a Ctx field it sets."""
    names = {" ".join(p) for p, _ in COMMANDS}
    assert {"status", "verify", "pin", "sandbox up", "sandbox exec", "bundle verify"} <= names
    assert len(GLOBALS) >= 5
    assert {p.name for p in GLOBALS} == set(cli._GLOBAL_FIELDS)
    assert set(cli._GLOBAL_FIELDS.values()) <= set(Ctx.__dataclass_fields__)


def _parse(path: tuple[str, ...], args: list[str]) -> tuple[Ctx, click.Context]:
    """Parse `deploytool PATH... ARGS` the way click does (callbacks run), without invoking any command;
    missing required arguments are tolerated."""
    obj = Ctx(config_path=None, json=False, dry_run=False, verbose=False, debug=False)
    ctx = click.Context(main, info_name="deploytool", obj=obj)
    group: click.Command = main
    for i, name in enumerate(path):
        assert isinstance(group, click.Group)
        cmd = group.commands[name]
        ctx = cmd.make_context(name, list(args) if i == len(path) - 1 else [], parent=ctx, resilient_parsing=True)
        group = cmd
    return obj, ctx


@pytest.mark.parametrize("opt", GLOBALS, ids=[p.name or "" for p in GLOBALS])
@pytest.mark.parametrize("path", [p for p, _ in COMMANDS], ids=[" ".join(p) for p, _ in COMMANDS])
def test_global_option_after_subcommand_sets_the_same_field(path: tuple[str, ...], opt: click.Option) -> None:
    """`deploytool SUB... --opt` sets the same Ctx field as `deploytool --opt SUB...`, under every long name."""
    field = cli._GLOBAL_FIELDS[opt.name or ""]
    extra, want = _value_args(opt)
    for name in [o for o in opt.opts if o.startswith("--")]:
        obj, _ = _parse(path, [name, *extra])
        assert getattr(obj, field) == want, (path, name)


@pytest.mark.parametrize("path", [p for p, _ in COMMANDS], ids=[" ".join(p) for p, _ in COMMANDS])
def test_real_parser_accepts_every_global_option_after_every_subcommand(path: tuple[str, ...]) -> None:
    """Through the real command line: `deploytool SUB... --opt [value] --help` exits 0 for each global option
    (an unknown option would exit 2 with 'No such option')."""
    runner = CliRunner()
    for opt in GLOBALS:
        extra, _ = _value_args(opt)
        for name in [o for o in opt.opts if o.startswith("--")]:
            r = runner.invoke(main, [*path, name, *extra, "--help"])
            assert r.exit_code == 0, (path, name, r.output)
            assert "No such option" not in r.output


def test_status_json_after_the_subcommand_is_the_same_report(tmp_path: Path) -> None:
    """`status --json` prints the same JSON as `--json status` (here: no systemd reachable, no backend active;
    the report says so in both, and both exit 22: not serving)."""
    data = example_dict("cpu-demo")
    for key in ("state_dir", "root", "unit_dir", "env_dir", "keys_dir"):
        set_key(data, f"paths.{key}", str(tmp_path / key))
    cfg = tmp_path / "deploytool.yaml"
    import yaml

    cfg.write_text(yaml.safe_dump(data))
    runner = CliRunner()
    before = runner.invoke(main, ["--config", str(cfg), "--json", "status"])
    after = runner.invoke(main, ["status", "--json", "--config", str(cfg)])
    assert before.exit_code == after.exit_code == 22, (before.output, after.output)
    a, b = json.loads(before.output), json.loads(after.output)
    assert a.keys() == b.keys() and a["active_backend"] is None and a["config"] == b["config"]
    c1 = runner.invoke(main, ["--config", str(cfg), "--json", "check", "--no-files"])
    c2 = runner.invoke(main, ["check", "--no-files", "--json", "-c", str(cfg)])
    assert c1.exit_code == c2.exit_code and json.loads(c1.output) == json.loads(c2.output)


def test_error_after_subcommand_json_is_json(tmp_path: Path) -> None:
    """An error under `SUB --json` is printed as JSON with its exit code, as under `--json SUB`."""
    r = CliRunner().invoke(main, ["status", "--json", "--config", str(tmp_path / "missing.yaml")])
    assert r.exit_code == 5
    out = json.loads(r.output)
    assert out["exit_code"] == 5 and "config file not found" in out["message"]


@pytest.mark.parametrize("argv", [["switch"], ["swich", "ftllm"], ["logs", "-l", "abc"], ["pin", "ftllm"],
                                  ["status", "--bogus"], ["--bogus"], ["--color", "pink", "status"]])
@pytest.mark.parametrize("where", ["before", "after"])
def test_a_usage_error_under_json_is_json(argv: list[str], where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mistyped command line under --json (before or after the command): one JSON object on stdout, exit 2."""
    full = ["--json", *argv] if where == "before" else [*argv, "--json"]
    monkeypatch.setattr(sys, "argv", ["deploytool", *full])
    r = CliRunner().invoke(main, full)
    assert r.exit_code == 2, r.output
    out = json.loads(r.stdout)
    assert out["error"] == "UsageError" and out["exit_code"] == 2 and out["message"] and "--help" in out["hint"]


def test_uninstall_asks_first_and_a_script_must_say_yes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No terminal and no --yes: refused (exit 5) before anything is read of the box; on a terminal the question,
    and "n" aborts; --yes and --dry-run go ahead (here: nothing installed)."""
    data = example_dict("cpu-demo")
    data.pop("systemd", None)
    cfg = tmp_path / "deploytool.yaml"
    cfg.write_text(yaml.safe_dump(data))
    (tmp_path / "demo-root" / "var" / "lib" / "deploytool").mkdir(parents=True)
    (tmp_path / "demo-root" / "var" / "lib" / "deploytool" / "state.json").write_text("{}")
    r = CliRunner().invoke(main, ["--config", str(cfg), "uninstall"])
    assert r.exit_code == 5 and "--yes" in r.output, r.output
    from deploy_tool.cli import releases as cli_releases

    monkeypatch.setattr(cli_releases, "can_ask", lambda: True)
    r = CliRunner().invoke(main, ["--config", str(cfg), "uninstall"], input="n\n")
    assert r.exit_code == 1 and "uninstall: stop the backends" in r.output, r.output
    assert (tmp_path / "demo-root" / "var" / "lib" / "deploytool" / "state.json").exists()
    (tmp_path / "demo-root" / "var" / "lib" / "deploytool" / "state.json").unlink()  # nothing installed
    for argv in (["uninstall", "--dry-run"], ["uninstall", "-y"]):
        r = CliRunner().invoke(main, ["--config", str(cfg), *argv])
        assert r.exit_code == 0, r.output


def test_dry_run_after_subcommand_changes_nothing(tmp_path: Path) -> None:
    """`init --dry-run` writes nothing, exactly like `--dry-run init`."""
    out = tmp_path / "d.yaml"
    r = CliRunner().invoke(main, ["init", "--example", "cpu-demo", "--out", str(out), "--dry-run"])
    assert r.exit_code == 0 and "would write" in r.output and not out.exists()


def test_pass_through_command_keeps_its_commands_options() -> None:
    """`sandbox exec DIR CMD --json`: --json belongs to CMD, not to deploytool; before DIR it is deploytool's."""
    obj, ctx = _parse(("sandbox", "exec"), ["/tmp/sb", "systemctl", "--json", "--dry-run"])
    assert ctx.params["cmd"] == ("systemctl", "--json", "--dry-run") and not obj.json and not obj.dry_run
    obj, ctx = _parse(("sandbox", "exec"), ["--json", "/tmp/sb", "systemctl", "status"])
    assert obj.json and ctx.params["cmd"] == ("systemctl", "status")


def test_one_meaning_per_short_option() -> None:
    """A short option means one thing in every command: -n is --dry-run in history too (its --limit is -l, as
    logs' --limit/--lines), and no command gives a global short name (-c, -n, -v) to an option of its own."""
    obj, ctx = _parse(("history",), ["-n", "-l", "3"])
    assert ctx.params["limit"] == 3 and obj.dry_run
    meaning: dict[str, set[str]] = {}
    for _path, cmd in [((), main), *COMMANDS]:
        for p in cmd.params:
            if isinstance(p, click.Option):
                for o in p.opts:
                    if not o.startswith("--"):
                        meaning.setdefault(o, set()).add(next((x for x in p.opts if x.startswith("--")), o))
    assert {o: m for o, m in meaning.items() if len(m) > 1} == {}


def test_a_local_config_that_differs_from_the_system_one_is_used_with_a_warning(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """./deploytool.yaml wins over /etc's, as documented; when both exist and differ, stderr says which one is used
    (one line, the command's result unchanged); identical copies, the same file or no system file say nothing."""
    from deploy_tool import config

    system = tmp_path / "etc" / "deploytool.yaml"
    system.parent.mkdir()
    monkeypatch.setattr(config, "DEFAULT_CONFIG_PATH", system)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    local = work / "deploytool.yaml"
    one = yaml.safe_dump(example_dict("two-2080ti"), sort_keys=False).encode()
    other = yaml.safe_dump(set_key(example_dict("two-2080ti"), "serve.port", 8090), sort_keys=False).encode()

    def run() -> tuple[Any, str]:
        ctx = Ctx(config_path=None, json=False, dry_run=False, verbose=False, debug=False)
        runner = CliRunner()
        got: dict[str, Any] = {}

        @click.command()
        def cmd() -> None:
            got["cfg"] = ctx.load_config()

        r = runner.invoke(cmd, [], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        return got["cfg"], r.stderr

    local.write_bytes(other)
    cfg, err = run()  # no system file: nothing to compare
    assert cfg.serve.port == 8090 and err == ""
    system.write_bytes(one)
    cfg, err = run()
    assert cfg.serve.port == 8090  # the local one is used, as documented
    assert err == f"warning: using ./deploytool.yaml, which differs from {system} (pass --config to choose)\n"
    local.write_bytes(one)
    cfg, err = run()
    assert err == ""
    local.unlink()
    local.symlink_to(system)
    cfg, err = run()
    assert err == ""
