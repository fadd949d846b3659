"""Trust, through install and verify as the CLI runs them, fast: no replay (a bundle's signed sequence against the
box's highest), key lifecycle (a revoked or expired signer), StrictModes (install refuses before it changes
anything; verify refuses the start, exit 23, on the fast ExecStartPre path and through click alike).

Real parts except systemd: small real bundles packed by the real `pack` (tests/test_install_kills.py's fixture),
verified with real Ed25519 signatures, unpacked, pinned on disk; the fake systemd driver (real sockets). The same
cases where systemd's own behaviour matters run on the real sandbox in tests/test_trust_e2e.py.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from deploy_tool import manifest
from deploy_tool.box import operations, sequence
from deploy_tool.builder import pack as pack_mod
from deploy_tool.cli import main
from deploy_tool.config import Config
from deploy_tool.errors import DeployError, ExitCode
from tests.support.bundles import rebundle
from tests.test_install_kills import CLEAN, Box, Bundles, F, Outcome

# with tests/test_install_kills.py on one xdist worker: its two packed bundles (tests/conftest.py) serve both
pytestmark = pytest.mark.xdist_group("tests/test_install_kills.py")


def install(bx: Box, bundle: Path, *, cfg: Config | None = None, allow: str | None = None,
            keys: str | None = None) -> Outcome:
    return bx._run(lambda sd: operations.install(cfg or bx.cfg, str(bundle), log=bx.log.append, sd=sd,
                                                 allow_downgrade=allow, keys_dir=keys), None)


def key(b: Bundles) -> Path:
    return b.dir / "keys" / "signer.key"


def snapshot(bx: Box) -> dict[str, object]:
    """What an install changes on the box: its traces, state, history, the sequence record, what runs."""
    rec = sequence.record_path(bx.state_dir)
    return {"traces": bx.traces(), "state": bx.state(), "history": bx.history(),
            "record": rec.read_bytes() if rec.exists() else None, "active": sorted(bx.world.active()),
            "units": sorted(os.listdir(bx.unit_dir)) if bx.unit_dir.is_dir() else []}


@pytest.fixture()
def box(bundles: Bundles):
    bx = Box(bundles)
    yield bx
    bx.world.close()
    bx.reset()


@pytest.fixture(scope="module")
def seqs(bundles: Bundles, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A and B at the sequences a test needs, re-signed under new MANIFESTs (new ids: other releases)."""
    d = tmp_path_factory.mktemp("seqs")
    k = key(bundles)
    return {"a5": rebundle(bundles.a, d, k, sequence=5), "a9": rebundle(bundles.a, d, k, sequence=9),
            "b3": rebundle(bundles.b, d, k, sequence=3), "b5": rebundle(bundles.b, d, k, sequence=5),
            "b7": rebundle(bundles.b, d, k, sequence=7), "b-legacy": rebundle(bundles.b, d, k, legacy=True)}


# ------------------------------------------------------------------------------------------------ the sequence

