"""Fingerprints (`deploytool verify` / `pin`) on an installed release built from real parts.

The tree (tests/support/release_tree.py) holds a real venv with the real ftllm 0.1.8.2 dist-info and
libfastllm_tools-cpu.so (also copied as libfastllm_tools.so: the 516 MB CUDA library is only benchmarked),
the real llama-server with its libraries, real safetensors shards and tiny GGUF files, and units rendered by
deploytool itself. One mock: the bundled NCCL is a tiny library built by the real nvcc with a real sm_75 (or
sm_80) cubin, because a real NCCL built for sm_75 does not exist on this machine.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from deploy_tool import hashing
from deploy_tool.box import fingerprint as fp
from deploy_tool.box.state import State, Store
from deploy_tool.errors import DriftError, ExitCode, InputError, StateError
from tests.support import release_tree as rt

REPO = Path(__file__).resolve().parents[1]
FT = "ftllm-dflash"
LL = "llamacpp-tensor"


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return rt.build_template(tmp_path_factory.mktemp("fp-template") / "tpl")


@pytest.fixture
def tree(template: Path, tmp_path: Path) -> rt.Tree:
    return rt.instantiate(template, tmp_path / "tree")


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def flip_byte(path: Path, offset: int) -> bytes:
    """Invert one byte in place (same size); return the original content."""
    data = path.read_bytes()
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes([data[offset] ^ 0xFF]))
    return data


def ids(report: fp.VerifyReport) -> list[str]:
    return [r.item.id for r in report.rows]


def rid(tree: rt.Tree, path: Path) -> str:
    """The item id of a release entry (release/<path relative to the release>)."""
    return "release/" + path.relative_to(tree.release).as_posix()


def fval(path: Path) -> str:
    """A regular file's tree value: type, mode and SHA-256."""
    return f"file {path.stat().st_mode & 0o7777:04o} {sha(path)}"


def verify_both(tree: rt.Tree, backend: str) -> fp.VerifyReport:
    """verify with and without the cache; both must agree."""
    a = fp.verify(tree.cfg, backend)
    b = fp.verify(tree.cfg, backend, use_cache=False)
    assert [tuple(r) for r in a.rows] == [tuple(r) for r in b.rows]
    return a


# ------------------------------------------------------------------------------------------- pin, verify ok


def test_pin_then_verify_passes_and_lists_the_ten_fingerprints(tree: rt.Tree) -> None:
    """A fresh pin verifies clean, and the ftllm pins cover the write-up's ten fingerprints with real values."""
    ps = fp.pin(tree.cfg, FT, "first install")
    v = ps.values()
    sp = tree.site_packages
    assert v["ftllm.version"] == "0.1.8.2"
    assert v["python.version"] == f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    t = {i.id: i.value for i in ps.all_items()}
    assert t[rid(tree, sp / "ftllm/libfastllm_tools.so")] == fval(sp / "ftllm/libfastllm_tools.so")
    assert v["unit"] == sha(Path(tree.cfg.paths.unit_dir) / f"{FT}.service")
    assert v["env"] == sha(Path(tree.cfg.paths.env_dir) / f"{FT}.env")
    assert t[rid(tree, tree.release / "templates/chat_template.jinja")] == fval(
        tree.release / "templates/chat_template.jinja")
    assert t[rid(tree, tree.release / "nccl/libnccl.so.2")] == fval(tree.release / "nccl/libnccl.so.2")
    assert v["nccl.arch"].startswith("has sm_75 code (policy exact)")
    assert v["model.config"] == sha(tree.root / "models/ftllm-model/config.json")
    shard = tree.root / "models/ftllm-model/model-00001-of-00002.safetensors"
    assert v["model.weight/model-00001-of-00002.safetensors"] == str(shard.stat().st_size)
    assert v["draft.config"] == sha(tree.root / "models/draft/config.json")
    assert v["draft.weight/model.safetensors"] == str((tree.root / "models/draft/model.safetensors").stat().st_size)
    assert v["python.interpreter"] == os.path.realpath(tree.release / "venv/bin/python")
    assert v["release"] == str(tree.release.resolve())
    # the whole release, entry by entry: every file, symlink and directory os.walk finds, nothing else
    seen = {"release/."}
    for d, dirs, files in os.walk(tree.release):
        for n in dirs + files:
            p = Path(d, n)
            seen.add(rid(tree, p))
            if p.is_symlink():
                assert t[rid(tree, p)] == f"link -> {os.readlink(p)}"
            elif p.is_dir():
                assert t[rid(tree, p)] == f"dir {p.stat().st_mode & 0o7777:04o}"
            else:
                assert t[rid(tree, p)] == fval(p)
    assert {i for i in t if i.startswith("release/")} == seen and len(seen) > 100
    assert t[rid(tree, tree.release / "venv/bin/python")].startswith("link -> ")
    pins = json.loads(fp.pins_path(tree.cfg, FT).read_text())
    assert pins["reason"] == "first install" and pins["release"] == "r1" and pins["backend"] == FT
    r = fp.verify(tree.cfg, FT)
    assert r.ok and r.rows == [] and len(r.items) == len(ps.items)


def test_llamacpp_pins_binary_build_libraries_and_gguf_headers(tree: rt.Tree) -> None:
    """The llama.cpp pins hold the binary's hash, the build it reports, its libraries, GGUF/mmproj size+header."""
    ps = fp.pin(tree.cfg, "llamacpp", "first install")  # an alias resolves
    v = ps.values()
    lb = tree.root / "llama/bin"
    assert v["binary.sha256"] == sha(lb / "llama-server")
    # newer builds print a version before the build ("version: 0.1.0-dev (build 1, commit 7e4c0a9)"), older ones
    # do not ("version: 1 (571d0d5)"); the pinned commit is the one the binary itself prints
    m = re.fullmatch(r"(version \S+, )?build \d+, commit (?P<commit>[0-9a-f]+)", v["binary.build"])
    assert m, v["binary.build"]
    out = subprocess.run([str(lb / "llama-server"), "--version"], capture_output=True, text=True, timeout=30)
    assert m["commit"] in out.stderr + out.stdout
    assert v["binary.lib/libggml-base.so.0"] == sha(lb / "libggml-base.so.0")
    assert v["binary.lib/libllama.so.0"] == sha(lb / "libllama.so.0")
    big = lb / "libggml-vulkan.so.0"  # > 32 MiB
    assert big.stat().st_size >= 32 << 20 and v["binary.lib/libggml-vulkan.so.0"] == sha(big)
    gguf = tree.root / "models/tiny-f16.gguf"
    assert v["model.size"] == str(gguf.stat().st_size)
    assert v["model.header"] == hashlib.sha256(gguf.read_bytes()[: 1 << 20]).hexdigest()
    assert v["mmproj.header"] == sha(tree.root / "models/mmproj.gguf")  # smaller than 1 MiB: the header is all
    assert fp.verify(tree.cfg, LL).ok


