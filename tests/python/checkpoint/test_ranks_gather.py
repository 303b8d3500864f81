"""Ranks.gather and Ranks.enter on 3 gloo processes: objects of random sizes (a few bytes to
hundreds of kilobytes, so both the one-round and the two-round path, and the slot's growth) come
back exactly, in rank order, on every rank; entries of one operation with one argument pass;
a different argument, or a different operation, raises CollectiveError on every rank, naming
each rank's call; a checked entry raises before the caller does anything else; a rank that
comes after the others gave up raises at its entry; an abort makes the next entry raise on
every rank; a save's stats say how long it waited in its collectives.

Runs in child processes started by this file's __main__ (own session, killed on timeout)."""


from __future__ import annotations

from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st


@hsettings(deadline=None)
@given(slot=st.sampled_from([1024, 2048, 4096, 65536]), n=st.integers(0, 1 << 20),
       world=st.integers(1, 100_000))
def test_a_grown_slot_fits_what_it_can_within_its_bounds(slot, n, world):
    from resilient.checkpoint.ranks import _ROUND_MAX, _SLOT_MAX, _SLOT_MIN, grown_slot

    limit = max(_SLOT_MIN, min(_SLOT_MAX, _ROUND_MAX // world))
    slot = min(slot, limit)
    got = grown_slot(slot, n, world)
    assert slot <= got <= max(slot, limit)
    if n + 8 <= limit:
        assert got >= n + 8
    if slot < got < limit:  # the smallest power of two that fits
        assert got & (got - 1) == 0 and got // 2 < n + 8


def test_a_peer_lost_while_the_ranks_connect_is_a_collective_error(monkeypatch, free_port):
    """The checkpointer's first collective (rank 0's run id) failing in gloo (a peer killed while
    a rebuilt group connects: "timed out connecting ... Connection refused") raises
    CollectiveError (a recovery takes it for a peer's failure and starts the next one: it had
    raised gloo's RuntimeError, which ended the job: test_recovery_overlap_system's [rebuild])"""
    import torch.distributed as dist

    from resilient.checkpoint import ranks as ranks_mod
    from resilient.errors import CollectiveError

    class Failed:
        def is_completed(self) -> bool:
            return True

        def wait(self) -> None:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:152] timed out connecting: "
                               "SO_ERROR: Connection refused\nmore")

    store = dist.TCPStore("127.0.0.1", free_port, 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        monkeypatch.setattr(ranks_mod.dist, "broadcast", lambda *a, **k: Failed())
        try:
            ranks_mod.Ranks(True, dist.group.WORLD, store, 5.0, 5.0)
        except CollectiveError as e:
            err = e
        else:
            raise AssertionError("no error")
        assert "creating the checkpointer's ranks failed" in str(err)
        assert "Connection refused" in str(err) and "more" not in str(err)
        assert isinstance(err.__cause__, RuntimeError)
    finally:
        dist.destroy_process_group()
