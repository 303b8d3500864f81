"""The chaos runner's corrupt fault damages the checkpoint whose save began last: when that save
is still in flight at the fault's step, it waits (bounded) for its commit. Without the wait, a
loaded CI machine corrupted an older step or none, the in-flight save then committed intact,
and the no-valid-checkpoint scenario resumed from it ("expected an unrecoverable failure, got
finished")."""

from __future__ import annotations

import threading
from pathlib import Path

from resilient.chaos import runner as runner_mod
from resilient.chaos.plan import Fault, Plan


def _commit(root: Path, step: int, payload: bytes = b"x" * 4096) -> None:
    d = root / f"step-{step:012d}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "rank0.data").write_bytes(payload)
    (d / "manifest.json").write_text("{}")


def test_a_corrupt_fault_waits_for_the_save_in_flight(tmp_path: Path) -> None:
    r = runner_mod.Runner(Plan(name="t"), run_dir=tmp_path / "run")
    _commit(Path(r.ckpt), 0)
    r._on_event({"kind": "save_begin", "step": 5, "rank": 0})  # step 5's save is in flight
    committed = threading.Event()
    # step 5 commits a moment after the fault fires
    timer = threading.Timer(0.3, lambda: (_commit(Path(r.ckpt), 5), committed.set()))
    timer.start()
    try:
        r._inject(Fault(type="corrupt", at_step=6))
    finally:
        timer.join()
    assert committed.is_set()
    assert r.result.corrupted == [5]
    data = (Path(r.ckpt) / "step-000000000005" / "rank0.data").read_bytes()
    assert data != b"x" * 4096  # damaged
    assert (Path(r.ckpt) / "step-000000000000" / "rank0.data").read_bytes() == b"x" * 4096


def test_a_save_that_never_commits_bounds_the_wait(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(runner_mod, "CORRUPT_WAIT_S", 0.2)
    r = runner_mod.Runner(Plan(name="t"), run_dir=tmp_path / "run")
    _commit(Path(r.ckpt), 0)
    r._on_event({"kind": "save_begin", "step": 5, "rank": 0})  # killed: never commits
    r._inject(Fault(type="corrupt", at_step=6))
    assert r.result.corrupted == [0]  # the newest committed one, after the bounded wait
