"""Property tests: no config value can become a directive.

Random configs (any string field that reaches a unit or env file, any character: control characters, quotes,
backslashes, `%`, `$`, spaces, unicode, lone surrogates) are either refused at load with exit 3 and the key
path named, or rendered; and a rendered unit parses back with systemd's own parser to exactly the intended
directives:
  * `systemd-analyze verify` exits 0 with EMPTY stderr (every Exec* binary exists: stubs are created);
  * the unit, split into lines as systemd splits them (at LF and at CR), has exactly the template's
    directives: the same keys, one ExecStartPre= and one ExecStart=;
  * each Exec* line read back (systemd's word splitting, quoting, C escapes, specifiers, `$$`) is exactly
    the intended argv, and the env file read back is exactly the intended environment;
  * for a bounded sample, a real sandboxed systemd loads the rendered unit (a drop-in makes it a oneshot as
    root without PrivateTmp, nothing else changed) and runs it: the programs print the argv and environment
    they got, which must be exactly the intended ones.
DEPLOYTOOL_FUZZ_EXAMPLES=N runs N examples of the offline property instead of the default 150.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from deploy_tool import config, render
from deploy_tool.errors import ConfigError, DeployError
from deploy_tool.textsafe import unsafe_char
from tests.support.configs import example_dict, set_key
from tests.support.examples import examples

REPO = Path(__file__).resolve().parents[1]
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
FUZZ_EXAMPLES = int(os.environ.get("DEPLOYTOOL_FUZZ_EXAMPLES", "150"))
TEMPLATE_KEYS = re.findall(r"(?m)^([A-Za-z]+)=", (REPO / "templates" / "backend.service.j2").read_text())

# Characters that break naive quoting, weighted in beside any code point at all (surrogates included).
NASTY = list("\n\r\t\x00\x0b\x0c\x1b\x7f\x85\x9b\u2028\u2029\u202e\ufeff\ufffe\U0010ffff"
             " %$\\\"'`;#=-{}[]:@+!&|<>*?~é✓日🚀") + ["%n", "$HOME", "${PATH}", "\\n", "\\", "$$", "%%"]
ANY_CHAR = st.one_of(st.sampled_from(NASTY), st.characters(blacklist_categories=()))
TEXT = st.lists(ANY_CHAR, max_size=16).map("".join)
# printable text only: what an operator may legitimately write (still quotes, %, $, backslashes, unicode)
SAFE_CHAR = st.one_of(st.sampled_from([c for c in NASTY if len(c) == 1 and unsafe_char(c) is None]),
                      st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp", "Cf", "Co", "Cn")))
SAFE_TEXT = st.lists(SAFE_CHAR, max_size=16).map("".join)
ENV_NAME = st.one_of(st.from_regex(r"\A[A-Z_][A-Z0-9_]{0,8}\Z"), TEXT)

F, L = "ftllm-dflash", "llamacpp-tensor"


def _fields(text: st.SearchStrategy[str]) -> dict[str, st.SearchStrategy[Any]]:
    """Key path -> strategy, for every string the templates can reach. Path fields are relative (resolved
    under the example's directory) or placeholder-based, so the stubs they name stay inside the test dir."""
    return {
        "serve.host": st.one_of(text, st.sampled_from(["127.0.0.1", "::1", "localhost", "a.b-c.example"])),
        "serve.model_name": text,
        "serve.user": st.one_of(text, st.sampled_from(["root", "dynamic", "nobody", "svc_1", "a-b"])),
        "serve.api_key_file": text,
        "paths.root": text.map(lambda t: "root-" + t),
        "paths.env_dir": text.map(lambda t: "env-" + t),
        "paths.config": text.map(lambda t: "cfg-" + t),
        # the failover unit's ReadWritePaths= holds its directory where it is not inside the state dir
        "paths.metrics_file": st.one_of(text.map(lambda t: "prom-" + t + "/m.prom"), text.map(lambda t: "m-" + t)),
        "paths.deploytool": st.one_of(text.map(lambda t: "{current}/" + t), text.map(lambda t: "dt-" + t)),
        "host.gpus": st.lists(st.integers(-2, 1100), max_size=3),
        f"backends.{F}.device": st.sampled_from(["cpu", "cuda"]),
        f"backends.{F}.description": text,
        f"backends.{F}.model": text,
        f"backends.{F}.extra_args": st.lists(text, max_size=4),
        f"backends.{F}.env": st.dictionaries(ENV_NAME, text, max_size=3),
        f"backends.{F}.executable": st.one_of(text.map(lambda t: "{venv}/" + t), text.map(lambda t: "ft-" + t)),
        f"backends.{F}.speculative": st.builds(lambda d: {"algorithm": "dflash", "draft_model": d}, text),
        f"backends.{L}.description": text,
        f"backends.{L}.model": text,
        f"backends.{L}.mmproj": text,
        f"backends.{L}.binary": text.map(lambda t: "ls-" + t),
        f"backends.{L}.spec": st.builds(lambda t: {"type": t, "draft_n_max": 3}, text),
        f"backends.{L}.extra_args": st.lists(text, max_size=4),
        f"backends.{L}.env": st.dictionaries(ENV_NAME, text, max_size=3),
    }


# each value any text (one time in four) or printable text, so that both refusals and renders are common
CHANGES = st.fixed_dictionaries({}, optional=_fields(  # type: ignore[arg-type]
    st.one_of(TEXT, SAFE_TEXT, SAFE_TEXT, SAFE_TEXT)))
SAFE_ENV = st.dictionaries(st.from_regex(r"\A[A-Z_][A-Z0-9_]{0,8}\Z"), SAFE_TEXT, max_size=3)
SAFE_CHANGES = st.fixed_dictionaries({}, optional={  # type: ignore[arg-type]
    **{k: _fields(SAFE_TEXT)[k] for k in ("serve.model_name", "paths.root", "paths.env_dir", "paths.config",
                                          f"backends.{F}.model", f"backends.{F}.extra_args",
                                          f"backends.{L}.mmproj", f"backends.{L}.extra_args")},
    f"backends.{F}.env": SAFE_ENV, f"backends.{L}.env": SAFE_ENV})


def _data(changes: dict[str, Any], names: tuple[str, str] = (F, L)) -> dict[str, Any]:
    data = example_dict("cpu-demo")
    data.pop("systemd", None)
    for k, v in changes.items():
        set_key(data, k, v)
    if names != (F, L):
        data["backends"] = {names[0]: data["backends"][F], names[1]: data["backends"][L]}
        data["default_backend"] = names[0]
    return data


def _key_ok(msg: str, changes: dict[str, Any], dirname_fuzzed: bool) -> bool:
    """The message names (one of) the fuzzed key paths, or any key when the config's own directory carries
    the bad character (every path resolved from it then carries it too)."""
    head = msg.split(": ", 1)[0]
    if "paths.root" in changes:  # the programs' paths are made of it ({current}, {venv})
        changes = {**changes, "paths.deploytool": 1, f"backends.{F}.executable": 1, f"backends.{L}.binary": 1}
    if dirname_fuzzed:
        return bool(re.match(r"^(the config file's own path|[a-z_]+(\.[A-Za-z0-9_-]+)*(\[\d+\])?)", head))
    return any(head == k or head.startswith((k + "[", k + ".", k + " key ")) for k in changes)


# --------------------------------------------------------------------------------- reading back like systemd


def _systemd_lines(unit: str) -> list[str]:
    """The unit's lines as systemd's read_line() ends them: at LF, at CR, at CR LF."""
    return re.split(r"\r\n|\r|\n", unit)


def _directives(unit: str) -> list[tuple[str, str]]:
    out = []
    for ln in _systemd_lines(unit):
        s = ln.strip(" \t")
        if not s or s.startswith(("#", ";", "[")):
            continue
        k, sep, v = s.partition("=")
        assert sep, f"a line that is not a directive: {ln!r}"
        out.append((k.strip(), v.strip(" \t")))
    return out


_C_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v", "\\": "\\", '"': '"',
              "'": "'", "s": " "}


