"""tests/python/tiers.py's guard, run on throw-away test files (pytester, in this process): a
unit file that starts a Python process, in a test or in a fixture of any scope, fails with the
file to move it to; the multiproc file it names may; every file gets its tier's marker.

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_tiers_guard.py."""

from __future__ import annotations

import pytest
from test_tiers_guard import STARTS


def test_the_multiproc_file_it_names_may_and_each_file_has_its_marker(
        tiers_dir: pytest.Pytester) -> None:
    tiers_dir.makepyfile(test_probe_multiproc=f"import subprocess, sys\n\ndef test_x():\n"
                                              f"    {STARTS}\n",
                         test_probe="def test_y():\n    pass\n")
    result = tiers_dir.runpytest_inprocess("-p", "no:cacheprovider", "-m", "multiproc")
    result.assert_outcomes(passed=1, deselected=1)
    result = tiers_dir.runpytest_inprocess("-p", "no:cacheprovider", "-m", "unit")
    result.assert_outcomes(passed=1, deselected=1)
