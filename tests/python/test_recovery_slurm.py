"""Under srun (one task per rank, emulated here: no Slurm on this machine) the ordinary DDP script
finds its rank, world and store from SLURM_* variables (resilient.recovery.environment.init_env)
and recovers from a killed rank like under ``resilient run``."""

from __future__ import annotations

import signal
from datetime import timedelta
from pathlib import Path

import pytest

from resilient.recovery import environment as renv

SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
         "SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "991",
         "SLURM_STEP_ID": "0"}


def test_slurm_env_derives_torch_distributed_variables() -> None:
    assert renv.launcher(SLURM) == "slurm"
    assert renv.slurm_env(SLURM) == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu07", "MASTER_PORT": str(renv.DEFAULT_SLURM_PORT)}
    # A store hosted outside the ranks: every rank is its client.
    ext = renv.slurm_env({**SLURM, "RESILIENT_STORE": "login1:4000"})
    assert (ext["MASTER_ADDR"], ext["MASTER_PORT"], ext["TORCHELASTIC_USE_AGENT_STORE"]) == (
        "login1", "4000", "True")
    assert renv.launcher_warnings({**SLURM, **ext}, adopted=True) == []
    (msg,) = renv.launcher_warnings({**SLURM, **renv.slurm_env(SLURM)}, adopted=True)
    assert "rank 0" in msg and "RESILIENT_STORE" in msg
    # Set variables win; under an agent (srun of resilient run) nothing is derived.
    assert renv.slurm_env({**SLURM, "MASTER_ADDR": "h", "RANK": "5"})["WORLD_SIZE"] == "8"
    assert "RANK" not in renv.slurm_env({**SLURM, "RANK": "5"})
    assert renv.slurm_env({**SLURM, "TORCHELASTIC_RUN_ID": "x"}) == {}
    assert renv.run_id(SLURM) == "991.0"


@pytest.mark.parametrize(("nodes", "first"), [("node[03-05,9],gpu1", "node03"), ("a1", "a1"),
                                              ("b[12]", "b12"), ("c[2,4-6]", "c2")])
def test_first_host(nodes: str, first: str) -> None:
    assert renv.first_host(nodes) == first


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
