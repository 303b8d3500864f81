"""Peer replicas of FSDP2 shards on GPUs (NCCL; at least 4): the CUDA path of
resilient.recovery.replica (side-stream device-to-host copies into pinned buffers, the step
pre-hook) and the restore into GPU shards, with rank 1 SIGKILLed, resharded to 3 ranks or with a
spare on its GPU. Skipped without 4 GPUs (tests/python/test_recovery_replica.py runs the same
scenarios on CPU in CI)."""

from __future__ import annotations

import pytest
import torch
from test_recovery_replica import _run

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 4, reason="needs 4 GPUs")


@pytest.mark.parametrize("scenario,step", [("shrink1", 5), ("spare1", 5), ("lag", 4)])
def test_lost_gpu_shard_restored_from_peer_memory(tmp_path, monkeypatch, scenario: str,
                                                  step: int) -> None:
    monkeypatch.setenv("DEVICE", "cuda")
    res = _run(tmp_path, scenario)
    lost = 1 if scenario.endswith("1") else 3
    members = [r for r in range(4) if r != lost]
    for r in members:
        assert res[r]["step"] == step and res[r]["match"], res[r]
    assert len({res[r]["after"] for r in res}) == 1
