"""The checkpointing idioms popular frameworks teach, for tests to save and load through."""

from __future__ import annotations

from typing import Any


def torchtitan_wrappers(model: Any, optimizer: Any) -> tuple[Any, Any]:
    """torchtitan's Stateful wrappers: (ModelWrapper, OptimizersContainer)-like objects whose
    state_dict / load_state_dict go through get_/set_model_state_dict and
    get_/set_optimizer_state_dict(flatten_optimizer_state_dict=True)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    flat = StateDictOptions(flatten_optimizer_state_dict=True)

    class ModelWrapper:
        def state_dict(self) -> dict:
            return get_model_state_dict(model)

        def load_state_dict(self, sd: dict) -> None:
            set_model_state_dict(model, sd)

    class Optimizers:
        def state_dict(self) -> dict:
            return get_optimizer_state_dict(model, optimizer, options=flat)

        def load_state_dict(self, sd: dict) -> None:
            set_optimizer_state_dict(model, optimizer, sd, options=flat)

    return ModelWrapper(), Optimizers()
