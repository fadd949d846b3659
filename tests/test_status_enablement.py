"""`status` reports boot enablement as systemd will act on it at the next boot, against the REAL sandboxed
systemd 252: after `enable/disable --no-reload` flips (what switch does), it agrees with a fresh
`daemon-reload` + `is-enabled` and with the *.wants/ symlinks, while the manager's cached UnitFileState lags."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy_tool.box.status import boot_enablement
from tests.support.examples import examples
from tests.support.sandbox import SandboxEnv

pytestmark = pytest.mark.sandbox

UNITS = ("t-boot-a.service", "t-boot-b.service")


def _unit(name: str) -> bytes:
    return (f"[Unit]\nDescription={name}\n[Service]\nExecStart=/bin/sleep 1000\n"
            "[Install]\nWantedBy=multi-user.target\n").encode()


def _linked(env: SandboxEnv, unit: str) -> bool:
    return (env.unit_dir / "multi-user.target.wants" / unit).is_symlink()


def test_after_a_no_reload_flip_status_names_the_enabled_unit(sandbox_env: SandboxEnv) -> None:
    """The switch's flip (enable B, disable A, both --no-reload): status says B enabled, A disabled, as a fresh
    daemon-reload + is-enabled does; the cached UnitFileState still says A is enabled (the old bug)."""
    sd = sandbox_env.systemd
    a, b = UNITS
    for u in UNITS:
        sd.install_file(u, _unit(u))
    sd.daemon_reload()
    sd.enable(a)
    assert sd.show(a).unit_file_state == "enabled"  # cached now
    sd.enable(b, reload=False)
    sd.disable(a, reload=False)
    assert (boot_enablement(sd, a), boot_enablement(sd, b)) == ("disabled", "enabled")
    assert sd.show(a).unit_file_state == "enabled", "systemd no longer caches UnitFileState: simplify status"
    sd.daemon_reload()
    assert (sd.is_enabled(a), sd.is_enabled(b)) == ("disabled", "enabled")
    assert sd.show(a).unit_file_state == "disabled"


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(UNITS), st.booleans()), min_size=1, max_size=4))
def test_any_flip_sequence_matches_a_fresh_reload(sandbox_env: SandboxEnv, flips: list[tuple[str, bool]]) -> None:
    """Any sequence of --no-reload enables and disables: boot_enablement equals the symlinks in
    multi-user.target.wants/ and what systemd says after a fresh daemon-reload."""
    sd = sandbox_env.systemd
    for u in UNITS:
        sd.install_file(u, _unit(u))
    sd.daemon_reload()
    sd.disable(*UNITS)
    for u in UNITS:  # cache every unit's state before the flips
        sd.show(u)
    for unit, on in flips:
        (sd.enable if on else sd.disable)(unit, reload=False)
    seen = {u: boot_enablement(sd, u) for u in UNITS}
    assert seen == {u: "enabled" if _linked(sandbox_env, u) else "disabled" for u in UNITS}
    sd.daemon_reload()
    assert seen == {u: sd.is_enabled(u) for u in UNITS}
    assert seen == {u: sd.show(u).unit_file_state for u in UNITS}


def test_missing_unit(sandbox_env: SandboxEnv) -> None:
    """A unit with no unit file is not-found (boot has nothing to start), not an error."""
    assert boot_enablement(sandbox_env.systemd, "t-boot-none.service") == "not-found"
