"""ResumableSampler around a DistributedSampler across a change of world size: a checkpoint saved
by W ranks mid-epoch resumes on W' ranks (and a running job reshards mid-epoch) with no sample of
the epoch lost or seen twice, beyond DistributedSampler's own padding (drop_last=False) or cut
(drop_last=True)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from resilient import ResumableSampler


def _ranks(n: int, world: int, shuffle: bool, drop_last: bool, seed: int = 7,
           sampler_type: type = DistributedSampler) -> list[ResumableSampler]:
    data = list(range(n))
    return [ResumableSampler(sampler_type(data, num_replicas=world, rank=r, shuffle=shuffle,
                                          seed=seed, drop_last=drop_last))
            for r in range(world)]


def _take(s: ResumableSampler, k: int) -> list[int]:
    it, out = iter(s), []
    for _ in range(k):
        out.append(next(it))
    return out


def _order(n: int, shuffle: bool, epoch: int, seed: int = 7) -> list[int]:
    d = DistributedSampler(list(range(n)), num_replicas=1, rank=0, shuffle=shuffle, seed=seed)
    d.set_epoch(epoch)
    return list(d)


def _check_epoch(seen: list[int], n: int, old: int, new: int, drop_last: bool) -> None:
    counts = Counter(seen)
    extra = sum(c - 1 for c in counts.values())
    if drop_last:
        assert extra == 0, counts  # nothing twice
        assert n - len(counts) < old + new  # only a cut tail is missed
    else:
        assert set(counts) == set(range(n))  # nothing lost
        assert extra < old + new  # only padding repeats


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 50), old=st.integers(1, 6), new=st.integers(1, 6),
       frac=st.floats(0, 1), shuffle=st.booleans(), drop_last=st.booleans(),
       epoch=st.integers(0, 3))
def test_resume_on_another_world_size_sees_each_sample_once(n, old, new, frac, shuffle,
                                                             drop_last, epoch):
    before = _ranks(n, old, shuffle, drop_last)
    if len(before[0]) == 0:
        return
    for s in before:
        s.set_epoch(epoch)
    c = int(frac * len(before[0]))
    seen = [i for s in before for i in _take(s, c)]
    assert sorted(seen) == sorted((_order(n, shuffle, epoch) * 2)[: c * old]) or c * old > n
    states = [s.state_dict() for s in before]
    after = _ranks(n, new, shuffle, drop_last)
    for r, s in enumerate(after):
        if r < old:
            s.load_state_dict(states[r])  # this rank's own state
        else:
            s.set_position(*after[0].position())  # a new rank: CheckpointManager syncs it
        assert s.epoch == epoch
    for r, s in enumerate(after):
        expected = len(s) - s.consumed  # len: this rank's share of the epoch's current split
        rest = list(s)
        assert len(rest) == expected
        if old == new:  # the same world: exactly the rest of the original split
            ref = _ranks(n, new, shuffle, drop_last)[r]
            ref.set_epoch(epoch)
            assert rest == list(ref)[c:]
        seen += rest
        assert s.epoch == epoch + 1 and s.offset == 0  # the next epoch is whole again
    _check_epoch(seen, n, old, new, drop_last)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(4, 60), sizes=st.lists(st.integers(1, 5), min_size=2, max_size=4),
       shuffle=st.booleans(), data=st.data())
def test_reshard_a_running_iterator_several_times(n, sizes, shuffle, data):
    """In-process world changes: every rank's live iterator switches to the new split."""
    world = sizes[0]
    ranks = _ranks(n, world, shuffle, drop_last=False)
    iters = [iter(s) for s in ranks]
    seen: list[int] = []
    for new in sizes[1:]:
        left = min(len(r._rest_of_epoch()) if r.offset else len(r) - r.consumed for r in ranks)
        k = data.draw(st.integers(0, max(0, left - 1)))
        seen += [next(it) for it in iters for _ in range(k)]
        pos = {r.position() for r in ranks}
        assert len(pos) == 1
        keep = ranks[:new]
        for r, s in enumerate(keep):
            s.reshard(new, r)
        while len(keep) < new:  # a joining rank: a new sampler at the job's position
            s = _ranks(n, new, shuffle, drop_last=False)[len(keep)]
            s.set_position(*pos.pop() if pos else keep[0].position())
            keep.append(s)
            iters.append(iter(s))
        ranks, iters = keep, iters[:new]
    for it in iters:
        seen += list(it)
    counts = Counter(seen)
    assert set(counts) == set(range(n))
    assert sum(c - 1 for c in counts.values()) < sum(sizes)


def test_a_dataloader_over_a_resumed_sampler_yields_the_rest_of_the_epoch():
    data = TensorDataset(torch.arange(40))
    four = [ResumableSampler(DistributedSampler(data, num_replicas=4, rank=r, shuffle=True,
                                                seed=3)) for r in range(4)]
    got = []
    for s in four:
        it = iter(DataLoader(data, batch_size=2, sampler=s))
        got += [x for _ in range(2) for x in next(it)[0].tolist()]  # two batches per rank
    states = [s.state_dict() for s in four]
    two = [ResumableSampler(DistributedSampler(data, num_replicas=2, rank=r, shuffle=True,
                                               seed=3)) for r in range(2)]
    for s, state in zip(two, states):
        s.load_state_dict(state)
        assert len(s) == 12  # 24 of the epoch's 40 left, over two ranks
        got += [x for (b,) in DataLoader(data, batch_size=2, sampler=s) for x in b.tolist()]
    assert sorted(got) == list(range(40))


def test_a_distributed_sampler_subclass_cannot_be_resplit():
    class Mine(DistributedSampler):
        def __iter__(self):
            return iter(range(self.rank, len(self.dataset), self.num_replicas))

    before = _ranks(20, 4, False, False, sampler_type=Mine)
    _take(before[0], 2)
    after = _ranks(20, 2, False, False, sampler_type=Mine)
    with pytest.raises(ValueError, match="own __iter__"):
        after[0].load_state_dict(before[0].state_dict())
    same = _ranks(20, 4, False, False, sampler_type=Mine)[0]
    same.load_state_dict(before[0].state_dict())  # the same world resumes as before
    assert next(iter(same)) == 8


def test_an_old_checkpoint_without_world_resumes_on_the_same_split():
    s = _ranks(20, 2, True, False)[1]
    s.load_state_dict({"epoch": 1, "consumed": 3})
    ref = _ranks(20, 2, True, False)[1]
    ref.set_epoch(1)
    assert list(s) == list(ref)[3:]
