"""The fleet test bed itself (tests/support/fleet.py): real hosts, real sshd, real ansible-core over ssh.

Three hosts come up, each its own systemd as PID 1 of its own namespaces; `ansible -m ping` reaches all of them;
a tiny playbook starts a unit on every host through that host's systemd and a `uri` gate on the controller sees
each one answer; a host that is not on the bridge is reported unreachable (exit 4) while the others succeed; and
after teardown nothing of the fleet is left on the machine.
"""

from __future__ import annotations

import os
import subprocess
import urllib.request
from pathlib import Path

import pytest

from tests.support.fleet import BRIDGE, CONTROLLER_IP, Fleet, FleetError, fleet_fixture  # noqa: F401  (`fleet`)

pytestmark = [pytest.mark.sandbox, pytest.mark.fleet]


def _cgroup_lines(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cgroup").read_text().splitlines()


def _host_pid(f: Fleet, host: str, ns_pid: int) -> int:
    """The machine's PID of the process that is `ns_pid` inside `host` (NSpid's last field)."""
    for cg in (f.host_dir(host) / "cgroups").read_text().split():
        for top, _, files in os.walk(cg):
            if "cgroup.procs" in files:
                for x in Path(top, "cgroup.procs").read_text().split():
                    status = Path(f"/proc/{x}/status").read_text()
                    nspid = next(line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:"))
                    if int(nspid[-1]) == ns_pid:
                        return int(x)
    raise AssertionError(f"no process {ns_pid} in {host}")


def test_three_hosts_each_a_systemd_of_its_own_answer_ansible_ping(fleet):
    assert fleet.hosts == ["h1", "h2", "h3"]
    pidns = set()
    for h in fleet.hosts:
        pid1 = fleet.pid1(h)
        assert Path(f"/proc/{pid1}/comm").read_text().strip() == "systemd"
        pidns.add(os.readlink(f"/proc/{pid1}/ns/pid"))
        # started from its own sub-cgroup: every hierarchy places it under fleetns-<hash>, never at the root
        assert all(f"/{fleet.host_cgroup_name(h)}" in line for line in _cgroup_lines(pid1)
                   if "cpuset" not in line), _cgroup_lines(pid1)
        r = fleet.exec(h, "systemctl", "is-system-running")
        assert r.stdout.strip() in ("running", "degraded"), r
        assert fleet.exec(h, "systemctl", "is-active", "ssh.service").stdout.strip() == "active"
    assert len(pidns | {os.readlink("/proc/self/ns/pid")}) == 4, "each host has a pid namespace of its own"

    run = fleet.ansible("fleet", "-m", "ansible.builtin.ping")
    assert run.returncode == 0, run
    assert {h: r.get("ping") for h, r in run.task_results("ansible.builtin.ping").items()} == \
        {"h1": "pong", "h2": "pong", "h3": "pong"}, run

    # the answers come from three different machines as far as ssh can tell: own hostname, own machine-id
    run = fleet.ansible("fleet", "-m", "ansible.builtin.command", "-a", "cat /etc/hostname /etc/machine-id")
    assert run.returncode == 0, run
    out = {h: r["stdout"].split() for h, r in run.task_results("ansible.builtin.command").items()}
    assert {h: o[0] for h, o in out.items()} == {"h1": "h1", "h2": "h2", "h3": "h3"}
    assert len({o[1] for o in out.values()}) == 3


def test_playbook_starts_a_unit_through_each_hosts_systemd_and_the_gate_sees_it(fleet):
    opt_demo_before = os.path.exists("/opt/demo")
    run = fleet.playbook("demo-web.yml")
    assert run.returncode == 0, run
    assert all(s["failures"] == 0 and s["unreachable"] == 0 for s in run.stats.values()), run.stats
    gate = run.task_results("health gate")
    assert sorted(gate) == fleet.hosts, run
    for h in fleet.hosts:
        # the gate ran on the controller and read the host's own page
        assert gate[h]["status"] == 200 and gate[h]["content"].strip() == h, gate[h]
        assert gate[h]["url"] == f"http://{fleet.ip(h)}:8080/host.txt"
        # the host's own systemd runs the unit: active there, its main process in that host's cgroup namespace
        assert fleet.exec(h, "systemctl", "is-active", "demo-web.service").stdout.strip() == "active"
        main = int(fleet.exec(h, "systemctl", "show", "-P", "MainPID", "demo-web.service").stdout)
        assert main > 1
        pid = _host_pid(fleet, h, main)
        assert os.readlink(f"/proc/{pid}/ns/pid") == os.readlink(f"/proc/{fleet.pid1(h)}/ns/pid")
        assert any(line.endswith(f"/{fleet.host_cgroup_name(h)}/system.slice/demo-web.service")
                   for line in _cgroup_lines(pid)), _cgroup_lines(pid)
        assert (fleet.host_dir(h) / "etc-systemd-system" / "demo-web.service").is_file()
        # and the test process reaches it over the bridge too
        with urllib.request.urlopen(f"http://{fleet.ip(h)}:8080/host.txt", timeout=5) as resp:
            assert resp.read().decode().strip() == h
    # what the hosts wrote stayed in their copy-on-write roots
    assert os.path.exists("/opt/demo") == opt_demo_before
    assert not Path("/etc/systemd/system/demo-web.service").exists()


def test_a_host_off_the_bridge_is_unreachable_and_the_others_succeed(fleet):
    inv = fleet.inventory_with("ghost", {"ghost": "ansible_host=10.231.0.99"}, after="h1")
    run = fleet.ansible("fleet", "-m", "ansible.builtin.copy",
                        "-a", "content={{ inventory_hostname }} dest=/root/mark mode=0600", inventory=inv)
    assert run.returncode == 4, run  # ansible's exit code for "a host was unreachable"
    assert run.stats["ghost"]["unreachable"] == 1, run.stats
    for h in fleet.hosts:
        assert run.stats[h]["unreachable"] == 0 and run.stats[h]["failures"] == 0, run.stats
        assert run.stats[h]["changed"] == 1, run.stats
        assert fleet.exec(h, "cat", "/root/mark").stdout == h
    res = run.task_results("ansible.builtin.copy")["ghost"]
    assert res.get("unreachable") is True and "10.231.0.99" in res.get("msg", ""), res


def test_teardown_leaves_nothing_behind(fleet):
    # more than the boot processes: a transient unit in h2 and ansible's ssh masters on the controller
    r = fleet.exec("h2", "systemd-run", "--unit=sleeper", "/bin/sleep", "600")
    assert r.returncode == 0, r
    run = fleet.ansible("fleet", "-m", "ansible.builtin.ping")
    assert run.returncode == 0, run
    seen = fleet.note_processes()
    masters = [p for p in seen if b"ansible-home/cp/" in Path(f"/proc/{p.pid}/cmdline").read_bytes()]
    assert len(masters) == 3 and len(seen) >= 3 * 3 + 1 + 3, seen
    assert fleet.leftovers() != [], "the check must see a fleet that is up"

    # one fleet per machine: a second one is refused and the first is not disturbed
    other = Fleet(fleet.dir.with_name(fleet.dir.name + "-second"))
    with pytest.raises(FleetError, match=BRIDGE):
        other.up(1)
    assert not other.dir.exists() or not other.started
    assert fleet.exec("h1", "systemctl", "is-system-running").stdout.strip() in ("running", "degraded")

    fleet.down()
    assert fleet.leftovers() == []
    assert subprocess.run(["ip", "-4", "addr", "show", "to", CONTROLLER_IP], capture_output=True,
                          text=True).stdout.strip() == ""
    fleet.down()  # idempotent
    assert fleet.leftovers() == []
