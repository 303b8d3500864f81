"""Loading part of a checkpoint on purpose, and a load that fails part-way (issue 44 item 8,
issue 50 item 8).

Evaluation from a training checkpoint loads the model of a {model, optim} checkpoint:
``load({"model": model}, subset=True)`` stays strict within the entries the target has. A load
that fails after it began reading says so on the exception (``target_modified`` and a note),
so a caller that catches it does not train from a half-loaded model believing it fresh.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import resilient
from damage import flip_byte


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return model, opt


def _fresh():
    torch.manual_seed(123)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


@pytest.fixture
def training_root(tmp_path):
    model, opt = _trained()
    with resilient.Checkpointer(tmp_path / "c", create=True) as ck:
        ck.save(100, {"model": model, "optim": opt, "step": 100}).wait()
    return tmp_path / "c", model


def test_evaluation_loads_the_model_of_a_training_checkpoint(training_root):
    root, trained = training_root
    model = _fresh()
    with resilient.Checkpointer(root) as ck:
        assert ck.load({"model": model}, subset=True) == 100
    for a, b in zip(model.parameters(), trained.parameters()):
        assert torch.equal(a, b)


def test_a_state_dict_target_works_too(training_root):
    root, trained = training_root
    model = _fresh()
    sd = model.state_dict()
    with resilient.Checkpointer(root) as ck:
        ck.load({"model": sd}, subset=True)
    model.load_state_dict(sd)
    assert torch.equal(model[0].weight, trained[0].weight)


def test_without_subset_the_error_says_how_to_load_a_subset(training_root):
    root, _ = training_root
    model = _fresh()
    before = model[0].weight.clone()
    with resilient.Checkpointer(root) as ck:
        with pytest.raises(resilient.IncompatibleCheckpointError, match="subset=True") as info:
            ck.load({"model": model})
    assert set(info.value.unexpected) == {"optim", "step"}
    assert torch.equal(model[0].weight, before)  # nothing was modified
    assert info.value.target_modified is False


def test_subset_stays_strict_within_the_entries(training_root):
    root, _ = training_root
    wider = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    before = wider[0].weight.clone()
    with resilient.Checkpointer(root) as ck:
        with pytest.raises(resilient.IncompatibleCheckpointError, match="mismatched") as info:
            ck.load({"model": wider}, subset=True)
        assert "model/0.weight" in info.value.mismatched[0]
        with pytest.raises(resilient.IncompatibleCheckpointError, match="missing") as info:
            ck.load({"model": _fresh(), "ema": _fresh()}, subset=True)
        assert info.value.missing == ["ema"]
        deeper = _fresh()
        deeper.add_module("head", torch.nn.Linear(2, 2))  # a key the saved model lacks
        with pytest.raises(resilient.IncompatibleCheckpointError, match="missing"):
            ck.load({"model": deeper}, subset=True)
        with pytest.raises(TypeError, match="dict of top-level entries"):
            ck.load(_fresh(), subset=True)
    assert torch.equal(wider[0].weight, before)


def _corrupt_tensor(root, step: int, index: int, nbytes: int) -> None:
    data = os.path.join(root, f"step-{step:012d}", "rank-00000.data")
    flip_byte(data, index * nbytes + 100)


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bad=st.integers(0, 7))
def test_a_load_that_fails_midway_says_the_target_was_partly_overwritten(tmp_path_factory, bad):
    root = tmp_path_factory.mktemp("partial") / "c"
    n = 1 << 16  # one 256 KiB chunk per tensor, in order in the rank's data file
    saved = {f"t{i}": torch.full((n,), float(i)) for i in range(8)}
    with resilient.Checkpointer(root, create=True) as ck:
        ck.save(1, saved).wait()
    _corrupt_tensor(root, 1, bad, n * 4)
    target = {f"t{i}": torch.full((n,), -1.0) for i in range(8)}
    with resilient.Checkpointer(root) as ck:
        with pytest.raises(resilient.CorruptCheckpointError) as info:
            ck.load(target)
    e = info.value
    assert e.target_modified is True
    assert any("target_modified=True" in note for note in e.__notes__)
    for i in range(8):
        t = target[f"t{i}"]
        if i != bad:  # untouched, or the saved value: never a mix
            assert torch.equal(t, saved[f"t{i}"]) or bool((t == -1).all())


def test_a_fallback_to_the_parent_restores_everything(tmp_path):
    n = 1 << 16
    with resilient.Checkpointer(tmp_path / "c", create=True) as ck:
        ck.save(1, {f"t{i}": torch.full((n,), float(i)) for i in range(8)}).wait()
        ck.save(2, {f"t{i}": torch.full((n,), 10.0 + i) for i in range(8)}).wait()
    _corrupt_tensor(tmp_path / "c", 2, 5, n * 4)
    target = {f"t{i}": torch.full((n,), -1.0) for i in range(8)}
    with resilient.Checkpointer(tmp_path / "c") as ck:
        assert ck.load(target) == 1
        assert [s for s, _ in ck.last_load.skipped] == [2]
    for i in range(8):
        assert torch.equal(target[f"t{i}"], torch.full((n,), float(i)))
