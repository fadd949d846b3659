"""Every make target the README, docs/ or the Makefile names works, and `deploytool lock` leaves the source tree as it was.

`make -n` of every target (and every script a recipe calls exists); real runs of the cheap ones (help, golden,
clean in a scratch copy, rebuild-check's argument handling). The real `make rebuild-check` of a bundle runs in
tests/test_e2e.py on the e2e demo bundle; `make demo` and `make test` are what CI runs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _make(*args: str, cwd: Path = REPO, env: dict[str, str] | None = None,
          timeout: float = 300) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    e.update(env or {})
    return subprocess.run(["make", "--no-print-directory", *args], cwd=cwd, capture_output=True, text=True,
                          env=e, timeout=timeout)


def _rules() -> dict[str, str]:
    """target -> recipe text, from the Makefile (explicit rules only, not $(VARIABLE) targets)."""
    out: dict[str, str] = {}
    cur = None
    for line in (REPO / "Makefile").read_text().splitlines():
        m = re.match(r"^([a-z][a-z0-9-]*):(?!=)", line)
        if m:
            cur = m.group(1)
            out[cur] = ""
        elif line.startswith("\t") and cur:
            out[cur] += line[1:] + "\n"
        elif line.strip() and not line.startswith("#"):
            cur = None
    return out


def _phony() -> set[str]:
    m = re.search(r"^\.PHONY:(.*)$", (REPO / "Makefile").read_text(), re.M)
    assert m
    return set(m.group(1).split())


def _documents() -> list[Path]:
    """The README and the pages beside it (docs/, bench/RESULTS.md), where commands are named for users."""
    return [REPO / "README.md", REPO / "bench" / "RESULTS.md", *sorted((REPO / "docs").rglob("*.md"))]


def _named_targets(text: str) -> set[str]:
    """`make X` as a command: in a code span or a code block (prose may say "make within ...")."""
    code = re.findall(r"```.*?```", text, re.S) + re.findall(r"`[^`\n]+`", re.sub(r"```.*?```", "", text, flags=re.S))
    return {t for c in code for t in re.findall(r"\bmake ([a-z][a-z0-9-]*)", c)}


def test_every_named_target_has_a_rule_and_is_in_help():
    """Targets named in the README or docs/ (`make X`), in .PHONY and in rules are the same set, and `make help`
    lists each."""
    rules = set(_rules())
    for doc in _documents():
        named = _named_targets(doc.read_text())
        assert named <= rules, f"{doc.relative_to(REPO)} names make targets with no rule: {sorted(named - rules)}"
    assert {"check", "test", "docs", "demo"} <= _named_targets((REPO / "README.md").read_text())
    assert _phony() == rules, (sorted(_phony() ^ rules))
    r = _make("help")
    assert r.returncode == 0, r.stderr
    listed = set(re.findall(r"^make ([a-z][a-z0-9-]*)", r.stdout, re.M))
    assert listed == rules - {"help"}, sorted(listed ^ (rules - {"help"}))


@pytest.mark.parametrize("target", sorted(_rules()))
def test_make_dry_run_of_every_target(target):
    """`make -n TARGET` succeeds, and every script or file a recipe calls exists in the checkout."""
    r = _make("-n", target)
    assert r.returncode == 0, r.stdout + r.stderr
    for word in re.findall(r"(?:bash|sh) (\S+)", _rules()[target]):
        assert (REPO / word).is_file(), f"make {target} calls {word}, which does not exist"
    for word in re.findall(r"\b((?:scripts|bench|tests)/[\w./*-]+)", _rules()[target]):
        assert list(REPO.glob(word)), f"make {target} names {word}, which matches nothing"


def test_make_golden_reproduces_the_committed_units():
    """`make golden` re-renders units/ from the two-2080ti example: byte-identical to what is committed."""
    before = {p.name: p.read_bytes() for p in (REPO / "units").iterdir()}
    r = _make("golden")
    assert r.returncode == 0, r.stdout + r.stderr
    assert {p.name: p.read_bytes() for p in (REPO / "units").iterdir()} == before


def test_make_clean_removes_build_leftovers_only(tmp_path):
    """`make clean` (in a scratch copy of the Makefile) removes build/, dist/, *.egg-info, .pytest_cache and
    nothing else."""
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    for d in ("build/lib/deploy_tool", "dist", "deploytool.egg-info", ".pytest_cache", "deploy_tool", "units"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "f").write_text("x")
    r = _make("clean", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Makefile", "deploy_tool", "units"]


def test_rebuild_check_names_what_is_missing(tmp_path):
    """scripts/rebuild-check.sh without a config or a bundle: one error line and a hint, exit 5, no traceback."""
    r = _make("-s", "rebuild-check", f"CONFIG={tmp_path / 'nope.yaml'}")
    assert "error: config not found:" in r.stderr and "Traceback" not in r.stderr
    assert "Error 5" in r.stderr
    cfg = tmp_path / "deploytool.yaml"
    cfg.write_text("version: 1\n")
    r = _make("-s", "rebuild-check", f"CONFIG={cfg}")
    assert f"error: no bundle in {tmp_path}/artifacts" in r.stderr and "hint: run `deploytool pack`" in r.stderr
    r = _make("-s", "rebuild-check", f"CONFIG={cfg}", f"BUNDLE={tmp_path / 'missing.tar.zst'}")
    assert "error: bundle not found:" in r.stderr and "Error 5" in r.stderr


# ------------------------------------------------------------------------------------ lock and the source tree

_SCRATCH = {".venv", ".cache", ".git", ".pytest_cache", ".hypothesis", ".mypy_cache", ".ruff_cache", "__pycache__"}


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every entry of the checkout (but venv, caches, VCS, bytecode) with its size and mtime; a directory with
    neither: what it gains or loses shows as entries of its own, and its mtime also moves when any process of the
    suite writes a __pycache__ into it (a test's subprocess with a clean environment does)."""
    out = {}
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SCRATCH]
        for n in dirs:
            out[os.path.relpath(os.path.join(top, n), root)] = (0, 0)
        for n in files:
            p = os.path.join(top, n)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_size, st.st_mtime_ns)
    return out


