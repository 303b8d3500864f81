import os
import subprocess
import sys
from pathlib import Path

import pytest

# The shared helpers (procs, damage, machine, ...) live here, the tests in folders mirroring the
# package: processes a test starts (a test file run as a script, a rank, a helper) import them
# too.
TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (TESTS, os.environ.get("PYTHONPATH", "")) if p)

pytest_plugins = ["tiers"]  # unit / multiproc / system, from each file's name (tiers.py)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 16 MiB tmpfs (root only), for ENOSPC tests; skipped where mounting is not allowed."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def pytest_report_header(config):
    return f"resilient tests, pid {os.getpid()}"


@pytest.fixture
def free_port():
    """A TCP port free a moment ago (for a test's own process group or store)."""
    from resilient.ports import free_port

    return free_port()


# The rows of `resilient bench --fsdp` that test_bench_fsdp and test_dcp_backend check: the
# default four, in their order, then the resilient.dcp rows.
FSDP_BENCH_METHODS = ("resilient", "resilient_overlap", "dcp", "dcp_async", "dcp_resilient",
                      "dcp_resilient_async")


@pytest.fixture(scope="session")
def fsdp_bench_two_ranks(tmp_path_factory):
    """`resilient bench --fsdp --model gpt-tiny --world-size 2 --json` with FSDP_BENCH_METHODS,
    run once for the tests of both files (a run spawns a 2-rank save job and a 1-rank reshard
    job: 20-25 s on the 2-core CI VM). Returns (its JSON, the scratch directory it was given)."""
    import json
    import sys

    from procs import run_separate

    scratch = tmp_path_factory.mktemp("fsdp-bench") / "scratch"
    cli = "import sys; from resilient.cli import main; sys.exit(main(sys.argv[1:]))"
    args = [sys.executable, "-c", cli, "bench", "--fsdp", "--model", "gpt-tiny", "--world-size",
            "2", "--repeat", "1", "--json", "--dir", str(scratch), "--methods",
            ",".join(FSDP_BENCH_METHODS)]
    rc, out, err = run_separate(args, 240, "bench --fsdp --world-size 2")
    assert rc == 0, err[-4000:]
    return json.loads(out), scratch
