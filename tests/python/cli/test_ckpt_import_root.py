"""`resilient ckpt import` into a training run's root (issue 50, item 11): refused, because
the imported step would become the newest, which the run resumes from, and the run's retention
would then delete training steps; `--as-head` makes the import the head on purpose."""

from __future__ import annotations

import torch

import resilient
from resilient.cli import main


def _run_root(tmp_path):
    model = torch.nn.Linear(4, 4)
    root = str(tmp_path / "run")
    with resilient.CheckpointManager(root, {"model": model}, every=100, keep=3,
                                     create=True) as m:
        for step in (100, 200, 300):
            torch.nn.init.constant_(model.weight, float(step))
            m.save(step)
    return root


def _pretrained(tmp_path) -> str:
    path = str(tmp_path / "pretrained.pt")
    model = torch.nn.Linear(4, 4)
    torch.nn.init.constant_(model.weight, -7.0)
    torch.save(model.state_dict(), path)
    return path


def test_importing_into_a_training_root_is_refused_and_changes_nothing(tmp_path, capsys):
    root = _run_root(tmp_path)
    assert main(["ckpt", "import", _pretrained(tmp_path), root, "--key", "model"]) == 2
    err = capsys.readouterr().err
    assert "already holds committed steps [100, 200, 300]" in err and "--as-head" in err
    with resilient.Checkpointer(root) as ck:
        assert ck.steps() == [100, 200, 300] and ck.lineage() == [300, 200, 100]
    model = torch.nn.Linear(4, 4)
    with resilient.CheckpointManager(root, {"model": model}, every=100, keep=3) as m:
        assert m.restore() == 300  # the run resumes where it was
        assert float(model.weight[0, 0].detach()) == 300.0


def test_as_head_needs_a_newer_step_and_then_continues_the_lineage(tmp_path, capsys):
    root = _run_root(tmp_path)
    src = _pretrained(tmp_path)
    assert main(["ckpt", "import", src, root, "--key", "model", "--as-head"]) == 2
    assert "greater than the newest step" in capsys.readouterr().err
    assert main(["ckpt", "import", src, root, "--key", "model", "--as-head",
                 "--step", "400"]) == 0
    capsys.readouterr()
    model = torch.nn.Linear(4, 4)
    with resilient.Checkpointer(root, keep=3, writer=True) as ck:
        assert ck.load({"model": model}) == 400 and float(model.weight[0, 0].detach()) == -7.0
        ck.save(500, {"model": model})
        ck.wait_cleanup()
        assert ck.lineage() == [500, 400, 300]  # keep=3 of one lineage


def test_importing_into_a_root_a_job_is_writing_is_refused(tmp_path, capsys):
    root = _run_root(tmp_path)
    model = torch.nn.Linear(4, 4)
    with resilient.CheckpointManager(root, {"model": model}, every=100):  # the live job
        assert main(["ckpt", "import", _pretrained(tmp_path), root, "--key", "model",
                     "--as-head", "--step", "400"]) == 2
        assert "another Checkpointer of this process" in capsys.readouterr().err


def test_importing_into_a_new_root_still_works(tmp_path):
    root = str(tmp_path / "new")
    assert main(["ckpt", "import", _pretrained(tmp_path), root, "--key", "model"]) == 0
    with resilient.Checkpointer(root) as ck:
        assert ck.steps() == [0]


def test_as_head_never_replaces_a_step_outside_the_lineage(tmp_path, capsys):
    """A step whose lineage record was lost is kept until repaired (not in the lineage, not
    deleted): --as-head with its number is refused, not written over it."""
    import os

    root = _run_root(tmp_path)
    os.remove(os.path.join(root, "step-000000000300", "lineage.json"))
    assert main(["ckpt", "import", _pretrained(tmp_path), root, "--key", "model", "--as-head",
                 "--step", "300"]) == 2
    assert "greater than the newest step" in capsys.readouterr().err
    with resilient.Checkpointer(root) as ck:
        model = torch.nn.Linear(4, 4)
        assert ck.load({"model": model}, step=300, subset=True) == 300
        assert float(model.weight[0, 0].detach()) == 300.0
