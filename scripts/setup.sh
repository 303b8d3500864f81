#!/usr/bin/env bash
# One-time set-up on a fresh Debian 12 machine (root): system packages, the virtual environment
# (.venv) and the build, each phase timed. By default what the main job, `resilient bench`,
# needs; with --tests (scripts/test.sh runs it first) also the test tools (clang, GoogleTest,
# etcd, stress-ng; pytest and the test-only Python packages), the C++ unit tests and the
# libtorch adapter. Re-running it installs or rebuilds only what is missing or changed.
#
# Where the time goes on a fresh 2-core VM (benchmarks/RESULTS.md, "The first run: set-up"):
# the Python environment is torch and its CUDA libraries from PyPI (about 3 GB: 3-5 minutes
# without a pip cache), the build the core and its pybind11 bindings (about 100 s); the C++
# tests and the libtorch adapter (as much CPU again) are built only with --tests.
set -euo pipefail
cd "$(dirname "$0")/.."

tests=0
for arg in "$@"; do
  case "$arg" in
    --tests) tests=1 ;;
    *) echo "usage: bash scripts/setup.sh [--tests]" >&2; exit 2 ;;
  esac
done

setup_started=$(date +%s)
phase_started=0
phase() { phase_started=$(date +%s); echo "[setup] $*"; }
phase_done() { echo "[setup]   done in $(( $(date +%s) - phase_started )) s"; }

# --- packages -------------------------------------------------------------------------------
# The main job: a C++20 compiler, CMake and Ninja, the core's libraries.
apt_pkgs=(build-essential cmake ninja-build pkg-config liburing-dev libzstd-dev libxxhash-dev
          nlohmann-json3-dev libssl-dev libcurl4-openssl-dev)
# The tests: GoogleTest, clang (fuzzing, sanitizers) and clang-format, network namespaces and
# load (iproute2, stress-ng), an etcd server.
[ "$tests" = 1 ] && apt_pkgs+=(libgtest-dev libgmock-dev clang libclang-rt-14-dev clang-format
                               iproute2 stress-ng etcd-server)
missing=()
for p in "${apt_pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  phase "packages: installing ${#missing[@]} Debian packages (${missing[*]})"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  phase_done
else
  echo "[setup] packages: all ${#apt_pkgs[@]} Debian packages present"
fi

# --- Python environment ---------------------------------------------------------------------
reqs=requirements.txt
[ "$tests" = 1 ] && reqs=requirements-dev.txt
py=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  phase "Python environment: creating .venv with $("$py" --version 2>&1)"
  "$py" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  phase_done
fi
# A requirements file already installed (same content, same venv) is not handed to pip again:
# pip takes 10-20 s to find that nothing is missing.
stamp=".venv/.installed-$(basename "$reqs" .txt)"
want=$(cat requirements.txt "$reqs" | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  phase "Python environment: pip install -r $reqs (the first time: torch and its CUDA" \
        "libraries, about 3 GB)"
  .venv/bin/pip install -q -r "$reqs"
  echo "$want" >"$stamp"
  phase_done
else
  echo "[setup] Python environment: $reqs installed"
fi

# --- build ----------------------------------------------------------------------------------
build_args=()
[ "$tests" = 1 ] && build_args+=(--tests)
phase "build: the C++ core and the Python extension$([ "$tests" = 1 ] && echo \
      ", the C++ tests and the libtorch adapter") ($(nproc) cores)"
bash scripts/build.sh "${build_args[@]}"
phase_done

echo "[setup] ready after $(( $(date +%s) - setup_started )) s"
if [ "$tests" = 1 ]; then
  echo "[setup] next: the tests run now (scripts/test.sh)"
else
  echo "[setup] next: .venv/bin/resilient bench    (every test: bash scripts/test.sh)"
fi
