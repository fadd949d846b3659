#!/usr/bin/env bash
# `ansible-test sanity` of the deploytool.fleet collection (ansible/), the check Galaxy holds collections to, with
# the fleet test bed's pinned ansible-core (.cache/fleet-ansible). ansible-test wants the collection at
# ansible_collections/deploytool/fleet: this builds the collection's tarball with ansible-galaxy (what a user
# installs) and unpacks it into a throwaway directory of that shape, so it checks exactly what is published.
#
#   scripts/sanity.sh [ANSIBLE-TEST SANITY OPTIONS...]     e.g. --test validate-modules, --prime-venvs
#   COLLECTION=DIR scripts/sanity.sh                        check another source tree (the tests break a copy)
#
# ansible-test runs --local (no Docker here) on this machine's Python; each sanity test's own tools (pylint,
# pycodestyle, yamllint, voluptuous, ...) live in virtual environments it keeps under $HOME/.ansible/test/venv.
# HOME is .cache/ansible-test, which scripts/setup.sh fills (the sanity venvs, and the pip bootstrap ansible-test
# would otherwise download from a host these machines cannot reach): after `make setup`, this runs offline.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
bin=$repo/.cache/fleet-ansible/bin
src=${COLLECTION:-$repo/ansible}
[ -x "$bin/ansible-test" ] || { echo "sanity: $bin/ansible-test is missing: run make setup" >&2; exit 1; }
py=$("$bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
work=$(mktemp -d "${TMPDIR:-/tmp}/deploytool-sanity.XXXXXX")
trap 'rm -rf "$work"' EXIT
"$bin/ansible-galaxy" collection build "$src" --output-path "$work/build" >/dev/null
dest=$work/ansible_collections/deploytool/fleet
mkdir -p "$dest"
tar -xzf "$work"/build/deploytool-fleet-*.tar.gz -C "$dest"
cd "$dest"
# nothing of the caller's ansible configuration reaches the run
for v in $(compgen -e | grep '^ANSIBLE_' || true); do unset "$v"; done
HOME=$repo/.cache/ansible-test PATH="$bin:$PATH" "$bin/ansible-test" sanity --local --python "$py" --color no "$@"
