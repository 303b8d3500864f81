"""Fixtures the test files of cli/ share."""

from __future__ import annotations

import pytest
from test_ckpt_cli import make_root


@pytest.fixture()
def root(tmp_path) -> str:
    return make_root(str(tmp_path / "root"))