def _git_status(root: Path) -> str:
    if not (root / ".git").exists():
        return ""
    r = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all"], cwd=root,
                       capture_output=True, text=True, timeout=60)
    return "\n".join(ln for ln in r.stdout.splitlines() if not any(s in ln for s in _SCRATCH))


@pytest.mark.slow
def test_lock_leaves_the_source_tree_as_it_was(tmp_path):
    """`deploytool lock` builds deploytool's own wheel from a clean copy of its sources: the checkout gets no build/
    or *.egg-info, nothing in it is rewritten (a build/ left in it would carry deleted modules into the next
    wheel), and the wheel is the one built from the sources."""
    import zipfile

    import yaml

    from deploy_tool.builder.pack import lock_tool
    from deploy_tool.config import load as load_config

    tree0, git0 = _tree(REPO), _git_status(REPO)
    cfgp = tmp_path / "deploytool.yaml"
    r = subprocess.run([sys.executable, "-m", "deploy_tool", "init", "--example", "cpu-demo", "--out",
                        str(cfgp)], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr
    data = yaml.safe_load(cfgp.read_text())
    data["bundle"]["tool_wheels_dir"] = str(tmp_path / "tool-wheels")
    cfgp.write_text(yaml.safe_dump(data, sort_keys=False))
    wheels = lock_tool(load_config(cfgp))
    assert _tree(REPO) == tree0
    assert _git_status(REPO) == git0
    whl = next(w for w in wheels if w.name.startswith("deploytool-"))
    names = set(zipfile.ZipFile(whl).namelist())
    mods = {f"deploy_tool/{p.relative_to(REPO / 'deploy_tool')}" for p in (REPO / "deploy_tool").rglob("*.py")
            if "__pycache__" not in p.parts}
    mods |= {f"deploy_tool/templates/{p.name}" for p in (REPO / "templates").glob("*.py")}  # setup.cfg package_dir
    mods |= {f"deploy_tool/collection/{p.relative_to(REPO / 'ansible')}" for p in (REPO / "ansible").rglob("*.py")
             if "__pycache__" not in p.parts}
    assert mods <= names and not {n for n in names if n.endswith(".py") and n.startswith("deploy_tool/")} - mods
    # the Ansible collection rides in the wheel, so pack can put it into every bundle (pack.collection_files)
    coll = {f"deploy_tool/collection/{p.relative_to(REPO / 'ansible')}" for p in (REPO / "ansible").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and not p.name.startswith(".")}
    assert "deploy_tool/collection/galaxy.yml" in coll and coll <= names, sorted(coll - names)
