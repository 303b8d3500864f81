"""Failures that overlap a save or a recovery, under ``resilient run`` (issue 50, items 1-2).

The job is a user's DDP script (tests/python/ddp_saving_every_step.py: gloo, a CheckpointManager
saving 32 MiB every step, so a save is nearly always in flight, handed to ``Recovery.adopt``)
on 3 CPU ranks. Faults come from outside, as an operator's or a host's would:

- a rank frozen (SIGSTOP) while saves are in flight: the survivors' planning gathers wait for it
  when the verdict comes, and the group they give up must not be destroyed on their training
  thread (its destructor joins a gloo worker that waits for the frozen peer);
- a second rank killed while the survivors recover from the first (at their agreement, or once
  the group is rebuilt), and two of three ranks killed at once: the last survivor goes on alone
  (``min_world`` 1);
- a frozen rank woken after the others removed it (issue 44, item 6): it learns it at once,
  says so and exits with EXIT_EVICTED (76), which the launcher counts as a removal; and what a
  recovery prints (item 5): one line on rank 0, in torch's log format, in the launcher's output.

Each test waits on files and events, never on fixed sleeps; its deadlines are multiples of the
time the job took to start on this machine (a loaded machine gets longer ones). Every process
is killed on the way out. The time from the last fault to the survivors' first completed
collective after it (their ``recovery_end`` event) is printed. RESILIENT_TEST_DEVICE=cuda runs
the same on GPUs 0-2 over NCCL (the checkpointer's collectives on a gloo group).

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_recovery_overlap.py."""


from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from procs import kill_mentioning, wait_or_kill


def summary_lines(log: str) -> list[str]:
    """The recoveries' one-line summaries in the launcher's output (torch's log format)."""
    return re.findall(r"^W\d{4} \d\d:\d\d:\d\d\.\d{6} \d+ resilient/recovery/\S+:\d+\] "
                      r"\[rank\d+\]: resilient: .*$", log, re.MULTILINE)


@pytest.mark.timeout(300)
def test_a_rank_frozen_while_saves_are_in_flight_leaves_the_others_training(
        tmp_path: Path) -> None:
    """Rank 1 is SIGSTOPped mid-run (every step saves 32 MiB): the survivors' next planning
    gather waits for it when the verdict comes (2-5 s later). They give that checkpointer and
    its gloo group up without destroying the group on their training thread (its destructor
    would join a worker blocked on the frozen peer until their hang watchdog evicted them, 30 s
    later, and the launcher never exited), finish the 40 steps on 2 ranks and commit step 40;
    the launcher reaps the frozen process after the finish grace and exits 0."""
    job = Job(tmp_path, env={"RESILIENT_LOG_LEVEL": "info"})  # each rank's phases too
    try:
        job.wait_for_step(1, 6)
        t_fault = job.kill(1, signal.SIGSTOP)
        code = job.finish(120)
    finally:
        job.finish(0)
    log = job.log()
    assert code == 0, log
    assert log.count(f"done at step {STEPS}, world 2") == 2, log
    assert " hang in " not in log, log  # no hang watchdog fired
    assert committed_steps(tmp_path / "ckpt")[STEPS] == 2
    lines = summary_lines(log)
    assert len(lines) == 1 and "[rank0]: resilient: lost rank 1 (it stopped answering: frozen, " \
        "stopped or cut off) at step" in lines[0] and ": world 3 -> 2" in lines[0], log
    for r in (0, 2):  # RESILIENT_LOG_LEVEL=info: every survivor's own phases
        for what in ("the detector removed rank 1", "agreed on generation 1", "group rebuilt",
                     "world -> 2: one DataLoader batch", "first collective on the new group"):
            assert re.search(rf"^I\d{{4}} .*\] \[rank{r}\]: resilient recovery: .*{what}", log,
                             re.MULTILINE), (r, what, log)
    print(f"\n[overlap] frozen rank 1: the survivors' first step after it "
          f"{job.resumed_after(0, t_fault):.2f} s after the SIGSTOP")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("phase", ["agreement", "rebuild"])
