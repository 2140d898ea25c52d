#!/usr/bin/env bash
# The Python and JavaScript transform plugins: their component toolchains, pinned and installed
# from the registries into the tools cache, and the builds, cached by content.
#
#   tools/guest-plugins.sh install py|js            installs the toolchain once (idempotent)
#   tools/guest-plugins.sh dir py|js                prints the toolchain's bin folder
#   tools/guest-plugins.sh build py SRC_DIR OUT     componentize-py: SRC_DIR/app.py → OUT
#   tools/guest-plugins.sh build js SRC_FILE OUT    componentize-js: the ES module → OUT
#
# The WIT is the plugin's own copy (`wit/` beside its sources, kept equal to the repository's
# by a test), so a plugin folder copied out of this repository builds the same way.
#
# Toolchains: componentize-py from tools/guest-toolchains/requirements.txt (a venv), and
# componentize-js with jco from tools/guest-toolchains/package.json, pinned with every transitive
# package by its package-lock.json (`npm ci`). Each lands in a folder named by its versions (and
# the lock's hash), completed by a stamp file, so a bump installs anew and a half-done install is
# redone. Cold: ~5 s (py, 72 MB) and ~25 s (js, 390 MB) on 2 cores.
#
# A build is keyed by the sha256 of its sources, the WIT and the toolchain pins: an unchanged
# plugin is copied from $CACHE_DIR/guest-plugins/ (componentize-py and componentize-js do not
# build byte-identical components twice, so rebuilding would also change the module's digest).
# Cold: ~12 s (py) and ~8 s (js).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache=${PKO_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pko-rs/tools}
builds=${PKO_GUEST_BUILD_CACHE:-$(dirname "$cache")/guest-plugins}
pins=$here/guest-toolchains

py_version() { sed -n 's/^componentize-py==//p' "$pins/requirements.txt"; }
js_key() { cat "$pins/package.json" "$pins/package-lock.json" | sha256sum | cut -c1-12; }

dir_for() {
  case $1 in
    py) echo "$cache/componentize-py-$(py_version)" ;;
    js) echo "$cache/componentize-js-$(js_key)" ;;
    *) echo "unknown toolchain: $1 (py or js)" >&2; exit 2 ;;
  esac
}

install_py() {
  local out; out=$(dir_for py)
  [[ -f $out/.complete ]] && return
  command -v python3 >/dev/null || { echo "python3 not found: it runs componentize-py" >&2; exit 1; }
  echo "installing componentize-py $(py_version) into $out" >&2
  # A venv records its own path, so it is built in place; the stamp marks it complete.
  rm -rf "$out"
  python3 -m venv "$out"
  "$out/bin/pip" install --quiet --disable-pip-version-check --no-input -r "$pins/requirements.txt"
  touch "$out/.complete"
}

install_js() {
  local out; out=$(dir_for js)
  [[ -f $out/.complete ]] && return
  command -v npm >/dev/null || { echo "npm not found: it installs componentize-js" >&2; exit 1; }
  echo "installing componentize-js and jco (tools/guest-toolchains/package-lock.json) into $out" >&2
  rm -rf "$out" "$out.tmp"
  mkdir -p "$out.tmp"
  cp "$pins/package.json" "$pins/package-lock.json" "$out.tmp/"
  (cd "$out.tmp" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
  touch "$out.tmp/.complete"
  mv "$out.tmp" "$out"
}

# The sha256 of everything a build reads: its sources, the WIT, the pins and this script.
build_key() {
  local kind=$1 src=$2 dir=$2
  [[ -d $dir ]] || dir=$(dirname "$src")
  {
    echo "$kind $(basename "$src")"
    find "$dir" -type f \( -name '*.py' -o -name '*.js' -o -name '*.mjs' \) -not -path '*/__pycache__/*' |
      LC_ALL=C sort | while read -r f; do echo "${f#"$dir"}"; cat "$f"; done
    cat "$(wit_of "$src")"/*.wit "$pins/requirements.txt" "$pins/package-lock.json" "$here/guest-plugins.sh"
  } | sha256sum | cut -c1-16
}

# The plugin's WIT folder: `wit/` in its folder (or in the folder of its JS file).
wit_of() {
  local dir=$1
  [[ -d $dir ]] || dir=$(dirname "$dir")
  [[ -d $dir/wit ]] || { echo "no WIT folder: $dir/wit (copy the repository's wit/ there)" >&2; exit 1; }
  (cd "$dir/wit" && pwd)
}

build() {
  local kind=$1 src=$2 out=$3 key cached
  [[ -e $src ]] || { echo "no such source: $src" >&2; exit 1; }
  key=$(build_key "$kind" "$src")
  local wit; wit=$(wit_of "$src")
  mkdir -p "$builds" "$(dirname "$out")"
  cached=$builds/$(basename "$out" .wasm)-$key.wasm
  if [[ ! -f $cached ]]; then
    "install_$kind"
    local tmp; tmp=$(mktemp "$builds/.build.XXXXXX")
    local bin; bin=$(dir_for "$kind")
    case $kind in
      py)
        echo "componentize-py: $src → $out" >&2
        # Only the plugin's own folder is on the Python path (no site-packages of the venv).
        (cd "$src" && "$bin/bin/componentize-py" -q -d "$wit" -w plugin componentize app \
          -p . -o "$tmp")
        ;;
      js)
        echo "componentize-js: $src → $out" >&2
        # No HTTP client and no fetch event: the plugin would import wasi:http, which the host
        # refuses.
        "$bin/node_modules/.bin/componentize-js" "$src" --wit "$wit" -n plugin \
          --disable http fetch-event -o "$tmp" >/dev/null
        ;;
    esac
    chmod 0644 "$tmp" && mv "$tmp" "$cached"
  fi
  cp "$cached" "$out.tmp" && mv "$out.tmp" "$out"
}

case ${1:-} in
  install) "install_${2:?py or js}" ;;
  dir)
    d=$(dir_for "${2:?py or js}")
    case $2 in py) echo "$d/bin" ;; js) echo "$d/node_modules/.bin" ;; esac
    ;;
  build) build "${2:?py or js}" "${3:?source}" "${4:?output}" ;;
  *) echo "usage: $0 install|dir py|js | build py|js SRC OUT" >&2; exit 2 ;;
esac
