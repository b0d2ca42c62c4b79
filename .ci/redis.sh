#!/usr/bin/env bash
# Makes sure a `redis-server` binary exists for the registry-store tests (idempotent): does nothing when one is on
# PATH, otherwise installs Debian's redis-server package (through sudo when not root). The tests start their own
# server on a free port, so the package's system service is neither needed nor started here.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
  exit 0
fi
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
  SUDO=(sudo)
fi
# `env` after sudo: sudo would otherwise drop DEBIAN_FRONTEND.
apt_get() { "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get "$@"; }
# A fresh container may have no package lists yet; update only when the install cannot find the package.
apt_get install -y --no-install-recommends redis-server \
  || { apt_get update && apt_get install -y --no-install-recommends redis-server; }
command -v redis-server >/dev/null 2>&1 || { echo "redis-server still missing after install" >&2; exit 1; }
