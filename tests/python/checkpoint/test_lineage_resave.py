"""Saving a step that already exists replaces it in the lineage (issue 44, item 1).

The loops users write re-save steps: a job resumed from step 200 saves 200 again (the
manager's "save on resume", torchtitan's save at the loaded step), a DCP user replaces
``root/step-300`` atomically, a loop re-runs its last step. A replaced step takes the replaced
one's parent, the old copy stays loadable until the new one is committed, and retention keeps
``keep`` steps of the lineage.
"""


from __future__ import annotations

import errno

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import resilient
from resilient import _C


def _w(value: float) -> dict:
    return {"w": torch.full((8,), float(value))}


def _loaded(ck: resilient.Checkpointer, step: int | None = None) -> tuple[int | None, float]:
    state = {"w": torch.zeros(8)}
    got = ck.load(state, step=step)
    return got, float(state["w"][0])


def test_resaving_a_step_keeps_the_steps_before_it(tmp_path):
    with resilient.Checkpointer(tmp_path / "c", keep=3, create=True) as ck:
        for i, s in enumerate((1, 2, 3, 3, 4)):
            ck.save(s, _w(10 * s + i)).wait()
        ck.wait_cleanup()
        assert ck.steps() == [2, 3, 4]
        assert ck.lineage() == [4, 3, 2]
        assert _loaded(ck, 3) == (3, 33.0)  # the second save of step 3
        assert _loaded(ck) == (4, 44.0)


def test_a_resumed_job_that_saves_the_step_it_resumed_from(tmp_path):
    root = tmp_path / "c"
    with resilient.Checkpointer(root, keep=3, create=True) as ck:
        ck.save(100, _w(100)).wait()
        ck.save(200, _w(200)).wait()
    with resilient.Checkpointer(root, keep=3) as ck:  # the restarted job
        assert _loaded(ck) == (200, 200.0)
        ck.save(200, _w(201)).wait()  # "save on resume"
        ck.save(300, _w(300)).wait()
        ck.wait_cleanup()
        assert ck.steps() == [100, 200, 300]
        assert ck.lineage() == [300, 200, 100]
        assert _loaded(ck, 200) == (200, 201.0)


def test_the_manager_resaving_after_restore(tmp_path):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": opt}
    with resilient.CheckpointManager(str(tmp_path / "c"), state, every=10, keep=3,
                                     create=True) as m:
        for step in (10, 20, 30):
            m.save(step)
    with resilient.CheckpointManager(str(tmp_path / "c"), state, every=10, keep=3) as m:
        step = m.restore()
        assert step == 30
        m.save(step)  # the same step again, right after the restore
        m.save(40)
        m.wait()
        m.checkpointer.wait_cleanup()
        assert m.checkpointer.lineage() == [40, 30, 20]


def test_dcp_atomic_replace_of_a_step_keeps_the_lineage(tmp_path):
    import torch.distributed.checkpoint as dcp

    from resilient.dcp import ResilientStorageReader, ResilientStorageWriter

    root = tmp_path / "c"
    for step, value in ((100, 1.0), (200, 2.0), (300, 3.0), (300, 3.5)):
        state = {"w": torch.full((8,), value)}
        dcp.save(state, checkpoint_id=str(root / f"step-{step}"),
                 storage_writer=ResilientStorageWriter(str(root)))
    with resilient.Checkpointer(root, keep=0) as ck:
        assert ck.lineage() == [300, 200, 100]
    got = {"w": torch.zeros(8)}
    dcp.load(got, storage_reader=ResilientStorageReader(str(root)))
    assert float(got["w"][0]) == 3.5


def test_a_failed_resave_leaves_the_old_copy_loadable(tmp_path):
    root = tmp_path / "c"
    with resilient.Checkpointer(root, keep=3, create=True, o_direct="off") as ck:
        for s in (1, 2, 3):
            ck.save(s, _w(s)).wait()
        _C.install_fault_hook(["rename"], errno.EIO, path_contains="step-000000000003")
        try:
            with pytest.raises(OSError):
                ck.save(3, _w(33)).wait()
        finally:
            _C.clear_fault_hook()
    with resilient.Checkpointer(root, keep=3) as ck:
        assert ck.lineage() == [3, 2, 1]
        assert _loaded(ck) == (3, 3.0)


# What the lineage should be after any mix of saves, re-saves and rollbacks: a model in which the
# lineage is a list of steps (oldest first) and the writer's position one of them.
_ops = st.lists(
    st.one_of(st.tuples(st.just("save"), st.integers(1, 8)),
              st.tuples(st.just("load"), st.integers(0, 7)),   # index into the lineage
              st.tuples(st.just("reopen"), st.just(0))),
    min_size=1, max_size=12)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_ops, keep=st.integers(0, 4))
def test_lineage_after_any_mix_of_saves_resaves_and_rollbacks(tmp_path_factory, ops, keep):
    root = tmp_path_factory.mktemp("lineage") / "c"
    chain: list[int] = []  # the model's lineage, oldest first
    head: int | None = None  # the writer's position
    values: dict[int, float] = {}
    ck = resilient.Checkpointer(root, keep=keep, create=True)
    try:
        for n, (op, arg) in enumerate(ops):
            if op == "save":
                step = arg
                base = chain[: chain.index(head) + 1] if head is not None else []
                chain = [s for s in base if s < step] + [step]
                head = step
                values[step] = float(n)
                ck.save(step, _w(n)).wait()
            elif op == "load" and chain:
                kept = chain if keep <= 0 else chain[-keep:]
                step = kept[-1 - arg % len(kept)]
                assert _loaded(ck, step) == (step, values[step])
                head = step
            elif op == "reopen":
                ck.close()
                ck = resilient.Checkpointer(root, keep=keep, create=True)
                head = chain[-1] if chain else None
        ck.wait_cleanup()
        kept = chain if keep <= 0 else chain[-keep:]
        assert ck.lineage() == kept[::-1]
        assert ck.steps() == sorted(kept)  # abandoned branches deleted
        if chain:
            assert _loaded(ck) == (chain[-1], values[chain[-1]])
    finally:
        ck.close()


def test_a_rollback_in_a_root_written_before_lineage_records_keeps_retention(tmp_path, caplog):
    """Steps of a root written before lineage records existed have none; a rollback there
    leaves the newer ones off the lineage, and retention deletes them as before (they are
    not steps that lost their record)."""
    import os

    root = tmp_path / "c"
    with resilient.Checkpointer(root, keep=0, create=True) as ck:
        for s in (10, 20, 30):
            ck.save(s, _w(s)).wait()
    for s in (10, 20, 30):  # as an older version wrote them
        os.remove(root / f"step-{s:012d}" / "lineage.json")
    with resilient.Checkpointer(root, keep=2) as ck:
        assert _loaded(ck, 10) == (10, 10.0)
        ck.save(15, _w(15)).wait()
        ck.save(16, _w(16)).wait()
        ck.wait_cleanup()
        assert ck.lineage() == [16, 15]
        assert ck.steps() == [15, 16]
    assert not any("retention skipped" in r.getMessage() for r in caplog.records)
