"""A box that cannot run a bundle is refused before anything changes: the packed config against the box's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy_tool import config
from deploy_tool.box import install, packedconfig
from deploy_tool.errors import BundleError
from deploy_tool.render import resolved_config_json
from tests.support.examples import examples

EXAMPLE = Path(__file__).resolve().parents[1] / "deploy_tool" / "examples" / "cpu-demo.yaml"


def _cfg(tmp: Path, edit=None, name: str = "deploytool.yaml") -> config.Config:
    data = yaml.safe_load(EXAMPLE.read_text())
    if edit:
        edit(data)
    p = tmp / name
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return config.load(p)


def _packed(tmp: Path, cfg: config.Config) -> Path:
    p = tmp / "packed.json"
    p.write_bytes(resolved_config_json(cfg))
    return p


def test_same_config_passes(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    install.check_config_matches(cfg, _packed(tmp_path, cfg), "r1")


def _leaves(cfg: config.Config) -> list[str]:
    flat = packedconfig.flatten(json.loads(resolved_config_json(cfg)))
    return sorted(k for k, v in flat.items() if isinstance(v, str) and not any(
        k == p or k.startswith(p + ".") for p in packedconfig.PACK_ONLY_KEYS))


@settings(max_examples=examples(40), deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_box_key_changed_is_named(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    """Property: any string-valued key the box runs by, changed in the packed config, refuses the install with
    exit 6 naming exactly that key (the fields are compared on the resolved config, as pack wrote it)."""
    tmp = tmp_path_factory.mktemp("cmp")
    cfg = _cfg(tmp)
    key = data.draw(st.sampled_from(_leaves(cfg)), label="key")
    packed = json.loads(resolved_config_json(cfg))
    node = packed
    parts = key.split(".")
    for part in parts[:-1]:
        node = node[part]
    node[parts[-1]] = node[parts[-1]] + "-other"
    (tmp / "config.json").write_text(json.dumps(packed))
    with pytest.raises(BundleError) as ei:
        install.check_config_matches(cfg, tmp / "config.json", "r1")
    assert ei.value.exit_code == 6
    assert ei.value.details == {"differences": [key]}
    assert key in ei.value.message and "\n" not in ei.value.message


def test_other_paths_named_and_pack_only_keys_ignored(tmp_path: Path) -> None:
    """A bundle packed for other paths is refused naming paths.root; where pack found its inputs (lock, wheels,
    the template's source) and how systemd is reached may differ."""
    box = _cfg(tmp_path)

    def other(d: dict) -> None:
        d["paths"]["root"] = "/srv/elsewhere"
        d["paths"]["config"] = str(box.source_path)
        d["bundle"]["wheels_dir"] = "/somewhere/wheels"
        d["bundle"]["lock"] = "/somewhere/requirements.lock"
        d["systemd"]["systemctl"] = ["/usr/local/bin/systemctl"]

    packed = _cfg(tmp_path, other, "packed.yaml")
    with pytest.raises(BundleError) as ei:
        install.check_config_matches(box, _packed(tmp_path, packed), "r1")
    assert ei.value.details["differences"] == ["paths.root"], ei.value.details
    assert "bundle.wheels_dir" not in ei.value.details["differences"]
    assert "systemd.systemctl" not in ei.value.details["differences"]
    assert '"/srv/elsewhere"' in ei.value.message

    def pack_only(d: dict) -> None:
        d["paths"]["config"] = str(box.source_path)
        d["bundle"]["wheels_dir"] = "/somewhere/wheels"
        d["systemd"]["systemctl"] = ["/usr/local/bin/systemctl"]

    install.check_config_matches(box, _packed(tmp_path, _cfg(tmp_path, pack_only, "packed.yaml")), "r1")


def test_config_in_another_directory_with_relative_model_paths_is_named(tmp_path: Path) -> None:
    """The same YAML in another directory resolves its relative model paths elsewhere: the units would point at
    models the box does not have there, so the keys are named."""
    box = _cfg(tmp_path)
    (tmp_path / "p").mkdir()
    with pytest.raises(BundleError) as ei:
        install.check_config_matches(box, _packed(tmp_path, _cfg(tmp_path / "p")), "r1")
    assert "backends.ftllm-dflash.model" in ei.value.details["differences"]


def test_unreadable_packed_config_is_a_bundle_error(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(BundleError):
        install.check_config_matches(cfg, tmp_path / "config.json", "r1")


def test_env_pairs_are_compared_key_by_key(tmp_path: Path) -> None:
    """A backend's env (kept as pairs) differing in one variable names exactly that variable."""
    box = _cfg(tmp_path)

    def extra_env(d: dict) -> None:
        d["paths"]["config"] = str(box.source_path)
        b = d["backends"]["ftllm-dflash"]
        b["env"] = {**(b.get("env") or {}), "DEPLOYTOOL_TEST_RELEASE": "b"}

    with pytest.raises(BundleError) as ei:
        install.check_config_matches(box, _packed(tmp_path, _cfg(tmp_path, extra_env, "packed.yaml")), "r1")
    assert ei.value.details == {"differences": ["backends.ftllm-dflash.env.DEPLOYTOOL_TEST_RELEASE"]}
    assert 'backends.ftllm-dflash.env.DEPLOYTOOL_TEST_RELEASE: bundle "b", here (unset)' in ei.value.message


def test_the_metrics_file_is_the_boxs_own(tmp_path: Path) -> None:
    """paths.metrics_file names no file of the bundle: a box may write its metrics elsewhere, and a bundle packed
    before the key existed (no paths.metrics_file in its config.json) still installs."""
    box = _cfg(tmp_path)
    packed = json.loads(resolved_config_json(box))
    packed["paths"]["metrics_file"] = "/var/lib/node_exporter/textfile_collector/deploytool.prom"
    (tmp_path / "other.json").write_text(json.dumps(packed))
    install.check_config_matches(box, tmp_path / "other.json", "r1")
    del packed["paths"]["metrics_file"]
    (tmp_path / "older.json").write_text(json.dumps(packed))
    install.check_config_matches(box, tmp_path / "older.json", "r1")
    packed["paths"]["root"] = "/srv/elsewhere"  # the other paths are still compared
    (tmp_path / "moved.json").write_text(json.dumps(packed))
    with pytest.raises(BundleError):
        install.check_config_matches(box, tmp_path / "moved.json", "r1")



def test_a_long_differing_value_is_shown_by_its_end(tmp_path: Path) -> None:
    """Two model paths that differ only in the file name: the message shows both names, not a cut-off prefix."""
    packed = _cfg(tmp_path, lambda d: d["backends"]["llamacpp-tensor"].update(
        model="models/" + "a-long-directory-name/" * 4 + "tiny-f16.gguf"), "packed.yaml")
    here = _cfg(tmp_path, lambda d: d["backends"]["llamacpp-tensor"].update(
        model="models/" + "a-long-directory-name/" * 4 + "nope.gguf"), "here.yaml")
    with pytest.raises(BundleError) as exc:
        install.check_config_matches(here, _packed(tmp_path, packed), "r1")
    assert 'tiny-f16.gguf"' in exc.value.message and 'nope.gguf"' in exc.value.message, exc.value.message


@given(port=st.integers(1, 65535), internal=st.none() | st.integers(1, 65535),
       name=st.sampled_from(["qwen38-27b-ud", "other-model", "m"]), allow=st.lists(st.sampled_from(
           ["10.0.0.0/8", "192.168.1.7", "any"]), max_size=2, unique=True))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_the_installed_release_serve_section_is_read_back_whole(tmp_path: Path, port: int, internal: int | None,
                                                                 name: str, allow: list[str]) -> None:
    """status asks the backend where the installed release's units serve: its config.json's `serve`, read back as
    the same Serve; None while the box's config says the same (nothing to tell apart), or no release is there."""
    box = _cfg(tmp_path)
    released = _cfg(tmp_path, lambda d: d["serve"].update(port=port, internal_port=internal, model_name=name,
                                                          allow=allow), "packed.yaml")
    cur = Path(box.paths.current)
    if cur.exists() or cur.is_symlink():
        (cur / "config.json").unlink(missing_ok=True)
    assert packedconfig.installed_serve(box) is None  # no release
    cur.mkdir(parents=True, exist_ok=True)
    (cur / "config.json").write_bytes(resolved_config_json(released))
    got = packedconfig.installed_serve(box)
    assert got == (released.serve if released.serve != box.serve else None)
    (cur / "config.json").write_bytes(resolved_config_json(box))
    assert packedconfig.installed_serve(box) is None
