# Sourced by the tools/ scripts: installs Debian packages that are missing, once, with the same
# refusal everywhere when not root (the message names what to install).
#   apt_install PKG...   (no-op without arguments)
apt_install() {
  (($# == 0)) && return 0
  echo "installing $* (apt-get)" >&2
  if [[ $(id -u) != 0 ]]; then
    echo "$* missing and not root: install them with apt-get" >&2
    exit 1
  fi
  # The package lists may be stale or absent on a fresh machine: update once, then retry.
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" ||
    { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@"; }
}
