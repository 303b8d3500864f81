"""Resuming a DataLoader with workers exactly (issue 44, item 3).

A DataLoader with workers draws indices ahead of the loop (prefetch_factor batches per worker),
and with several epochs the sampler may even finish an epoch before the loop does. A
ResumableSampler counts what the loop received (the batches the DataLoader yielded), so a
checkpoint taken at any batch resumes with the next batch. Where that count cannot be exact it
raises at save. torchdata's StatefulDataLoader is saved as a rank_state entry like any
Stateful object.

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_sampler_workers.py."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
)

import resilient
from resilient import ResumableSampler, forever


def _inner(kind: str, n: int):
    data = list(range(n))
    if kind == "random":
        return RandomSampler(data, generator=torch.Generator().manual_seed(7))
    if kind == "sequential":
        return SequentialSampler(data)
    return DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)


def _loader(kind, n, batch, drop_last, workers, prefetch, persistent):
    sampler = ResumableSampler(_inner(kind, n))
    extra = dict(prefetch_factor=prefetch, persistent_workers=persistent) if workers else {}
    loader = DataLoader(list(range(n)), batch_size=batch, drop_last=drop_last, sampler=sampler,
                        num_workers=workers, **extra)
    return sampler, loader


def _take(batches, k):
    return [b.tolist() for b in itertools.islice(batches, k)]


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(kind=st.sampled_from(["random", "sequential", "distributed"]), n=st.integers(5, 23),
       batch=st.integers(1, 4), drop_last=st.booleans(), workers=st.sampled_from([0, 1, 2]),
       prefetch=st.integers(1, 3), persistent=st.booleans(), at=st.integers(0, 17))
def test_a_resume_continues_with_the_next_batch_whatever_the_workers_drew(
        kind, n, batch, drop_last, workers, prefetch, persistent, at):
    sampler, loader = _loader(kind, n, batch, drop_last, workers, prefetch, persistent)
    assume(len(loader) > 0)
    batches = forever(loader)
    _take(batches, at)
    state = sampler.state_dict()
    expected = _take(batches, 6)
    sampler2, loader2 = _loader(kind, n, batch, drop_last, workers, prefetch, persistent)
    sampler2.load_state_dict(state)
    assert _take(forever(loader2), 6) == expected


def test_the_manager_resumes_a_loader_with_workers_exactly(tmp_path):
    def run(stop_after: int) -> tuple[int, list]:
        model = torch.nn.Linear(1, 1)
        sampler = ResumableSampler(RandomSampler(range(64),
                                                 generator=torch.Generator().manual_seed(0)))
        loader = DataLoader(list(range(64)), batch_size=4, sampler=sampler, num_workers=2)
        with resilient.CheckpointManager(str(tmp_path / "c"), {"model": model},
                                         rank_state={"sampler": sampler}, every=5,
                                         create=True) as ckpt:
            step = start = ckpt.restore()
            seen = []
            for batch in forever(loader):
                seen.append(batch.tolist())
                step += 1
                ckpt.step(step)
                if step == stop_after:
                    break
        return start, seen

    _, whole = run(30)  # the reference run, in a root of its own
    (tmp_path / "c").rename(tmp_path / "whole")
    _, first = run(12)  # saved at 5 and 10; stopped ("killed") after 12
    start, rest = run(30)
    assert start == 10
    assert first[:10] + rest == whole


def test_batches_out_of_order_are_refused_at_save(tmp_path):
    sampler = ResumableSampler(SequentialSampler(range(32)))
    loader = DataLoader(list(range(32)), batch_size=2, sampler=sampler, num_workers=2,
                        in_order=False)
    batches = iter(loader)
    next(batches)
    with resilient.Checkpointer(tmp_path / "c", create=True) as ck:
        with pytest.raises(ValueError, match="in_order=False"):
            ck.save(1, {"w": torch.zeros(1)}, rank_state={"sampler": sampler})
        assert ck.steps() == []


def test_a_custom_batch_sampler_with_workers_is_refused_at_save():
    class Pairs(BatchSampler):  # torch's BatchSampler subclassed: its batch size still counts
        pass

    class Odd:  # not a BatchSampler: batches of varying size
        def __init__(self, sampler):
            self.sampler = sampler

        def __iter__(self):
            it = iter(self.sampler)
            while batch := list(itertools.islice(it, 3)):
                yield batch

        def __len__(self):
            return 11

    sampler = ResumableSampler(SequentialSampler(range(32)))
    loader = DataLoader(list(range(32)), batch_sampler=Pairs(sampler, 2, False), num_workers=1)
    it = iter(loader)
    next(it)
    assert sampler.state_dict()["consumed"] == 2

    sampler = ResumableSampler(SequentialSampler(range(32)))
    loader = DataLoader(list(range(32)), batch_sampler=Odd(sampler), num_workers=1)
    it = iter(loader)
    next(it)
    with pytest.raises(ValueError, match="batch sampler of type Odd"):
        sampler.state_dict()


def test_stateful_dataloader_is_a_rank_state_entry(tmp_path):
    sdl = pytest.importorskip("torchdata.stateful_dataloader")

    def make():
        return sdl.StatefulDataLoader(list(range(50)), batch_size=3, num_workers=2,
                                      shuffle=True, generator=torch.Generator().manual_seed(1))

    loader = make()
    batches = iter(loader)
    _take(batches, 7)
    with resilient.Checkpointer(tmp_path / "c", create=True) as ck:
        ck.save(7, {"w": torch.zeros(1)}, rank_state={"loader": loader}).wait()
    expected = _take(batches, 6)
    loader2 = make()
    with resilient.Checkpointer(tmp_path / "c") as ck:
        assert ck.load({"w": torch.zeros(1)}, rank_state={"loader": loader2}) == 7
    assert _take(iter(loader2), 6) == expected


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_save_after_an_epoch_loop_resumes_at_the_next_epoch(workers, drop_last):
    """`for epoch: for batch in loader: ...; save` saves after the loop ended: the position is
    the next epoch's start, also when drop_last left the last partial batch undrawn by the loop
    (workers drew it), so the resumed run's epochs are the uninterrupted run's."""
    def make():
        s = ResumableSampler(RandomSampler(range(10), generator=torch.Generator().manual_seed(3)))
        return s, DataLoader(list(range(10)), batch_size=3, drop_last=drop_last, sampler=s,
                             num_workers=workers)

    sampler, loader = make()
    first = [b.tolist() for b in loader]
    state = sampler.state_dict()
    assert state["epoch"] == 1 and state["consumed"] == 0, state
    second = [b.tolist() for b in loader]
    sampler2, loader2 = make()
    sampler2.load_state_dict(state)
    assert [b.tolist() for b in loader2] == second
    assert second != first
