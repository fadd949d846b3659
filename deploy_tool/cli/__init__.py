"""The command line: thin click commands that parse, call one library function and print.

Errors are mapped at this one edge: a DeployError becomes one red line plus a hint and its own exit code;
anything else is a bug (exit 70), shown with its traceback only under --debug.

"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from pathlib import Path

import click

from deploy_tool import __version__
from deploy_tool.cli.context import Ctx
from deploy_tool.cli.names import SuggestingGroup
from deploy_tool.errors import DeployError, ExitCode

ENV_CONFIG = "DEPLOYTOOL_CONFIG"
COLOR_MODES = ("auto", "always", "never")




class Group(SuggestingGroup):
    """Maps DeployError to a one-line message with a hint and its exit code; shows tracebacks only with --debug."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except DeployError as exc:
            obj = ctx.find_object(Ctx)
            if obj is not None and obj.json:
                click.echo(json.dumps(exc.to_json(), indent=2, sort_keys=True, default=str))
            else:
                click.secho(f"error: {exc.message}", fg="red", err=True)
                if exc.hint:
                    click.echo(f"hint: {exc.hint}", err=True)
            if obj is not None and obj.debug:
                traceback.print_exc()
            sys.exit(int(exc.exit_code))
        except click.UsageError as exc:
            obj = ctx.find_object(Ctx)
            if (obj is not None and obj.json) or "--json" in sys.argv[1:]:  # before or after the command
                _usage_json(exc, ctx)
            raise
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException, SystemExit):
            raise
        except KeyboardInterrupt:
            click.secho("interrupted", fg="red", err=True)
            click.echo("hint: `deploytool status` says whether an operation was left for `deploytool recover` to "
                       "finish (an install undoes itself)", err=True)
            sys.exit(130)
        except Exception as exc:  # a bug: say so in one line, traceback with --debug
            obj = ctx.find_object(Ctx)
            if obj is not None and obj.debug:
                traceback.print_exc()
            hint = "this is a bug in deploytool; rerun with --debug and report the traceback"
            if obj is not None and obj.json:  # a script reads one JSON object whatever went wrong
                click.echo(json.dumps({"error": "InternalError", "message": f"{type(exc).__name__}: {exc}",
                                       "exit_code": int(ExitCode.INTERNAL), "hint": hint},
                                      indent=2, sort_keys=True, default=str))
            else:
                click.secho(f"internal error: {type(exc).__name__}: {exc}", fg="red", err=True)
                click.echo(f"hint: {hint}", err=True)
            sys.exit(int(ExitCode.INTERNAL))

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # deploytool's own options, before any command: a mistake there under --json is JSON too (the parser
        # consumes the list it is given: asked of a copy)
        given = list(args)
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            if "--json" in given:
                _usage_json(exc, ctx)
            raise


def _usage_json(exc: click.UsageError, ctx: click.Context) -> None:
    """A usage error as one JSON object on stdout, then exit 2."""
    where = exc.ctx.command_path if exc.ctx is not None else ctx.command_path
    click.echo(json.dumps({"error": "UsageError", "message": exc.format_message(), "exit_code": exc.exit_code,
                           "hint": f"see `{where} --help`"}, indent=2, sort_keys=True))
    sys.exit(exc.exit_code)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="deploytool")
@click.option("--config", "-c", "config_path", type=click.Path(path_type=Path), envvar=ENV_CONFIG,
              help=f"The config file (default: ./deploytool.yaml if present, else /etc/deploytool/deploytool.yaml; "
                   f"env {ENV_CONFIG}).")
@click.option("--json", "json_out", is_flag=True, help="Print machine-readable JSON instead of text.")
@click.option("--dry-run", "-n", is_flag=True, help="Show what would change, change nothing.")
@click.option("--verbose", "-v", is_flag=True, help="Log every external command (+ argv).")
@click.option("--debug", is_flag=True, help="Show tracebacks and debug logs.")
@click.option("--color", "color", type=click.Choice(COLOR_MODES), default=None, metavar="[auto|always|never]",
              help="Colors in text output: auto (default) colors a terminal unless NO_COLOR is set; always; never.")
