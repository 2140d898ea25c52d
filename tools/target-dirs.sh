#!/usr/bin/env bash
# Usage: target-dirs.sh CACHE_DIR CHECKOUT TARGET_DIR...
# Records CHECKOUT in each TARGET_DIR (as `.checkout`), then deletes every CACHE_DIR/target-*
# whose recorded checkout no longer exists. A target dir with no record is never touched.
set -euo pipefail
cache=$1 checkout=$2
shift 2
for dir in "$@"; do
  mkdir -p "$dir"
  printf '%s\n' "$checkout" >"$dir/.checkout"
done
for record in "$cache"/target-*/.checkout; do
  [ -f "$record" ] || continue
  owner=$(head -n1 "$record")
  if [ -n "$owner" ] && [ ! -d "$owner" ]; then
    echo "removing $(dirname "$record"): its checkout $owner is gone"
    rm -rf "$(dirname "$record")"
  fi
done
# A full `make test` needs about 15 GiB of its own (target dir, images, the test node's files);
# below that, say so now rather than through a node under DiskPressure much later.
free_kib=$(df -Pk "$cache" | awk 'NR==2 {print $4}')
if [ -n "$free_kib" ] && [ "$free_kib" -lt $((15 * 1024 * 1024)) ]; then
  echo "warning: only $((free_kib / 1024 / 1024)) GiB free under $cache; a full make test needs about 15 GiB" >&2
fi
