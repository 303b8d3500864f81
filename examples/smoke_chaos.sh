#!/usr/bin/env bash
# CI smoke test of `resilient chaos`: the CPU scenario matrix of examples/chaos_plan.yaml.
# --check fails the run when a scenario misses its expected outcome or breaks an invariant
# (corrupt/partial checkpoint loaded, committed checkpoint lost, final model differs from a
# fault-free run). Scenarios needing root (ENOSPC tmpfs) are reported as skipped without it.
# Also exercises `resilient sim ettr`. Writes build/chaos-smoke/{table.txt,timeline.png,runs/}.
set -euo pipefail
cd "$(dirname "$0")/.."
out=build/chaos-smoke
rm -rf "$out" && mkdir -p "$out"
timeout 600 resilient chaos --plan examples/chaos_plan.yaml --check --plot "$out/timeline.png" \
  --dir "$out/runs" \
  | tee "$out/table.txt"
resilient sim ettr --interval-s 600 --restart-stall-s 10
python -m resilient.detect.health >/dev/null || { echo "health check reported a sick GPU"; exit 1; }
echo "chaos smoke passed"
