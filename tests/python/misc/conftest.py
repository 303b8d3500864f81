"""Fixtures the test files of misc/ share."""

from __future__ import annotations

import pytest


@pytest.fixture
def tiers_dir(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest('pytest_plugins = ["tiers"]\n')
    return pytester
