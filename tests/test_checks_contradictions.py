"""Checks that judge what the server will actually be given (extra_args after the rendered flags, a backend's
CUDA_VISIBLE_DEVICES over host.gpus), over the whole input space (hypothesis, bounded per example), and the
real llama-server at its default verbosity for pitfall 16."""

from __future__ import annotations

import dataclasses
import json
import time
import types
import urllib.request
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deploy_tool import checks
from deploy_tool.config import Backend, Config
from deploy_tool.render import launch_argv
from tests.support.configs import example_dict, load_dict, set_key
from tests.support.examples import examples

LL = "llamacpp-tensor"
FT = "ftllm-dflash"
SETTINGS = settings(max_examples=examples(150), deadline=2000)


@pytest.fixture(scope="module")
def cfgs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Config]:
    return {name: load_dict(tmp_path_factory.mktemp(name), example_dict(name)) for name in ("two-2080ti", "cpu-demo")}


def with_backend(cfg: Config, b: Backend) -> Config:
    return dataclasses.replace(cfg, backends=types.MappingProxyType({**cfg.backends, b.name: b}))


def run(check, cfg: Config, b: Backend, *, on_box: bool = True) -> list[checks.Finding]:
    return list(check(checks._Ctx(cfg, False, on_box), b))


# ------------------------------------------------------------------------------------- extra_args override

# options neither server's unit renders (real flags of llama-server / ftllm)
LLAMA_OTHER = ["--metrics", "-lv", "--jinja", "-np", "--parallel", "-b", "--batch-size", "--no-webui", "-dev",
               "--cont-batching", "--slots"]
FTLLM_OTHER = ["--page_size", "--cache_fast", "--temperature", "--top_k", "--dtype", "--atype", "--lora"]
# a value that is itself a rendered flag ('-m --flash-attn') is two overrides, rightly two findings: not drawn
VALUES = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=12).filter(
    lambda v: not v.startswith("-"))


def _groups_rendered(cfg: Config, b: Backend) -> list[tuple[str, ...]]:
    argv = launch_argv(cfg, b)
    return [g for g in checks._flag_groups(b) if any(a in g for a in argv[1:])]


@SETTINGS
@given(example=st.sampled_from(["two-2080ti", "cpu-demo"]), name=st.sampled_from([LL, FT]), data=st.data(),
       value=VALUES, joined=st.booleans(), before=st.lists(st.sampled_from(["--metrics", "--cache_fast"]),
                                                           max_size=2))
def test_any_rendered_flag_repeated_in_extra_args_is_an_error(cfgs, example, name, data, value, joined, before):
    """Any spelling of any flag the unit renders, as `F V` or `F=V` anywhere in extra_args: an error naming it
    and the config key it overrides."""
    cfg = cfgs[example]
    b = cfg.backends[name]
    group = data.draw(st.sampled_from(_groups_rendered(cfg, b)), label="group")
    spelling = data.draw(st.sampled_from([s for s in group if s.startswith("--")] if joined and any(
        s.startswith("--") for s in group) else list(group)), label="spelling")
    args = [*before, f"{spelling}={value}"] if joined and spelling.startswith("--") else [*before, spelling, value]
    b2 = dataclasses.replace(b, extra_args=tuple(args))
    found = run(checks.check_extra_args_override, with_backend(cfg, b2), b2)
    assert len(found) == 1 and found[0].severity == "error", (args, found)
    assert args[len(before)] in found[0].message and "last value" in found[0].message
    key = checks.FLAG_KEYS.get(group[0], group[0])
    assert key in found[0].fix


@SETTINGS
@given(example=st.sampled_from(["two-2080ti", "cpu-demo"]), name=st.sampled_from([LL, FT]),
       flags=st.lists(st.tuples(st.integers(0, 100), VALUES), max_size=4))
