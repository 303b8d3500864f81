#!/usr/bin/env bash
# One device call for issues 3 and 6 (see benchmarks/RESULTS.md): build; the GPU checkpoint
# tests (every GPU of the machine); the recovery bench (kill, stop, restart; REPEAT runs each);
# the training-loop row (stage train; SKIP_TRAIN=1 leaves it out). Everything lands in one
# tarball, $OUT/session.tgz (the device tool returns only a few files).
cd "$(dirname "$0")/.."
REAL_OUT=${OUT:-build/gpu-out}; W=/tmp/session; rm -rf $W; mkdir -p $W
export OUT=$W PYTHONFAULTHANDLER=1 RESILIENT_CRASH_HANDLER=1
trap 'tar czf "$REAL_OUT/session.tgz" -C /tmp session' EXIT
bash scripts/gpu_run.sh build 2>&1 | tail -n 2
export PYTHONPATH=$PWD/python LD_LIBRARY_PATH=/opt/deps/usr/lib/x86_64-linux-gnu
n=$(python -c "import torch; print(torch.cuda.device_count())")
echo "[session $(date +%T)] GPU checkpoint tests"
timeout 150 python -m pytest -q -p no:cacheprovider tests/python/checkpoint/test_gpu_checkpoint.py > $W/pytest-gpu.log 2>&1
echo "rc=$?"; tail -n 8 $W/pytest-gpu.log
echo "[session $(date +%T)] recovery bench ($n GPUs)"
timeout 240 python scripts/gpu_recovery_bench.py --gpus "$n" --repeat ${REPEAT:-1} --timeout 90 \
  --out $W/rec > $W/recovery.log 2>&1; echo "rc=$?"; tail -c 2500 $W/recovery.log; echo
[ -n "${SKIP_TRAIN:-}" ] || bash scripts/gpu_run.sh train 2>&1 | tail -n 30
