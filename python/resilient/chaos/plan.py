"""Fault plans for `resilient chaos`: what job to run, on how many ranks, and which faults to inject
when. A plan file (YAML or JSON) holds one plan, or ``{"defaults": {...}, "scenarios": [...]}``.
A seed turns ``random_faults: K`` into K faults drawn repeatably (see random_faults()).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Faults that take a rank out (the job must detect them and recover).
RANK_FAULTS = ("kill", "stop", "partition", "kill_during_save")
# Faults of the storage path (saves fail or a committed file is damaged; training goes on).
STORAGE_FAULTS = ("enospc", "eio", "corrupt")
FAULT_TYPES = (*RANK_FAULTS, *STORAGE_FAULTS, "slow")


@dataclass
class Fault:
    """One fault. Fires once, when any rank has finished `at_step` steps or `at_time` seconds
    after the run started (whichever is given; at_step wins).

    type: kill (SIGKILL), stop (SIGSTOP, held until teardown), partition (the rank's network
    link goes down), slow (SIGSTOP/SIGCONT duty cycle stop_ms/run_ms for `duration` s), enospc
    (fill the checkpoint file system for `duration` s), eio (the rank's checkpoint writes fail
    with EIO for `duration` s), corrupt (flip bytes of the newest committed checkpoint),
    kill_during_save (slow the rank's checkpoint writes, SIGKILL it inside the next save).
    permanent: a killed rank does not come back (the job restarts with fewer ranks).
    """

    type: str
    rank: int = 0
    at_step: int | None = None
    at_time: float | None = None
    duration: float = 2.0
    permanent: bool = False
    stop_ms: float = 40.0
    run_ms: float = 40.0

    def validate(self, ranks: int) -> None:
        if self.type not in FAULT_TYPES:
            raise ValueError(f"unknown fault type {self.type!r} (known: {', '.join(FAULT_TYPES)})")
        if not 0 <= self.rank < ranks:
            raise ValueError(f"fault {self.type}: rank {self.rank} outside 0..{ranks - 1}")
        if self.at_step is None and self.at_time is None:
            raise ValueError(f"fault {self.type}: give at_step or at_time")

    def describe(self) -> str:
        when = f"step {self.at_step}" if self.at_step is not None else f"t+{self.at_time:g}s"
        who = "" if self.type in ("enospc", "corrupt") else f" rank {self.rank}"
        return f"{self.type}{who} at {when}" + (" (permanent)" if self.permanent else "")


@dataclass
class Plan:
    """One chaos run. `expect` is "recovered" or "unrecoverable" (checked by --check)."""

    name: str = "run"
    ranks: int = 2
    steps: int = 40
    ckpt_every: int = 5
    keep: int = 3
    step_ms: float = 50.0
    min_world_size: int = 1
    max_restarts: int = 5
    seed: int = 0
    command: list[str] | None = None  # None: the built-in job (resilient.chaos.job)
    faults: list[Fault] = field(default_factory=list)
    random_faults: int = 0
    expect: str = "recovered"
    timeout: float = 120.0
    hang_timeout: float = 20.0  # no step progress for this long: the runner declares a failure
    compare: bool = True  # compare the final model with a fault-free run of the same size
    adapter: str = ""  # "ddp_recovery": the in-job recovery example (see adapters.py)

    def validate(self) -> None:
        if self.ranks < 1 or self.steps < 1 or self.ckpt_every < 1:
            raise ValueError(f"plan {self.name}: ranks, steps and ckpt_every must be >= 1")
        if self.expect not in ("recovered", "unrecoverable"):
            raise ValueError(f"plan {self.name}: expect must be recovered or unrecoverable")
        for f in self.faults:
            f.validate(self.ranks)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def random_faults(plan: Plan, count: int, seed: int) -> list[Fault]:
    """`count` recoverable faults drawn with `seed`: types among kill, stop, eio, corrupt, slow,
    at steps spread over the run's middle, on random ranks. The same seed gives the same list."""
    rng = random.Random(seed)
    kinds = ["kill", "stop", "eio", "corrupt", "slow"]
    lo, hi = max(2, plan.ckpt_every + 1), max(3, plan.steps - 3)
    out = []
    for _ in range(count):
        kind = rng.choice(kinds)
        out.append(Fault(type=kind, rank=rng.randrange(plan.ranks), at_step=rng.randint(lo, hi),
                         duration=round(rng.uniform(0.5, 2.0), 2)))
    out.sort(key=lambda f: f.at_step or 0)
    return out


def _plan_from_dict(d: dict[str, Any], defaults: dict[str, Any]) -> Plan:
    merged = {**defaults, **d}
    faults = [Fault(**f) for f in merged.pop("faults", [])]
    known = set(Plan.__dataclass_fields__)
    unknown = set(merged) - known
    if unknown:
        raise ValueError(f"unknown plan keys: {', '.join(sorted(unknown))}")
    if isinstance(merged.get("command"), str):
        merged["command"] = merged["command"].split()
    plan = Plan(**merged, faults=faults)
    if plan.random_faults:
        plan.faults += random_faults(plan, plan.random_faults, plan.seed)
    plan.validate()
    return plan


def load_plans(path: str | Path) -> list[Plan]:
    """Plans in a YAML or JSON file (one plan, or defaults + scenarios)."""
    text = Path(path).read_text()
    if str(path).endswith(".json"):
        doc = json.loads(text)
    else:
        import yaml

        doc = yaml.safe_load(text)
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a plan file holds a mapping")
    if "scenarios" in doc:
        defaults = doc.get("defaults", {})
        return [_plan_from_dict(s, defaults) for s in doc["scenarios"]]
    return [_plan_from_dict(doc, {})]


def plans_from_dicts(docs: list[dict[str, Any]],
                     defaults: dict[str, Any] | None = None) -> list[Plan]:
    """Plans from already-parsed mappings (tests and the --fault flags)."""
    return [_plan_from_dict(d, defaults or {}) for d in docs]


def parse_fault_flag(text: str) -> Fault:
    """Parses ``--fault kill:rank=1,at_step=12`` into a Fault."""
    kind, _, rest = text.partition(":")
    kw: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key == "permanent":
            kw[key] = value.lower() in ("1", "true", "yes", "")
        elif key in ("rank", "at_step"):
            kw[key] = int(value)
        else:
            kw[key] = float(value)
    return Fault(type=kind, **kw)


@dataclass
class RunResult:
    """What one run produced: the plan, the merged timeline and the outcome."""

    plan: Plan
    timeline: list[dict[str, Any]] = field(default_factory=list)
    outcome: str = "running"  # finished | unrecoverable | timeout | skipped
    message: str = ""
    recovery_path: str = "restart"  # restart (the runner) or in-job (the job's recovery loop)
    attempts: int = 0
    final_world: int = 0
    committed_at_end: list[int] = field(default_factory=list)
    verified: list[int] = field(default_factory=list)
    corrupted: list[int] = field(default_factory=list)
    run_dir: str = ""
