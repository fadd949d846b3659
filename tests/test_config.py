"""The config loader: bad input gives one exact line (plus a hint), its own exit code, no traceback, nothing written.

Also property-based fuzzing (hypothesis): any text, and any mutation of the embedded examples, yields either a
valid Config or a DeployError; never another exception, and through the real CLI never a traceback.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy_tool import checks, config, render, yamlread
from deploy_tool.cli import main
from deploy_tool.errors import ConfigError, DeployError, ExitCode, InputError
from tests.support.configs import example_dict
from tests.support.examples import examples

MIN = "version: 1\ndefault_backend: a\nbackends:\n  a:\n    kind: ftllm\n    model: /m\n"


NUMBER_HINT = "write numbers in plain decimal (8082, 0.95, 900); yes/no, 0x1F, 1e3 and 1_000 are not numbers here"
NO_ALIAS = "write the value out in full: a deploytool config takes no anchors (&) or aliases (*)"
NO_TAG = "remove the tag: a config holds plain strings, numbers, true/false, null, lists and mappings"


def _b(extra: str) -> str:
    """MIN with extra lines added to backend a."""
    return MIN + extra


# (case id, YAML text, exact error line, exact hint or None, exit code)
BAD: list[tuple[str, str, str, str | None, int]] = [
    ("malformed-flow", "version: 1\nbackends:\n  a: [1, 2\n",
     "{p}:4:1: malformed YAML: did not find expected ',' or ']'",
     "fix the YAML syntax (indentation, quotes, colons)", 3),
    ("malformed-tab", "version: 1\n\tbackends: {}\n",
     "{p}:2:1: malformed YAML: found a tab character that violates indentation",
     "fix the YAML syntax (indentation, quotes, colons)", 3),
    ("malformed-colon", "version: 1\nbackends: a: b\n",
     "{p}:2:12: malformed YAML: mapping values are not allowed in this context",
     "fix the YAML syntax (indentation, quotes, colons)", 3),
    ("top-level-list", "- 1\n- 2\n", "the config must be a YAML mapping at the top level, not list",
     "start from `deploytool init --example cpu-demo`", 3),
    ("empty", "", "the config must be a YAML mapping at the top level, not NoneType",
     "start from `deploytool init --example cpu-demo`", 3),
    ("wrong-type-int", _b("    tp: two\n"), "backends.a.tp: 'two' is not an integer", NUMBER_HINT, 3),
    ("wrong-type-bool", _b("    cuda_embedding: 'yes'\n"), "backends.a.cuda_embedding: 'yes' is not true or false",
     None, 3),
    ("wrong-type-list", _b("    aliases: ftllm\n"), "backends.a.aliases: 'ftllm' is not a list (expected a list of "
     "a string)", None, 3),
    ("wrong-type-mapping", MIN + "serve: 8082\n", "serve: 8082 is not a mapping (expected keys: host, port, "
     "internal_port, hold_timeout_s, model_name, api_key_file, user, allow)", None, 3),
    ("unknown-key", _b("    tokenz: 5\n"), "backends.a: unknown key 'tokenz'", "did you mean 'tokens'?", 3),
    ("unknown-key-nested", _b("    speculative:\n      num_draft_token: 8\n"),
     "backends.a.speculative: unknown key 'num_draft_token'", "did you mean 'num_draft_tokens'?", 3),
    ("unknown-top", MIN + "servee: {}\n", "unknown key 'servee' at the top level", "did you mean 'serve'?", 3),
    ("missing-model", "version: 1\ndefault_backend: a\nbackends:\n  a:\n    kind: ftllm\n",
     "backends.a.model: missing (expected a string: model directory (ftllm) or GGUF file)", None, 3),
    ("missing-version", MIN.replace("version: 1\n", ""), "version: missing (expected 1)",
     "add `version: 1` at the top", 3),
    ("bad-version", MIN.replace("version: 1", "version: 2"),
     "version: 2 is not a supported config version (expected 1)", None, 3),
    ("missing-backends", "version: 1\ndefault_backend: a\n",
     "backends: missing or empty (expected a mapping of backend name -> settings)", None, 3),
    ("bad-port-range", MIN + "serve:\n  port: 70000\n",
     "serve.port: 70000 is out of range (expected an integer from 1 to 65535: a TCP port)", None, 3),
    ("bad-port-zero", MIN + "serve:\n  port: 0\n",
     "serve.port: 0 is out of range (expected an integer from 1 to 65535: a TCP port)", None, 3),
    ("bad-port-type", MIN + "serve:\n  port: abc\n", "serve.port: 'abc' is not an integer", NUMBER_HINT, 3),
    ("bad-backend-name", MIN.replace(" a", " A_b").replace("\n  a:", "\n  A_b:"),
     "backends.A_b: 'A_b' is not a valid backend name (expected lowercase letters, digits and '-', starting with "
     "a letter, at most 40 characters; it becomes the unit name)", None, 3),
    ("bad-kind", MIN.replace("kind: ftllm", "kind: vllm"),
     "backends.a.kind: 'vllm' is not valid (expected one of 'ftllm', 'llamacpp')", None, 3),
    ("unknown-default", MIN.replace("default_backend: a", "default_backend: b"),
     "default_backend: 'b' is not one of the backends (a)", None, 3),
    ("unknown-default-close", "version: 1\ndefault_backend: ftlm\nbackends:\n  ftllm:\n    kind: ftllm\n"
     "    model: /m\n", "default_backend: 'ftlm' is not one of the backends (ftllm)", "did you mean 'ftllm'?", 3),
    ("duplicate-alias", _b("    aliases: [x]\n  b:\n    kind: llamacpp\n    model: /m\n    aliases: [x]\n"),
     "backends.b.aliases: 'x' is already an alias of a", None, 3),
    ("alias-shadows-backend", _b("    aliases: [b]\n  b:\n    kind: llamacpp\n    model: /m\n"),
     "backends.a.aliases: 'b' is the name of another backend", None, 3),
    ("env-name", _b("    env:\n      1BAD: x\n"), "backends.a.env: '1BAD' is not a valid environment variable name",
     "use letters, digits and '_', not starting with a digit", 3),
    ("env-newline", _b('    env:\n      GOOD: "a\\nb"\n'),
     "backends.a.env.GOOD: the value contains a line break, which an EnvironmentFile cannot hold",
     "put such data in a file and pass its path", 3),
    ("env-nul", _b('    env:\n      GOOD: "a\\0b"\n'), "backends.a.env.GOOD: contains a NUL byte", None, 3),
    ("ratio", _b("    gpu_mem_ratio: 1.5\n"), "backends.a.gpu_mem_ratio: 1.5 is out of range (expected a number "
     "above 0 and at most 1: a fraction)", None, 3),
    ("ratio-nan", _b("    gpu_mem_ratio: .nan\n"), "backends.a.gpu_mem_ratio: .nan is not a finite number", None, 3),
    ("kv-dtype", _b("    kv_cache_dtype: fp5\n"), "backends.a.kv_cache_dtype: 'fp5' is not valid (expected one "
     "of 'auto', 'float16', 'bfloat16', 'fp8', 'fp8_e4m3', 'fp4')", "did you mean 'fp8'?", 3),
    ("split-mode", MIN.replace("kind: ftllm", "kind: llamacpp") + "    split_mode: rows\n",
     "backends.a.split_mode: 'rows' is not valid (expected one of 'none', 'layer', 'row', 'tensor')",
     "did you mean 'row'?", 3),
    ("compute-capability", MIN + "host:\n  compute_capability: sm_75\n",
     "host.compute_capability: 'sm_75' is not a compute capability (expected a string like '7.5')", None, 3),
    ("placeholder", _b("    executable: '{home}/ftllm'\n"),
     "backends.a.executable: '{home}/ftllm' may only start with the placeholders {current} or {venv}", None, 3),
    # the bounded loader: what YAML allows and a config never needs
    ("duplicate-key", _b("    tp: 2\n    model: /other\n"), "backends.a.model: duplicate key at lines 6 and 8",
     "keep one of the two (YAML would silently take the last)", 3),
    ("duplicate-top", MIN + "version: 1\n", "version: duplicate key at lines 1 and 7",
     "keep one of the two (YAML would silently take the last)", 3),
    ("duplicate-backend", MIN + "  a:\n    kind: llamacpp\n    model: /n\n", "backends.a: duplicate key at lines 4 and 7",
     "keep one of the two (YAML would silently take the last)", 3),
    ("alias", _b("    aliases: &x [q]\n    extra_args: *x\n"),
     "backends.a.aliases (line 7): the YAML anchor &x is not accepted", NO_ALIAS, 3),
    ("alias-only", _b("    extra_args: *x\n"), "backends.a.extra_args (line 7): the YAML alias *x is not accepted",
     NO_ALIAS, 3),
    ("merge-key", _b("    <<: {tp: 2}\n"), "backends.a (line 7): the YAML merge key << is not accepted", NO_ALIAS, 3),
    ("tag-python", _b("    description: !!python/object/apply:os.system ['true']\n"),
     "backends.a.description (line 7): the YAML tag !!python/object/apply:os.system is not accepted", NO_TAG, 3),
    ("tag-int", _b("    tp: !!int 2\n"), "backends.a.tp (line 7): the YAML tag !!int is not accepted", NO_TAG, 3),
    ("tag-set", _b("    aliases: !!set {x: null}\n"), "backends.a.aliases (line 7): the YAML tag !!set is not accepted",
     NO_TAG, 3),
    ("str-tag-ok-but-not-int", _b("    tp: !!str 2\n"), "backends.a.tp: '2' is not an integer", NUMBER_HINT, 3),
    ("key-int", _b("    env:\n      1: x\n"), "backends.a.env (line 8): the key '1' (read as 1) is not a string",
     "keys are names: quote a key that YAML reads as a number, true/false or null", 3),
    ("key-null", _b("    env:\n      ~: x\n"), "backends.a.env (line 8): the key '~' (read as null) is not a string",
     "keys are names: quote a key that YAML reads as a number, true/false or null", 3),
    ("key-list", _b("    env:\n      ? [a]\n      : x\n"), "backends.a.env (line 8): the key a list is not a string",
     "keys are names: quote a key that YAML reads as a number, true/false or null", 3),
    ("second-document", MIN + "---\nversion: 1\n", "{p}:7:1: a second YAML document; a config is one document",
     "remove the '---' line and what follows it, or merge the two", 3),
    ("huge-int", _b("    tp: " + "9" * 5000 + "\n"),
     "backends.a.tp (line 7): 999999999999... (5000 digits) is out of range for every setting", None, 3),
    ("huge-float-int", _b("    start_timeout_s: " + "9" * 400 + "\n"),
     "backends.a.start_timeout_s (line 7): 999999999999... (400 digits) is out of range for every setting", None, 3),
    ("big-int-to-float", _b("    start_timeout_s: " + "9" * 99 + "\n"),
     "backends.a.start_timeout_s: 1e+99 is out of range (expected a number from 1 to 86400: "
     + config.START_TIMEOUT_S.why + ")", None, 3),
    ("timeout-zero", MIN + "health:\n  start_timeout_s: 0.5\n", "health.start_timeout_s: 0.5 is out of range "
     "(expected a number from 1 to 86400: " + config.START_TIMEOUT_S.why + ")", None, 3),
    ("timeout-e", _b("    start_timeout_s: 1e3\n"), "backends.a.start_timeout_s: '1e3' is not a number", NUMBER_HINT, 3),
    ("timeout-inf", _b("    start_timeout_s: .inf\n"), "backends.a.start_timeout_s: .inf is not a finite number", None, 3),
    ("bool-yes", _b("    cuda_embedding: yes\n"), "backends.a.cuda_embedding: 'yes' is not true or false", None, 3),
    ("bool-on", _b("    prefix_cache: on\n"), "backends.a.prefix_cache: 'on' is not true or false", None, 3),
    ("bool-for-int", _b("    tp: true\n"), "backends.a.tp: true is not an integer", None, 3),
    ("hex-int", MIN + "serve:\n  port: 0x1F90\n", "serve.port: '0x1F90' is not an integer", NUMBER_HINT, 3),
    ("octal-int", MIN + "serve:\n  port: 0o17\n", "serve.port: '0o17' is not an integer", NUMBER_HINT, 3),
    ("underscore-int", MIN + "serve:\n  port: 8_082\n", "serve.port: '8_082' is not an integer", NUMBER_HINT, 3),
    ("sexagesimal", MIN + "serve:\n  port: 1:30\n", "serve.port: '1:30' is not an integer", NUMBER_HINT, 3),
    ("float-for-int", _b("    tp: 2.0\n"), "backends.a.tp: 2.0 is not an integer", None, 3),
    ("float-for-string", MIN + "serve:\n  model_name: 7.10\n", "serve.model_name: 7.1 is not a string",
     "quote it if you mean the text", 3),
    ("bool-for-string", MIN + "serve:\n  model_name: true\n", "serve.model_name: true is not a string",
     "quote it if you mean the text", 3),
    ("version-float", MIN.replace("version: 1", "version: 1.0"),
     "version: 1.0 is not a supported config version (expected 1)", None, 3),
    ("gpu-id", MIN + "host:\n  gpus: [0, 32]\n", "host.gpus[1]: 32 is out of range (expected an integer from 0 to 31: "
     + config.GPU_ID.why + ")", None, 3),
    ("gpu-twice", MIN + "host:\n  gpus: [1, 0, 1]\n", "host.gpus[2]: 1 is listed twice (also host.gpus[0])",
     "list each once", 3),
    ("threads-zero", _b("    threads: 0\n"), "backends.a.threads: 0 is out of range (expected an integer from 1 to "
     "4096: " + config.THREADS.why + ")", None, 3),
    ("ctx-huge", MIN.replace("ftllm", "llamacpp") + "    ctx_size: 2621440000\n", "backends.a.ctx_size: 2621440000 is "
     "out of range (expected an integer from 64 to 16777216: " + config.CONTEXT.why + ")", None, 3),
    ("nested", MIN + "serve: " + "[" * 20 + "]" * 20 + "\n",
     "serve" + "[0]" * 15 + " (line 7): nested deeper than 16 levels",
     "a deploytool config nests at most 5 levels; check the indentation", 3),
    ("control-char", MIN + "serve:\n  model_name: a\x07b\n",
     "{p}:8:16: the character '\\x07' is not allowed in YAML (control characters are not allowed)",
     "remove it, or write it as an escape inside double quotes", 3),
]

# where each error points, FILE:LINE:COLUMN (the key it names; a missing key's mapping); a case not listed names
# its file only (no key to point at) or its place in the message itself (malformed YAML)
LOCATION: dict[str, str] = {
    'top-level-list': '1:1',
    'wrong-type-int': '7:5',
    'wrong-type-bool': '7:5',
    'wrong-type-list': '7:5',
    'wrong-type-mapping': '7:1',
    'unknown-key': '7:5',
    'unknown-key-nested': '8:7',
    'unknown-top': '7:1',
    'missing-model': '4:3',
    'missing-version': '1:1',
    'bad-version': '1:1',
    'missing-backends': '1:1',
    'bad-port-range': '8:3',
    'bad-port-zero': '8:3',
    'bad-port-type': '8:3',
    'bad-backend-name': '4:3',
    'bad-kind': '5:5',
    'unknown-default': '2:1',
    'unknown-default-close': '2:1',
    'duplicate-alias': '11:5',
    'alias-shadows-backend': '7:5',
    'env-name': '7:5',
    'env-newline': '8:7',
    'env-nul': '8:7',
    'ratio': '7:5',
    'ratio-nan': '7:5',
    'kv-dtype': '7:5',
    'split-mode': '7:5',
    'compute-capability': '8:3',
    'placeholder': '7:5',
    'duplicate-key': '8:5',
    'duplicate-top': '7:1',
    'duplicate-backend': '7:3',
    'alias': '7:5',
    'alias-only': '7:5',
    'merge-key': '7:5',
    'tag-python': '7:5',
    'tag-int': '7:5',
    'tag-set': '7:5',
    'str-tag-ok-but-not-int': '7:5',
    'key-int': '8:7',
    'key-null': '8:7',
    'key-list': '8:7',
    'huge-int': '7:5',
    'huge-float-int': '7:5',
    'big-int-to-float': '7:5',
    'timeout-zero': '8:3',
    'timeout-e': '7:5',
    'timeout-inf': '7:5',
    'bool-yes': '7:5',
    'bool-on': '7:5',
    'bool-for-int': '7:5',
    'hex-int': '8:3',
    'octal-int': '8:3',
    'underscore-int': '8:3',
    'sexagesimal': '8:3',
    'float-for-int': '7:5',
    'float-for-string': '8:3',
    'bool-for-string': '8:3',
    'version-float': '1:1',
    'gpu-id': '8:13',
    'gpu-twice': '8:16',
    'threads-zero': '7:5',
    'ctx-huge': '7:5',
    'nested': '7:23',
}


def _located(case_id: str, line: str) -> str:
    """The error as the CLI prints it: `FILE:LINE:COL: key: message` (the composer's ' (line N)' folded in)."""
    if line.startswith("{p}"):
        return line
    loc = LOCATION.get(case_id)
    return f"{{p}}:{loc}: " + re.sub(r" \(line \d+\)", "", line, count=1) if loc else "{p}: " + line


def _run(args: list[str], cwd: Path) -> Any:
    runner = CliRunner()
    with runner.isolated_filesystem(temp_dir=cwd):
        return runner.invoke(main, args, catch_exceptions=False)


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_config_exact_message_through_cli(case: tuple[str, str, str, str | None, int], tmp_path: Path) -> None:
    """`render --out` on a bad config: the exact one-line error and hint, its exit code, no traceback, no output."""
    name, text, line, hint, code = case
    line = _located(name, line)
    p = tmp_path / "deploytool.yaml"
    p.write_text(text)
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["--config", str(p), "render", "--out", str(out)])
    expected = f"error: {line.replace('{p}', str(p))}\n" + (f"hint: {hint}\n" if hint else "")
    assert r.stderr == expected
    assert r.exit_code == code
    assert r.stdout == ""
    assert not out.exists(), "nothing may be written for a bad config"
    r2 = CliRunner().invoke(main, ["--config", str(p), "check"])
    assert r2.exit_code == code and r2.stderr == expected