def test_flags_the_unit_does_not_render_are_quiet(cfgs, example, name, flags):
    """extra_args with only options the unit does not render (and any values that are not flags): no finding."""
    cfg = cfgs[example]
    b = cfg.backends[name]
    other = FTLLM_OTHER if b.kind == "ftllm" else LLAMA_OTHER
    rendered = {s for g in _groups_rendered(cfg, b) for s in g}
    args: list[str] = []
    for i, v in flags:
        args.append(other[i % len(other)])
        if not v.startswith("-"):
            args.append(v)
    assert not rendered & set(args)
    b2 = dataclasses.replace(b, extra_args=tuple(args))
    assert run(checks.check_extra_args_override, with_backend(cfg, b2), b2) == []


# ------------------------------------------------------------------------------------- devices (pitfall 15)

GPU_IDS = st.lists(st.integers(0, 3), unique=True, max_size=4)


@SETTINGS
@given(host=GPU_IDS, env=st.none() | GPU_IDS, dev=st.none() | st.lists(st.integers(0, 3), unique=True, max_size=3),
       sm_in_args=st.booleans())
def test_tensor_split_fires_exactly_when_one_device_remains(cfgs, host, env, dev, sm_in_args):
    """-sm tensor (typed or in extra_args) on cuda: an error iff llama-server is left with one device, counted
    from --device when given, else a backend's CUDA_VISIBLE_DEVICES, else host.gpus."""
    cfg = dataclasses.replace(cfgs["two-2080ti"], host=dataclasses.replace(cfgs["two-2080ti"].host,
                                                                           gpus=tuple(host)))
    b = cfg.backends[LL]
    env_d = dict(b.env)
    if env is not None:
        env_d["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, env))
    extra = ["-sm", "tensor"] if sm_in_args else []
    if dev is not None:
        extra += ["--device", ",".join(f"CUDA{d}" for d in dev) or "none"]
    b2 = dataclasses.replace(b, env=tuple(sorted(env_d.items())), extra_args=tuple(extra),
                             split_mode=None if sm_in_args else "tensor")
    n = len(dev) if dev is not None else len(env) if env is not None else len(host)
    found = run(checks.check_tensor_one_device, with_backend(cfg, b2), b2)
    assert (len(found) == 1) == (n == 1), (host, env, dev, found)


@SETTINGS
@given(host=GPU_IDS, env=GPU_IDS)
def test_visible_devices_outside_device_allow_are_errors(cfgs, host, env):
    """A backend's CUDA_VISIBLE_DEVICES naming a GPU id not in host.gpus (whose nodes the unit prepares): an error
    naming exactly those; inside host.gpus: no such finding."""
    cfg = dataclasses.replace(cfgs["two-2080ti"], host=dataclasses.replace(cfgs["two-2080ti"].host,
                                                                           gpus=tuple(host)))
    b = cfg.backends[LL]
    b2 = dataclasses.replace(b, env=tuple(sorted({**dict(b.env), "CUDA_VISIBLE_DEVICES": ",".join(map(str, env))}
                                                 .items())))
    found = [f for f in run(checks.check_visible_devices_allowed, with_backend(cfg, b2), b2)
             if f.id == "cuda-devices-not-allowed"]
    denied = [g for g in env if g not in host]
    assert bool(found) == bool(denied)
    if denied:
        assert f"GPU {', '.join(map(str, denied))}" in found[0].message


# ------------------------------------------------------------------------------------- threads, context


@settings(max_examples=examples(40), deadline=2000)
@given(extra=st.integers(-2, 64))
def test_threads_beyond_this_machines_cpus(cfgs, extra):
    """A backend that runs here: a warning iff -t exceeds the CPUs this process may use."""
    cfg = cfgs["cpu-demo"]
    n = checks._cpus()
    b = dataclasses.replace(cfg.backends[FT], threads=max(1, n + extra))
    found = run(checks.check_threads, with_backend(cfg, b), b, on_box=False)
    assert bool(found) == (b.threads > n)
    # a cuda backend checked away from the box: its box's CPUs are unknown here, nothing is said
    cuda = dataclasses.replace(cfgs["two-2080ti"].backends[FT], threads=n + 64)
    assert run(checks.check_threads, cfgs["two-2080ti"], cuda, on_box=False) == []


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Config, Path]:
    from tests.support.tiny_model import write_model

    d = tmp_path_factory.mktemp("ctx")
    (d / "models").mkdir()
    model = write_model(d / "models" / "tiny-f16.gguf", f16=True)
    data = example_dict("cpu-demo")
    return load_dict(d, data), model


