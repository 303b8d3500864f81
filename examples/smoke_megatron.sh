#!/usr/bin/env bash
# CI smoke test: the Megatron-style example (2-way TP x 2-way DP) under torchrun, then a resume
# onto a different tensor-parallel split (TP=4) that saves the resharded state again.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
run() { timeout -k 5 100 python -m torch.distributed.run --standalone --nproc-per-node 4 examples/megatron_train.py "$@"; }
run --tp 2 --steps 3 --save-every 3 --ckpt "$dir/ckpt"
run --tp 4 --ckpt "$dir/ckpt" --resave
python - "$dir/ckpt" <<'PY'
import json, sys
m = json.load(open(f"{sys.argv[1]}/step-000000000003/manifest.json"))
fc1 = [t for t in m["tensors"] if t["name"].startswith("S/model/fc1_w#@")]
assert len(fc1) == 4 and all(t["shape"] == [16, 16] for t in fc1), fc1  # 4-way TP pieces
PY
echo "smoke_megatron: OK"