# ------------------------------------------------------------------------------------------- drift, item by item


def _edit(path: Path, fn) -> bytes:
    old = path.read_bytes()
    path.write_bytes(fn(old))
    return old


def _metadata(tree: rt.Tree) -> Path:
    return next(tree.site_packages.glob("ftllm-*.dist-info")) / "METADATA"


# (case, item id, mutation returning (path, original bytes), expected(value before), actual(value after))
FT_CASES = {
    "so-byte": (lambda t: [rid(t, t.site_packages / "ftllm/libfastllm_tools.so")],
                lambda t, n=FT: (p := t.site_packages / "ftllm/libfastllm_tools.so", flip_byte(p, 5_000_000))),
    "unit": (lambda t: ["unit"], lambda t, n=FT: (p := Path(t.cfg.paths.unit_dir) / f"{n}.service",
                                _edit(p, lambda b: b.replace(b"RestartSec=10", b"RestartSec=11")))),
    "env": (lambda t: ["env"], lambda t, n=FT: (p := Path(t.cfg.paths.env_dir) / f"{n}.env",
                              _edit(p, lambda b: b.replace(b'FASTLLM_CUDA_GRAPH="0"', b'FASTLLM_CUDA_GRAPH="1"')))),
    "template": (lambda t: [rid(t, t.release / "templates/chat_template.jinja")], lambda t, n=FT: (p := t.release / "templates/chat_template.jinja",
                                        _edit(p, lambda b: b.replace(b"'low'", b"'medium'")))),
    "nccl": (lambda t: [rid(t, t.release / "nccl/libnccl.so.2")], lambda t, n=FT: (p := t.release / "nccl/libnccl.so.2", _edit(p, lambda b: b + b"\0"))),
    "model-config": (lambda t: ["model.config"], lambda t, n=FT: (p := t.root / "models/ftllm-model/config.json",
                                                _edit(p, lambda b: b.replace(b'"num_hidden_layers": 2',
                                                                             b'"num_hidden_layers": 3')))),
    "weight-size": (lambda t: ["model.weight/model-00002-of-00002.safetensors"],
                    lambda t, n=FT: (p := t.root / "models/ftllm-model/model-00002-of-00002.safetensors",
                               _edit(p, lambda b: b[:-2]))),
    "python": (lambda t: ["python.version", rid(t, t.release / "venv/pyvenv.cfg")], lambda t, n=FT: (p := t.release / "venv/pyvenv.cfg",
                                            _edit(p, lambda b: re.sub(rb"(?m)^version = .*$", b"version = 3.11.99",
                                                                      b)))),
    "ftllm-version": (lambda t: ["ftllm.version", rid(t, _metadata(t))], lambda t, n=FT: (p := _metadata(t),
                                                  _edit(p, lambda b: b.replace(b"Version: 0.1.8.2",
                                                                               b"Version: 0.1.8.3")))),
    "draft-config": (lambda t: ["draft.config"], lambda t, n=FT: (p := t.root / "models/draft/config.json",
                                                _edit(p, lambda b: b.replace(b"64", b"65", 1)))),
    "draft-weight": (lambda t: ["draft.weight/model.safetensors"],
                     lambda t, n=FT: (p := t.root / "models/draft/model.safetensors", _edit(p, lambda b: b + b"xx"))),
    "ftllm-python-file": (lambda t: [rid(t, t.site_packages / "ftllm/server.py")], lambda t, n=FT: (p := t.site_packages / "ftllm/server.py",
                                                          _edit(p, lambda b: b + b"# patched\n"))),
    "tokenizer": (lambda t: ["model.file/tokenizer_config.json"],
                  lambda t, n=FT: (p := t.root / "models/ftllm-model/tokenizer_config.json",
                             _edit(p, lambda b: b.replace(b"2048", b"4096")))),
}


@pytest.mark.parametrize("case", sorted(FT_CASES))
def test_ftllm_drift_names_exactly_the_changed_item(tree: rt.Tree, case: str) -> None:
    """Changing one fingerprinted thing fails verify naming only that item, with expected and actual; restoring passes."""
    ids_of, mutate = FT_CASES[case]
    item_ids = ids_of(tree)
    pins = {i.id: i.value for i in fp.pin(tree.cfg, FT, "install").all_items()}
    path, original = mutate(tree)
    after = {i.id: i.value for i in fp.collect(tree.cfg, FT, use_cache=False)}
    r = verify_both(tree, FT)
    assert not r.ok
    assert ids(r) == item_ids
    text = fp.format_report(r)
    for row in r.rows:
        item_id = row.item.id
        assert row.expected == pins[item_id] and row.actual == after[item_id] and row.expected != row.actual
        assert row.item.label in text and fp.short(row.expected) in text and fp.short(row.actual) in text
    err = fp.drift_error(fp.verify(tree.cfg, FT))
    assert isinstance(err, DriftError) and err.exit_code == 7 and r.rows[0].item.label in err.message
    path.write_bytes(original)
    assert fp.verify(tree.cfg, FT).ok
    assert fp.verify(tree.cfg, FT, use_cache=False).ok


def test_changed_python_file_and_upgraded_package_are_named(tree: rt.Tree) -> None:
    """A patched ftllm .py file is named with both hashes; a dependency renamed to another version is named by
    every entry that went (missing) and came (absent at pin time)."""
    fp.pin(tree.cfg, FT, "install")
    server = tree.site_packages / "ftllm/server.py"
    before = fval(server)
    original = _edit(server, lambda b: b.replace(b"import", b"import ", 1))
    r = fp.verify(tree.cfg, FT)
    assert [(d.item.id, d.expected, d.actual) for d in r.rows] == [(rid(tree, server), before, fval(server))]
    server.write_bytes(original)
    dist = next(tree.site_packages.glob("shortuuid-*.dist-info"))
    new = dist.with_name("shortuuid-99.0.dist-info")
    dist.rename(new)
    r = fp.verify(tree.cfg, FT)
    gone = {d.item.id for d in r.rows if d.actual == fp.MISSING}
    came = {d.item.id for d in r.rows if d.expected == fp.ABSENT}
    assert rid(tree, dist) in gone and rid(tree, new) in came and rid(tree, new / "METADATA") in came
    assert len(gone) == len(came) == len(list(new.iterdir())) + 1 and len(r.rows) == 2 * len(gone)


