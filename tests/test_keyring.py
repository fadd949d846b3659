"""Key lifecycle (deploy_tool/keyring.py): key files with an optional not-after, the revocation list, and what a
signature check makes of them; the bootstrap's stdlib copy gives the same verdict on every key file and list.

Real Ed25519 keys and signatures throughout (cryptography for deploytool, the bootstrap's pure-Python verifier for
the bootstrap). The end-to-end rotation on the real sandbox, bootstrap included, is tests/test_trust_e2e.py's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy_tool import keyring
from deploy_tool import manifest as mf
from deploy_tool.box import bootstrap
from deploy_tool.cli import main
from deploy_tool.errors import BundleError, DeployError, ExitCode, KeyRefused
from tests.support.examples import examples

T0 = 1_800_000_000  # 2027-01-15T08:00:00Z


def _keys(d: Path, *names: str) -> dict[str, tuple[Path, str]]:
    """{name: (private key, key id)} with the public keys in d/trusted."""
    (d / "trusted").mkdir(parents=True, exist_ok=True)
    out = {}
    for n in names:
        kid = mf.generate_keypair(d / f"{n}.key", d / "trusted" / f"{n}.pub")
        out[n] = (d / f"{n}.key", kid)
    return out


def _signed(key: Path) -> tuple[bytes, bytes]:
    data = b'{"a manifest": 1}\n'
    return data, mf.sign(data, key)


def both(data: bytes, sig: bytes, keys_dir: Path, now: float) -> tuple[str, str | int]:
    """(deploytool's verdict, the bootstrap's): a key id, or the refusal's reason slug and exit code."""
    try:
        a: tuple[str, str | int] = ("ok", mf.verify_signature(data, sig, keys_dir, now=now))
    except DeployError as exc:
        a = (getattr(exc, "reason", "?"), int(exc.exit_code))
    try:
        b: tuple[str, str | int] = ("ok", bootstrap.check_signature(data, sig, str(keys_dir), now=now))
    except bootstrap.Refused as exc:
        b = (exc.message.split(":", 1)[0], exc.code)
    return a, b


def test_a_plain_key_file_never_expires(tmp_path: Path) -> None:
    """A key file as keygen wrote it before lifecycles existed: valid, no not-after, at any time."""
    k = _keys(tmp_path, "old")
    data, sig = _signed(k["old"][0])
    for now in (0, T0, 4e9):
        assert both(data, sig, tmp_path / "trusted", now) == (("ok", k["old"][1]),) * 2


def test_not_after_refuses_from_that_second_on(tmp_path: Path) -> None:
    """`not-after: T` (with comments around): trusted at T, refused after T, naming the key id and its file,
    exit 25, by deploytool and the bootstrap alike."""
    k = _keys(tmp_path, "k")
    pub = tmp_path / "trusted" / "k.pub"
    pub.write_text("# signing key of the lab, rotated yearly\n\nnot-after: 2027-01-15T08:00:00Z\n" + pub.read_text())
    data, sig = _signed(k["k"][0])
    kid = k["k"][1]
    assert both(data, sig, tmp_path / "trusted", T0) == (("ok", kid),) * 2
    assert both(data, sig, tmp_path / "trusted", T0 + 1) == (("key-expired", 25),) * 2
    with pytest.raises(KeyRefused) as ei:
        mf.verify_signature(data, sig, tmp_path / "trusted", now=T0 + 1)
    assert ei.value.exit_code == ExitCode.KEY
    assert kid in ei.value.message and str(pub) in ei.value.message and "2027-01-15T08:00:00Z" in ei.value.message
    assert str(pub) in (ei.value.hint or "")


