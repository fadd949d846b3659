"""`deploytool keygen`: an Ed25519 key pair for signing bundles.

The key code (manifest, cryptography) is imported when the command runs: the units' ExecStartPre verify (the
same CLI) must not depend on cryptography.
"""

from __future__ import annotations

import time
from pathlib import Path

import click

from deploy_tool.cli.context import Ctx, pass_ctx
from deploy_tool.errors import InputError


@click.command()
@click.option("--out", "out_dir", type=click.Path(path_type=Path), required=True,
              help="Directory for the key pair (created if missing).")
@click.option("--name", default="deploytool", show_default=True,
              help="File name stem: NAME.key (private, 0600) and NAME.pub (public).")
@click.option("--force", is_flag=True, help="Overwrite an existing key pair.")
@click.option("--not-after", default=None, metavar="YYYY-MM-DDTHH:MM:SSZ",
              help="Write this expiry (UTC) into NAME.pub: from then on, boxes refuse bundles signed by the key.")
@pass_ctx
def keygen(ctx: Ctx, out_dir: Path, name: str, force: bool, not_after: str | None) -> None:
    """Write a new Ed25519 key pair for signing bundles.

    Keep NAME.key private (it signs bundles); copy NAME.pub into the trusted keys directory
    (/etc/deploytool/keys by default) of every box that installs them. To retire a key, add its id to
    KEYS_DIR/revoked on every box (docs/trust.md, "Rotating the signing key", has the steps).
    """
    from deploy_tool.keyring import parse_not_after
    from deploy_tool.manifest import generate_keypair, refuse_existing

    if not name or "/" in name or name.startswith("."):
        raise InputError(f"--name {name!r} must be a plain file name stem")
    when = parse_not_after(not_after) if not_after else None
    if when is not None and when <= time.time():
        raise InputError(f"--not-after {not_after} is in the past: every box would refuse what this key signs",
                         hint="give a time to come (UTC), e.g. a year from now")
    priv, pub = out_dir / f"{name}.key", out_dir / f"{name}.pub"
    if ctx.dry_run:
        refuse_existing(priv, pub, force=force)  # as the run would
        ctx.emit({"would_write": [str(priv), str(pub)]}, f"would write {priv} and {pub}")
        return
    key_id = generate_keypair(priv, pub, force=force, not_after=not_after)
    ctx.emit({"key_id": key_id, "private_key": str(priv), "public_key": str(pub), "not_after": not_after},
             f"key {key_id}:\n  private {priv} (mode 0600, keep it secret)\n"
             f"  public  {pub} (copy into the trusted keys directory)"
             + (f"\n  trusted until {not_after}" if not_after else ""))
