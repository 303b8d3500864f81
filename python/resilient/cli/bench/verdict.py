"""What `resilient bench` concludes: each goal's value against its target, and for a goal
missed, whether the library or the machine missed it.

The machine is judged by what it did during the run, not by its specification: the CPU time
other processes took from the bench (from /proc/stat and the bench's own rusage), the time the
hypervisor took from the VM (steal), and how much the storage's own speed (the raw rows, read
next to every measured save and restore) varied. A goal missed while the machine was busy or its
disk unsteady is reported as the machine's, with the numbers, and should be measured again on a
quiet machine; one missed on a quiet machine is the library's.
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from dataclasses import dataclass
from typing import Any

# Beyond these the run says more about the machine than about the library.
BUSY_OTHERS = 0.25  # share of the CPUs' time that other processes used
BUSY_STEAL = 0.05  # share of the CPUs' time the hypervisor took (a VM's noisy neighbours)
UNSTEADY_DISK = 0.25  # (max - min) / median of the raw reads' speed over the run

LEGEND = [
    ("return_s", "seconds the save call blocked the caller"),
    ("stall_s", "seconds until the saved tensors may change again (async: staging done)"),
    ("durable_s", "seconds until the checkpoint is on storage (fsynced) and committed"),
    ("write_gbps", "GB/s written once staged: bytes / (durable_s - stall_s)"),
    ("restore_gbps", "GB/s read back into the tensors, page cache dropped first (cold)"),
    ("warm_gbps", "GB/s read back with the files in the page cache (a restart on this host)"),
    ("memcpy", "one thread copying the same bytes in memory: the floor of a save's stall"),
    ("raw", "plain io_uring O_DIRECT write and read of the same bytes: the storage's limit"),
]


def _cpu_ticks() -> tuple[int, int, int]:
    """(busy, steal, total) clock ticks of all CPUs since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    busy = user + nice + system + irq + softirq
    return busy, steal, busy + idle + iowait + steal


def _own_seconds() -> float:
    """CPU seconds this process and its waited-for children used."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class MachineWatch:
    """Samples the machine's CPU use around a run: start() before, stop() after."""

    def start(self) -> MachineWatch:
        self._load = os.getloadavg()[0]
        self._ticks = _cpu_ticks() if os.path.exists("/proc/stat") else None
        self._own = _own_seconds()
        self._t0 = time.monotonic()
        return self

    def stop(self) -> dict[str, Any]:
        """cpus, load average at start and end, and over the run: the share of all CPUs' time
        that other processes used (others) and that the hypervisor took (steal)."""
        out: dict[str, Any] = {
            "cpus": os.cpu_count(),
            "loadavg_start": round(self._load, 2),
            "loadavg_end": round(os.getloadavg()[0], 2),
            "seconds": round(time.monotonic() - self._t0, 1),
        }
        if self._ticks is not None:
            busy, steal, total = (b - a for a, b in zip(self._ticks, _cpu_ticks()))
            hz = os.sysconf("SC_CLK_TCK")
            own = (_own_seconds() - self._own) * hz
            if total > 0:
                out["others"] = round(max(0.0, busy - own) / total, 3)
                out["steal"] = round(steal / total, 3)
        return out


def spread(values: list[float] | None) -> float | None:
    """(max - min) / median of a row's repeats, None for fewer than two."""
    if not values or len(values) < 2:
        return None
    mid = statistics.median(values)
    return (max(values) - min(values)) / mid if mid else None


@dataclass
class Machine:
    """Why the machine, not the library, may have missed a goal (empty reasons: a quiet run)."""

    reasons: list[str]

    @classmethod
    def judge(cls, stats: dict[str, Any], rows: list[dict]) -> Machine:
        reasons = []
        others, steal = stats.get("others"), stats.get("steal")
        if others is not None and others > BUSY_OTHERS:
            reasons.append(f"other processes used {others:.0%} of the {stats['cpus']} CPUs' time "
                           f"during the run (load average {stats['loadavg_start']} -> "
                           f"{stats['loadavg_end']})")
        if steal is not None and steal > BUSY_STEAL:
            reasons.append(f"the hypervisor took {steal:.0%} of the CPUs' time (steal)")
        raw = next((r for r in rows if r["method"] == "raw" and r["ok"]), None)
        disk = spread((raw or {}).get("notes", {}).get("all", {}).get("restore_gbps"))
        res = next((r for r in rows if r["method"] == "resilient" and r["ok"]), None)
        paired = spread((res or {}).get("notes", {}).get("x_raw_restore_all"))
        if disk is not None and disk > UNSTEADY_DISK:
            reasons.append(f"the storage's raw read speed varied by {disk:.0%} over the run")
        elif paired is not None and paired > UNSTEADY_DISK:
            reasons.append(f"restore / raw varied by {paired:.0%} between repeats")
        return cls(reasons)


