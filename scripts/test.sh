#!/usr/bin/env bash
# Every test, in tiers (tests/python/tiers.py: unit, multiproc, system, from each file's name).
#
#   bash scripts/test.sh            everything: the README's test command, and CI's (.ci/run)
#   bash scripts/test.sh fast       the edit loop: the C++ unit tests, the Python unit tier, three
#                                   end-to-end smokes, ruff and clang-format (a few minutes)
#   bash scripts/test.sh --stress   the multiproc and system tiers twice under stress-ng on every
#                                   core (the flakiness check: they must not fail for want of CPU)
#
# Everything: the C++ unit tests; the Python tiers with pytest-xdist (a file's tests on one
# worker; the multi-process tiers one worker per core, their deadlines following the
# machine's load: tests/python/machine.py); smoke runs of
# the CLI and examples; the C++ tests under ASan/UBSan and ThreadSanitizer; bounded libFuzzer
# runs; ruff and clang-format. FUZZ_SECONDS (default 30) bounds each fuzz target;
# SKIP_SANITIZE=1 / SKIP_TSAN=1 / SKIP_FUZZ=1 skip those; PYTEST_WORKERS sets the multi-process
# tiers' workers (default one per core: at two per core, 2 cores saw load averages of 11-13
# and CPU-starved failures).
#
# The sanitizer and fuzz builds start first, in the background at the lowest CPU and I/O
# priority: they use the cycles the Python tiers leave idle. One clang build serves both ASan
# and libFuzzer (address and undefined-behaviour sanitizers, fuzzer coverage: the unit tests and
# the fuzz targets), and ThreadSanitizer builds only the units with threads of their own.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=all
case "${1:-}" in
  "") ;;
  fast) mode=fast ;;
  --stress) mode=stress ;;
  *) echo "usage: bash scripts/test.sh [fast|--stress]" >&2; exit 2 ;;
esac
jobs=$(nproc)
workers=${PYTEST_WORKERS:-$jobs}
failed=()
test_started=$(date +%s)
# Each step's header says when it started (seconds into this script), so a CI log shows where
# the time went.
step() { echo; echo "=== $* === (at $(( $(date +%s) - test_started )) s)"; }
run() { local name=$1; shift; if ! "$@"; then failed+=("$name"); echo "*** $name FAILED"; fi; }
finish() {
  echo
  echo "$1 after $(( $(date +%s) - test_started )) s"
  if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]}"
    exit 1
  fi
  echo "all test suites passed"
}

# scripts/setup.sh builds what `resilient bench` needs; the test tools, the C++ unit tests and the
# libtorch adapter are installed and built here (incrementally: quick once they are).
step "set-up for the tests: scripts/setup.sh --tests"
bash scripts/setup.sh --tests
. .venv/bin/activate

pytest_tier() {  # pytest_tier NAME MARKERS WORKERS [ARGS...]: one pytest run over a tier's files
  local name=$1 markers=$2 n=$3; shift 3
  run "$name" python -m pytest tests/python -m "($markers) and not slow" -q -p no:cacheprovider \
    --timeout 600 -n "$n" --dist loadfile --durations=15 "$@"
}

if [ "$mode" = stress ]; then
  # Two runs of the multi-process tiers with stress-ng keeping every core busy at the tests'
  # own priority: they get about half the CPU they would alone.
  step "stress: stress-ng --cpu $jobs in the background"
  stress-ng --cpu "$jobs" --timeout 0 >/dev/null 2>&1 &
  stress_pid=$!
  trap 'kill "$stress_pid" 2>/dev/null || true' EXIT
  for round in 1 2; do
    step "stress round $round: the multiproc and system tiers"
    # (not the 'alone' tests: the straggler detector's latency in steps, beside stress-ng,
    # measures the machine's scheduling noise)
    pytest_tier "stressed-round-$round" "(multiproc or system) and not alone" "$workers"
  done
  finish "the stressed runs ended"
  exit 0