def test_bad_config_json_error(tmp_path: Path) -> None:
    """With --json the same error is a JSON object carrying the message, the hint and the exit code."""
    import json

    p = tmp_path / "deploytool.yaml"
    p.write_text(_b("    tokenz: 5\n"))
    r = CliRunner().invoke(main, ["--json", "--config", str(p), "check"])
    assert r.exit_code == 3
    assert json.loads(r.stdout) == {"error": "ConfigError", "message": f"{p}:7:5: backends.a: unknown key 'tokenz'",
                                    "hint": "did you mean 'tokens'?", "exit_code": 3,
                                    "details": {"file": str(p), "line": 7, "column": 5, "key": "backends.a.tokenz"}}


@pytest.mark.parametrize("kind", ["missing", "directory", "not-utf8", "unreadable"])
def test_bad_config_file(kind: str, tmp_path: Path) -> None:
    """A missing, directory, non-UTF-8 or unreadable config file: one line, exit 5 (or 3 for bad text)."""
    import os

    p = tmp_path / "deploytool.yaml"
    expected: tuple[str, int]
    if kind == "missing":
        expected = (f"error: config file not found: {p}\nhint: write one with `deploytool init --example "
                    f"cpu-demo` or pass --config PATH\n", 5)
    elif kind == "directory":
        p.mkdir()
        expected = (f"error: config path is a directory, not a file: {p}\n", 5)
    elif kind == "not-utf8":
        p.write_bytes(b"\xff\xfe version: 1")
        expected = (f"error: {p}: not UTF-8 text (line 1, byte 0)\nhint: save the file as UTF-8\n", 3)
    else:
        if os.geteuid() == 0:
            # root reads any file: make it unreadable another way, a FIFO-free dangling symlink loop
            p.symlink_to(p)
            expected = (f"error: cannot read config file {p}: Too many levels of symbolic links\n", 5)
        else:
            p.write_text(MIN)
            p.chmod(0)
            expected = (f"error: cannot read config file {p}: Permission denied\n", 5)
    r = CliRunner().invoke(main, ["--config", str(p), "check"])
    assert (r.stderr, r.exit_code) == expected
    assert "Traceback" not in r.output