def test_nccl_without_the_required_arch_is_named(tree: rt.Tree) -> None:
    """An NCCL swapped for one without sm_75 code fails on its hash and on the architecture check."""
    fp.pin(tree.cfg, FT, "install")
    nccl = tree.release / "nccl/libnccl.so.2"
    original = nccl.read_bytes()
    shutil.copyfile(tree.root / "build/nccl80/libnccl.so.2", nccl)
    r = verify_both(tree, FT)
    assert ids(r) == ["nccl.arch", rid(tree, nccl)]
    arch = r.rows[0]
    assert arch.expected.startswith("has sm_75 code") and arch.actual == "NO sm_75 code (policy exact); cubins: sm_80"
    nccl.write_bytes(original)
    assert fp.verify(tree.cfg, FT).ok


def test_new_gpu_arch_in_config_fails_only_the_nccl_arch_item(tree: rt.Tree) -> None:
    """Same NCCL, config moved to compute capability 8.0: only the architecture item drifts."""
    fp.pin(tree.cfg, FT, "install")
    data = yaml.safe_load(tree.config_path.read_text())
    data["host"]["compute_capability"] = "8.0"
    tree.config_path.write_text(yaml.safe_dump(data, sort_keys=False))
    tree.reload()
    r = fp.verify(tree.cfg, FT)
    assert ids(r) == ["nccl.arch"]
    assert r.rows[0].actual.startswith("NO sm_80 code (policy exact)")


def test_missing_file_is_a_value(tree: rt.Tree) -> None:
    """A deleted chat template reads 'missing', not a traceback; restoring it passes."""
    fp.pin(tree.cfg, FT, "install")
    tpl = tree.release / "templates/chat_template.jinja"
    data = tpl.read_bytes()
    tpl.unlink()
    r = fp.verify(tree.cfg, FT)
    assert [(d.item.id, d.actual) for d in r.rows] == [(rid(tree, tpl), "missing")]
    tpl.write_bytes(data)
    assert fp.verify(tree.cfg, FT).ok


def test_items_added_or_dropped_by_the_config_are_drift(tree: rt.Tree) -> None:
    """Dropping the bundled NCCL from the config (items no longer fingerprinted) and a new weight file show up."""
    fp.pin(tree.cfg, FT, "install")
    (tree.root / "models/ftllm-model/extra.safetensors").write_bytes(b"\0" * 16)
    data = yaml.safe_load(tree.config_path.read_text())
    del data["backends"][FT]["nccl"]
    tree.config_path.write_text(yaml.safe_dump(data, sort_keys=False))
    tree.reload()
    r = fp.verify(tree.cfg, FT)
    got = {d.item.id: (d.expected, d.actual) for d in r.rows}
    assert got["nccl.arch"][1] == "no longer fingerprinted"
    assert got["model.weight/extra.safetensors"] == ("not pinned", "16")
    assert len(got) == 2


@pytest.mark.parametrize("present", [False, True])
def test_a_config_edited_for_another_file_names_the_edit_as_the_cause(tree: rt.Tree, present: bool) -> None:
    """The box's config edited after the pin to name another model (the next bundle's, not there yet or already
    there): the drift rows carry the pinned file, the report and the switch's preflight name the config edit and
    its fix, not only a missing or changed value; the config put back verifies clean."""
    from deploy_tool.box import switch

    fp.pin(tree.cfg, LL, "install")
    original = tree.config_path.read_text()
    old = tree.root / "models/tiny-f16.gguf"
    new = tree.root / "models/next-model.gguf"
    if present:
        new.write_bytes(old.read_bytes()[:-1] + b"\x01")  # another model: the same size, its last byte other
    data = yaml.safe_load(original)
    data["backends"][LL]["model"] = "models/next-model.gguf"
    tree.config_path.write_text(yaml.safe_dump(data, sort_keys=False))
    tree.reload()
    r = fp.verify(tree.cfg, LL)
    assert not r.ok
    moved = [d for d in r.rows if d.pinned_path is not None]
    assert moved and {d.pinned_path for d in moved} == {str(old)} and {d.item.path for d in moved} == {str(new)}
    assert all(d.to_json()["pinned_path"] == str(old) for d in moved)
    text = fp.format_report(r)
    assert "the config names other files than were pinned" in text and str(old) in text and str(new) in text, text
    with pytest.raises(DriftError) as ei:
        switch.run_preflight(tree.cfg, tree.cfg.backends[LL], run_checks=lambda *a, **k: [])
    assert "edited after the pin" in ei.value.message and "config" in (ei.value.hint or ""), ei.value
    tree.config_path.write_text(original)
    tree.reload()
    assert fp.verify(tree.cfg, LL).ok
    # a file changed in place (the same path as pinned) is plain drift: no config edit named
    flip_byte(old, old.stat().st_size - 1)
    r = fp.verify(tree.cfg, LL)
    assert not r.ok and r.config_moved() is None and all(d.pinned_path is None for d in r.rows)


def test_the_pins_are_of_the_files_the_installed_release_loads_not_the_edited_configs(tree: rt.Tree) -> None:
    """With the release's config.json in place (what its units were rendered from), the box's config edited for the
    next bundle (another model file) is no drift: verify and pin go by the release's config, so a change to the
    model the release loads is caught, and the next model's file is not what is pinned."""
    from deploy_tool.render import resolved_config_json

    (tree.release / "config.json").write_bytes(resolved_config_json(tree.cfg))
    fp.pin(tree.cfg, LL, "install")
    loaded = tree.root / "models/tiny-f16.gguf"
    nxt = tree.root / "models/next-model.gguf"
    nxt.write_bytes(loaded.read_bytes()[:-1] + bytes([loaded.read_bytes()[-1] ^ 1]))
    data = yaml.safe_load(tree.config_path.read_text())
    data["backends"][LL]["model"] = "models/next-model.gguf"
    tree.config_path.write_text(yaml.safe_dump(data, sort_keys=False))
    tree.reload()
    assert fp.verify(tree.cfg, LL).ok  # the units run the release: nothing they load changed
    ps = fp.pin(tree.cfg, LL, "re-pinned after the edit")  # what an operator told to re-pin would do
    paths = {i.path for i in ps.items}
    assert str(loaded) in paths and str(nxt) not in paths
    flip_byte(loaded, loaded.stat().st_size - 1)  # the model the release loads, changed in place
    r = fp.verify(tree.cfg, LL)
    assert not r.ok and {d.item.path for d in r.rows} == {str(loaded)}, r.rows


def test_llamacpp_binary_change_is_named_and_the_changed_binary_is_not_run(tree: rt.Tree) -> None:
    """A flipped byte in llama-server fails its hash; verify does not execute the changed binary for its build."""
    fp.pin(tree.cfg, LL, "install")
    binary = tree.root / "llama/bin/llama-server"
    original = flip_byte(binary, 200)  # inside the ELF program headers: the changed file would not even run
    r = verify_both(tree, LL)
    assert ids(r) == ["binary.sha256", "binary.build"]
    assert r.rows[1].actual == "not checked (the file changed)"
    binary.write_bytes(original)
    assert fp.verify(tree.cfg, LL).ok


