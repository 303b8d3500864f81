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
