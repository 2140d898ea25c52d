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
