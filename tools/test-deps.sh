#!/usr/bin/env bash
# Debian packages the integration tests run as real servers or clients, installed when missing:
# git (test repositories; the agent's checkouts), OpenSSH's sshd (a git server over SSH on
# loopback) with ssh and ssh-keygen.
set -euo pipefail
# shellcheck source=tools/apt.sh
. "$(dirname "$0")/apt.sh"

missing=()
command -v git >/dev/null || missing+=(git)
[[ -x /usr/sbin/sshd ]] || missing+=(openssh-server)
command -v ssh >/dev/null || missing+=(openssh-client)
command -v ssh-keygen >/dev/null || missing+=(openssh-client)
apt_install "${missing[@]}"