def test_a_revoked_key_is_refused_with_or_without_its_key_file(tmp_path: Path) -> None:
    """KEYS/revoked lists the key id (with a reason): refused naming the id, the list and the line, exit 25; still
    refused when its .pub is gone, or copied back; the other key signs on."""
    k = _keys(tmp_path, "old", "new")
    kd = tmp_path / "trusted"
    old_id = k["old"][1]
    (kd / "revoked").write_text(f"# retired keys\n{old_id} laptop stolen 2026-11-02\n")
    data, sig = _signed(k["old"][0])
    assert both(data, sig, kd, T0) == (("key-revoked", 25),) * 2
    with pytest.raises(KeyRefused) as ei:
        mf.verify_signature(data, sig, kd)
    assert old_id in ei.value.message and "line 2" in ei.value.message and "laptop stolen" in ei.value.message
    pub = (kd / "old.pub").read_bytes()
    (kd / "old.pub").unlink()
    assert both(data, sig, kd, T0) == (("key-revoked", 25),) * 2
    (kd / "old.pub").write_bytes(pub)
    assert both(data, sig, kd, T0) == (("key-revoked", 25),) * 2
    d2, s2 = _signed(k["new"][0])
    assert both(d2, s2, kd, T0) == (("ok", k["new"][1]),) * 2


@pytest.mark.parametrize("text, reason", [
    ("not-after: 2027-13-01T00:00:00Z\n", "key-metadata-invalid"),
    ("not-after: 2027-01-01\n", "key-metadata-invalid"),
    ("not-after: 2027-01-01T00:00:00Z\nnot-after: 2028-01-01T00:00:00Z\n", "key-metadata-invalid"),
    ("expires: 2027-01-01T00:00:00Z\n", "key-metadata-invalid"),
    ("some text\n", "key-metadata-invalid"),
])
def test_bad_key_metadata_is_one_error_naming_file_and_line(tmp_path: Path, text: str, reason: str) -> None:
    """A header deploytool does not understand fails closed: exit 25 naming the file and the line, for every
    bundle (whoever signed it), by deploytool and the bootstrap alike."""
    k = _keys(tmp_path, "a", "b")
    pub = tmp_path / "trusted" / "b.pub"
    pub.write_text(text + pub.read_text())
    data, sig = _signed(k["a"][0])
    assert both(data, sig, tmp_path / "trusted", T0) == ((reason, 25),) * 2
    with pytest.raises(KeyRefused) as ei:
        keyring.load(tmp_path / "trusted")
    assert str(pub) in ei.value.message and "line " in ei.value.message and "\n" not in ei.value.message


@pytest.mark.parametrize("line", ["0123456789abcde", "0123456789ABCDEF", "g123456789abcdef x", "0123456789abcdef\tx",
                                  "revoke 0123456789abcdef"])
def test_a_bad_revocation_line_is_one_error_naming_it(tmp_path: Path, line: str) -> None:
    k = _keys(tmp_path, "a")
    (tmp_path / "trusted" / "revoked").write_text(f"# ok\n\n{line}\n")
    data, sig = _signed(k["a"][0])
    assert both(data, sig, tmp_path / "trusted", T0) == (("revocation-list-invalid", 25),) * 2
    with pytest.raises(KeyRefused) as ei:
        keyring.load(tmp_path / "trusted")
    assert "line 3" in ei.value.message and str(tmp_path / "trusted" / "revoked") in ei.value.message


# ------------------------------------------------------------------------------------------------ agreement

HEAD_LINES = st.sampled_from([
    "", "# comment", "   # indented comment", "not-after: 2027-01-15T08:00:00Z", "not-after:2027-01-15T08:00:01Z",
    "NOT-AFTER: 2027-01-15T07:59:59Z", "not-after: 2027-02-30T00:00:00Z", "not-after: soon", "x: y", "garbage",
    "not-after: 2027-01-15T08:00:00Z # comment", "\t", "not-after: 1970-01-01T00:00:00Z",
])


