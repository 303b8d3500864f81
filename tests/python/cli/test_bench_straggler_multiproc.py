"""`resilient bench straggler`: --help works (it failed: the subcommand passed its arguments on
with argparse.REMAINDER, which does not take a leading option) and --json prints one object."""

from __future__ import annotations

import json
import sys

from procs import run_separate

CLI = "import sys; from resilient.cli import main; sys.exit(main(sys.argv[1:]))"


def _run(args: list[str], timeout: float) -> tuple[int, str, str]:
    return run_separate([sys.executable, "-c", CLI, *args], timeout, " ".join(args[:2]))


def test_bench_straggler_help_and_json(tmp_path):
    rc, out, err = _run(["bench", "straggler", "--help"], timeout=60)
    assert rc == 0, err
    assert "--json" in out and "--slow-rank" in out and "--plot" in out
    rc, out, err = _run(["bench", "straggler", "--json", "--world", "2", "--steps", "60",
                         "--slow-from", "20", "--slowdown", "1.0", "--interval", "5",
                         "--slow-rank", "1"], timeout=180)
    assert rc == 0, err[-4000:]
    r = json.loads(out)
    assert r["world"] == 2 and r["scenario"]["slow_rank"] == 1 and r["plot"] is None
    res = r["result"]
    for key in ("mean_step_ms", "first_named_step", "detection_latency", "false_reports",
                "timeline", "reports"):
        assert key in res, key
    assert res["timeline"] and {"rank", "window", "ratio"} <= set(res["timeline"][0])
    # the summary's fields agree (whether 60 steps on a loaded host suffice to name it is the
    # straggler tests' business, not this one's)
    named = res["first_named_step"]
    assert res["detection_latency"] == (-1 if named < 0 else named - 20)
