"""Names on the command line: the embedded examples (a usage error with did-you-mean, exit 2) and backends (checked
against the config before anything probes the system, exit 3 with did-you-mean), both completed by the shell
(click's shell_complete: `eval "$(_DEPLOYTOOL_COMPLETE=bash_source deploytool)"`)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import click
from click.shell_completion import CompletionItem

EXAMPLES = ("two-2080ti", "cpu-demo")  # deploy_tool.config.EXAMPLES (tests/test_cli_names.py holds them equal)


def did_you_mean(word: str, names: list[str] | tuple[str, ...]) -> str | None:
    from deploy_tool.config import did_you_mean as dym  # the loader is imported only on an error

    return dym(word, names)


class ExampleName(click.ParamType):
    """One of the embedded examples; anything else is a usage error naming the examples and the closest one."""

    name = "example"

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "[" + "|".join(EXAMPLES) + "]"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> str:
        v = str(value)
        if v in EXAMPLES:
            return v
        close = did_you_mean(v, EXAMPLES)
        self.fail(f"unknown example {v!r} (examples: {', '.join(EXAMPLES)})"
                  + (f"; did you mean {close!r}?" if close else ""), param, ctx)

    def shell_complete(self, ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
        return [CompletionItem(n) for n in EXAMPLES if n.startswith(incomplete)]


def _config_for_completion(ctx: click.Context) -> Path | None:
    """The config a completion reads: --config given so far, else DEPLOYTOOL_CONFIG, ./deploytool.yaml, /etc/..."""
    root = ctx.find_root()
    given = root.params.get("config_path") or ctx.params.get("config_path")
    if given:
        return Path(given)
    env = os.environ.get("DEPLOYTOOL_CONFIG")
    if env:
        return Path(env)
    local = Path("deploytool.yaml")
    return local if local.exists() else Path("/etc/deploytool/deploytool.yaml")


class BackendName(click.ParamType):
    """A backend's name, alias or unambiguous prefix: resolved against the config by the command (before any
    system probe); the shell completes the names and aliases of the config's backends."""

    name = "backend"

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "BACKEND"

    def shell_complete(self, ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
        try:
            from deploy_tool import config

            cfg = config.load(_config_for_completion(ctx) or "deploytool.yaml")
            return [CompletionItem(n) for n in config.backend_names(cfg) if n.startswith(incomplete)]
        except Exception:  # no readable config: nothing to offer (a completion never prints an error)
            return []


class SuggestingGroup(click.Group):
    """An unknown command is a usage error (exit 2) naming the closest command."""

    def resolve_command(self, ctx: click.Context, args: list[str]):
        name = args[0] if args else ""
        if name and not name.startswith("-") and self.get_command(ctx, name) is None:
            close = did_you_mean(name, sorted(self.list_commands(ctx)))
            ctx.fail(f"no such command {name!r}" + (f"; did you mean {close!r}?" if close else "")
                     + f" (see `{ctx.command_path} --help`)")
        return super().resolve_command(ctx, args)


class Seconds(click.FloatRange):
    """A number of seconds, 0 or more and finite (click's FloatRange lets nan and inf through, and a wait for the
    lock until nan never ends)."""

    name = "seconds"

    def __init__(self) -> None:
        super().__init__(min=0)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number of seconds", param, ctx)
        return rv


EXAMPLE = ExampleName()
BACKEND = BackendName()
SECONDS = Seconds()
