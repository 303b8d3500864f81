#!/usr/bin/env bash
# Incremental rebuild of the C++ core, the C++ tests and the editable Python install
# (build dir build/py). Serialised with a lock so concurrent builders do not collide.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
exec flock /tmp/resilient-build.lock \
  pip install -q --no-build-isolation --no-deps -e . -Ccmake.define.RESILIENT_TESTS=ON "$@"
