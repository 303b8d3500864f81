#!/usr/bin/env bash
# CI smoke test: builds the libtorch adapter and examples/cpp/train.cpp (build/adapter, kept
# between runs; the first build compiles the core too, ~1.5 min on 2 cores), trains and resumes
# in C++, then checks C++ <-> Python checkpoint interchange (tests/python/test_libtorch_adapter.py).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
prefix=$(python -c "import torch; print(torch.utils.cmake_prefix_path)")
cmake -S . -B build/adapter -G Ninja -DCMAKE_BUILD_TYPE=Release -DRESILIENT_PYTHON=OFF \
      -DRESILIENT_TORCH_ADAPTER=ON -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build build/adapter -j 2 --target resilient_train_example
bin=build/adapter/cpp/adapter/resilient_train_example
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$bin" "$dir/a" 3
resumed=$("$bin" "$dir/a" 6)
straight=$("$bin" "$dir/b" 6)
echo "$resumed"
[ "$resumed" = "$straight" ] || { echo "resumed run differs: $resumed vs $straight"; exit 1; }
RESILIENT_TRAIN_EXAMPLE="$bin" python -m pytest tests/python/test_libtorch_adapter.py -q -p no:cacheprovider
echo "smoke_libtorch: OK"
