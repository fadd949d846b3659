"""The whole release is pinned: tamper and drift suites over the space of what can change in it.

On an installed release built from real parts (tests/support/release_tree.py: a real venv with the real ftllm
0.1.8.2 files and libraries, plus here the real markupsafe distribution with its compiled extension, as a
dependency with a native library), every change hypothesis can draw is refused by verify with exit 7 (DriftError)
and the changed entry named with expected and actual values: any file of the release, any byte offset, any mode
bit, a new file in any directory, a symlink retargeted, a file replaced by a symlink or a directory. Each example
is undone afterwards and verify passes again, so the examples run on one pinned tree. Then the specific cases of
issue 13 through the real CLI entry the units' ExecStartPre runs: a .pth, sitecustomize.py, a planted .pyc, a
same-size byte flip in a dependency's native library, a chmod of the server binary.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy_tool.box import fingerprint as fp
from tests.support import release_tree as rt
from tests.support.examples import examples

REPO = Path(__file__).resolve().parents[1]
FT = "ftllm-dflash"
LL = "llamacpp-tensor"
EXAMPLES = settings(max_examples=examples(25), deadline=None, derandomize=False,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
NAMES = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,24}", fullmatch=True).filter(lambda n: n not in (".", ".."))
HOOK_NAMES = st.sampled_from(["evil.pth", "sitecustomize.py", "usercustomize.py", "sitecustomize.cpython-311.pyc",
                              "zz.cpython-311.pyc", "x.so"])


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return rt.build_template(tmp_path_factory.mktemp("pin-template") / "tpl")


@pytest.fixture(scope="module")
def pinned(template: Path, tmp_path_factory: pytest.TempPathFactory) -> rt.Tree:
    """One tree for a module's examples: own copies of every file (no hard links into the template), the real
    markupsafe distribution added to its venv, pinned."""
    tree = rt.instantiate(template, tmp_path_factory.mktemp("pinned") / "tree")
    src = Path(sysconfig.get_paths()["purelib"])
    for name in ("markupsafe", *(p.name for p in src.glob("markupsafe-*.dist-info"))):
        shutil.copytree(src / name, tree.site_packages / name, ignore=shutil.ignore_patterns("__pycache__"))
    for d, _dirs, files in os.walk(tree.release):
        for f in files:
            p = Path(d, f)
            if not p.is_symlink() and p.stat().st_nlink > 1:  # break hard links: examples edit files in place
                tmp = p.with_name(p.name + ".copy")
                shutil.copy2(p, tmp)
                os.replace(tmp, p)
    fp.pin(tree.cfg, FT, "install")
    fp.pin(tree.cfg, LL, "install")
    time.sleep(fp.CACHE_RACY_MARGIN_S)
    assert fp.verify(tree.cfg, FT).ok  # fills the cache: the examples run the cached path, as the units do
    return tree


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def rid(tree: rt.Tree, p: Path) -> str:
    return "release/" + p.relative_to(tree.release).as_posix()


def entries(tree: rt.Tree, want: Callable[[Path], bool]) -> list[Path]:
    out = []
    for d, dirs, files in os.walk(tree.release):
        out += [Path(d, n) for n in sorted(dirs) + sorted(files) if want(Path(d, n))]
    return sorted(out)


def refused(tree: rt.Tree, use_cache: bool, *expect: str) -> fp.VerifyReport:
    """verify fails naming (at least) the `expect` ids, each with different expected and actual values, and again
    when verified a second time."""
    r = fp.verify(tree.cfg, FT, use_cache=use_cache)
    assert not r.ok
    got = {d.item.id: d for d in r.rows}
    for e in expect:
        assert e in got, (e, list(got)[:10])
        assert got[e].expected != got[e].actual
    again = fp.verify(tree.cfg, FT, use_cache=use_cache)
    assert not again.ok and fp.drift_error(again).exit_code == 7
    return r


def passes(tree: rt.Tree) -> None:
    r = fp.verify(tree.cfg, FT)
    assert r.ok, fp.format_report(r)


def is_file(p: Path) -> bool:
    return p.is_file() and not p.is_symlink()


# ------------------------------------------------------------------------------------------- property suites


@EXAMPLES
@given(data=st.data(), use_cache=st.booleans())
def test_any_byte_of_any_file_flipped_is_refused(pinned: rt.Tree, data: st.DataObject, use_cache: bool) -> None:
    files = entries(pinned, lambda p: is_file(p) and p.stat().st_size > 0)
    p = data.draw(st.sampled_from(files), label="file")
    size = p.stat().st_size
    off = data.draw(st.integers(0, size - 1), label="offset")
    x = data.draw(st.integers(1, 255), label="xor")
    with open(p, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ x]))
    try:
        r = refused(pinned, use_cache, rid(pinned, p))
        row = next(d for d in r.rows if d.item.id == rid(pinned, p))
        assert row.actual.endswith(sha(p)) and row.expected.split()[:2] == row.actual.split()[:2]  # same type, mode
    finally:
        with open(p, "r+b") as f:
            f.seek(off)
            f.write(b)
    passes(pinned)


@EXAMPLES
@given(data=st.data(), use_cache=st.booleans())
def test_any_mode_bit_of_any_entry_is_refused(pinned: rt.Tree, data: st.DataObject, use_cache: bool) -> None:
    paths = entries(pinned, lambda p: not p.is_symlink())
    p = data.draw(st.sampled_from([pinned.release, *paths]), label="entry")
    bit = data.draw(st.sampled_from([1 << i for i in range(12)]), label="bit")
    old = stat.S_IMODE(p.stat().st_mode)
    os.chmod(p, old ^ bit)
    try:
        r = refused(pinned, use_cache, "release/." if p == pinned.release else rid(pinned, p))
        assert f"{old ^ bit:04o}" in next(d.actual for d in r.rows if d.item.path == str(p))
    finally:
        os.chmod(p, old)
    passes(pinned)


@EXAMPLES
@given(data=st.data(), uid=st.sampled_from([0, 1, 1000, 65534]), gid=st.sampled_from([0, 5, 1000]),
       use_cache=st.booleans())
def test_any_owner_of_any_entry_is_refused(pinned: rt.Tree, data: st.DataObject, uid: int, gid: int,
                                           use_cache: bool) -> None:
    """uid and gid are pinned like modes: any entry (file, directory, symlink) given another owner is drift naming
    it, expected without an owner (root's 0:0 is not written), actual with `uid:gid` after the mode."""
    if (uid, gid) == (0, 0):
        gid = 5
    paths = entries(pinned, lambda p: True)
    p = data.draw(st.sampled_from([pinned.release, *paths]), label="entry")
    st0 = os.lstat(p)
    assert (st0.st_uid, st0.st_gid) == (0, 0)
    os.lchown(p, uid, gid)
    try:
        r = refused(pinned, use_cache, "release/." if p == pinned.release else rid(pinned, p))
        row = next(d for d in r.rows if d.item.path == str(p))
        assert f" {uid}:{gid}" in row.actual and f"{uid}:{gid}" not in row.expected
        assert row.actual.replace(f" {uid}:{gid}", "", 1) == row.expected  # only the owner differs
    finally:
        os.lchown(p, 0, 0)
        if not p.is_symlink():
            os.chmod(p, stat.S_IMODE(st0.st_mode))  # chown clears setuid/setgid bits
    passes(pinned)


def test_pin_refuses_an_entry_that_is_not_roots_alone(pinned: rt.Tree) -> None:
    """`pin` of a release with a group-writable file: exit 23 naming it and `chmod go-w`, the pins untouched (what
    is pinned is what verify holds the tree to)."""
    from deploy_tool.errors import UnsafePathError

    p = pinned.release / "MANIFEST"
    before = fp.pins_path(pinned.cfg, FT).read_bytes()
    os.chmod(p, 0o664)
    try:
        with pytest.raises(UnsafePathError) as ei:
            fp.pin(pinned.cfg, FT, "a deliberate change")
        assert ei.value.exit_code == 23 and str(p) in ei.value.message and f"chmod go-w {p}" in ei.value.message
        assert fp.pins_path(pinned.cfg, FT).read_bytes() == before
    finally:
        os.chmod(p, 0o644)
    passes(pinned)


@EXAMPLES
@given(data=st.data(), name=st.one_of(NAMES, HOOK_NAMES), kind=st.sampled_from(["file", "dir", "link"]),
       use_cache=st.booleans())
def test_a_new_entry_in_any_directory_is_refused(pinned: rt.Tree, data: st.DataObject, name: str, kind: str,
                                                 use_cache: bool) -> None:
    dirs = [pinned.release, *entries(pinned, lambda p: p.is_dir() and not p.is_symlink())]
    d = data.draw(st.sampled_from(dirs), label="directory")
    new = d / name
    if os.path.lexists(new):
        return
    if kind == "file":
        new.write_bytes(b"import os\n")
    elif kind == "dir":
        new.mkdir()
    else:
        os.symlink("/etc/passwd", new)
    try:
        r = refused(pinned, use_cache, rid(pinned, new))
        row = next(x for x in r.rows if x.item.id == rid(pinned, new))
        assert row.expected == fp.ABSENT and row.actual.split()[0] == kind
    finally:
        if kind == "dir":
            new.rmdir()
        else:
            new.unlink()
    passes(pinned)


@EXAMPLES
@given(data=st.data(), target=st.text(st.characters(codec="utf-8", exclude_characters="\0"), min_size=1,
                                      max_size=40), use_cache=st.booleans())
def test_a_retargeted_symlink_is_refused(pinned: rt.Tree, data: st.DataObject, target: str, use_cache: bool) -> None:
    links = entries(pinned, lambda p: p.is_symlink())
    assert links  # venv/bin/python, lib64, ...
    p = data.draw(st.sampled_from(links), label="link")
    old = os.readlink(p)
    if target == old:
        return
    os.unlink(p)
    os.symlink(target, p)
    try:
        r = refused(pinned, use_cache, rid(pinned, p))
        assert next(d for d in r.rows if d.item.id == rid(pinned, p)).actual == f"link -> {target}"
    finally:
        os.unlink(p)
        os.symlink(old, p)
    passes(pinned)


@EXAMPLES
@given(data=st.data(), how=st.sampled_from(["symlink", "dir"]), use_cache=st.booleans())
def test_a_file_replaced_by_a_symlink_or_a_directory_is_refused(pinned: rt.Tree, data: st.DataObject, how: str,
                                                                use_cache: bool) -> None:
    """Even a symlink to a copy with the very same bytes is refused: the release pins what is there, a link."""
    p = data.draw(st.sampled_from(entries(pinned, is_file)), label="file")
    aside = pinned.root / "aside"
    shutil.copy2(p, aside)
    mode = stat.S_IMODE(p.stat().st_mode)
    p.unlink()
    if how == "symlink":
        os.symlink(aside, p)
    else:
        p.mkdir()
    try:
        r = refused(pinned, use_cache, rid(pinned, p))
        assert next(d for d in r.rows if d.item.id == rid(pinned, p)).actual.split()[0] == (
            "link" if how == "symlink" else "dir")
    finally:
        if how == "symlink":
            p.unlink()
        else:
            p.rmdir()
        shutil.copy2(aside, p)
        os.chmod(p, mode)
        aside.unlink()
    passes(pinned)


# ------------------------------------------------------------------------------------------- the specific cases


def fast_verify(tree: rt.Tree, *extra: str) -> subprocess.CompletedProcess[str]:
    """`deploytool verify` through the console entry, as systemd runs the units' ExecStartPre."""
    return subprocess.run([sys.executable, "-m", "deploy_tool", "--config",
                           str(tree.config_path), "verify", FT, *extra], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def _pyc_name(stem: str) -> str:
    return f"{stem}.cpython-{sys.version_info.major}{sys.version_info.minor}.pyc"


CASES: dict[str, Callable[[rt.Tree], Path]] = {
    "pth": lambda t: t.site_packages / "zz-hook.pth",
    "sitecustomize": lambda t: t.site_packages / "sitecustomize.py",
    "usercustomize": lambda t: t.site_packages / "usercustomize.py",
    "planted-pyc": lambda t: t.site_packages / "markupsafe" / "__pycache__" / _pyc_name("__init__"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_import_hook_or_planted_pyc_is_refused_by_the_cli_exit_7(pinned: rt.Tree, case: str) -> None:
    """A new .pth, sitecustomize/usercustomize module or a .pyc that is not the release's own: exit 7, named."""
    p = CASES[case](pinned)
    assert not os.path.lexists(p)
    made = [d for d in reversed(p.parents) if not d.exists()]
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"import os; os.system('id')\n")
    try:
        r = fast_verify(pinned)
        assert r.returncode == 7, r.stdout + r.stderr
        first = made[0] if made else p
        line = next(ln for ln in r.stdout.splitlines() if rid(pinned, first) in ln)
        assert "absent" in line and ("file 0644" in line or "dir " in line)
        assert rid(pinned, first) in r.stderr  # the error line names it too
    finally:
        p.unlink()
        for d in reversed(made):
            d.rmdir()
    assert fast_verify(pinned).returncode == 0


def test_same_size_byte_flip_in_a_dependency_native_library_is_refused(pinned: rt.Tree) -> None:
    """markupsafe's compiled extension, one byte changed in place, size and mtime kept: exit 7, named."""
    so = next((pinned.site_packages / "markupsafe").glob("_speedups*.so"))
    st0 = so.stat()
    data = so.read_bytes()
    with open(so, "r+b") as f:
        f.seek(len(data) // 2)
        f.write(bytes([data[len(data) // 2] ^ 0x01]))
    os.utime(so, ns=(st0.st_atime_ns, st0.st_mtime_ns))
    try:
        assert so.stat().st_size == st0.st_size and so.stat().st_mtime_ns == st0.st_mtime_ns
        for extra in ((), ("--no-cache",)):
            r = fast_verify(pinned, *extra)
            assert r.returncode == 7, r.stdout + r.stderr
            line = next(ln for ln in r.stdout.splitlines() if rid(pinned, so) in ln)
            assert hashlib.sha256(data).hexdigest()[:12] in line and sha(so)[:12] in line
    finally:
        so.write_bytes(data)
        os.chmod(so, stat.S_IMODE(st0.st_mode))
    assert fast_verify(pinned).returncode == 0


def test_chmod_on_a_server_binary_is_refused(pinned: rt.Tree) -> None:
    """ftllm's console script in the release and llama-server outside it: a mode change alone is exit 7."""
    script = pinned.release / "venv" / "bin" / "ftllm"
    assert script.is_file()
    old = stat.S_IMODE(script.stat().st_mode)
    os.chmod(script, old | stat.S_ISUID)
    try:
        r = fast_verify(pinned)
        assert r.returncode == 7 and rid(pinned, script) in r.stdout
        assert f"file {old:04o}" in r.stdout and f"file {old | stat.S_ISUID:04o}" in r.stdout
    finally:
        os.chmod(script, old)
    assert fast_verify(pinned).returncode == 0
    binary = pinned.root / "llama" / "bin" / "llama-server"
    old = stat.S_IMODE(binary.stat().st_mode)
    os.chmod(binary, 0o777)
    try:
        r = fp.verify(pinned.cfg, LL)
        assert [(d.item.id, d.expected, d.actual) for d in r.rows] == [("binary.mode", f"{old:04o}", "0777")]
    finally:
        os.chmod(binary, old)
    assert fp.verify(pinned.cfg, LL).ok


def test_a_release_swapped_under_current_is_refused(pinned: rt.Tree) -> None:
    """`current` pointed at another directory with the very same content: the release item names the switch."""
    other = pinned.release.with_name("r2")
    shutil.copytree(pinned.release, other, symlinks=True)
    cur = Path(pinned.cfg.paths.current)
    os.replace(cur, cur.with_name("current.bak"))
    os.symlink("releases/r2", cur)
    try:
        r = fp.verify(pinned.cfg, FT)
        assert [d.item.id for d in r.rows] == ["release"]
    finally:
        cur.unlink()
        os.replace(cur.with_name("current.bak"), cur)
        shutil.rmtree(other)
    passes(pinned)


def test_a_hostile_file_name_is_refused_on_one_line_without_a_traceback(pinned: rt.Tree) -> None:
    """A planted .pth whose name is not UTF-8 and holds a newline and an escape sequence: exit 7, the report
    keeps one line per drift (the name escaped), no traceback; JSON names it too."""
    sp = os.fsencode(pinned.site_packages)
    bad = sp + b"/\xff\n\x1b[2Jevil.pth"
    with open(bad, "wb") as f:
        f.write(b"import os\n")
    try:
        r = fast_verify(pinned)
        assert r.returncode == 7, r.stdout + r.stderr
        assert "Traceback" not in r.stderr and "internal error" not in r.stderr
        lines = r.stdout.splitlines()
        assert len(lines) == 3 and "\\udcff\\n\\x1b[2Jevil.pth" in lines[2] and "absent" in lines[2]
        assert "\x1b" not in r.stdout + r.stderr
        js = subprocess.run([sys.executable, "-m", "deploy_tool", "--config", str(pinned.config_path), "verify", FT,
                             "--json"], capture_output=True, text=True, timeout=120, cwd=REPO)
        assert js.returncode == 7 and "evil.pth" in js.stdout and "Traceback" not in js.stderr
    finally:
        os.unlink(bad)
    assert fast_verify(pinned).returncode == 0


def test_pins_without_the_tree_and_a_tree_gone_are_one_row_each(pinned: rt.Tree) -> None:
    """Pins written before the release was pinned entry by entry (no "trees"): one row says the tree is not
    pinned (exit 7, re-pin), not ten thousand; `current` gone: the release item and one row for its tree."""
    import json

    pp = fp.pins_path(pinned.cfg, FT)
    saved = pp.read_bytes()
    doc = json.loads(saved)
    n = len(doc.pop("trees")["release"]["entries"])
    pp.write_text(json.dumps(doc))
    try:
        r = fp.verify(pinned.cfg, FT)
        assert [(d.item.id, d.expected, d.actual) for d in r.rows] == [("release/.", "not pinned", f"{n} entries")]
    finally:
        pp.write_bytes(saved)
    cur = Path(pinned.cfg.paths.current)
    os.replace(cur, cur.with_name("current.bak"))
    try:
        r = fp.verify(pinned.cfg, FT)
        rows = {d.item.id: (d.expected, d.actual) for d in r.rows}
        assert rows["release"][1] == fp.MISSING and rows["release/."] == (f"{n} entries", fp.MISSING)
        assert len([i for i in rows if i.startswith("release/")]) == 1
    finally:
        os.replace(cur.with_name("current.bak"), cur)
    passes(pinned)
