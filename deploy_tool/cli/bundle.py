"""`deploytool bundle verify`: check a bundle's signature, manifest and every file before trusting it.

The bundle code (archive, manifest, cryptography) is imported when the command runs: the units' ExecStartPre
verify (the same CLI) must not depend on cryptography.
"""

from __future__ import annotations

from pathlib import Path

import click

from deploy_tool.cli.context import Ctx
from deploy_tool.cli.names import SuggestingGroup
from deploy_tool.progress import progress_for


@click.group(cls=SuggestingGroup)
def bundle() -> None:
    """Inspect and verify signed bundles."""


@bundle.command()
@click.argument("bundle_path", metavar="BUNDLE", type=click.Path(path_type=Path))
@click.option("--keys", "keys_dir", type=click.Path(path_type=Path), default=None,
              help="Trusted public keys, *.pub (default: paths.keys_dir of --config, else /etc/deploytool/keys).")
@click.pass_context
def verify(cctx: click.Context, bundle_path: Path, keys_dir: Path | None) -> None:
    """Verify BUNDLE (a bundle directory or its .tar.zst): signature first, then every hash, size and mode.

    An archive is unpacked only into a private temporary directory, which is removed afterwards. Exits 6 with
    a named reason (hash-mismatch, extra-file, signature-invalid, untrusted-key, ...) on any problem, 25 when
    the signing key is revoked (KEYS/revoked) or past its not-after. Prints the bundle's signed name and sequence.
    """
    ctx = cctx.find_object(Ctx)
    if ctx is None:  # called outside the deploytool group (e.g. embedded): plain defaults
        ctx = Ctx(config_path=None, json=False, dry_run=False, verbose=False, debug=False)
    _verify(ctx, bundle_path, keys_dir)


def _verify(ctx: Ctx, bundle_path: Path, keys_dir: Path | None) -> None:
    from deploy_tool import bundle as bundle_mod
    from deploy_tool.manifest import DEFAULT_KEYS_DIR

    if keys_dir is None:
        keys_dir = Path(ctx.load_config().paths.keys_dir) if ctx.config_path is not None else DEFAULT_KEYS_DIR
    bar = progress_for(json_mode=ctx.json)
    from deploy_tool.box import sequence

    with bundle_mod.verify_bundle(bundle_path, keys_dir, progress=bar) as vb:
        seq = sequence.of_bundle(vb.manifest, vb.root / "config.json")
        data = {"ok": True, **vb.to_json(), "keys_dir": str(keys_dir), "sequence": seq.to_json()}
        ctx.emit(data, f"bundle {vb.bundle_id} OK: signed by trusted key {vb.key_id}, "
                       f"{len(vb.manifest.files)} files ({vb.manifest.total_size} bytes) match the MANIFEST; "
                       f"{seq.name} sequence {seq.number}{' (none: packed before sequences)' if seq.legacy else ''}")
