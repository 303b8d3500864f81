"""Peer replicas of FSDP2 shards: 4 CPU ranks replicate in the background, rank 3 is SIGKILLed,
and the survivors (resharding to 3 ranks, or with a spare taking its place) restore the full
state of the newest step held in memory, equal to the state before the loss. A damaged replica is
never loaded: the previous step's is, or ReplicaUnavailable on every rank.

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_recovery_replica.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_recovery_replica import _run


@pytest.mark.parametrize("scenario,step", [("shrink", 5), ("spare", 5), ("lag", 4),
                                           ("corrupt", 4), ("shrink1", 5), ("spare1", 5),
                                           ("hsdp", 5), ("tp", 5)])
def test_lost_shard_restored_from_memory(tmp_path: Path, scenario: str, step: int) -> None:
    """Rank 3 (or 1: then the survivors' ranks move down and every shard moves) is lost.
    hsdp: HSDP (2 replica groups of 2) without peer replicas, resharded to FSDP over 3; tp:
    tensor parallel (pairs) x FSDP2, resharded to FSDP over 3."""
    res = _run(tmp_path, scenario)
    lost = 1 if scenario.endswith("1") else 3
    members = [r for r in range(4) if r != lost]
    spare = scenario.startswith("spare")
    assert sorted(res) == sorted(members + [4] if spare else members)
    if scenario == "hsdp":  # no peer copies: the other replica group holds rank 3's shard
        assert all(res[r]["buddies"] == [] for r in members)
    else:
        assert res[3 if lost == 1 else 1]["buddies"] == [lost]  # its replica: the other host
    for r in members:
        assert res[r]["new_rank"] == members.index(r)
        assert res[r]["step"] == step, res[r]
        assert res[r]["match"], f"rank {r}: restored state differs from step {step}'s"
        assert res[r]["old_stats"]["rejected"] == 0 or scenario == "corrupt"
    # training goes on in the new group: every rank holds the same next state
    assert len({res[r]["after"] for r in res}) == 1
    assert sum(res[r]["bytes_received"] for r in res) > 0
    if spare:
        assert res[4]["step"] == step and res[4]["bytes_local"] == 0
        if lost == 3:  # the survivors keep their places and shards: only the spare receives
            assert all(res[r]["bytes_received"] == 0 for r in members), res


def test_damaged_replicas_never_loaded(tmp_path: Path) -> None:
    res = _run(tmp_path, "corrupt_both")
    for r in (0, 1, 2):
        assert "no step of all 4 old ranks' shards" in res[r]["unavailable"], res[r]
        assert "step" not in res[r]
