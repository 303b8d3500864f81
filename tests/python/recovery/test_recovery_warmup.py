"""The rebuilt groups' warm-up (resilient.recovery.warmup): what it warms, that its
collectives pair across ranks, and that a failed warm-up fails the restore."""


from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from resilient.recovery import warmup


def _poll(done, finish):
    """Recovery._poll without the verdict. A work is waited for: gloo's reduce-scatter
    reports completion only from wait() (NCCL's can be polled)."""
    deadline = time.monotonic() + 30
    while getattr(finish, "__name__", "") != "wait" and not done():
        assert time.monotonic() < deadline
        time.sleep(0.001)
    return finish()


@pytest.fixture
def world1():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _nested(sizes: list[tuple[int, int]]) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(*[nn.Linear(i, o) for i, o in sizes])
    for layer in model[:-1]:
        fully_shard(layer)
    fully_shard(model)
    return model


def test_each_unit_counts_its_own_parameters_and_the_plan_takes_small_and_largest(world1):
    """Unsharded sizes (the two-rank test below checks that they agree across ranks)."""
    model = _nested([(40, 30), (30, 20), (20, 2)])
    sizes = sorted(n for n, _ in warmup.unit_sizes(model))
    # the root unit owns only the last layer; the nested units their own layer each
    assert sizes == sorted([40 * 30 + 30, 30 * 20 + 20, 20 * 2 + 2])
    assert warmup.plan(model) == [(warmup.SMALL, torch.float32), (40 * 30 + 30, torch.float32)]
    tiny = _nested([(4, 3), (3, 2)])
    assert warmup.plan(tiny) == [(4 * 3 + 3, torch.float32)]  # smaller than SMALL: one size


def test_a_unit_with_a_mixed_precision_policy_is_warmed_in_its_gather_dtype(world1):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = nn.Sequential(nn.Linear(40, 30), nn.Linear(30, 2))
    fully_shard(model[0], mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fully_shard(model)
    assert sorted(warmup.unit_sizes(model), key=lambda s: s[0]) == [
        (30 * 2 + 2, torch.float32), (40 * 30 + 30, torch.bfloat16)]


def test_only_nccl_groups_of_a_gpu_model_are_warmed(world1, monkeypatch):
    model = _nested([(8, 4), (4, 2)])
    assert warmup.mesh_groups(model) == []  # gloo's connections are made at its creation
    assert warmup.Warmup.for_model(model, torch.device("cpu")).start().finish(_poll) is False
    from resilient.comm import process_group as pgm

    monkeypatch.setattr(pgm, "nccl_backend", lambda g: object())
    assert warmup.mesh_groups(model) == [dist.group.WORLD]  # one group, however many params


def test_a_failed_warm_up_fails_the_restore(world1, monkeypatch):
    def fails(*_a):
        raise RuntimeError("no memory for the buffers")

    monkeypatch.setattr(warmup, "issue", fails)
    w = warmup.Warmup([dist.group.WORLD], [(8, torch.float32)], torch.device("cpu")).start()
    with pytest.raises(RuntimeError, match="warming the new NCCL groups failed: no memory"):
        w.finish(_poll)


def test_the_finish_polls_the_thread_and_every_work(world1):
    calls = []

    def poll(done, finish):
        calls.append(done)
        return _poll(done, finish)

    w = warmup.Warmup([dist.group.WORLD], [(8, torch.float32), (3000, torch.float64)],
                      torch.device("cpu")).start()
    assert w.finish(poll) is True
    assert not w.thread.is_alive()
    assert len(calls) == 1 + 3 * 2  # the thread, then three collectives per size
    # the timeline's nccl_warmed event says where the warm-up's time went, in order
    assert list(w.phases) == ["allocated", "voted", "issued", "completed"]
    assert sorted(w.phases.values()) == list(w.phases.values())


def test_a_cpu_spare_warms_nothing():
    assert warmup.warm_compute(torch.device("cpu"), {torch.bfloat16}) == 0.0


def test_only_torch_optims_own_optimizers_are_initialized_during_the_warm_up():
    """Their steps are elementwise on DTensors; any other optimizer's state is created before
    the warm-up's thread issues on the groups its step may also use."""
    from resilient.recovery.sharded import _step_is_local

    params = [nn.Parameter(torch.zeros(2))]

    class Lamb(torch.optim.SGD):  # a subclass outside torch.optim: its step may communicate
        pass

    assert _step_is_local(torch.optim.SGD(params, lr=0.1))
    assert _step_is_local(torch.optim.AdamW(params))
    assert not _step_is_local(Lamb(params, lr=0.1))
