"""The README guides and docs/ holds the rest: the generated reference pages are what the code says now, every link
points somewhere, and figures live in bench/RESULTS.md only.

The reference pages (docs/reference/) are written by scripts/docs_reference.py (`make docs`); `--check` is how this
test and CI see a page that is not current. The coverage tests read the code's own tables (the click tree,
ExitCode, the config schema, the checks' catalog) apart from the generator, so a generator that drops something
fails them too.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import click
import pytest

from deploy_tool import checks, config, errors
from deploy_tool.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]
REF = REPO / "docs" / "reference"
GEN = REPO / "scripts" / "docs_reference.py"
README = REPO / "README.md"
RESULTS = REPO / "bench" / "RESULTS.md"
PAGES = ("cli.md", "exit-codes.md", "config.md", "checks.md")


def _gen(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(GEN), *args], capture_output=True, text=True, timeout=120, cwd=REPO)


def _prose_pages() -> list[Path]:
    """The hand-written pages: the README, docs/ but the generated reference."""
    return [README, *sorted(p for p in (REPO / "docs").rglob("*.md") if REF not in p.parents)]


# ------------------------------------------------------------------------------------------ generated pages


def test_generated_reference_pages_are_current():
    """docs/reference/ is exactly what `make docs` writes from the code now (else: run `make docs`)."""
    r = _gen("--check")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr
    assert sorted(p.name for p in REF.glob("*.md")) == sorted(PAGES)


def test_the_check_fails_on_a_stale_or_missing_page(tmp_path):
    """`--check` exits 1 naming the page when one differs by a line or is missing, and 0 on fresh pages."""
    assert _gen("--out", str(tmp_path)).returncode == 0
    assert _gen("--check", "--out", str(tmp_path)).returncode == 0
    with (tmp_path / "exit-codes.md").open("a") as f:
        f.write("| 99 | `MADE_UP` | a code the code does not have | |\n")
    (tmp_path / "checks.md").unlink()
    r = _gen("--check", "--out", str(tmp_path))
    assert r.returncode == 1
    assert "exit-codes.md" in r.stderr and "checks.md" in r.stderr and "cli.md" not in r.stderr
    assert "+| 99 | `MADE_UP`" not in r.stdout and "-| 99 | `MADE_UP`" in r.stdout  # the diff shows what goes


def _section(page: str, heading: str) -> str:
    body = page.split(f"\n## {heading}\n", 1)[1]
    return body.split("\n## ", 1)[0]


def test_cli_page_has_every_command_and_option():
    """Every command of the click tree has its own section in cli.md with its usage and every option it takes."""
    page = (REF / "cli.md").read_text()
    shared = {o for p in cli_main.params for o in getattr(p, "opts", ())}

    def walk(cmd: click.Command, path: str):
        yield cmd, path
        if isinstance(cmd, click.Group):
            for name, sub in cmd.commands.items():
                yield from walk(sub, f"{path} {name}".strip())

    seen = 0
    for cmd, path in walk(cli_main, ""):
        if not path:
            continue
        seen += 1
        body = _section(page, path)
        assert f"deploytool {path} " in body, path
        for p in cmd.params:
            if isinstance(p, click.Option) and not (set(p.opts) <= shared and not p.expose_value):
                longest = max(p.opts, key=len)
                assert longest in body, (path, longest)
    assert seen >= 25  # init ... sandbox exec: a tree that lost its commands is not documented by an empty page


def test_exit_codes_page_has_every_code_with_its_meaning():
    """Every ExitCode member is a row of exit-codes.md, with the comment errors.py gives it."""
    page = (REF / "exit-codes.md").read_text()
    src = (REPO / "deploy_tool" / "errors.py").read_text()
    for m in errors.ExitCode:
        comment = re.search(rf"^    {m.name} = {int(m)}  # (.+)$", src, re.M)
        assert comment, f"ExitCode.{m.name} has no comment to document it by"
        row = re.search(rf"^\| {int(m)} \| `{m.name}` \| (.+?) \|", page, re.M)
        assert row and row.group(1) == comment.group(1).strip(), m.name


def test_config_page_has_every_key():
    """Every key the schema documents (deploytool config-reference) is a row of config.md, under its backend kind
    where it has one, with its default."""
    page = (REF / "config.md").read_text()
    for key, _tp, default, _doc in config.reference_rows():
        head, sep, rest = key.partition("  (kind: ")
        if sep:
            kind, _, leaf = rest.partition(") ")
            key, body = head + leaf, _section(page, f"backends.&lt;name&gt; of kind `{kind}`")
        else:
            body = page
        row = next((ln for ln in body.splitlines() if ln.startswith(f"| `{key}` |")), None)
        assert row is not None, key
        assert " ".join(default.split()).replace("|", "\\|") in row, (key, default)


def test_checks_page_has_every_check_id():
    page = (REF / "checks.md").read_text()
    for c in checks.CATALOG:
        assert f"| `{c.id}` | {c.severity} |" in page, c.id


def test_the_root_help_names_every_exit_code():
    """`deploytool --help` lists the exit codes for a user without docs/: every ExitCode value is in it."""
    r = subprocess.run([sys.executable, "-m", "deploy_tool", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    listed = " ".join(r.stdout.split("Exit codes:", 1)[1].split())
    missing = [f"{int(m)} {m.name}" for m in errors.ExitCode if m and not re.search(rf"\b{int(m)} [A-Za-z]", listed)]
    assert not missing, missing


# ------------------------------------------------------------------------------------------ the hand-written pages


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    s = re.sub(r"[`*_]", "", heading.strip().lower())
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", [*_prose_pages(), RESULTS, *sorted(REF.glob("*.md"))],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_points_to_a_file_and_heading_that_exist(page):
    """Each relative link of the page names a file of the checkout and, after `#`, one of that file's headings."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not bad, bad


