#!/usr/bin/env bash
# The test command (README "Set-up"): installs the Debian packages that the system-level tests need
# when run as root (network namespaces, a local SLURM cluster, headless Chromium), then runs pytest.
# Arguments are passed to pytest, e.g. `bash tests/run.sh -k data -x`.
set -euo pipefail
cd "$(dirname "$0")/.."

DEBIAN_PACKAGES=(iproute2 util-linux slurm-wlm munge chromium fonts-liberation)
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  missing=()
  for pkg in "${DEBIAN_PACKAGES[@]}"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "tests/run.sh: installing Debian packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
else
  echo "tests/run.sh: not root (or no apt-get): tests that need ${DEBIAN_PACKAGES[*]} skip if absent"
fi

exec python -m pytest "$@"
