#!/usr/bin/env bash
# One-time set-up on a fresh Debian 12 machine: system packages, virtual environment, build.
# Idempotent: re-running it only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

apt_pkgs=(build-essential cmake ninja-build pkg-config liburing-dev libzstd-dev libxxhash-dev
          nlohmann-json3-dev libgtest-dev libgmock-dev libssl-dev clang libclang-rt-14-dev
          clang-format iproute2 stress-ng etcd-server libcurl4-openssl-dev)
missing=()
for p in "${apt_pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

py=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$py" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
pip install -q -r requirements-dev.txt
# Build the C++ core, its tests and the Python extension (editable install, build/py).
bash scripts/build.sh