def test_a_second_rank_lost_during_the_recovery_is_recovered_from(tmp_path: Path,
                                                                  phase: str) -> None:
    """Rank 1 is killed; rank 2 is killed as soon as it finished the recovery's `phase`
    (agreed on the verdict, or rebuilt the group and moving the checkpointer onto it). Rank 0
    abandons the recovery under way, agrees on the next verdict, rebuilds alone and trains the
    40 steps (min_world 1), within a bound that does not include any group's timeout."""
    job = Job(tmp_path)
    try:
        job.wait_for_step(1, 6)
        job.kill(1)
        job.wait_for_event(2, "recovery_phase", 60, phase=phase)
        t_fault = job.kill(2)
        code = job.finish(60)
    finally:
        job.finish(0)
    log = job.log()
    assert code == 0, (code, log)
    resumed = job.resumed_after(0, t_fault)
    assert f"done at step {STEPS}, world 1" in log, log
    assert " hang in " not in log, log  # no hang watchdog fired
    lines = summary_lines(log)  # the recovery interrupted by the second loss and redone: one
    assert len(lines) == 1 and "lost ranks 1, 2 (its process is gone)" in lines[0], log
    assert "world 3 -> 1" in lines[0], lines
    print(f"\n[overlap] rank 2 killed after its {phase}: rank 0's first step alone "
          f"{resumed:.2f} s after")
    # the second verdict (<= 3 s) and a rebuild: no group's timeout (60 s) waited out
    assert resumed < 15 + job.startup_s, resumed


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_two_of_three_ranks_lost_at_once(tmp_path: Path, sig: int) -> None:
    """Ranks 1 and 2 killed (or frozen) together: each one's second watcher is the other, yet
    rank 0 gets the verdict (alone, after max_silence beyond its suspicion), goes on alone and
    commits step 40 as a world of 1."""
    job = Job(tmp_path)
    try:
        job.wait_for_step(1, 6)
        t_fault = job.kill(1, sig)
        job.kill(2, sig)
        code = job.finish(60)
    finally:
        job.finish(0)
    log = job.log()
    assert code == 0, (code, log)
    resumed = job.resumed_after(0, t_fault)
    assert f"done at step {STEPS}, world 1" in log, log
    assert committed_steps(tmp_path / "ckpt")[STEPS] == 1
    print(f"\n[overlap] ranks 1 and 2 {signal.Signals(sig).name}: rank 0's first step alone "
          f"{resumed:.2f} s after")
    assert resumed < 15 + job.startup_s, resumed


ROOT = Path(__file__).resolve().parents[3]


SCRIPT = Path(__file__).parents[1] / "ddp_saving_every_step.py"


STEPS = 40


class Job:
    """``python -m resilient.run --standalone --nproc-per-node N SCRIPT`` in a session of its
    own, with per-rank event logs (RESILIENT_EVENTS_DIR) and its start time measured."""

    def __init__(self, out: Path, nproc: int = 3, *, launcher: tuple[str, ...] = (),
                 env: dict | None = None) -> None:
        self.out, self.nproc = out, nproc
        (out / "events").mkdir()
        log = open(out / "launcher.log", "w")  # noqa: SIM115 -- owned by the child
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node",
             str(nproc), "--finish-grace-s", "3", *launcher, str(SCRIPT), str(out / "ckpt"),
             str(out), str(STEPS)],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "RESILIENT_EVENTS_DIR": str(out / "events"), **(env or {})})
        log.close()
        self.startup_s = 0.0  # set by wait_for_step: the time every rank took to step once

    def step(self, rank: int) -> int:
        try:
            return int((self.out / f"rank{rank}.step").read_text() or -1)
        except (FileNotFoundError, ValueError):
            return -1

    def pid(self, rank: int) -> int:
        return int((self.out / f"rank{rank}.pid").read_text())

    def wait_for_step(self, rank: int, step: int, timeout: float = 120) -> None:
        """Until every rank stepped once (the start-up time the deadlines scale with), then
        until `rank` completed `step`."""
        deadline = time.monotonic() + timeout
        while min(self.step(r) for r in range(self.nproc)) < 1:
            assert self.proc.poll() is None, self.log()
            assert time.monotonic() < deadline, f"the job did not start\n{self.log()}"
            time.sleep(0.01)
        self.startup_s = self.startup_s or time.monotonic() - self.t0
        while self.step(rank) < step:
            assert self.proc.poll() is None, self.log()
            assert time.monotonic() < deadline, f"rank {rank} never completed step {step}"
            time.sleep(0.005)

    def events(self, rank: int) -> list[dict]:
        path = self.out / "events" / f"rank-{rank}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def wait_for_event(self, rank: int, kind: str, timeout: float, **fields: object) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.events(rank):
                if e["kind"] == kind and all(e.get(k) == v for k, v in fields.items()):
                    return e
            time.sleep(0.002)
        raise AssertionError(f"rank {rank} logged no {kind} {fields} within {timeout} s")

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> float:
        """Signals `rank`; returns the wall time (the event logs' clock)."""
        os.kill(self.pid(rank), sig)
        return time.time()

    def finish(self, after_fault_s: float) -> int | None:
        """Waits for the launcher (deadline: `after_fault_s` scaled by the start-up time);
        whatever happens, kills every process of the job. Returns the launcher's exit code."""
        try:
            return wait_or_kill(self.proc, after_fault_s + 10 * self.startup_s)
        finally:
            for r in range(self.nproc):
                try:
                    os.kill(self.pid(r), signal.SIGKILL)
                except (OSError, ValueError):
                    pass
            kill_mentioning(str(self.out))

    def log(self) -> str:
        return (self.out / "launcher.log").read_text()[-6000:]

    def resumed_after(self, rank: int, t_fault: float) -> float:
        """Seconds from `t_fault` to `rank`'s last recovery_end (its first completed
        collective after the last recovery)."""
        ends = [e for e in self.events(rank) if e["kind"] == "recovery_end"]
        assert ends, self.events(rank)
        return ends[-1]["t"] - t_fault


