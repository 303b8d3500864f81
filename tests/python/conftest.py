import os
import subprocess
import sys
from pathlib import Path

import pytest

# The shared helpers (procs, damage, machine, ...) live here, the tests in folders mirroring the
# package: processes a test starts (a test file run as a script, a rank, a helper) import them
# too.
TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (TESTS, os.environ.get("PYTHONPATH", "")) if p)

pytest_plugins = ["tiers", "pytester"]  # tiers from each file's name (tiers.py); pytester: its test


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 16 MiB tmpfs (root only), for ENOSPC tests; skipped where mounting is not allowed."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def pytest_report_header(config):
    return f"resilient tests, pid {os.getpid()}"


@pytest.fixture
def free_port():
    """A TCP port free a moment ago (for a test's own process group or store)."""
    from resilient.ports import free_port

    return free_port()
