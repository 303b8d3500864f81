#!/usr/bin/env bash
# Incremental rebuild of the C++ core and the editable Python install (build dir build/py),
# serialised with a lock (build/.lock) so concurrent builders of this tree do not collide.
#   bash scripts/build.sh            what the tree was configured with (a fresh tree: the core
#                                    and the Python extension, what `resilient bench` needs)
#   bash scripts/build.sh --tests    also the C++ unit tests and the libtorch adapter (from then
#                                    on, plain build.sh keeps building them)
# Other arguments go to pip (e.g. -v).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
tests=OFF
if grep -q "^RESILIENT_TESTS:BOOL=ON" build/py/CMakeCache.txt 2>/dev/null; then tests=ON; fi
pip_args=()
for arg in "$@"; do
  if [ "$arg" = --tests ]; then tests=ON; else pip_args+=("$arg"); fi
done
# The libtorch adapter and its example (examples/smoke_libtorch.sh) build with the tests, on the
# same core objects: a build of their own recompiled the core (about 4 CPU-minutes of CI). A
# CUDA build of torch needs the CUDA toolkit for its CMake config; without one the adapter is
# left out.
adapter=(-Ccmake.define.RESILIENT_TORCH_ADAPTER=OFF)
if [ "$tests" = ON ]; then
  torch_dir=$(python -c "import torch; print(torch.utils.cmake_prefix_path + '/Torch')")
  if python -c "import sys, torch; sys.exit(torch.version.cuda is not None)" ||
      command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then
    adapter=(-Ccmake.define.RESILIENT_TORCH_ADAPTER=ON "-Ccmake.define.Torch_DIR=$torch_dir")
  else
    echo "build.sh: no CUDA toolkit for this CUDA build of torch: the libtorch adapter is not built"
  fi
fi
mkdir -p build
exec flock build/.lock \
  pip install -q --no-build-isolation --no-deps -e . "-Ccmake.define.RESILIENT_TESTS=$tests" \
  "${adapter[@]}" "${pip_args[@]}"
