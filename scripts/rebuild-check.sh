#!/usr/bin/env bash
# make rebuild-check [BUNDLE=path] [CONFIG=path] [KEYS=dir]
# Rebuild a bundle's venv from its own wheels with no network at all (an empty network namespace, pip with
# --no-index --require-hashes) and compare every native library of the rebuilt venv with the one packed, by
# SHA-256 (`deploytool rebuild --offline`). Exit 0: all identical; 7: some differ (listed); otherwise the CLI's
# own exit code (5 no bundle/config, 6 bad bundle or signature, ...).
#   BUNDLE  a bundle archive or directory; default: the newest one in the config's artifacts/
#   CONFIG  the config it was packed from; default: $DEPLOYTOOL_CONFIG, else ./deploytool.yaml
#   KEYS    the trusted public keys; default: the keys/ beside the config if it is there, else paths.keys_dir
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
DT="$here/.venv/bin/deploytool"
CONFIG="${CONFIG:-${DEPLOYTOOL_CONFIG:-$PWD/deploytool.yaml}}"
BUNDLE="${BUNDLE:-${1:-}}"
KEYS="${KEYS:-}"

die() { printf 'error: %s\n' "$1" >&2; [ -n "${2:-}" ] && printf 'hint: %s\n' "$2" >&2; exit "${3:-5}"; }

[ -f "$CONFIG" ] || die "config not found: $CONFIG" "pass CONFIG=path/to/deploytool.yaml (the config the bundle was packed from)"
cfgdir="$(cd "$(dirname "$CONFIG")" && pwd)"
if [ -z "$BUNDLE" ]; then
  # the newest bundle archive or directory (one holding a MANIFEST) in the config's artifacts/
  BUNDLE="$(ls -dt "$cfgdir"/artifacts/*.tar.zst "$cfgdir"/artifacts/*.tar "$cfgdir"/artifacts/*/MANIFEST 2>/dev/null \
            | head -1 || true)"
  BUNDLE="${BUNDLE%/MANIFEST}"
  [ -n "$BUNDLE" ] || die "no bundle in $cfgdir/artifacts" "run \`deploytool pack\` first, or pass BUNDLE=path"
fi
[ -e "$BUNDLE" ] || die "bundle not found: $BUNDLE" "pass BUNDLE=path to a bundle archive or directory"
args=(--config "$CONFIG" rebuild --offline "$BUNDLE")
if [ -n "$KEYS" ]; then args+=(--keys "$KEYS"); elif [ -d "$cfgdir/keys" ]; then args+=(--keys "$cfgdir/keys"); fi
# no network: not a promise of pip's flags alone, a network namespace with nothing in it
unshare --net -- true 2>/dev/null \
  || die "cannot create an empty network namespace (unshare --net) to rebuild offline" "run as root" 17
echo "rebuilding $BUNDLE offline (empty network namespace) and comparing its native libraries" >&2
exec unshare --net -- "$DT" "${args[@]}"