def goals(rows: list[dict], device: str) -> list[dict[str, Any]]:
    """The goals as ratios measured in this run: {goal, value, target, met, detail}."""
    out: list[dict[str, Any]] = []

    def row(name: str) -> dict | None:
        return next((r for r in rows if r["method"] == name and r["ok"]), None)

    def add(name: str, value: float | None, target: str, met: bool | None,
            detail: str = "") -> None:
        out.append({"goal": name, "value": value, "target": target, "met": met, "detail": detail})

    res, raw = row("resilient"), row("raw")
    ref = row("d2h_limit" if device == "cuda" else "memcpy")
    limit = 1.15 if device == "cuda" else 1.2
    if res and raw:
        for key, paired, label in (("write_gbps", "x_raw_write", "write vs raw"),
                                   ("restore_gbps", "x_raw_restore", "restore vs raw (cold)")):
            v = res["notes"].get(paired)
            detail = "median of each repeat against a raw run right after it"
            if v is None and res[key] and raw[key]:
                v, detail = res[key] / raw[key], "medians of the two rows"
            add(label, v, ">= 0.90", None if v is None else v >= 0.9, detail)
    if res and ref:
        v = res["stall_s"] / ref["stall_s"]
        add(f"stall vs {ref['method']}", v, f"<= {limit}", v <= limit)
        first, fresh = res["notes"].get("first_stall_s"), ref["notes"].get("fresh_s")
        if first and fresh:
            v = first / fresh
            add("first save's stall vs memcpy into new memory", v, f"<= {limit}", v <= limit,
                f"{first:.3f} s against {fresh:.3f} s (the pages' first touch)")
    ov = row("resilient_overlap")
    if ov and ref and device == "cuda":
        v = ov["return_s"] / ref["stall_s"]
        add("overlap return vs d2h_limit", v, "<= 0.10", v <= 0.10)
    tr = row("train_overlap")
    if tr:
        v = tr["notes"]["step_ratio"]
        add(f"training step with saves every {tr['notes']['every']} steps vs without", v,
            "<= 1.02", v <= 1.02)
    if res:
        for other in ("torch.save", "dcp", "dcp_async", "dcp_async_fresh"):
            o = row(other)
            if not o:
                continue
            # How many times better resilient is on each measure (> 1: ahead).
            ratios = {
                "stall": o["stall_s"] / res["stall_s"] if res["stall_s"] else None,
                "durable": o["durable_s"] / res["durable_s"] if res["durable_s"] else None,
                "write": res["write_gbps"] / o["write_gbps"] if o["write_gbps"] else None,
                "restore": res["restore_gbps"] / o["restore_gbps"] if o["restore_gbps"] else None,
                "warm restore": (res["warm_gbps"] / o["warm_gbps"]
                                 if res.get("warm_gbps") and o.get("warm_gbps") else None),
            }
            known = {k: v for k, v in ratios.items() if v is not None}
            if not known:
                continue
            worst = min(known, key=lambda k: known[k])
            detail = ", ".join(f"{k} {v:.2f}x" for k, v in known.items())
            add(f"ahead of {other} (least: {worst})", known[worst], "> 1.00",
                known[worst] > 1.0, detail)
    return out


def verdict(goal_rows: list[dict], machine: Machine) -> tuple[list[str], str]:
    """Each goal's line and the closing verdict."""
    lines, missed = [], []
    for g in goal_rows:
        if g["met"] is None:
            mark = "not measured"
        elif g["met"]:
            mark = "met"
        else:
            mark = "MISSED (" + ("the machine" if machine.reasons else "the library") + ")"
            missed.append(g["goal"])
        value = "-" if g["value"] is None else f"{g['value']:.3f}"
        line = f"  {g['goal']:<46} {value:>7}  target {g['target']:<8} {mark}"
        if g.get("detail"):
            line += f"\n  {'':<46} {'':>7}  ({g['detail']})"
        lines.append(line)
    if not missed:
        end = f"verdict: all {len(goal_rows)} goals met"
        if machine.reasons:
            end += " (although " + "; ".join(machine.reasons) + ")"
    elif machine.reasons:
        end = (f"verdict: {len(missed)} of {len(goal_rows)} goals missed, on a machine that was "
               "not quiet: " + "; ".join(machine.reasons) + ". Measure again when it is idle; "
               "a goal missed then is the library's")
    else:
        end = (f"verdict: {len(missed)} of {len(goal_rows)} goals missed by the library on a "
               f"quiet machine ({', '.join(missed)}): please report it with this output "
               "(--json has every repeat)")
    return lines, end
