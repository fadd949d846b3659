#!/usr/bin/env python3
"""How a rollout, a fleet switch and plain rsync grow with the fleet: 1, 3 and 6 hosts of the fleet test bed.

For each host count N (--hosts, default 1,3,6) the fleet test bed (tests/support/fleet.py: N hosts, each its own
systemd and sshd in namespaces of its own, real ansible-core) is brought up, and side by side, in this order:

  rsync      `rsync -a` of the cpu-demo fleet release's bundle directory to the N hosts at once (one rsync per host,
             in parallel, as bench_ship.py does), over the fleet's ssh (its config, key and known hosts), into an
             empty directory; the copy is then deleted on the hosts
  rollout    `ansible-playbook rollout.yml` of that release (tests/support/fleet_release.py) to the N hosts: the
             canary, then the batches (default serial [1, "50%", "100%"]), each host shipped, bootstrapped,
             installed and gated from the controller
  rollout 2  `rollout.yml` of a second release of the same fleet, one setting of the backend's environment apart
             (its units, env files and config differ: small files, which go along with the ship's first module call,
             so each host's ship is one call, and every venv part is the first release's, so each host's install
             links them: deploy_tool.box.venvreuse): what a rollout costs when little changed
  switch     `ansible-playbook switch.yml -e backend=llamacpp` (serial 1, each host gated)

--serial gives the rollout other batches (deploytool_serial), e.g. 100%: all N hosts in one batch, the same
parallelism as the rsync. Both playbooks run with --forks max(5, N).

and, for each of the three, the CPU it cost on either side (--no-cpu: not measured): the controller's (this process
and everything it starts, ssh's persistent masters included, counted in a cpuacct sub-cgroup of its own that this
process moves into once the hosts are up; that is where rsync's and ansible's own work and ssh's encryption run) and
the hosts' (their payload cgroups: sshd, the receiving rsync, bootstrap, install, the servers). On this bed both sides
share the machine's cores, so a host added to the bed adds its install's CPU to everyone's wall time; on a real fleet
each box spends its share on its own CPU in parallel, and what grows with the fleet on one machine is the controller's
part. So the controller's CPU per added host is printed beside the wall times, with its ratio to rsync's.

then the memory and disk each host holds with the release installed and serving: its memory cgroup (memory.current,
which counts its tmpfs files) and the RSS/PSS of its processes (`Fleet.mem`), and `df /` inside the host (its
overlay's upper layer, a tmpfs of at most FLEET_HOST_TMPFS_SIZE, 4 GiB by default). The fleet is taken down and
checked gone after each N (running_fleet).

Printed: the seconds of each per N; the marginal cost of one more host, (t3 - t1) / 2 and (t6 - t3) / 3, for the
rollout, the second rollout, each one's ship step, the switch and rsync; the rollout's marginal cost over rsync's.
Goal (issue 29): the marginal cost of a rollout per added host at most 1.5x the marginal cost of rsync of the same
bundle to one more host in parallel.
The machine's load before and after (--json: everything as JSON). Only one fleet can be up on a machine: this waits
for another run's fleet to go first.

Usage: python bench/bench_fleet_scale.py [--hosts 1,3,6] [--serial 1,50%,100%] [--json] [--save FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.fleet import Fleet, FleetError, running_fleet  # noqa: E402
from tests.support.fleet_release import MODEL, PORT, Release, make_release  # noqa: E402
from tests.support.sandbox import RUN_PARENT  # noqa: E402

# ansible-core must not see the checkout on its PYTHONPATH: the collection's source, ansible/, has an __init__.py
# and would shadow the `ansible` package (deploytool's own child processes set PYTHONPATH themselves)
os.environ.pop("PYTHONPATH", None)

PLAYBOOKS = REPO / "ansible" / "playbooks"
PLAIN = "/var/lib/bench-rsync"
GOAL = 1.5
MIB = 1 << 20


def _loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _mem_available() -> int:
    m = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
    return int(m.group(1)) * 1024 if m else 0


def _fail(what: str, run: object) -> None:
    sys.exit(f"bench_fleet_scale: {what} failed\n{run}")


def rsync_all(f: Fleet, src: Path, dest: str) -> float:
    ssh = f"ssh -F {f.ssh_config}"

    def one(h: str) -> None:
        r = subprocess.run(["rsync", "-a", "-e", ssh, f"{src}/", f"{f.ip(h)}:{dest}/"], capture_output=True,
                           text=True, timeout=1200)
        if r.returncode != 0:
            _fail(f"rsync to {h}", r.stderr)

    t0 = time.monotonic()
    with ThreadPoolExecutor(len(f.hosts)) as pool:
        list(pool.map(one, f.hosts))
    return time.monotonic() - t0


def disk_used(f: Fleet) -> dict[str, int]:
    """Bytes used on each host's / (overlayfs reports its upper layer's tmpfs)."""
    out = {}
    for h in f.hosts:
        r = f.exec(h, "df", "-B1", "--output=used", "/")
        if r.returncode != 0:
            _fail(f"df on {h}", r.stdout + r.stderr)
        out[h] = int(r.stdout.split()[-1])
    return out


def memory(f: Fleet) -> dict[str, dict[str, int]]:
    """Per host: processes, RSS, PSS (MiB) and the memory cgroup's usage (MiB, its tmpfs files included)."""
    out = {}
    pat = re.compile(r"^(h\d+): (\d+) processes, rss (\d+) MiB, pss (\d+) MiB, memory cgroup (\d+|n/a) MiB", re.M)
    for m in pat.finditer(f.mem()):
        out[m[1]] = {"processes": int(m[2]), "rss_mib": int(m[3]), "pss_mib": int(m[4]),
                     "cgroup_mib": int(m[5]) if m[5] != "n/a" else -1}
    return out