fi

background_builds() {  # each writes build/<name>-build.log and build/<name>-build.ok on success
  local tsan_targets=(test_common_thread_pool test_io_engine test_memory_pool
                      test_checkpoint_engine test_checkpoint_device test_detect_agent_live)
  mkdir -p build
  # When each build ended, in seconds after they started (does the Python suite leave them
  # enough idle CPU, or do they run into the smokes?).
  ended() {
    echo "$1 ended after $(( $(date +%s) - background_builds_started )) s" \
      >>build/background-builds.times
  }
  if [ "${SKIP_SANITIZE:-0}" != 1 ] || [ "${SKIP_FUZZ:-0}" != 1 ]; then
    # -O1: ASan's recommended level; line tables only.
    CC=clang CXX=clang++ cmake -S . -B build/asan -G Ninja -DCMAKE_BUILD_TYPE=Debug \
        -DRESILIENT_PYTHON=OFF -DRESILIENT_TESTS=ON -DRESILIENT_FUZZ=ON -DRESILIENT_SANITIZE=ON \
        "-DCMAKE_CXX_FLAGS=-O1 -g1 -fsanitize=fuzzer-no-link" >build/asan-build.log 2>&1 &&
      cmake --build build/asan -j "$jobs" >>build/asan-build.log 2>&1 && touch build/asan-build.ok
    ended "asan and fuzz"
  fi
  if [ "${SKIP_TSAN:-0}" != 1 ]; then
    # RelWithDebInfo keeps TSan's slowdown within the test timeouts.
    cmake -S . -B build/tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DRESILIENT_PYTHON=OFF \
          -DRESILIENT_TESTS=ON -DRESILIENT_SANITIZE=thread >build/tsan-build.log 2>&1 &&
      cmake --build build/tsan -j "$jobs" --target "${tsan_targets[@]}" \
        >>build/tsan-build.log 2>&1 && touch build/tsan-build.ok
    ended tsan
  fi
  return 0
}

if [ "$mode" = all ]; then
  rm -f build/asan-build.ok build/tsan-build.ok build/background-builds.times
  background_builds_started=$(date +%s)
  export -f background_builds
  export jobs background_builds_started
  idle=(nice -n 19)
  if ionice -c 3 true 2>/dev/null; then idle=(ionice -c 3 nice -n 19); fi
  setsid "${idle[@]}" bash -c background_builds &
  builds_pid=$!
  trap 'kill -- -$builds_pid 2>/dev/null || true' EXIT
fi

step "C++ unit tests"
run ctest ctest --test-dir build/py --output-on-failure -j "$jobs" --timeout 300

step "Python: the unit tier (in-process)"
pytest_tier "pytest-unit" "unit" "$jobs"

if [ "$mode" = fast ]; then
  step "smokes: resilient bench, the README's quick start killed and resumed, the DDP example"
  run bench resilient bench --size 32MiB --tensors 16 --repeat 1 --dir build/bench-smoke
  run readme python -m pytest -q -p no:cacheprovider --timeout 300 \
    "tests/python/docs/test_readme_blocks_multiproc.py::test_the_single_process_quick_start_resumes_exactly"
  run "examples/smoke_ddp.sh" bash examples/smoke_ddp.sh
