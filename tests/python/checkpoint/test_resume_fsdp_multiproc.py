"""Exact resume of the FSDP2 example (examples/fsdp_train.py, 4 gloo processes on CPU): train N
steps uninterrupted; separately train k steps, save, SIGKILL every process, restart from the
checkpoint and train to N. Losses of the last N-k steps and every full parameter are
bit-identical. (The --tp 2 layout runs in examples/smoke_fsdp.sh, and resharding onto other
meshes in test_dtensor_checkpoint.py.)"""

from __future__ import annotations

import json

import pytest
from test_resume_ddp_multiproc import run_example

N, K = 6, 4


@pytest.mark.timeout(500)
def test_fsdp_kill_and_resume_is_bit_exact(tmp_path):
    common = ["--nproc", "4", "--steps", str(N), "--save-every", "3"]
    run_example("fsdp_train.py", *common, "--ckpt", str(tmp_path / "a"),
                "--out", str(tmp_path / "a.json"), timeout=200)
    run_example("fsdp_train.py", *common, "--ckpt", str(tmp_path / "b"), "--kill-at", str(K),
                timeout=200, expect_kill=True)
    steps = sorted(p.name for p in (tmp_path / "b").glob("step-*"))
    assert steps == ["step-000000000003", "step-000000000004"]
    # each rank wrote its own shard of the sharded model
    assert len(list((tmp_path / "b" / steps[-1]).glob("rank-*.data"))) == 4
    run_example("fsdp_train.py", *common, "--ckpt", str(tmp_path / "b"),
                "--out", str(tmp_path / "b.json"), timeout=200)
    a = json.loads((tmp_path / "a.json").read_text())
    b = json.loads((tmp_path / "b.json").read_text())
    assert sorted(b["losses"], key=int) == [str(s) for s in range(K + 1, N + 1)]
    assert {s: a["losses"][s] for s in b["losses"]} == b["losses"]
    assert a["params"] == b["params"] and len(a["params"]) > 10
