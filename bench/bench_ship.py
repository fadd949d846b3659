#!/usr/bin/env python3
"""Shipping a release to 3 hosts with deploytool.fleet.ship vs plain rsync of the same directory over the same ssh.

On the fleet test bed (tests/support/fleet.py: 3 hosts, each a real systemd + sshd in namespaces of its own on a
bridge, real ansible-core), with two real cpu-demo bundles one wheel apart (tests/support/ship_bundles.py, packed
once and cached). Side by side, in one run, in this order:

  rsync      `rsync -a` of bundle A's directory to the 3 hosts at once (one rsync per host, in parallel, as ansible
             runs its forks), over the fleet's ssh (its config, key and known hosts), into an empty directory
  ship A     `ansible fleet -m deploytool.fleet.ship -a src=A` (ansible start included): nothing on the hosts yet
  rsync =    the same rsync again, nothing changed; `ship A =` the same ship again (changed=false)
  ship A rehash=true   the same again re-reading every earlier file on the hosts instead of trusting the record
  ship B     bundle B (one wheel rebuilt: that wheel, its archive among the venv's parts, the lock, config.json and
             the units differ) onto hosts that hold A, with the ship's default `link` (both bundles are of MANIFEST
             format 2: the files the hosts have become hard links to A's); every changed file is small, so all go
             along with the first module call (the bundle's smallest files, at most 512 KiB), which commits: no
             rsync and no second call (its phases then show `prepare` alone)
  ship B copies  bundle B again, with link=false, onto hosts that hold A alone again (the first B removed): local
             copies of the files the hosts have, as for a bundle packed before 2026-12-06
  rsync B    for reference, rsync's own best for B: `rsync -a --no-whole-file` of B onto a copy of A

Bytes are rsync's "Total bytes sent" (--stats) plus the file bytes sent along with the first module call, summed
over the hosts. Goals (issue 17): ship A at most 1.5x
rsync; ship B at most 10% of ship A's bytes and (issue 29) at most 20% of its time. Also printed: the fixed cost of
any ad hoc task on these hosts (`ansible fleet -m ping`, median of 3), and ship B's time above it.

Usage: python bench/bench_ship.py [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.fleet import Fleet, running_fleet  # noqa: E402
from tests.support.ship_bundles import cached_pair  # noqa: E402

DEST = "/var/lib/deploytool/bundles"
PLAIN = "/var/lib/bench-rsync"
TASK = "deploytool.fleet.ship"


def _bytes(out: str) -> int:
    m = re.search(r"^Total bytes sent: ([\d,.]+)", out, re.M)
    return int(m.group(1).replace(",", "").replace(".", "")) if m else 0


def rsync_all(f: Fleet, src: Path, dest: str, *extra: str) -> tuple[float, int]:
    ssh = f"ssh -F {f.ssh_config}"

    def one(h: str) -> int:
        r = subprocess.run(["rsync", "-a", "--stats", *extra, "-e", ssh, f"{src}/", f"{f.ip(h)}:{dest}/"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"bench_ship: rsync to {h} failed: {r.stderr}")
        return _bytes(r.stdout)

    t0 = time.monotonic()
    with ThreadPoolExecutor(len(f.hosts)) as pool:
        sent = sum(pool.map(one, f.hosts))
    return time.monotonic() - t0, sent


def ship_all(f: Fleet, src: Path, *extra: str) -> tuple[float, int, dict]:
    run = f.ansible("fleet", "-m", TASK, "-a", f"src={src} dest={DEST} keep=3 {' '.join(extra)}".strip(),
                    timeout=600)
    if run.returncode != 0:
        sys.exit(f"bench_ship: ship failed\n{run}")
    res = run.task_results(TASK)
    return run.seconds, sum(r["sent_bytes"] for r in res.values()), res


def _bundle_id(bundle: Path) -> str:
    return json.loads((bundle / "MANIFEST").read_text())["bundle_id"]


def _phases(res: dict) -> dict:
    """The slowest host's time in each phase of the action (prepare on the host, rsync, verify + rename)."""
    out = {"task_s": max(r["seconds"] for r in res.values())}
    for k in ("prepare", "transfer", "commit"):
        out[f"{k}_s"] = max(r.get("timings", {}).get(k, 0.0) for r in res.values())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    a, b = cached_pair()
    size_a = sum(x["size"] for x in json.loads((a / "MANIFEST").read_text())["files"])
    rows: dict[str, dict] = {}
    with running_fleet(3) as f:
        f.install_collection()
        f.ansible("fleet", "-m", "ansible.builtin.ping")  # ssh masters up for both sides alike
        # the fixed cost of any ad hoc task on these hosts: ansible's start and one module round trip per host
        pings = [f.ansible("fleet", "-m", "ansible.builtin.ping").seconds for _ in range(3)]
        rows["fixed (ping)"] = {"seconds": sorted(pings)[1], "bytes": 0}
        t, n = rsync_all(f, a, PLAIN)
        rows["rsync A"] = {"seconds": t, "bytes": n}
        t, n, res = ship_all(f, a)
        rows["ship A"] = {"seconds": t, "bytes": n, **_phases(res)}
        t, n = rsync_all(f, a, PLAIN)
        rows["rsync A ="] = {"seconds": t, "bytes": n}
        t, n, res = ship_all(f, a)
        assert not any(r["changed"] for r in res.values())
        rows["ship A ="] = {"seconds": t, "bytes": n}
        t, n, res = ship_all(f, a, "rehash=true")
        rows["ship A = rehash"] = {"seconds": t, "bytes": n}
        t, n, res = ship_all(f, b)
        rows["ship B"] = {"seconds": t, "bytes": n, "sent_files": max(r["sent_files"] for r in res.values()),
                          "literal_MB": sum(r.get("literal_bytes", 0) for r in res.values()) / 1e6, **_phases(res)}
        gone = f.ansible("fleet", "-m", "ansible.builtin.file", "-a", f"path={DEST}/{_bundle_id(b)} state=absent")
        if gone.returncode != 0:
            sys.exit(f"bench_ship: removing B failed\n{gone}")
        t, n, res = ship_all(f, b, "link=false")
        rows["ship B copies"] = {"seconds": t, "bytes": n, "sent_files": max(r["sent_files"] for r in res.values()),
                               "literal_MB": sum(r.get("literal_bytes", 0) for r in res.values()) / 1e6,
                               **_phases(res)}
        t, n = rsync_all(f, b, PLAIN, "--no-whole-file")
        rows["rsync B (onto A)"] = {"seconds": t, "bytes": n}
    r_a = rows["ship A"]["seconds"] / rows["rsync A"]["seconds"]
    r_bt = rows["ship B"]["seconds"] / rows["ship A"]["seconds"]
    r_bl = rows["ship B copies"]["seconds"] / rows["ship A"]["seconds"]
    r_bb = rows["ship B"]["bytes"] / rows["ship A"]["bytes"]
    fixed = rows["fixed (ping)"]["seconds"]
    r_var = (rows["ship B"]["seconds"] - fixed) / (rows["ship A"]["seconds"] - fixed)
    summary = {"bundle_bytes": size_a, "hosts": 3, "rows": rows, "ship_vs_rsync": r_a, "ship_b_time_ratio": r_bt,
               "ship_b_bytes_ratio": r_bb, "ship_b_copies_time_ratio": r_bl, "fixed_s": fixed, "ship_b_time_ratio_over_fixed": r_var}
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(f"bundle A: {size_a / 1e6:.0f} MB; 3 hosts; bytes = rsync 'Total bytes sent' summed over the hosts; "
          f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for name, row in rows.items():
        extra = "".join(f"  {k}={v:.2f}" if isinstance(v, float) else f"  {k}={v}" for k, v in row.items()
                        if k not in ("seconds", "bytes"))
        print(f"  {name:<18} {row['seconds']:7.2f} s  {row['bytes'] / 1e6:9.2f} MB{extra}")
    print(f"ship A / rsync A:   {r_a:.2f}x time (goal <= 1.5x)")
    print(f"ship B / ship A:    {r_bt * 100:.1f}% time (goal <= 20%), {r_bb * 100:.2f}% bytes (goal <= 10%)")
    print(f"ship B copies / A:  {r_bl * 100:.1f}% time (link=false: local copies, not hard links)")
    print(f"fixed cost:         {fixed:.2f} s (ansible's start and one module round trip per host: "
          f"{fixed / rows['ship A']['seconds'] * 100:.1f}% of ship A by itself); above it, ship B is "
          f"{r_var * 100:.1f}% of ship A")
    return 0


if __name__ == "__main__":
    sys.exit(main())