@settings(max_examples=examples(40), deadline=2000)
@given(ctx_size=st.integers(1, 1 << 20))
def test_ctx_above_the_gguf_training_context_warns(tiny, ctx_size):
    """-c above the GGUF's <arch>.context_length (2048 for the tiny model): a warning; at or below: nothing."""
    cfg, _model = tiny
    b = dataclasses.replace(cfg.backends[LL], ctx_size=ctx_size)
    found = list(checks.check_ctx_over_training(checks._Ctx(cfg, True, False), b))
    assert bool(found) == (ctx_size > 2048)


# ------------------------------------------------------------------------------------- pitfall 16, real server


def _chat(base: str) -> None:
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                       "temperature": 0}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()


@pytest.mark.backends
def test_real_llama_server_default_verbosity_has_no_buffer_lines(tmp_path: Path) -> None:
    """The real llama-server at its default verbosity logs n_ctx_slot but no 'KV buffer size' line: the capacity
    read-back reports the context it runs at and says 'could not determine' for the buffers, the GPU check is
    'unknown'; with -lv 4 (the check's fix) the buffer lines are there and both are decided."""
    from deploy_tool.box.probe.health import wait_ready
    from deploy_tool.box.runtime import OK, UNKNOWN, capacity_truth, detect_cpu_fallback
    from tests.support import backends
    from tests.support.tiny_model import write_model

    model = write_model(tmp_path / "tiny-f16.gguf", f16=True)
    logs: dict[str, str] = {}
    for label, extra in (("default", []), ("lv4", ["-lv", "4"])):
        with backends.running("llamacpp", model, model_name="tiny", log_dir=tmp_path / label,
                              extra=[*extra, "-c", "1024"]) as srv:
            wait_ready("llamacpp", srv.base_url, "tiny", timeout=90, interval=0.1, unit_state=srv.unit_state,
                       journal_tail=srv.log_text)
            _chat(srv.base_url)
            time.sleep(0.2)
            logs[label] = srv.log_text()
    default, lv4 = logs["default"], logs["lv4"]
    assert "verbosity = 3" in default and "n_ctx_slot = 1024" in default and "KV buffer size" not in default
    cap = capacity_truth("llamacpp", default, 1024)
    assert cap.ceiling_tokens == 1024 and cap.per_card == ()
    assert "per-device KV buffer sizes: could not determine" in cap.message
    assert detect_cpu_fallback("llamacpp", default, "cuda").status == UNKNOWN
    assert "KV buffer size" in lv4
    cap4 = capacity_truth("llamacpp", lv4, 1024)
    assert cap4.status == OK and cap4.per_card and "could not determine" not in cap4.message
    assert detect_cpu_fallback("llamacpp", lv4, "cuda") is not None  # decided: buffers in host memory here
    assert detect_cpu_fallback("llamacpp", lv4, "cuda").status != UNKNOWN


