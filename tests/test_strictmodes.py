"""StrictModes (deploy_tool/strictmodes.py): the rule over its whole input space, then on a real box tree: every
path class, every owner and mode, found exactly when the rule says so, and fixed by exactly the command it prints.

The box here is a directory tree under pytest's tmp dir (/tmp is 1777 and root's, its pytest-of-root child root's:
the sticky exception is what lets a box live there). The starts systemd refuses are tests/test_trust_e2e.py's.
"""

from __future__ import annotations

import itertools
import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy_tool import checks, config, strictmodes
from deploy_tool.box import bootstrap
from deploy_tool.box import status as status_mod
from deploy_tool.errors import ExitCode, UnsafePathError
from tests.support.configs import DELETE, example_dict, set_key, write_dict
from tests.support.examples import examples

TYPES = (stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK, stat.S_IFIFO)
F, L = "ftllm-dflash", "llamacpp-tensor"


def expected(uid: int, mode: int, role: str, child: int | None) -> set[str]:
    """The rule as the module doc states it, written independently: which problems a path has."""
    out = set()
    if uid != 0:
        out.add("owner")
    link = stat.S_ISLNK(mode)
    writable = bool(mode & 0o022)
    safe_sticky = (role == strictmodes.ABOVE and stat.S_ISDIR(mode) and bool(mode & 0o1000) and uid == 0
                   and child is not None)
    if not link and writable and not safe_sticky:
        out.add("write")
    return out


def kinds(problems: tuple[str, ...] | list[str]) -> set[str]:
    return {"owner" if p.startswith("owned by") else "write" for p in problems}


def test_the_rule_over_every_owner_mode_role_and_child() -> None:
    """Every file type x 4096 permission bits x owner x role x the child's owner: the module's judge gives exactly
    the stated rule, and the bootstrap's stdlib copy gives the very same problems (it checks the keys before
    deploytool exists on the box)."""
    n = 0
    for t, perm, uid, role, child in itertools.product(TYPES, range(0o10000), (0, 1, 1000),
                                                       (strictmodes.PATH, strictmodes.ABOVE), (None, 0, 1000)):
        mode = t | perm
        got = strictmodes.judge(uid, mode, role=role, child_uid=child)
        assert kinds(got) == expected(uid, mode, role, child), (oct(mode), uid, role, child, got)
        assert list(got) == bootstrap.judge(uid, mode, above=role == strictmodes.ABOVE, child_uid=child)
        n += 1
    assert n == 4 * 4096 * 3 * 2 * 3


def test_fix_names_the_commands() -> None:
    assert strictmodes.fixes("/x", ("owned by uid 5, not root", "writable by group")) == \
        "chown root /x && chmod go-w /x"
    assert strictmodes.fixes("/x", ("writable by others",)) == "chmod go-w /x"


def test_drop_in_dirs_are_the_ones_systemd_reads() -> None:
    """systemd.unit(5): the unit's own, the template's, every dash prefix, the type-wide one."""
    assert strictmodes.dropin_dirs("ftllm-dflash.service") == [
        "ftllm-dflash.service.d", "ftllm-.service.d", "service.d"]
    assert strictmodes.dropin_dirs("deploytool-failover@llamacpp-tensor.service") == [
        "deploytool-failover@llamacpp-tensor.service.d", "deploytool-failover@.service.d", "deploytool-.service.d",
        "service.d"]


# ------------------------------------------------------------------------------------------------ a real box tree

