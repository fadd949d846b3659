#!/bin/bash
# fleet-ns.sh - one host of deploytool's fleet test bed (tests/support/fleet.py), on this machine. Root only.
#   A real systemd as PID 1 of private pid/mount/uts/ipc/cgroup namespaces, launched from its own
#   sub-cgroup (never the caller's), plus:
#   * its own network namespace fleet-NAME, veth fv-NAME -> bridge fleetbr0 (10.231.0.1/24; no NAT, no route out)
#   * a copy-on-write root: overlayfs (lower = this machine's /, upper = tmpfs of the host's mount namespace,
#     at most $FLEET_HOST_TMPFS_SIZE, default 4g)
#   * Debian's sshd, enabled at boot, listening only on the host's address, root login by key only
#
#   fleet-ns.sh net-up                    create bridge fleetbr0
#   fleet-ns.sh net-down                  delete it
#   fleet-ns.sh up   DIR NAME IP PUBKEY   boot host NAME at IP; DIR = its state dir; PUBKEY = root's authorized key
#   fleet-ns.sh exec DIR CMD...           run CMD in all the host's namespaces (systemctl, journalctl, ...)
#   fleet-ns.sh down DIR                  poweroff (SIGKILL fallback), remove its cgroups, veth and netns
#
# Inside a host: /etc/systemd/system = DIR/etc-systemd-system (starts empty at every boot, kept after down)
#   /usr/lib/systemd/system = DIR/vendor-units (targets, slices, journald, dbus, ssh only)
#   /run, /dev, /var/log/journal, /var/lib/systemd = private tmpfs; /sys and /proc/sys read-only
#   PID 1 logs to DIR/console.log
set -euo pipefail
SELF=$(realpath "$0")
BR=fleetbr0; BRIP=10.231.0.1; PFX=24

cg_list() {  # the cgroup dir of pid $1 in every hierarchy (cpuset skipped: it needs cpus/mems set up)
  local line ctrl path h
  while IFS= read -r line; do
    IFS=: read -r _ ctrl path <<<"$line"
    case "$ctrl" in "") h=unified;; *cpuset*) continue;; name=*) h=${ctrl#name=};; *) h=$ctrl;; esac
    [ "$h" = unified ] && [ "$(stat -fc %T /sys/fs/cgroup)" = cgroup2fs ] && h=.
    [ -d "/sys/fs/cgroup/$h" ] || continue
    echo "/sys/fs/cgroup/$h${path%/}"
  done < "/proc/$1/cgroup"
}

