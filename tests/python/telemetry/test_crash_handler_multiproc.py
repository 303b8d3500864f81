"""The native crash report: a process that crashes in native code names the signal and thread,
prints native frames, and still dies with the same signal; faulthandler's Python stacks follow."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

CRASH_IN_THREAD = """
import ctypes, threading
def crash():
    ctypes.string_at(0)  # reads address 0 in native code
t = threading.Thread(target=crash, name="writer")
t.start(); t.join()
"""


def _run(code: str, env_on: bool, *flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("RESILIENT_CRASH_HANDLER", None)
    if env_on:
        env["RESILIENT_CRASH_HANDLER"] = "1"
    return subprocess.run([sys.executable, *flags, "-c", "import resilient\n" + code], env=env,
                          capture_output=True, text=True, timeout=60)


def test_env_installs_and_the_signal_is_kept():
    p = _run(CRASH_IN_THREAD, True)
    assert p.returncode == -signal.SIGSEGV, p.stderr
    assert "resilient: fatal signal 11 (SIGSEGV), address 0x0, thread " in p.stderr
    # native frames: the module that faulted (libc's strlen or ctypes) appears in the stack
    assert ".so" in p.stderr.split("resilient: fatal signal", 1)[1]


def test_faulthandler_still_prints_python_stacks_after_the_report():
    p = _run(CRASH_IN_THREAD, True, "-X", "faulthandler")
    assert p.returncode == -signal.SIGSEGV, p.stderr
    ours = p.stderr.index("resilient: fatal signal 11")
    theirs = p.stderr.index("Fatal Python error: Segmentation fault")
    assert ours < theirs
    assert "in crash" in p.stderr[theirs:]


def test_not_installed_without_the_variable():
    p = _run(CRASH_IN_THREAD, False)
    assert p.returncode == -signal.SIGSEGV
    assert "resilient: fatal signal" not in p.stderr


def test_explicit_install_reports_abort():
    p = _run("resilient.install_crash_handler()\nimport os\nos.abort()", False)
    assert p.returncode == -signal.SIGABRT
    assert "resilient: fatal signal 6 (SIGABRT), thread " in p.stderr

