"""Async checkpointing of training state: ``Checkpointer.save`` snapshots into reusable host
buffers and returns; the native engine persists, verifies and commits in the background."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from resilient import _C
from resilient.errors import CorruptCheckpointError, VersionMismatchError
from resilient.state import (
    StatefulState,
    decode,
    dtype_from_name,
    dtype_name,
    encode,
    is_stateful,
    tensor_paths,
)

log = logging.getLogger("resilient.checkpoint")

_VALUES_FORMAT = "resilient.state/1"


class SaveHandle:
    """A save in progress. ``wait()`` returns once the checkpoint is durable and committed."""

    def __init__(self, native: Any, step: int, keep: list | None = None):
        self._native = native
        self.step = step
        self._keep = keep  # the saved tensors, alive until the snapshot stops reading them

    def wait_snapshot(self, timeout: float | None = None) -> None:
        """Blocks until the snapshot no longer reads the saved tensors; after that they may
        change. Immediate for host tensors and for saves in "blocking" mode."""
        self._native.wait_snapshot(timeout)
        self._keep = None

    def done(self) -> bool:
        """True once the save finished (successfully or not)."""
        return self._native.done()

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until durable; raises the save's error (OSError for I/O, TimeoutError)."""
        self._native.wait(timeout)

    def stats(self) -> dict[str, float]:
        """Seconds from the save call: snapshot_s, written_s, durable_s; bytes, stored_bytes."""
        return self._native.stats()


@dataclass
class LoadReport:
    """What the last load() did: the step it restored and the newer steps it skipped, with why."""

    step: int | None = None
    skipped: list[tuple[int, str]] = field(default_factory=list)


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def tensor_descriptor(
    name: str, t: torch.Tensor, keep: list[torch.Tensor], streams: dict | None = None
) -> dict[str, Any]:
    """The buffer descriptor the native engine reads: pointer, bytes, dtype, shape, device.

    Called once per tensor inside save(), so the common case (a dense, contiguous CPU or CUDA
    tensor) takes as few calls into torch as possible.
    """
    device = t.device
    if t.layout != torch.strided or device.type not in ("cpu", "cuda"):
        raise TypeError(f"tensor {name!r}: {t.layout} tensors on {device} cannot be saved")
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    keep.append(t)
    dtype = t.dtype
    dname = _DTYPE_NAMES.get(dtype)
    if dname is None:
        dname = _DTYPE_NAMES[dtype] = dtype_name(dtype)
    desc = {
        "name": name,
        "dtype": dname,
        "shape": t.shape,
        "ptr": t.data_ptr(),
        "nbytes": t.nbytes,
        "device": -1,
    }
    if device.type == "cuda":
        # The engine copies on its own stream, ordered after the stream that produced the tensor;
        # `keep` holds a reference so the caching allocator cannot reuse the memory meanwhile.
        index = device.index
        desc["device"] = index
        streams = {} if streams is None else streams  # one lookup per device and save
        stream = streams.get(index)
        if stream is None:
            stream = streams[index] = torch.cuda.current_stream(device).cuda_stream
        desc["stream"] = stream
    return desc


