"""A state dict flattened to plain values for comparisons across processes and meshes."""

from __future__ import annotations

import json
from typing import Any


def full_values(state: dict, with_values: bool = False) -> dict[str, Any]:
    """dotted name -> each tensor in full (DTensors gathered) as a list of floats; with
    `with_values`, non-tensor leaves too, as JSON sees them (tuples as lists)."""
    import torch

    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in full_values(v, with_values).items()})
        elif isinstance(v, torch.Tensor):
            t = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[k] = t.detach().double().flatten().tolist()
        elif with_values:
            out[k] = json.loads(json.dumps(v))
    return out