@pytest.mark.parametrize("case", ["lib", "model-header", "model-size", "mmproj", "unit", "env"])
def test_llamacpp_drift_names_exactly_the_changed_item(tree: rt.Tree, case: str) -> None:
    """Each llama.cpp analogue (library, GGUF header/size, mmproj, unit, env file) is named when changed."""
    fp.pin(tree.cfg, LL, "install")
    m = tree.root / "models"
    path, expect = {
        "lib": (tree.root / "llama/bin/libggml-base.so.0", ["binary.lib/libggml-base.so.0"]),
        "model-header": (m / "tiny-f16.gguf", ["model.header"]),
        "model-size": (m / "tiny-f16.gguf", ["model.size", "model.header"]),  # < 1 MiB: header covers all
        "mmproj": (m / "mmproj.gguf", ["mmproj.header"]),
        "unit": (Path(tree.cfg.paths.unit_dir) / f"{LL}.service", ["unit"]),
        "env": (Path(tree.cfg.paths.env_dir) / f"{LL}.env", ["env"]),
    }[case]
    if case == "model-size":
        original = _edit(path, lambda b: b + b"\0" * 32)
    else:
        original = flip_byte(path, min(4000, path.stat().st_size - 1))
    r = verify_both(tree, LL)
    assert ids(r) == expect
    path.write_bytes(original)
    assert fp.verify(tree.cfg, LL).ok


def test_llamacpp_build_checked_against_config(tree: rt.Tree) -> None:
    """A config naming another llama.cpp build than the binary reports makes the build item drift."""
    fp.pin(tree.cfg, LL, "install")
    data = yaml.safe_load(tree.config_path.read_text())
    data["backends"][LL]["build"] = "b10064"
    tree.config_path.write_text(yaml.safe_dump(data, sort_keys=False))
    tree.reload()
    r = fp.verify(tree.cfg, LL)
    assert ids(r) == ["binary.build"]
    assert r.rows[0].actual.endswith("; config says b10064")


def test_ftllm_on_a_single_gguf_and_split_gguf_parts(tree: rt.Tree) -> None:
    """An ftllm model given as one GGUF file pins its size and 1 MiB header; a split GGUF pins every part's size."""
    m = tree.root / "models"
    first, second = m / "big-00001-of-00002.gguf", m / "big-00002-of-00002.gguf"
    shutil.copyfile(m / "tiny-f16.gguf", first)
    second.write_bytes(b"GGUF" + b"\0" * 60)
    data = yaml.safe_load(tree.config_path.read_text())
    data["backends"][FT]["model"] = "models/big-00001-of-00002.gguf"
    data["backends"][FT].pop("speculative")
    tree.config_path.write_text(yaml.safe_dump(data, sort_keys=False))
    tree.reload()
    v = fp.pin(tree.cfg, FT, "gguf model").values()
    assert v["model.size"] == str(first.stat().st_size) and v["model.header"] == sha(first)
    assert v["model.split/big-00002-of-00002.gguf"] == "64"
    assert not any(k.startswith(("model.config", "model.weight", "draft.")) for k in v)
    second.write_bytes(b"GGUF" + b"\0" * 61)
    r = fp.verify(tree.cfg, FT)
    assert [(d.item.id, d.expected, d.actual) for d in r.rows] == [("model.split/big-00002-of-00002.gguf", "64", "65")]
    second.unlink()
    assert [(d.item.id, d.actual) for d in fp.verify(tree.cfg, FT).rows] == [
        ("model.split/big-00002-of-00002.gguf", "missing")]


def test_table_shortens_hashes_and_long_values() -> None:
    """The drift table cuts SHA-256 values to 12 hex digits and long paths to their end."""
    h1, h2 = "a" * 64, "b" * 64
    item = fp.Item("unit", "unit file x.service", "/etc/systemd/system/x.service", h2)
    long = fp.Item("python.interpreter", "Python interpreter", None, "/very/long/" + "p" * 80 + "/python3.11")
    r = fp.VerifyReport(ok=False, rows=[fp.Drift(item, h1, h2), fp.Drift(long, "/usr/bin/python3.11", long.value)],
                        backend="x", items=(item, long))
    lines = fp.format_report(r).splitlines()
    assert lines[0].startswith("x: DRIFT in 2 of 2 fingerprints (not pinned)")
    assert lines[2].split() == ["unit", "file", "x.service", "a" * 12, "b" * 12]
    assert lines[3].split()[-1].startswith("...") and lines[3].rstrip().endswith("/python3.11")
    assert all(len(ln) < 120 for ln in lines)


# ------------------------------------------------------------------------------------------- pins file, history


def test_not_pinned_and_damaged_pins_are_distinct_clear_errors(tree: rt.Tree) -> None:
    """No pins: StateError saying 'not pinned' and how to pin; a damaged pins file: another clear StateError."""
    with pytest.raises(StateError) as ei:
        fp.verify(tree.cfg, FT)
    assert "not pinned" in ei.value.message and "deploytool pin" in ei.value.hint
    assert "deploytool install" in ei.value.hint
    fp.pin(tree.cfg, FT, "install")
    p = fp.pins_path(tree.cfg, FT)
    p.write_text('{"format": 1, "items": [{"id": 3}]}')
    with pytest.raises(StateError) as ei2:
        fp.verify(tree.cfg, FT)
    assert "damaged" in ei2.value.message


def test_pin_records_who_why_when_and_what_changed(tree: rt.Tree, monkeypatch: pytest.MonkeyPatch) -> None:
    """pin writes history entries with user, reason, release and the items a re-pin changed."""
    monkeypatch.setenv("SUDO_USER", "alice")
    store = Store(tree.cfg.paths.state_dir)
    fp.pin(tree.cfg, FT, "install", store=store)
    unit = Path(tree.cfg.paths.unit_dir) / f"{FT}.service"
    unit.write_text(unit.read_text() + "# local note\n")
    assert not fp.verify(tree.cfg, FT).ok
    ps = fp.pin(tree.cfg, FT, "documented the unit", store=store)
    assert fp.verify(tree.cfg, FT).ok
    events = [e for e in store.history() if e["event"] == "pin"]
    assert [e["reason"] for e in events] == ["install", "documented the unit"]
    last = events[-1]
    assert last["by"] == "alice" and last["uid"] == os.getuid() and last["release"] == "r1" and last["time"]
    assert [c["id"] for c in last["changed"]] == ["unit"] and "changed_total" not in last
    assert ps.by["user"] == "alice" and ps.reason == "documented the unit"
    # many changes (a new release changes every file): the first few named, all counted, the event stays small
    pyfiles = sorted(tree.site_packages.rglob("*.py"))[: fp.HISTORY_CHANGED + 5]
    for f in pyfiles:
        f.write_bytes(f.read_bytes() + b"# changed\n")
    fp.pin(tree.cfg, FT, "many changes", store=store)
    last = [e for e in store.history() if e["event"] == "pin"][-1]
    assert len(last["changed"]) == fp.HISTORY_CHANGED and last["changed_total"] >= len(pyfiles)
    with pytest.raises(InputError):
        fp.pin(tree.cfg, FT, "   ")


