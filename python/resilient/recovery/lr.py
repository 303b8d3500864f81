"""The scale_lr policy's factor applied to a running optimizer and its LR schedulers.

A world change multiplies the rates by new factor / old factor where the schedule has left them,
and every rate a scheduler computes from (its base and peak rates, those OneCycleLR keeps in the
param groups, the bounds of CyclicLR and ReduceLROnPlateau, the schedulers inside SequentialLR or
ChainedScheduler), so that its next ``step()`` neither undoes the factor nor resets the schedule.
Each scheduler is scaled once, however often the state lists it.
"""

from __future__ import annotations

from typing import Any

import torch

# Rates a param group or a scheduler holds; eta_min (a floor) scales with them.
_GROUP_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")
_SCHEDULER_LISTS = ("base_lrs", "max_lrs", "min_lrs", "_last_lr")
_SCHEDULER_FLOATS = ("eta_min",)


def schedulers_of(optimizer: torch.optim.Optimizer, objects: list[Any]) -> list[Any]:
    """The LR schedulers of `optimizer` among `objects` and inside them (SequentialLR's and
    ChainedScheduler's ``_schedulers``), each once."""
    found: dict[int, Any] = {}

    def visit(obj: Any) -> None:
        if id(obj) in found or not hasattr(obj, "optimizer") or not hasattr(obj, "step"):
            return
        if getattr(obj, "optimizer", None) is optimizer:
            found[id(obj)] = obj
        for inner in getattr(obj, "_schedulers", None) or ():
            visit(inner)

    for obj in objects:
        visit(obj)
    return list(found.values())


def _scaled(value: Any, ratio: float) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value * ratio
    if isinstance(value, torch.Tensor):  # a tensor learning rate (capturable optimizers)
        return value.mul_(ratio) if value.dim() == 0 else value
    return value


def scale_learning_rates(optimizer: torch.optim.Optimizer, objects: list[Any],
                         ratio: float) -> None:
    """Multiplies every rate of `optimizer` and of its schedulers among `objects` by
    `ratio` (module docstring)."""
    if ratio == 1.0:
        return
    for group in optimizer.param_groups:
        for key in _GROUP_KEYS:
            if key in group:
                group[key] = _scaled(group[key], ratio)
    for sched in schedulers_of(optimizer, objects):
        for attr in _SCHEDULER_LISTS:
            values = getattr(sched, attr, None)
            if isinstance(values, list):
                setattr(sched, attr, [_scaled(v, ratio) for v in values])
        for attr in _SCHEDULER_FLOATS:
            value = getattr(sched, attr, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                setattr(sched, attr, value * ratio)


__all__ = ["scale_learning_rates", "schedulers_of"]
