import os
import subprocess

import pytest


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
