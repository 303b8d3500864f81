"""A second job on a root in use stops when it starts, and a new root says it was created
(issue 44, item 9).

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_root_in_use.py."""


from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import resilient

HOLDER = textwrap.dedent("""
    import sys, torch, resilient
    model = torch.nn.Linear(2, 2)
    m = resilient.CheckpointManager(sys.argv[1], {"model": model}, every=1, create=True)
    m.restore()
    m.save(1)
    m.wait()
    print("training", flush=True)
    sys.stdin.readline()          # until the test is done
    m.close()
""")


@pytest.fixture
def busy_root(tmp_path):
    root = tmp_path / "c"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(root)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "training"
        yield root
    finally:
        proc.stdin.close()
        proc.wait(60)


def test_a_second_manager_on_a_root_in_use_stops_before_it_resumes(busy_root):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(resilient.RootInUseError, match="being written by another process"):
        resilient.CheckpointManager(str(busy_root), {"model": model}, every=1, create=True)
    with pytest.raises(resilient.RootInUseError):  # without create too: a manager saves
        resilient.CheckpointManager(str(busy_root), {"model": model}, every=1)


def test_a_second_checkpointer_that_may_start_fresh_stops_at_once(busy_root):
    with pytest.raises(resilient.RootInUseError):
        resilient.Checkpointer(busy_root, create=True)
    with pytest.raises(resilient.RootInUseError):
        resilient.Checkpointer(busy_root, writer=True)


def test_a_reader_of_a_root_in_use_still_loads(busy_root):
    state = {"model": torch.nn.Linear(2, 2)}
    with resilient.Checkpointer(busy_root) as ck:  # evaluation while the job trains
        assert ck.load(state) == 1
        with pytest.raises(resilient.RootInUseError):
            ck.save(2, state)


LOCK_HOLDER = textwrap.dedent("""
    import sys
    from resilient.checkpoint import root as roots
    lock = roots.WriterLock(sys.argv[1])
    lock.acquire(job=sys.argv[2])
    print("holding", flush=True)
    sys.stdin.readline()
""")


def test_a_removed_writer_of_the_same_job_is_taken_over_and_the_lock_reclaimed(tmp_path):
    """In-process recovery's takeover (root.WriterLock): a holder that names this job (the
    job's removed writer, still alive) is taken over, another job's never; the OS lock is taken
    back once the holder is gone."""
    from resilient.checkpoint import root as roots

    root = tmp_path / "c"
    root.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(root), "job-a"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        other_job = roots.WriterLock(str(root))
        with pytest.raises(resilient.RootInUseError, match="job job-a"):
            other_job.acquire(job="job-b", takeover=True)
        no_takeover = roots.WriterLock(str(root))
        with pytest.raises(resilient.RootInUseError):
            no_takeover.acquire(job="job-a")
        lock = roots.WriterLock(str(root))
        lock.acquire(job="job-a", takeover=True)
        assert lock.taken_over is not None and "job job-a" in lock.taken_over
        lock.reclaim()
        assert lock.taken_over is not None  # the holder still has it
    finally:
        holder.stdin.close()
        holder.wait(60)
    lock.reclaim()
    assert lock.taken_over is None
    assert (root / ".writer.lock").read_text().endswith(" job job-a\n")
    lock.release()


def test_a_takeover_never_shares_the_root_with_another_job(tmp_path):
    """Once the removed writer is gone, if another job's process grabbed the lock first, the
    takeover writer's next reclaim raises instead of writing beside it."""
    from resilient.checkpoint import root as roots

    root = tmp_path / "c"
    root.mkdir()

    def hold(job: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(root), job],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "holding"
        return p

    removed = hold("job-a")
    lock = roots.WriterLock(str(root))
    lock.acquire(job="job-a", takeover=True)
    removed.stdin.close()
    removed.wait(60)
    intruder = hold("job-b")
    try:
        with pytest.raises(resilient.RootInUseError, match="another job's process"):
            lock.reclaim()
    finally:
        intruder.stdin.close()
        intruder.wait(60)
        lock.release()
