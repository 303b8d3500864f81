"""`resilient bench` ends with a verdict a first-time user can read: a legend of the columns,
each goal with its value, and for a goal missed whether the library or the machine missed it; a
method known to fail on this torch is skipped with the reason, not a FAILED row."""


from __future__ import annotations

import pytest

from resilient.cli.bench import verdict
from resilient.cli.bench.methods import known_failure


def row(method: str, **fields) -> dict:
    base = {"method": method, "ok": True, "return_s": None, "stall_s": None, "durable_s": None,
            "write_gbps": None, "restore_gbps": None, "warm_gbps": None, "notes": {}}
    base.update(fields)
    return base


def rows(restore: float = 1.9, paired: float = 0.95, raw_reads=(2.0, 2.1, 2.0)) -> list[dict]:
    return [
        row("memcpy", return_s=0.05, stall_s=0.05, notes={"fresh_s": 0.2}),
        row("raw", durable_s=0.13, write_gbps=2.0, restore_gbps=2.0,
            notes={"all": {"restore_gbps": list(raw_reads)}}),
        row("resilient", return_s=0.03, stall_s=0.03, durable_s=0.16, write_gbps=2.0,
            restore_gbps=restore, warm_gbps=5.0,
            notes={"x_raw_write": 0.98, "x_raw_restore": paired, "first_stall_s": 0.21,
                   "x_raw_restore_all": [paired] * 3}),
        row("torch.save", return_s=0.4, stall_s=0.4, durable_s=0.4, write_gbps=0.6,
            restore_gbps=0.8, warm_gbps=1.5),
    ]


QUIET = {"cpus": 2, "loadavg_start": 0.1, "loadavg_end": 0.2, "others": 0.02, "steal": 0.0}


BUSY = {**QUIET, "others": 0.6, "loadavg_start": 4.0}


def test_every_goal_has_a_value_and_a_target() -> None:
    goals = verdict.goals(rows(), "cpu")
    names = [g["goal"] for g in goals]
    assert names[:2] == ["write vs raw", "restore vs raw (cold)"]
    assert "first save's stall vs memcpy into new memory" in names
    assert all(g["value"] is not None and g["target"] for g in goals)
    ahead = next(g for g in goals if g["goal"].startswith("ahead of torch.save"))
    assert ahead["met"] and ahead["value"] == pytest.approx(1.9 / 0.8)  # restore: the least
    assert "(least: restore)" in ahead["goal"]
    assert "warm restore" in ahead["detail"]


def test_the_paired_ratio_is_the_goal_value() -> None:
    goals = {g["goal"]: g for g in verdict.goals(rows(paired=0.93), "cpu")}
    assert goals["restore vs raw (cold)"]["value"] == pytest.approx(0.93)


def test_a_miss_on_a_quiet_machine_is_the_librarys() -> None:
    goals = verdict.goals(rows(paired=0.7), "cpu")
    machine = verdict.Machine.judge(QUIET, rows(paired=0.7))
    lines, end = verdict.verdict(goals, machine)
    assert machine.reasons == []
    assert any("restore vs raw (cold)" in line and "MISSED (the library)" in line
               for line in lines)
    assert end.startswith("verdict: 1 of") and "library" in end


def test_a_miss_on_a_busy_machine_or_an_unsteady_disk_is_the_machines() -> None:
    goals = verdict.goals(rows(paired=0.7), "cpu")
    busy = verdict.Machine.judge(BUSY, rows(paired=0.7))
    assert "other processes used 60%" in busy.reasons[0]
    lines, end = verdict.verdict(goals, busy)
    assert any("MISSED (the machine)" in line for line in lines)
    assert "not quiet" in end and "Measure again" in end
    unsteady = verdict.Machine.judge(QUIET, rows(paired=0.7, raw_reads=(1.2, 2.0, 2.2)))
    assert "raw read speed varied by 50%" in unsteady.reasons[0]


def test_all_met_says_so() -> None:
    _, end = verdict.verdict(verdict.goals(rows(), "cpu"), verdict.Machine.judge(QUIET, rows()))
    assert end.startswith("verdict: all") and "goals met" in end


def test_dcp_async_is_a_known_failure_of_torch_2_11_only() -> None:
    assert "DefaultStager" in known_failure("dcp_async", "2.11.0+cu130")
    assert known_failure("dcp_async", "2.12.0") is None
    assert known_failure("dcp_async_fresh", "2.11.0") is None


def test_machine_watch_measures_the_run() -> None:
    w = verdict.MachineWatch().start()
    sum(i * i for i in range(200_000))
    stats = w.stop()
    assert stats["cpus"] >= 1 and 0.0 <= stats.get("others", 0.0) <= 1.0
