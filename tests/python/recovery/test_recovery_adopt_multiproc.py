"""Recovery.adopt: a torchrun-style script's own default group, store and DDP model.

One process: adopting the group the user created (no "default process group twice"), the store
behind it scoped to the launch attempt, steps run. Four processes: examples/ddp_resilient_run.py
started the way an elastic agent starts workers (RANK, WORLD_SIZE, MASTER_ADDR/PORT, a store hosted
outside the ranks with TORCHELASTIC_USE_AGENT_STORE=True); one rank is SIGKILLed, the others
rebuild (replacing the default group) and end with the failure-free parameters. Every process is
killed with its session at the end, whatever happened.

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_recovery_adopt.py."""

from __future__ import annotations

import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist  # noqa: E402
from test_recovery_adopt import STEPS, check_survivors, run_ranks


@pytest.mark.timeout(120)
def test_agent_style_workers_survive_a_kill(tmp_path: Path, free_port: int) -> None:
    store = dist.TCPStore("127.0.0.1", free_port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    envs = [{"RANK": str(r), "WORLD_SIZE": "4", "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(free_port), "TORCHELASTIC_USE_AGENT_STORE": "True",
             "RESILIENT_LAUNCHER": "test", "TORCHELASTIC_RUN_ID": f"adopt-{free_port}"}
            for r in range(4)]
    codes = run_ranks(envs, ["--steps", str(STEPS), "--kill-rank", "1", "--kill-step", "6"],
                      tmp_path, timeout=90)
    assert codes[1] == -signal.SIGKILL
    check_survivors(tmp_path, [0, 2, 3], codes)
    del store


@pytest.mark.timeout(120)
def test_rank_zero_serving_the_store_dies_and_the_others_stop_and_say_why(
        tmp_path: Path, free_port: int) -> None:
    """A bare init_process_group: rank 0's process serves the TCPStore. When it dies the
    survivors cannot agree; they stop (exit code 3) within seconds, saying the store is gone
    and where to host it, instead of waiting out the agreement timeout."""
    envs = [{"RANK": str(r), "WORLD_SIZE": "4", "LOCAL_RANK": str(r),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port)} for r in range(4)]
    t0 = time.monotonic()
    codes = run_ranks(envs, ["--steps", str(STEPS), "--kill-rank", "0", "--kill-step", "6"],
                      tmp_path, timeout=90)
    assert codes == {0: -signal.SIGKILL, 1: 3, 2: 3, 3: 3}
    assert time.monotonic() - t0 < 60
    for r in (1, 2, 3):
        log = (tmp_path / f"proc{r}.log").read_text()
        assert "the job's store is unreachable" in log and "etcd" in log, log[-2000:]
