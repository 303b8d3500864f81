"""The README's DDP quick start made recoverable (examples/quickstart_ddp_recoverable.py).

The change from examples/quickstart_ddp.py is at most 10 lines (whitespace aside). Under
``resilient run`` a rank SIGKILLed from outside mid-epoch: the three survivors finish, every
sample of the epoch is trained on once (the DistributedSampler's padding aside), the
CheckpointManager goes on saving from the survivors' group, and the plain script resumes from
that checkpoint on 2 ranks under torchrun. Checkpointer.abandon (what the manager does with a
save that needed the lost rank) gives such a save up at once and frees the root.

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_quickstart_recovery.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from test_quickstart_recovery import (
    PLAIN,
    RECOVERABLE,
    ROOT,
    _launch,
    kill_rank1_after,
    wait_for_a_replacement,
)

from procs import wait_or_kill


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
    slow = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "slow_steps"),
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


@pytest.mark.timeout(240)
def test_a_rank_killed_while_saves_are_in_flight(tmp_path: Path) -> None:
    """Every step saves 32 MiB, so the killed rank leaves saves that wait for its shard: the
    survivors abandon them at once (no commit timeout), go on saving from their group, and every
    committed checkpoint verifies."""
    from resilient.checkpoint.catalog import list_root

    steps = 40
    script = Path(__file__).parents[1] / "ddp_saving_every_step.py"
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
