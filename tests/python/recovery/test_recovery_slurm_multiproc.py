"""Under srun (one task per rank, emulated here: no Slurm on this machine) the ordinary DDP script
finds its rank, world and store from SLURM_* variables (resilient.recovery.environment.init_env)
and recovers from a killed rank like under ``resilient run``.

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_recovery_slurm.py."""

from __future__ import annotations

import signal
from datetime import timedelta
from pathlib import Path

import pytest


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_srun_tasks_survive_a_kill(tmp_path: Path, free_port: int, fsdp: bool) -> None:
    """DDP, and FSDP2 (the lost shard restored from a peer's memory): the survivors end with
    the failure-free run's parameters (the batch is kept)."""
    pytest.importorskip("torch")
    import torch.distributed as dist
    from test_recovery_adopt import check_survivors, run_ranks

    store = dist.TCPStore("127.0.0.1", free_port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    envs = [{"SLURM_PROCID": str(r), "SLURM_NTASKS": "4", "SLURM_LOCALID": str(r),
             "SLURM_NTASKS_PER_NODE": "4", "SLURM_NODELIST": "localhost",
             "SLURM_JOB_ID": f"{free_port}", "SLURM_STEP_ID": "0",
             "RESILIENT_STORE": f"127.0.0.1:{free_port}"} for r in range(4)]
    codes = run_ranks(envs, ["--steps", "16", "--kill-rank", "2", "--kill-step", "6",
                             *(["--fsdp"] if fsdp else [])], tmp_path, timeout=90)
    assert codes[2] == -signal.SIGKILL
    check_survivors(tmp_path, [0, 1, 3], codes)
    # Recovery's keys live under the srun step's prefix of the external store.
    assert store.check([f"resilient/run/{free_port}.0/resilient/detect/default/start/hello/0"])
