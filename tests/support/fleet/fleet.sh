#!/bin/bash
# fleet.sh - deploytool's fleet test bed: hosts h1..hN (10.231.0.11, .12, ...) on this machine, each a real
# systemd + sshd (see fleet-ns.sh), driven by ansible over ssh. Root only; one fleet per machine (fixed bridge,
# subnet and netns names). The tests drive it through tests/support/fleet.py; by hand:
#   FLEET_DIR=DIR fleet.sh up [N]        boot N hosts (default 3); writes DIR/ansible.cfg, inventory.ini, ssh/
#   FLEET_DIR=DIR fleet.sh down          stop them; remove bridge, veths, netns, cgroups, ssh masters
#   FLEET_DIR=DIR fleet.sh exec hN CMD   run CMD inside host hN (systemctl, journalctl, ...)
#   FLEET_DIR=DIR fleet.sh mem           memory per host
#   FLEET_DIR=DIR fleet.sh check         after down: list what is left (nothing = clean), exit 1 if anything
# DIR: not under /tmp or /var/tmp (units with PrivateTmp=yes would not see it) and free of spaces, commas and
# colons (they would break overlayfs's lowerdir/upperdir options and ssh's and ansible's option lists).
set -euo pipefail
HERE=$(dirname "$(realpath "$0")")
NS=$HERE/fleet-ns.sh
ns() { bash "$NS" "$@"; }
: "${FLEET_DIR:?set FLEET_DIR to the fleet working directory}"
D=$(realpath -m "$FLEET_DIR")
case "$D/" in /tmp/*|/var/tmp/*|*[[:space:],:]*) echo "FLEET_DIR: not under /tmp or /var/tmp; no spaces, commas, colons" >&2; exit 2;; esac
mkdir -p "$D"
ipof() { echo "10.231.0.$((10 + $1))"; }

up() {
  local n=${1:-3} i
  if ip link show fleetbr0 >/dev/null 2>&1; then
    echo "bridge fleetbr0 exists: a fleet is already up on this machine; 'fleet.sh down' it first" >&2; exit 1
  fi
  cat /proc/1/cgroup > "$D/pid1-cgroup.before"
  ns net-up
  mkdir -p "$D/ssh" "$D/ansible-home/tmp" "$D/ansible-home/cp"
  [ -f "$D/ssh/id_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -C fleet-controller -f "$D/ssh/id_ed25519"
  for i in $(seq "$n"); do ns up "$D/hosts/h$i" "h$i" "$(ipof "$i")" "$D/ssh/id_ed25519.pub" & done
  wait
  : > "$D/ssh/known_hosts"; echo "[fleet]" > "$D/inventory.ini"
  for i in $(seq "$n"); do
    [ -s "$D/hosts/h$i/pid" ] || { echo "h$i did not come up; tearing the fleet down" >&2; down; exit 1; }
    echo "$(ipof "$i") $(cut -d' ' -f1,2 "$D/hosts/h$i/seed/etc/ssh/ssh_host_ed25519_key.pub")" >> "$D/ssh/known_hosts"
    echo "h$i ansible_host=$(ipof "$i")" >> "$D/inventory.ini"
  done
  cat > "$D/ssh/config" <<EOF
Host 10.231.0.*
  User root
  IdentityFile $D/ssh/id_ed25519
  IdentitiesOnly yes
  UserKnownHostsFile $D/ssh/known_hosts
  StrictHostKeyChecking yes
  BatchMode yes
  ConnectTimeout 10
EOF
  sed "s|@FLEET_DIR@|$D|g" "$HERE/ansible.cfg.in" > "$D/ansible.cfg"
  echo "fleet of $n up: export ANSIBLE_CONFIG=$D/ansible.cfg"
}

down() {
  local b s
  for b in "$D"/hosts/*/; do if [ -d "$b" ]; then ns down "$b" & fi; done
  wait
  for s in "$D"/ansible-home/cp/*; do   # ssh ControlPersist masters of the controller
    if [ -S "$s" ]; then ssh -o ControlPath="$s" -O exit fleet >/dev/null 2>&1 || true; fi
  done
  ns net-down
}

mem() {  # memory cgroup usage (includes the host's tmpfs files) and RSS/PSS of its processes
  local b P m ns p r s rss pss n
  for b in "$D"/hosts/*/; do
    P=$(cat "$b/pid" 2>/dev/null) || continue
    m=$(grep -v '\.sup$' "$b/cgroups" | while read -r d; do ls "$d"/memory.usage_in_bytes "$d"/memory.current 2>/dev/null; done | head -1 || true)
    ns=$(readlink "/proc/$P/ns/pid"); rss=0; pss=0; n=0
    for p in /proc/[0-9]*; do
      [ "$(readlink "$p/ns/pid" 2>/dev/null)" = "$ns" ] || continue
      r=$(awk '/^Rss:/{print $2}' "$p/smaps_rollup" 2>/dev/null || true); s=$(awk '/^Pss:/{print $2}' "$p/smaps_rollup" 2>/dev/null || true)
      n=$((n + 1)); rss=$((rss + ${r:-0})); pss=$((pss + ${s:-0}))
    done
    printf '%s: %d processes, rss %d MiB, pss %d MiB, memory cgroup %s MiB\n' "$(basename "$b")" "$n" $((rss / 1024)) $((pss / 1024)) \
      "$([ -n "$m" ] && echo $(($(cat "$m") / 1048576)) || echo n/a)"
  done
}

check() {
  local out
  out=$( { ip netns list | grep '^fleet-' || true
           ip -br link | grep -E '^(fv-|fleetbr0)' || true
           find /sys/fs/cgroup -type d -name 'fleetns-*' 2>/dev/null || true
           ps -eo pid=,args= | grep -F -e "$D/hosts/" -e "$D/ansible-home/" | grep -v grep || true
           grep -F -e " $D/" -e " /run/netns/fleet-" /proc/self/mountinfo || true
           if [ -f "$D/pid1-cgroup.before" ] && ! diff -q "$D/pid1-cgroup.before" /proc/1/cgroup >/dev/null; then echo "/proc/1/cgroup changed"; fi; } )
  if [ -n "$out" ]; then echo "left over:"; echo "$out"; return 1; fi
  echo "clean: no fleet netns, veth, bridge, cgroup, process or mount left; /proc/1/cgroup unchanged"
}

case "${1:-}" in
  up)    up "${2:-3}" ;;
  down)  down ;;
  exec)  h=$2; shift 2; exec bash "$NS" exec "$D/hosts/$h" "$@" ;;
  mem)   mem ;;
  check) check ;;
  *) echo "usage: FLEET_DIR=DIR $0 up [N]|down|exec hN CMD...|mem|check" >&2; exit 2 ;;
esac
