"""ResilientStager: dcp.async_save's stager into the engine's reusable host pool.

dcp.async_save first *stages* the state (a copy that training may not change), then writes the
copy in the background. torch's DefaultStager allocates a new copy per save unless told to cache.

Bound to a ResilientStorageWriter (``ResilientStager(writer)``), the stager copies every tensor
straight into the host pool of the writer's native engine: the slabs the engine writes from
(pinned when CUDA is available, so device-to-host copies run at full speed; reused across saves;
each goes back to the pool as soon as its bytes are on their way to storage). The state is held
once on the host, and write_data writes the staged bytes without copying them again. What the
stager hands to DCP's planner are placeholders: meta tensors (DTensors over meta local tensors)
with the shapes and dtypes of the staged ones, which the writer maps back to its staged bytes.
Only that writer, in this process, can write them (async_checkpointer_type THREAD, the default);
any other writer fails on the meta tensors rather than writing wrong bytes.

Unbound (``ResilientStager()``), there is no engine yet: the stager copies into torch host buffers
it keeps, one per tensor path, reallocated only when a shape or dtype changes. The caller must
wait for the previous async_save's future before the next stage, as torchtitan does.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from resilient.checkpoint.dcp_storage import ResilientStorageWriter
from resilient.checkpoint.dtensor import is_dtensor


class ResilientStager(AsyncStager):
    """dcp.async_save's stager. stage() returns once every copy is complete, so training may
    change the state as soon as async_save returns.

    Args:
        writer: the ResilientStorageWriter the saves go to: stage into its engine's host pool
            (waiting at most the writer's timeout for free slabs). None: stage into host
            buffers of this stager's own, kept across saves.
        pin_memory: for the stager's own buffers (no writer): pinned; default: when CUDA is
            available. The engine's pool pins by its own option (``pin_memory`` of the writer's
            options, docs/SETTINGS.md).
    """

    _synchronize_after_execute = False

    def __init__(self, writer: ResilientStorageWriter | None = None,
                 pin_memory: bool | None = None):
        self.writer = writer
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self.allocations = 0  # own buffers allocated so far (reuse keeps it constant)
        self._buffers: dict[tuple, torch.Tensor] = {}

    @property
    def buffer_bytes(self) -> int:
        """Host bytes this stager holds: its own buffers, or the writer's pool."""
        if self.writer is not None:
            return self.writer.pool_allocated_bytes
        return sum(b.nbytes for b in self._buffers.values())

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self.writer is None:
            cuda = [False]
            staged = self._stage(state_dict, (), cuda, self._copy, [])
            if cuda[0]:
                torch.cuda.synchronize()
            return staged
        tensors: list[torch.Tensor] = []
        placeholders: list[torch.Tensor] = []

        def to_pool(t: torch.Tensor, path: tuple, cuda: list) -> torch.Tensor:
            tensors.append(t.detach())
            placeholders.append(torch.empty(t.shape, dtype=t.dtype, device="meta"))
            return placeholders[-1]

        made: list[torch.Tensor] = []  # what the staged state holds: placeholders or DTensors
        staged = self._stage(state_dict, (), [False], to_pool, made)
        self.writer.stage_tensors(tensors, placeholders, made)
        return staged

    def _stage(self, value: Any, path: tuple, cuda: list, copy_tensor: Any,
               made: list) -> Any:
        if isinstance(value, torch.Tensor):
            if is_dtensor(value):
                from torch.distributed.tensor import DTensor

                local = copy_tensor(value.to_local(), path, cuda)
                out = DTensor.from_local(local, value.device_mesh, value.placements,
                                         run_check=False, shape=value.shape,
                                         stride=value.stride())
            else:
                out = copy_tensor(value, path, cuda)
            made.append(out)
            return out
        if isinstance(value, dict):
            out = {k: self._stage(v, (*path, k), cuda, copy_tensor, made)
                   for k, v in value.items()}
            return out if type(value) is dict else type(value)(out)
        if isinstance(value, list):
            return [self._stage(v, (*path, i), cuda, copy_tensor, made)
                    for i, v in enumerate(value)]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(self._stage(v, (*path, i), cuda, copy_tensor, made)
                         for i, v in enumerate(value))
        return copy.deepcopy(value)

    def _copy(self, t: torch.Tensor, path: tuple, cuda: list) -> torch.Tensor:
        t = t.detach()
        key = (path, tuple(t.shape), t.dtype)
        buf = self._buffers.get(key)
        if buf is None:
            self._buffers = {k: b for k, b in self._buffers.items() if k[0] != path}
            buf = torch.empty(t.shape, dtype=t.dtype,
                              pin_memory=self.pin_memory and t.device.type == "cuda")
            self._buffers[key] = buf
            self.allocations += 1
        non_blocking = t.device.type == "cuda" and buf.is_pinned()
        cuda[0] = cuda[0] or t.device.type == "cuda"
        buf.copy_(t, non_blocking=non_blocking)
        return buf

    def synchronize_staging(self) -> None:
        """Nothing to wait for: stage() returns once the copies are done."""

    def close(self) -> None:
        self._buffers = {}
