#!/usr/bin/env bash
# Incremental rebuild of the C++ core, the C++ tests and the editable Python install
# (build dir build/py). Serialised with a lock so concurrent builders do not collide.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
# The libtorch adapter and its example (examples/smoke_libtorch.sh) build here too, on the same
# core objects: a build of their own recompiled the core (about 4 CPU-minutes of CI). A CUDA
# build of torch needs the CUDA toolkit for its CMake config; without one the adapter is left out.
adapter=()
torch_dir=$(python -c "import torch; print(torch.utils.cmake_prefix_path + '/Torch')")
if python -c "import sys, torch; sys.exit(torch.version.cuda is not None)" ||
    command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then
  adapter=(-Ccmake.define.RESILIENT_TORCH_ADAPTER=ON "-Ccmake.define.Torch_DIR=$torch_dir")
else
  echo "build.sh: no CUDA toolkit for this CUDA build of torch: the libtorch adapter is not built"
  adapter=(-Ccmake.define.RESILIENT_TORCH_ADAPTER=OFF)
fi
exec flock /tmp/resilient-build.lock \
  pip install -q --no-build-isolation --no-deps -e . -Ccmake.define.RESILIENT_TESTS=ON \
  "${adapter[@]}" "$@"
