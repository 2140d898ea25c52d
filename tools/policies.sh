#!/usr/bin/env bash
# Checks, tests and builds the admission policies (policies/*.rego) with the pinned `opa`:
# `opa check --strict`, `opa fmt` (no diff allowed), `opa test`, then `opa build -t wasm` of the
# two entrypoints into one bundle (policy.wasm + data.json), written atomically to $1.
#
#   tools/policies.sh OUT.tar.gz
set -euo pipefail

out=${1:?usage: $0 OUT.tar.gz}
here=$(cd "$(dirname "$0")" && pwd)
src="$here/../policies"
"$here/build.sh" opa
opa="$("$here/build.sh" dir opa)/opa"

"$opa" check --strict "$src"
unformatted=$("$opa" fmt --list "$src")
if [[ -n $unformatted ]]; then
  echo "not opa-formatted (run: $opa fmt -w policies/):" >&2
  echo "$unformatted" >&2
  exit 1
fi
"$opa" test "$src"

mkdir -p "$(dirname "$out")"
tmp=$(mktemp "$out.XXXXXX")
trap 'rm -f "$tmp"' EXIT
"$opa" build --target wasm \
  --entrypoint pko/admission/decision \
  --entrypoint pko/defaults/patch \
  --ignore '*_test.rego' \
  --output "$tmp" "$src"
mv "$tmp" "$out"
echo "policy bundle: $out" >&2
