"""Settings of the recovery loop: typed defaults, ``RESILIENT_RECOVERY_*`` overrides, setters."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from resilient import settings
from resilient.recovery.policy import POLICIES

MISMATCH_SOURCES = ("storage", "peer")


@dataclass
class RecoveryConfig:
    """Recovery settings. ``RecoveryConfig.from_env()`` applies ``RESILIENT_RECOVERY_<NAME>``
    overrides (upper-case field names); ``set(name, value)`` checks and sets one field."""

    #: smaller-world policy: keep_batch | scale_lr | none (see resilient.recovery.policy)
    policy: str = "keep_batch"
    #: stop (RecoveryStopped, exit code 3 in the example) below this many ranks
    min_world: int = 1
    #: seconds to wait for the detector's agreed membership after a collective failed
    agree_timeout_s: float = 30.0
    #: rendezvous and collective timeout of a rebuilt (and the first) process group
    group_timeout_s: float = 60.0
    #: a gradient all-reduce still running after this long counts as a failure
    collective_timeout_s: float = 300.0
    #: when survivors hold different steps: "storage" (the Checkpointer, if any) or "peer"
    mismatch_source: str = "storage"
    #: a job that needs more recoveries than this stops
    max_recoveries: int = 16
    #: NCCL: shrink the group in place where torch supports it instead of abort + new group.
    #: Off: torch 2.11's shrink_group destroys the old group (ncclCommDestroy), which waits
    #: forever for a frozen peer's operations; abort + new group never waits on peers and was
    #: as fast on 4 H200s (benchmarks/RESULTS.md, "comm and recovery").
    prefer_shrink: bool = False
    #: NCCL: on a verdict, revoke the groups' communicators (ncclCommRevoke, NCCL >= 2.28.7),
    #: so a training thread blocked in one returns at once, and abort them on threads of their
    #: own while the new group forms. Off: abort and wait (up to 0.5 s: NCCL's proxy threads
    #: poll with that timeout) before creating the new group.
    revoke_nccl: bool = True
    #: NCCL, sharded models: make the rebuilt groups' connections (FSDP2's collectives at its
    #: sizes) on a thread while the state is restored, not in the first step (warmup.py)
    warm_nccl: bool = True
    #: GPU: a spare or restarted rank runs a small forward, backward and optimizer update on its
    #: device before it waits to be admitted, not in its first step after joining (warmup.py)
    warm_spare: bool = True
    #: seconds between polls of an in-flight collective
    poll_interval_s: float = 0.0005
    #: admit waiting spare/restarted ranks every this many steps (0: never)
    join_check_every: int = 0
    #: seconds a joining rank waits to be admitted
    join_timeout_s: float = 300.0
    #: admit joiners only up to this many ranks: 0 no limit, -1 the job's initial world size
    #: (hot spares wait until a rank is lost; ``resilient run --spares`` sets -1)
    max_world: int = 0

    def set(self, name: str, value: Any) -> None:
        """Sets field ``name``. A string is parsed like its ``RESILIENT_RECOVERY_<NAME>``
        variable (resilient.settings: ``yes``/``no`` for booleans; anything else is an error);
        other values must already have the field's type.

        Raises:
            ValueError: unknown name, bad value, or an out-of-range setting.
        """
        kinds = {f.name: f.type for f in fields(self)}
        if name not in kinds:
            raise ValueError(f"unknown recovery setting {name!r}")
        kind = kinds[name] if isinstance(kinds[name], str) else kinds[name].__name__
        if isinstance(value, str):
            value = settings.lookup(f"RESILIENT_RECOVERY_{name.upper()}").parse(value)
        elif kind == "bool" and not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool, not {value!r}")
        elif kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{name} must be an int, not {value!r}")
        elif kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, not {value!r}")
            value = float(value)
        setattr(self, name, value)
        self.validate()

    def validate(self) -> None:
        """Raises ValueError for an invalid combination."""
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r} not one of {POLICIES}")
        if self.mismatch_source not in MISMATCH_SOURCES:
            raise ValueError(f"mismatch_source {self.mismatch_source!r} not one of "
                             f"{MISMATCH_SOURCES}")
        if self.join_check_every < 0:
            raise ValueError("join_check_every must be >= 0")
        if self.max_world < -1:
            raise ValueError("max_world must be >= -1 (0: no limit, -1: the initial world)")
        if self.min_world < 1:
            raise ValueError("min_world must be >= 1")
        for name in ("agree_timeout_s", "group_timeout_s", "collective_timeout_s",
                     "poll_interval_s", "join_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    @classmethod
    def from_env(cls, **overrides: Any) -> RecoveryConfig:
        """Defaults, then ``RESILIENT_RECOVERY_*`` variables, then ``overrides``."""
        cfg = cls()
        for f in fields(cls):
            env = os.environ.get(f"RESILIENT_RECOVERY_{f.name.upper()}", "")
            if env.strip():
                cfg.set(f.name, env)
        for name, value in overrides.items():
            cfg.set(name, value)
        cfg.validate()
        return cfg


__all__ = ["MISMATCH_SOURCES", "RecoveryConfig"]