def _exec_words(value: str) -> list[str]:
    """ExecStart= value -> words, by systemd.service(5) "Command lines" (extract_first_word with UNQUOTE and
    CUNESCAPE): words split at white space, "..." and '...' quote, backslash escapes C-style."""
    words, i, n = [], 0, len(value)
    while True:
        while i < n and value[i] in " \t":
            i += 1
        if i >= n:
            return words
        w, quote = [], None
        while i < n:
            c = value[i]
            if quote is None and c in " \t":
                break
            if c == "\\":
                assert i + 1 < n, f"a trailing backslash in {value!r}"
                e = value[i + 1]
                assert e in _C_ESCAPES, f"an escape this test does not model: \\{e} in {value!r}"
                w.append(_C_ESCAPES[e])
                i += 2
                continue
            if quote is None and c in "\"'":
                quote = c
            elif c == quote:
                quote = None
            else:
                w.append(c)
            i += 1
        assert quote is None, f"an unterminated quote in {value!r}"
        words.append("".join(w))


def _resolve_word(w: str) -> str | render.Credential:
    """Specifiers (`%%` -> `%`, a whole word `%d/NAME` -> the unit's credential NAME; any other specifier is a
    test failure) and, at exec, variables (`$$` -> `$`; anything else with `$` is a test failure)."""
    m = re.fullmatch(r"%d/([a-z][a-z0-9-]*)", w)
    if m:
        return render.Credential(m.group(1))
    assert re.fullmatch(r"([^%]|%%)*", w), f"an unescaped specifier in {w!r}"
    w = w.replace("%%", "%")
    assert re.fullmatch(r"([^$]|\$\$)*", w), f"an unescaped variable in {w!r}"
    return w.replace("$$", "$")


