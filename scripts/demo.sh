#!/usr/bin/env bash
# The whole story on this machine, with real parts: a real systemd (sandboxed as PID 1 of its own namespaces),
# real ftllm 0.1.8.2 and llama-server on CPU serving a tiny model, a real signed bundle.
#   pack -> install (ftllm-dflash) -> switch llamacpp -> switch ftllm -> an injected failure rolled back
#   -> status and history -> sandbox down. Leaves nothing running.
#
# The box (config, demo-root/, sandbox) is a directory of its own for this run under $DEPLOYTOOL_DEMO_ROOT
# (default /var/lib/deploytool-demo), removed at the end (DEPLOYTOOL_DEMO_KEEP=1 keeps it): not in the checkout,
# which may be under /tmp (hidden by the units' PrivateTmp=yes) or in a 0700 home (closed to the servers, which
# run as a DynamicUser as on the real box). A run killed before its clean-up is taken down by the next one.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DT="$ROOT/.venv/bin/deploytool"
BASE="${DEPLOYTOOL_DEMO_ROOT:-/var/lib/deploytool-demo}"

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
run() { printf '\033[2m$ deploytool %s\033[0m\n' "$*"; "$DT" "$@"; }
starttime() { [ -r "/proc/$1/stat" ] && sed 's/^.*) //' "/proc/$1/stat" | cut -d' ' -f20; }

# earlier runs that were killed (their owner process is gone): sandbox down, directory removed
mkdir -p "$BASE" && chmod 0755 "$BASE" || exit 1
for old in "$BASE"/run-*; do
  [ -f "$old/owner" ] || continue
  read -r opid ostart < "$old/owner" || continue
  [ "$(starttime "$opid")" = "$ostart" ] && continue  # still running
  if [ -f "$old/sandbox/.deploytool-sandbox" ]; then "$DT" sandbox down "$old/sandbox" >/dev/null 2>&1 || true; fi
  rm -rf "$old"
done
W="$(mktemp -d "$BASE/run-XXXXXXXX")" || exit 1
chmod 0755 "$W"
echo "$$ $(starttime $$)" > "$W/owner"
export DEPLOYTOOL_CONFIG="$W/deploytool.yaml"
mkdir -p "$W/models" "$ROOT/.cache/wheels-demo"
cleanup() {
  say "sandbox down (nothing left running)"
  rc=0
  if [ -f "$W/sandbox/.deploytool-sandbox" ]; then "$DT" sandbox down "$W/sandbox"; rc=$?; fi
  if [ -n "${DEPLOYTOOL_DEMO_KEEP:-}" ] || [ -z "$finished" ]; then
    echo "the demo box is kept in $W (the next make demo removes it)"
  elif [ $rc -eq 0 ]; then rm -rf "$W"; fi
}
finished=
trap cleanup EXIT

say "1. a config for this machine: both backends on CPU, same port and model name"
run init --example cpu-demo --out "$W/deploytool.yaml" || exit 1
# a port free right now rather than the example's 18082, which another box on this machine may be using
port="$("$ROOT/.venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
sed -i "s/^  port: 18082\b.*/  port: $port/" "$W/deploytool.yaml" && grep -q "^  port: $port\$" "$W/deploytool.yaml" || exit 1
ln -s "$ROOT/.cache/wheels-demo" "$W/wheels"
"$ROOT/.venv/bin/python" -m tests.support.tiny_model "$W/models/tiny-f16.gguf" --f16 || exit 1
run check || exit 1

say "2. lock the wheels and pack a signed, reproducible bundle"
run keygen --out "$W/keys" || exit 1
mkdir -p "$W/demo-root/etc/deploytool/keys" && cp "$W"/keys/*.pub "$W/demo-root/etc/deploytool/keys/"
run lock || exit 1
run pack || exit 1
run bundle verify "$(ls -d "$W"/artifacts/*.tar* | head -1)" --keys "$W/keys" || exit 1

say "3. a real systemd, sandboxed"
run sandbox up "$W/sandbox" || exit 1

say "4. install on the 'fresh box' (offline), default backend ftllm-dflash behind the health gate"
run install || exit 1
run status

say "5. switch to llama.cpp (the rollback target), then back"
run switch llamacpp || exit 1
run bench --kinds code,prose --runs 1 --max-tokens 64 || exit 1
run switch ftllm || exit 1
run status --deep

say "6. an injected failure: llamacpp-tensor crashes at start; the switch rolls back to ftllm-dflash"
mkdir -p "$W/sandbox/etc-systemd-system/llamacpp-tensor.service.d"
printf '[Service]\nExecStart=\nExecStart=/bin/sh -c "echo simulated crash: CUDA error on device 0 >&2; exit 3"\n' \
  > "$W/sandbox/etc-systemd-system/llamacpp-tensor.service.d/50-demo-crash.conf"
"$DT" sandbox exec "$W/sandbox" systemctl daemon-reload
echo "(a drop-in is drift: verify would refuse it; re-pin on purpose, with a reason, to let the crash happen)"
run pin llamacpp-tensor --reason "demo: inject a crash at start" || exit 1
run switch llamacpp; rc=$?
echo "exit code $rc (10 = rolled back, the previous backend serves again)"
[ $rc -eq 10 ] || { echo "expected exit 10"; exit 1; }
rm -rf "$W/sandbox/etc-systemd-system/llamacpp-tensor.service.d"
"$DT" sandbox exec "$W/sandbox" systemctl daemon-reload
run pin llamacpp-tensor --reason "demo: crash drop-in removed" || exit 1

say "7. status and history"
run status
run history
say "demo finished"
finished=1
