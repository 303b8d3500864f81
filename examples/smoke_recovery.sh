#!/usr/bin/env bash
# Smoke run of the in-process recovery example (4 gloo ranks on CPU, ~25 s): a SIGKILLed rank,
# then a SIGSTOPped one; the survivors must finish with identical parameters (exit code 0).
set -euo pipefail
cd "$(dirname "$0")/.."
out=build/smoke-recovery
mkdir -p "$out"
timeout 90 python examples/ddp_recovery.py --world 4 --steps 12 --kill-rank 1 --kill-step 5 \
  --out "$out/kill" --timeout 60 | tail -n 2 | cut -c1-300
timeout 90 python examples/ddp_recovery.py --world 4 --steps 12 --stop-rank 2 --stop-step 5 \
  --out "$out/stop" --timeout 60 | tail -n 2 | cut -c1-300
echo "smoke_recovery: ok"