def make_box(d: Path) -> config.Config:
    """A box laid out as an install leaves it (root's, 0755/0644), its config among it."""
    etc, units = d / "etc" / "deploytool", d / "etc" / "systemd" / "system"
    data = example_dict("cpu-demo")
    set_key(data, "systemd.sandbox", DELETE)
    set_key(data, "paths.root", str(d / "opt" / "deploytool"))
    set_key(data, "paths.env_dir", str(etc / "env"))
    set_key(data, "paths.keys_dir", str(etc / "keys"))
    set_key(data, "paths.state_dir", str(d / "var" / "lib" / "deploytool"))
    set_key(data, "paths.unit_dir", str(units))
    set_key(data, "paths.config", str(etc / "deploytool.yaml"))
    set_key(data, "paths.metrics_file", None)
    for p in ("models/tiny-f16.gguf", "chat_template.jinja", "requirements.in"):
        (etc / p).parent.mkdir(parents=True, exist_ok=True)
        (etc / p).write_bytes(b"x")
    cfg = config.load(write_dict(etc, data))
    rel = d / "opt" / "deploytool" / "releases" / "r1"
    for f in (units / f"{F}.service", units / f"{L}.service", units / f"{F}.service.d" / "gpu.conf",
              etc / "env" / f"{F}.env", etc / "env" / f"{L}.env", etc / "keys" / "deploytool.pub",
              etc / "keys" / "revoked", d / "var/lib/deploytool/state.json", d / "var/lib/deploytool/pins" / f"{F}.json",
              rel / "units" / "deploytool-failover@.service", rel / "MANIFEST"):
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("x\n")
    os.symlink("releases/r1", d / "opt" / "deploytool" / "current")
    for top, dirs, files in os.walk(d):
        for n in dirs:
            os.chmod(Path(top, n), 0o755)
        for n in files:
            os.chmod(Path(top, n), 0o644)
    os.chmod(d, 0o755)
    return cfg


@pytest.fixture
def box(tmp_path: Path) -> config.Config:
    return make_box(tmp_path / "box")


def test_a_box_laid_down_as_install_does_is_clean(box: config.Config) -> None:
    """Nothing found, and every class of the module doc is among the paths looked at."""
    assert strictmodes.scan(box) == []
    whats = {w for w, _ in strictmodes.box_paths(box)}
    for w in ("config", f"unit file {F}.service", f"drop-in dir of {F}.service", f"drop-in of {F}.service",
              "unit file deploytool-failover@.service", "env dir", "env file", "keys dir", "trusted key",
              "keys dir entry", "state dir", "state", "pins", "current", "release", "releases dir"):
        assert w in whats, w


