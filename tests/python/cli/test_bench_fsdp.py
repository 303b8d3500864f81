"""`resilient bench --fsdp` with tiny shapes (gpt-tiny): every row and column is there, every
restore (same mesh and onto half the ranks) was verified equal, world size 1 states why the
reshard is skipped, and the verifier itself catches zeroed, changed and misplaced values.
The 2-rank run is conftest's fsdp_bench_two_ranks, shared with test_dcp_backend."""


from __future__ import annotations

import pytest

pytest.importorskip("torch.distributed.fsdp")


DEFAULT_METHODS = ["resilient", "resilient_overlap", "dcp", "dcp_async"]


def test_fsdp_bench_runs_the_four_default_rows_unless_told(monkeypatch):
    """Without --methods, --fsdp asks for these rows in this order (the 2-rank run names them,
    and the rows come out in the order asked)."""
    import resilient.cli.bench.fsdp as fsdp
    from resilient.cli import main

    asked = []
    monkeypatch.setattr(fsdp, "run_fsdp_bench", lambda args: asked.append(args.methods) or 0)
    assert main(["bench", "--fsdp", "--model", "gpt-tiny"]) == 0
    assert asked == [",".join(DEFAULT_METHODS)]


def test_a_failed_method_becomes_its_rows_error_and_the_others_stay():
    from resilient.cli.bench.fsdp import goals, summarize

    ok = {"saves": [[0.1, 0.1, 0.5, None]], "restores": [{"s": 0.4, "bad": [], "cache": "x"}],
          "notes": {}}
    ranks = [{"bytes": 10**9, "reference": {"method": "memcpy", "s": 0.1},
              "methods": {"resilient": ok, "dcp_async": {**ok, "error": "rank 0: boom"}}}]
    reference, rows = summarize(ranks, None, ["resilient", "dcp_async"])
    assert rows[0]["restore_verified"] is True and rows[0]["durable_s"] == 0.5
    assert rows[1]["error"] == "rank 0: boom" and rows[1]["durable_s"] is None
    assert all(g["value"] is None or g["goal"].startswith("resilient stall")
               for g in goals(reference, rows, "cpu") if "dcp_async" in g["goal"])