@click.pass_context
def main(ctx: click.Context, config_path: Path | None, json_out: bool, dry_run: bool, verbose: bool,
         debug: bool, color: str | None) -> None:
    """deploytool: run self-hosted LLM inference servers as systemd services.

    \b
    One YAML config describes the box and its backends (e.g. ftllm-dflash and llamacpp-tensor behind one
    port and one model name). Typical flow:
      deploytool init --example two-2080ti   write a starter config
      deploytool check                       validate it against every known pitfall
      deploytool render --out DIR            the unit and env files it produces
      deploytool pack                        a signed, reproducible, offline bundle in artifacts/
      deploytool install                     set up this box from the bundle, start the default backend
      deploytool switch llamacpp             swap backends behind a health gate, rolling back on failure
      deploytool status / history            what runs (exit 0 only when serving), what happened
      deploytool metrics                     the same for Prometheus (node_exporter textfile format)

    \b
    Exit codes: 0 ok, 2 usage, 3 config, 4 check failed, 5 input file, 6 bundle, 7 drift, 8 systemd,
    9 health, 10 rolled back, 11 rollback failed, 12 locked, 13 state, 14 install, 15 sandbox,
    16 missing tool, 17 OS, 18 runtime truth, 19 performance, 23 unsafe path, 24 downgrade, 25 key,
    30 GPU, 70 internal bug; `status` alone:
    20 degraded, 21 interrupted operation pending, 22 not serving.
    """
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    _set_logging(verbose, debug)  # only ours: the `sh` library logs every line at DEBUG
    ctx.obj = Ctx(config_path=config_path, json=json_out, dry_run=dry_run, verbose=verbose, debug=debug,
                  color=color or "auto")
    apply_color(ctx, ctx.obj.color)
    from deploy_tool import progress

    obj = ctx.obj
    progress.enable_waits(when=lambda: not obj.json)  # a wait's line on a terminal, never with --json



def color_setting(mode: str) -> bool | None:
    """click's color for `--color MODE`: True always, False never, None (a terminal only) for auto, which NO_COLOR
    (https://no-color.org: set and not empty) turns off."""
    if mode == "always":
        return True
    if mode == "never" or os.environ.get("NO_COLOR"):
        return False
    return None


def apply_color(ctx: click.Context, mode: str) -> None:
    """Set the color of `ctx` and every context above it (the error edge prints from the root's)."""
    c: click.Context | None = ctx
    while c is not None:
        c.color = color_setting(mode)
        c = c.parent


# main's parameter name -> the Ctx field it sets
_GLOBAL_FIELDS = {"config_path": "config_path", "json_out": "json", "dry_run": "dry_run", "verbose": "verbose",
                  "debug": "debug", "color": "color"}


def _set_logging(verbose: bool, debug: bool) -> None:
    logging.getLogger("deploytool").setLevel(logging.DEBUG if (verbose or debug) else logging.WARNING)


def _global_callback(field: str):
    def set_field(ctx: click.Context, param: click.Parameter, value: object) -> None:
        if value is None or value is False:  # not given after the subcommand: the global value stands
            return
        obj = ctx.find_object(Ctx)
        if obj is None:  # a command used outside the deploytool group: its own defaults
            obj = ctx.obj = Ctx(config_path=None, json=False, dry_run=False, verbose=False, debug=False)
        setattr(obj, field, value)
        if field in ("verbose", "debug"):
            _set_logging(obj.verbose, obj.debug)
        if field == "color":
            apply_color(ctx, str(value))

    return set_field


def share_global_options(cmd: click.Command) -> None:
    """Accept every global option (--config, --json, --dry-run, --verbose, --debug, --color) after `cmd` too, and
    after each of its subcommands: `deploytool status --json` is `deploytool --json status`.

    A command's own option of the same long name is kept (it sets the same Ctx field). A short option has one
    meaning everywhere (-n is --dry-run, -c --config, -v --verbose; tests/test_cli_names.py holds it). A command that passes unknown
    options through (sandbox exec CMD...) reads its own options only before its first argument, so CMD's
    options stay CMD's.
    """
    if isinstance(cmd, click.Group):
        for sub in cmd.commands.values():
            share_global_options(sub)
    taken = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
    for gp in main.params:
        if not isinstance(gp, click.Option) or gp.name not in _GLOBAL_FIELDS:
            continue
        if any(o.startswith("--") and o in taken for o in gp.opts):
            continue
        opts = [o for o in gp.opts if o not in taken]
        cmd.params.append(click.Option(opts, type=None if gp.is_flag else gp.type, is_flag=gp.is_flag or None,
                                       expose_value=False, callback=_global_callback(_GLOBAL_FIELDS[gp.name]),
                                       help=gp.help, metavar=gp.metavar))
    if cmd.ignore_unknown_options or cmd.context_settings.get("ignore_unknown_options"):
        cmd.context_settings["allow_interspersed_args"] = False


def _register() -> None:
    # the command modules import Ctx and pass_ctx from this package: they are imported once those exist
    from deploy_tool.cli import basic, bench, bundle, keys, logs, ops, releases, sandbox, verify

    for cmd in (*basic.COMMANDS, *ops.COMMANDS, *releases.COMMANDS, sandbox.sandbox, keys.keygen, bundle.bundle, verify.verify,
                verify.verify_front, verify.pin, verify.await_ready, bench.bench, logs.logs):
        main.add_command(cmd)
    for cmd in main.commands.values():
        share_global_options(cmd)


_register()
