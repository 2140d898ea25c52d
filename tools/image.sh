#!/usr/bin/env bash
# Assembles the container images without a container daemon: each image is one layer tarred
# from a staging folder (fixed owners, modes and mtimes, so a rebuild of the same binaries has
# the same digest), added to an OCI layout with umoci. No base image: every binary is static,
# and /etc/passwd, /etc/group and the CA bundle are the only other files.
#
#   tools/image.sh deps              installs umoci, runc and ca-certificates (apt) when missing
#   tools/image.sh busybox           installs busybox-static (apt) unless /bin/busybox is a
#                                    static busybox (the agent image's sh, cp and ln)
#   tools/image.sh build DIST OUT    OCI layouts OUT/pko-rs and OUT/pko-rs-agent (tag latest) from
#                                    what `make dist dist-policies dist-plugins dist-pulumi
#                                    dist-rootfs` wrote to DIST; prints each manifest digest
#
# The Dockerfile's last two stages copy the same files to the same paths.
set -euo pipefail
umask 022
# shellcheck source=tools/apt.sh
. "$(dirname "$0")/apt.sh"

NONROOT=65532
TAG=latest

deps() {
  local missing=()
  command -v umoci >/dev/null || missing+=(umoci)
  command -v runc >/dev/null || missing+=(runc)
  [[ -f /etc/ssl/certs/ca-certificates.crt ]] || missing+=(ca-certificates)
  apt_install "${missing[@]}"
}

# Debian's busybox-static: one static binary, so it runs in an image with no libc.
busybox() {
  if [[ -x /bin/busybox ]] && ! LC_ALL=C readelf -l /bin/busybox 2>/dev/null | grep -q 'program interpreter'; then
    return
  fi
  # the agent image's sh, cp and ln
  apt_install busybox-static
}

# The files both images carry.
stage_base() {
  local root=$1
  install -D -m 0644 "$dist/passwd" "$root/etc/passwd"
  install -D -m 0644 "$dist/group" "$root/etc/group"
  install -D -m 0644 "$dist/ca-certificates.crt" "$root/etc/ssl/certs/ca-certificates.crt"
  install -d -m 1777 "$root/tmp"
}

# One uncompressed layer: everything root-owned, but the user's home.
layer() {
  local root=$1 tar=$2 home_owned=$3
  local opts=(--format=posix --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime
    --mtime="@$epoch" --numeric-owner --no-acls --no-xattrs --no-selinux)
  local top; top=$(cd "$root" && ls -A | LC_ALL=C sort)
  # shellcheck disable=SC2086 # the top-level names have no spaces
  tar -cf "$tar" -C "$root" --sort=name --owner=0 --group=0 "${opts[@]}" \
    --exclude=home/nonroot $top
  if [[ $home_owned == yes ]]; then
    tar -rf "$tar" -C "$root" --owner=$NONROOT --group=$NONROOT "${opts[@]}" home/nonroot
  fi
}

# image NAME ROOT HOME_OWNED umoci-config-flags…
image() {
  local name=$1 root=$2 home_owned=$3
  shift 3
  local layout=$out/$name created
  created=$(date -u -d "@$epoch" +%Y-%m-%dT%H:%M:%SZ)
  layer "$root" "$work/$name.tar" "$home_owned"
  rm -rf "$layout"
  umoci init --layout "$layout"
  umoci new --image "$layout:$TAG"
  umoci raw add-layer --image "$layout:$TAG" --history.created="$created" \
    --history.created_by="tools/image.sh" "$work/$name.tar"
  umoci config --image "$layout:$TAG" --no-history --created="$created" --author=pko-rs \
    --os=linux --architecture=amd64 --config.user=$NONROOT:$NONROOT --config.workingdir=/ "$@"
  umoci gc --layout "$layout"
  local digest size
  digest=$(jq -r '.manifests[0].digest' "$layout/index.json")
  size=$(du -sb "$layout/blobs" | cut -f1)
  printf '%s:%s %s (%s bytes, %s MiB compressed)\n' "$layout" "$TAG" "$digest" "$size" \
    "$((size / 1024 / 1024))"
}

build() {
  dist=${1:?DIST folder} out=${2:?output folder}
  # Every mtime and timestamp is the last commit's time, so the digests follow the sources.
  epoch=${SOURCE_DATE_EPOCH:-$(git -C "$(dirname "$0")" log -1 --format=%ct 2>/dev/null || echo 0)}
  mkdir -p "$out"
  work=$(mktemp -d "$out/.stage.XXXXXX")
  trap 'rm -rf "$work"' EXIT

  local op=$work/operator
  stage_base "$op"
  install -D -m 0755 "$dist/pko-operator" "$op/usr/local/bin/pko-operator"
  # The workspace pods' bootstrap container copies the agent from this image (as PKO's).
  install -D -m 0755 "$dist/pko-agent" "$op/usr/local/bin/pko-agent"
  install -D -m 0644 "$dist/policies.tar.gz" "$op/usr/local/share/pko-rs/policies.tar.gz"
  for wasm in default_tags naming_policy resource_allowlist; do
    install -D -m 0644 "$dist/plugins/$wasm.wasm" "$op/usr/local/share/pko-rs/plugins/$wasm.wasm"
  done
  image pko-rs "$op" no --config.env=PATH=/usr/local/bin \
    --config.entrypoint=/usr/local/bin/pko-operator \
    --config.exposedports=9090/tcp --config.exposedports=8081/tcp \
    --config.exposedports=8383/tcp --config.exposedports=9443/tcp

  local ag=$work/agent
  stage_base "$ag"
  # pulumi keeps its state and plugins under $HOME/.pulumi. Writable by any user, like /tmp:
  # the restricted workspace pods run as 1000:1000 (PKO's pulumi images' user), not 65532.
  install -d -m 1777 "$ag/home/nonroot"
  install -D -m 0755 "$dist/pko-agent" "$ag/usr/local/bin/pko-agent"
  install -D -m 0755 "$dist/pulumi" "$ag/usr/local/bin/pulumi"
  install -D -m 0755 "$dist/pulumi-language-yaml" "$ag/usr/local/bin/pulumi-language-yaml"
  # What PKO's workspace pod runs from its agent image: /agent, /tini (links to the agent) and
  # busybox's sh, cp and ln in /bin (links kept as links: cp -P).
  cp -P -R "$dist/agent-root/." "$ag/"
  # No entrypoint: PKO's init containers give only `args` (`cp …`, `sh -c …`), run as they are.
  image pko-rs-agent "$ag" yes --config.env=HOME=/home/nonroot \
    --config.env=PATH=/usr/local/bin:/bin --config.cmd=/usr/local/bin/pko-agent
}

case ${1:-} in
  deps) deps ;;
  busybox) busybox ;;
  build) build "${2:-}" "${3:-}" ;;
  *) echo "usage: $0 deps | busybox | build DIST OUT" >&2; exit 2 ;;
esac
