"""The README's DDP quick start made recoverable (examples/quickstart_ddp_recoverable.py).

The change from examples/quickstart_ddp.py is at most 10 lines (whitespace aside). Under
``resilient run`` a rank SIGKILLed from outside mid-epoch: the three survivors finish, every
sample of the epoch is trained on once (the DistributedSampler's padding aside), the
CheckpointManager goes on saving from the survivors' group, and the plain script resumes from
that checkpoint on 2 ranks under torchrun. Checkpointer.abandon (what the manager does with a
save that needed the lost rank) gives such a save up at once and frees the root.
"""


from __future__ import annotations

import difflib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")


ROOT = Path(__file__).resolve().parents[3]


PLAIN = ROOT / "examples" / "quickstart_ddp.py"


RECOVERABLE = ROOT / "examples" / "quickstart_ddp_recoverable.py"


def _code(path: Path) -> list[str]:
    """The script's lines after its docstring, without indentation or trailing comments."""
    text = path.read_text()
    body = text[text.index('"""', 3) + 3:]
    return [line.split("  #")[0].strip() for line in body.splitlines()]


def test_the_recoverable_quickstart_changes_at_most_10_lines() -> None:
    changed = removed = 0
    ops = difflib.SequenceMatcher(None, _code(PLAIN), _code(RECOVERABLE)).get_opcodes()
    for tag, i1, i2, j1, j2 in ops:
        if tag != "equal":
            changed += j2 - j1
            removed += max(0, (i2 - i1) - (j2 - j1))
    assert 0 < changed <= 10, changed
    assert removed <= 4, removed  # step += 1, ckpt.step(step) and the break go to Recovery


def _launch(out: Path, script: Path, launcher: list[str], steps: int,
            env: dict | None = None) -> subprocess.Popen:
    log = open(out / "launcher.log", "a")  # noqa: SIM115 -- owned by the child
    p = subprocess.Popen(
        [sys.executable, *launcher, str(script), "--ckpt", str(out / "ckpt"),
         "--sample-log", str(out / "samples"), "--steps", str(steps)],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, **(env or {})})
    log.close()
    return p


def kill_rank1_after(out: Path, steps: int, timeout: float = 120) -> None:
    """SIGKILLs the process of rank 1 once its sample log holds `steps` completed steps."""
    victim = out / "samples" / "rank1.samples"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = victim.read_text().splitlines() if victim.exists() else []
        if len(lines) >= steps:
            os.kill(json.loads(lines[0])[1], signal.SIGKILL)
            return
        time.sleep(0.005)
    raise AssertionError(f"rank 1 never completed {steps} steps")


def wait_for_a_replacement(out: Path, launcher: subprocess.Popen, timeout: float) -> None:
    """Until a process that joined mid-run (its first logged step is not 0) completed a step,
    the launcher exited, or `timeout` passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and launcher.poll() is None:
        first: dict[int, int] = {}
        for f in (out / "samples").glob("rank*.samples"):
            for line in f.read_text().splitlines():
                try:
                    step, pid, _index = json.loads(line)
                except ValueError:  # a line being written
                    continue
                first.setdefault(pid, step)
        if any(step > 0 for step in first.values()):
            return
        time.sleep(0.05)


def test_abandon_gives_up_a_save_that_waits_for_a_lost_rank(tmp_path: Path) -> None:
    """Rank 0 of a 2-rank save whose rank 1 never reports: abandon() ends it at once (not after
    the 60 s commit timeout), commits nothing, and a new checkpointer takes the root over."""
    import resilient

    ck = resilient.Checkpointer(tmp_path / "ck", create=True, distributed=False, timeout=60)
    state = {"w": torch.arange(1000.0)}
    ck.save(1, state).wait()
    ck.world_size = ck._ranks.world_size = 2  # a peer that will never report
    handle = ck.save(2, state)
    time.sleep(0.2)
    assert not handle.done()  # waiting for rank 1's report
    t0 = time.monotonic()
    assert ck.abandon("rank 1 was lost") == [2]
    assert time.monotonic() - t0 < 10
    with pytest.raises(resilient.CheckpointCommitError, match="abandoned"):
        handle.wait(0)
    ck2 = resilient.Checkpointer(tmp_path / "ck", create=True, distributed=False)
    assert ck2.steps() == [1]
    target = {"w": torch.zeros(1000)}
    assert ck2.load(target) == 1 and torch.equal(target["w"], state["w"])
    ck2.save(3, state).wait()  # the writer lock was released
    assert ck2.steps() == [1, 3]
    ck2.close()


def test_abandon_keeps_the_root_while_a_save_still_runs(tmp_path: Path) -> None:
    """A save that does not end within abandon's timeout (here: its abandonment cannot be
    marked) is not handed over: TimeoutError, and the root stays this checkpointer's."""
    import resilient

    ck = resilient.Checkpointer(tmp_path / "ck", create=True, distributed=False, timeout=60)
    state = {"w": torch.arange(1000.0)}
    ck.save(1, state).wait()
    ck.world_size = ck._ranks.world_size = 2
    ck.save(2, state)
    ck.abandon_in_flight = lambda reason: []  # the store did not take the mark
    with pytest.raises(TimeoutError, match="root stays locked"):
        ck.abandon("rank 1 was lost", timeout=0.5)
    with pytest.raises(resilient.RootInUseError):  # a writer is refused when it is made
        resilient.Checkpointer(tmp_path / "ck", create=True, distributed=False)
    other = resilient.Checkpointer(tmp_path / "ck", create=True, distributed=False,
                                   writer=False)
    with pytest.raises(resilient.RootInUseError):  # or at its first save
        other.save(3, state).wait()
    del ck.abandon_in_flight
    assert ck.abandon("rank 1 was lost", timeout=10) == [2]
    other.close()


def test_recovery_close_leaves_a_failed_save_to_the_managers_close(tmp_path: Path) -> None:
    """rec.steps() closes the Recovery when the loop ends; a last save that failed must still
    raise from the user's ckpt.close() (the job must not exit 0 without its checkpoint)."""
    import resilient
    from resilient.recovery import Recovery

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = resilient.CheckpointManager(str(tmp_path / "ck"), {"model": model, "optim": opt},
                                       every=1, create=True, distributed=False)
    rec = Recovery(None, 0, 1, model, opt, checkpointer=ckpt)
    handle = ckpt.save(1)
    handle.wait()
    handle._error = resilient.CheckpointCommitError("injected: the disk filled up")
    ckpt.checkpointer._failed.append(handle)
    rec.close()
    with pytest.raises(resilient.CheckpointCommitError, match="injected"):
        ckpt.close()