def _cgroup_mounts() -> dict[str, Path]:
    """{"cpuacct" or "v2": mount point} of the cgroup file systems that account CPU."""
    out: dict[str, Path] = {}
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _dev, mnt, fstype, opts, *_ = line.split()
        if fstype == "cgroup" and "cpuacct" in opts.split(","):
            out.setdefault("cpuacct", Path(mnt))
        elif fstype == "cgroup2":
            out.setdefault("v2", Path(mnt))
    return out


def _cpu_seconds(cg: Path) -> float | None:
    """CPU seconds a cgroup (and its children) used: cpuacct.usage (v1, ns) or cpu.stat's usage_usec (v2)."""
    try:
        return int((cg / "cpuacct.usage").read_text()) / 1e9
    except (FileNotFoundError, ValueError):
        pass
    try:
        m = re.search(r"^usage_usec (\d+)$", (cg / "cpu.stat").read_text(), re.M)
    except FileNotFoundError:
        return None
    return int(m.group(1)) / 1e6 if m else None


class CpuMeter:
    """CPU seconds of the controller and of the hosts, read before and after each thing measured.

    The controller's side is a sub-cgroup of this process's own in the CPU-accounting hierarchy (cpuacct on cgroup
    v1, the unified one on v2), made by `enter` once the hosts are up (so that the hosts' cgroups, made beside it,
    are not inside it) with this process moved into it: everything started from then on counts, including ssh's
    ControlPersist masters, which leave their parent and would escape getrusage(RUSAGE_CHILDREN). `close` moves this
    process back and removes the sub-cgroup once it is empty (the fleet's teardown ends the ssh masters; close it
    after the fleet). The hosts' side is the sum over their payload cgroups (fleet-ns.sh's, not the `.sup` ones).
    Where no such hierarchy can be written, `why` says so and the figures are None."""

    def __init__(self) -> None:
        self.cg: Path | None = None
        self.home: Path | None = None
        self.root: Path | None = None
        self.why = ""
        mounts = _cgroup_mounts()
        kind = "cpuacct" if "cpuacct" in mounts else "v2" if "v2" in mounts else ""
        if not kind:
            self.why = "no cgroup hierarchy accounts CPU here"
            return
        self.root = mounts[kind]
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _hid, ctls, path = line.split(":", 2)
            if (kind == "v2" and ctls == "") or (kind == "cpuacct" and "cpuacct" in ctls.split(",")):
                self.home = self.root / path.lstrip("/")
        if self.home is None:
            self.why = f"this process is in no {kind} cgroup"

    def enter(self) -> None:
        if self.home is None or self.cg is not None:
            return
        cg = self.home / f"bench-fleet-controller-{os.getpid()}"
        try:
            cg.mkdir()
        except OSError as exc:
            self.why = f"cannot make {cg}: {exc.strerror}"
            return
        try:
            (cg / "cgroup.procs").write_text(f"{os.getpid()}\n")
        except OSError as exc:
            self.why = f"cannot move into {cg}: {exc.strerror}"
            cg.rmdir()
            return
        self.cg = cg

    def close(self) -> None:
        if self.cg is None or self.home is None:
            return
        (self.home / "cgroup.procs").write_text(f"{os.getpid()}\n")
        left = (self.cg / "cgroup.procs").read_text().split()
        try:
            self.cg.rmdir()
        except OSError as exc:
            print(f"bench_fleet_scale: cannot remove {self.cg} ({exc.strerror}); processes in it: "
                  f"{' '.join(left) or 'none'}", file=sys.stderr)
        self.cg = None

    def controller(self) -> float | None:
        return _cpu_seconds(self.cg) if self.cg is not None else None

    def hosts(self, f: Fleet) -> float | None:
        if self.root is None:
            return None
        total = 0.0
        for h in f.hosts:
            dirs = [Path(d) for d in (f.host_dir(h) / "cgroups").read_text().split() if not d.endswith(".sup")]
            found = [v for d in dirs if d.is_relative_to(self.root) and (v := _cpu_seconds(d)) is not None]
            if not found:
                return None
            total += found[0]
        return total

    def read(self, f: Fleet) -> tuple[float | None, float | None]:
        return self.controller(), self.hosts(f)


