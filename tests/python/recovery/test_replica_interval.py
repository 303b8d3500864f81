"""RESILIENT_REPLICA_EVERY=0: the replicas' interval chosen so that a send fits, the same on
every rank (resilient.recovery.replica.choose_every, PeerReplicas._agree_interval)."""


from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from resilient.recovery import replica
from resilient.recovery.replica import MARGIN, MAX_EVERY, choose_every


@given(st.floats(0.0, 100.0), st.floats(1e-4, 10.0))
@settings(max_examples=300, deadline=None)
def test_the_interval_is_the_fewest_steps_a_send_fits_in(send_s: float, step_s: float) -> None:
    every = choose_every(send_s, step_s)
    assert 1 <= every <= MAX_EVERY
    if every < MAX_EVERY:
        assert every * step_s >= MARGIN * send_s * (1 - 1e-9)  # fits, with the margin
    if 1 < every < MAX_EVERY:
        assert (every - 1) * step_s < MARGIN * send_s  # and one step fewer would not


def test_an_unmeasured_step_takes_the_longest_interval_only_when_a_send_took_time() -> None:
    assert choose_every(0.0, 0.0) == 1
    assert choose_every(0.5, 0.0) == MAX_EVERY


def test_a_negative_interval_is_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        replica.PeerReplicas(nn.Linear(2, 2), None, every=-1)  # type: ignore[arg-type]
