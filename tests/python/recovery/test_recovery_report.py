"""What a recovery prints (resilient.recovery.report): the one-line summary built from a
recovery's timeline events (pure), torch's log format, and the handler that steps aside once the
application configured logging. The lines as a launcher shows them: test_recovery_overlap.py."""

from __future__ import annotations

import logging
import re
import sys

import pytest

from resilient.recovery import report


def ev(kind: str, t: float = 0.0, **fields: object) -> dict:
    return {"kind": kind, "rank": 0, "time_mono": t, "time_wall": 1e9 + t, **fields}


def kill_events(**restored: object) -> list[dict]:
    return [ev("verdict", 0.1, removed=[1], generation=1, reasons={1: "crash"}),
            ev("failure_observed", 0.2, cause="verdict", step=7),
            ev("agreed", 0.21, generation=1, removed=[1], members=[0, 2, 3]),
            ev("rebuilt", 0.23, method="reinit", rank=0, world_size=3),
            ev("restored", 0.25, **({"source": "memory", "step": 7} | restored)),
            ev("policy", 0.25, message="world 4 -> 3: global batch 32 kept with 2 "
                                       "accumulation step(s)"),
            ev("first_collective", 0.64, step=7, generation=1, world_size=3)]


def test_a_lost_rank_in_one_line() -> None:
    line = report.summary(kill_events(), "keep_batch")
    assert line == ("resilient: lost rank 1 (its process is gone) at step 7: world 4 -> 3, "
                    "step 7 redone (state kept in memory), batch policy keep_batch: global "
                    "batch 32 kept with 2 accumulation step(s); recovered in 0.44 s (failed "
                    "step seen -> first collective)")
    went_back = report.summary(kill_events(source="storage", step=5), "keep_batch")
    assert "going back to step 5, the newest checkpoint" in went_back


def test_a_cascade_is_one_recovery_with_every_lost_rank() -> None:
    events = kill_events()[:4] + [
        ev("failure_observed", 0.3, cause="collective_error", step=7),
        ev("verdict", 0.31, removed=[2], generation=2, reasons={2: "unresponsive"}),
        ev("agreed", 0.32, generation=2, removed=[2], members=[0, 3]),
        *kill_events()[3:]]
    line = report.summary(events, "none", loader_batches=True)
    assert line.startswith("resilient: lost rank 1 (its process is gone) and rank 2 (it "
                           "stopped answering: frozen, stopped or cut off) at step 7: world 4 "
                           "-> 3"), line
    assert "batch policy none: one DataLoader batch per rank and step" in line


def test_an_admission_and_nothing() -> None:
    from resilient.recovery.join import JOIN_BASE

    line = report.summary([ev("join_admitted", joiners=[JOIN_BASE], step=9),
                           ev("first_collective", 1.0, step=9, world_size=4)], "keep_batch")
    assert line == "resilient: rank joiner 0 joined at step 9: world 3 -> 4"
    assert report.summary([ev("first_collective", step=3, world_size=4)], "none") is None


def test_the_line_is_torchs_and_steps_aside_for_the_applications_logging(
        capsys: pytest.CaptureFixture[str]) -> None:
    report.install()
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers.clear()  # (pytest's own capture handler is on the root)
    handler = next(h for h in report.log.handlers if isinstance(h, logging.StreamHandler))
    handler.setStream(sys.stderr)
    try:
        report.log.warning("[rank%d]: resilient: %s", 0, "hello")
        err = capsys.readouterr().err
        assert re.fullmatch(r"W\d{4} \d\d:\d\d:\d\d\.\d{6} \d+ "
                            r"resilient/tests/python/test_recovery_report\.py:\d+\] "
                            r"\[rank0\]: resilient: hello\n", err) or re.fullmatch(
            r"W\d{4} \d\d:\d\d:\d\d\.\d{6} \d+ test_recovery_report\.py:\d+\] "
            r"\[rank0\]: resilient: hello\n", err), err
        root.addHandler(logging.NullHandler())  # the application configured logging
        report.log.warning("not twice")
        assert capsys.readouterr().err == ""
    finally:
        root.handlers[:] = saved
