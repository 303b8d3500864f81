"""Exact resume of the Megatron-style example (2-way tensor x 2-way data parallel, hand-written
column- and row-parallel linears, 4 gloo processes), and load-time resharding of its checkpoint
onto a different tensor-parallel split (TP=1 x DP=2): the global tensors are equal."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_resume_ddp_multiproc import global_state, run_example

N, K = 7, 5


@pytest.mark.timeout(400)
def test_megatron_kill_resume_and_reshard(tmp_path):
    common = ["--nproc", "4", "--tp", "2", "--steps", str(N), "--save-every", "4"]
    run_example(
        "megatron_train.py", *common, "--ckpt", str(tmp_path / "a"), "--out", str(tmp_path / "a")
    )
    run_example(
        "megatron_train.py",
        *common,
        "--ckpt",
        str(tmp_path / "b"),
        "--kill-at",
        str(K),
        expect_kill=True,
    )
    run_example(
        "megatron_train.py", *common, "--ckpt", str(tmp_path / "b"), "--out", str(tmp_path / "b")
    )
    for rank in range(4):
        a = json.loads((tmp_path / f"a.rank{rank}").read_text())
        b = json.loads((tmp_path / f"b.rank{rank}").read_text())
        assert sorted(b["losses"], key=int) == [str(s) for s in range(K + 1, N + 1)]
        assert {s: a["losses"][s] for s in b["losses"]} == b["losses"]
        assert a["params"] == b["params"], rank

    # The TP=2 pieces of fc1/fc2 (and their Adam state) reassemble into TP=1 tensors.
    shutil.copytree(tmp_path / "b" / "step-000000000005", tmp_path / "c" / "step-000000000005")
    run_example(
        "megatron_train.py", "--nproc", "2", "--tp", "1", "--ckpt", str(tmp_path / "c"), "--resave"
    )
    before, after = global_state(tmp_path / "b", K), global_state(tmp_path / "c", K)
    assert sorted(before) == sorted(after)
    assert before["model/fc1_w"].shape == (64, 16) and before["model/fc2_w"].shape == (16, 64)
    for name in before:
        assert torch.equal(before[name], after[name]), name
    manifest = json.loads((tmp_path / "c" / "step-000000000005" / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    pieces = [t for t in manifest["tensors"] if t["name"].startswith("S/model/fc1_w")]
    assert all(t["global_shape"] == [64, 16] for t in pieces)
