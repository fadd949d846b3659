"""The bounded config loader (config.load / yamlread.read): whatever the bytes, a Config or one ConfigError (exit 3)
that names the key path or the line, within a bounded time and memory; never another exception, never a hang.

Property tests (hypothesis) with a per-example deadline and a tracemalloc bound on each example's peak memory;
the hostile files (alias bomb, 10 MB, huge integers, endless devices) through the real CLI in a subprocess
limited in address space and time. Exact messages for single cases are in test_config.py's BAD table.
"""

from __future__ import annotations

import dataclasses
import os
import re
import resource
import subprocess
import sys
import time
import tracemalloc
import typing
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy_tool import config, yamlread
from deploy_tool.errors import ConfigError, ExitCode
from tests.support.configs import example_dict
from tests.support.examples import examples

REPO = Path(__file__).resolve().parents[1]
MIN = "version: 1\ndefault_backend: a\nbackends:\n  a:\n    kind: ftllm\n    model: /m\n"
TOP = ("version", "default_backend", "backends", "host", "serve", "paths", "systemd", "health", "bundle",
       "supervision")
PLACE = re.compile(r"^(?:" + "|".join(TOP) + r")\b|\blines? \d+\b|at the top level")
DEADLINE = timedelta(seconds=2)  # a parse of the largest file allowed takes well under 1 s; a hang takes forever
PEAK_BYTES = 64 << 20  # a whole 1 MiB file parsed into Python objects stays far below this
FUZZ = settings(deadline=DEADLINE, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                          HealthCheck.function_scoped_fixture])


def bare(msg: str) -> str:
    """A config error without the place it starts with (`FILE:LINE:COL: `, as compilers write it)."""
    return re.sub(r"^.*?:\d+:\d+: ", "", msg, count=1)


def names_place(msg: str, path: Path) -> bool:
    """The message names a key path or a line (or, for a file too big to read, the file and the limit)."""
    if msg.startswith(f"{path}: a config file may be at most"):
        return True
    if re.match(rf"{re.escape(str(path))}:\d+:\d+: ", msg):
        return True  # FILE:LINE:COL: as compilers write it
    return bool(PLACE.search(msg.removeprefix(f"{path}: ")))


def load_bounded(path: Path) -> config.Config | ConfigError:
    """config.load, with the example's peak Python memory held under PEAK_BYTES; only ConfigError may escape."""
    tracemalloc.start()
    try:
        return config.load(path)
    except ConfigError as exc:
        assert exc.exit_code == ExitCode.CONFIG
        assert "\n" not in exc.message and names_place(exc.message, path), exc.message
        return exc
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < PEAK_BYTES, f"{peak / 2**20:.0f} MiB peak"


@pytest.fixture(scope="module")
def cfg_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("loader")


def write(d: Path, text: str | bytes) -> Path:
    p = d / "deploytool.yaml"
    p.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    return p


# ----------------------------------------------------------------------------------------- any text

_FRAGMENTS = ["version: 1\n", "default_backend: a\n", "backends:\n", "  a:\n", "    kind: ftllm\n", "    model: /m\n",
              "    tp: ", "    env:\n", "      X: ", "    extra_args: ", "host:\n  gpus: ", "serve:\n  port: ",
              "- ", "[", "]", "{", "}", ", ", ": ", "? ", "&a ", "*a", "<<: ", "!!str ", "!!python/name:os.system ",
              "!!binary ", "!x ", "---\n", "...\n", "%YAML 1.1\n", "%TAG ! tag:x,2000:\n", "'", '"', "|\n", ">-\n",
              "#", "\t", "\n", "  ", "\\", "\x00", "\x07", "\x85", "\ufeff", "\ud800", "yes", "on", "~", "null", "0x1F",
              "0o17", "1_000", "1e3", "1.5e+3", ".inf", "-.nan", "12:30", "2026-12-01", "9" * 120, "-0", "007",
              "65536", "0.0", "1.0e-400", "true", "False"]


