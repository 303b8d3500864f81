"""`resilient bench --fsdp` with tiny shapes (gpt-tiny): every row and column is there, every
restore (same mesh and onto half the ranks) was verified equal, world size 1 states why the
reshard is skipped, and the verifier itself catches zeroed, changed and misplaced values.
The 2-rank run is conftest's fsdp_bench_two_ranks, which also serves the check of the
resilient.dcp rows (test_bench_fsdp_rows_through_resilient_dcp).

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_bench_fsdp.py."""


from __future__ import annotations

import json
import sys

import pytest
from test_bench_fsdp import DEFAULT_METHODS

from procs import run_separate

COLUMNS = ["return_s", "stall_s", "stall_s_per_rank", "durable_s", "write_gbps", "restore_s",
           "restore_gbps", "reshard_s", "reshard_gbps"]


CLI = "import sys; from resilient.cli import main; sys.exit(main(sys.argv[1:]))"


def _run(args: list[str], timeout: float = 240) -> tuple[int, str, str]:
    return run_separate(args, timeout, " ".join(args[3:6]))


def _bench(tmp_path, *extra: str) -> dict:
    rc, out, err = _run([sys.executable, "-c", CLI, "bench", "--fsdp", "--model", "gpt-tiny",
                         "--repeat", "1", "--json", "--dir", str(tmp_path / "scratch"), *extra])
    assert rc == 0, err[-4000:]
    assert not (tmp_path / "scratch").exists()  # the scratch directory is removed
    return json.loads(out)


@pytest.mark.timeout(300)
def test_fsdp_bench_two_ranks_has_every_row_and_verifies_restores(fsdp_bench_two_ranks):
    r, scratch = fsdp_bench_two_ranks
    assert not scratch.exists()  # the scratch directory is removed
    assert r["world_size"] == 2 and r["reshard_world_size"] == 1 and r["reshard_skipped"] is None
    assert r["dtype"] == "float32" and len(r["bytes_per_rank"]) == 2
    assert r["reference"]["method"] == "memcpy" and len(r["reference"]["stall_s_per_rank"]) == 2
    # the order asked (conftest.FSDP_BENCH_METHODS): the default rows, then the resilient.dcp
    # ones, which test_dcp_backend checks
    assert [row["method"] for row in r["rows"]] == DEFAULT_METHODS + [
        "dcp_resilient", "dcp_resilient_async"]
    rows = r["rows"][:4]
    for row in rows:
        for c in COLUMNS:
            assert row[c] is not None, (row["method"], c)
        assert row["restore_verified"] is True and row["reshard_verified"] is True, row
        assert row["mismatches"] == []
        assert row["durable_s"] >= row["stall_s"] > 0
    # resilient and DCP wrote the whole state (the bytes of every rank, plus metadata)
    for row in rows:
        assert row["notes"]["written_bytes"] >= r["bytes"]
    names = [g["goal"] for g in r["goals"]]
    assert "resilient stall / memcpy, worst rank" in names
    assert "resilient reshard / same-mesh restore" in names
    # the default rows' goals (the resilient.dcp rows' goals start with their own names)
    names = [n for n in names if n.startswith(("resilient ", "resilient_overlap "))]
    assert sum("dcp_async's" in n for n in names) == 3 and sum("dcp's" in n for n in names) == 3


@pytest.mark.timeout(300)
def test_fsdp_bench_world_size_one_skips_the_half_mesh_with_a_reason(tmp_path):
    r = _bench(tmp_path, "--world-size", "1", "--methods", "resilient,dcp")
    assert "world size 1" in r["reshard_skipped"] and r["reshard_world_size"] is None
    assert [row["method"] for row in r["rows"]] == ["resilient", "dcp"]
    for row in r["rows"]:
        assert row["restore_verified"] is True and row["reshard_verified"] is None
        assert row["reshard_s"] is None


def _verifier_checks() -> dict:
    """In a process of its own (a one-rank process group): what verify() reports."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from resilient.cli.bench import fsdp_state
    from resilient.cli.bench.shapes import model_shapes
    from resilient.ports import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    model, opt = fsdp_state.build(model_shapes("gpt-tiny"), torch.float32,
                                  init_device_mesh("cpu", (1,)), "cpu")
    out = {"fresh": fsdp_state.verify(model, opt), "keys": len(list(fsdp_state.leaves(model, opt)))}
    w = dict(model.named_parameters())["layers.1.mlp.fc1.weight"].to_local()
    with torch.no_grad():
        w[3, 5] += 1.0
        out["one_value"] = fsdp_state.verify(model, opt)
        w[3, 5] -= 1.0
        w.copy_(w.roll(1, 0))  # the right values in the wrong rows
        out["rolled"] = fsdp_state.verify(model, opt)
        fsdp_state.fill(model, opt)
        opt.state[dict(model.named_parameters())["embed.weight"]]["step"].fill_(3.0)
        out["step"] = fsdp_state.verify(model, opt)
        fsdp_state.clobber(model, opt)
        out["clobbered"] = len(fsdp_state.verify(model, opt))
    dist.destroy_process_group()
    return out


def test_verify_catches_changed_misplaced_and_zeroed_values():
    rc, out, err = _run([sys.executable, __file__, "verifier"], timeout=120)
    assert rc == 0, err[-4000:]
    got = json.loads(out)
    assert got["fresh"] == []
    assert got["one_value"] == ["param/layers.1.mlp.fc1.weight"]
    assert got["rolled"] == ["param/layers.1.mlp.fc1.weight"]
    assert got["step"] == ["step/embed.weight"]
    assert got["clobbered"] == got["keys"]


if __name__ == "__main__" and sys.argv[1:] == ["verifier"]:
    print(json.dumps(_verifier_checks()))


@pytest.mark.timeout(300)
def test_bench_fsdp_rows_through_resilient_dcp(fsdp_bench_two_ranks):
    """`resilient bench --fsdp --methods ...,dcp,...,dcp_resilient,dcp_resilient_async`
    (gpt-tiny, conftest's run shared with test_bench_fsdp): both rows there, every restore and
    the resharded one verified, the ratios against dcp's row given."""
    result, _ = fsdp_bench_two_ranks
    rows = {r["method"]: r for r in result["rows"]}
    assert {"dcp", "dcp_resilient", "dcp_resilient_async"} <= set(rows)
    for name in ("dcp_resilient", "dcp_resilient_async"):
        assert rows[name]["restore_verified"] and rows[name]["reshard_verified"], rows[name]
        assert rows[name]["durable_s"] > 0
    goals = [g["goal"] for g in result["goals"]]
    assert any(g.startswith("dcp_resilient reshard / dcp's") for g in goals)
