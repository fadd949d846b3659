"""The deploytool.fleet collection on the fleet test bed: real hosts (each its own systemd and sshd), real
ansible-core, real cpu-demo releases installed by the collection's modules and playbooks. The fleet's servers want
an API key (serve.api_key_file; each host has the key root-only, as an operator puts it there): every gate asks them
for a real one-token completion with a key, the box's own credential unless the controller gives one.

One fleet of 3 hosts for the whole class, in this order: check mode on fresh hosts changes nothing; rollout.yml
bootstraps release 1 on all three behind the controller's gate (a completion, with the key); the same rollout again
changes nothing; the same rollout with a wrong key on the controller stops at the canary, named as the gate's key,
every host still serving; check mode of release 2 changes nothing; a host whose gate fails stops the roll of release 2 (the host before it serves
release 2, the host after it is untouched) and revert.yml puts the changed hosts back on release 1; an unreachable
host stops a roll; status.yml prints one table; switch.yml switches the fleet host by host (the hosts' switch
events do not overlap). How long that takes against one host's switch is bench/bench_fleet_switch.py's figure.
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.support.fleet import Fleet, running_fleet
from tests.support.fleet_release import API_KEY_FILE, MODEL, PORT, Release, make_release
from tests.support.sandbox import RUN_PARENT

REPO = Path(__file__).resolve().parents[1]
PLAYBOOKS = REPO / "ansible" / "playbooks"
DT = "/opt/deploytool/current/tool/bin/deploytool"
CREDENTIAL = "/etc/deploytool/env/api-key"  # the root-only copy install makes of serve.api_key_file

pytestmark = [pytest.mark.sandbox, pytest.mark.fleet]


@pytest.fixture(scope="module")
def releases() -> Iterator[tuple[Release, Release]]:
    """Two releases of the same fleet config (with an API key), signed by the same key; the second differs in
    ftllm's env."""
    d = Path(RUN_PARENT) / f"fleet-releases-{id(object()):x}"
    key = f"fleet-{secrets.token_hex(16)}"
    try:
        r1 = make_release(d / "r1", api_key=key)
        r2 = make_release(d / "r2", env={"FLEET_RELEASE": "2"}, keys=d / "r1" / "keys", api_key=key)
        assert r1.id != r2.id
        yield r1, r2
    finally:
        shutil.rmtree(d, ignore_errors=True)


def extra(f: Fleet, r: Release, name: str, **more: object) -> str:
    """`-e @FILE` for a rollout of `r` on this fleet."""
    path = f.dir / f"extra-{name}.json"
    path.write_text(json.dumps({"deploytool_bundle": str(r.bundle), "deploytool_config": str(r.config),
                                "deploytool_keys": str(r.pubkey), "deploytool_port": PORT, **more}))
    return f"@{path}"


def status(f: Fleet, host: str) -> dict:
    r = f.exec(host, DT, "--json", "status", timeout=60)
    if r.returncode == 127 or "No such file" in r.stderr:
        return {"release": None, "active_backend": None, "code": None}
    data = json.loads(r.stdout)
    return {"release": data["release"], "active_backend": data["active_backend"], "code": r.returncode}


