"""examples/fsdp_recoverable.py (FSDP2 under Recovery(build=...)) under ``resilient run`` on 4 CPU
ranks: one worker is SIGKILLed (or SIGSTOPped) mid-run. The others (with a hot spare in its
place, or resharded over 3 ranks) finish; the state each step starts from after the recovery is
the state the job had at the end of that step before the loss (full-state hashes, gathered over
whatever group holds it), and no sample of the epoch is trained on twice."""


from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from procs import wait_or_kill

ROOT = Path(__file__).resolve().parents[3]


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
