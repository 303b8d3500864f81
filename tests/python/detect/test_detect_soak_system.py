"""The 10-minute detector soak (8 ranks, stress-ng CPU load): zero false suspicions.
Excluded from CI (slow); run with `pytest -m slow tests/python/test_detect_soak.py`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "detector_soak.py"


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_soak_ten_minutes_under_cpu_stress():
    pytest.importorskip("torch.distributed")
    out = subprocess.run([sys.executable, str(SCRIPT), "--ranks", "8", "--minutes", "10",
                          "--stress-cpu", "2"], capture_output=True, text=True, timeout=1100)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["false_suspicions"] == 0 and result["generations"] == 0, result
    assert result["ranks_reporting"] == 8