def committed_steps(root: Path) -> dict[int, int]:
    """step -> world size of the committed checkpoints."""
    from resilient.checkpoint.catalog import list_root

    return {s.step: s.world_size for s in list_root(str(root)).steps}


@pytest.mark.timeout(300)
def test_a_frozen_rank_0_holding_the_roots_writer_lock_is_taken_over(tmp_path: Path) -> None:
    """Rank 0, the root's writer, is SIGSTOPped mid-run: alive, it keeps the root's writer lock.
    The survivors' new rank 0 takes the root over (the holder names this job, and it is not in
    the new group), commits the rest of the run, and the launcher exits 0."""
    job = Job(tmp_path)
    try:
        job.wait_for_step(0, 6)
        job.kill(0, signal.SIGSTOP)
        code = job.finish(120)
    finally:
        job.finish(0)
    log = job.log()
    assert code == 0, log
    assert log.count(f"done at step {STEPS}, world 2") == 2, log
    assert "taking over from the job's removed writer" in log, log
    assert "RootInUseError" not in log, log
    assert committed_steps(tmp_path / "ckpt")[STEPS] == 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("when", ["while the others train", "after the others finished"])
def test_a_frozen_rank_woken_after_its_removal_leaves_at_once(tmp_path: Path,
                                                             when: str) -> None:
    """Rank 1 is SIGSTOPped; once the survivors recovered without it (or finished the job) it
    is woken (SIGCONT). It learns at once that it was removed (its detector reads the
    generations decided while it stood, from the store, even with nobody left to tell it),
    says so and exits with 76; the launcher counts that as a removal and exits 0 without
    waiting out its finish grace (60 s here) for it."""
    from resilient.recovery import EXIT_EVICTED

    job = Job(tmp_path, launcher=("--finish-grace-s", "60"))
    try:
        job.wait_for_step(1, 6)
        job.kill(1, signal.SIGSTOP)
        job.wait_for_event(0, "recovery_end", 60)
        if when == "after the others finished":
            deadline = time.monotonic() + 60 + 10 * job.startup_s
            while job.log().count(f"done at step {STEPS}, world 2") < 2:
                assert time.monotonic() < deadline, job.log()
                time.sleep(0.05)
        t_wake = time.monotonic()
        job.kill(1, signal.SIGCONT)
        code = job.finish(30)  # well within the finish grace
        took = time.monotonic() - t_wake
    finally:
        job.finish(0)
    log = job.log()
    assert code == 0, log
    assert took < 30, took  # not the 60 s finish grace
    assert ("[rank1]: resilient: this rank was removed from the job by the other ranks" in log
            and f"exiting with {EXIT_EVICTED}" in log), log
    assert "removed no rank within" not in log, log
    assert f"rank 1 (pid {job.pid(1)}) was removed from the job by the other ranks (exit " \
        f"{EXIT_EVICTED})" in log, log
    assert "still running" not in log, log  # nobody was reaped
    print(f"\n[overlap] rank 1 woken {when}: gone, and the launcher done, {took:.2f} s later")
