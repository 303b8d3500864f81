"""resilient.settings: one table, parsed like the C++ core parses it, documented from itself;
lists parsed as lists, every number checked against its range naming the variable.

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_settings.py."""

from __future__ import annotations

import os
import subprocess
import sys


def test_settings_current_refuses_what_the_checkpointer_would(tmp_path):
    """`resilient settings --current` reports RESILIENT_CHUNK_BYTES=5k as an error naming it,
    and a Checkpointer made in that environment fails naming the same variable."""
    env = dict(os.environ, RESILIENT_CHUNK_BYTES="5k")
    cli = [sys.executable, "-m", "resilient", "settings", "--current"]
    p = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p
    assert "error: RESILIENT_CHUNK_BYTES='5k': must be a multiple of 4KiB" in p.stdout
    code = ("import resilient\n"
            f"resilient.Checkpointer({str(tmp_path / 'c')!r}, create=True, distributed=False)")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode != 0 and "RESILIENT_CHUNK_BYTES" in p.stderr, p.stderr
