#!/usr/bin/env python3
"""A fleet switch of 3 hosts (switch.yml, serial 1) against one host's switch, on the fleet test bed.

Brings up the fleet test bed (tests/support/fleet.py: 3 hosts, each its own systemd and sshd, real ansible-core),
packs a cpu-demo fleet release (tests/support/fleet_release.py), rolls it out with rollout.yml, then, --runs times
each way (llamacpp, then ftllm):

  one host   `deploytool.fleet.switch` on h1 alone (ansible ad-hoc, as an operator runs it: ssh, module, switch)
             and, for reference, `deploytool switch` run on h1 over plain ssh
  fleet      `ansible-playbook switch.yml -e backend=...` on h1..h3, serial 1 (switch, then the controller's gate)

Goal (issue 17): fleet <= 3 x (one host's switch + 2 s). Prints the medians (--json: as JSON). Leaves nothing
running: the fleet is taken down and checked.

Usage: python bench/bench_fleet_switch.py [--runs 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.fleet import running_fleet  # noqa: E402
from tests.support.fleet_release import MODEL, PORT, make_release  # noqa: E402
from tests.support.sandbox import RUN_PARENT  # noqa: E402

PLAYBOOKS = REPO / "ansible" / "playbooks"
DT = "/opt/deploytool/current/tool/bin/deploytool"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    d = Path(RUN_PARENT) / f"bench-fleet-{time.time_ns():x}"
    try:
        rel = make_release(d)
        with running_fleet(3) as f:
            f.install_collection()
            extra = f.dir / "extra.json"
            extra.write_text(json.dumps({"deploytool_bundle": str(rel.bundle), "deploytool_config": str(rel.config),
                                         "deploytool_keys": str(rel.pubkey), "deploytool_port": PORT,
                                         "deploytool_rsh": f"ssh -F {f.ssh_config}"}))
            model = f"src={rel.model} dest={Path(MODEL).parent}/"
            for run in (f.ansible("fleet", "-m", "ansible.builtin.copy", "-a", model),
                        f.playbook(PLAYBOOKS / "rollout.yml", "-e", f"@{extra}", timeout=1200)):
                if run.returncode != 0:
                    print(run, file=sys.stderr)
                    return 1
            one, plain, fleet = [], [], []
            for _ in range(args.runs):
                for backend in ("llamacpp", "ftllm"):
                    r = f.ansible("h1", "-m", "deploytool.fleet.switch", "-a", f"backend={backend}")
                    assert r.returncode == 0, r
                    one.append(r.seconds)
                    other = "ftllm" if backend == "llamacpp" else "llamacpp"
                    t0 = time.monotonic()
                    p = subprocess.run(["ssh", "-F", str(f.ssh_config), f.ip("h1"), DT, "switch", other],
                                       capture_output=True, text=True, timeout=300)
                    plain.append(time.monotonic() - t0)
                    assert p.returncode == 0, p
                    r = f.ansible("h1", "-m", "deploytool.fleet.switch", "-a", f"backend={backend}")
                    assert r.returncode == 0, r
                    r = f.playbook(PLAYBOOKS / "switch.yml", "-e", f"backend={other}", "-e",
                                   f"deploytool_port={PORT}", timeout=900)
                    assert r.returncode == 0, r
                    fleet.append(r.seconds)
                    r = f.playbook(PLAYBOOKS / "switch.yml", "-e", f"backend={backend}", "-e",
                                   f"deploytool_port={PORT}", timeout=900)
                    assert r.returncode == 0, r
    finally:
        shutil.rmtree(d, ignore_errors=True)
    m_one, m_plain, m_fleet = (statistics.median(x) for x in (one, plain, fleet))
    budget = 3 * (m_one + 2)
    out = {"one_host_switch_s": round(m_one, 2), "one_host_plain_ssh_switch_s": round(m_plain, 2),
           "fleet_switch_3_hosts_serial1_s": round(m_fleet, 2), "goal_s": round(budget, 2),
           "ok": m_fleet <= budget, "runs": len(fleet)}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"one host's switch (deploytool.fleet.switch, ad-hoc): {m_one:.2f} s  "
              f"(deploytool switch over plain ssh: {m_plain:.2f} s)")
        print(f"fleet switch, 3 hosts, serial 1 (switch.yml):       {m_fleet:.2f} s  "
              f"goal <= 3 x (one + 2 s) = {budget:.2f} s: {'ok' if out['ok'] else 'MISSED'}")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
