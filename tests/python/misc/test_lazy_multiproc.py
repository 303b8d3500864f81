"""`import resilient` and its packages (checkpoint, recovery, comm, errors) in a fresh
interpreter import no torch: their torch names resolve lazily (resilient._lazy)."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_packages_imports_no_torch() -> None:
    code = ("import sys\n"
            "import resilient, resilient.checkpoint, resilient.recovery, resilient.comm\n"
            "import resilient.errors\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
            "resilient.recovery.RecoveryStopped\n"  # a lazy name: its module imports torch
            "print('torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["[]", "True"], r.stdout
