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
from collections import Counter
from pathlib import Path

import pytest

from procs import wait_or_kill

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
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


def _samples(out: Path, rolled_back: bool = False) -> tuple[dict[int, int], Counter,
                                                             dict[int, list[int]]]:
    """Samples per step, how often each sample index was trained on, and each rank's steps.

    `rolled_back`: the survivors may have gone back once to the newest checkpoint (the
    documented mismatch: one survivor's all-reduce of the failed step completed, another's did
    not, and the newest save is loaded). Then the steps every rank logged from that step on
    before going back are not part of the job's run and are left out; all survivors must go
    back to the same step, a saved one (a multiple of 5), at most once."""
    logs: dict[int, list[tuple[int, list[int]]]] = {}
    for f in (out / "samples").glob("rank*.samples"):
        logs[int(f.stem[4:])] = [(step, index) for step, _pid, index in
                                 map(json.loads, f.read_text().splitlines())]
    back = {r: next((b for a, (b, _) in zip(log, log[1:]) if b <= a[0]), None)
            for r, log in logs.items()}
    targets = {b for b in back.values() if b is not None} if rolled_back else set()
    assert len(targets) <= 1, back
    to = targets.pop() if targets else None
    if to is not None:
        assert to % 5 == 0, back  # a committed checkpoint's step
        for r, log in logs.items():
            j = next((i + 1 for i, (a, b) in enumerate(zip(log, log[1:])) if b[0] <= a[0]),
                     len(log))
            logs[r] = [e for e in log[:j] if e[0] < to] + log[j:]
    per_step: Counter = Counter()
    seen: Counter = Counter()
    steps: dict[int, list[int]] = {}
    for rank, log in logs.items():
        for step, index in log:
            per_step[step] += len(index)
            seen.update(index)
            steps.setdefault(rank, []).append(step)
    return dict(per_step), seen, steps


@pytest.mark.timeout(240)
def test_a_killed_rank_the_quickstart_finishes_and_keeps_checkpointing(tmp_path: Path) -> None:
    from resilient.checkpoint.catalog import list_root

    (tmp_path / "samples").mkdir()
    steps, kill_after = 30, 7  # 960 samples, 32 per step on 4 ranks: the kill is mid-epoch
    p = _launch(tmp_path, RECOVERABLE,
                ["-m", "resilient.run", "--standalone", "--nproc-per-node", "4"], steps)
    try:
        kill_rank1_after(tmp_path, kill_after)
    finally:
        code = wait_or_kill(p, 150)
    log = (tmp_path / "launcher.log").read_text()[-6000:]
    assert code == 0, log
    assert "exited with -9" in log, log

    per_step, seen, ran = _samples(tmp_path, rolled_back=True)
    assert sorted(per_step) == list(range(steps)), per_step
    killed_at = len(ran[1])  # the steps rank 1 completed (and that the job kept)
    assert killed_at >= kill_after or killed_at % 5 == 0, killed_at  # else: back to a save
    for r in (0, 2, 3):
        assert ran[r] == list(range(steps)), (r, ran[r])  # each step once, the redone one too
    assert all(per_step[s] == 32 for s in range(killed_at)), per_step
    assert all(per_step[s] == 24 for s in range(killed_at, steps)), per_step
    total = 32 * killed_at + 24 * (steps - killed_at)
    assert total <= 960 and seen == Counter({i: 1 for i in seen}) and len(seen) == total

    # The survivors' group kept checkpointing: every 5 steps after the kill, 3 ranks each.
    by_step = {s.step: s for s in list_root(str(tmp_path / "ckpt")).steps}
    assert max(by_step) == steps and by_step[steps].lineage == "current", by_step
    assert by_step[steps].world_size == 3, by_step[steps]

    # The plain script resumes from the survivors' checkpoint on 2 ranks, mid-epoch.
    (tmp_path / "samples2").mkdir()
    os.rename(tmp_path / "samples", tmp_path / "samples1")
    os.rename(tmp_path / "samples2", tmp_path / "samples")
    more = steps + 6
    q = _launch(tmp_path, PLAIN, ["-m", "torch.distributed.run", "--standalone",
                                  "--nproc-per-node", "2"], more)
    assert wait_or_kill(q, 120) == 0, (tmp_path / "launcher.log").read_text()[-6000:]
    per_step2, seen2, ran2 = _samples(tmp_path)
    assert sorted(per_step2) == list(range(steps, more)), per_step2
    assert set(per_step2.values()) == {16}
    assert not set(seen2) & set(seen), "a sample of the epoch was trained on twice"


