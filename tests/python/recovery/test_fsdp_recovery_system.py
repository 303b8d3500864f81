"""examples/fsdp_recoverable.py (FSDP2 under Recovery(build=...)) under ``resilient run`` on 4 CPU
ranks: one worker is SIGKILLed (or SIGSTOPped) mid-run. The others (with a hot spare in its
place, or resharded over 3 ranks) finish; the state each step starts from after the recovery is
the state the job had at the end of that step before the loss (full-state hashes, gathered over
whatever group holds it), and no sample of the epoch is trained on twice.

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_fsdp_recovery.py."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from test_fsdp_recovery import (
    _check_samples,
    _check_states,
    _run_self_kill,
    _start,
    _states,
)

from procs import wait_or_kill


def _run(tmp: Path, steps: int, kill_after: int, spares: int,
         sig: int = signal.SIGKILL) -> tuple[str, list[dict]]:
    p = _start(tmp, steps, ["--spares", str(spares)], [])
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
    return str(victim), _states(tmp)


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
    # the spare's first model was built on the meta device (resilient.joining()): it never held
    # the whole model in its one-rank group
    joiners = [f.read_text() for f in (tmp_path / "state").glob("joiner*.device")]
    assert joiners == ["meta"] * spares, joiners


@pytest.mark.timeout(240)
@pytest.mark.parametrize("spares,per_step", [(0, 24), (1, 32)], ids=["to-fsdp-over-3", "spare"])
def test_hsdp_a_lost_rank_is_restored_from_peer_memory(tmp_path: Path, spares: int,
                                                       per_step: int) -> None:
    """HSDP (2 replica groups of 2 ranks, `--hsdp`) under `resilient run`, a rank SIGKILLed:
    without a spare the survivors rebuild as FSDP2 over 3 (HSDP needs an even world), with one
    the spare takes the lost rank's place and the job is HSDP over 4 again; either way from
    memory, each step after the recovery starting from the job's state at that step."""
    steps = 30
    # rank 0 kills itself at step 8's start (a kill from outside could land after the step's
    # update but before its end-of-step hash: then the job rightly goes on from step 9, but the
    # state log has nothing to compare step 9's start with). RESILIENT_TEST_DEVICE=cuda runs it
    # on 4 GPUs with NCCL (the spare takes GPU 0, the lost rank's).
    device = os.environ.get("RESILIENT_TEST_DEVICE", "cpu")
    _run_self_kill(tmp_path, steps, spares, ["--hsdp", "--device", device], per_step)


@pytest.mark.timeout(240)
def test_a_rank_whose_device_is_lost_is_restarted_alone(tmp_path: Path) -> None:
    """A rank's device fails at step 3 (a device-side assert, emulated on CPU): that process
    exits with 75 instead of joining the recovery (its CUDA context would be poisoned), the
    three others reshard over themselves from memory, and the launcher restarts that rank alone
    (--max-restarts 1): the new process rejoins at a step boundary and the four continue from
    the members' snapshots. No step is lost beyond the one in flight, no sample is seen twice."""
    steps = 60  # (fewer than an epoch's samples)
    # While the replacement starts the three survivors step once a second: on a loaded machine
    # its start (a torch import, seconds of CPU) decides when it rejoins, within the 57 steps.
    p = _start(tmp_path, steps, ["--max-restarts", "1"],
               ["--lose-device", "2:3", "--step-sleep", "0.05", "--short-step-sleep", "1"])
    code = wait_or_kill(p, 200)
    out = (tmp_path / "launcher.log").read_text()
    assert code == 0, out[-6000:]
    lost = re.search(r"rank 2 \(pid (\d+)\) exited with 75", out)
    assert lost, out[-6000:]
    assert "to replace rank 2 (0 restarts left)" in out, out[-6000:]
    assert "device-side assert triggered (emulated)" in out, out[-6000:]
    back_to = _check_states(_states(tmp_path), steps)
    assert back_to >= 2, back_to
    _check_samples(tmp_path, lost.group(1), back_to, {24, 32})
    joined = []
    for f in sorted((tmp_path / "state").glob("timeline*.json")):
        events = json.loads(f.read_text())
        restored = [(e["source"], e["step"]) for e in events if e["kind"] == "restored"]
        assert restored and all(src == "replica" for src, _ in restored), (f, restored)
        if any(e["kind"] == "started" and e.get("joined") for e in events):
            joined.append(restored)
    assert len(joined) == 1, joined  # the restarted rank, filled from the members' memory
    joiners = [f.read_text() for f in (tmp_path / "state").glob("joiner*.device")]
    assert joiners == ["meta"], joiners  # it never held the whole model
    last = max(json.loads(line)[0] for f in (tmp_path / "samples").glob("pid*.samples")
               for line in f.read_text().splitlines())
    per_rank = Counter(json.loads(line)[0] for f in (tmp_path / "samples").glob("pid*.samples")
                       for line in f.read_text().splitlines())
    assert per_rank[last] == 4, per_rank  # four ranks again at the end
