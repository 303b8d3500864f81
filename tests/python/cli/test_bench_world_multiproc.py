"""`resilient bench --world-size N` runs every method end to end (it failed with
ReplicaMismatchError once check_replicas was on: the ranks' synthetic state differed), and the
shared restore reads the state from storage once while the direct one reads it once per rank; a
raw single-reader row gives the storage limit in the same run."""

from __future__ import annotations

import json
import sys

import pytest

from procs import run_separate

CLI = "import sys; from resilient.cli import main; sys.exit(main(sys.argv[1:]))"


@pytest.mark.timeout(300)
def test_world_bench_two_ranks_every_method(tmp_path):
    rc, out, err = run_separate(
        [sys.executable, "-c", CLI, "bench", "--world-size", "2", "--size", "8MiB", "--tensors",
         "8", "--repeat", "1", "--json", "--dir", str(tmp_path / "scratch")], 240, "world bench")
    assert rc == 0, err[-4000:]
    r = json.loads(out)
    rows = {row["method"]: row for row in r["rows"]}
    assert set(rows) == {"sharded", "sharded_redist", "sharded_shm", "every_rank", "dcp",
                         "raw (1 reader)"}  # the storage limit of one reader, in the same run
    state = rows["sharded"]["state_bytes"]
    assert rows["sharded_shm"]["storage_read_bytes"] == state  # once
    assert rows["sharded"]["storage_read_bytes"] == 2 * state  # once per rank
    assert rows["raw (1 reader)"]["storage_read_bytes"] == state
    assert all(row["restore_s"] > 0 and row["save_s"] > 0 for row in rows.values())
    for name, row in rows.items():  # a raw read right after each restore, and the ratio to it
        if not name.startswith("raw"):
            assert len(row["raw_paired_gbps"]) == len(row["restore_all_s"]) == 1, row
            once = row["state_bytes"] / row["restore_all_s"][0] / 1e9
            assert row["x_raw_paired"] == pytest.approx(once / row["raw_paired_gbps"][0],  # rounded
                                                        rel=0.01, abs=1e-3)
    assert not (tmp_path / "scratch").exists()


@pytest.mark.timeout(300)
def test_world_bench_chosen_methods_on_two_emulated_hosts(tmp_path):
    """--methods picks the world rows; with --hosts 2 the shared restore still reads the state
    once in all (each rank's run crosses to the other host). An unknown method is refused."""
    rc, out, err = run_separate(
        [sys.executable, "-c", CLI, "bench", "--world-size", "2", "--hosts", "2", "--size",
         "8MiB", "--tensors", "8", "--repeat", "1", "--methods", "sharded_shm,dcp", "--json",
         "--dir", str(tmp_path / "scratch")], 240, "world bench")
    assert rc == 0, err[-4000:]
    r = json.loads(out)
    rows = {row["method"]: row for row in r["rows"]}
    assert set(rows) == {"sharded_shm", "dcp", "raw (1 reader)"} and r["hosts"] == 2
    assert rows["sharded_shm"]["storage_read_bytes"] == rows["sharded_shm"]["state_bytes"]
    rc, out, err = run_separate(
        [sys.executable, "-c", CLI, "bench", "--world-size", "2", "--methods", "sharded,nope",
         "--dir", str(tmp_path / "scratch")], 60, "world bench")
    assert rc == 2 and "unknown methods ['nope']" in err
