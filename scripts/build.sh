#!/usr/bin/env bash
# Incremental rebuild of the C++ core, the C++ tests and the editable Python install
# (build dir build/py). Serialised with a lock so concurrent builders do not collide.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
# The libtorch adapter and its example (examples/smoke_libtorch.sh) build here too, on the same
# core objects: a build of their own recompiled the core (about 4 CPU-minutes of CI).
prefix=$(python -c "import torch; print(torch.utils.cmake_prefix_path)")
exec flock /tmp/resilient-build.lock \
  pip install -q --no-build-isolation --no-deps -e . -Ccmake.define.RESILIENT_TESTS=ON \
  -Ccmake.define.RESILIENT_TORCH_ADAPTER=ON "-Ccmake.define.CMAKE_PREFIX_PATH=$prefix" "$@"