make_units() {  # the only units the host's systemd sees besides DIR/etc-systemd-system
  local D=$1 S=/usr/lib/systemd/system u
  rm -rf "$D"; mkdir -p "$D/sockets.target.wants" "$D/sysinit.target.wants" "$D/multi-user.target.wants"
  cp -a $S/*.target $S/*.slice "$D/"
  for u in systemd-journald.service systemd-journald.socket systemd-journald-dev-log.socket \
           systemd-poweroff.service systemd-halt.service systemd-reboot.service systemd-exit.service \
           dbus.service dbus.socket ssh.service; do
    if [ -e "$S/$u" ]; then cp -a "$S/$u" "$D/"; fi
  done
  [ -e "$D/ssh.service" ] || { echo "ssh.service missing: apt-get install openssh-server" >&2; return 1; }
  ln -s /dev/null "$D/systemd-journald-audit.socket"  # masked: journald would enable kernel audit (global)
  ln -s ../systemd-journald.socket ../systemd-journald-dev-log.socket "$D/sockets.target.wants/"
  if [ -e "$D/dbus.socket" ]; then ln -s ../dbus.socket "$D/sockets.target.wants/"; fi
  ln -s ../systemd-journald.service "$D/sysinit.target.wants/"
  ln -s ../ssh.service "$D/multi-user.target.wants/"
  ln -sf multi-user.target "$D/default.target"
}

seed() {  # per-host files, copied into the overlay before boot (host key and machine-id survive reboots)
  local B=$1 NAME=$2 IP=$3 PUB=$4 S=$1/seed
  mkdir -p "$S/etc/ssh/sshd_config.d" "$S/etc/ssh/authorized_keys.d" "$S/var/lib/dbus"
  ln -sfn /etc/machine-id "$S/var/lib/dbus/machine-id"   # ansible_machine_id reads this one first
  echo "$NAME" > "$S/etc/hostname"
  printf '127.0.0.1\tlocalhost\n%s\t%s\n' "$IP" "$NAME" > "$S/etc/hosts"
  [ -s "$S/etc/machine-id" ] || { od -An -N16 -tx1 /dev/urandom | tr -d ' \n'; echo; } > "$S/etc/machine-id"
  [ -e "$S/etc/ssh/ssh_host_ed25519_key" ] || ssh-keygen -q -t ed25519 -N '' -C "root@$NAME" -f "$S/etc/ssh/ssh_host_ed25519_key"
  cat > "$S/etc/ssh/sshd_config.d/00-fleet.conf" <<EOF
# fleet test bed: first value wins, this file is included before the Debian defaults
ListenAddress $IP
HostKey /etc/ssh/ssh_host_ed25519_key
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
AuthorizedKeysFile /etc/ssh/authorized_keys.d/%u
UseDNS no
EOF
  install -m 600 "$PUB" "$S/etc/ssh/authorized_keys.d/root"
}

inner() {  # runs as PID 1 of the new namespaces (already inside netns fleet-NAME)
  local B=$1 R n cgmode v1 hasunified=0
  cgmode=$(stat -fc %T /sys/fs/cgroup)
  v1=$(awk -v ctl="$(awk 'NR>1{printf "%s ", $1}' /proc/cgroups)" '$3=="cgroup" {
          n=split($4,o,","); opts=""; split(ctl,c," "); for(i in c) isc[c[i]]=1
          for(i=1;i<=n;i++) if (o[i] ~ /^name=/ || (o[i] in isc)) opts=opts (opts==""?"":",") o[i]
          if (opts !~ /cpuset/) print $2, opts }' /proc/self/mounts)
  if awk '$2=="/sys/fs/cgroup/unified" && $3=="cgroup2" {f=1} END {exit !f}' /proc/self/mounts; then hasunified=1; fi
  # tmpfs on /run first: mount(8) would otherwise write /run/mount/utab on the machine's /run
  mount -n -t tmpfs -o nosuid,nodev,mode=755 tmpfs /run
  # copy-on-write root: upper+work on a tmpfs (a separate superblock, so lower=/ does not overlap)
  mount -t tmpfs -o mode=755,size=${FLEET_HOST_TMPFS_SIZE:-4g} fleetovl "$B/ovl"
  mkdir -p "$B/ovl/upper" "$B/ovl/work" "$B/ovl/root"
  mount -t overlay overlay -o "lowerdir=/,upperdir=$B/ovl/upper,workdir=$B/ovl/work" "$B/ovl/root"
  R=$B/ovl/root
  cp -a "$B/seed/." "$R/"
  mount -n -t tmpfs -o nosuid,nodev,mode=755 tmpfs "$R/run"
  mount -t proc -o nosuid,nodev,noexec proc "$R/proc"
  mount --bind "$R/proc/sys" "$R/proc/sys"; mount -o remount,bind,ro,nosuid,nodev,noexec "$R/proc/sys"
  if [ -e "$R/proc/sysrq-trigger" ]; then mount --bind "$R/proc/sysrq-trigger" "$R/proc/sysrq-trigger"; mount -o remount,bind,ro "$R/proc/sysrq-trigger"; fi
  mount -t sysfs -o ro,nosuid,nodev,noexec sysfs "$R/sys"     # fresh: /sys/class/net shows this netns only
  if [ "$cgmode" = cgroup2fs ]; then                          # pure cgroup v2 machine
    mount -t cgroup2 -o nosuid,nodev,noexec cgroup2 "$R/sys/fs/cgroup"
  else                                                        # hybrid machine: same hierarchies, rooted at our cgroupns
    mount -t tmpfs -o nosuid,nodev,noexec,mode=755 tmpfs "$R/sys/fs/cgroup"
    while read -r mp opts; do
      [ -n "$mp" ] || continue
      case "$opts" in name=*) opts="none,$opts";; esac
      mkdir -p "$R$mp"; mount -t cgroup -o "nosuid,nodev,noexec,$opts" cgroup "$R$mp"
    done <<< "$v1"
    if [ $hasunified = 1 ]; then mkdir -p "$R/sys/fs/cgroup/unified"; mount -t cgroup2 -o nosuid,nodev,noexec cgroup2 "$R/sys/fs/cgroup/unified"; fi
    mount -o remount,ro,bind "$R/sys/fs/cgroup"
  fi
  mount -t tmpfs -o nosuid,mode=755,size=4m tmpfs "$R/dev"
  mknod -m 666 "$R/dev/null" c 1 3; mknod -m 666 "$R/dev/zero" c 1 5; mknod -m 666 "$R/dev/full" c 1 7
  mknod -m 666 "$R/dev/random" c 1 8; mknod -m 666 "$R/dev/urandom" c 1 9; mknod -m 666 "$R/dev/tty" c 5 0
  mkdir "$R/dev/pts" "$R/dev/shm" "$R/dev/mqueue"
  mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts "$R/dev/pts"; ln -s pts/ptmx "$R/dev/ptmx"
  mount -t tmpfs -o nosuid,nodev,mode=1777 tmpfs "$R/dev/shm"
  ln -s /proc/self/fd "$R/dev/fd"; ln -s /proc/self/fd/0 "$R/dev/stdin"; ln -s /proc/self/fd/1 "$R/dev/stdout"; ln -s /proc/self/fd/2 "$R/dev/stderr"
  touch "$R/dev/console"; mount --bind "$B/console.log" "$R/dev/console"
  mkdir -p "$R/run/systemd/journald.conf.d" "$R/run/lock"
  printf '[Journal]\nStorage=volatile\n' > "$R/run/systemd/journald.conf.d/volatile.conf"
  for n in /var/log/journal /var/lib/systemd; do if [ -d "$R$n" ]; then mount -t tmpfs -o mode=755 tmpfs "$R$n"; fi; done
  mount --bind "$B/etc-systemd-system" "$R/etc/systemd/system"
  mount --bind "$B/vendor-units" "$R/usr/lib/systemd/system"
  mkdir -p "$R/run/fleet-empty" "$R/run/.oldroot"
  # the overlay becomes / and the copied mount tree of the machine is detached (it holds the other
  # hosts' /run/netns/* mounts, which would keep their netns alive after 'ip netns del')
  cd "$R"; pivot_root . run/.oldroot; umount -l /run/.oldroot; rmdir /run/.oldroot; cd /
  # shared propagation, as systemd sets it when the kernel boots it (under a container manager it leaves that to
  # the manager): what systemd mounts for a service in a namespace of its own, such as the service's credentials
  # (LoadCredential= -> /run/credentials/UNIT), reaches PID 1's view and the service only this way (without it a
  # DynamicUser= service gets "Permission denied" on its own credential). Within this host's mount namespace only:
  # unshare made every mount here a private copy, so nothing propagates to the machine or the other hosts.
  mount --make-rshared /
  exec env -i container=fleet-ns PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
       SYSTEMD_GENERATOR_PATH=/run/fleet-empty SYSTEMD_ENVIRONMENT_GENERATOR_PATH=/run/fleet-empty \
       /usr/lib/systemd/systemd --log-target=console --show-status=no
}

ours() {  # print the PID 1 of host DIR if it is still the systemd started by its launcher (guards PID reuse)
  local B=$1 P L
  P=$(cat "$B/pid" 2>/dev/null) && L=$(cat "$B/launcher.pid" 2>/dev/null) || return 1
  [ "$(cat "/proc/$P/comm" 2>/dev/null)" = systemd ] && [ "$(cat "/proc/$L/comm" 2>/dev/null)" = unshare ] \
    && [ "$(ps -o ppid= -p "$P" | tr -d ' ')" = "$L" ] && echo "$P"
}
nsx() { local P; P=$(ours "$1") || { echo "$1: not running" >&2; return 1; }; shift; nsenter -t "$P" -m -p -u -i -n -C -- "$@"; }
gone() { local s; s=$(ps -o stat= -p "$1" 2>/dev/null) || return 0; [[ $s == Z* ]]; }   # exited (zombie counts)

net_up() {
  ip link show $BR >/dev/null 2>&1 && return 0
  ip link add $BR type bridge; ip link set $BR addrgenmode none   # IPv4 only: no IPv6 link-local chatter
  ip addr add $BRIP/$PFX dev $BR; ip link set $BR up
}
net_down() {
  if [ -n "$(ip link show master $BR 2>/dev/null)" ]; then echo "$BR still has hosts attached; kept" >&2; return 1; fi
  if ip link show $BR >/dev/null 2>&1; then ip link del $BR; fi
  # 'ip netns add' leaves /run/netns bind-mounted on itself; undo it when no netns is left (-n: no utab)
  if [ -d /run/netns ] && [ -z "$(ls -A /run/netns)" ]; then umount -n /run/netns 2>/dev/null || true; rmdir /run/netns; fi
}

up() {
  local B=$1 NAME=$2 IP=$3 PUB=$4 L P d st CG NS=fleet-$2 V=fv-$2 T0
  T0=$(date +%s%N)
  if ours "$B" >/dev/null; then echo "$NAME: already up" >&2; return 1; fi
  ip link show $BR >/dev/null 2>&1 || { echo "bridge $BR missing: run net-up" >&2; return 1; }
  rm -rf "$B/etc-systemd-system"   # every boot is a fresh host (the overlay upper is a tmpfs)
  mkdir -p "$B/etc-systemd-system" "$B/ovl"; : > "$B/console.log"
  make_units "$B/vendor-units"; seed "$B" "$NAME" "$IP" "$PUB"
  # network first, so sshd can bind its address as soon as systemd starts it; no default route
  rm -f "$B/netns" "$B/veth"   # down deletes what these name: write them only once created here
  ip netns add "$NS"; echo "$NS" > "$B/netns"
  ip link add "$V" type veth peer name eth0 netns "$NS"; echo "$V" > "$B/veth"
  ip link set "$V" addrgenmode none; ip -n "$NS" link set eth0 addrgenmode none
  ip link set "$V" master $BR up
  ip -n "$NS" link set lo up; ip -n "$NS" addr add "$IP/$PFX" dev eth0; ip -n "$NS" link set eth0 up
  # payload cgroup CG (becomes the cgroupns root) and CG.sup (parks the launcher) in every hierarchy
  CG=fleetns-$(echo -n "$B" | md5sum | cut -c1-8)
  : > "$B/cgroups"
  for d in $(cg_list $$); do mkdir -p "$d/$CG" "$d/$CG.sup"; printf '%s\n%s\n' "$d/$CG" "$d/$CG.sup" >> "$B/cgroups"; done
  # the launcher joins CG everywhere and the netns, then becomes unshare, whose child is the host's PID 1
  setsid bash -c 'for d in $(grep -v "\.sup$" "$1/cgroups"); do echo $$ > "$d/cgroup.procs"; done
                  exec nsenter --net=/run/netns/$3 -- unshare --pid --fork --mount --uts --ipc --cgroup --propagation private /bin/bash "$2" __inner "$1"' \
    _ "$B" "$SELF" "$NS" > "$B/launcher.log" 2>&1 < /dev/null &
  L=$!; echo "$L" > "$B/launcher.pid"
  P=
  for _ in $(seq 250); do
    if [ "$(cat "/proc/$L/comm" 2>/dev/null)" = unshare ]; then P=$(pgrep -P "$L" 2>/dev/null | head -1 || true); [ -n "$P" ] && break; fi
    sleep 0.02
  done
  [ -n "$P" ] || { echo "$NAME: no PID 1; see $B/launcher.log" >&2; cat "$B/launcher.log" >&2; down "$B"; return 1; }
  echo "$P" > "$B/pid"
  for d in $(grep '\.sup$' "$B/cgroups"); do echo "$L" > "$d/cgroup.procs" 2>/dev/null || true; done
  for _ in $(seq 300); do
    st=$(nsx "$B" systemctl is-system-running 2>/dev/null || true)
    case "$st" in running|degraded)
      echo "$NAME: up in $(( ($(date +%s%N) - T0) / 1000000 )) ms (pid $P, $st), ssh $(nsx "$B" systemctl is-active ssh.service || true) on $IP"
      return 0;; esac
    kill -0 "$P" 2>/dev/null || break; sleep 0.05
  done
  echo "$NAME: systemd did not come up (state '$st')" >&2; cat "$B/launcher.log" "$B/console.log" >&2; down "$B"; return 1
}

down() {
  local B=$1 L P d left f p
  L=$(cat "$B/launcher.pid" 2>/dev/null || true)
  if P=$(ours "$B"); then
    timeout 5 nsenter -t "$P" -m -p -u -i -n -C -- systemctl poweroff --no-block >/dev/null 2>&1 || kill -s SIGRTMIN+4 "$P" 2>/dev/null || true
    for _ in $(seq 300); do gone "$P" && break; sleep 0.05; done
    if ! gone "$P"; then echo "$B: poweroff timed out, SIGKILL to its PID 1" >&2; kill -KILL "$P"; fi
  fi
  if [ -n "$L" ] && [ "$(cat "/proc/$L/comm" 2>/dev/null)" = unshare ]; then
    for _ in $(seq 100); do gone "$L" && break; sleep 0.05; done
  fi
  if [ -f "$B/cgroups" ]; then
    # whatever is still inside the host's own sub-cgroups is ours by construction (for example when the pid
    # file was lost, so the poweroff above never ran): SIGKILL it by PID
    for _ in 1 2 3; do
      left=$(while read -r d; do if [ -d "$d" ]; then find "$d" -name cgroup.procs -exec cat {} + 2>/dev/null; fi; done < "$B/cgroups" | sort -u)
      [ -n "$left" ] || break
      for p in $left; do kill -KILL "$p" 2>/dev/null || true; done
      sleep 0.1
    done
    for _ in $(seq 50); do
      left=0
      while read -r d; do
        if [ -d "$d" ]; then find "$d" -depth -type d -exec rmdir {} + 2>/dev/null || true; fi
        if [ -d "$d" ]; then left=1; fi
      done < "$B/cgroups"
      [ $left = 0 ] && break; sleep 0.1
    done
    while read -r d; do if [ -d "$d" ]; then echo "WARN: leftover cgroup $d" >&2; fi; done < "$B/cgroups"
  fi
  # deleting the veth is synchronous; the netns itself is freed by the kernel in the background
  f=$(cat "$B/veth" 2>/dev/null || true);  if [ -n "$f" ] && ip link show "$f" >/dev/null 2>&1; then ip link del "$f"; fi
  f=$(cat "$B/netns" 2>/dev/null || true); if [ -n "$f" ] && [ -e "/run/netns/$f" ]; then ip netns del "$f"; fi
  rm -f "$B/pid" "$B/launcher.pid" "$B/netns" "$B/veth"
}

case "${1:-}" in
  __inner)  inner "$2" ;;
  net-up)   net_up ;;
  net-down) net_down ;;
  up)    [ $# = 5 ] || { echo "usage: $0 up DIR NAME IP PUBKEY" >&2; exit 2; }
         mkdir -p "$2"; up "$(realpath "$2")" "$3" "$4" "$(realpath "$5")" ;;
  down)  down "$(realpath "$2")" ;;
  exec)  B=$(realpath "$2"); shift 2; nsx "$B" "$@" ;;
  *) echo "usage: $0 net-up|net-down|up DIR NAME IP PUBKEY|exec DIR CMD...|down DIR" >&2; exit 2 ;;
esac
