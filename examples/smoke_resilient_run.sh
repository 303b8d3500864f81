#!/usr/bin/env bash
# Smoke run of `resilient run` (4 gloo ranks on CPU, ~30 s): an ordinary DDP script whose rank 1
# SIGKILLs itself mid-run; the launcher keeps the survivors, they finish, exit code 0. Then the
# same with a replacement rank that joins the running job.
set -euo pipefail
cd "$(dirname "$0")/.."
out=build/smoke-resilient-run
rm -rf "$out" && mkdir -p "$out"
timeout -k 5 90 python -m resilient.run --standalone --nproc-per-node 4 \
  examples/ddp_resilient_run.py --steps 12 --kill-rank 1 --kill-step 5 --out "$out/kill" \
  2>&1 | grep -E "^rank |resilient run:"
timeout -k 5 120 python -m resilient.run --standalone --nproc-per-node 4 --replacements 1 \
  examples/ddp_resilient_run.py --steps 16 --kill-rank 1 --kill-step 5 --wait-for-joiner 8 \
  --out "$out/replace" 2>&1 | grep -E "^rank |resilient run:"
echo "smoke_resilient_run: ok"
