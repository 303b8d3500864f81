#!/usr/bin/env bash
# CI smoke test: the FSDP2 + tensor-parallel example under torchrun (4 CPU processes, gloo, a
# 2x2 dp x tp mesh), then a resume on another mesh (2 processes, FSDP only) that reshards the
# checkpoint on load and trains on.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
run() { local n=$1; shift; timeout -k 5 150 python -m torch.distributed.run --standalone --nproc-per-node "$n" examples/fsdp_train.py "$@"; }
run 4 --tp 2 --steps 3 --save-every 3 --ckpt "$dir/ckpt"
run 2 --steps 5 --save-every 5 --ckpt "$dir/ckpt" --out "$dir/out.json"
test -f "$dir/ckpt/step-000000000005/manifest.json"
python - "$dir/out.json" <<'PY'
import json, sys
losses = json.load(open(sys.argv[1]))["losses"]
assert sorted(losses, key=int) == ["4", "5"], losses  # resumed at step 3, on another mesh
PY
echo "smoke_fsdp: OK"
