"""Recovery.adopt: a torchrun-style script's own default group, store and DDP model.

One process: adopting the group the user created (no "default process group twice"), the store
behind it scoped to the launch attempt, steps run. Four processes: examples/ddp_resilient_run.py
started the way an elastic agent starts workers (RANK, WORLD_SIZE, MASTER_ADDR/PORT, a store hosted
outside the ranks with TORCHELASTIC_USE_AGENT_STORE=True); one rank is SIGKILLed, the others
rebuild (replacing the default group) and end with the failure-free parameters. Every process is
killed with its session at the end, whatever happened.

The tests here start servers, network namespaces or the launcher (the system tier,
tests/python/tiers.py); the others are in test_recovery_adopt.py."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from test_recovery_adopt import STEPS, check_survivors, run_ranks


@pytest.mark.timeout(180)
def test_rank_zero_dies_and_the_job_goes_on_when_the_store_is_etcd(tmp_path: Path) -> None:
    """The job's store on a 3-member etcd cluster (init_method="etcd://..."): SIGKILL rank 0,
    which with a bare TCPStore would host the store and take the job with it; ranks 1-3 agree,
    rebuild and finish with the failure-free parameters."""
    from etcd_cluster import EtcdCluster

    with EtcdCluster(tmp_path, 3) as etcd:
        url = f"etcd://{','.join(etcd.endpoints)}/adopt/"
        envs = [{"RANK": str(r), "WORLD_SIZE": "4", "LOCAL_RANK": str(r)} for r in range(4)]
        codes = run_ranks(envs, ["--steps", str(STEPS), "--kill-rank", "0", "--kill-step", "6",
                                 "--init-method", url], tmp_path, timeout=120)
    assert codes[0] == -signal.SIGKILL
    check_survivors(tmp_path, [1, 2, 3], codes)
