"""examples/fsdp_recoverable.py (FSDP2 under Recovery(build=...)) under ``resilient run`` on 4 CPU
ranks: one worker is SIGKILLed (or SIGSTOPped) mid-run. The others (with a hot spare in its
place, or resharded over 3 ranks) finish; the state each step starts from after the recovery is
the state the job had at the end of that step before the loss (full-state hashes, gathered over
whatever group holds it), and no sample of the epoch is trained on twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from procs import wait_or_kill

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "fsdp_recoverable.py"


def _run(tmp: Path, steps: int, kill_after: int, spares: int,
         sig: int = signal.SIGKILL) -> tuple[str, list[dict]]:
    (tmp / "samples").mkdir()
    (tmp / "state").mkdir()
    log = open(tmp / "launcher.log", "w")  # noqa: SIM115 -- owned by the child
    p = subprocess.Popen(
        [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "4",
         "--finish-grace-s", "5", "--spares", str(spares), str(EXAMPLE),
         "--ckpt", str(tmp / "ckpt"), "--steps", str(steps), "--state-log", str(tmp / "state"),
         "--sample-log", str(tmp / "samples")],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    try:
        deadline = time.monotonic() + 120
        victim = None
        while victim is None and time.monotonic() < deadline:
            files = sorted((tmp / "samples").glob("pid*.samples"))
            for f in files:
                lines = f.read_text().splitlines()
                if len(files) >= 4 and len(lines) >= kill_after:
                    victim = json.loads(lines[0])[1]
                    break
            time.sleep(0.01)
        assert victim is not None, "no worker reached the kill step"
        os.kill(victim, sig)
    finally:
        code = wait_or_kill(p, 150)
    out = (tmp / "launcher.log").read_text()
    assert code == 0, out[-6000:]
    if sig == signal.SIGKILL:
        assert f"(pid {victim}) exited with -9" in out, out[-6000:]
    else:  # frozen: the survivors removed it; the launcher kills it once they finished
        assert "still running 5s after the others finished" in out, out[-6000:]
    states = [json.loads(line) for line in (tmp / "state" / "state.log").read_text().splitlines()]
    return str(victim), states


def _check_states(states: list[dict], steps: int) -> int:
    """Every step's start state equals the end state of the step before it (latest record);
    returns the step the job went back to after the loss."""
    done: dict[int, str] = {}
    restarts = []
    last = -1
    for e in states:
        if "done" in e:
            done[e["done"]] = e["hash"]
            continue
        step = e["begin"]
        if step <= last:
            restarts.append(step)
        last = step
        if step > 0:
            assert e["hash"] == done[step], f"step {step} did not start from step {step}'s state"
    assert len(restarts) == 1, restarts  # one recovery, which went back at most one step
    assert max(done) == steps
    return restarts[0]


def _check_samples(tmp: Path, victim: str, back_to: int, per_step: int) -> None:
    """Each step's samples come from its last attempt; none is trained on twice, and every
    step after the recovery draws `per_step` samples."""
    by_step: dict[int, dict[str, list[int]]] = {}
    for f in (tmp / "samples").glob("pid*.samples"):
        for line in f.read_text().splitlines():
            step, pid, index = json.loads(line)
            if str(pid) == victim and step >= back_to:
                continue  # its attempt of a step the job went back over
            by_step.setdefault(step, {})[f.stem] = index
    seen: Counter = Counter()
    for step, parts in by_step.items():
        seen.update(i for idx in parts.values() for i in idx)
        if step >= back_to:
            assert sum(map(len, parts.values())) == per_step, (step, parts)
    assert all(c == 1 for c in seen.values()), [i for i, c in seen.items() if c > 1][:10]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("spares,per_step,sig", [(0, 24, signal.SIGKILL), (1, 32, signal.SIGKILL),
                                                 (0, 24, signal.SIGSTOP)])
def test_a_lost_fsdp2_rank_is_restored_from_peer_memory(tmp_path: Path, spares: int,
                                                        per_step: int, sig: int) -> None:
    """SIGKILL (with and without a hot spare) and SIGSTOP (a frozen rank: the detector's
    verdict ends the survivors' polled collectives)."""
    steps = 30
    victim, states = _run(tmp_path, steps, kill_after=8, spares=spares, sig=sig)
    back_to = _check_states(states, steps)
    # from memory: the victim completed 8 steps, every rank snapshots every step; at most one
    # step back (a snapshot in flight), not to the checkpoint of step 0
    assert back_to >= 7, back_to
    _check_samples(tmp_path, victim, back_to, per_step)
    timelines = sorted((tmp_path / "state").glob("timeline*.json"))
    assert len(timelines) == 4 - (spares == 0)
    for f in timelines:
        restored = [e for e in json.loads(f.read_text()) if e["kind"] == "restored"]
        assert [(e["source"], e["step"]) for e in restored] == [("replica", back_to)], f
