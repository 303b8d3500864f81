"""The training-loop row of `resilient bench --train` with a small model on the CPU: the paired
with/without-save blocks, the calibrated interval, and that every save it made is a complete,
loadable checkpoint (the row itself only runs on GPUs in the benchmark)."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from resilient.checkpoint import Checkpointer
from resilient.cli.bench.training import train_row


def test_train_row_pairs_blocks_and_leaves_loadable_checkpoints(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    x = torch.randn(32, 64)
    row = train_row(tmp_path, "cpu", steps=5, rounds=4, progress_fn=lambda s: None,
                    model=model, x=x)
    n = row.notes
    assert n["rounds"] == 4 and len(n["step_ratios_paired"]) == 4
    assert n["every"] >= 1 and len(n["calibration_steps"]) == 3
    assert n["step_ratio"] == pytest.approx(statistics.median(n["step_ratios_paired"]), abs=1e-3)
    lo, hi = n["step_ratio_ci90"]
    assert lo <= n["step_ratio"] <= hi
    assert n["checkpoint_bytes"] > 0 and n["step_s"] > 0 and n["host_step_s"] > 0
    assert n["batch"] == 32
    # Its saves are complete checkpoints: the newest (the diagnostic save after the loop) loads.
    with Checkpointer(tmp_path, keep=2) as ckpt:
        restored = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                       torch.nn.Linear(256, 64))
        opt = torch.optim.AdamW(restored.parameters())
        step = ckpt.load({"model": restored, "optim": opt})
    assert step == 999_999
    for p in restored.parameters():
        assert torch.isfinite(p).all()


def test_train_batch_below_one_is_refused(tmp_path: Path, capsys) -> None:
    from resilient.cli import main

    assert main(["bench", "--train", "--train-batch", "0", "--dir", str(tmp_path / "b")]) == 2
    assert "--train-batch must be at least 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()  # refused before anything was made
