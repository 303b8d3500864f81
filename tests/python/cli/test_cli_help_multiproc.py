"""Every `resilient` subcommand answers `--help` (exit 0, a usage line), and the top-level
description is a whole sentence.

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_cli_help.py."""

from __future__ import annotations

import subprocess
import sys

from resilient.cli import DESCRIPTION


def test_top_level_help_is_a_whole_sentence():
    r = subprocess.run([sys.executable, "-m", "resilient", "--help"], capture_output=True,
                       text=True)
    assert r.returncode == 0
    assert DESCRIPTION.endswith(".") and DESCRIPTION.split()[0] in r.stdout
    assert " ".join(r.stdout.split()).count(" ".join(DESCRIPTION.split())) == 1
