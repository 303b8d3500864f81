"""A second job on a root in use stops when it starts, and a new root says it was created
(issue 44, item 9)."""


from __future__ import annotations

import logging

import pytest
import torch

import resilient


def test_the_lock_is_free_again_after_a_failed_construction(tmp_path):
    with pytest.raises(ValueError):
        resilient.Checkpointer(tmp_path / "c", create=True, chunk_bytes=1000)
    with resilient.Checkpointer(tmp_path / "c", create=True) as ck:
        ck.save(1, {"w": torch.ones(2)}).wait()


def test_a_new_root_is_logged_and_a_new_parent_warned(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="resilient.checkpoint")
    with resilient.Checkpointer(tmp_path / "c", create=True):
        pass
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any(f"created a new checkpoint root at {tmp_path / 'c'}" in m for m in infos)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    caplog.clear()
    with resilient.Checkpointer(tmp_path / "c", create=True):  # exists: nothing to say
        pass
    assert not any("created" in r.getMessage() for r in caplog.records)
    typo = tmp_path / "chekpoints" / "run1" / "c"
    with resilient.Checkpointer(typo, create=True):
        pass
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(tmp_path / "chekpoints") in warnings[0], warnings
    assert "mistyped" in warnings[0]