def test_verbosity_check_is_quiet_once_the_unit_raises_it(cfgs):
    """`-lv 4` (any spelling) in extra_args or LLAMA_ARG_LOG_VERBOSITY=4: no pitfall-16 finding; lower: one."""
    cfg = cfgs["two-2080ti"]
    b = cfg.backends[LL]
    assert len(run(checks.check_llama_verbosity, cfg, b)) == 1
    for args, env in ((["-lv", "4"], {}), (["--verbosity", "5"], {}), (["--log-verbosity=4"], {}),
                      ([], {"LLAMA_ARG_LOG_VERBOSITY": "4"})):
        b2 = dataclasses.replace(b, extra_args=tuple(args), env=tuple(sorted({**dict(b.env), **env}.items())))
        assert run(checks.check_llama_verbosity, with_backend(cfg, b2), b2) == [], (args, env)
    b3 = dataclasses.replace(b, extra_args=("-lv", "3"))
    assert len(run(checks.check_llama_verbosity, with_backend(cfg, b3), b3)) == 1


def test_check_cli_refuses_a_config_that_cannot_run(tmp_path: Path) -> None:
    """Through `deploytool check`: -sm tensor on one GPU is refused with exit 4 and the evidence."""
    from click.testing import CliRunner

    from deploy_tool.cli import main

    data = example_dict("two-2080ti")
    set_key(data, "host.gpus", [0])
    set_key(data, "backends.ftllm-dflash.tp", 1)
    cfg_path = tmp_path / "deploytool.yaml"
    import yaml

    cfg_path.write_text(yaml.safe_dump(data))
    r = CliRunner().invoke(main, ["--config", str(cfg_path), "check", "--no-files"])
    assert r.exit_code == 4
    assert "llamacpp-tensor-one-device" in r.output and "unsupported mul_mat split states" in r.output


# ------------------------------------------------------------------------------------- port, draft


def test_port_held_by_a_foreign_process_is_named(cfgs, tmp_path: Path) -> None:
    """On the box, a real listener on serve.port that is not a backend's: an info naming its pid; none
    without a listener, and nothing said away from the box."""
    import os
    import socket

    from tests.support.sandbox import free_port

    port = free_port()
    cfg = dataclasses.replace(cfgs["cpu-demo"], serve=dataclasses.replace(cfgs["cpu-demo"].serve, port=port))
    assert list(checks.check_port_in_use(checks._Ctx(cfg, True, True))) == []
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        found = list(checks.check_port_in_use(checks._Ctx(cfg, True, True)))
        assert len(found) == 1 and f"pid {os.getpid()}" in found[0].message and str(port) in found[0].message
        assert list(checks.check_port_in_use(checks._Ctx(cfg, True, False))) == []


def test_draft_model_without_speculation_warns(cfgs) -> None:
    """A draft model with algorithm 'none' is never passed to ftllm: a warning; with dflash: none."""
    cfg = cfgs["two-2080ti"]
    b = cfg.backends[FT]
    assert b.speculative is not None
    off = dataclasses.replace(b, speculative=dataclasses.replace(b.speculative, algorithm="none"))
    found = run(checks.check_draft_unused, with_backend(cfg, off), off)
    assert len(found) == 1 and "--speculative_algorithm" not in " ".join(map(str, launch_argv(cfg, off)))
    assert run(checks.check_draft_unused, cfg, b) == []


@settings(max_examples=examples(60), deadline=2000)
@given(tokens=st.none() | st.integers(1, 1 << 20), ctx_size=st.none() | st.integers(1, 1 << 20),
       extra_c=st.none() | st.integers(1, 1 << 20))
def test_context_differs_iff_the_servers_are_told_different_contexts(cfgs, tokens, ctx_size, extra_c):
    """An info iff both contexts are known and differ, counting a -c in extra_args as the one that wins."""
    cfg = cfgs["two-2080ti"]
    ft = dataclasses.replace(cfg.backends[FT], tokens=tokens)
    ll = dataclasses.replace(cfg.backends[LL], ctx_size=ctx_size,
                             extra_args=("-c", str(extra_c)) if extra_c is not None else ())
    cfg2 = with_backend(with_backend(cfg, ft), ll)
    eff = extra_c if extra_c is not None else ctx_size
    found = list(checks.check_context_differs(checks._Ctx(cfg2, False, False)))
    assert bool(found) == (tokens is not None and eff is not None and tokens != eff)
