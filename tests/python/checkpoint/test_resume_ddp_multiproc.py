"""Exact resume of the DDP example (examples/ddp_train.py, 4 gloo processes on CPU): train N
steps uninterrupted; separately train k steps, save, SIGKILL every process, restart from the
checkpoint and train to N. Losses of the last N-k steps and final parameters are bit-identical.
Then the 4-rank checkpoint is restored onto 2 data-parallel ranks and saved again: every global
tensor (model, optimizer, scheduler) is equal."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from procs import run_bounded

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
N, K = 7, 5


def run_example(script: str, *args: str, timeout: float = 150, expect_kill: bool = False) -> None:
    """Runs an example in its own session; kills the whole group on timeout."""
    rc, output = run_bounded([sys.executable, str(EXAMPLES / script), *args], timeout,
                             f"{script} {args}")
    if expect_kill:
        assert rc != 0 and "SIGKILL" in output, output[-4000:]
    else:
        assert rc == 0, output[-4000:]


def global_state(root: Path, step: int) -> dict:
    from resilient.distributed import read_global

    return {k: v for k, v in read_global(root, step).items() if not k.startswith("R")}


@pytest.mark.timeout(400)
def test_ddp_kill_and_resume_is_bit_exact(tmp_path):
    common = ["--nproc", "4", "--steps", str(N), "--save-every", "3"]
    run_example(
        "ddp_train.py", *common, "--ckpt", str(tmp_path / "a"), "--out", str(tmp_path / "a.json")
    )
    run_example(
        "ddp_train.py",
        *common,
        "--ckpt",
        str(tmp_path / "b"),
        "--kill-at",
        str(K),
        expect_kill=True,
    )
    assert sorted(os.listdir(tmp_path / "b")) == [
        ".writer.lock",
        "latest",
        "resilient-root.json",
        "step-000000000003",
        "step-000000000005",
    ]
    run_example(
        "ddp_train.py", *common, "--ckpt", str(tmp_path / "b"), "--out", str(tmp_path / "b.json")
    )
    a = json.loads((tmp_path / "a.json").read_text())
    b = json.loads((tmp_path / "b.json").read_text())
    assert sorted(b["losses"], key=int) == [str(s) for s in range(K + 1, N + 1)]
    assert {s: a["losses"][s] for s in b["losses"]} == b["losses"]
    assert a["params"] == b["params"]

    # Restore the 4-rank step-5 checkpoint onto 2 data-parallel ranks, save it again, compare.
    import torch

    shutil.copytree(tmp_path / "b" / "step-000000000005", tmp_path / "c" / "step-000000000005")
    run_example(
        "ddp_train.py", "--nproc", "2", "--steps", str(K), "--ckpt", str(tmp_path / "c"), "--resave"
    )
    before, after = global_state(tmp_path / "b", K), global_state(tmp_path / "c", K)
    assert sorted(before) == sorted(after) and len(before) > 30
    for name in before:
        assert torch.equal(before[name], after[name]), name
    manifest = json.loads((tmp_path / "c" / "step-000000000005" / "manifest.json").read_text())
    assert manifest["world_size"] == 2