else
  step "Python: the multiproc and system tiers ($workers workers on $jobs cores)"
  pytest_tier "pytest-multiproc-system" "(multiproc or system) and not alone" "$workers"
  step "Python: the tests that measure time, one at a time (marker 'alone')"
  run "pytest-alone" python -m pytest tests/python -m "alone and not slow" -q -p no:cacheprovider \
    --timeout 600 --durations=5

  step "smoke: resilient bench"
  run bench resilient bench --size 32MiB --tensors 16 --repeat 1 --dir build/bench-smoke
  for ex in examples/smoke_*.sh; do
    [ -e "$ex" ] || continue
    step "smoke: $ex"
    run "$ex" bash "$ex"
  done

  step "sanitizer and fuzz builds (started in the background $(( $(date +%s) - background_builds_started )) s ago)"
  wait "$builds_pid" || true
  trap - EXIT
  echo "done after $(( $(date +%s) - background_builds_started )) s"
  cat build/background-builds.times 2>/dev/null || true

  if [ "${SKIP_SANITIZE:-0}" != 1 ]; then
    step "C++ unit tests under ASan/UBSan"
    if [ -e build/asan-build.ok ]; then
      ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
        run asan ctest --test-dir build/asan --output-on-failure -j "$jobs" --timeout 600
    else
      tail -n 40 build/asan-build.log; failed+=("asan-build")
    fi
  fi

  if [ "${SKIP_TSAN:-0}" != 1 ]; then
    # The units with threads of their own (thread pool, io engines, host pool, checkpoint writer
    # and device copies, live detector agents over UDP); the others are single-threaded and
    # already run under ASan.
    step "C++ tests under ThreadSanitizer"
    if [ -e build/tsan-build.ok ]; then
      TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
        run tsan ctest --test-dir build/tsan --output-on-failure -j "$jobs" --timeout 600 \
        -E _NOT_BUILT
    else
      tail -n 40 build/tsan-build.log; failed+=("tsan-build")
    fi
  fi

  if [ "${SKIP_FUZZ:-0}" != 1 ]; then
    step "libFuzzer (${FUZZ_SECONDS:-30} s per target)"
    if [ -e build/asan-build.ok ]; then
      # Each target is one single-threaded process: up to $jobs of them run at once, each for
      # the full FUZZ_SECONDS (2 targets on 2 cores: 30 s instead of 60 s, the same fuzzing).
      fuzzers=()
      for f in build/asan/tests/cpp/fuzz_*; do
        [ -x "$f" ] || continue
        name=$(basename "$f")
        corpus="build/asan/corpus/$name"
        mkdir -p "$corpus"
        # Seeds that reach deep nesting and duplicate tensor names (mutations of a valid
        # manifest rarely would), and the format's keywords as a dictionary.
        seeds="tests/cpp/fuzz_seeds/$name"
        if [ -d "$seeds" ]; then cp -n "$seeds"/* "$corpus"/ 2>/dev/null || true; fi
        while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
        rm -f "build/asan/$name.rc"
        { rc=0; "$f" -max_total_time="${FUZZ_SECONDS:-30}" -print_final_stats=1 \
            -dict=tests/cpp/fuzz_seeds/checkpoint_manifest.dict "$corpus" \
            >"build/asan/$name.log" 2>&1 || rc=$?; echo "$rc" >"build/asan/$name.rc"; } &
        fuzzers+=("$name")
      done
      wait
      for name in "${fuzzers[@]}"; do
        if [ "$(cat "build/asan/$name.rc" 2>/dev/null)" != 0 ]; then
          failed+=("$name"); echo "*** $name FAILED"; tail -n 30 "build/asan/$name.log"
        fi
        tail -n 3 "build/asan/$name.log"
      done
      [ ${#fuzzers[@]} -gt 0 ] || { echo "no fuzz target was built"; failed+=("fuzz-build"); }
    else
      tail -n 40 build/asan-build.log; failed+=("fuzz-build")
    fi
  fi
fi

step "ruff"
run ruff ruff check python tests examples benchmarks scripts

step "clang-format (.clang-format: Google, 100 columns)"
run clang-format clang-format --dry-run -Werror $(git ls-files 'cpp/*.cpp' 'cpp/*.hpp' \
  'bindings/*.cpp' 'bindings/*.hpp' 'tests/cpp/*.cpp' 'tests/cpp/*.hpp' 'benchmarks/*.cpp' \
  'examples/*.cpp' 'examples/**/*.cpp')

finish "the tests ended"
