#!/bin/bash
# Mount setup for the deploytool systemd sandbox; run by deploy_tool/rehearsal/sandbox.py, never by hand.
#
#   sandbox_init.sh launch DIR   join DIR's payload sub-cgroups (listed in DIR/cgroups, one path a line, the
#                                 support ones end in .sup and are skipped), then become `unshare`, whose
#                                 forked child runs `inner` as PID 1 of fresh pid/mount/uts/ipc/cgroup namespaces
#   sandbox_init.sh inner  DIR   private /run, /proc, read-only /proc/sys and /sys, cgroup hierarchies rooted at
#                                 the namespace, private /dev (with the machine's NVIDIA nodes re-created, when it
#                                 has any), volatile journal, DIR/etc-systemd-system over /etc/systemd/system,
#                                 DIR/vendor-units over /usr/lib/systemd/system, then exec the real systemd with
#                                 generators disabled
#
# DIR/systemd-root, when present, names a tree holding an unpacked systemd (sandbox up --systemd-root): its
# lib/systemd is bound over /usr/lib/systemd and DIR/ld.so.cache over /etc/ld.so.cache, inside only.
#
# DIR/cgroup-mounts (written by sandbox.py from the host's mount table) holds one "MOUNTPOINT OPTIONS" line per
# legacy (v1) hierarchy to re-mount inside, plus "unified" when a hybrid host has cgroup2 at
# /sys/fs/cgroup/unified, or the single line "cgroup2" on a pure cgroup2 host.
set -euo pipefail

launch() {
  local B=$1 d
  while IFS= read -r d; do
    case "$d" in *.sup|"") continue ;; esac
    echo $$ > "$d/cgroup.procs"
  done < "$B/cgroups"
  exec unshare --pid --fork --mount --uts --ipc --cgroup --propagation private \
    /bin/bash "${BASH_SOURCE[0]}" inner "$B"
}

