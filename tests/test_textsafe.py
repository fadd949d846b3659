"""Names from outside reach the terminal quoted, with every control character escaped (textsafe.q), in text and in
--json: a property test of q() itself, and real tampered bundles whose file names carry escape sequences,
verified through the real CLI (`deploytool bundle verify`, a subprocess with real Ed25519 keys)."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import unicodedata
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy_tool.textsafe import describe, key, q, unsafe_char
from tests.support.bundles import make_keys, member, mutate_archive, write_sample_bundle
from tests.support.examples import examples

REPO = Path(__file__).resolve().parents[1]
TOOL = str(REPO / ".venv" / "bin" / "deploytool")
EVIL = "x\x1b]0;pwned\x07\x1b[2J\rEVIL\x9b31m\u202egnp.exe\x7f\u2028"
NASTY = st.sampled_from(list("\x1b\r\n\t\x07\x08\x00\x7f\x85\x9b\u2028\u2029\u202e\u2066\\'\"") + ["\x1b[2J", "\x1b]0;t\x07"])
ANY_TEXT = st.lists(st.one_of(NASTY, st.characters(blacklist_categories=())), max_size=30).map("".join)


def _terminal_safe(out: str) -> bool:
    """Nothing that acts on a terminal: no C0 but LF, no DEL, no C1, no line/paragraph separator, no bidi override."""
    return all(c == "\n" or (unsafe_char(c) is None and unicodedata.category(c) not in ("Cf", "Cc")) for c in out)


@settings(max_examples=examples(500), deadline=1000)
@given(name=ANY_TEXT)
def test_q_escapes_every_control_character_and_reads_back(name: str) -> None:
    """q(name) is printable (no ESC, CR, C1, bidi, ...), quoted, and reads back to exactly the name."""
    out = q(name)
    assert out.isprintable() and _terminal_safe(out)
    assert out[0] in "'\"" and out[-1] == out[0]
    assert ast.literal_eval(out) == name
    k = key(name)
    assert k.isprintable() and k in (name, out)


@settings(max_examples=examples(200), deadline=1000)
@given(raw=st.binary(max_size=30))
def test_q_of_file_name_bytes(raw: bytes) -> None:
    """A file name as the file system gives it (bytes, undecodable ones too) is printable after q()."""
    out = q(raw)
    assert out.isprintable()
    import os

    assert os.fsencode(ast.literal_eval(out)) == raw


def test_describe_names_the_character() -> None:
    assert describe("\n") == "U+000A (LINE FEED)" and describe("\x1b") == "U+001B (ESCAPE)"
    assert describe("\u2028") == "U+2028 (LINE SEPARATOR)" and describe("\x7f") == "U+007F (DELETE)"


# ------------------------------------------------------------------------------------ tampered bundles, real CLI


@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    base = tmp_path_factory.mktemp("evil-bundles")
    keys = make_keys(base / "keys")
    info = write_sample_bundle(base, keys, out="out")
    return {"base": base, "keys": keys, "info": info}


def _verify(path: Path, keys_dir: Path, *json_flag: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([TOOL, "bundle", "verify", str(path), "--keys", str(keys_dir), *json_flag],
                          capture_output=True, text=True, timeout=60, errors="surrogateescape")


def _check(r: subprocess.CompletedProcess[str], name: str) -> None:
    assert r.returncode == 6, (r.returncode, r.stdout, r.stderr)
    out = r.stdout + r.stderr
    assert _terminal_safe(out), repr(out)
    assert q(name) in out or q(name) in json.loads(r.stdout or "{}").get("message", ""), out


def test_bundle_dir_with_an_escape_sequence_in_a_file_name(signed: dict, tmp_path: Path) -> None:
    """A bundle directory with an extra file named with ESC, BEL, CR, CSI, bidi and DEL: `bundle verify`
    exits 6 naming the file quoted and escaped, in text and in --json (whose parsed message is printable too)."""
    d = tmp_path / "bundle"
    shutil.copytree(signed["info"].directory, d, symlinks=True)  # type: ignore[attr-defined]
    (d / EVIL).write_bytes(b"payload")
    r = _verify(d, signed["keys"].trusted_dir)  # type: ignore[attr-defined]
    _check(r, EVIL)
    rj = _verify(d, signed["keys"].trusted_dir, "--json")  # type: ignore[attr-defined]
    _check(rj, EVIL)
    assert json.loads(rj.stdout)["message"].isprintable()


def test_bundle_archive_with_an_escape_sequence_in_a_member_name(signed: dict, tmp_path: Path) -> None:
    """The same through an archive: a tar member whose name carries the escape sequences."""
    p = tmp_path / "evil.tar.zst"
    mutate_archive(signed["info"].archive, p, lambda ms: ms + [member(f"{EVIL}", data=b"x")])  # type: ignore[attr-defined]
    for flags in ((), ("--json",)):
        r = _verify(p, signed["keys"].trusted_dir, *flags)  # type: ignore[attr-defined]
        assert r.returncode == 6, (r.stdout, r.stderr)
        assert _terminal_safe(r.stdout + r.stderr), repr(r.stdout + r.stderr)


FILE_NAME = st.lists(st.one_of(NASTY, st.characters(blacklist_categories=("Cs",))), min_size=1, max_size=20).map(
    "".join).filter(lambda s: "/" not in s and "\x00" not in s and s not in (".", "..")
                    and len(s.encode()) < 200)


@settings(max_examples=examples(12), deadline=30000,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(name=FILE_NAME)
def test_any_extra_file_name_never_reaches_the_terminal_raw(signed: dict, tmp_path: Path, name: str) -> None:
    """Property, through the CLI: whatever the extra file is called, the output holds no control character and
    names it by q()."""
    d = tmp_path / "b"
    if d.exists():
        shutil.rmtree(d)
    shutil.copytree(signed["info"].directory, d, symlinks=True)  # type: ignore[attr-defined]
    if name in {p.name for p in d.iterdir()}:
        return
    (d / name).write_bytes(b"z")
    r = _verify(d, signed["keys"].trusted_dir)  # type: ignore[attr-defined]
    _check(r, name)