def test_exit_codes_are_distinct() -> None:
    """Config errors, failed checks and bad input files have distinct exit codes (3, 4, 5)."""
    assert {int(ExitCode.CONFIG), int(ExitCode.CHECK_FAILED), int(ExitCode.INPUT)} == {3, 4, 5}
    assert len(set(ExitCode)) == len(list(ExitCode))


def test_init_refuses_to_overwrite(tmp_path: Path) -> None:
    """`init` never overwrites an existing config without --force and writes nothing then."""
    p = tmp_path / "deploytool.yaml"
    p.write_text("mine\n")
    r = CliRunner().invoke(main, ["init", "--example", "two-2080ti", "--out", str(p)])
    assert r.exit_code == 5 and "already exist" in r.stderr
    assert p.read_text() == "mine\n"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["deploytool.yaml"]


def test_unknown_example(tmp_path: Path) -> None:
    """An unknown example name is a usage error (exit 2) with a did-you-mean, nothing written."""
    r = CliRunner().invoke(main, ["init", "--example", "cpu-dem", "--out", str(tmp_path / "x.yaml")])
    assert r.exit_code == 2
    assert r.stderr.endswith("Error: Invalid value for '--example' / '-e': unknown example 'cpu-dem' (examples: "
                             "two-2080ti, cpu-demo); did you mean 'cpu-demo'?\n")
    assert not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------------------- good configs


