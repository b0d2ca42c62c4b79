#!/usr/bin/env bash
# The Debian packages the tests drive for real (idempotent): redis-server (the registry-store tests start their own
# servers on free ports; the package's system service is neither needed nor started) and chromium (the status page
# is checked in a headless browser). Installs only what is missing, through sudo when not root.
set -euo pipefail
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
  SUDO=(sudo)
fi
# `env` after sudo: sudo would otherwise drop DEBIAN_FRONTEND.
apt_get() { "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get "$@"; }
# A fresh container may have no package lists yet; update only when the install cannot find a package.
apt_get install -y --no-install-recommends "${missing[@]}" \
  || { apt_get update && apt_get install -y --no-install-recommends "${missing[@]}"; }
for cmd in redis-server chromium; do
  command -v "$cmd" >/dev/null 2>&1 || { echo "$cmd still missing after install" >&2; exit 1; }
done