def test_pack_signs_the_sequence_it_is_given(bundles: Bundles, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """`pack` puts bundle_name and sequence into the signed MANIFEST: --sequence over bundle.sequence over
    SOURCE_DATE_EPOCH over 0; only the inputs (and so the id) change with it, not one file."""
    cfg = bundles.cfg
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    assert pack_mod.sequence_of(cfg) == 0
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1750000000")
    assert pack_mod.sequence_of(cfg) == 1750000000
    import dataclasses

    assert pack_mod.sequence_of(dataclasses.replace(cfg, bundle=dataclasses.replace(cfg.bundle, sequence=12))) == 12
    assert pack_mod.sequence_of(cfg, 42) == 42
    with pytest.raises(DeployError) as ei:
        pack_mod.sequence_of(cfg, -1)
    assert ei.value.exit_code == ExitCode.INPUT
    monkeypatch.delenv("SOURCE_DATE_EPOCH")
    info = pack_mod.pack(cfg, out_dir=tmp_path / "out", key_path=key(bundles), sequence=42)
    a = manifest.Manifest.from_bytes((bundles.a.parent / bundles.a.name.split(".tar")[0] / "MANIFEST").read_bytes())
    assert info.manifest.inputs["sequence"] == 42 and info.manifest.inputs["bundle_name"] == cfg.bundle.name
    assert a.inputs["sequence"] == 0
    assert info.manifest.files == a.files and info.bundle_id != a.bundle_id


def test_an_older_bundle_is_refused_naming_both_and_nothing_changes(box: Box, seqs: dict[str, Path]) -> None:
    """A at 5 installed; B at 3 (never on this box): exit 24 naming both releases and sequences, with the fix;
    the box, its history and its record exactly as they were, A serving."""
    assert install(box, seqs["a5"]).what == "installed", box.log
    before = snapshot(box)
    out = install(box, seqs["b3"], cfg=box.b.cfg_b)
    assert out.what == "error" and out.error is not None, out
    e = out.error
    a5, b3 = seqs["a5"].name.rsplit("-", 1)[1], seqs["b3"].name.rsplit("-", 1)[1]
    assert e.exit_code == ExitCode.DOWNGRADE == 24
    assert e.message == (f"bundle {b3} (cpu-demo) has sequence 3, lower than sequence 5 of release {a5} this box "
                         "installed: an older bundle is not installed over a newer one")
    assert e.hint is not None and "--allow-downgrade --reason TEXT" in e.hint
    assert snapshot(box) == before


def test_a_downgrade_on_purpose_is_recorded_and_the_highest_stays(box: Box, seqs: dict[str, Path]) -> None:
    """--allow-downgrade --reason: installed, history names from/to and the reason; the record still holds 5, so
    B at 3 was let in, but nothing else below 5 is."""
    assert install(box, seqs["a5"]).what == "installed", box.log
    out = install(box, seqs["b3"], cfg=box.b.cfg_b, allow="5 loses requests under load")
    assert out.what == "installed", (out, box.log)
    last = [e for e in box.history() if e["event"] == "install"][-1]
    a5 = seqs["a5"].name.rsplit("-", 1)[1]
    assert last["downgrade"] == {"name": "cpu-demo", "from": 5, "from_release": a5, "to": 3,
                                 "reason": "5 loses requests under load"}
    assert last["reason"] == "downgrade: 5 loses requests under load" and last["sequence"] == 3
    assert sequence.load(box.state_dir)["cpu-demo"]["sequence"] == 5


def test_going_back_to_a_release_on_the_box_is_not_a_downgrade(box: Box, seqs: dict[str, Path]) -> None:
    """A at 5, then B at 7, then A at 5 again (its release is laid down on the box): installed, no downgrade; an
    equal sequence is accepted too; the highest is 7 throughout."""
    assert install(box, seqs["a5"]).what == "installed"
    assert install(box, seqs["b7"], cfg=box.b.cfg_b).what == "installed"
    n = len(box.log)
    out = install(box, seqs["a5"])
    assert out.what == "installed", (out, box.log)
    assert box.current_release() == seqs["a5"].name.rsplit("-", 1)[1]
    assert "downgrade" not in box.history()[-1]
    # not silent: the operator is told it goes back, from which sequence to which
    assert any("going back to an older release of cpu-demo" in ln and "sequence 5" in ln and "sequence 7" in ln
               for ln in box.log[n:]), box.log[n:]
    assert install(box, seqs["b7"], cfg=box.b.cfg_b).what == "installed"
    rec = sequence.load(box.state_dir)["cpu-demo"]
    assert rec["sequence"] == 7 and rec["release"] == seqs["b7"].name.rsplit("-", 1)[1]


def test_an_equal_sequence_and_a_legacy_bundle(box: Box, seqs: dict[str, Path]) -> None:
    """B at 5 after A at 5: accepted (a rebuild, or packs that set none). A bundle with no sequence (packed before
    there were any) counts as 0 under its config's bundle.name: refused after 5, saying it carries none."""
    assert install(box, seqs["a5"]).what == "installed"
    assert install(box, seqs["b5"], cfg=box.b.cfg_b).what == "installed", box.log
    out = install(box, seqs["b-legacy"], cfg=box.b.cfg_b)
    assert out.error is not None and out.error.exit_code == 24
    assert "sequence 0 (it carries none: packed before sequences)" in out.error.message


@pytest.mark.parametrize("bad", ["5", True, -1, 1 << 60, None])
def test_a_malformed_signed_sequence_is_a_bundle_error(box: Box, bundles: Bundles, tmp_path: Path, bad) -> None:
    """A sequence that is not an integer in range, signed by a trusted key: exit 6 naming it, nothing written."""
    b = rebundle(bundles.a, tmp_path, key(bundles), sequence=None)
    man = json.loads((b / "MANIFEST").read_bytes())
    man["inputs"]["sequence"] = bad
    m = manifest.Manifest.build([manifest.FileEntry(f["path"], f["size"], int(f["mode"], 8), f["sha256"])
                                 for f in man["files"]], inputs=man["inputs"], native_libs=man["native_libs"],
                                created=man["created"])
    (b / "MANIFEST").write_bytes(m.to_bytes())
    (b / "MANIFEST.sig").write_bytes(manifest.sign(m.to_bytes(), key(bundles)))
    out = install(box, b)
    assert out.error is not None and out.error.exit_code == 6, out
    assert "sequence" in out.error.message and getattr(out.error, "reason", "") == "sequence-invalid"
    assert box.traces() == CLEAN


def test_a_damaged_record_is_named(box: Box, seqs: dict[str, Path]) -> None:
    assert install(box, seqs["a5"]).what == "installed"
    sequence.record_path(box.state_dir).write_text("{}\n")
    out = install(box, seqs["b7"], cfg=box.b.cfg_b)
    assert out.error is not None and out.error.exit_code == ExitCode.STATE
    assert str(sequence.record_path(box.state_dir)) in out.error.message


def test_allow_downgrade_and_reason_go_together(bundles: Bundles) -> None:
    """Either alone is a usage error (exit 2) naming the other, before the config or the bundle is read."""
    for args, says in ((["--allow-downgrade"], "--allow-downgrade needs --reason"),
                       (["--reason", "x"], "--reason goes with --allow-downgrade"),
                       (["--allow-downgrade", "--reason", "  "], "--allow-downgrade needs --reason")):
        r = CliRunner().invoke(main, ["--config", str(bundles.cfg.source_path), "install", str(bundles.a), *args])
        assert r.exit_code == 2 and says in r.output, r.output


# ------------------------------------------------------------------------------------------------ keys

def test_a_bundle_of_a_revoked_or_expired_key_is_refused_before_anything(box: Box, bundles: Bundles) -> None:
    """The signer revoked in KEYS/revoked: exit 25 naming its key id, the box clean; its key file with a not-after
    in the past: exit 25 again, naming when."""
    keys = Path(box.cfg.paths.keys_dir)
    kid = manifest.public_key_id(key(bundles))
    pub = (keys / "signer.pub").read_text()
    try:
        (keys / "revoked").write_text(f"{kid} rotated out\n")
        out = install(box, bundles.a)
        assert out.error is not None and out.error.exit_code == ExitCode.KEY == 25
        assert kid in out.error.message and "revoked" in out.error.message
        assert box.traces() == CLEAN
        (keys / "revoked").unlink()
        (keys / "signer.pub").write_text("not-after: 2001-01-01T00:00:00Z\n" + pub)
        out = install(box, bundles.a)
        assert out.error is not None and out.error.exit_code == 25
        assert kid in out.error.message and "expired at 2001-01-01T00:00:00Z" in out.error.message
        assert box.traces() == CLEAN
        (keys / "signer.pub").write_text("not-after: 2999-01-01T00:00:00Z\n" + pub)
        assert install(box, bundles.a).what == "installed", box.log
    finally:
        (keys / "signer.pub").write_text(pub)
        (keys / "revoked").unlink(missing_ok=True)


def test_keys_given_on_the_command_line_do_not_escape_the_boxs_revocations(box: Box, bundles: Bundles,
                                                                           tmp_path: Path) -> None:
    """`install --keys DIR` names where the trusted keys are: a key this box revoked (paths.keys_dir/revoked) is
    refused all the same (exit 25), with its .pub in DIR and no revocation list there; the box clean."""
    keys = Path(box.cfg.paths.keys_dir)
    kid = manifest.public_key_id(key(bundles))
    other = tmp_path / "other-keys"
    other.mkdir(mode=0o755)
    shutil.copy(keys / "signer.pub", other / "signer.pub")
    try:
        (keys / "revoked").write_text(f"{kid} leaked\n")
        out = install(box, bundles.a, keys=str(other))
        assert out.error is not None and out.error.exit_code == ExitCode.KEY, (out, box.log)
        assert kid in out.error.message and "revoked" in out.error.message
        assert box.traces() == CLEAN
    finally:
        (keys / "revoked").unlink(missing_ok=True)
    assert install(box, bundles.a, keys=str(other)).what == "installed", box.log


def test_a_dry_run_install_refuses_what_the_install_refuses(box: Box, bundles: Bundles, tmp_path: Path) -> None:
    """--dry-run install checks the bundle in place as the install would (signature, key, every hash, the config
    it was packed for) and exits with the same code, changing nothing; a good bundle plans."""
    from deploy_tool.box.install import VERIFY_ALSO
    from deploy_tool.box.install import install as run_install

    keys = Path(box.cfg.paths.keys_dir)
    assert run_install(box.cfg, str(bundles.a), dry_run=True).action == "planned"
    r = CliRunner().invoke(main, ["--config", str(box.cfg.source_path), "--dry-run", "install", str(bundles.a)])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[:3] == ["would:", f"  lock {box.state_dir / 'lock'}",
                         f"  verify {bundles.a} against keys in {keys}" + VERIFY_ALSO], lines[:3]
    assert lines[-2:] == ["  commit state",
                          "  on failure: undo every step in reverse, start the backend that served, exit 14"]
    tampered = tmp_path / bundles.a.name  # the archive with one byte of it changed
    data = bytearray(bundles.a.read_bytes())
    data[len(data) // 2] ^= 1
    tampered.write_bytes(bytes(data))
    with pytest.raises(DeployError) as exc:
        run_install(box.cfg, str(tampered), dry_run=True)
    assert exc.value.exit_code == ExitCode.BUNDLE, exc.value.message
    kid = manifest.public_key_id(key(bundles))
    try:
        (keys / "revoked").write_text(f"{kid}\n")
        with pytest.raises(DeployError) as exc:
            run_install(box.cfg, str(bundles.a), dry_run=True)
        assert exc.value.exit_code == ExitCode.KEY
    finally:
        (keys / "revoked").unlink(missing_ok=True)
    with pytest.raises(DeployError) as exc:
        run_install(bundles.cfg_b, str(bundles.a), dry_run=True)  # B's config, A's bundle
    assert exc.value.exit_code == ExitCode.BUNDLE and "packed for another config" in exc.value.message
    assert box.traces() == CLEAN


# ------------------------------------------------------------------------------------------------ StrictModes

def test_install_refuses_an_unsafe_keys_dir_before_it_writes_anything(box: Box, bundles: Bundles) -> None:
    """A world-writable keys directory (anyone could add a key and sign their own bundle): exit 23 naming it and
    `chmod go-w`; not even the state directory or the lock is created."""
    keys = Path(box.cfg.paths.keys_dir)
    os.chmod(keys, 0o777)
    try:
        out = install(box, bundles.a)
        assert out.error is not None and out.error.exit_code == ExitCode.UNSAFE_PATH == 23, out
        assert f"{keys} (keys dir): owner 0:0, mode 0777, writable by group and others; fix: chmod go-w {keys}" \
            in out.error.message
        assert box.traces() == CLEAN and not box.state_dir.exists() and not box.releases.exists()
    finally:
        os.chmod(keys, 0o755)


def test_verify_refuses_the_start_until_the_path_is_fixed(box: Box, bundles: Bundles) -> None:
    """An installed box whose env dir turns group-writable: `deploytool verify` (the units' ExecStartPre) exits 23
    with the error and hint lines naming the path, its owner, mode and fix, before comparing any pin; fixed, it
    passes."""
    assert install(box, bundles.a).what == "installed", box.log
    env = Path(box.cfg.paths.env_dir)
    os.chmod(env, 0o775)
    try:
        r = CliRunner().invoke(main, ["--config", str(box.cfg.source_path), "verify", F])
        assert r.exit_code == 23 and r.stdout == ""
        assert r.stderr.startswith(f"error: {F} may not start: {env} (env dir): owner 0:0, mode 0775, writable by "
                                   f"group; fix: chmod go-w {env}\nhint: chmod go-w {env};")
    finally:
        os.chmod(env, 0o755)
    assert CliRunner().invoke(main, ["--config", str(box.cfg.source_path), "verify", F]).exit_code == 0