def _classes(cfg: config.Config) -> list[tuple[str, Path, str]]:
    """(what, path, role) of one path per class, and of directories above them."""
    p = cfg.paths
    units, env = Path(p.unit_dir), Path(p.env_dir)
    state, keys = Path(p.state_dir), Path(p.keys_dir)
    A, P = strictmodes.ABOVE, strictmodes.PATH
    return [("config", Path(p.config), P), ("unit", units / f"{F}.service", P),
            ("drop-in dir", units / f"{F}.service.d", P), ("drop-in", units / f"{F}.service.d" / "gpu.conf", P),
            ("env dir", env, P), ("env file", env / f"{L}.env", P), ("keys dir", keys, P),
            ("key", keys / "deploytool.pub", P), ("revoked", keys / "revoked", P), ("state dir", state, P),
            ("state.json", state / "state.json", P), ("pins dir", state / "pins", P),
            ("pins file", state / "pins" / f"{F}.json", P), ("release", Path(p.releases_dir) / "r1", P),
            ("releases dir", Path(p.releases_dir), P), ("current", Path(p.current), P),
            ("above: install root", Path(p.root), A), ("above: /etc of the box", units.parent.parent, A),
            ("above: the box", units.parent.parent.parent, A)]


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_owner_and_mode_of_any_path_class_is_found_exactly_and_fixed_by_its_command(
        tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    """Property: one path of any class gets any owner (uid, gid) and permission bits (sticky included); scan finds
    exactly that path, with exactly the problems the rule gives, when the rule says so, and nothing otherwise; the
    `fix` it prints, run by a shell, leaves a box scan finds clean."""
    cfg = make_box(tmp_path_factory.mktemp("sm") / "box")
    what, path, role = data.draw(st.sampled_from(_classes(cfg)), label="class")
    uid = data.draw(st.sampled_from([0, 1, 1000, 65534]), label="uid")
    gid = data.draw(st.sampled_from([0, 1000]), label="gid")
    is_link = path.is_symlink()
    perm = 0 if is_link else data.draw(st.integers(0, 0o1777), label="perm") | 0o700  # root still walks it
    os.lchown(path, uid, gid)
    if not is_link:
        os.chmod(path, perm)
    st_ = os.lstat(path)
    found = strictmodes.scan(cfg)
    want = expected(uid, st_.st_mode, role, 0)
    if not want:
        assert found == [], [u.line() for u in found]
        return
    assert [u.path for u in found] == [str(path)], [u.line() for u in found]
    u = found[0]
    assert kinds(u.problems) == want and (u.uid, u.gid, stat.S_IMODE(u.mode)) == (uid, gid, stat.S_IMODE(st_.st_mode))
    assert str(path) in u.line() and f"{stat.S_IMODE(st_.st_mode):04o}" in u.line() and u.fix in u.line()
    r = subprocess.run(["sh", "-c", u.fix.replace(str(path), f"-h '{path}'" if is_link else f"'{path}'")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert strictmodes.scan(cfg) == []


def test_a_sticky_world_writable_parent_is_safe_above_roots_own_entry_only(tmp_path: Path) -> None:
    """/tmp-like (1777, root's) above the box: clean while the box directory in it is root's; a box directory of
    another user is named (its owner: the sticky parent is not what to fix); a path still to be created under a sticky directory
    names the sticky directory (anyone could create it first)."""
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    cfg = make_box(sticky / "box")
    assert strictmodes.scan(cfg) == []
    os.chown(sticky / "box", 1000, 1000)
    found = strictmodes.scan(cfg)
    assert [(u.path, u.problems) for u in found] == [(str(sticky / "box"), ("owned by uid 1000, not root",))]
    os.chown(sticky / "box", 0, 0)
    found = strictmodes.scan(cfg, paths=[("keys dir", str(sticky / "not-yet" / "keys"))])
    assert [(u.path, u.problems) for u in found] == [(str(sticky), ("writable by group and others",))]
    os.chmod(sticky, 0o0777)  # not sticky: anyone may rename the box away
    assert [u.path for u in strictmodes.scan(cfg)] == [str(sticky)]


def test_a_symlink_on_the_way_is_followed_to_where_it_leads(tmp_path: Path) -> None:
    """paths.env_dir through a link into a group-writable directory: the real directory is named; the link itself
    is held to its owner only."""
    cfg = make_box(tmp_path / "box")
    env = Path(cfg.paths.env_dir)
    real = tmp_path / "elsewhere"
    real.mkdir()
    os.rename(env, real / "env")
    os.symlink(real / "env", env)
    os.chmod(real, 0o775)
    found = strictmodes.scan(cfg)
    assert [(u.path, u.problems) for u in found] == [(str(real), ("writable by group",))]
    assert "above the env" in found[0].what
    os.chmod(real, 0o755)
    os.lchown(env, 1000, 0)
    assert [(u.path, u.problems) for u in strictmodes.scan(cfg)] == [(str(env), ("owned by uid 1000, not root",))]


def test_require_refuses_naming_path_owner_mode_and_fix(box: config.Config) -> None:
    env = Path(box.paths.env_dir)
    os.chmod(env, 0o775)
    with pytest.raises(UnsafePathError) as ei:
        strictmodes.require(box, None, "cannot install x")
    e = ei.value
    assert e.exit_code == ExitCode.UNSAFE_PATH == 23
    assert e.message == f"cannot install x: {env} (env dir): owner 0:0, mode 0775, writable by group; fix: chmod go-w {env}"
    assert e.hint is not None and e.hint.startswith(f"chmod go-w {env};")
    assert e.details == [{"path": str(env), "what": "env dir", "uid": 0, "gid": 0, "mode": "0775",
                          "problems": ["writable by group"], "fix": f"chmod go-w {env}"}]


def test_check_lists_them_on_the_box_and_not_on_a_packaging_machine(tmp_path: Path) -> None:
    """With the config's install present (`current`), `check` has one path-not-root-only error per path; a
    checkout with no install of the config (a packaging machine), owned by a user and group-writable, none."""
    cfg = make_box(tmp_path / "box")
    os.chmod(cfg.paths.state_dir, 0o777)
    os.chown(Path(cfg.paths.keys_dir) / "deploytool.pub", 1000, 1000)
    found = [f for f in checks.run_checks(cfg, inspect_files=False) if f.id == "path-not-root-only"]
    assert sorted((f.severity, f.fix) for f in found) == [
        ("error", f"chmod go-w {cfg.paths.state_dir}"), ("error", f"chown root {cfg.paths.keys_dir}/deploytool.pub")]
    os.unlink(cfg.paths.current)
    assert not [f for f in checks.run_checks(cfg, inspect_files=False) if f.id == "path-not-root-only"]
    checkout = tmp_path / "checkout"
    data = example_dict("cpu-demo")
    set_key(data, "systemd.sandbox", DELETE)
    pack_cfg = config.load(write_dict(checkout, data))
    os.chown(checkout, 1000, 1000)
    os.chmod(checkout, 0o777)
    assert not [f for f in checks.run_checks(pack_cfg, inspect_files=False) if f.id == "path-not-root-only"]


def test_status_is_degraded_by_an_unsafe_path(box: config.Config) -> None:
    """status's verdict: an unsafe path is a degraded box (exit 20) whose reason names the path and the fix."""
    drop_in = Path(box.paths.unit_dir) / f"{F}.service.d"
    os.chmod(drop_in, 0o757)
    rep = {"active_backend": F, "units": {F: {"active": "active", "sub": "running", "enabled": "enabled",
                                              "main_pid": 7, "restarts": 0}}, "health": {"ok": True},
           "fingerprints": {}, "unsafe_paths": [u.to_json() for u in strictmodes.scan(box)]}
    code, reasons = status_mod.verdict(json.loads(json.dumps(rep)))
    assert code == ExitCode.DEGRADED
    assert reasons == [f"{drop_in} is not root's alone (writable by others), so no backend may start: "
                       f"chmod go-w {drop_in}"]
    text = status_mod.format_status({**rep, "config": "c", "model_name": "m", "endpoint": "e",
                                     "health": {"ok": True, "detail": "d"}, "previous_backend": None,
                                     "release": "r1", "current": "releases/r1", "events": [],
                                     "verdict": {"exit_code": 20, "state": "degraded", "reasons": reasons}})
    assert f"unsafe    {drop_in} (drop-in dir of {F}.service): owner 0:0, mode 0757" in text


def test_tree_values_are_read_back_with_their_owner() -> None:
    """What pin refuses is read from the pinned values: mode and owner (0:0 when none is written)."""
    P = strictmodes.parse_tree_value
    assert P("file 0644 " + "a" * 64) == (stat.S_IFREG | 0o644, 0, 0)
    assert P("file 0664 1000:5 " + "a" * 64) == (stat.S_IFREG | 0o664, 1000, 5)
    assert P("dir 0755 7:7") == (stat.S_IFDIR | 0o755, 7, 7)
    assert P("link -> x") == (stat.S_IFLNK | 0o777, 0, 0)
    assert P("link 3:4 -> a b") == (stat.S_IFLNK | 0o777, 3, 4)
    assert P("missing") is None
    bad = strictmodes.tree_problems({".": "dir 0755", "a": "file 0666 " + "a" * 64, "b": "link 9:0 -> a"}, "/r")
    assert [(u.path, u.problems) for u in bad] == [("/r/a", ("writable by group and others",)),
                                                  ("/r/b", ("owned by uid 9, not root",))]