inner() {
  local B=$1 mp opts n SYSTEMD SD="" nv nvn mode uid gid ma mi
  if [ -s "$B/systemd-root" ]; then
    SD=$(head -n1 "$B/systemd-root")
    if [ -f /etc/ld.so.cache ]; then mount --bind "$B/ld.so.cache" /etc/ld.so.cache; fi
    mount --bind "$SD/lib/systemd" /usr/lib/systemd
  fi
  # the machine's NVIDIA nodes, read before the private /dev hides them: "PATH MODE UID GID MAJOR MINOR" (hex)
  nv=$(for n in /dev/nvidia* /dev/nvidia-caps/*; do [ -c "$n" ] && stat -c '%n %a %u %g %t %T' "$n"; done 2>/dev/null || true)
  # /run first: on some hosts it is on disk, and mount(8) would otherwise create /run/mount/ there
  mount -n -t tmpfs -o nosuid,nodev,mode=755 tmpfs /run
  mount -t proc -o nosuid,nodev,noexec proc /proc
  # read-only: PID 1 would otherwise write machine-wide sysctls
  mount --bind /proc/sys /proc/sys
  mount -o remount,bind,ro,nosuid,nodev,noexec /proc/sys
  if [ -e /proc/sysrq-trigger ]; then
    mount --bind /proc/sysrq-trigger /proc/sysrq-trigger
    mount -o remount,bind,ro /proc/sysrq-trigger
  fi
  mount --bind /sys /sys                                  # also hides the host's cgroup mounts
  mount -o remount,bind,ro,nosuid,nodev,noexec /sys
  if [ "$(head -n1 "$B/cgroup-mounts")" = cgroup2 ]; then
    mount -t cgroup2 -o nosuid,nodev,noexec cgroup2 /sys/fs/cgroup
  else
    mount -t tmpfs -o nosuid,nodev,noexec,mode=755 tmpfs /sys/fs/cgroup
    while read -r mp opts; do
      [ -n "$mp" ] || continue
      if [ "$mp" = unified ]; then
        mkdir -p /sys/fs/cgroup/unified
        mount -t cgroup2 -o nosuid,nodev,noexec cgroup2 /sys/fs/cgroup/unified
        continue
      fi
      case "$opts" in name=*) opts="none,$opts" ;; esac
      mkdir -p "$mp"
      mount -t cgroup -o "nosuid,nodev,noexec,$opts" cgroup "$mp"
    done < "$B/cgroup-mounts"
    mount -o remount,ro,bind /sys/fs/cgroup
  fi
  mount -t tmpfs -o nosuid,mode=755,size=4m tmpfs /dev
  mknod -m 666 /dev/null c 1 3
  mknod -m 666 /dev/zero c 1 5
  mknod -m 666 /dev/full c 1 7
  mknod -m 666 /dev/random c 1 8
  mknod -m 666 /dev/urandom c 1 9
  mknod -m 666 /dev/tty c 5 0
  mkdir /dev/pts /dev/shm /dev/mqueue
  mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts /dev/pts
  ln -s pts/ptmx /dev/ptmx
  mount -t tmpfs -o nosuid,nodev,mode=1777 tmpfs /dev/shm
  ln -s /proc/self/fd /dev/fd
  ln -s /proc/self/fd/0 /dev/stdin
  ln -s /proc/self/fd/1 /dev/stdout
  ln -s /proc/self/fd/2 /dev/stderr
  touch /dev/console
  mount --bind "$B/console.log" /dev/console
  if [ -n "$nv" ]; then
    # same major:minor, mode and owner as the machine's; /dev/char/MAJ:MIN as udev makes them (nvidia-modprobe
    # updates these links and fails where it cannot)
    mkdir -p /dev/char
    while read -r nvn mode uid gid ma mi; do
      mkdir -p "$(dirname "$nvn")"
      mknod -m "$mode" "$nvn" c $((16#$ma)) $((16#$mi))
      chown "$uid:$gid" "$nvn"
      ln -sf "../${nvn#/dev/}" "/dev/char/$((16#$ma)):$((16#$mi))"
    done <<< "$nv"
  fi
  mkdir -p /run/systemd/journald.conf.d /run/lock
  printf '[Journal]\nStorage=volatile\n' > /run/systemd/journald.conf.d/volatile.conf
  if [ -n "$SD" ]; then
    # the services' PATH finds SD's systemctl and journalctl (deploytool's failover and liveness call them)
    mkdir -p /run/systemd/system.conf.d
    printf '[Manager]\nDefaultEnvironment="PATH=%s/bin:%s/usr/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"\n' \
      "$SD" "$SD" > /run/systemd/system.conf.d/sandbox-path.conf
  fi
  for n in /var/log/journal /var/lib/systemd; do
    if [ -d "$n" ]; then mount -t tmpfs -o mode=755 tmpfs "$n"; fi
  done
  mount --bind "$B/etc-systemd-system" /etc/systemd/system
  mount --bind "$B/vendor-units" /usr/lib/systemd/system
  # shared propagation, as systemd sets it when the kernel boots it (under a container manager it leaves that to
  # the manager): what systemd mounts for a service in a namespace of its own, such as the service's credentials
  # (LoadCredential= -> /run/credentials/UNIT), reaches PID 1's view and the service only this way. Within this
  # namespace only: unshare above made every mount here a private copy, so nothing propagates to the host.
  mount --make-rshared /
  SYSTEMD=/usr/lib/systemd/systemd
  [ -x "$SYSTEMD" ] || SYSTEMD=/lib/systemd/systemd
  exec env -i container=deploytool-sandbox PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 SYSTEMD_GENERATOR_PATH="$B/empty" SYSTEMD_ENVIRONMENT_GENERATOR_PATH="$B/empty" \
    "$SYSTEMD" --log-target=journal-or-kmsg --show-status=no
}

case "${1:-}" in
  launch) launch "$2" ;;
  inner) inner "$2" ;;
  *) echo "usage: $0 launch|inner DIR (internal to deploytool sandbox)" >&2; exit 2 ;;
esac
