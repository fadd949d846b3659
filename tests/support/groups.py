"""How `make test` shares its work between pytest-xdist workers (`-n N --dist loadgroup`).

Most of the suite's time is spent waiting on real servers and a real systemd, not on the CPU, so a few workers
side by side finish it in a fraction of the time. What must stay together is kept together by an xdist group:

    fleet   every `fleet` test: one fleet test bed per machine (tests/support/fleet.py holds a machine-wide lock)
    box     every test of the session's installed cpu-demo box (fixtures `installed`, `demo`): one pack, one
            install, its tests one after another as they were written
    <file>  every other test runs with the rest of its file, so a module's fixtures (its own box, sandbox or
            bundles) are built once

A test that reaches the box through `request.getfixturevalue` says so with `@pytest.mark.xdist_group("box")`.
Groups are queued heaviest first (the fleet, the box, then files by their count of `slow` tests), so the long
ones start at once and the small files fill the gaps. Without xdist (`-n 0`, or a plain `pytest`), nothing
changes: the marks are only read by xdist's scheduler.
"""

from __future__ import annotations

import pytest

BOX_FIXTURES = frozenset({"installed", "demo"})


def group_of(item: pytest.Item) -> str:
    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
        return str(mark.args[0] if mark.args else mark.kwargs["name"])
    if item.get_closest_marker("fleet") is not None:
        return "fleet"
    if BOX_FIXTURES & set(getattr(item, "fixturenames", ())):
        return "box"
    return item.nodeid.split("::", 1)[0]


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks into the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        g = group_of(item)
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(g))
        groups.setdefault(g, []).append(item)

    def weight(g: str) -> tuple[int, int, int]:
        its = groups[g]
        return (g == "fleet", g == "box", sum(i.get_closest_marker("slow") is not None for i in its))

    # a stable sort: the same order on every worker (xdist checks that all workers collected the same list)
    order = sorted(groups, key=lambda g: tuple(-w for w in weight(g)))
    items[:] = [i for g in order for i in groups[g]]