@pytest.mark.timeout(240)
def test_a_replacement_joins_the_quickstart_with_the_same_state(tmp_path: Path) -> None:
    """--replacements 1: a new process takes the lost rank's place mid-run. It receives model,
    optimizer and the LR scheduler from a peer (a replica with its own scheduler would diverge:
    the next save's replica check raises ReplicaMismatchError and fails the job), the manager
    moves onto the grown group, and the last checkpoints are written by 4 ranks again."""
    from resilient.checkpoint.catalog import list_root

    (tmp_path / "samples").mkdir()
    # >= 30 s at 50 ms a step: time for the replacement to start and be admitted; once it has
    # trained a step the rest goes at full speed. The kill lands in the step-5 save (every=5): a
    # survivor once stayed in its gather until evicted (593 of 600 steps on 3 ranks); the
    # save's gathers are now polled (test_ranks_abort.py).
    steps = 600
    go_fast = tmp_path / "replacement-trained"
    slow = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent / "slow_steps"),
                                           os.environ.get("PYTHONPATH", "")]),
            "RESILIENT_TEST_STEP_SLEEP": "0.05", "RESILIENT_TEST_STEP_SLEEP_UNTIL": str(go_fast)}
    p = _launch(tmp_path, RECOVERABLE, ["-m", "resilient.run", "--standalone",
                                        "--nproc-per-node", "4", "--replacements", "1"], steps,
                env=slow)
    try:
        kill_rank1_after(tmp_path, 5)
        wait_for_a_replacement(tmp_path, p, timeout=120)
        go_fast.touch()
    finally:
        code = wait_or_kill(p, 200)
    log = (tmp_path / "launcher.log").read_text()[-6000:]
    assert code == 0, log
    full = (tmp_path / "launcher.log").read_text()
    assert "to replace rank 1" in full and "before this rank was admitted" not in full, log
    per_step, _seen, _ran = _samples(tmp_path)
    assert sorted(per_step) == list(range(steps))
    counts = Counter(per_step.values())
    assert counts[24] > 0 and counts[32] > counts[24], counts  # 3 ranks, then 4 again
    worlds = {s.step: s.world_size for s in list_root(str(tmp_path / "ckpt")).steps}
    assert max(worlds) == steps and worlds[steps] == 4, worlds


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


@pytest.mark.timeout(240)
def test_a_rank_killed_while_saves_are_in_flight(tmp_path: Path) -> None:
    """Every step saves 32 MiB, so the killed rank leaves saves that wait for its shard: the
    survivors abandon them at once (no commit timeout), go on saving from their group, and every
    committed checkpoint verifies."""
    from resilient.checkpoint.catalog import list_root

    steps = 40
    script = Path(__file__).parent / "ddp_saving_every_step.py"
    with open(tmp_path / "launcher.log", "w") as log:
        p = subprocess.Popen(
            [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "4",
             str(script), str(tmp_path / "ckpt"), str(tmp_path), str(steps)],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if int((tmp_path / "rank1.step").read_text() or 0) >= 6:
                    os.kill(int((tmp_path / "rank1.pid").read_text()), signal.SIGKILL)
                    break
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.01)
        else:
            raise AssertionError("rank 1 never reached step 6")
    finally:
        code = wait_or_kill(p, 180)
    log_text = (tmp_path / "launcher.log").read_text()
    assert code == 0, log_text[-6000:]
    assert log_text.count("done at step 40, world 3") == 3, log_text[-3000:]
    root = str(tmp_path / "ckpt")
    info = list_root(root)
    by_step = {s.step: s for s in info.steps}
    assert max(by_step) == steps and by_step[steps].world_size == 3, by_step
    r = subprocess.run([sys.executable, "-m", "resilient", "ckpt", "verify", root, "--json"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