@pytest.mark.parametrize("name", config.EXAMPLES)
def test_examples_load(name: str, tmp_path: Path) -> None:
    """Both embedded examples load into frozen objects; relative paths are resolved against the config file."""
    p = tmp_path / "deploytool.yaml"
    p.write_text(config.example_text(name))
    cfg = config.load(p)
    assert cfg.serve.model_name == "qwen38-27b-ud"
    assert set(cfg.backends) == {"ftllm-dflash", "llamacpp-tensor"}
    assert cfg.bundle.chat_template is not None
    assert cfg.bundle.chat_template.source == str(tmp_path / "chat_template.jinja")
    with pytest.raises(AttributeError):
        cfg.serve.port = 1  # type: ignore[misc]


def test_two_2080ti_has_every_production_setting(tmp_path: Path) -> None:
    """The two-2080ti example reproduces both production launch lines of the field notes."""
    p = tmp_path / "deploytool.yaml"
    p.write_text(config.example_text("two-2080ti"))
    cfg = config.load(p)
    ft = cfg.backends["ftllm-dflash"]
    assert isinstance(ft, config.FtllmBackend)
    assert (ft.tp, ft.max_batch, ft.tokens, ft.gpu_mem_ratio, ft.kv_cache_dtype) == (2, 1, 262144, 0.95, "fp4")
    assert ft.speculative is not None and (ft.speculative.algorithm, ft.speculative.num_draft_tokens) == ("dflash", 8)
    assert dict(ft.env)["FASTLLM_CUDA_GRAPH"] == "0"
    ll = cfg.backends["llamacpp-tensor"]
    assert isinstance(ll, config.LlamacppBackend)
    assert (ll.split_mode, ll.ctx_size, ll.flash_attn) == ("tensor", 262144, "on")
    assert ll.spec is not None and (ll.spec.type, ll.spec.draft_n_max) == ("draft-mtp", 3)
    assert dict(ll.env)["GGML_CUDA_ALLREDUCE"] == "internal"
    assert cfg.serve.port == 8082


