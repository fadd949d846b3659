"""The module reference of ansible/README.md (the page Galaxy shows), generated from each module's DOCUMENTATION and
RETURN (and the doc fragment they extend), between the README's two marker lines.

    python scripts/collection_readme.py          rewrite the section (make collection-readme)
    python scripts/collection_readme.py --check  exit 1 with a diff when the README is not current (the test's way)
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
COLLECTION = REPO / "ansible"
README = COLLECTION / "README.md"
BEGIN = "<!-- modules: generated from the modules' documentation by scripts/collection_readme.py -->"
END = "<!-- end of the generated modules -->"
_MARKUP = re.compile(r"\b(?:C|O|V|RV|M|I|B)\(((?:[^()]|\([^()]*\))*)\)")  # one level of nested parentheses


def _text(v: Any) -> str:
    """Ansible doc markup as Markdown: C(x), O(x), V(x), RV(x), M(x) -> `x`; a list of paragraphs joined."""
    s = " ".join(v) if isinstance(v, list) else str(v or "")
    s = _MARKUP.sub(lambda m: f"`{m.group(1)}`", s)
    parts = s.split("`")  # outside code spans, < and > are text, not HTML
    s = "`".join(x if i % 2 else x.replace("<", "&lt;").replace(">", "&gt;") for i, x in enumerate(parts))
    return s.replace("|", "\\|").strip()


def _assigned(path: Path, name: str) -> str | None:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return str(ast.literal_eval(node.value))
        if isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, ast.Assign) and any(getattr(t, "id", None) == name for t in sub.targets):
                    return str(ast.literal_eval(sub.value))
    return None


def module_docs() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(name, DOCUMENTATION with its fragments' options merged in, RETURN) of every module, by name."""
    fragments = {}
    for p in sorted((COLLECTION / "plugins" / "doc_fragments").glob("*.py")):
        fragments[f"deploytool.fleet.{p.stem}"] = yaml.safe_load(_assigned(p, "DOCUMENTATION") or "{}")
    out = []
    for p in sorted((COLLECTION / "plugins" / "modules").glob("*.py")):
        doc = yaml.safe_load(_assigned(p, "DOCUMENTATION") or "{}")
        opts = dict(doc.get("options") or {})
        for frag in doc.get("extends_documentation_fragment") or []:
            opts.update((fragments.get(frag) or {}).get("options") or {})
        doc["options"] = opts
        out.append((p.stem, doc, yaml.safe_load(_assigned(p, "RETURN") or "{}") or {}))
    return out


def render() -> str:
    lines = [BEGIN, ""]
    for name, doc, ret in module_docs():
        lines += [f"### deploytool.fleet.{name} (module)", "", f"{_text(doc['short_description'])}.", ""]
        lines += [f"- {_text(d)}" for d in doc.get("description") or []]
        lines += ["", "| option | type | default | |", "|---|---|---|---|"]
        for opt, spec in sorted(doc["options"].items()):
            desc = _text(spec.get("description"))
            if desc.startswith("Internal"):
                continue
            typ = spec.get("type", "str") + (f" of {spec['elements']}" if spec.get("elements") else "")
            d = spec.get("default")
            d = str(d).lower() if isinstance(d, bool) else d
            default = "**required**" if spec.get("required") else (f"`{d}`" if d not in (None, "", []) else "")
            choices = f" One of {', '.join(f'`{c}`' for c in spec['choices'])}." if spec.get("choices") else ""
            lines.append(f"| `{opt}` | {typ} | {default} | {desc}{choices} |")
        if ret:
            lines += ["", "Returns " + ", ".join(f"`{k}`" for k in sorted(ret)) + ".",
                      f"`ansible-doc deploytool.fleet.{name}` has each one's meaning."]
        lines.append("")
    lines.append(END)
    return "\n".join(lines)


def current(readme: str) -> str:
    """The README with its generated section as the modules' documentation says it now."""
    if BEGIN not in readme or END not in readme:
        raise SystemExit(f"{README}: the markers of the generated section are missing ({BEGIN!r} ... {END!r})")
    head, rest = readme.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    return head + render() + tail


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 with a diff when the README is not current")
    args = ap.parse_args()
    old = README.read_text()
    new = current(old)
    if args.check:
        if old != new:
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True), str(README),
                                                       "generated"))
            print("\nansible/README.md is not current: run `make collection-readme`", file=sys.stderr)
            return 1
        return 0
    if old != new:
        README.write_text(new)
        print(f"rewrote the module reference of {README.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
