"""The coordinator's native merge-and-commit (_C.commit_shards), driven from one process with
one native engine per simulated rank: success, a stale shard manifest from another save, a
missing rank, a tensor saved twice, and a truncated shard file. No commit on any failure."""

from __future__ import annotations

import json
import os

import pytest
import torch

from resilient import _C
from resilient.checkpoint import tensor_descriptor
from resilient.errors import CorruptCheckpointError, ResilientError


def save_rank(root, rank: int, world: int, step: int, save_id: str, names: list[str]) -> None:
    opts = _C.CheckpointOptions(str(root))
    opts.rank, opts.world_size, opts.keep = rank, world, 0
    engine = _C.Checkpointer(opts)
    keep: list[torch.Tensor] = []
    tensors = {n: torch.full((4, 8), float(rank)) for n in names}
    descs = [tensor_descriptor(n, t, keep) for n, t in tensors.items()]
    engine.save(step, descs, json.dumps({"save_id": save_id, "rank": rank}), False).wait(30)
    engine.close(30)


def test_merges_rank_manifests_into_one_commit(tmp_path):
    for r in range(3):
        save_rank(tmp_path, r, 3, 7, "run-1", [f"r{r}/a", f"r{r}/b"])
    _C.commit_shards(str(tmp_path), 7, 3, "run-1")
    assert _C.committed_steps(str(tmp_path)) == [7]
    m = json.loads((tmp_path / "step-000000000007" / "manifest.json").read_text())
    assert [s["rank"] for s in m["shards"]] == [0, 1, 2] and m["world_size"] == 3
    assert {t["name"]: t["shard"] for t in m["tensors"]} == {
        "r0/a": 0,
        "r0/b": 0,
        "r1/a": 1,
        "r1/b": 1,
        "r2/a": 2,
        "r2/b": 2,
    }
    assert m["values"]["format"] == "resilient.sharded/1"
    assert [v["rank"] for v in m["values"]["ranks"]] == [0, 1, 2]
    # The merged manifest reads back through the ordinary engine, each tensor from its shard.
    engine = _C.Checkpointer(_C.CheckpointOptions(str(tmp_path)))
    out = torch.empty(4, 8)
    engine.read(engine.manifest(7), [{"name": "r2/b", "ptr": out.data_ptr(), "nbytes": 128}])
    assert torch.equal(out, torch.full((4, 8), 2.0))


def test_stale_missing_duplicate_and_truncated_shards_do_not_commit(tmp_path):
    save_rank(tmp_path, 0, 2, 3, "new", ["r0/a"])
    save_rank(tmp_path, 1, 2, 3, "old", ["r1/a"])  # left over by an earlier, failed save
    with pytest.raises(ResilientError, match="rank 1 belongs to another save"):
        _C.commit_shards(str(tmp_path), 3, 2, "new")
    save_rank(tmp_path, 1, 2, 3, "new", ["r0/a"])
    with pytest.raises(ValueError, match="'r0/a' is saved by more than one rank"):
        _C.commit_shards(str(tmp_path), 3, 2, "new")
    save_rank(tmp_path, 1, 2, 3, "new", ["r1/a"])
    with pytest.raises(FileNotFoundError, match="rank 2 left no shard manifest"):
        _C.commit_shards(str(tmp_path), 3, 3, "new")
    data = tmp_path / ".tmp-step-000000000003" / "rank-00001.data"
    os.truncate(data, 16)
    with pytest.raises(CorruptCheckpointError, match="size"):
        _C.commit_shards(str(tmp_path), 3, 2, "new")
    assert _C.committed_steps(str(tmp_path)) == []
    save_rank(tmp_path, 1, 2, 3, "new", ["r1/a"])
    _C.commit_shards(str(tmp_path), 3, 2, "new")
    assert _C.committed_steps(str(tmp_path)) == [3]


def test_coordinator_gives_up_on_a_silent_rank(tmp_path):
    """Rank 0's coordination step with an in-memory store: rank 1 never reports."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from resilient.checkpoint import Checkpointer, SaveHandle

    ck = object.__new__(Checkpointer)  # only the coordinator's fields
    ck.root, ck.rank, ck.world_size, ck.keep, ck.timeout = str(tmp_path), 0, 2, 1, 0.3
    ck._ranks = SimpleNamespace(store=dist.HashStore())
    ck._store = ck._ranks.store
    save_rank(tmp_path, 0, 2, 5, "x-1", ["r0/a"])
    ck._store.set("resilient/ckpt/x-1/rank0", "ok")
    result = ck._coordinate(
        SaveHandle(5, None, "x-1", None), "resilient/ckpt/x-1"
    )
    assert result.startswith("error: rank 1: TimeoutError: did not report within 0.3 s"), result
    assert _C.committed_steps(str(tmp_path)) == []
    ck._store.set("resilient/ckpt/x-2/rank0", "error: rank 0: OSError: disk full")
    ck._store.set("resilient/ckpt/x-2/rank1", "ok")
    result = ck._coordinate(
        SaveHandle(5, None, "x-2", None), "resilient/ckpt/x-2"
    )
    assert result == "error: rank 0: OSError: disk full"