# ----------------------------------------------------------------------------------------- fuzzing

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                     st.text(max_size=30), st.sampled_from(["", "bundle", "cuda", "cpu", "{venv}/x", "{x}",
                                                            "ftllm", "llamacpp", "tensor", "row", "fp4", "0.0.0.0",
                                                            "/tmp/" + "n" * 300, "/dev/null", "/proc/self/mem",
                                                            "/etc", "."]))
_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.one_of(st.text(max_size=12), st.integers(),
                                                                                   st.booleans(), st.none()),
                                                                         inner, max_size=4)), max_leaves=12)


def _paths(d: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(d, dict):
        for k, v in d.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def mutated_examples(draw: st.DrawFn) -> Any:
    """An embedded example with 1-3 random edits: a value replaced, a key deleted, or a key added."""
    data = copy.deepcopy(draw(st.sampled_from([_EX["two-2080ti"], _EX["cpu-demo"]])))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(data)
        path = draw(st.sampled_from(paths))
        op = draw(st.sampled_from(["replace", "delete", "add", "tweak", "tweak", "tweak"]))
        if not path:
            if op == "replace":
                data = draw(_values)
            continue
        parent = data
        for k in path[:-1]:
            parent = parent[k]
        last = path[-1]
        if op == "replace":
            parent[last] = draw(_values)
        elif op == "tweak":  # same type, new value: keeps more configs valid, so checks and render run too
            old = parent[last]
            parent[last] = draw(st.booleans() if isinstance(old, bool) else st.integers(-3, 2**40)
                                if isinstance(old, int) else st.floats(-2, 2) if isinstance(old, float)
                                else st.text(max_size=40) if isinstance(old, str) else st.just(old))
        elif op == "delete" and isinstance(parent, dict):
            del parent[last]
        elif op == "add" and isinstance(parent, dict):
            parent[draw(st.one_of(st.text(max_size=12), st.integers()))] = draw(_values)
        if not isinstance(data, dict | list):
            break
    return data


_EX = {name: example_dict(name) for name in config.EXAMPLES}


def _exercise(raw: Any) -> None:
    """Load, check (no files) and render: anything but a DeployError is a bug."""
    try:
        cfg = config.from_dict(raw, source_path="/nonexistent/deploytool.yaml")
        checks.run_checks(cfg, inspect_files=False, on_box=False)
        checks.run_checks(cfg, inspect_files=True, on_box=True)  # fuzzed paths reach the file system too
        render.render_all(cfg)
    except (ConfigError, InputError):
        pass
    except DeployError as exc:  # render may reject an argument systemd cannot carry
        assert isinstance(exc, ConfigError | InputError), exc


@pytest.mark.slow  # 300 examples, 5 s of CPU: make test runs it, make check does not (bench/RESULTS.md)
@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_examples())
def test_fuzz_mutated_examples(raw: Any) -> None:
    """Any mutation of the examples: a Config or a ConfigError/InputError, never another exception."""
    _exercise(raw)


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(max_size=300),
                 st.lists(st.sampled_from(["version: 1\n", "backends:\n", "  a:\n", "    kind: ftllm\n",
                                           "    model: /m\n", "default_backend: a\n", "- x\n", "  - [\n", "{", "}",
                                           ": ", "&a ", "*a\n", "!!python/object:os.system ''\n", "? ", "\t",
                                           "'", '"', "%YAML 1.1\n", "---\n", "...\n", "\x00", "\ufeff"]),
                          max_size=25).map("".join)))