@st.composite
def key_files(draw: st.DrawFn, pem: str) -> str:
    head = draw(st.lists(HEAD_LINES, max_size=4))
    lines = pem.splitlines()
    body = draw(st.sampled_from(["same", "flip", "drop-line", "no-end", "pad", "trailing", "crlf", "rsa-prefix"]))
    if body == "flip":
        b = lines[1]
        lines[1] = b[:20] + ("A" if b[20] != "A" else "B") + b[21:]
    elif body == "drop-line":
        lines = [lines[0], lines[2]]
    elif body == "no-end":
        lines = lines[:2]
    elif body == "pad":
        lines[1] = lines[1] + "=="
    elif body == "trailing":
        lines.append("extra")
    elif body == "rsa-prefix":
        lines[1] = "MCowBQYDK2VuAyEA" + lines[1][16:]  # X25519's OID: a valid PEM, not an Ed25519 key
    text = "\n".join(head + lines) + "\n"
    return text.replace("\n", "\r\n") if body == "crlf" else text


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), now=st.sampled_from([0, T0 - 1, T0, T0 + 1, 2e9]))
def test_deploytool_and_the_bootstrap_agree_on_every_key_file_and_list(tmp_path_factory: pytest.TempPathFactory,
                                                                       data: st.DataObject, now: float) -> None:
    """Property: key files with any mix of header lines and damaged bodies, a revocation list of any lines, any
    clock: deploytool's keyring and the bootstrap's stdlib copy accept the same bundles and refuse the others with
    the same reason and exit code (the bootstrap runs the check before anything of the bundle exists on the box)."""
    d = tmp_path_factory.mktemp("agree")
    k = _keys(d, "signer")
    kd = d / "trusted"
    pem = (kd / "signer.pub").read_text()
    (kd / "signer.pub").write_text(data.draw(key_files(pem), label="key file"))
    rev = data.draw(st.lists(st.sampled_from([k["signer"][1], "0123456789abcdef some reason", "# c", "",
                                              "not-a-key-id", k["signer"][1] + " # trailing comment"]),
                             max_size=3), label="revoked")
    if rev:
        (kd / "revoked").write_text("\n".join(rev) + "\n")
    msg, sig = _signed(k["signer"][0])
    a, b = both(msg, sig, kd, now)
    assert a == b


def test_keygen_writes_the_not_after_and_refuses_a_bad_one(tmp_path: Path) -> None:
    """`keygen --not-after T`: the .pub carries it and loads with it; a bad T is one error (exit 5), no files."""
    r = CliRunner().invoke(main, ["--json", "keygen", "--out", str(tmp_path / "k"), "--not-after",
                                  "2099-01-15T08:00:00Z"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    ring = keyring.load(tmp_path / "k")
    assert ring.keys[out["key_id"]].not_after == "2099-01-15T08:00:00Z"
    assert ring.keys[out["key_id"]].not_after_epoch == keyring.parse_not_after("2099-01-15T08:00:00Z")
    for bad, says in (("next year", "YYYY-MM-DDTHH:MM:SSZ"), ("2001-01-01T00:00:00Z", "is in the past")):
        r = CliRunner().invoke(main, ["keygen", "--out", str(tmp_path / "bad"), "--not-after", bad])
        assert r.exit_code == 5 and says in r.output, r.output
        assert not (tmp_path / "bad").exists() or not os.listdir(tmp_path / "bad")


def test_no_keys_and_junk_keep_their_old_reasons(tmp_path: Path) -> None:
    """What was a bundle error stays one (exit 6): no keys directory, no keys, a file that is not a key."""
    k = _keys(tmp_path, "a")
    data, sig = _signed(k["a"][0])
    assert both(data, sig, tmp_path / "none", T0) == (("no-trusted-keys", 6),) * 2
    (tmp_path / "trusted" / "a.pub").write_text("not a key\n")
    assert both(data, sig, tmp_path / "trusted", T0) == (("trusted-key-invalid", 6),) * 2
    with pytest.raises(BundleError):
        keyring.load(tmp_path / "trusted")


def test_an_unknown_signer_is_told_the_keys_still_usable(tmp_path: Path) -> None:
    """Signed by a key the box does not trust: the message lists the trusted keys that may still sign (not the
    revoked one), so the fix is not sought among retired keys."""
    k = _keys(tmp_path, "good", "old")
    (tmp_path / "trusted" / "revoked").write_text(f"{k['old'][1]} rotated out\n")
    stranger = _keys(tmp_path / "elsewhere", "stranger")
    data, sig = _signed(stranger["stranger"][0])
    with pytest.raises(DeployError) as ei:
        mf.verify_signature(data, sig, tmp_path / "trusted", now=T0)
    assert k["good"][1] in ei.value.message and k["old"][1] not in ei.value.message, ei.value.message
