"""ResilientStager: dcp.async_save's stager into host buffers kept across saves.

dcp.async_save first *stages* the state (a copy that training may not change), then writes the
copy in the background. torch's DefaultStager allocates a new copy per save unless told to cache;
this stager keeps one buffer per tensor path and refills it at every save (pinned host memory
when CUDA is available, so device-to-host copies run at full speed and without blocking; a
plain host buffer on a CPU-only machine), reallocating only when a shape or dtype changes.

A buffer must not be refilled while the previous save still reads it. Bound to the
ResilientStorageWriter the saves go to, a stage waits until that writer's previous write_data
has handed the tensors to its engine (which copies them into its own pool before write_data
waits for the disk). The engine's own pinned pool is native and not reachable from Python, so
the staged copy lives in torch-allocated buffers.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from resilient.checkpoint.dcp_storage import ResilientStorageWriter
from resilient.checkpoint.dtensor import is_dtensor


class ResilientStager(AsyncStager):
    """dcp.async_save's stager: copies the state into host buffers kept across saves (pinned
    when CUDA is available), one per tensor path, reallocated only when a shape or dtype
    changes. DTensors are staged as DTensors over their staged local tensor.

    Args:
        writer: the ResilientStorageWriter the saves go to; a stage then waits (at most
            `timeout` seconds) until that writer's previous save no longer reads the buffers.
            Without one, wait for the previous async_save's future before the next stage, as
            torchtitan does.
        pin_memory: default: when CUDA is available.
    """

    _synchronize_after_execute = False

    def __init__(self, writer: ResilientStorageWriter | None = None,
                 pin_memory: bool | None = None, timeout: float = 600.0):
        self.writer = writer
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self.timeout = timeout
        self.allocations = 0  # buffers allocated so far (reuse keeps it constant)
        self._buffers: dict[tuple, torch.Tensor] = {}

    @property
    def buffer_bytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self.writer is not None:
            if not self.writer.acquire_staging(self.timeout):
                raise TimeoutError(f"the previous save still reads the staging buffers after "
                                   f"{self.timeout} s")
        cuda = [False]
        try:
            staged = self._stage(state_dict, (), cuda)
        except BaseException:
            if self.writer is not None:
                self.writer.release_staging()
            raise
        if cuda[0]:
            torch.cuda.synchronize()
        return staged

    def _stage(self, value: Any, path: tuple, cuda: list) -> Any:
        if isinstance(value, torch.Tensor):
            if is_dtensor(value):
                from torch.distributed.tensor import DTensor

                local = self._copy(value.to_local(), path, cuda)
                return DTensor.from_local(local, value.device_mesh, value.placements,
                                          run_check=False, shape=value.shape,
                                          stride=value.stride())
            return self._copy(value, path, cuda)
        if isinstance(value, dict):
            out = {k: self._stage(v, (*path, k), cuda) for k, v in value.items()}
            return out if type(value) is dict else type(value)(out)
        if isinstance(value, list):
            return [self._stage(v, (*path, i), cuda) for i, v in enumerate(value)]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(self._stage(v, (*path, i), cuda) for i, v in enumerate(value))
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