def test_fuzz_yaml_text(text: str) -> None:
    """Any YAML-ish text: parse_yaml + from_dict give a Config or a ConfigError, never another exception."""
    try:
        raw = yamlread.read(text)
    except ConfigError:
        return
    _exercise(raw)


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(raw=mutated_examples())
def test_fuzz_cli_never_traceback(raw: Any, tmp_path: Path) -> None:
    """Through the real CLI, a mutated config exits 0, 3, 4 or 5 with no traceback and no internal error."""
    p = tmp_path / "fuzz.yaml"
    try:
        p.write_text(yaml.safe_dump(raw, allow_unicode=True))
    except (yaml.YAMLError, ValueError):
        return
    r = CliRunner().invoke(main, ["--config", str(p), "check", "--no-files"])
    assert r.exit_code in (0, 3, 4, 5), r.output
    assert "Traceback" not in r.output and "internal error" not in r.output
    if r.exit_code in (3, 5):
        assert r.stderr.startswith("error: ") and len(r.stderr.splitlines()) <= 2


def test_fuzz_helpers_cover_examples() -> None:
    """The mutation strategy reaches deep keys (so the fuzzing really explores the schema)."""
    paths = _paths(_EX["two-2080ti"])
    assert ("backends", "ftllm-dflash", "speculative", "num_draft_tokens") in paths
    assert not math.isnan(len(paths)) and len(paths) > 60


