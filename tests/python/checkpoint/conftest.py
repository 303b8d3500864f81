"""Fixtures the test files of checkpoint/ share."""

from __future__ import annotations

import pytest
from test_restore_shared import _mount_tmpfs, _umount


@pytest.fixture
def tiny_shm(tmp_path):
    """512 KiB: smaller than one host's buffer of the saved state."""
    where = tmp_path / "small-shm"
    _mount_tmpfs(where, "512k")
    try:
        yield where
    finally:
        _umount(where)