class Checkpointer:
    """Saves and restores training state under ``root``.

    Args:
        root: checkpoint directory (one sub-directory per step).
        keep: committed checkpoints kept; older ones are deleted in the background (<= 0: all).
        zstd_level: compress each chunk with zstd at this level (0: off).
        chunk_bytes: checksum/compression unit (default 16 MiB, RESILIENT_CHUNK_BYTES).
        pool_bytes: host buffer budget (default half of RAM, RESILIENT_POOL_BYTES).
        io_uring, o_direct, pin_memory: "auto", "on" or "off" (RESILIENT_IO_URING, ...).
        timeout: seconds any single blocking engine step may take (RESILIENT_CKPT_TIMEOUT_S).
        options: any further _C.CheckpointOptions fields by name (queue_depth, request_bytes...).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        keep: int = 3,
        *,
        zstd_level: int | None = None,
        chunk_bytes: int | None = None,
        pool_bytes: int | None = None,
        io_uring: str | None = None,
        o_direct: str | None = None,
        pin_memory: str | None = None,
        timeout: float | None = None,
        **options: Any,
    ):
        self.root = os.fspath(root)
        opts = _C.CheckpointOptions(self.root)
        opts.keep = keep
        given = dict(
            zstd_level=zstd_level,
            chunk_bytes=chunk_bytes,
            pool_bytes=pool_bytes,
            io_uring=io_uring,
            o_direct=o_direct,
            pin_memory=pin_memory,
            timeout_s=timeout,
            **options,
        )
        for key, value in given.items():
            if value is None:
                continue
            if not hasattr(opts, key):
                raise TypeError(f"unknown checkpoint option {key!r}")
            setattr(opts, key, value)
        self.options = opts
        self._native = _C.Checkpointer(opts)
        self._in_snapshot: SaveHandle | None = None
        self._fenced: list[SaveHandle] = []
        self.last_load = LoadReport()

    # -- saving ---------------------------------------------------------------------------
    def save(self, step: int, state: Any, mode: str = "blocking") -> SaveHandle:
        """Snapshots `state` and returns while it is written in the background.

        mode "blocking": when this returns, the tensors in `state` may be modified (for CUDA
        tensors it waits for the device-to-host copies). mode "overlap": returns as soon as the
        copies are queued on the engine's streams; the tensors must not change until
        ``wait_snapshot()`` (the hook installed by ``attach(optimizer)`` calls it before the next
        ``optimizer.step()``). Raises TypeError for values that cannot be stored without pickle.
        """
        self.wait_snapshot()  # a previous overlapped snapshot must finish before a new one
        enc = encode(state)
        keep: list[torch.Tensor] = []
        streams: dict = {}
        descs = [tensor_descriptor(name, t, keep, streams) for name, t in enc.tensors.items()]
        values = json.dumps({"format": _VALUES_FORMAT, "state": enc.doc}, allow_nan=False)
        native = self._native.save(int(step), descs, values, True, mode)
        handle = SaveHandle(native, int(step), keep if mode == "overlap" else None)
        if mode == "overlap":
            self._in_snapshot = handle
        return handle

    def wait_snapshot(self, timeout: float | None = None) -> None:
        """Waits until the last overlapped save no longer reads the saved tensors."""
        handle, self._in_snapshot = self._in_snapshot, None
        if handle is not None:
            handle.wait_snapshot(timeout)

    def fence(self) -> None:
        """Orders the next GPU work after the last overlapped snapshot, without blocking.

        Each CUDA device's current stream waits (on the device) for the snapshot's copies, so
        kernels queued afterwards - the optimizer step - cannot change what is being copied,
        while the host keeps queueing work. The saved tensors stay referenced until the save
        completes. Host-only snapshots need nothing (their copies are done when save returns).
        """
        handle, self._in_snapshot = self._in_snapshot, None
        if handle is None:
            return
        devices = {t.device for t in handle._keep or () if t.device.type == "cuda"}
        for device in devices:
            handle._native.fence_stream(torch.cuda.current_stream(device).cuda_stream)
        self._fenced.append(handle)  # keeps the tensors alive until the copies complete
        self._fenced = [h for h in self._fenced if not h.done()]

    def attach(self, optimizer: torch.optim.Optimizer) -> Any:
        """Makes `optimizer.step()` ordered after an overlapped snapshot (``fence()``), so a
        checkpoint taken in "overlap" mode holds exactly the saved step's values, without
        blocking the training thread. Returns the hook handle."""
        return optimizer.register_step_pre_hook(lambda *_: self.fence())

    def wait(self, timeout: float | None = None) -> None:
        """Waits for every save in flight; raises the first failure."""
        self._native.wait_all(timeout)

    # -- loading --------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return list(self._native.steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def load(self, state: Any, step: int | None = None) -> int | None:
        """Restores `state` in place from `step`, or from the newest checkpoint that verifies.

        Tensors are copied into the tensors already in `state` (dtype and shape must match, else
        ValueError naming the tensor); Stateful objects get load_state_dict(); plain values are
        replaced. Returns the step restored, or None when there is no checkpoint. Without `step`,
        checkpoints that fail verification are skipped (logged, and listed in ``last_load``);
        CorruptCheckpointError if none verifies. If every candidate fails, tensors in `state`
        may hold partially restored data.
        """
        steps = self.steps()
        if step is not None:
            if step not in steps:
                raise FileNotFoundError(f"no committed checkpoint for step {step} in {self.root}")
            self._load_step(state, step)
            self.last_load = LoadReport(step=step)
            return step
        skipped: list[tuple[int, str]] = []
        for s in reversed(steps):
            try:
                self._load_step(state, s)
            except (CorruptCheckpointError, VersionMismatchError, FileNotFoundError) as e:
                log.warning("skipping checkpoint step %d: %s", s, e)
                skipped.append((s, str(e)))
                continue
            self.last_load = LoadReport(step=s, skipped=skipped)
            return s
        self.last_load = LoadReport(step=None, skipped=skipped)
        if skipped:
            detail = "; ".join(f"step {s}: {why}" for s, why in skipped)
            raise CorruptCheckpointError(f"no checkpoint in {self.root} verifies: {detail}")
        return None

    def verify(self, step: int) -> None:
        """Reads every chunk of `step` and checks its checksum; raises CorruptCheckpointError."""
        self._native.verify(self._native.manifest(step))

    def _load_step(self, state: Any, step: int) -> None:
        manifest = self._native.manifest(step)
        values = json.loads(manifest.values_json)
        if not isinstance(values, dict) or values.get("format") != _VALUES_FORMAT:
            raise VersionMismatchError(
                f"step {step}: values format {values.get('format')!r} unknown"
            )
        doc = values["state"]
        entries = {e["name"]: e for e in manifest.tensors()}
        live = tensor_paths(doc, state)
        resolved: dict[str, torch.Tensor] = {}
        targets: list[dict[str, Any]] = []
        copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, entry in entries.items():
            dtype = dtype_from_name(entry["dtype"])
            shape = tuple(entry["shape"])
            target = live.get(name)
            if isinstance(target, torch.Tensor) or _is_ndarray(target):
                t = target if isinstance(target, torch.Tensor) else torch.from_numpy(target)
                if t.dtype != dtype or tuple(t.shape) != shape:
                    raise ValueError(
                        f"tensor {name!r}: checkpoint has {entry['dtype']}{list(shape)}, "
                        f"the target has {dtype_name(t.dtype)}{list(t.shape)}"
                    )
                if t.device.type in ("cpu", "cuda") and t.is_contiguous() and not t.is_conj():
                    dst = t
                else:
                    dst = torch.empty(shape, dtype=dtype)
                    copy_back.append((t, dst))
                resolved[name] = target if isinstance(target, torch.Tensor) else t
            else:
                dst = torch.empty(shape, dtype=dtype)
                resolved[name] = dst
            device = dst.device.index if dst.device.type == "cuda" else -1
            targets.append(
                {"name": name, "ptr": dst.data_ptr(), "nbytes": entry["nbytes"], "device": device}
            )
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # no kernel may still use a tensor the engine overwrites
        with torch.no_grad():
            self._native.read(manifest, targets)
            for t, src in copy_back:
                t.copy_(src)
        restored = decode(doc, lambda kind, name: resolved[name])
        _merge(state, restored)

    def close(self, timeout: float | None = None) -> None:
        """Waits for saves in flight (raising their error) and releases the engine."""
        if self._native is not None:
            try:
                self._native.close(timeout)
            finally:
                self._native = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def io_backend(self) -> str:
        """ "io_uring" or "threads"."""
        return self._native.io_backend


def _is_ndarray(x: Any) -> bool:
    import numpy as np

    return isinstance(x, np.ndarray)


def _merge(target: Any, value: Any) -> Any:
    """Puts `value` into `target` in place where possible; returns what belongs at this spot."""
    if isinstance(value, StatefulState):
        if is_stateful(target):
            target.load_state_dict(value.state_dict)
            return target
        return value.state_dict
    if isinstance(target, dict) and isinstance(value, dict):
        for k, v in value.items():
            target[k] = _merge(target.get(k), v)
        return target
    if isinstance(target, list) and isinstance(value, list) and len(target) == len(value):
        for i, v in enumerate(value):
            target[i] = _merge(target[i], v)
        return target
    if (
        _is_ndarray(target)
        and _is_ndarray(value)
        and target.shape == value.shape
        and target.dtype == value.dtype
    ):
        if target.flags.writeable:
            target[...] = value
            return target
    return value
