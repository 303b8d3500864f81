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
"""


from __future__ import annotations

import pytest

pytest.importorskip("torch")


def test_judge_counts_an_evicted_rank_as_removed_not_failed() -> None:
    """The launcher's judgement (pure): a rank that exits with EXIT_EVICTED after the others
    finished fails nothing, unlike any other non-zero exit."""
    from resilient.recovery import EXIT_EVICTED
    from resilient.recovery.agent import Exit, judge

    finished = [Exit(0, 0), Exit(2, 0)]
    assert judge([*finished, Exit(1, EXIT_EVICTED)], 0).state == "succeeded"
    assert judge([*finished, Exit(1, 1)], 0).state == "failed"
    assert judge([Exit(1, EXIT_EVICTED)], 2).state == "healthy"  # the others go on