def _spent(before: tuple[float | None, float | None], after: tuple[float | None, float | None]) -> dict:
    """{"controller_s", "hosts_s"}: the CPU seconds between two CpuMeter reads (None where not measured)."""
    return {k: round(a - b, 2) if a is not None and b is not None else None
            for k, b, a in zip(("controller_s", "hosts_s"), before, after, strict=True)}


def _fleet(stack: contextlib.ExitStack, n: int, wait_s: float = 3600) -> Fleet:
    """running_fleet(n), waiting up to `wait_s` for other runs' fleets (running_fleet gives up after 600 s)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return stack.enter_context(running_fleet(n))
        except FleetError as exc:
            if "another test run holds" not in str(exc) or time.monotonic() > deadline:
                raise


def _batches(n: int, serial: list) -> list[int]:
    """The batch sizes ansible makes of n hosts for `serial` (numbers or percentages; the last one repeats)."""
    out, left, i = [], n, 0
    while left > 0:
        v = serial[min(i, len(serial) - 1)]
        size = int(n * float(v[:-1]) / 100) if isinstance(v, str) else int(v)
        size = min(max(size, 1), left)
        out.append(size)
        left -= size
        i += 1
    return out


def one_size(n: int, rel: Release, rel2: Release, serial: list | None, cpu: bool = True) -> dict:
    row: dict = {"hosts": n}
    with contextlib.ExitStack() as stack:
        meter = CpuMeter()
        stack.callback(meter.close)  # after the fleet's teardown (an ExitStack unwinds last in, first out)
        f = _fleet(stack, n)
        if cpu:
            meter.enter()
        row["cpu_not_measured"] = meter.why if cpu else "--no-cpu"
        row.update(load_before=_loadavg(), mem_available_up_mib=_mem_available() // MIB)
        row["up_s"] = round(f.up_seconds, 2)
        f.install_collection()
        extra, extra2 = f.dir / "extra.json", f.dir / "extra-2.json"
        for path, r in ((extra, rel), (extra2, rel2)):
            path.write_text(json.dumps({"deploytool_bundle": str(r.bundle), "deploytool_config": str(r.config),
                                        "deploytool_keys": str(r.pubkey), "deploytool_port": PORT,
                                        **({"deploytool_serial": serial} if serial else {})}))
        row["rollout_batches"] = _batches(n, serial or [1, "50%", "100%"])
        run = f.ansible("fleet", "-m", "ansible.builtin.copy", "-a",
                        f"src={rel.model} dest={Path(MODEL).parent}/", timeout=600)
        if run.returncode != 0:
            _fail("copying the model", run)
        row["disk_base_mib"] = round(max(disk_used(f).values()) / MIB, 1)
        c0 = meter.read(f)
        row["rsync_s"] = round(rsync_all(f, rel.bundle, PLAIN), 2)
        row["rsync_cpu"] = _spent(c0, meter.read(f))
        row["disk_rsync_copy_mib"] = round(max(disk_used(f).values()) / MIB - row["disk_base_mib"], 1)
        run = f.ansible("fleet", "-m", "ansible.builtin.file", "-a", f"path={PLAIN} state=absent")
        if run.returncode != 0:
            _fail("removing the rsync copy", run)
        forks = str(max(5, n))  # the bed's ansible.cfg has 5: never fewer forks than a batch's hosts
        c0 = meter.read(f)
        run = f.playbook(PLAYBOOKS / "rollout.yml", "--forks", forks, "-e", f"@{extra}", timeout=3600)
        row["rollout_cpu"] = _spent(c0, meter.read(f))
        if run.returncode != 0:
            _fail(f"rollout to {n}", run)
        row["rollout_s"] = round(run.seconds, 2)
        # the ship step alone (what compares with rsync): the slowest host's, as the action timed it
        row["ship_max_s"] = round(max(r.get("seconds", 0.0) for r in run.task_results("ship").values()), 2)
        c0 = meter.read(f)
        run = f.playbook(PLAYBOOKS / "rollout.yml", "--forks", forks, "-e", f"@{extra2}", timeout=3600)
        row["rollout2_cpu"] = _spent(c0, meter.read(f))
        if run.returncode != 0:
            _fail(f"second rollout to {n}", run)
        row["rollout2_s"] = round(run.seconds, 2)
        ships = run.task_results("ship").values()
        row["ship2_max_s"] = round(max(r.get("seconds", 0.0) for r in ships), 2)
        row["ship2_one_call"] = all(set(r.get("timings", {})) == {"prepare"} for r in ships)
        # every host's install took the venv from the release before (deploy_tool.box.venvreuse), not unpacked it
        row["install2_linked"] = all(any(s.get("reused_parts") for s in (r.get("install") or {}).get("steps") or [])
                                     for r in run.task_results("install").values())
        c0 = meter.read(f)
        run = f.playbook(PLAYBOOKS / "switch.yml", "--forks", forks, "-e", "backend=llamacpp", "-e", f"deploytool_port={PORT}",
                         timeout=1800)
        row["switch_cpu"] = _spent(c0, meter.read(f))
        if run.returncode != 0:
            _fail(f"switch of {n}", run)
        changed = sum(1 for r in run.task_results("switch").values() if r.get("changed"))
        if changed != n:
            _fail(f"switch of {n}: {changed} hosts changed", run)
        row["switch_s"] = round(run.seconds, 2)
        row["switch_module_s"] = round(sum(r.get("seconds") or 0.0 for r in run.task_results("switch").values()), 2)
        mem = memory(f)
        disk = disk_used(f)
        row["per_host"] = {h: {**mem.get(h, {}), "disk_mib": round(disk[h] / MIB, 1)} for h in f.hosts}
        row["mem_available_serving_mib"] = _mem_available() // MIB
    row["load_after"] = _loadavg()
    return row


def marginal(rows: dict[int, dict], key: str, side: str | None = None) -> list[dict]:
    """The cost of one more host between each two host counts: (t_b - t_a) / (b - a) of rows[n][key] (or of
    rows[n][key][side], a CPU figure; None where either was not measured)."""
    ns = sorted(rows)

    def at(n: int) -> float | None:
        return rows[n][key] if side is None else rows[n][key][side]

    out = []
    for a, b in zip(ns, ns[1:], strict=False):
        va, vb = at(a), at(b)
        out.append({"from": a, "to": b,
                    "per_host_s": None if va is None or vb is None else round((vb - va) / (b - a), 2)})
    return out


def _per_host_ratio(num: list[dict], den: list[dict]) -> list[dict]:
    """num/den of two marginal() lists, where both grew (a marginal cost <= 0 is the load's noise, or for a
    rollout as many batches at both host counts, not a cost met)."""
    out = []
    for x, y in zip(num, den, strict=True):
        a, b = x["per_host_s"], y["per_host_s"]
        ok = a is not None and b is not None and a > 0 and b > 0
        out.append({"from": x["from"], "to": x["to"], "num_per_host_s": a, "den_per_host_s": b,
                    "ratio": round(a / b, 2) if ok else None})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", default="1,3,6", help="host counts, comma-separated (default 1,3,6)")
    ap.add_argument("--serial", help="the rollout's batches (deploytool_serial), comma-separated, e.g. 100%% or "
                    "1,100%%; default the playbook's own [1, 50%%, 100%%]")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--save", type=Path, help="also write the JSON summary to this file")
    ap.add_argument("--no-cpu", action="store_true",
                    help="measure no CPU (makes no cgroup for the controller; the wall times stay)")
    args = ap.parse_args()
    sizes = sorted({int(x) for x in args.hosts.split(",") if x.strip()})
    if not sizes or sizes[0] < 1:
        ap.error("--hosts: positive host counts, e.g. 1,3,6")
    serial = [int(x) if x.strip().isdigit() else x.strip() for x in args.serial.split(",")] if args.serial else None
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    load0 = _loadavg()
    d = Path(RUN_PARENT) / f"bench-fleet-scale-{time.time_ns():x}"
    rows: dict[int, dict] = {}
    try:
        t0 = time.monotonic()
        rel = make_release(d / "r1")
        pack_s = time.monotonic() - t0
        rel2 = make_release(d / "r2", env={"FLEET_RELEASE": "2"}, keys=d / "r1" / "keys")
        bundle_bytes = sum(x["size"] for x in json.loads((rel.bundle / "MANIFEST").read_text())["files"])
        for n in sizes:
            rows[n] = one_size(n, rel, rel2, serial, cpu=not args.no_cpu)
            if not args.json:
                r = rows[n]
                print(f"  {n} host(s) done: rollout {r['rollout_s']} s, second rollout {r['rollout2_s']} s, "
                      f"switch {r['switch_s']} s, "
                      f"rsync {r['rsync_s']} s (load {r['load_before']} -> {r['load_after']})", file=sys.stderr)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    m = {k: marginal(rows, k) for k in ("rollout_s", "ship_max_s", "rollout2_s", "ship2_max_s", "switch_s", "rsync_s")}
    ratios = [{"from": x["from"], "to": x["to"], "rollout_per_host_s": x["num_per_host_s"],
               "rsync_per_host_s": x["den_per_host_s"], "ratio": x["ratio"],
               "met": None if x["ratio"] is None else x["ratio"] <= GOAL}
              for x in _per_host_ratio(m["rollout_s"], m["rsync_s"])]
    cpu_m = {f"{what}_{side}": marginal(rows, f"{what}_cpu", f"{side}_s")
             for what in ("rsync", "rollout", "rollout2", "switch") for side in ("controller", "hosts")}
    controller_ratios = _per_host_ratio(cpu_m["rollout_controller"], cpu_m["rsync_controller"])
    per_host = [h for r in rows.values() for h in r["per_host"].values()]
    summary = {"started": started, "cores": os.cpu_count(), "load_start": load0, "load_end": _loadavg(),
               "bundle_bytes": bundle_bytes, "pack_s": round(pack_s, 1), "rows": rows, "marginal": m,
               "cpu_marginal": cpu_m, "controller_cpu_ratios": controller_ratios,
               "rollout_serial": serial or [1, "50%", "100%"],
               "goal": f"rollout per added host <= {GOAL}x rsync per added host", "ratios": ratios,
               "met": (None if not ratios or any(r["met"] is None for r in ratios)
                       else all(r["met"] for r in ratios)),
               "max_cgroup_mib_per_host": max((h.get("cgroup_mib", -1) for h in per_host), default=-1),
               "max_disk_mib_per_host": max((h["disk_mib"] for h in per_host), default=0)}
    if args.save:
        args.save.write_text(json.dumps(summary, indent=1) + "\n")
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(f"{started}; cpu-demo bundle {bundle_bytes / 1e6:.0f} MB; {os.cpu_count()} cores; "
          f"load {load0} at the start, {summary['load_end']} at the end")
    print(f"  rollout serial {summary['rollout_serial']}")
    print(f"  {'hosts':>5} {'up':>7} {'rsync':>8} {'rollout':>9} {'batches':>8} {'ship':>7} {'rollout 2':>10}"
          f" {'ship':>7} {'switch':>8} {'(module)':>9}   load before -> after")
    for n, r in rows.items():
        b = "+".join(map(str, r["rollout_batches"]))
        print(f"  {n:>5} {r['up_s']:>6.1f}s {r['rsync_s']:>7.1f}s {r['rollout_s']:>8.1f}s {b:>8} {r['ship_max_s']:>6.1f}s"
              f" {r['rollout2_s']:>8.1f}s{'' if r['install2_linked'] else '!'} {r['ship2_max_s']:>6.1f}s"
              f"{'' if r['ship2_one_call'] else '*'}"
              f" {r['switch_s']:>7.1f}s {r['switch_module_s']:>8.1f}s   {r['load_before']} -> {r['load_after']}")
    print("  (ship: each rollout's ship step, the slowest host's; * a host's second ship took more than one module "
          "call; ! a host's second install unpacked every venv part instead of linking the ones the first release "
          "has; (module): the switch modules' own seconds, summed)")
    for key, name in (("rollout_s", "rollout"), ("ship_max_s", "its ship step"), ("rollout2_s", "2nd rollout"),
                      ("ship2_max_s", "its ship step"), ("switch_s", "switch"), ("rsync_s", "rsync")):
        parts = [f"{x['from']}->{x['to']}: {x['per_host_s']:.2f} s" for x in m[key]]
        print(f"  per added host, {name:<13} {'; '.join(parts) or '(needs two host counts)'}")
    for x in ratios:
        if x["ratio"] is None:
            print(f"  {x['from']}->{x['to']}: rollout/rsync per added host: no ratio (a marginal cost <= 0: the "
                  f"load's noise, or as many batches at both counts), goal <= {GOAL}x: undecided")
        else:
            print(f"  {x['from']}->{x['to']}: rollout/rsync per added host {x['ratio']:.2f}x (goal <= {GOAL}x): "
                  f"{'met' if x['met'] else 'not met'}")
    not_measured = {r["cpu_not_measured"] for r in rows.values() if r["cpu_not_measured"]}
    if not_measured:
        print(f"  CPU: not measured ({'; '.join(sorted(not_measured))})")
    else:
        print("  CPU seconds, controller (this process and all it started, ssh's masters included) / hosts:")
        for n, r in rows.items():
            print(f"  {n:>5} host(s): " + ", ".join(
                f"{what} {r[what + '_cpu']['controller_s']:.1f} / {r[what + '_cpu']['hosts_s']:.1f}"
                for what in ("rsync", "rollout", "rollout2", "switch")))
        for what in ("rsync", "rollout", "rollout2", "switch"):
            parts = [f"{a['from']}->{a['to']}: {a['per_host_s']:.2f} / {b['per_host_s']:.2f} s"
                     for a, b in zip(cpu_m[f"{what}_controller"], cpu_m[f"{what}_hosts"], strict=True)]
            print(f"  CPU per added host, {what:<8} controller / hosts: {'; '.join(parts) or '(needs two host counts)'}")
        for x in controller_ratios:
            shown = f"{x['ratio']:.2f}x" if x["ratio"] is not None else "no ratio (a marginal cost <= 0)"
            print(f"  {x['from']}->{x['to']}: the controller's CPU per added host, rollout/rsync: {shown} (on a real "
                  "fleet the hosts' part runs on each box; this part is what one controller carries per box)")
    print("  per host, serving (memory cgroup incl. tmpfs files / RSS / PSS, disk = df / in the host):")
    for n, r in rows.items():
        for h, v in r["per_host"].items():
            print(f"    {n} hosts, {h}: cgroup {v.get('cgroup_mib', -1)} MiB, rss {v.get('rss_mib', -1)} MiB, "
                  f"pss {v.get('pss_mib', -1)} MiB, {v.get('processes', -1)} processes, disk {v['disk_mib']:.0f} MiB")
        print(f"    {n} hosts: machine MemAvailable {r['mem_available_up_mib']} MiB with the hosts up, "
              f"{r['mem_available_serving_mib']} MiB serving; rsync copy {r['disk_rsync_copy_mib']:.0f} MiB a host")
    return 0


if __name__ == "__main__":
    sys.exit(main())
