"""Rebuilding torch.distributed groups: pure helpers, and the 4-process gloo kill scenario."""


from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")


dist = pytest.importorskip("torch.distributed")


ROOT = Path(__file__).resolve().parents[3]


sys.path.insert(0, str(ROOT / "examples"))


from resilient.comm.process_group import (  # noqa: E402
    generation_store,
    rebuild_process_group,
    supports_shrink,
    survivor_rank,
)


def test_survivor_rank_closes_gaps_like_shrink() -> None:
    assert survivor_rank(3, 4, [1]) == 2
    assert survivor_rank(0, 4, [3]) == 0
    assert survivor_rank(5, 8, [7, 0, 2]) == 3
    for bad in ([1], [4], [2, 2]):
        with pytest.raises(ValueError):
            survivor_rank(1, 4, bad)


def test_generation_store_separates_generations() -> None:
    base = dist.HashStore()
    base.set_timeout(timedelta(seconds=5))
    generation_store(base, 1).set("k", b"one")
    generation_store(base, 2).set("k", b"two")
    assert generation_store(base, 1).get("k") == b"one"
    assert base.get("gen2/k") == b"two"


def test_rebuild_without_group_is_an_error() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="no default process group"):
        rebuild_process_group(dist.HashStore(), generation=1, excluded=[1])


def test_single_process_gloo_rebuild_into_new_generation() -> None:
    """The reinit path in one process: gloo cannot shrink, so abort + new group under gen1/."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=generation_store(store, 0), rank=0, world_size=1)
    try:
        assert not supports_shrink()
        with pytest.raises(ValueError):
            rebuild_process_group(store, generation=1, excluded=[0])
        res = rebuild_process_group(store, generation=1, excluded=[], backend="gloo",
                                    timeout=timedelta(seconds=10))
        assert (res.rank, res.world_size, res.generation) == (0, 1, 1)
        assert res.timings.method == "reinit"
        assert res.timings.first_collective_s > 0
        assert dist.get_world_size() == 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_later_default_nccl_group_gets_its_global_ranks(monkeypatch) -> None:
    """torch 2.11 splits a default NCCL group other than the process's first one by reading
    its empty global-rank list (SIGSEGV, HSDP rebuilt on 4 H200s): join_process_group fills
    it in; a list torch filled in is left alone."""
    from resilient.comm import process_group as pgm

    options = dist.ProcessGroupNCCL.Options()  # torch's own type: the attribute is real
    backend = type("Backend", (), {"options": options})()
    monkeypatch.setattr(pgm, "backend_of", lambda group, device: backend)
    pgm.name_default_group_ranks(object(), 3)
    assert list(options.global_ranks_in_group) == [0, 1, 2]
    options.global_ranks_in_group = [4, 5]
    pgm.name_default_group_ranks(object(), 2)
    assert list(options.global_ranks_in_group) == [4, 5]
    monkeypatch.setattr(pgm, "backend_of", lambda group, device: None)  # gloo: nothing to do
    pgm.name_default_group_ranks(object(), 2)
