"""`resilient chaos`: fault-injection runs of a training job with recovery reports.

Runs the job (the built-in CPU DDP job, or any command) on N local ranks under a fault plan,
recovers by restart where the job does not recover itself, and reports detection time, recovery
time by phase, steps lost, checkpoints, bit-exactness against a fault-free run, ETTR, and over a
set of runs MTBF, MTTR, availability, detection coverage and automatic-recovery rate.
"""

from __future__ import annotations

from resilient.chaos.plan import Fault, Plan, load_plans

__all__ = ["Fault", "Plan", "load_plans"]
