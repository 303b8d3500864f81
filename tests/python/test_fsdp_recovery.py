"""examples/fsdp_recoverable.py (FSDP2 under Recovery(build=...)) under ``resilient run`` on 4 CPU
ranks: one worker is SIGKILLed (or SIGSTOPped) mid-run. The others (with a hot spare in its
place, or resharded over 3 ranks) finish; the state each step starts from after the recovery is
the state the job had at the end of that step before the loss (full-state hashes, gathered over
whatever group holds it), and no sample of the epoch is trained on twice."""

from __future__ import annotations

import json
import os
import re
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


def _start(tmp: Path, steps: int, launcher: list[str], example: list[str]) -> subprocess.Popen:
    (tmp / "samples").mkdir()
    (tmp / "state").mkdir()
    log = open(tmp / "launcher.log", "w")  # noqa: SIM115 -- owned by the child
    p = subprocess.Popen(
        [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "4",
         "--finish-grace-s", "5", *launcher, str(EXAMPLE),
         "--ckpt", str(tmp / "ckpt"), "--steps", str(steps), "--state-log", str(tmp / "state"),
         "--sample-log", str(tmp / "samples"), *example],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        # a replica every step, as the checks of the step restored assume (the chosen
        # interval, RESILIENT_REPLICA_EVERY=0, has tests of its own: test_replica_interval.py)
        env={**os.environ, "RESILIENT_REPLICA_EVERY": "1"})
    log.close()
    return p


def _states(tmp: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp / "state" / "state.log").read_text().splitlines()]


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


def _check_samples(tmp: Path, victim: str, back_to: int, per_step: int | set[int]) -> None:
    """Each step's samples come from its last attempt; none is trained on twice, and every
    step after the recovery draws `per_step` samples (one of them)."""
    allowed = per_step if isinstance(per_step, set) else {per_step}
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
            assert sum(map(len, parts.values())) in allowed, (step, parts)
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


def _run_self_kill(tmp_path: Path, steps: int, spares: int, example: list[str],
                   per_step: int) -> None:
    """Rank 0 SIGKILLs itself at step 8's start; the job finishes from memory: every step
    after it starts from the job's state at that step, `per_step` samples each, none twice."""
    p = _start(tmp_path, steps, ["--spares", str(spares)], [*example, "--kill", "0:8"])
    code = wait_or_kill(p, 150)
    out = (tmp_path / "launcher.log").read_text()
    assert code == 0, out[-6000:]
    victim = re.search(r"rank 0 \(pid (\d+)\) exited with -9", out)
    assert victim, out[-6000:]
    back_to = _check_states(_states(tmp_path), steps)
    assert back_to == 8, back_to
    _check_samples(tmp_path, victim.group(1), back_to, per_step)
    for f in sorted((tmp_path / "state").glob("timeline*.json")):
        restored = [e for e in json.loads(f.read_text()) if e["kind"] == "restored"]
        assert [(e["source"], e["step"]) for e in restored] == [("replica", back_to)], f


@pytest.mark.timeout(240)
@pytest.mark.skipif(os.environ.get("RESILIENT_TEST_DEVICE", "cpu") != "cuda",
                    reason="4 GPUs (RESILIENT_TEST_DEVICE=cuda): on gloo, DTensor's "
                           "tensor-parallel collectives cannot be aborted or polled")
@pytest.mark.parametrize("spares,per_step", [(0, 24), (1, 16)], ids=["to-fsdp-over-3", "spare"])
def test_tp_a_lost_rank_is_restored_from_peer_memory(tmp_path: Path, spares: int,
                                                     per_step: int) -> None:
    """Tensor parallel over pairs of ranks with FSDP2 across the pairs (`--tp`, a 2x2 mesh),
    a rank SIGKILLed: the survivors go on as FSDP2 over 3, or with a spare as TP x FSDP2 again,
    from memory. A pair reads the same batches (``Recovery(data_parallel=...)``: 2
    data-parallel ranks of 8 samples while the pairs last, 3 over 3 ranks), and no sample of
    the epoch is trained on twice."""
    _run_self_kill(tmp_path, 30, spares, ["--tp", "--device", "cuda"], per_step)
    first = [json.loads(line)[2] for f in (tmp_path / "samples").glob("pid*.samples")
             for line in f.read_text().splitlines() if json.loads(line)[0] == 0]
    assert sorted(map(len, first)) == [8, 8]  # 2 data-parallel readers; a pair logs once


@pytest.mark.timeout(240)
def test_a_rank_whose_device_is_lost_is_restarted_alone(tmp_path: Path) -> None:
    """A rank's device fails at step 3 (a device-side assert, emulated on CPU): that process
    exits with 75 instead of joining the recovery (its CUDA context would be poisoned), the
    three others reshard over themselves from memory, and the launcher restarts that rank alone
    (--max-restarts 1): the new process rejoins at a step boundary and the four continue from
    the members' snapshots. No step is lost beyond the one in flight, no sample is seen twice."""
    steps = 60  # (a replacement takes seconds to start; fewer than an epoch's samples)
    p = _start(tmp_path, steps, ["--max-restarts", "1"],
               ["--lose-device", "2:3", "--step-sleep", "0.05"])
    code = wait_or_kill(p, 180)
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