# ------------------------------------------------------------------------------------------- the cache


def _aged_cache(tree: rt.Tree, margin: float = 0.05) -> fp.VerifyReport:
    fp.pin(tree.cfg, FT, "install")
    time.sleep(margin * 2)
    fp.verify(tree.cfg, FT, racy_margin_s=margin)  # values computed now are older than the files by > margin
    r = fp.verify(tree.cfg, FT, racy_margin_s=margin)
    assert r.ok and r.stats.cache_hits == r.stats.files and r.stats.bytes_hashed == 0
    return r


def test_cache_catches_same_size_change_with_restored_mtime(tree: rt.Tree) -> None:
    """A byte changed in place with size and mtime restored is still caught through the cache: ctime moved."""
    r0 = _aged_cache(tree)
    so = tree.site_packages / "ftllm/libfastllm_tools.so"
    st0 = so.stat()
    flip_byte(so, 1234)
    os.utime(so, ns=(st0.st_atime_ns, st0.st_mtime_ns))
    st1 = so.stat()
    assert (st1.st_dev, st1.st_ino, st1.st_size, st1.st_mtime_ns) == (st0.st_dev, st0.st_ino, st0.st_size,
                                                                        st0.st_mtime_ns)
    assert st1.st_ctime_ns != st0.st_ctime_ns
    r = fp.verify(tree.cfg, FT, racy_margin_s=0.05)
    assert ids(r) == [rid(tree, so)]
    assert r.stats.cache_hits == r0.stats.files - 1


def test_cache_ignores_values_computed_right_after_a_change(tree: rt.Tree) -> None:
    """A file rewritten just now is hashed on every verify (racy entries are not trusted) until it ages."""
    _aged_cache(tree)
    so = tree.site_packages / "ftllm/libfastllm_tools.so"
    so.write_bytes(so.read_bytes())  # same content, new ctime
    r1 = fp.verify(tree.cfg, FT, racy_margin_s=5.0)
    r2 = fp.verify(tree.cfg, FT, racy_margin_s=5.0)
    assert r1.ok and r2.ok
    assert r2.stats.hashed >= 1 and r2.stats.bytes_hashed >= so.stat().st_size
    time.sleep(0.3)
    fp.verify(tree.cfg, FT, racy_margin_s=0.1)  # computed now: older than the file by > 0.1 s, stored
    r3 = fp.verify(tree.cfg, FT, racy_margin_s=0.1)
    assert r3.ok and r3.stats.bytes_hashed == 0 and r3.stats.cache_hits == r3.stats.files


@pytest.mark.parametrize("garbage", [b"\x00\xffnot json", b'{"format": 1, "entries": [1, 2]}',
                                     b'{"format": 1, "entries": {"/x": {"key": "k", "values": 5}}}',
                                     b'{"format": 99, "entries": {}}', b""])
def test_corrupt_cache_is_ignored(tree: rt.Tree, garbage: bytes) -> None:
    """A corrupt cache file changes nothing: a clean tree passes, a changed .so is caught, the cache is rewritten."""
    _aged_cache(tree)
    cp = fp.cache_path(tree.cfg, FT)
    cp.write_bytes(garbage)
    assert fp.verify(tree.cfg, FT, racy_margin_s=0.05).ok
    cp.write_bytes(garbage)
    so = tree.site_packages / "ftllm/libfastllm_tools.so"
    flip_byte(so, 99)
    assert ids(fp.verify(tree.cfg, FT, racy_margin_s=0.05)) == [rid(tree, so)]
    assert json.loads(cp.read_bytes())["format"] == hashing.CACHE_FORMAT


def _poison(tree: rt.Tree, mode: int) -> Path:
    """Rewrite both caches so the (unchanged) libfastllm_tools.so maps to a wrong hash: the files cache under
    its real stat key, and the release's snapshot (the fast path of an unchanged tree)."""
    so_id = rid(tree, tree.site_packages / "ftllm/libfastllm_tools.so")
    so = next(i.path for i in fp.collect(tree.cfg, FT) if i.id == so_id)
    assert so is not None and so.startswith(str(tree.release.resolve()))  # the release, its real path
    fc = fp.files_cache_path(tree.cfg, FT)
    d = json.loads(fc.read_bytes())
    d["entries"][so]["values"]["sha256"][0] = "0" * 64
    fc.write_text(json.dumps(d))
    os.chmod(fc, mode)
    cp = fp.cache_path(tree.cfg, FT)
    d = json.loads(cp.read_bytes())
    snap = d["trees"]["release"]
    from deploy_tool.box import treepin

    w = treepin.walk(str(tree.release.resolve()))  # the snapshot's values are in walk order
    i = w.rels.index(so_id[len("release/"):])
    assert snap["values"][i] == fval(Path(so))
    snap["values"][i] = snap["values"][i][:-64] + "0" * 64
    cp.write_text(json.dumps(d))
    os.chmod(cp, mode)
    return cp


def test_cache_is_used_and_no_cache_bypasses_it(tree: rt.Tree) -> None:
    """The cache really answers (a doctored entry shows up) and --no-cache hashes everything instead."""
    _aged_cache(tree)
    _poison(tree, 0o644)
    so_id = rid(tree, tree.site_packages / "ftllm/libfastllm_tools.so")
    assert ids(fp.verify(tree.cfg, FT, racy_margin_s=0.05)) == [so_id]  # through the snapshot
    fp.cache_path(tree.cfg, FT).unlink()
    assert ids(fp.verify(tree.cfg, FT, racy_margin_s=0.05)) == [so_id]  # through the files cache
    assert fp.verify(tree.cfg, FT, use_cache=False).ok


def test_the_gates_hasher_answers_from_verifys_caches(tree: rt.Tree, tmp_path: Path) -> None:
    """The gate's runtime check hashes the libraries a server maps through what verify cached (the doctored entry
    shows it answers, under another name too: a hard link is the file a process maps), and hashes what verify
    never saw."""
    so = tree.site_packages / "ftllm/libfastllm_tools.so"
    link = tmp_path / "mapped-as.so"
    os.link(so, link)  # before the cache is written: a new link moves the file's ctime
    # aged past the margin the gate's hasher trusts (verify's own default): with a smaller one, a value the pin
    # computed that soon after the link (a loaded machine) is kept by verify and refused as racy by the hasher
    _aged_cache(tree, margin=fp.CACHE_RACY_MARGIN_S)
    _poison(tree, 0o644)
    other = tmp_path / "never-pinned.so"
    other.write_bytes(b"\x7fELF not pinned")
    h = fp.cached_hasher(tree.cfg, FT)
    assert h(str(so)) == "0" * 64 and h(str(link)) == "0" * 64
    assert h(str(other)) == sha(other)
    assert fp.cached_hasher(tree.cfg, LL)(str(so)) == sha(so)  # another backend's caches know nothing of it