@settings(FUZZ, max_examples=examples(250))
@given(text=st.one_of(st.text(max_size=400),
                 st.lists(st.sampled_from(_FRAGMENTS), max_size=40).map("".join),
                 st.lists(st.one_of(st.sampled_from(_FRAGMENTS), st.text(max_size=8)), max_size=40).map("".join)))
def test_any_text_gives_a_config_or_a_placed_config_error(text: str, cfg_dir: Path) -> None:
    """Any text (YAML fragments, control characters, lone surrogates, BOMs, tags, anchors): a Config or a
    ConfigError naming a key path or a line, within the deadline and the memory bound."""
    load_bounded(write(cfg_dir, text))


@settings(FUZZ, max_examples=examples(25))
@given(fragment=st.sampled_from(["[", "{", "- ", "a: 1\n", "&a x\n", "*a ", "'x", "9", "#", "\n", " ", "[a, ", "{a: b, ",
                        "  - x\n", "? x\n: y\n", "k: [1,2,3]\n", "\"\\u0041\"", "x" * 100]),
       n=st.integers(1, 600_000), valid_head=st.booleans())
def test_large_repetitive_text_is_bounded(fragment: str, n: int, valid_head: bool, cfg_dir: Path) -> None:
    """Up to ~1.2 MiB of one fragment repeated (deep nesting, long lines, many keys, long scalars): still within
    the deadline and the memory bound, and over 1 MiB refused by size without being parsed."""
    text = (MIN + "    extra_args:\n" if valid_head else "") + fragment * max(1, min(n, (1_250_000 // len(fragment))))
    p = write(cfg_dir, text)
    r = load_bounded(p)
    if len(text.encode()) > config.MAX_CONFIG_BYTES:
        assert isinstance(r, ConfigError) and "may be at most 1048576 bytes" in r.message


# ----------------------------------------------------------------------------------------- any structure

_keys = st.one_of(st.sampled_from(["version", "backends", "a", "kind", "model", "tp", "env", "serve", "port",
                                   "host", "gpus", "health", "ftllm", "llamacpp", "speculative"]),
                  st.text(max_size=10), st.integers(-5, 5), st.booleans(), st.none(), st.floats())
_numbers = st.one_of(st.integers(), st.integers(-2**64, 2**64), st.integers(-10**200, 10**200).filter(lambda v: v != 0),
                     st.floats(allow_nan=True, allow_infinity=True), st.just(0), st.just(-0.0))
_scalars = st.one_of(st.none(), st.booleans(), _numbers, st.text(max_size=20),
                     st.sampled_from(["ftllm", "llamacpp", "cpu", "cuda", "/m", "a", "yes", "on", "0x1F", "1e3"]))
_structures = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                              st.dictionaries(_keys, inner, max_size=5)),
                           max_leaves=25)


def emit(v: Any, indent: str = "") -> str:
    """A block-style YAML rendering of `v` that writes numbers as Python prints them (any size, inf, nan) and
    keys and strings double-quoted (JSON escapes, which YAML reads), so no emitter's limits shape the input."""
    import json

    def scalar(x: Any) -> str:
        if isinstance(x, str):
            return json.dumps(x)
        if x is None or isinstance(x, bool):
            return {None: "null", True: "true", False: "false"}[x]
        return str(x) if isinstance(x, int) else repr(x)

    if isinstance(v, dict) and v:
        return "".join(f"{indent}{scalar(k)}:" + (f"\n{emit(x, indent + '  ')}" if isinstance(x, dict | list) and x
                                                   else f" {emit(x)}\n") for k, x in v.items())
    if isinstance(v, list) and v:
        return "".join(f"{indent}-" + (f"\n{emit(x, indent + '  ')}" if isinstance(x, dict | list) and x
                                       else f" {emit(x)}\n") for x in v)
    if isinstance(v, dict | list):
        return "{}" if isinstance(v, dict) else "[]"
    return scalar(v)


@settings(FUZZ, max_examples=examples(300))
@given(doc=st.one_of(_structures, st.builds(lambda extra, base: {**base, **extra},
                                        st.dictionaries(st.sampled_from(TOP), _structures, max_size=3),
                                        st.sampled_from([example_dict("cpu-demo"), example_dict("two-2080ti")]))))
def test_any_structure_gives_a_config_or_a_placed_config_error(doc: Any, cfg_dir: Path) -> None:
    """Any structure (any key, any value type, any number: huge, negative, zero, inf, nan) written as YAML: a
    Config or a ConfigError naming a key path or a line."""
    text = emit(doc)
    if not isinstance(doc, dict | list) or not doc:
        text += "\n"
    load_bounded(write(cfg_dir, text))


# ----------------------------------------------------------------------------------------- every number's range


def _numeric_fields() -> list[tuple[str, config.Range, bool, bool]]:
    """(key path in the two-2080ti example, range, integer?, a list?) for every numeric setting of the schema."""
    out = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if "doc" not in f.metadata:
                continue
            tp = hints[f.name]
            args = [a for a in (typing.get_args(tp) or (tp,)) if a is not type(None)]
            path = f"{prefix}{f.name}"
            if dataclasses.is_dataclass(args[0]):
                walk(args[0], path + ".")  # type: ignore[arg-type]
            elif int in args or float in args:
                assert "range" in f.metadata, f"{path}: a number without a range"
                out.append((path, f.metadata["range"], int in args, typing.get_origin(tp) is tuple))

    walk(config._ConfigRest, "")
    walk(config._FtllmRaw, "backends.ftllm-dflash.")
    walk(config._LlamacppRaw, "backends.llamacpp-tensor.")
    return out


NUMERIC = _numeric_fields()


def test_every_numeric_field_has_a_range_that_admits_its_default() -> None:
    """Every int or float setting has a range (walking the schema asserts it), with a reason, and its default
    and the examples' values lie inside."""
    assert len(NUMERIC) == 34  # 19, the 3 of supervision.failover, the 8 of liveness and drain, bundle.sequence,
    # supervision.keep_releases, serve.internal_port and serve.hold_timeout_s
    names = {p.rsplit(".", 1)[-1] for p, *_ in NUMERIC}
    assert {"port", "gpus", "start_timeout_s", "interval_s", "threads", "tp", "tokens", "ctx_size", "gpu_mem_ratio",
            "num_draft_tokens", "draft_n_max", "vram_mib", "max_batch", "perf_gate_fraction", "window_s",
            "start_limit_burst", "start_limit_interval_s", "sequence", "keep_releases"} <= names
    for cls in (config._ConfigRest, config.Host, config.Serve, config.HealthCfg, config._FtllmRaw,
                config._LlamacppRaw, config.Speculative, config.LlamaSpec, config.FailoverCfg, config.BundleCfg):
        for f in dataclasses.fields(cls):
            rng = f.metadata.get("range")
            if rng is not None:
                assert rng.why and rng.lo < rng.hi
                if isinstance(f.default, int | float) and not isinstance(f.default, bool):
                    assert rng.admits(f.default), f.name
    for name in config.EXAMPLES:
        config.from_dict(example_dict(name))


def _yaml_number(v: int | float) -> str:
    return str(v) if isinstance(v, int) else yaml.safe_dump(v).splitlines()[0]


def _set(doc: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for k in parents:
        doc = doc.setdefault(k, {})
    doc[last] = value


def _get(cfg: config.Config, path: str) -> Any:
    obj: Any = cfg
    parts = path.split(".")
    if parts[0] == "backends":
        obj, parts = cfg.backends[parts[1]], parts[2:]
    for k in parts:
        obj = getattr(obj, k)
    return obj


@pytest.mark.slow  # 300 examples, 8 s of CPU: make test runs it, make check does not (bench/RESULTS.md)
@settings(FUZZ, max_examples=examples(300))
@given(field=st.sampled_from(NUMERIC),
       value=st.one_of(st.integers(-10**6, 10**8), st.integers(), st.integers(-10**120, 10**120),
                       st.floats(allow_nan=True, allow_infinity=True), st.floats(-1e6, 1e8),
                       st.sampled_from([0, -1, 1, 31, 32, 63, 64, 65535, 65536, 86400, 86401, 4096, 4097, 16777216,
                                        16777217, 0.0, -0.0, 0.004, 0.005, 1.0, 1e-300, 5e-324, 1.0000001])))
def test_every_number_is_range_checked(field: tuple[str, config.Range, bool, bool], value: int | float,
                                       cfg_dir: Path) -> None:
    """Any number, in any numeric setting, through YAML text: accepted exactly when it has the setting's type
    and lies in its range (and then reaches the Config unchanged); otherwise one ConfigError naming the key path."""
    path, rng, integer, is_list = field
    doc = example_dict("two-2080ti")
    _set(doc, path, "NUMBER_HERE")
    text = yaml.safe_dump(doc, sort_keys=False)
    number = _yaml_number(value)
    text = text.replace("NUMBER_HERE", f"[{number}]" if is_list else number)
    p = write(cfg_dir, text)
    r = load_bounded(p)
    finite = value == value and value not in (float("inf"), float("-inf"))
    digits_ok = not isinstance(value, int) or len(str(value)) <= yamlread.MAX_INT_DIGITS
    ok = (isinstance(value, int) or not integer) and finite and digits_ok and rng.admits(value)
    if ok:
        assert isinstance(r, config.Config), r
        got = _get(r, path)
        assert got == ((value,) if is_list else value)
        assert type(got[0] if is_list else got) is (int if integer else float)
    else:
        assert isinstance(r, ConfigError)
        assert bare(r.message).startswith(path), r.message


@pytest.mark.parametrize("field", NUMERIC, ids=[f[0] for f in NUMERIC])
def test_range_bounds_of_every_field(field: tuple[str, config.Range, bool, bool], tmp_path: Path) -> None:
    """Each numeric setting takes both ends of its range (an open lower end excepted) and refuses the next value
    past either end, naming the key path, the range and the reason."""
    path, rng, integer, is_list = field
    step = 1 if integer else max(abs(rng.hi), 1) * 1e-9
    inside = [rng.hi] + ([] if rng.lo_open else [rng.lo])
    outside = [rng.hi + step, rng.lo if rng.lo_open else rng.lo - (1 if integer else max(abs(rng.lo), 1) * 1e-9)]
    for value, ok in [*((v, True) for v in inside), *((v, False) for v in outside)]:
        v = int(value) if integer else float(value)
        doc = example_dict("two-2080ti")
        _set(doc, path, [v] if is_list else v)
        r = load_bounded(write(tmp_path, yaml.safe_dump(doc, sort_keys=False)))
        if ok:
            assert isinstance(r, config.Config) and _get(r, path) == ((v,) if is_list else v), (path, v, r)
        else:
            assert isinstance(r, ConfigError), (path, v)
            assert bare(r.message).startswith(path) and "out of range" in r.message and rng.why in r.message, r.message


# ----------------------------------------------------------------------------------------- duplicate keys


@settings(FUZZ, max_examples=examples(100))
@given(keys=st.lists(st.from_regex(r"[A-Z_][A-Z0-9_]{0,8}", fullmatch=True).filter(
           lambda k: k not in ("TRUE", "FALSE", "NULL")), min_size=1, max_size=12, unique=True),
       pick=st.integers(0, 100), at=st.integers(0, 100), where=st.sampled_from(["env", "top", "backend"]))
def test_a_duplicate_key_names_both_lines(keys: list[str], pick: int, at: int, where: str, cfg_dir: Path) -> None:
    """A key written twice anywhere (env names, top-level keys, backend settings): the error names the key path
    and both lines, whichever comes first."""
    if where == "env":
        lines = MIN.splitlines() + ["    env:"] + [f"      {k}: v" for k in keys]
        first = len(MIN.splitlines()) + 1 + pick % len(keys)
        dup = keys[pick % len(keys)]
        pos = first + 1 + at % (len(lines) - first)  # somewhere after the first, inside env
        lines.insert(pos, f"      {dup}: w")
        path = f"backends.a.env.{dup}"
    elif where == "top":
        lines = MIN.splitlines()
        dup = ["version", "default_backend"][pick % 2]
        first = 0 if dup == "version" else 1
        lines.append(f"{dup}: 1")
        pos = len(lines) - 1
        path = dup
    else:
        lines = MIN.splitlines()
        dup = ["kind", "model"][pick % 2]
        first = 4 if dup == "kind" else 5
        pos = first + 1 + at % (len(lines) - first)
        lines.insert(pos, f"    {dup}: x")
        path = f"backends.a.{dup}"
    file = write(cfg_dir, "\n".join(lines) + "\n")
    r = load_bounded(file)
    assert isinstance(r, ConfigError)
    col = len(lines[pos]) - len(lines[pos].lstrip()) + 1  # the second key's own column
    assert r.message == f"{file}:{pos + 1}:{col}: {path}: duplicate key at lines {first + 1} and {pos + 1}"


# ----------------------------------------------------------------------------------------- hostile files, real CLI

MEM_LIMIT = 512 << 20


def _cli(path: Path, timeout: float = 20) -> tuple[subprocess.CompletedProcess[str], float]:
    """`deploytool check` in a child limited to MEM_LIMIT of address space, killed after `timeout` seconds."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEM_LIMIT, MEM_LIMIT))

    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "deploy_tool", "--config", str(path), "check", "--no-files"],
                       capture_output=True, text=True, timeout=timeout, cwd=REPO, preexec_fn=limit)
    return r, time.monotonic() - t


BOMB_LEVELS = ['&l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]'] + [
    f"&l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 10)]


@pytest.mark.parametrize("name,text,message", [
    ("alias bomb", MIN + "    extra_args: [[" + ", ".join(BOMB_LEVELS) + "]]\n",
     ":7:19: backends.a.extra_args[0][0]: the YAML anchor &l0 is not accepted"),
    ("alias bomb, block style", "version: 1\ndefault_backend: a\nbackends:\n  a:\n    kind: ftllm\n    model: /m\n"
     "    description: &d " + "x" * 1000 + "\n    extra_args:\n" + "".join("      - *d\n" for _ in range(5000)),
     ":7:5: backends.a.description: the YAML anchor &d is not accepted"),
    ("10 MB", MIN + "    env:\n" + "".join(f"      V{i}: '{'x' * 80}'\n" for i in range(100_000)),
     "a config file may be at most 1048576 bytes (1 MiB); this one is "),
    ("5000-digit integer", MIN + "    tp: " + "9" * 5000 + "\n",
     ":7:5: backends.a.tp: 999999999999... (5000 digits) is out of range for every setting"),
    ("huge float", MIN + "    start_timeout_s: 1" + "0" * 500 + ".0\n",
     ":7:5: backends.a.start_timeout_s: .inf is not a finite number"),
    ("500k items", MIN + "    extra_args: [" + "1," * 500_000 + "1]\n",
     ": the config holds more than 10000 keys and values"),
    ("deep nesting", MIN + "    extra_args: " + "[" * 200_000 + "]" * 200_000 + "\n",
     ":7:"),  # libyaml's own nesting limit (1000) may answer first: its scanner reads ahead
], ids=lambda v: v if isinstance(v, str) and len(v) < 30 else "")
def test_hostile_file_is_refused_fast_and_small(name: str, text: str, message: str, tmp_path: Path) -> None:
    """The hostile files of the issue through the real CLI: exit 3 with the key path or the file named, in a
    child limited to 512 MiB, within 5 s (the loader before this took >20 s and 1 GB for the bomb and 8 s for
    10 MB, and ended the huge integer in exit 70)."""
    p = write(tmp_path, text)
    r, took = _cli(p)
    assert r.returncode == 3, (r.returncode, r.stderr[-2000:])
    first = r.stderr.splitlines()[0]
    assert first.startswith(f"error: {p}") and message in first and len(r.stderr.splitlines()) <= 2, r.stderr
    assert name == "10 MB" or first.startswith(f"error: {p}:7:"), first  # the line it is on
    assert "Traceback" not in r.stderr and took < 5, took


def test_size_cap_is_checked_before_reading(tmp_path: Path) -> None:
    """A sparse 10 GB file is refused from its size alone: nothing is read, so it is instant."""
    p = tmp_path / "deploytool.yaml"
    with open(p, "wb") as f:
        f.truncate(10 << 30)
    t = time.monotonic()
    with pytest.raises(ConfigError) as e:
        config.load(p)
    assert time.monotonic() - t < 0.5
    assert e.value.message == (f"{p}: a config file may be at most 1048576 bytes (1 MiB); this one is "
                               f"{10 << 30} bytes")
    assert e.value.hint and "--config names the config" in e.value.hint


def test_exactly_the_limit_is_read(tmp_path: Path) -> None:
    """A file of exactly MAX_CONFIG_BYTES is parsed (a comment pads it); one byte more is refused."""
    pad = config.MAX_CONFIG_BYTES - len(MIN) - 2
    p = write(tmp_path, MIN + "#" + "x" * pad + "\n")
    assert p.stat().st_size == config.MAX_CONFIG_BYTES
    assert config.load(p).backends["a"].model == "/m"
    p = write(tmp_path, MIN + "#" + "x" * (pad + 1) + "\n")
    with pytest.raises(ConfigError, match="may be at most 1048576 bytes"):
        config.load(p)


def test_endless_device_and_fifo_do_not_hang(tmp_path: Path) -> None:
    """/dev/zero as the config is read up to the limit and refused; a FIFO nobody writes to reads as empty instead
    of blocking, and a pipe with a writer (`--config <(...)`) is read."""
    with pytest.raises(ConfigError, match="may be at most 1048576 bytes .*holds more than that"):
        config.load("/dev/zero")
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    t = time.monotonic()
    with pytest.raises(ConfigError, match="not NoneType"):
        config.load(fifo)
    assert time.monotonic() - t < 2
    r, w = os.pipe()
    try:
        os.write(w, MIN.encode())
        os.close(w)
        assert config.load(f"/dev/fd/{r}").backends["a"].model == "/m"
    finally:
        os.close(r)


def test_config_reference_shows_every_range() -> None:
    """`deploytool config-reference --json` gives every numeric setting's range and its reason."""
    import json

    from click.testing import CliRunner

    from deploy_tool.cli import main

    r = CliRunner().invoke(main, ["--json", "config-reference"])
    assert r.exit_code == 0, r.output
    rows = {row["key"].replace("  (kind: ftllm) ", "").replace("  (kind: llamacpp) ", ""): row
            for row in json.loads(r.stdout)}
    for path, rng, integer, _is_list in NUMERIC:
        key = re.sub(r"^backends\.[^.]+\.", "backends.<name>.", path)
        assert rng.text(integer) in rows[key]["type"] and rng.why in rows[key]["doc"], (key, rows[key])


def test_start_timeout_range_is_what_systemd_parses(tmp_path: Path) -> None:
    """Both ends of the start-timeout range render a TimeoutStartSec= that the real systemd-analyze parses,
    while a value past it (as `check` used to pass) is one systemd ignores, falling back to its default."""
    from deploy_tool import render

    def timeout_line(seconds: float) -> str:
        doc = example_dict("cpu-demo")
        doc["health"]["start_timeout_s"] = seconds
        cfg = config.from_dict(doc, source_path=str(tmp_path / "deploytool.yaml"))
        unit = render.render_backend(cfg, cfg.backends["ftllm-dflash"])[0].content
        return next(ln for ln in unit.splitlines() if ln.startswith("TimeoutStartSec="))

    def analyze(line: str) -> str:
        u = tmp_path / "t.service"
        u.write_text(f"[Unit]\nDescription=t\n[Service]\nExecStart=/bin/true\n{line}\n")
        r = subprocess.run(["systemd-analyze", "verify", str(u)], capture_output=True, text=True, timeout=60)
        return r.stdout + r.stderr

    rng = config.START_TIMEOUT_S
    for seconds in (rng.lo, rng.hi):
        line = timeout_line(seconds)
        assert line == f"TimeoutStartSec={int(seconds)}"
        assert "TimeoutStartSec" not in analyze(line)
    with pytest.raises(ConfigError, match="out of range"):
        timeout_line(1e20)
    assert "Failed to parse TimeoutStartSec= parameter, ignoring" in analyze(f"TimeoutStartSec={int(1e20)}")