def switch_spans(f: Fleet, host: str, since: float) -> list[tuple[float, float]]:
    """(start, end), in seconds since the epoch, of each switch the host made after `since`, from its history events
    (end time and duration; the hosts share the machine's clock)."""
    r = f.exec(host, "cat", "/var/lib/deploytool/history.jsonl")
    spans = []
    for ev in map(json.loads, r.stdout.splitlines()):
        if ev["event"] == "switch" and ev.get("outcome") == "switched":
            end = datetime.datetime.strptime(ev["time"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(
                tzinfo=datetime.UTC).timestamp()
            if end > since:
                spans.append((end - ev["seconds"], end))
    return spans


def model_name(r: Release) -> str:
    return str(yaml.safe_load(r.config.read_text())["serve"]["model_name"])


def completion_status(f: Fleet, host: str, r: Release, *, key: str | None) -> int:
    """The HTTP status of a one-token completion asked of the host's server from the controller, with `key`."""
    body = json.dumps({"model": model_name(r), "messages": [{"role": "user", "content": "Say hello."}],
                       "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://{f.ip(host)}:{PORT}/v1/chat/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the bridge, never a proxy
    try:
        with opener.open(req, timeout=60) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def history_len(f: Fleet, host: str) -> int:
    r = f.exec(host, "sh", "-c", "cat /var/lib/deploytool/history.jsonl 2>/dev/null | wc -l")
    return int(r.stdout.strip() or 0)


class TestFleet:
    @pytest.fixture(scope="class")
    def fleet3(self, releases) -> Iterator[Fleet]:
        r1, _ = releases
        # two cpu-demo releases (1.5 GB each once installed), their bundles and the copy install verifies: more
        # than the test bed's default 4g per host
        prev = os.environ.get("FLEET_HOST_TMPFS_SIZE")
        os.environ["FLEET_HOST_TMPFS_SIZE"] = "6g"
        try:
            with running_fleet(3) as f:
                f.install_collection()
                run = f.ansible("fleet", "-m", "ansible.builtin.copy",
                                "-a", f"src={r1.model} dest={Path(MODEL).parent}/ mode=0644")
                assert run.returncode == 0, str(run)
                run = f.ansible("fleet", "-m", "ansible.builtin.copy",
                                "-a", f"src={r1.api_key_file} dest={Path(API_KEY_FILE).parent}/ mode=0600")
                assert Path(API_KEY_FILE).name == r1.api_key_file.name, "copy keeps the file's name"
                assert run.returncode == 0, str(run)
                yield f
        finally:
            if prev is None:
                os.environ.pop("FLEET_HOST_TMPFS_SIZE", None)
            else:
                os.environ["FLEET_HOST_TMPFS_SIZE"] = prev

    def test_check_mode_on_fresh_hosts_changes_nothing(self, fleet3, releases):
        f, (r1, _) = fleet3, releases
        run = f.playbook(PLAYBOOKS / "rollout.yml", "--check", "--diff", "-e", extra(f, r1, "check1"), timeout=300)
        assert run.returncode == 0, str(run)
        res = run.task_results("install")
        assert sorted(res) == f.hosts, str(run)
        for h in f.hosts:
            assert res[h]["changed"] is True, res[h]  # it would install
            r = f.exec(h, "sh", "-c", "ls -d /opt/deploytool /etc/deploytool /var/lib/deploytool 2>&1; true")
            assert "No such file" in r.stdout and "/opt/deploytool\n" not in r.stdout, (h, r.stdout)
            assert r.stdout.count("No such file") == 3, (h, r.stdout)

    def test_rollout_bootstraps_every_host_behind_the_gate_and_again_changes_nothing(self, fleet3, releases):
        f, (r1, _) = fleet3, releases
        run = f.playbook(PLAYBOOKS / "rollout.yml", "-e", extra(f, r1, "r1"), timeout=900)
        assert run.returncode == 0, str(run)
        inst, gate = run.task_results("install"), run.task_results("gate")
        for h in f.hosts:
            assert inst[h]["changed"] and inst[h]["bootstrapped"] and inst[h]["release"] == r1.bundle_id, inst[h]
            assert gate[h]["status"] == 200, gate[h]
            assert gate[h]["url"] == f"http://{f.ip(h)}:{PORT}/v1/chat/completions", gate[h]
            assert gate[h]["model"] == model_name(r1) and isinstance(gate[h]["content"], str), gate[h]
            assert gate[h]["key_source"] == f"the box's credential {CREDENTIAL}", gate[h]
            assert status(f, h) == {"release": r1.bundle_id, "active_backend": "ftllm-dflash", "code": 0}
            # the key is what let the gate in: the same completion without it is refused
            assert completion_status(f, h, r1, key=None) == 401
            assert completion_status(f, h, r1, key=r1.api_key_file.read_text().strip()) == 200
        again = f.playbook(PLAYBOOKS / "rollout.yml", "-e", extra(f, r1, "r1"), timeout=600)
        assert again.returncode == 0, str(again)
        assert {h: again.stats[h]["changed"] for h in f.hosts} == {h: 0 for h in f.hosts}, again

    def test_a_wrong_key_on_the_controller_stops_the_roll_at_the_canary_as_the_gates_key(self, fleet3, releases):
        f, (r1, _) = fleet3, releases
        run = f.playbook(PLAYBOOKS / "rollout.yml", "-e", extra(f, r1, "wrongkey", deploytool_api_key="not-the-key",
                                                                 deploytool_gate_timeout=120), timeout=600)
        assert run.returncode == 2, str(run)
        gate = run.task_results("gate")
        assert sorted(gate) == ["h1"] and gate["h1"]["_status"] == "failed", gate
        g = gate["h1"]
        assert g["reason"] == "key-wrong" and g["status"] == 401 and g["attempts"] == 1, g
        assert g["msg"].startswith("the gate's key is wrong:") and "the api_key option" in g["msg"], g
        assert g["seconds"] < 30, g  # at once, not after the 120 s the gate had
        assert "not-the-key" not in run.stdout + run.stderr
        assert "h2" not in run.stats and "h3" not in run.stats, run.stats
        assert run.stats["h1"]["changed"] == 0, run.stats
        for h in f.hosts:  # nothing changed, and the box the gate refused serves
            assert status(f, h) == {"release": r1.bundle_id, "active_backend": "ftllm-dflash", "code": 0}, h

    def test_check_mode_of_the_next_release_changes_nothing(self, fleet3, releases):
        f, (r1, r2) = fleet3, releases
        before = {h: history_len(f, h) for h in f.hosts}
        run = f.playbook(PLAYBOOKS / "rollout.yml", "--check", "--diff", "-e", extra(f, r2, "check2"), timeout=300)
        assert run.returncode == 0, str(run)
        res = run.task_results("install")
        for h in f.hosts:
            assert res[h]["changed"] is True and res[h]["before"]["release"] == r1.bundle_id, res[h]
            assert res[h]["after"]["release"] == r2.bundle_id, res[h]  # what diff mode shows as "after"
            assert status(f, h)["release"] == r1.bundle_id
            assert history_len(f, h) == before[h]
            assert f.exec(h, "test", "-e", f"/var/lib/deploytool/bundles/{r2.bundle_id}").returncode != 0

    def test_a_failed_gate_stops_the_roll_and_revert_puts_the_changed_hosts_back(self, fleet3, releases):
        f, (r1, r2) = fleet3, releases
        inv = f.inventory_with("badgate", {"h2": f"deploytool_gate_url=http://{f.ip('h2')}:1/v1/models "
                                                 "deploytool_gate_timeout=2"}, after=None)
        # the host var line is appended: h2 gets a second definition with the var (ansible merges them)
        h3_hist = history_len(f, "h3")
        # h1's deploytool made one that reads MANIFEST format 1 only, as every deploytool before 2026-12-06 does:
        # its install refuses r2 (format 2, the venv in parts), and the release module has r2 install itself with
        # the deploytool r2 carries (bootstrap)
        older = f.exec("h1", "sh", "-c", "m=$(echo /opt/deploytool/current/tool/venv/lib/python3*/site-packages/"
                       "deploy_tool/manifest.py) && sed -i 's/^SUPPORTED_FORMAT_VERSIONS = .*/SUPPORTED_FORMAT_"
                       "VERSIONS = frozenset({1})/' \"$m\" && grep -c '^SUPPORTED_FORMAT_VERSIONS = frozenset({1})$' "
                       "\"$m\"")
        assert older.returncode == 0 and older.stdout.strip() == "1", older
        # shipped with the ship's default `link` (both bundles are of MANIFEST format 2): r2's bundle shares r1's
        # unchanged files on the hosts (one inode, two names), and both the install of r2 and revert.yml's
        # reinstall of r1 take such bundles
        run = f.playbook(PLAYBOOKS / "rollout.yml", "-e", extra(f, r2, "r2", deploytool_serial=1), inventory=inv,
                         timeout=900)
        assert run.returncode != 0, str(run)
        bundles = "/var/lib/deploytool/bundles"
        shared = f.exec("h1", "sh", "-c", f"cd {bundles} && for f in {r1.bundle_id}/wheels/*; do "
                        f"[ {r2.bundle_id}/${{f#*/}} -ef $f ] && echo \"$f\"; done; true")
        assert shared.returncode == 0 and shared.stdout.strip(), shared
        assert run.stats["h2"]["failures"] == 1, run.stats
        inst = run.task_results("install")
        assert inst["h1"]["bootstrapped"] is True and inst["h2"]["bootstrapped"] is False, inst
        # h2's install (under sshd, as the module runs it) took the venv parts r2 shares with r1 from r1's release:
        # linked, one inode in both (deploy_tool.box.venvreuse)
        venv_step = next(s for s in inst["h2"]["install"]["steps"] if s["step"] == "venv-ready")
        assert venv_step.get("reused_parts", 0) > 10 and venv_step["from"] == r1.bundle_id, venv_step
        one = f.exec("h2", "sh", "-c", "cd /opt/deploytool/releases && n=0; for p in "
                     f"{r1.bundle_id}/venv/lib/python3*/site-packages/*/__init__.py; do "
                     f"[ {r2.bundle_id}/${{p#*/}} -ef $p ] && n=$((n+1)); done; echo $n")
        assert one.returncode == 0 and int(one.stdout.strip()) > 10, one
        assert run.task_results("gate")["h2"]["reason"] == "unhealthy", run.task_results("gate")["h2"]
        assert "h3" not in run.stats or run.stats["h3"]["ok"] == 0, run.stats
        assert status(f, "h1")["release"] == r2.bundle_id and status(f, "h1")["code"] == 0
        assert status(f, "h2")["release"] == r2.bundle_id  # installed; its gate (the controller's) failed
        assert status(f, "h3")["release"] == r1.bundle_id and history_len(f, "h3") == h3_hist
        run_id = json.loads(f.exec("h1", "cat", "/var/lib/deploytool/fleet/last-run.json").stdout)["run_id"]

        rev = f.playbook(PLAYBOOKS / "revert.yml", "-e", f"deploytool_port={PORT}", timeout=900)
        assert rev.returncode == 0, str(rev)
        back = rev.task_results("previous release")
        assert sorted(h for h, r in back.items() if r.get("_status") == "changed") == ["h1", "h2"], str(back)
        for h in f.hosts:
            assert status(f, h) == {"release": r1.bundle_id, "active_backend": "ftllm-dflash", "code": 0}, h
        assert history_len(f, "h3") == h3_hist
        for h in ("h1", "h2"):
            rec = json.loads(f.exec(h, "cat", "/var/lib/deploytool/fleet/last-run.json").stdout)
            assert rec["run_id"] == run_id and rec["reverted"] is True and rec["release"] == r1.bundle_id, rec
        again = f.playbook(PLAYBOOKS / "revert.yml", "-e", f"deploytool_port={PORT}", timeout=300)
        assert again.returncode == 0 and all(again.stats[h]["changed"] == 0 for h in f.hosts), str(again)

    def test_an_unreachable_host_stops_the_roll(self, fleet3, releases):
        f, (r1, _) = fleet3, releases
        inv = f.inventory_with("ghost", {"ghost": "ansible_host=10.231.0.99"}, after="h1")
        run = f.playbook(PLAYBOOKS / "rollout.yml", "-e", extra(f, r1, "ghost", deploytool_serial=1), inventory=inv,
                         timeout=600)
        assert run.returncode == 4, str(run)
        assert run.stats["ghost"]["unreachable"] == 1, run.stats
        assert run.stats["h1"]["failures"] == 0 and run.stats["h1"]["changed"] == 0, run.stats
        assert "h2" not in run.stats and "h3" not in run.stats, run.stats

    def test_status_prints_one_table(self, fleet3, releases):
        f, (r1, _) = fleet3, releases
        run = f.playbook(PLAYBOOKS / "status.yml")
        assert run.returncode == 0, str(run)
        table = next(iter(run.task_results("fleet table").values()))["msg"]
        assert table[0].split() == ["host", "state", "release", "backend", "units"]
        assert [row.split()[:4] for row in table[1:]] == [[h, "serving", r1.bundle_id, "ftllm-dflash"]
                                                         for h in f.hosts], table

    def test_a_rolled_back_switch_fails_its_task_and_stops_the_fleet_switch(self, fleet3, releases):
        f = fleet3
        dropin = "/etc/systemd/system/llamacpp-tensor.service.d/50-crash.conf"
        crash = '[Service]\nExecStart=\nExecStart=/bin/sh -c "echo simulated crash: CUDA error >&2; exit 3"\n'
        r = f.exec("h2", "sh", "-c", f"mkdir -p {Path(dropin).parent} && printf '{crash}' > {dropin} && "
                   f"systemctl daemon-reload && {DT} pin llamacpp-tensor --reason 'test: crash at start'")
        assert r.returncode == 0, r
        try:
            run = f.playbook(PLAYBOOKS / "switch.yml", "-e", "backend=llamacpp", "-e", f"deploytool_port={PORT}",
                             timeout=600)
            assert run.returncode != 0, str(run)
            res = run.task_results("switch")
            assert res["h1"]["changed"] and res["h1"]["backend"] == "llamacpp-tensor", res["h1"]
            bad = res["h2"]
            assert bad["_status"] == "failed" and bad["rolled_back"] is True and bad["exit_code"] == 10, bad
            assert "simulated crash" in bad["journal_tail"] and bad["reason"], bad
            assert "h3" not in run.stats, run.stats
            assert status(f, "h1")["active_backend"] == "llamacpp-tensor"
            assert status(f, "h2") == {"release": status(f, "h2")["release"], "active_backend": "ftllm-dflash",
                                       "code": 0}
            assert status(f, "h3")["active_backend"] == "ftllm-dflash"
            rev = f.playbook(PLAYBOOKS / "revert.yml", "-e", f"deploytool_port={PORT}", timeout=600)
            assert rev.returncode == 0, str(rev)
            assert rev.task_results("previous backend")["h1"]["_status"] == "changed", rev
            for h in f.hosts:
                assert status(f, h)["active_backend"] == "ftllm-dflash", h
        finally:
            r = f.exec("h2", "sh", "-c", f"rm -rf {Path(dropin).parent} && systemctl daemon-reload && "
                       f"{DT} pin llamacpp-tensor --reason 'test: crash drop-in removed'")
            assert r.returncode == 0, r

    def test_switch_serial_one_against_one_hosts_switch(self, fleet3, releases):
        f = fleet3
        one = f.ansible("h1", "-m", "deploytool.fleet.switch", "-a", "backend=llamacpp")
        assert one.returncode == 0, str(one)
        assert one.task_results("deploytool.fleet.switch")["h1"]["backend"] == "llamacpp-tensor"
        back = f.ansible("h1", "-m", "deploytool.fleet.switch", "-a", "backend=ftllm")
        assert back.returncode == 0 and status(f, "h1")["active_backend"] == "ftllm-dflash", str(back)
        t0 = time.time()
        # the key from a file on the controller this time (deploytool_api_key_file), not the box's credential
        run = f.playbook(PLAYBOOKS / "switch.yml", "-e", "backend=llamacpp", "-e", f"deploytool_port={PORT}",
                         "-e", f"deploytool_api_key_file={releases[0].api_key_file}", timeout=600)
        assert run.returncode == 0, str(run)
        gate = run.task_results("gate")
        assert all(gate[h]["status"] == 200 and gate[h]["key_source"] ==
                   f"the api_key_file {releases[0].api_key_file}" for h in f.hosts), gate
        for h in f.hosts:
            assert status(f, h)["active_backend"] == "llamacpp-tensor", h
        # serial 1: each host's switch (its history event: end time and duration) ran after the one before it
        # had ended, in inventory order. How long it takes against one host's is bench/bench_fleet_switch.py's.
        made = {h: switch_spans(f, h, t0) for h in f.hosts}
        assert all(len(v) == 1 for v in made.values()), made
        spans = {h: v[0] for h, v in made.items()}
        order = sorted(f.hosts, key=lambda h: spans[h][0])
        assert order == list(f.hosts), spans
        for a, b in zip(order, order[1:], strict=False):
            assert spans[a][1] <= spans[b][0], f"{a}'s switch {spans[a]} overlaps {b}'s {spans[b]}"
        print(f"\nfleet switch of 3 hosts (serial 1): {run.seconds:.1f} s; one host's switch (ansible ad-hoc): "
              f"{one.seconds:.1f} s")
        again = f.playbook(PLAYBOOKS / "switch.yml", "-e", "backend=llamacpp", "-e", f"deploytool_port={PORT}")
        assert again.returncode == 0 and all(again.stats[h]["changed"] == 0 for h in f.hosts), str(again)

    def test_rollback_module_and_facts(self, fleet3, releases):
        f, (r1, _) = fleet3, releases
        assert status(f, "h1")["active_backend"] == "llamacpp-tensor"  # after the fleet switch
        dry = f.ansible("h1", "-m", "deploytool.fleet.rollback", "--check")
        assert dry.returncode == 0, str(dry)
        assert dry.task_results("deploytool.fleet.rollback")["h1"]["changed"] is True
        assert status(f, "h1")["active_backend"] == "llamacpp-tensor"  # check mode changed nothing
        run = f.ansible("h1", "-m", "deploytool.fleet.rollback")
        assert run.returncode == 0, str(run)
        res = run.task_results("deploytool.fleet.rollback")["h1"]
        assert res["changed"] and res["backend"] == "ftllm-dflash" and res["from_backend"] == "llamacpp-tensor", res
        assert status(f, "h1")["active_backend"] == "ftllm-dflash"
        facts = f.ansible("fleet", "-m", "deploytool.fleet.facts")
        assert facts.returncode == 0, str(facts)
        got = {h: r["ansible_facts"]["deploytool"] for h, r in facts.task_results("deploytool.fleet.facts").items()}
        assert {h: (d["state"], d["exit_code"], d["release"], d["active_backend"]) for h, d in got.items()} == {
            "h1": ("serving", 0, r1.bundle_id, "ftllm-dflash"),
            "h2": ("serving", 0, r1.bundle_id, "llamacpp-tensor"),
            "h3": ("serving", 0, r1.bundle_id, "llamacpp-tensor")}, got
        # a box that is not serving is a state in the facts, not a failed task
        assert f.exec("h3", "systemctl", "stop", "llamacpp-tensor.service").returncode == 0
        down = f.ansible("h3", "-m", "deploytool.fleet.facts")
        assert down.returncode == 0, str(down)
        d = down.task_results("deploytool.fleet.facts")["h3"]["ansible_facts"]["deploytool"]
        assert (d["state"], d["exit_code"]) == ("not-serving", 22), d