def _exec_argv(value: str) -> tuple[str, list[str | render.Credential]]:
    """(prefix characters, argv) of an Exec*= value."""
    m = re.match(r"^([-+@:!]*)(.*)$", value)
    assert m
    return m.group(1), [_resolve_word(w) for w in _exec_words(m.group(2))]


def _env_file(text: str) -> dict[str, str]:
    """EnvironmentFile= lines NAME="value": a backslash before one of \" \\ ` $ gives that character."""
    out: dict[str, str] = {}
    for line in _systemd_lines(text):
        if not line or line.startswith(("#", ";")):
            continue
        m = re.fullmatch(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\["\\`$])*)"', line)
        assert m, f"not a NAME=\"value\" line: {line!r}"
        out[m.group(1)] = re.sub(r'\\(["\\`$])', r"\1", m.group(2))
    return out


# --------------------------------------------------------------------------------- the property


def _stub(path: str, root: Path, body: str = "#!/bin/sh\nexit 0\n") -> None:
    p = Path(path)
    assert p.is_relative_to(root), f"{path} is outside the test directory"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(body)
    p.chmod(0o755)


def _analyze(units: list[Path]) -> subprocess.CompletedProcess[str]:
    assert SYSTEMD_ANALYZE, "systemd-analyze is required (apt-get install systemd)"
    env = dict(os.environ, SYSTEMD_LOG_COLOR="0", SYSTEMD_PAGER="")
    return subprocess.run([SYSTEMD_ANALYZE, "verify", "--man=no", *map(str, units)], capture_output=True,
                          text=True, timeout=30, env=env)


def _load(data: dict[str, Any], root: Path, dirname: str) -> config.Config:
    return config.from_dict(data, source_path=str(root / dirname / "deploytool.yaml"))


def _check_rendered(cfg: config.Config, root: Path, stub: str = "#!/bin/sh\nexit 0\n") -> list[Path]:
    """Write the rendered files, check every unit as systemd reads it; return the unit paths."""
    units = []
    out = root / "units"
    out.mkdir(exist_ok=True)
    by_name = {f.name: f for f in render.render_all(cfg)}
    for name, b in sorted(cfg.backends.items()):
        unit = by_name[f"{name}.service"].content
        argv = {"ExecStartPre": render.verify_argv(cfg, b), "ExecStart": render.launch_argv(cfg, b),
                "ExecStartPost": render.await_ready_argv(cfg, b)}
        for a in argv.values():
            _stub(str(a[0]), root, stub)
        # ExecStart= runs the real env launcher (bundle.python: the machine's /usr/bin/python3), which execs the server
        server = render.server_argv(cfg, b)
        _stub(str(server[0]), root, stub)
        launcher = Path(render.launcher_path(cfg, b))
        launcher.write_bytes(render.launcher_script(cfg, (REPO / "deploy_tool/box/env_launch.py").read_bytes()))

        ds = _directives(unit)
        keys = [k for k, _ in ds]
        assert set(keys) <= set(TEMPLATE_KEYS), f"a directive the template does not have: {keys}"
        modprobe = render.nvidia_modprobe_argvs(cfg, b)  # first: the GPU nodes (cuda backends only)
        assert [k for k in keys if k.startswith("Exec")] == \
            ["ExecStartPre"] * (len(modprobe) + 1) + ["ExecStart", "ExecStartPost"]
        pre = [v for k, v in ds if k == "ExecStartPre"]
        assert [_exec_argv(v) for v in pre[:-1]] == [("-+", a) for a in modprobe]
        for k in ("Description", "Documentation", "Type", "User", "DynamicUser", "TimeoutStartSec"):
            assert keys.count(k) == (0 if (k, cfg.serve.user) in (("User", "dynamic"),) or (
                k == "DynamicUser" and cfg.serve.user != "dynamic") else 1), (k, keys)
        # no EnvironmentFile= or Environment=: the env file reaches the launcher alone, as a credential
        assert keys.count("EnvironmentFile") == 0 and keys.count("Environment") == 0
        creds = [v.replace("%%", "%") for k, v in ds if k == "LoadCredential"]
        assert creds == [f"environment:{cfg.paths.env_dir}/{name}.env",
                         *([f"api-key:{cfg.paths.env_dir}/api-key"] if cfg.serve.api_key_file else [])]
        assert dict(ds)["UnsetEnvironment"].split() == list(render.UNSAFE_ENV)
        vals = dict(ds)
        for k, want in argv.items():
            prefix, got = _exec_argv(vals[k])
            assert prefix == ("" if k == "ExecStart" else "+")
            assert got == want, f"{k}: systemd would run {got!r}, the config meant {want!r}"
        desc = vals["Description"]
        assert desc.replace("%%", "%") == (b.description or f"{b.kind} inference server {name}")
        env_text = by_name[f"{name}.env"].content
        assert _env_file(env_text) == dict(render.backend_env(cfg, b))
        env_path = Path(cfg.paths.env_dir) / f"{name}.env"
        env_path.parent.mkdir(parents=True, exist_ok=True)
        env_path.write_text(env_text)
        (out / f"{name}.service").write_text(unit)
        units.append(out / f"{name}.service")
    assert read_write_paths(by_name[render.FAILOVER_TEMPLATE].content) == failover_writes(cfg)
    assert read_write_paths(by_name[render.LIVENESS_UNIT].content) == [f"-{cfg.paths.state_dir}",
                                                                      f"-{cfg.paths.unit_dir}"]
    return units


def failover_writes(cfg: config.Config) -> list[str]:
    """What the failover unit must be able to write: the state dir, and the metrics file's directory unless the
    state dir holds it (`-`: it may not exist)."""
    m = cfg.paths.metrics_file
    inside = m is None or os.path.dirname(m) == cfg.paths.state_dir or \
        os.path.dirname(m).startswith(cfg.paths.state_dir + "/")
    return [cfg.paths.state_dir, *([] if inside else [f"-{os.path.dirname(m)}"])]


def read_write_paths(unit: str) -> list[str]:
    """The words of a unit's ReadWritePaths= lines as systemd reads them: split at white space, double quotes
    group a word (a backslash or quote in a path is refused before this), then specifiers (%% is %)."""
    return [w.replace("%%", "%") for k, v in _directives(unit) if k == "ReadWritePaths" for w in shlex.split(v)]


@pytest.mark.sandbox
def test_read_write_paths_with_spaces_as_a_real_systemd_reads_them(sandbox_env: Any, tmp_path: Path) -> None:
    """A box whose paths hold a space, a percent sign and non-ASCII: the failover and liveness units' ReadWritePaths=
    as the sandbox's systemd 252 loads them name exactly those directories (unquoted, a space would split one
    path into two, a relative one that systemd drops)."""
    cfg = _load(_data({"paths.metrics_file": "node exporter %/m.prom"}), tmp_path, "c a%b é")
    by_name = {f.name: f for f in render.render_all(cfg)}
    sd = sandbox_env.systemd
    want = {"rwprobe-failover@x.service": [cfg.paths.state_dir, f"-{os.path.dirname(cfg.paths.metrics_file)}"],
            "rwprobe-liveness.service": [f"-{cfg.paths.state_dir}", f"-{cfg.paths.unit_dir}"]}
    assert " " in cfg.paths.state_dir and "%" in cfg.paths.state_dir
    sd.install_file("rwprobe-failover@.service", by_name[render.FAILOVER_TEMPLATE].content.encode())
    sd.install_file("rwprobe-liveness.service", by_name[render.LIVENESS_UNIT].content.encode())
    sd.daemon_reload()
    # systemctl show prints the list with a word that holds a space in double quotes
    got = {u: shlex.split(sd.properties(u, "ReadWritePaths")["ReadWritePaths"]) for u in want}
    assert got == want


def _fuzz_dirname(draw_text: str) -> str:
    return "c" + draw_text.replace("/", "_").replace("\x00", "_")


@pytest.mark.slow  # 6 s of CPU: make test runs it, make check does not (bench/RESULTS.md)
@settings(max_examples=examples(FUZZ_EXAMPLES), deadline=10000, suppress_health_check=[HealthCheck.too_slow])
@given(changes=CHANGES, dirtext=st.one_of(st.just(""), TEXT))
def test_random_config_is_refused_with_its_key_or_renders_to_exactly_the_intended_directives(
        changes: dict[str, Any], dirtext: str) -> None:
    """Any config: a ConfigError (exit 3) whose message names the key and carries no control character, or
    units that `systemd-analyze verify` accepts silently and that read back to exactly the intended argv,
    environment and directives."""
    with tempfile.TemporaryDirectory(prefix="rprop-") as tmp:
        root = Path(tmp)
        dirname = _fuzz_dirname(dirtext)
        try:
            cfg = _load(_data(changes), root, dirname)
        except ConfigError as exc:
            assert exc.exit_code == 3
            assert exc.message.isprintable() and (exc.hint or "").isprintable(), exc.message
            assert _key_ok(exc.message, changes, dirname != "c"), exc.message
            event("refused")
            return
        event("rendered")
        units = _check_rendered(cfg, root)
        r = _analyze(units)
        assert r.stderr == "" and r.returncode == 0, (r.stderr, [u.read_text() for u in units])


@settings(max_examples=examples(40), deadline=10000, suppress_health_check=[HealthCheck.too_slow])
@given(changes=SAFE_CHANGES)
def test_printable_values_in_free_text_fields_are_never_refused(changes: dict[str, Any]) -> None:
    """Quotes, backslashes, `%`, `$`, `;`, spaces and any printable unicode in arguments, env values and paths
    are rendered (not refused), and read back exactly (the refusals above are not the easy way out)."""
    if changes.get("serve.model_name", "x")[:1] in ("", "-"):
        changes["serve.model_name"] = "m" + changes.get("serve.model_name", "")
    for k in ("paths.root", "paths.env_dir", "paths.config"):  # a path cannot end in a space or a backslash
        if k in changes:
            changes[k] = changes[k].rstrip(" \\") + "x"
    with tempfile.TemporaryDirectory(prefix="rprop-") as tmp:
        root = Path(tmp)
        try:
            cfg = _load(_data(changes), root, "c")
        except ConfigError as exc:
            if any(w in exc.message for w in ("..", "normalized", "in a program path", "backslash",
                                              "cannot resolve this path")):
                return  # '..', '//', a '$' in a program path, '~name' for a user this box does not have, made
                #         of the random text: refused by design
            raise
        units = _check_rendered(cfg, root)
        r = _analyze(units)
        assert r.stderr == "" and r.returncode == 0, r.stderr


def test_the_reported_injections_are_refused_at_check_with_the_key(tmp_path: Path) -> None:
    """The issue's cases through the CLI: a newline in a description and a CR in an ExecStart argument each
    exit 3 naming the key; `check` prints no control character."""
    from tests.support.configs import write_dict

    cases = {f"backends.{F}.description": "x\nExecStartPre=+/bin/sh -c id",
             f"backends.{L}.extra_args": ["--x", "a\rExecStartPre=+/bin/id"],
             "serve.user": "root\nExecStartPre=+/bin/id",
             "paths.env_dir": "/etc/x\nExecStartPre=+/bin/id"}
    for key, value in cases.items():
        cfg = write_dict(tmp_path / key.replace(".", "_"), _data({key: value}))
        for args in (["check", "--no-files"], ["--json", "check", "--no-files"], ["render"]):
            r = subprocess.run([str(REPO / ".venv" / "bin" / "deploytool"), "--config", str(cfg), *args],
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 3, (key, args, r.stdout, r.stderr)
            out = r.stdout + r.stderr
            assert key in out and "ExecStartPre" in out  # the value is shown, escaped
            assert all(c.isprintable() or c == "\n" for c in out), out


def test_templates_print_only_escaped_values() -> None:
    """The Jinja finalize hook refuses a plain string: a template cannot print a value that skipped escaping."""
    env = render._env()
    assert env.from_string("{{ x }}").render(x=render.unit_text("a%b", "k")) == "a%%b"
    assert env.from_string("{{ n }}").render(n=5) == "5"
    for bad in ("plain", True, 1.5, None):
        with pytest.raises(TypeError, match="unescaped"):
            env.from_string("X={{ x }}").render(x=bad)


# --------------------------------------------------------------------------------- a real systemd


STUB = """#!/usr/bin/python3
import json, os, sys
creds = {a: open(a, encoding="utf-8").read() for a in sys.argv if a.startswith("/run/credentials/")}
print("RT=" + json.dumps({"argv": sys.argv, "creds": creds, "env": {k: v for k, v in os.environ.items()
      if k.startswith("RT_") or k in ("CUDA_VISIBLE_DEVICES", "LD_PRELOAD", "DEPLOYTOOL_API_KEY", "LLAMA_API_KEY")}}),
      flush=True)
"""
DROP_IN = b"[Service]\nType=oneshot\nUser=\nDynamicUser=no\nPrivateTmp=no\nRestart=no\nProtectHome=no\n"
ENV_RT = st.dictionaries(st.from_regex(r"\ART_[A-Z0-9_]{0,6}\Z"), SAFE_TEXT, max_size=3)


@pytest.mark.sandbox
@settings(max_examples=examples(10), deadline=20000,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(changes=SAFE_CHANGES, env=ENV_RT, args=st.lists(st.one_of(SAFE_TEXT, TEXT), max_size=4),
       api_key=st.one_of(st.none(), SAFE_TEXT.filter(lambda t: bool(t) and t == t.strip())), desc=SAFE_TEXT.map(lambda t: "d " + t + " d"))
def test_real_systemd_runs_the_rendered_units_with_exactly_the_intended_argv_and_env(
        sandbox_env: Any, changes: dict[str, Any], env: dict[str, str], args: list[str], api_key: str | None,
        desc: str) -> None:
    """A bounded sample: the rendered units (with a oneshot/root drop-in) loaded and started by a real
    sandboxed systemd; the programs they start print argv and environment, exactly the intended ones (the
    API key reaches the server as the credential file its argv names, and stands in no argv or environment)."""
    sd = sandbox_env.systemd
    names = ("rtprop-ft", "rtprop-ll")
    changes = {k.replace(F, names[0]).replace(L, names[1]): v for k, v in changes.items()}
    for k in ("paths.root", "paths.env_dir", "paths.config"):
        if k in changes:
            changes[k] = changes[k].rstrip(" \\") + "x"
    if changes.get("serve.model_name", "x")[:1] in ("", "-"):
        changes["serve.model_name"] = "m" + changes.get("serve.model_name", "")
    changes[f"backends.{names[0]}.env"] = env
    changes[f"backends.{names[0]}.description"] = desc
    changes[f"backends.{names[1]}.extra_args"] = args
    if api_key is not None:
        changes["serve.api_key_file"] = "api.key"
    root = Path(tempfile.mkdtemp(prefix="rprop-sd-", dir=sandbox_env.unit_dir.parent))
    try:
        try:
            cfg = _load(_data(changes, names), root, "c")
        except ConfigError as exc:
            assert (unsafe_char("".join(args)) is not None
                    or any(w in exc.message for w in ("..", "normalized", "in a program path", "backslash"))), \
                exc.message
            return
        event("ran in systemd")
        units = _check_rendered(cfg, root, STUB)
        if api_key is not None:
            secrets = render.render_api_key(cfg, api_key)
            (Path(cfg.paths.env_dir) / secrets.name).write_text(secrets.content)
            os.chmod(Path(cfg.paths.env_dir) / secrets.name, secrets.mode)
        for u in units:
            sd.install_file(u.name, u.read_bytes())
            (sandbox_env.unit_dir / f"{u.name}.d").mkdir(exist_ok=True)
            (sandbox_env.unit_dir / f"{u.name}.d" / "zz-rprop.conf").write_bytes(DROP_IN)
        sd.daemon_reload()
        for name in names:
            b = cfg.backends[name]
            cursor = sd.journal_cursor()
            sd.start(f"{name}.service")
            sd.sync_journal()
            deadline = time.monotonic() + 15
            got: list[dict[str, Any]] = []
            while len(got) < 3 and time.monotonic() < deadline:
                log = sd.journal(f"{name}.service", since_cursor=cursor)
                got = [json.loads(ln.split("RT=", 1)[1]) for ln in log.splitlines() if "RT=" in ln]
                time.sleep(0.1) if len(got) < 3 else None
            assert len(got) == 3, log  # ExecStartPre, the server (exec'd by the launcher), ExecStartPost
            want_env = {k: v for k, v in render.backend_env(cfg, b)
                        if k.startswith("RT_") or k in ("CUDA_VISIBLE_DEVICES", "LD_PRELOAD")}
            cred = f"/run/credentials/{name}.service/api-key"
            shown = sandbox_env.run("systemctl", "show", "-p", "Description", "--value", f"{name}.service").stdout
            assert shown.rstrip("\n") == (b.description or f"{b.kind} inference server {name}")
            for rec, argv, env_seen in zip(got, (render.verify_argv(cfg, b), render.server_argv(cfg, b),
                                                 render.await_ready_argv(cfg, b)), ({}, want_env, {}), strict=True):
                assert rec["argv"] == [cred if isinstance(a, render.Credential) else a for a in argv]
                # the root steps see none of the server's environment; the server sees exactly it
                assert rec["env"] == env_seen
                has_cred = any(isinstance(a, render.Credential) for a in argv)
                assert rec["creds"] == ({cred: f"{api_key}\n"} if has_cred else {})
            assert any(isinstance(a, render.Credential) for a in render.server_argv(cfg, b)) == (api_key is not None)
    finally:
        for name in names:
            for p in (sandbox_env.unit_dir / f"{name}.service.d", sandbox_env.unit_dir / f"{name}.service"):
                try:
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
                except FileNotFoundError:
                    pass
                except OSError as exc:  # pragma: no cover - reported, not hidden
                    raise DeployError(f"cannot clean {p}: {exc}") from None
        sd.reset_failed()
        sd.daemon_reload()
        shutil.rmtree(root, ignore_errors=True)
