"""The fleet test bed itself (tests/support/fleet.py): real hosts, real sshd, real ansible-core over ssh.

Three hosts come up, each its own systemd as PID 1 of its own namespaces; `ansible -m ping` reaches all of them;
a tiny playbook starts a unit on every host through that host's systemd and a `uri` gate on the controller sees
each one answer; a host that is not on the bridge is reported unreachable (exit 4) while the others succeed; and
after teardown nothing of the fleet is left on the machine, also when the test run that brought it up was killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fleet import (  # noqa: F401  (fleet_fixture: the `fleet` fixture)
    BRIDGE,
    CONTROLLER_IP,
    Fleet,
    FleetError,
    fleet_fixture,
    machine_lock,
    running_fleet,
    subreaper,
    sweep_orphan_fleets,
)

REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.sandbox, pytest.mark.fleet]


def _cgroup_lines(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cgroup").read_text().splitlines()


def _host_pid(f: Fleet, host: str, ns_pid: int) -> int:
    """The machine's PID of the process that is `ns_pid` inside `host` (NSpid's last field)."""
    for cg in (f.host_dir(host) / "cgroups").read_text().split():
        for top, _, files in os.walk(cg):
            if "cgroup.procs" in files:
                for x in Path(top, "cgroup.procs").read_text().split():
                    try:
                        status = Path(f"/proc/{x}/status").read_text()
                    except OSError:
                        continue  # exited meanwhile
                    nspid = next(line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:"))
                    if int(nspid[-1]) == ns_pid:
                        return int(x)
    raise AssertionError(f"no process {ns_pid} in {host}")


class TestThreeHosts:
    """One fleet of three hosts for the tests of this class (up once, down and checked when the class is done)."""

    @pytest.fixture(scope="class")
    def fleet3(self) -> Iterator[Fleet]:
        with running_fleet(3) as f:
            yield f

    def test_each_host_is_a_systemd_of_its_own_and_answers_ansible_ping(self, fleet3):
        f = fleet3
        assert f.hosts == ["h1", "h2", "h3"]
        pidns = set()
        for h in f.hosts:
            pid1 = f.pid1(h)
            assert Path(f"/proc/{pid1}/comm").read_text().strip() == "systemd"
            pidns.add(os.readlink(f"/proc/{pid1}/ns/pid"))
            # started from its own sub-cgroup: every hierarchy places it under fleetns-<hash>, never at the root
            assert all(f"/{f.host_cgroup_name(h)}" in line for line in _cgroup_lines(pid1)
                       if "cpuset" not in line), _cgroup_lines(pid1)
            r = f.exec(h, "systemctl", "is-system-running")
            assert r.stdout.strip() in ("running", "degraded"), r
            assert f.exec(h, "systemctl", "is-active", "ssh.service").stdout.strip() == "active"
            assert f.exec(h, "hostname").stdout.strip() == h
        assert len(pidns | {os.readlink("/proc/self/ns/pid")}) == 4, "each host has a pid namespace of its own"

        run = f.ansible("fleet", "-m", "ansible.builtin.ping")
        assert run.returncode == 0, run
        assert {h: r.get("ping") for h, r in run.task_results("ansible.builtin.ping").items()} == \
            {"h1": "pong", "h2": "pong", "h3": "pong"}, run
        assert all(s["ok"] == 1 and s["unreachable"] == 0 for s in run.stats.values()), run.stats

    def test_playbook_starts_a_unit_through_each_hosts_systemd_and_the_gate_sees_it(self, fleet3):
        f = fleet3
        run = f.playbook("demo-web.yml")
        assert run.returncode == 0, run
        assert sorted(run.stats) == f.hosts, run.stats
        assert all(s["failures"] == 0 and s["unreachable"] == 0 for s in run.stats.values()), run.stats
        gate = run.task_results("health gate")
        assert sorted(gate) == f.hosts, run
        for h in f.hosts:
            # the gate ran on the controller and read each host's own page (its name, written by its unit)
            assert gate[h]["status"] == 200 and gate[h]["content"].strip() == h, gate[h]
            assert gate[h]["url"] == f"http://{f.ip(h)}:8080/host.txt"
            # the host's own systemd runs the unit: active there, its main process in that host's cgroup namespace
            assert f.exec(h, "systemctl", "is-active", "demo-web.service").stdout.strip() == "active"
            main = int(f.exec(h, "systemctl", "show", "-P", "MainPID", "demo-web.service").stdout)
            assert main > 1
            pid = _host_pid(f, h, main)
            assert os.readlink(f"/proc/{pid}/ns/pid") == os.readlink(f"/proc/{f.pid1(h)}/ns/pid")
            assert any(line.endswith(f"/{f.host_cgroup_name(h)}/system.slice/demo-web.service")
                       for line in _cgroup_lines(pid)), _cgroup_lines(pid)
            assert (f.host_dir(h) / "etc-systemd-system" / "demo-web.service").is_file()
            # and the test process reaches it over the bridge too
            with urllib.request.urlopen(f"http://{f.ip(h)}:8080/host.txt", timeout=5) as resp:
                assert resp.read().decode().strip() == h
        assert not Path("/etc/systemd/system/demo-web.service").exists()

    def test_a_dynamic_user_service_reads_its_own_credential(self, fleet3):
        """LoadCredential= works as on a booted box (the host's / has shared propagation): a DynamicUser= service
        reads its credential, which stays root-only on the host (a deploytool unit with serve.api_key_file needs it)."""
        f = fleet3
        r = f.exec("h1", "sh", "-c", "mkdir -p /etc/fleet-bed && echo bed-secret > /etc/fleet-bed/k && "
                   "chmod 600 /etc/fleet-bed/k && systemd-run --wait --pipe -q -p LoadCredential=k:/etc/fleet-bed/k "
                   "-p DynamicUser=yes -p PrivateUsers=yes -p ProtectSystem=strict "
                   "sh -c 'id -u; cat \"$CREDENTIALS_DIRECTORY/k\"'", timeout=60)
        assert r.returncode == 0, r
        uid, text = r.stdout.split()
        assert int(uid) != 0 and text == "bed-secret", r

    def test_a_host_off_the_bridge_is_unreachable_and_the_others_succeed(self, fleet3):
        f = fleet3
        mark = Path("/root/fleet-bed-mark")
        assert not mark.exists()
        inv = f.inventory_with("ghost", {"ghost": "ansible_host=10.231.0.99"}, after="h1")
        run = f.ansible("fleet", "-m", "ansible.builtin.copy",
                        "-a", f"content={{{{ inventory_hostname }}}} dest={mark} mode=0600", inventory=inv)
        assert run.returncode == 4, run  # ansible's exit code for "a host was unreachable"
        assert run.stats["ghost"]["unreachable"] == 1, run.stats
        res = run.task_results("ansible.builtin.copy")
        assert res["ghost"]["_status"] == "unreachable" and "10.231.0.99" in res["ghost"]["msg"], res["ghost"]
        for h in f.hosts:
            assert run.stats[h]["unreachable"] == 0 and run.stats[h]["failures"] == 0, run.stats
            assert res[h]["_status"] == "changed", res[h]
            assert f.exec(h, "cat", str(mark)).stdout == h
        # what the hosts wrote stayed in their copy-on-write roots
        assert not mark.exists()


@pytest.mark.parametrize("fleet", [2], indirect=True)
def test_teardown_leaves_nothing_behind(fleet):
    assert fleet.hosts == ["h1", "h2"]
    # more than the boot processes: a transient unit in h2 and ansible's ssh masters on the controller
    r = fleet.exec("h2", "systemd-run", "--unit=sleeper", "/bin/sleep", "600")
    assert r.returncode == 0, r
    run = fleet.ansible("fleet", "-m", "ansible.builtin.ping")
    assert run.returncode == 0, run
    seen = fleet.note_processes()
    masters = [p for p in seen if b"ansible-home/cp/" in Path(f"/proc/{p.pid}/cmdline").read_bytes()]
    # per host: launcher, systemd, journald, sshd (+ its session for ansible); the sleeper; one master per host
    assert len(masters) == 2 and len(seen) >= 2 * 4 + 1 + 2, seen
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


def test_a_fleet_left_by_a_killed_test_run_is_taken_down_by_the_next():
    owner = textwrap.dedent("""
        import time
        from tests.support.fleet import Fleet, new_fleet_dir
        f = Fleet(new_fleet_dir())
        f.up(1)
        print(f.dir, flush=True)
        time.sleep(600)
    """)
    with machine_lock():
        prev = subreaper(True)  # the killed owner's launcher becomes ours, to be reaped by the sweep
        p = subprocess.Popen([sys.executable, "-c", owner], cwd=REPO, stdout=subprocess.PIPE, text=True)
        try:
            assert p.stdout is not None
            d = Path(p.stdout.readline().strip())
            assert d.name.startswith("fleet-") and (d / "fleet-owner.json").is_file(), d
            pid1 = int((d / "hosts/h1/pid").read_text())
            launcher = int((d / "hosts/h1/launcher.pid").read_text())
            cgroups = (d / "hosts/h1/cgroups").read_text().split()
            assert cgroups and all(os.path.isdir(c) for c in cgroups)
            p.send_signal(signal.SIGKILL)
            p.wait()
            assert Path(f"/proc/{pid1}/comm").read_text().strip() == "systemd", "the host outlived its owner"

            assert str(d) in sweep_orphan_fleets()
            assert not d.exists()
            assert not Path(f"/proc/{pid1}").exists() and not Path(f"/proc/{launcher}").exists()
            assert not any(os.path.exists(c) for c in cgroups)
            assert not Path("/run/netns/fleet-h1").exists()
            assert subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode != 0
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            sweep_orphan_fleets()
            subreaper(prev)
