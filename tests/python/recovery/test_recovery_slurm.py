"""Under srun (one task per rank, emulated here: no Slurm on this machine) the ordinary DDP script
finds its rank, world and store from SLURM_* variables (resilient.recovery.environment.init_env)
and recovers from a killed rank like under ``resilient run``."""


from __future__ import annotations

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
