"""Fixtures the test files of cli/ share."""

from __future__ import annotations

import pytest
from test_ckpt_cli import make_root


@pytest.fixture()
def root(tmp_path) -> str:
    return make_root(str(tmp_path / "root"))


# The rows of `resilient bench --fsdp` that test_bench_fsdp_multiproc checks: the
# default four, in their order, then the resilient.dcp rows.
FSDP_BENCH_METHODS = ("resilient", "resilient_overlap", "dcp", "dcp_async", "dcp_resilient",
                      "dcp_resilient_async")


@pytest.fixture(scope="module")
def fsdp_bench_two_ranks(tmp_path_factory):
    """`resilient bench --fsdp --model gpt-tiny --world-size 2 --json` with FSDP_BENCH_METHODS,
    run once for the tests that read it (a run spawns a 2-rank save job and a 1-rank reshard
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
