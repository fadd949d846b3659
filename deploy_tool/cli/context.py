"""What every command gets: the global options (--config, --json, --dry-run, -v, --debug, --color) and the config they
name, and how a result is printed (JSON with --json, else text)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import click


@dataclass
class Ctx:
    config_path: Path | None
    json: bool
    dry_run: bool
    verbose: bool
    debug: bool
    color: str = "auto"  # --color: auto, always, never (NO_COLOR turns auto off)

    def load_config(self):
        """The config: --config, else ./deploytool.yaml, else /etc/deploytool/deploytool.yaml.

        A ./deploytool.yaml that differs from /etc's is used with a warning on stderr: on a box, the copy left in
        root's home by the install steps and the one the units name drift apart at the first edit of either."""
        from deploy_tool import config

        path = self.config_path
        if path is None:
            local = Path("deploytool.yaml")
            path = local if local.exists() else config.DEFAULT_CONFIG_PATH
            if path is local:
                warn_if_shadowing(local, config.DEFAULT_CONFIG_PATH)
        return config.load(path)

    def emit(self, data: object, human: str | None = None) -> None:
        """Print `data` as JSON with --json, else the human text."""
        if self.json:
            click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
        elif human is not None:
            click.echo(human.rstrip("\n"))


def warn_if_shadowing(local: Path, system: Path) -> None:
    """Warn on stderr when `local` is used while `system` exists with other contents."""
    try:
        if local.resolve() == system.resolve() or local.read_bytes() == system.read_bytes():
            return
    except OSError:
        return  # no system config (a packaging machine), or one this user cannot read: nothing to compare
    click.echo(f"warning: using ./deploytool.yaml, which differs from {system} (pass --config to choose)", err=True)


pass_ctx = click.make_pass_decorator(Ctx)
