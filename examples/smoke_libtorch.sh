#!/usr/bin/env bash
# CI smoke test: examples/cpp/train.cpp on the libtorch adapter (built by scripts/build.sh in
# build/py) trains, resumes and must match a straight run. The C++ <-> Python checkpoint
# interchange (tests/python/test_libtorch_adapter.py) runs in the Python suite on that binary.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
bin=build/py/cpp/adapter/resilient_train_example
if grep -q "RESILIENT_TORCH_ADAPTER:BOOL=OFF" build/py/CMakeCache.txt 2>/dev/null; then
  echo "smoke_libtorch: SKIPPED: scripts/build.sh left the adapter out (no CUDA toolkit)"
  exit 0
fi
[ -x "$bin" ] || { echo "no $bin: run scripts/build.sh (it builds the adapter)"; exit 1; }
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$bin" "$dir/a" 3
resumed=$("$bin" "$dir/a" 6)
straight=$("$bin" "$dir/b" 6)
echo "$resumed"
[ "$resumed" = "$straight" ] || { echo "resumed run differs: $resumed vs $straight"; exit 1; }
echo "smoke_libtorch: OK"