def test_the_root_help_names_every_exit_code_and_no_other() -> None:
    """The root --help's one list of exit codes (the README links to it through docs/reference/cli.md, which is
    generated from it) names each code of ExitCode, and no other."""
    import re

    from click.testing import CliRunner

    from deploy_tool.cli import main as cli

    text = CliRunner().invoke(cli, ["--help"], terminal_width=200).output
    para = text[text.index("Exit codes: 0 ok"):]
    para = para[:para.index("\n\n")] if "\n\n" in para else para
    named = {int(n) for n in re.findall(r"(?<![\w.-])(\d+) [A-Za-z`]", para)}
    assert named == {int(c) for c in ExitCode}, sorted(named ^ {int(c) for c in ExitCode})


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_examples())
def test_a_bundles_config_json_reads_back_as_the_same_config(raw: Any) -> None:
    """Property: every config that loads, written as a bundle's config.json and read back (what the pins of an
    installed release are taken by), is the same Config, field for field, and writes the same bytes again."""
    from deploy_tool.render import resolved_config_json

    try:
        cfg = config.from_dict(raw, source_path="/nonexistent/deploytool.yaml")
    except DeployError:
        return
    back = config.from_resolved(json.loads(resolved_config_json(cfg)), source_path=cfg.source_path)
    assert back == cfg
    assert resolved_config_json(back) == resolved_config_json(cfg)


@pytest.mark.parametrize("doc", [None, [], {"backends": []}, {"version": 1, "backends": {"x": {"kind": "ftllm"}}},
                                 {"serve": "x"}])
def test_a_config_json_of_another_shape_is_a_value_error(doc: Any) -> None:
    with pytest.raises(ValueError):
        config.from_resolved(doc)
