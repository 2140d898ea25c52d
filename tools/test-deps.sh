#!/usr/bin/env bash
# Debian packages the integration tests run as real servers or clients, installed when missing:
# git (test repositories; the agent's checkouts), OpenSSH's sshd (a git server over SSH on
# loopback) with ssh and ssh-keygen.
set -euo pipefail

missing=()
command -v git >/dev/null || missing+=(git)
[[ -x /usr/sbin/sshd ]] || missing+=(openssh-server)
command -v ssh >/dev/null || missing+=(openssh-client)
command -v ssh-keygen >/dev/null || missing+=(openssh-client)
if ((${#missing[@]} == 0)); then exit 0; fi
echo "installing ${missing[*]} (apt-get)" >&2
if [[ $(id -u) != 0 ]]; then
  echo "${missing[*]} missing and not root: install them with apt-get" >&2
  exit 1
fi
DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}" ||
  { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"; }