def test_every_page_of_docs_is_reachable_from_the_readme():
    """Following links from README.md reaches every page under docs/ (no orphan page a newcomer cannot find)."""
    seen, todo = set(), [README.resolve()]
    while todo:
        page = todo.pop()
        if page in seen or page.suffix != ".md" or not page.exists():
            continue
        seen.add(page)
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in LINK.findall(text):
            path = target.partition("#")[0]
            if path and not re.match(r"[a-z]+://", path):
                todo.append((page.parent / path).resolve())
    orphans = sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.md") if p.resolve() not in seen)
    assert not orphans, orphans


def test_the_readme_is_a_guide():
    """At most 12 KB; it says what deploytool is, how to install it, a first install and switch, the commands,
    and where to read on; and its command table has a row for every top-level command."""
    text = README.read_text()
    assert len(text.encode()) <= 12 * 1024, len(text.encode())
    heads = re.findall(r"^## (.+)$", text, re.M)
    for want in ("Install", "First pack, install and switch", "Commands", "Read on"):
        assert want in heads, (want, heads)
    table = text.split("\n## Commands\n", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| `([a-z-]+)(?: [a-z]+)?` \|", table, re.M))
    assert rows == set(cli_main.commands), sorted(rows ^ set(cli_main.commands))


# a goal stated or judged ("goal 100 ms: met", "(goal: under 1%)", "not met") or a comparison with the past
FIGURE_CLAIM = re.compile(r"\bgoals? (?:met|not met)\b|\bgoal\W+(?:at most|under|\d)|\bnot met\b|"
                          r"\bbefore the renovation\b|\(before: \d", re.I)


def test_figures_and_goals_live_in_the_results_file():
    """No hand-written page claims a goal met or compares with how things were: that is bench/RESULTS.md's job,
    with a date; and that file says, for every run, its date, machine and the script that printed the figures."""
    bad = []
    for page in _prose_pages():
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if FIGURE_CLAIM.search(line):
                bad.append(f"{page.relative_to(REPO)}:{n}: {line.strip()[:100]}")
    assert not bad, bad
    results = RESULTS.read_text()
    runs = re.split(r"^### ", results, flags=re.M)[1:]
    assert runs, "bench/RESULTS.md has no dated run sections"
    for run in runs:
        head = run.splitlines()[0]
        assert re.match(r"\d{4}-\d{2}-\d{2}\b", head), head
        assert "Machine:" in run and re.search(r"`(bench/\S+\.py|make \w+|scripts/\S+|tests/\S+|systemd-analyze[^`]*)`",
                                                run), head
