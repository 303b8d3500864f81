"""The reference the recovery tests compare against: an example's model trained in one process
with the full global batch and no failure."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch


def reference_params(example: Path, steps: int, global_batch: int = 32,
                     lr: float = 0.05) -> Any:
    """The flattened parameters after `steps` steps of `example`'s make_model / make_data."""
    spec = importlib.util.spec_from_file_location(f"{example.stem}_example", example)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    model = ex.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for step in range(steps):
        x, y = ex.make_data(step, global_batch)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])
