"""The house points one way: every import inside deploy_tool (module level or inside a function) goes from a
higher room to a lower one, never back up, and no modules import each other in a circle.

    cli/, __main__             the commands                                    (top)
    rehearsal/                 the sandboxed systemd, benchmark runs, charts
    box/ | builder/            what runs on the box | on the build machine     (side by side: neither imports
                                                                               the other)
    box/probe/                 the probes of a running backend: the rest of box/ uses them; what they use of
                               box/ never uses them back
    deploy_tool/*.py           shared by both sides: config, render, checks, bundle, hashing, ...   (bottom)
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "deploy_tool"
RANK = {"shared": 0, "box": 1, "builder": 1, "rehearsal": 2, "cli": 3}


def room(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("box", "builder", "rehearsal", "cli"):
        return parts[1]
    if len(parts) > 1 and parts[1] == "__main__":
        return "cli"
    return "shared"


def modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = p
    return out


def imports(path: Path, known: set[str]) -> set[str]:
    """Every deploy_tool module `path` imports, anywhere in it (TYPE_CHECKING blocks included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("deploy_tool")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("deploy_tool"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in known else node.module)
    return {m for m in found if m in known}


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: imports(p, known) - {m} for m, p in mods.items()}


def test_no_import_runs_back_up_and_the_two_sides_do_not_meet() -> None:
    bad = []
    for m, deps in graph().items():
        for d in deps:
            a, b = room(m), room(d)
            if d == "deploy_tool" or m.count(".") == 0:
                continue  # the package's face (__version__)
            if RANK[b] > RANK[a] or (RANK[a] == RANK[b] == 1 and a != b):
                bad.append(f"{m} ({a}) imports {d} ({b})")
    assert not bad, "\n".join(sorted(bad))


def test_no_circles() -> None:
    g = graph()
    seen: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(m: str) -> None:
        seen[m] = 1
        stack.append(m)
        for d in sorted(g[m]):
            if seen.get(d) == 1:
                circles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in seen:
                visit(d)
        stack.pop()
        seen[m] = 2

    for m in sorted(g):
        if m not in seen:
            visit(m)
    assert not circles, "\n".join(circles)


def test_every_room_is_a_package_with_a_doc() -> None:
    for name in ("box", "box/probe", "builder", "rehearsal"):
        init = PKG / name / "__init__.py"
        assert init.is_file() and ast.get_docstring(ast.parse(init.read_text())), name


PROBE = "deploy_tool.box.probe"


def test_the_probe_wing_and_the_rest_of_box_do_not_meet_in_a_circle() -> None:
    """What box/probe/ imports from the rest of box/ (runtime, fingerprint, systemd, state, ...) never leads back
    into box/probe/: the wing sits below the operations that use it."""
    g = graph()

    def inside(m: str) -> bool:
        return m == PROBE or m.startswith(PROBE + ".")

    bad = []
    for m in sorted(x for x in g if inside(x)):
        for d in sorted(x for x in g[m] if room(x) == "box" and not inside(x)):
            todo, seen = [d], {d}
            while todo:
                cur = todo.pop()
                for nxt in g[cur]:
                    if inside(nxt):
                        bad.append(f"{m} imports {d}, which leads back to {nxt} (through {cur})")
                    elif nxt not in seen:
                        seen.add(nxt)
                        todo.append(nxt)
    assert not bad, "\n".join(bad)