def test_writable_by_others_cache_is_not_trusted(tree: rt.Tree) -> None:
    """A cache file that group or others may write is ignored (its doctored entry does not count)."""
    _aged_cache(tree)
    _poison(tree, 0o666)
    assert fp.verify(tree.cfg, FT, racy_margin_s=0.05).ok


def test_unwritable_cache_costs_only_speed(tree: rt.Tree) -> None:
    """When the cache cannot be written (its directory is a file), verify is still correct and raises nothing."""
    cache_dir = fp.cache_path(tree.cfg, FT).parent
    shutil.rmtree(cache_dir, ignore_errors=True)
    fp.pin(tree.cfg, FT, "install")
    shutil.rmtree(cache_dir, ignore_errors=True)
    cache_dir.write_text("not a directory")
    assert fp.verify(tree.cfg, FT).ok
    flip_byte(tree.site_packages / "ftllm/libfastllm_tools-cpu.so", 77)
    assert ids(fp.verify(tree.cfg, FT)) == [rid(tree, tree.site_packages / "ftllm/libfastllm_tools-cpu.so")]


# ------------------------------------------------------------------------------------------- the CLI


def cli(tree: rt.Tree, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deploy_tool", "--config", str(tree.config_path), *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, **(env or {})})


def test_cli_verify_exit_codes_and_table(tree: rt.Tree) -> None:
    """deploytool verify: 13 when not pinned, 0 when clean, 7 with a plain item/expected/actual table on drift."""
    r = cli(tree, "verify", FT)
    assert r.returncode == 13, r.stderr
    assert "not pinned" in r.stderr and "deploytool pin" in r.stderr
    p = cli(tree, "pin", "ftllm", "--reason", "first install", env={"SUDO_USER": "bob"})
    assert p.returncode == 0, p.stderr
    assert "pinned" in p.stdout and "first pin" in p.stdout
    ok = cli(tree, "verify", "ftllm")
    assert ok.returncode == 0, ok.stderr
    assert re.match(rf"{FT}: all \d+ fingerprints match \(pinned \S+, release r1\)", ok.stdout)
    so = tree.site_packages / "ftllm/libfastllm_tools.so"
    before = sha(so)
    flip_byte(so, 4321)
    after = sha(so)
    bad = cli(tree, "verify", FT)
    assert bad.returncode == 7, bad.stderr
    assert "\x1b[" not in bad.stdout + bad.stderr  # no colors when not a terminal
    lines = bad.stdout.splitlines()
    assert lines[0].startswith(f"{FT}: DRIFT in 1 of ")
    assert lines[1].split() == ["ITEM", "EXPECTED", "ACTUAL"]
    so_id = rid(tree, so)
    mode = f"{so.stat().st_mode & 0o7777:04o}"
    assert lines[2].split() == [so_id, "file", mode, before[:12], "file", mode, after[:12]]
    assert len(lines) == 3
    assert f"error: ftllm-dflash: 1 fingerprint(s) differ from the pins: {so_id}" in bad.stderr
    assert "deploytool pin ftllm-dflash --reason" in bad.stderr
    js = cli(tree, "verify", FT, "--json", "--no-cache")
    assert js.returncode == 7
    doc = json.loads(js.stdout)
    assert doc["ok"] is False and [d["id"] for d in doc["drift"]] == [so_id]
    assert doc["drift"][0]["expected"] == f"file {mode} {before}" and doc["drift"][0]["actual"] == f"file {mode} {after}"


def test_cli_pin_repins_with_reason_and_reports_changes(tree: rt.Tree) -> None:
    """deploytool pin requires --reason, shows what changed, and afterwards verify passes; --dry-run writes nothing."""
    assert cli(tree, "pin", FT).returncode == 2  # click: missing --reason
    assert cli(tree, "pin", FT, "--reason", "install").returncode == 0
    env_file = Path(tree.cfg.paths.env_dir) / f"{FT}.env"
    env_file.write_text(env_file.read_text() + 'EXTRA="1"\n')
    assert cli(tree, "verify", FT).returncode == 7
    pins_before = fp.pins_path(tree.cfg, FT).read_bytes()
    dry = cli(tree, "--dry-run", "pin", FT, "--reason", "x")
    assert dry.returncode == 0 and "would pin" in dry.stdout and "env file" in dry.stdout
    assert fp.pins_path(tree.cfg, FT).read_bytes() == pins_before
    p = cli(tree, "pin", FT, "--reason", "added EXTRA")
    assert p.returncode == 0, p.stderr
    assert "1 changed" in p.stdout and f"env file {FT}.env" in p.stdout
    assert cli(tree, "verify", FT).returncode == 0
    assert cli(tree, "pin", FT, "--reason", " ").returncode == 5
    assert cli(tree, "verify", "nosuch").returncode == 3


def test_verify_path_imports_no_jinja2_or_cryptography(tree: rt.Tree) -> None:
    """The ExecStartPre path stays light: running verify loads neither jinja2 nor cryptography."""
    fp.pin(tree.cfg, FT, "install")
    code = ("import sys\n"
            "from deploy_tool.cli import main\n"
            "try:\n"
            f"    main(['--config', {str(tree.config_path)!r}, 'verify', 'ftllm'])\n"
            "except SystemExit as e:\n"
            "    code = e.code\n"
            "print('EXIT', code, [m for m in ('jinja2', 'cryptography') if m in sys.modules])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.stdout.strip().splitlines()[-1] == "EXIT 0 []", r.stdout + r.stderr


# ------------------------------------------------------------------------------------------- under real systemd


def _sandbox_tree(template: Path, env, port: int) -> rt.Tree:
    """A tree whose units are installed in the sandbox's unit dir, with unique backend names; the ExecStartPre
    is the rendered one, running this checkout's deploytool.

    Two views of one config: the test pins through deploytool.yaml, which names the sandbox's unit dir as the
    host sees it; the units' ExecStartPre reads inside.yaml, identical but for paths.unit_dir, which inside the
    sandbox is /etc/systemd/system (the host path of the sandbox's unit dir is not the one systemd sees).
    """
    def edit(data: dict) -> None:
        data["paths"]["unit_dir"] = str(env.unit_dir)
        data["paths"]["config"] = "inside.yaml"
        data["paths"]["deploytool"] = str(Path(sys.executable).parent / "deploytool")
        data["serve"]["internal_port"] = port  # the backends' own port, which the unit's server binds
        from tests.support.sandbox import free_port

        data["serve"]["port"] = free_port()  # the front's (not started here)
        data["backends"] = {f"fpt-{k}": v for k, v in data["backends"].items()}
        data["backends"]["fpt-ftllm-dflash"]["aliases"] = ["fpt-ftllm"]
        data["backends"]["fpt-llamacpp-tensor"]["aliases"] = ["fpt-llamacpp"]
        data["default_backend"] = "fpt-ftllm-dflash"
        del data["backends"]["fpt-llamacpp-tensor"]["mmproj"]  # a text GGUF: llama-server would refuse it as mmproj

    # in a run directory the units can see wherever the checkout is (PrivateTmp=yes hides /tmp); the caller
    # removes tree.root.parent
    from tests.support.sandbox import new_run_dir

    dest = new_run_dir("fingerprint") / "tree"
    tree = rt.instantiate(template, dest, edit)
    inside = yaml.safe_load(tree.config_path.read_text())
    inside["paths"]["unit_dir"] = "/etc/systemd/system"
    (dest / "inside.yaml").write_text(yaml.safe_dump(inside, sort_keys=False))
    return tree


def _refused_naming(env, unit: str, label: str) -> str:
    from deploy_tool.errors import SystemdError

    sd = env.systemd
    sd.reset_failed(unit)  # also resets StartLimitBurst's counter
    with pytest.raises(SystemdError) as ei:
        sd.start(unit)
    st = sd.show(unit)
    assert st.active_state != "active"
    log = sd.journal(unit, invocation=st.invocation_id)
    deadline = time.monotonic() + 5
    while label not in log and time.monotonic() < deadline:  # journald takes stream lines in asynchronously
        time.sleep(0.05)
        log = sd.journal(unit, invocation=st.invocation_id)
    assert re.search(r"DRIFT in \d+ of", log) and label in log, log
    assert "status=7" in log or "exit-code" in ei.value.message, log
    sd.stop(unit)  # cancel Restart=on-failure's pending retry (RestartSec=10)
    return log


def _starts(env, unit: str, port: int) -> None:
    from tests.support.sandbox import port_closed, wait_http

    sd = env.systemd
    sd.reset_failed(unit)
    sd.start(unit)
    ok = wait_http(port, timeout=30)
    assert ok and sd.is_active(unit), f"{unit} did not serve on 127.0.0.1:{port}:\n{sd.journal(unit)[-3000:]}"
    sd.stop(unit)
    assert port_closed(port)


SANDBOX_FT_CASES = ("so-byte", "unit", "template", "nccl", "model-config", "weight-size", "python", "ftllm-version")


@pytest.mark.sandbox
def test_systemd_refuses_ftllm_start_naming_each_changed_item(template: Path, sandbox_env) -> None:
    """Real sandboxed systemd: the rendered ExecStartPre refuses the start naming the changed item; restored, it starts.

    No GPU here, so a drop-in (pinned like any local drop-in) replaces ExecStart by a small HTTP server; the
    unit file, ExecStartPre and everything it checks are the real ones.
    """
    from tests.support.sandbox import free_port

    port = free_port()
    tree = _sandbox_tree(template, sandbox_env, port)
    try:
        name = "fpt-ftllm-dflash"
        unit = f"{name}.service"
        dropin = sandbox_env.unit_dir / f"{unit}.d"
        dropin.mkdir()
        (dropin / "stand-in.conf").write_text(
            # the stand-in serves no model: the readiness wait (ExecStartPost=) is not what this test is about
            f"[Service]\nExecStart=\nExecStart=/usr/bin/python3 -m http.server --bind 127.0.0.1 {port}\n"
            "ExecStartPost=\n")
        sandbox_env.systemd.daemon_reload()
        fp.pin(tree.cfg, name, "install")
        _starts(sandbox_env, unit, port)
        for case in SANDBOX_FT_CASES:
            ids_of, mutate = FT_CASES[case]
            label = {i.id: i.label for i in fp.collect(tree.cfg, name)}[ids_of(tree)[-1]]
            path, original = mutate(tree, name)
            if case == "unit":
                sandbox_env.systemd.daemon_reload()
            _refused_naming(sandbox_env, unit, label)
            path.write_bytes(original)
            if case == "unit":
                sandbox_env.systemd.daemon_reload()
            _starts(sandbox_env, unit, port)
    finally:
        shutil.rmtree(tree.root.parent, ignore_errors=True)


@pytest.mark.sandbox
@pytest.mark.backends
def test_systemd_refuses_real_llama_server_start_and_starts_it_when_restored(template: Path, sandbox_env) -> None:
    """Real sandboxed systemd and real llama-server on CPU: a changed library or GGUF refuses the start; restored, it serves."""
    from tests.support.sandbox import free_port

    port = free_port()
    tree = _sandbox_tree(template, sandbox_env, port)
    try:
        name = "fpt-llamacpp-tensor"
        unit = f"{name}.service"
        sandbox_env.systemd.daemon_reload()
        fp.pin(tree.cfg, name, "install")
        _starts(sandbox_env, unit, port)
        labels = {i.id: i.label for i in fp.collect(tree.cfg, name)}
        for target, item_id in ((tree.root / "llama/bin/libggml-base.so.0", "binary.lib/libggml-base.so.0"),
                                (tree.root / "models/tiny-f16.gguf", "model.header")):
            original = flip_byte(target, 4000)
            _refused_naming(sandbox_env, unit, labels[item_id])
            target.write_bytes(original)
            _starts(sandbox_env, unit, port)
    finally:
        shutil.rmtree(tree.root.parent, ignore_errors=True)


# ------------------------------------------------------------------------------------------- the console entry


def entry(tree: rt.Tree, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deploy_tool", *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO)


def test_console_entry_exit_codes_of_verify(tree: rt.Tree) -> None:
    """verify as the units' ExecStartPre runs it (stdout not a terminal): its exit code in every outcome, an error
    on stderr as one line plus a hint; --json and pin on the same entry."""
    cfgp = str(tree.config_path)
    broken = tree.root / "broken.yaml"
    broken.write_text("version: 1\nbackends: [\n")

    def code(*args: str) -> int:
        r = entry(tree, *args)
        assert r.returncode == 0 or r.stderr.startswith("error: "), r
        return r.returncode

    assert code("--config", cfgp, "verify", FT) == 13  # not pinned
    fp.pin(tree.cfg, FT, "install")
    assert code("--config", cfgp, "verify", FT) == 0
    assert code("-c", cfgp, "verify", "ftllm", "--no-cache") == 0
    # --await-port (the units' ExecStartPre): the served port held by a process that is no backend unit, this
    # test itself, fails at once (exit 9) with the holder named
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with contextlib.suppress(OSError):  # if something else has it, it is held all the same
            s.bind((tree.cfg.backend_host, tree.cfg.backend_port))
            s.listen()
        assert code("--config", cfgp, "verify", FT, "--await-port") == 9
        assert code("--config", cfgp, "verify", FT, "--no-cache", "--await-port") == 9
    assert code("--config", cfgp, "verify", FT, "--await-port") in (0, 9)  # 0 unless another program holds it
    js = entry(tree, "--config", cfgp, "verify", FT, "--json")
    assert js.returncode == 0 and json.loads(js.stdout)["ok"] is True
    p = entry(tree, "--config", cfgp, "pin", FT, "--reason", "again")
    assert p.returncode == 0 and "nothing changed since the last pin" in p.stdout
    flip_byte(tree.site_packages / "ftllm/libfastllm_tools.so", 2222)
    assert code(f"--config={cfgp}", "verify", FT) == 7
    assert code("--config", cfgp, "verify", "nosuch") == 3
    assert code("--config", str(broken), "verify", FT) == 3
    assert code("--config", str(tree.root / "absent.yaml"), "verify", FT) == 5


# ------------------------------------------------------------------------------------------------ the front

FRONT_PROGRAM = "launch/front.py"


def _with_front(tree: rt.Tree) -> Path:
    """The release's launch/front.py as pack lays it down, then both backends pinned (as install does)."""
    p = tree.release / FRONT_PROGRAM
    p.write_bytes((REPO / "deploy_tool/box/front.py").read_bytes())
    p.chmod(0o644)
    fp.pin(tree.cfg, FT, "install")
    fp.pin(tree.cfg, LL, "install")
    return p


def _front_changes(p: Path, tree: rt.Tree) -> dict[str, Callable[[], object]]:
    """Every way the front's program can differ from its pin, each a function that makes that change."""
    other = tree.root / "other-front.py"

    def replaced_by_link() -> None:
        other.write_bytes(p.read_bytes())
        p.unlink()
        p.symlink_to(other)

    def replaced_by_dir() -> None:
        p.unlink()
        p.mkdir()

    return {"byte": lambda: flip_byte(p, 100), "appended": lambda: p.write_bytes(p.read_bytes() + b"\n#"),
            "mode": lambda: p.chmod(0o755), "owner": lambda: os.chown(p, 1000, 1000), "removed": p.unlink,
            "link": replaced_by_link, "dir": replaced_by_dir}


@pytest.mark.parametrize("change", ["byte", "appended", "mode", "owner", "removed", "link", "dir"])
def test_the_fronts_program_is_checked_against_the_pinned_release(tree: rt.Tree, change: str) -> None:
    """verify-front passes on the pinned release and names the front's program, alone, for every way it can
    change (content, mode, owner, removal, a symlink or a directory in its place)."""
    p = _with_front(tree)
    r = fp.verify_front(tree.cfg)
    assert r.ok and r.rows == [] and r.backend == fp.FRONT
    _front_changes(p, tree)[change]()
    r = fp.verify_front(tree.cfg)
    assert not r.ok and [d.item.id for d in r.rows] == [f"release/{FRONT_PROGRAM}"], r.rows
    pinned = fp.load_pins(tree.cfg, FT).trees["release"].entries[FRONT_PROGRAM]
    assert r.rows[0].expected == pinned and r.rows[0].actual != pinned
    err = fp.front_drift_error(r)
    assert err.exit_code == ExitCode.DRIFT and FRONT_PROGRAM in err.message and "deploytool pin" in (err.hint or "")


def test_the_front_reads_only_its_program_and_where_current_points(tree: rt.Tree) -> None:
    """A drift elsewhere in the release stops the backends (their verify) but not the front, which holds the clients'
    requests meanwhile; `current` moved to another release is the front's drift too; the active backend's pins are
    the ones used."""
    _with_front(tree)
    lib = tree.site_packages / "ftllm/libfastllm_tools.so"
    flip_byte(lib, 5_000_000)
    assert not fp.verify(tree.cfg, FT).ok
    assert fp.verify_front(tree.cfg).ok
    other = tree.root / "opt/deploytool/releases/other"
    shutil.copytree(tree.release, other, symlinks=True)
    cur = Path(tree.cfg.paths.current)
    cur.unlink()
    cur.symlink_to("releases/other")
    r = fp.verify_front(tree.cfg)
    assert [d.item.id for d in r.rows] == ["release"] and r.rows[0].actual == str(other.resolve())
    Store(tree.cfg.paths.state_dir).save(State(active_backend=LL))
    assert fp.verify_front(tree.cfg).pins.backend == LL  # type: ignore[union-attr]


def test_verify_front_exit_codes(tree: rt.Tree) -> None:
    """As the front's unit runs it: 13 with no backend pinned, 0 on the pinned release, 7 naming the file on drift
    (one error line and a hint on stderr), the same verdict in --json."""
    cfgp = str(tree.config_path)
    r = entry(tree, "--config", cfgp, "verify-front")
    assert r.returncode == 13 and r.stderr.startswith("error: ") and "no backend is pinned" in r.stderr, r
    p = _with_front(tree)
    r = entry(tree, "--config", cfgp, "verify-front")
    assert r.returncode == 0 and "the front: all 2 fingerprints match" in r.stdout, r
    flip_byte(p, 10)
    r = entry(tree, "--config", cfgp, "verify-front")
    assert r.returncode == 7 and FRONT_PROGRAM in r.stdout and r.stderr.startswith("error: the front's program"), r
    js = entry(tree, "--config", cfgp, "--json", "verify-front")
    assert js.returncode == 7 and [d["id"] for d in json.loads(js.stdout)["drift"]] == [f"release/{FRONT_PROGRAM}"]


@pytest.mark.parametrize("backend", [FT, LL])
def test_a_drop_in_anywhere_systemd_reads_one_for_the_unit_is_drift(tree: rt.Tree, backend: str) -> None:
    """systemd applies `a-.service.d/*.conf` (each dash prefix of the unit's name) and `service.d/*.conf` as well
    as the unit's own `NAME.d`: a file added to any of them after the pin is drift, named; removed, it passes."""
    from deploy_tool import strictmodes

    fp.pin(tree.cfg, backend, "install")
    unit = tree.cfg.backends[backend].unit
    dirs = strictmodes.dropin_dirs(unit)
    assert f"{unit}.d" in dirs and "service.d" in dirs and any(d.endswith("-.service.d") for d in dirs)
    for d in dirs:
        p = Path(tree.cfg.paths.unit_dir) / d / "zz-local.conf"
        p.parent.mkdir(exist_ok=True)
        p.write_text("[Service]\nEnvironment=LOCAL=1\n")
        r = fp.verify(tree.cfg, backend, use_cache=False)
        assert not r.ok and [row.item.label for row in r.rows] == [f"unit drop-in {d}/zz-local.conf"], (d, r.rows)
        p.unlink()
        assert fp.verify(tree.cfg, backend, use_cache=False).ok
