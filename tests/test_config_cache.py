"""The config parse cache (`.NAME.cache.json` beside the config, used by verify): it replaces only the YAML
parse of the same bytes, is used when valid, and ignored (and rewritten) whenever it is not.

A cache is proven "used" by tampering with its recorded document while keeping everything it checks (stat
key, text, parser, owner, mode) valid: the tampered value then comes out of load(). It is proven "ignored"
by the same tampered value not coming out.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from deploy_tool import config
from deploy_tool.errors import ConfigError, DeployError
from tests.test_config import BAD, MIN

REPO = Path(__file__).resolve().parents[1]


def load(p: Path, **kw: Any) -> config.Config:
    return config.load(p, parse_cache=True, **kw)


def cache_of(p: Path) -> Path:
    return config.parse_cache_path(p.resolve())


def tamper(p: Path, model: str = "/tampered") -> None:
    """Rewrite the cache's document (backend a's model) keeping its key, text, parser, owner and mode valid."""
    c = cache_of(p)
    d = json.loads(c.read_bytes())
    d["document"]["backends"]["a"]["model"] = model
    mode = stat.S_IMODE(c.stat().st_mode)
    c.write_text(json.dumps(d))
    c.chmod(mode)


def model(cfg: config.Config) -> str:
    return cfg.backends["a"].model


@pytest.fixture
def cfgp(tmp_path: Path) -> Path:
    p = tmp_path / "deploytool.yaml"
    p.write_text(MIN)
    return p


def test_written_on_first_load_and_used_on_the_next(cfgp: Path) -> None:
    """The first load parses and writes the cache (0644 like the config); the next one takes the document from it."""
    first = load(cfgp)
    c = cache_of(cfgp)
    assert c.name == ".deploytool.yaml.cache.json" and c.parent == cfgp.parent
    assert stat.S_IMODE(c.stat().st_mode) == 0o644
    d = json.loads(c.read_bytes())
    assert d["text"] == MIN and d["document"] == {"version": 1, "default_backend": "a",
                                                  "backends": {"a": {"kind": "ftllm", "model": "/m"}}}
    assert load(cfgp) == first  # same Config, source_sha256 and source_path included
    tamper(cfgp)
    assert model(load(cfgp)) == "/tampered"  # used
    assert model(config.load(cfgp)) == "/m"  # plain load (every other command) never reads it
    assert model(load(cfgp, refresh=True)) == "/m"  # verify --no-cache parses afresh ...
    assert model(load(cfgp)) == "/m"  # ... and rewrites the cache


def test_cached_load_needs_no_yaml_and_no_hashlib(cfgp: Path) -> None:
    """A cached load imports neither yaml nor hashlib (their start-up time is what the cache saves)."""
    load(cfgp)
    code = ("import sys\nfrom deploy_tool import config\n"
            f"cfg = config.load({str(cfgp)!r}, parse_cache=True)\n"
            "print(cfg.backends['a'].model, 'yaml' in sys.modules, 'hashlib' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.stdout.split() == ["/m", "False", "False"], r.stderr


@pytest.mark.parametrize("example", config.EXAMPLES)
def test_cached_config_is_identical_with_relative_paths_and_placeholders(example: str, tmp_path: Path) -> None:
    """The examples (relative paths, {current}/{venv} placeholders): the cached load equals the plain one, also
    when the config is reached through a symlink from another directory."""
    real = tmp_path / "etc" / "deploytool.yaml"
    real.parent.mkdir()
    real.write_text(config.example_text(example))
    link = tmp_path / "link.yaml"
    link.symlink_to(real)
    plain = config.load(real)
    assert load(real) == plain and cache_of(real).is_file()
    assert load(real) == plain
    assert load(link) == plain  # the cache lives beside the real file; relative paths from its directory
    assert not (tmp_path / ".link.yaml.cache.json").exists()


def test_same_size_edit_with_old_mtime_misses_and_rewrites(cfgp: Path) -> None:
    """An edit of the same size given back its old mtime still misses (ctime and the text differ); the cache is
    rewritten for the new bytes."""
    load(cfgp)
    tamper(cfgp)
    before = cfgp.stat()
    time.sleep(0.01)
    cfgp.write_text(MIN.replace("/m", "/n"))
    os.utime(cfgp, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = cfgp.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert model(load(cfgp)) == "/n"
    d = json.loads(cache_of(cfgp).read_bytes())
    assert d["key"] == [after.st_dev, after.st_ino, after.st_size, after.st_mtime_ns, after.st_ctime_ns]
    assert d["text"] == MIN.replace("/m", "/n")
    tamper(cfgp)
    assert model(load(cfgp)) == "/tampered"  # the rewritten cache is used in turn


def test_text_must_match_even_when_the_stat_key_does(cfgp: Path) -> None:
    """A cache whose stat key matches but whose recorded text is not the file's bytes is ignored (the content check
    covers an edit in the same timestamp tick as the parse)."""
    load(cfgp)
    c = cache_of(cfgp)
    d = json.loads(c.read_bytes())
    d["text"] = MIN.replace("/m", "/x")
    d["document"]["backends"]["a"]["model"] = "/x"
    c.write_text(json.dumps(d))
    assert model(load(cfgp)) == "/m"


@pytest.mark.parametrize("change", ["group-writable", "world-writable", "other-owner", "symlink", "fifo",
                                    "parser", "format", "config-path"])
def test_untrusted_or_foreign_cache_is_ignored(change: str, cfgp: Path, tmp_path: Path) -> None:
    """Group/world-writable, owned by someone else, a symlink, not a regular file, another parser, format or
    config: ignored (the YAML is parsed; the config loads as it is)."""
    load(cfgp)
    tamper(cfgp)
    c = cache_of(cfgp)
    if change == "group-writable":
        c.chmod(0o664)
    elif change == "world-writable":
        c.chmod(0o646)
    elif change == "other-owner":
        if os.geteuid() != 0:
            pytest.skip("needs root to give the cache file to another user")
        os.chown(c, 12345, 12345)
    elif change == "symlink":
        target = tmp_path / "elsewhere.json"
        shutil.move(c, target)
        c.symlink_to(target)
    elif change == "fifo":
        c.unlink()
        os.mkfifo(c, 0o644)
    else:
        d = json.loads(c.read_bytes())
        if change == "parser":
            d["parser"]["key"][1] += 1  # another yaml/__init__.py (an upgrade)
        elif change == "format":
            d["format"] = 99
        else:
            d["config"] = str(tmp_path / "other.yaml")
        c.write_text(json.dumps(d))
    assert model(load(cfgp)) == "/m"


@pytest.mark.parametrize("garbage", [b"", b"{", b"\xff\xfe", b"[]", b'{"format": 1}', b"null",
                                     b'{"format": 1, "key": 5, "text": 7}'])
def test_corrupt_cache_is_ignored_and_replaced(garbage: bytes, cfgp: Path) -> None:
    """An empty, truncated, non-UTF-8, wrong-shape or wrong-typed cache file is ignored and replaced."""
    first = load(cfgp)
    cache_of(cfgp).write_bytes(garbage)
    assert load(cfgp) == first
    assert json.loads(cache_of(cfgp).read_bytes())["text"] == MIN


def test_unwritable_directory_just_means_no_cache(cfgp: Path) -> None:
    """A directory the cache cannot be written to (immutable for root, read-only otherwise): the config loads the
    same every time, with no cache and no leftover temp file."""
    d = cfgp.parent
    if os.geteuid() == 0:
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(d)]).returncode != 0:
            pytest.skip("cannot make a directory unwritable for root here (chattr +i)")
    else:
        d.chmod(0o555)
    try:
        plain = config.load(cfgp)
        assert load(cfgp) == plain and load(cfgp) == plain
        assert sorted(p.name for p in d.iterdir()) == ["deploytool.yaml"]
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(d)], check=True)
        else:
            d.chmod(0o755)


def test_private_config_gives_a_private_cache(cfgp: Path) -> None:
    """The cache is no more readable than the config (it holds its text): 0600 config, 0600 cache."""
    cfgp.chmod(0o600)
    load(cfgp)
    assert stat.S_IMODE(cache_of(cfgp).stat().st_mode) == 0o600


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_errors_unchanged_and_never_cached(case: tuple[str, str, str, str | None, int], cfgp: Path) -> None:
    """Every bad config gives the same error with the parse cache as without, writes no cache, and a valid cache
    of the previous good text does not hide the error."""
    _name, text, line, hint, code = case
    cfgp.write_text(text)
    with pytest.raises(DeployError) as plain:
        config.load(cfgp)
    with pytest.raises(DeployError) as cached:
        load(cfgp)
    assert (type(cached.value), cached.value.message, cached.value.hint) == \
        (type(plain.value), plain.value.message, plain.value.hint)
    assert cached.value.message == line.replace("{p}", str(cfgp)) and cached.value.hint == hint
    assert int(cached.value.exit_code) == code
    assert not cache_of(cfgp).exists()  # a parse error, a non-mapping or an invalid document is never stored
    cfgp.write_text(MIN)
    load(cfgp)
    cfgp.write_text(text)
    with pytest.raises(DeployError) as again:
        load(cfgp)
    assert (again.value.message, again.value.hint) == (plain.value.message, plain.value.hint)


@pytest.mark.parametrize("extra", ["    description: .inf\n", "    description: !!binary aGk=\n",
                                   "    description: 2024-01-02\n", "    description: 0.0\n"])
def test_documents_json_cannot_carry_exactly_are_not_cached(extra: str, cfgp: Path) -> None:
    """Values JSON would change (infinity, bytes, dates) are never cached: the load then always parses (or fails
    the same way); a value JSON carries exactly (a float) is cached."""
    cfgp.write_text(MIN + extra)
    try:
        plain: config.Config | ConfigError = config.load(cfgp)
    except ConfigError as exc:
        plain = exc
    try:
        cached: config.Config | ConfigError = load(cfgp)
    except ConfigError as exc:
        cached = exc
    if isinstance(plain, ConfigError):
        assert isinstance(cached, ConfigError) and cached.message == plain.message
    else:
        assert cached == plain
    assert cache_of(cfgp).exists() == (extra == "    description: 0.0\n")


def test_verify_uses_the_cache_through_both_entries(cfgp: Path, tmp_path: Path) -> None:
    """`deploytool verify` (fast entry and click) reads the cache; --no-cache parses afresh: a tampered document
    shows in the error, and --no-cache does not."""
    cfgp.write_text(MIN.replace("default_backend: a", "default_backend: a\npaths:\n  state_dir: state"))
    load(cfgp)
    tamper(cfgp, "/tampered")
    c = cache_of(cfgp)
    d = json.loads(c.read_bytes())
    d["document"]["default_backend"] = "zz"  # not a backend: from_dict names it
    c.write_text(json.dumps(d))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    for prog in (["-c", "from deploy_tool.entry import main; main()"], ["-m", "deploy_tool"]):
        r = subprocess.run([sys.executable, *prog, "--config", str(cfgp), "verify", "a"], capture_output=True,
                           text=True, timeout=60, cwd=REPO, env=env)
        assert r.returncode == 3 and "default_backend: 'zz' is not one of the backends" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-c", "from deploy_tool.entry import main; main()", "--config", str(cfgp),
                        "verify", "a", "--no-cache"], capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    assert r.returncode == 13 and "a is not pinned" in r.stderr, r.stderr  # the real config, parsed afresh
    assert json.loads(c.read_bytes())["document"]["default_backend"] == "a"  # and the cache rewritten


def test_touch_misses_and_rewrites_the_key(cfgp: Path) -> None:
    """A touched config (same bytes, new mtime and ctime) misses the stat key: the cache is rewritten for it."""
    load(cfgp)
    tamper(cfgp)
    time.sleep(0.01)
    os.utime(cfgp)
    st = cfgp.stat()
    assert model(load(cfgp)) == "/m"
    assert json.loads(cache_of(cfgp).read_bytes())["key"] == [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                                                              st.st_ctime_ns]


@pytest.mark.parametrize("doc", [[1, 2], "text", None, {1: "int key"}, {"a": {True: 1}}, {"a": (1, 2)},
                                 {"a": float("nan")}, {"a": {1, 2}}])
def test_blob_refuses_what_json_would_not_give_back_exactly(doc: Any, cfgp: Path) -> None:
    """Defence in depth below from_dict: a non-mapping, non-string keys, tuples, NaN or sets are never stored."""
    st = cfgp.stat()
    assert config._ParseCache(cfgp.resolve(), st, cfgp.read_bytes()).blob(MIN, doc, "0" * 64) is None
