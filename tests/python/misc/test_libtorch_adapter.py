"""A checkpoint saved by the libtorch example (examples/cpp/train.cpp, cpp/adapter) loads in
Python, and one saved from Python loads in C++. Needs the adapter build (scripts/build.sh builds
it into build/py); skipped, with the reason, when that binary is absent."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

from resilient.checkpoint import Checkpointer

BINARY = Path(
    os.environ.get(
        "RESILIENT_TRAIN_EXAMPLE",
        Path(__file__).resolve().parents[3] / "build/py/cpp/adapter/resilient_train_example",
    )
)


class Net(nn.Module):
    """The Python twin of examples/cpp/train.cpp's Net (same parameter names and shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 1)


def checksum(net: nn.Module) -> float:
    return sum(p.detach().to(torch.float64).sum().item() for p in net.parameters())


def run(*args: str) -> dict[str, str]:
    out = subprocess.run([str(BINARY), *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()
    return dict(zip(words[::2], words[1::2]))


@pytest.mark.skipif(not BINARY.exists(), reason=f"libtorch adapter example not built ({BINARY})")
def test_checkpoints_cross_between_cpp_and_python(tmp_path):
    cpp = run(str(tmp_path), "4")
    net, tensors, values = Net(), {}, {}
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.load({"model": net, "tensors": tensors, "values": values}) == 4
    assert values == {"step": 4}
    assert checksum(net) == float.fromhex(cpp["checksum"])  # bit-exact parameters
    assert tensors["data_weight"].shape == (8, 1)

    with torch.no_grad():
        for p in net.parameters():
            p.mul_(0.5)
    state = {
        "model": net,
        "tensors": {"data_weight": tensors["data_weight"]},
        "values": {"step": 9},
    }
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(9, state).wait()
    back = run(str(tmp_path), "--print")
    assert back["step"] == "9"
    assert float.fromhex(back["checksum"]) == checksum(net)

    # C++ resumes training from the Python checkpoint.
    assert run(str(tmp_path), "11")["step"] == "11"


@pytest.mark.skipif(not BINARY.exists(), reason=f"libtorch adapter example not built ({BINARY})")
def test_cpp_reports_a_shape_mismatch_by_name(tmp_path):
    bad = nn.Module()
    bad.fc1, bad.fc2 = nn.Linear(8, 32), nn.Linear(32, 1)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": bad, "values": {"step": 1}}).wait()
    out = subprocess.run(
        [str(BINARY), str(tmp_path), "--print"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0
    assert "model/fc1.weight" in out.stderr and "[16,8]" in out.stderr, out.stderr
