"""The deploytool.fleet collection held to Galaxy's bar: `ansible-test sanity` (scripts/sanity.sh, the pinned
ansible-core of the fleet test bed, every sanity test that runs offline) passes on the collection as
`ansible-galaxy collection build` publishes it; a broken RETURN doc makes it fail (so the pass means something); the
only ignores are the GPLv3-header test, each with its reason; the published tarball carries a README that documents
every playbook and module option, the LICENSE, the repository links, and no dot files or package markers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
COLLECTION = REPO / "ansible"
ANSIBLE_BIN = REPO / ".cache" / "fleet-ansible" / "bin"
SANITY = REPO / "scripts" / "sanity.sh"
SANITY_HOME = REPO / ".cache" / "ansible-test"
IGNORE = COLLECTION / "tests" / "sanity" / "ignore-2.19.txt"


def _need_tools() -> None:
    if not (ANSIBLE_BIN / "ansible-test").is_file() or not (SANITY_HOME / "primed").is_file():
        pytest.fail("ansible-test sanity's tools are missing (.cache/fleet-ansible, .cache/ansible-test): "
                    "run `make setup`")


def _sanity(*args: str, collection: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    if collection is not None:
        env["COLLECTION"] = str(collection)
    return subprocess.run(["bash", str(SANITY), *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=REPO, stdin=subprocess.DEVNULL)


def _ran(out: str) -> set[str]:
    return set(re.findall(r'^Running sanity test "([^"]+)"', out, re.M))


@pytest.mark.slow
def test_ansible_test_sanity_passes_every_test_on_the_published_collection():
    """Every sanity test ansible-test lists runs (none skipped, none installing anything) and none fails."""
    _need_tools()
    listed = _sanity("--list-tests")
    assert listed.returncode == 0, listed.stdout + listed.stderr
    tests = {t for t in listed.stdout.split() if re.fullmatch(r"[a-z0-9-]+", t)}
    assert {"validate-modules", "pylint", "pep8", "yamllint", "import", "compile", "ansible-doc"} <= tests, tests
    r = _sanity()
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-8000:]
    assert _ran(out) == tests, sorted(tests - _ran(out))
    assert not re.search(r"^(ERROR|FATAL)", out, re.M), out[-8000:]
    assert "Skipping" not in out, out[-8000:]
    assert "Installing requirements" not in out, "the sanity venvs were not primed by make setup:\n" + out[-3000:]


@pytest.mark.slow
def test_a_malformed_return_doc_fails_validate_modules(tmp_path):
    """The RETURN doc that once showed `noop or planned.: null` in ansible-doc fails sanity again when put back."""
    _need_tools()
    copy = tmp_path / "fleet"
    shutil.copytree(COLLECTION, copy, ignore=shutil.ignore_patterns("__pycache__"))
    mod = copy / "plugins" / "modules" / "switch.py"
    text = mod.read_text()
    start, end = text.index('RETURN = r"""'), text.index('EXAMPLES = r"""')
    mod.write_text(text[:start] + 'RETURN = r"""\naction: {description: switched, noop or planned., type: str}\n"""\n\n'
                   + text[end:])
    r = _sanity("--test", "validate-modules", collection=copy)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-4000:]
    assert "plugins/modules/switch.py" in out and "RETURN.action.noop or planned." in out, out[-4000:]


def test_the_only_ignores_are_the_gplv3_header_each_with_its_reason():
    """ignore-2.19.txt skips nothing but validate-modules:missing-gplv3-license, one line per module, with why."""
    modules = sorted(p.name for p in (COLLECTION / "plugins" / "modules").glob("*.py"))
    lines = IGNORE.read_text().splitlines()
    got = []
    for line in lines:
        entry, sep, reason = line.partition(" # ")
        path, test = entry.split()
        assert test == "validate-modules:missing-gplv3-license", line
        assert sep and "MIT" in reason, line
        got.append(Path(path).name)
    assert sorted(got) == modules


@pytest.fixture(scope="module")
def tarball(tmp_path_factory) -> Path:
    galaxy = ANSIBLE_BIN / "ansible-galaxy"
    if not galaxy.is_file():
        pytest.fail(f"{galaxy} is missing: run `make setup`")
    out = tmp_path_factory.mktemp("collection")
    r = subprocess.run([str(galaxy), "collection", "build", str(COLLECTION), "--output-path", str(out)],
                       capture_output=True, text=True, timeout=120, cwd=out)
    assert r.returncode == 0, r.stdout + r.stderr
    (t,) = out.glob("deploytool-fleet-*.tar.gz")
    return t


def test_the_tarball_has_no_dot_files_or_package_markers_and_carries_license_and_readme(tarball):
    """What Galaxy gets: LICENSE, README.md, no `.keep` (or any dot file), no bytecode, no __init__.py marker."""
    with tarfile.open(tarball) as tf:
        names = tf.getnames()
        files = json.loads(tf.extractfile("FILES.json").read())  # type: ignore[union-attr]
    assert {"LICENSE", "README.md", "galaxy.yml"} - set(names) == {"galaxy.yml"}  # galaxy.yml becomes MANIFEST.json
    assert not [n for n in names if any(part.startswith(".") for part in n.split("/"))], names
    assert not [n for n in names if n.endswith((".pyc", "__init__.py")) or "__pycache__" in n], names
    assert {f["name"] for f in files["files"]} - {"."} == set(names) - {"MANIFEST.json", "FILES.json"}


def test_galaxy_metadata_names_the_license_and_links():
    """galaxy.yml: MIT (as setup.cfg), the LICENSE file, repository, issues and documentation links."""
    meta = yaml.safe_load((COLLECTION / "galaxy.yml").read_text())
    assert meta["license"] == ["MIT"] and "license = MIT" in (REPO / "setup.cfg").read_text()
    assert "MIT License" in (COLLECTION / "LICENSE").read_text()
    for key in ("repository", "issues", "documentation", "homepage"):
        assert re.fullmatch(r"https://\S+", meta.get(key) or ""), (key, meta.get(key))


def test_the_readme_documents_every_playbook_and_its_module_reference_is_current():
    """ansible/README.md (the page Galaxy shows) has a section per playbook and, generated from the modules' own
    documentation (scripts/collection_readme.py, `make collection-readme`), one per module with all its options."""
    readme = (COLLECTION / "README.md").read_text()
    for pb in sorted((COLLECTION / "playbooks").glob("*.yml")):
        assert f"### deploytool.fleet.{pb.stem} (playbook)\n" in readme, pb.stem
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "collection_readme.py"), "--check"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import collection_readme as gen
    finally:
        sys.path.pop(0)
    docs = gen.module_docs()
    assert sorted(n for n, _, _ in docs) == sorted(p.stem for p in (COLLECTION / "plugins" / "modules").glob("*.py"))
    for name, doc, _ in docs:
        body = readme.split(f"### deploytool.fleet.{name} (module)\n", 1)[1].split("\n### ", 1)[0]
        for opt, spec in doc["options"].items():
            if not str(spec.get("description")).startswith("Internal"):
                assert f"| `{opt}` |" in body, (name, opt)
    assert "record_run" in readme and "`config_content`" in readme and "`api_key`" in readme
