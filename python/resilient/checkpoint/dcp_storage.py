"""torch.distributed.checkpoint (DCP) storage through resilient's engine (docs/dcp.md).

``dcp.save(state, storage_writer=ResilientStorageWriter(path))`` and
``dcp.load(state, storage_reader=ResilientStorageReader(path))``: DCP's planners decide what
each rank writes and reads (deduplication, resharding); resilient stores it.

Where. ``path`` (or the ``checkpoint_id`` given to dcp.save/dcp.load) is a checkpoint root
(docs/FORMAT.md): each dcp.save commits one more step (the newest committed step + 1; 0 in a new
root). A path whose last component is ``step-<digits>`` names that step of its parent root:
``dcp.save(..., checkpoint_id="/ckpt/step-100")`` commits ``/ckpt/step-000000000100`` (the
directory name always has 12 digits; "step-100" and "step-000000000100" are the same step), so
the ``<folder>/step-<N>`` naming of torchtitan and Lightning keeps working. A load of a root reads
the newest step of its current lineage; of a step path, that step.

Writing. Rank 0 (DCP's coordinator) picks the step and a save id in prepare_global_plan, takes
the root's writer lock and removes a dead save's leftover of that step; the step and id reach
every rank in its plan's storage_data. In write_data each rank hands its items to its native
engine: a tensor item (a whole tensor or a chunk of a DTensor/ShardedTensor) is stored as the
piece ``S/<fqn>#@<chunk offsets>`` of its global tensor, a bytes item (a non-tensor value, which
DCP's planner serialized) as the uint8 piece ``S/<fqn>#@0``, opaque: resilient never unpickles
it. The engine writes the rank's data file and shard manifest into ``root/.tmp-step-N/`` with
io_uring, a checksum per chunk, and fsync; write_data returns once they are durable. finish()
(rank 0, after every rank's write_data returned) writes DCP's Metadata as JSON
(dcp_metadata.py, ``dcp-metadata.json``, checksummed), the lineage record, then commits the
step with the crash-consistent protocol of commit.cpp (merged sealed manifest, fsync, rename):
a process killed at any point before the rename leaves only a ``.tmp-`` directory, and every
previously committed step loads as before.

The step is also a resilient checkpoint: rank 0's values document holds each FQN's tensor where
DCP's planner found it in the state (its flattening mappings; flat by FQN without them), bytes
items as uint8 tensors, so ``resilient ckpt ls/show/verify/diff/export`` (``--key model``),
``Checkpointer.read_global`` and ``Checkpointer(root).load({"model": model}, strict=False)`` read
it. verify also checks the metadata record's checksum.

Reading. read_metadata parses the step's sealed manifest and the metadata record (checksum,
closed set of types: a hostile record is CorruptCheckpointError); storage_data is each chunk's
entry name, a function of its FQN and offsets. read_data reads the saved chunks each ReadItem
needs through the engine (every chunk's checksum verified; a flipped byte is
CorruptCheckpointError naming the data file and offset), straight into the planner's target
when it is a whole contiguous chunk, else through a host buffer.

Staging for dcp.async_save is dcp_stager.ResilientStager. Bound to a writer, it stages into
the host pool that all of the writer's engines share (stage_tensors); write_data then hands the
staged bytes to the engine as they are (save_staged), and the engine writes them without
another copy.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import shutil
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from resilient import _C, settings
from resilient.checkpoint import dcp_metadata
from resilient.checkpoint import root as roots
from resilient.checkpoint.checkpointer import RANK_FORMAT, tensor_descriptor
from resilient.checkpoint.dtensor import is_dtensor
from resilient.checkpoint.plan import Saved, ShardSpec
from resilient.checkpoint.reader import Reader
from resilient.errors import CheckpointNotFoundError, CorruptCheckpointError

_STEP = re.compile(r"^step-(\d{1,19})$")


def locate(path: str | os.PathLike) -> tuple[str, int | None]:
    """(root, step) of a checkpoint_id: ``<root>/step-<digits>`` is that step of <root>;
    anything else is a root (step None: the next step for a save, the newest for a load)."""
    path = os.path.normpath(os.fspath(path))
    m = _STEP.match(os.path.basename(path))
    if m is not None and int(m.group(1)) < 2**63:
        return os.path.dirname(path) or ".", int(m.group(1))
    return path, None


def _engine(root: str, rank: int = 0, world_size: int = 1, options: dict | None = None,
            share_pool_with: Any = None) -> Any:
    opts = _C.CheckpointOptions(root)
    opts.keep = 0  # retention is the writer's (roots.apply_retention), or the framework's
    opts.rank, opts.world_size = rank, world_size
    for key, value in (options or {}).items():
        if value is None:
            continue
        if not hasattr(opts, key):
            raise TypeError(f"unknown checkpoint option {key!r}")
        setattr(opts, key, value)
    return _C.Checkpointer(opts, share_pool_with)


@dataclass(frozen=True)
class _SaveInfo:
    """What rank 0 decided for one save; travels to every rank in its plan's storage_data."""

    root: str
    step: int
    save_id: str
    world_size: int
    fqns: tuple[str, ...] = ()  # rank 0's plan only: every FQN of the save (its values)
    paths: tuple = ()  # rank 0's plan only: (FQN, its key path in the state) from the planner


@dataclass
class _Staged:
    """Tensors a ResilientStager copied into the writer's pool for one save: the native staging,
    and each placeholder's storage key -> its tensor's index in the staging."""

    state: Any  # _C.StagedState
    index: dict[int, int]
    held: list = field(default_factory=list)  # the placeholders' storages: no key is reused
    kinds: list = field(default_factory=list)  # each staged tensor's (shape, dtype)


def _storage_key(t: torch.Tensor) -> int:
    """A placeholder's identity, shared by its views (DTensor.to_local, view_as)."""
    return t.untyped_storage()._cdata


@dataclass(frozen=True)
class _Stored:
    """A WriteResult's storage_data: the item's manifest entry and the save it belongs to (how
    finish() finds its save when async saves of one writer overlap)."""

    entry: str
    save_id: str


def _state_doc(fqns: list[str], paths: dict[str, tuple] | None = None) -> Any:
    """Rank 0's values document (docs/FORMAT.md notation): each FQN's tensor where DCP's
    planner found it in the state (`paths`: the planner's FQN -> key path mappings), so that
    the step reads like any other (``Checkpointer.load({"model": model})``, ``resilient ckpt
    export --key model``); flat, FQN -> tensor, without mappings that cover every FQN."""
    paths = paths or {}
    tree: dict = {}
    try:
        for f in fqns:
            path = paths[f]
            if not isinstance(path, (tuple, list)):
                raise TypeError(f)  # not DefaultSavePlanner's mapping: keep it flat
            node = tree
            for c in path[:-1]:
                node = node.setdefault(c, {})
                if not isinstance(node, dict):
                    raise KeyError(f)  # a value that is also a prefix: keep it flat
            if not path or path[-1] in node:
                raise KeyError(f)
            node[path[-1]] = f
    except (KeyError, TypeError):
        tree = {f: f for f in fqns}

    def doc(node: Any) -> Any:
        if isinstance(node, str):
            return {"$tensor": node}
        keys = list(node)
        if keys and all(type(k) is int for k in keys) and sorted(keys) == list(range(len(keys))):
            return [doc(node[i]) for i in range(len(keys))]
        if all(isinstance(k, str) and not k.startswith("$") for k in keys) and keys == sorted(keys):
            return {k: doc(v) for k, v in node.items()}
        return {"$dict": [[k, doc(v)] for k, v in node.items()]}

    return doc(tree)


class ResilientStorageWriter(StorageWriter):
    """A DCP StorageWriter that commits each save as one step of a resilient root.

    Args:
        path: the root, or ``<root>/step-<N>`` for step N (dcp.save's checkpoint_id replaces it).
        keep: after a commit, keep the newest `keep` steps of the root's lineage (<= 0: all,
            the default: frameworks built on DCP usually delete old checkpoints themselves).
        timeout: seconds a rank's write may take (default RESILIENT_DIST_TIMEOUT_S).
        options: engine options (zstd_level, chunk_bytes, pool_bytes, io_uring, o_direct ...:
            docs/SETTINGS.md).
    """

    def __init__(self, path: str | os.PathLike, *, keep: int = 0, timeout: float | None = None,
                 **options: Any):
        super().__init__()
        self.path = os.fspath(path)
        self.keep = int(keep)
        self.timeout = float(settings.get("RESILIENT_DIST_TIMEOUT_S") if timeout is None
                             else timeout)
        self.options = options
        self.rank = 0
        self.is_coordinator = True
        self.save_id = uuid.uuid4().hex
        self.last_step: int | None = None  # the step the last finished save committed
        self._info: _SaveInfo | None = None  # this rank's last save
        self._pending: dict[str, tuple[_SaveInfo, float]] = {}  # rank 0: saves not finished
        # _pending and the lock: async saves plan and finish on other threads; commits happen
        # in planning order (the lineage's order), one at a time.
        self._mutex = threading.Condition()
        self._engines: dict[tuple, Any] = {}
        self._lock: roots.WriterLock | None = None
        self._staged: dict[int, _Staged] = {}  # placeholder storage key -> its staging

    # -- the StorageWriter protocol -------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        root, _ = locate(checkpoint_id)
        return roots.is_root(root) or not os.path.exists(root)

    def storage_meta(self) -> StorageMeta | None:
        self.save_id = uuid.uuid4().hex  # DCP asks once per save, on every rank
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise ValueError("ResilientStorageWriter commits one step for all ranks and needs "
                             "dcp.save's collectives (use_collectives=True)")
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)
        self._info = None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Rank 0: the step, the save id, the root made and locked, a dead save's leftover of
        the step removed (before any rank writes: they write after this plan reaches them)."""
        root, step = locate(self.path)
        with self._mutex:  # two async saves of this writer: one creates the root, then the other
            roots.ensure_root(root)
            if self._lock is None or self._lock.root != os.path.realpath(root):
                if self._pending:
                    raise ValueError("a save of this writer to another root is still in flight")
                self._release()
                self._lock = roots.WriterLock(root)
            self._lock.acquire()
            busy = self._in_flight(root)
            if step is None:
                steps = list(_C.committed_steps(root))
                step = max([*steps, *busy], default=-1) + 1
            elif step in busy:
                raise ValueError(f"a save of step {step} of {root} by this writer is still in "
                                 "flight (wait for its future before saving the step again)")
            fqns = tuple(sorted({item.index.fqn for p in plans for item in p.items}))
            paths: dict[str, tuple] = {}
            for p in plans:  # DefaultSavePlanner's mappings: FQN -> its key path in the state
                if isinstance(p.planner_data, dict):
                    paths.update(p.planner_data)
            info = _SaveInfo(root, step, f"dcp-{uuid.uuid4().hex}", len(plans), fqns,
                             tuple(paths.items()))
            self._pending[info.save_id] = (info, time.monotonic())
        tmp = roots.tmp_dir(root, step)
        if os.path.islink(tmp):
            os.unlink(tmp)
        elif os.path.exists(tmp):
            shutil.rmtree(tmp)
        return [replace(p, storage_data=info if i == 0 else replace(info, fqns=(), paths=()))
                for i, p in enumerate(plans)]

    def _in_flight(self, root: str) -> set[int]:
        """Rank 0: steps of `root` whose save this writer planned and has not finished (a save
        that failed on another rank never reaches finish(): forgotten after `timeout`)."""
        now = time.monotonic()
        self._pending = {k: v for k, v in self._pending.items() if now - v[1] < self.timeout}
        return {info.step for info, _ in self._pending.values() if info.root == root}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Stores this rank's items through its native engine; returns once they are durable.
        Items a ResilientStager staged into the pool are written from there, without a copy;
        the staging is released whatever happens (written, or back to the pool on an error)."""
        info = plan.storage_data
        if not isinstance(info, _SaveInfo):
            raise ValueError("the save plan was not prepared by a ResilientStorageWriter")
        self._info = info
        met: list[_Staged] = []  # the stagings this save's items came from
        try:
            results = self._write(plan, planner, info, met)
        except BaseException:
            with self._mutex:  # rank 0: this save never commits; a later one need not wait
                if self._pending.pop(info.save_id, None) is not None:
                    self._mutex.notify_all()
            raise
        finally:
            for record in met:
                self._drop_staged(record)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write(self, plan: SavePlan, planner: SavePlanner, info: _SaveInfo,
               met: list[_Staged]) -> list[WriteResult]:
        others: list[tuple] = []  # (entry, tensor, global shape, offset): copied by the engine
        kept: list[tuple] = []  # (index in the staging, entry, global shape, offset)
        results: list[WriteResult] = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else \
                    torch.empty(0, dtype=torch.uint8)
                gshape, offset = [t.numel()], [0]
            else:
                t = data.detach()
                if is_dtensor(t):
                    t = t.to_local()
                chunk = item.tensor_data.chunk
                gshape, offset = list(item.tensor_data.size), list(chunk.offsets)
                if tuple(t.shape) != tuple(chunk.sizes):
                    raise ValueError(f"DCP item {item.index.fqn!r}: the planner resolved a "
                                     f"{list(t.shape)} tensor for a {list(chunk.sizes)} chunk")
            name = dcp_metadata.entry_name(item.index)
            results.append(WriteResult(index=item.index, size_in_bytes=t.nbytes,
                                       storage_data=_Stored(name, info.save_id)))
            if t.device.type == "meta":
                record, index = self._staged_item(item.index.fqn, t)
                if record not in met:
                    met.append(record)
                if len(met) > 1:
                    raise ValueError("one save's items come from two stagings (stage once per "
                                     "async_save)")
                kept.append((index, name, gshape, offset))
            else:
                others.append((name, t, gshape, offset))
        keep: list[torch.Tensor] = []
        descs: list[dict[str, Any]] = []
        for name, t, gshape, offset in others:
            if met:
                t = t.cpu()  # added to the staging, which holds host bytes
            d = tensor_descriptor(name, t, keep)
            d["global_shape"], d["global_offset"] = gshape, offset
            descs.append(d)
        values = {"format": RANK_FORMAT, "save_id": info.save_id, "rank": self.rank,
                  "world_size": info.world_size, "rank_state": None,
                  "state": _state_doc(list(info.fqns), dict(info.paths)) if self.rank == 0
                  else None}
        engine = self._engine(info.root, self.rank, info.world_size)
        if not met:
            native = engine.save(info.step, descs, json.dumps(values), False, "blocking")
        else:
            native = engine.save_staged(info.step, met[0].state, kept, descs,
                                        json.dumps(values), False)
        del keep  # the engine copied every tensor before save() returned
        native.wait(self.timeout)
        return results

    def _staged_item(self, fqn: str, t: torch.Tensor) -> tuple[_Staged, int]:
        with self._mutex:
            key = _storage_key(t)
            record = self._staged.get(key)
        index = record.index[key] if record is not None else None
        if (record is None or not record.state.held
                or record.kinds[index][1] != t.dtype
                or t.numel() != math.prod(record.kinds[index][0])):
            raise ValueError(
                f"DCP item {fqn!r} is a placeholder (a meta tensor) that this writer did not "
                "stage, or whose staging was already written or dropped: a state staged by "
                "ResilientStager(writer) is written by that writer, in the process that staged "
                "it (async_save's async_checkpointer_type THREAD), once")
        return record, index

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Rank 0, after every rank's data is durable: the metadata record, the lineage record,
        the commit (crash-consistent), retention. Nothing is committed if any of it fails."""
        ids = {r.storage_data.save_id for rr in results for r in rr
               if isinstance(r.storage_data, _Stored)}
        with self._mutex:
            if not ids and self._info is not None:  # a save without items
                ids = {self._info.save_id}
            found = [self._pending.get(i) for i in ids]  # pending until committed
        if len(ids) != 1 or found[0] is None:
            raise ValueError(f"finish() of a save this writer did not plan (save ids {ids})")
        info, planned = found[0]
        with self._mutex:  # an earlier save of this writer commits first
            self._mutex.wait_for(lambda: not any(
                t < planned and i.root == info.root for i, t in self._pending.values()),
                timeout=self.timeout)
        tmp = roots.tmp_dir(info.root, info.step)
        try:
            text = dcp_metadata.encode(metadata)
            roots.write_atomic(os.path.join(tmp, dcp_metadata.FILE), text, sync_dir=False,
                               in_step=True)
            steps = list(_C.committed_steps(info.root))
            chain, lineage = roots.history(info.root, steps)
            head = None
            if chain:
                li = lineage[chain[0]]
                head = (chain[0], li.seq if isinstance(li, roots.Lineage) else None)
            roots.write_lineage(tmp, info.step, roots.max_seq(lineage) + 1,
                                roots.parent_for(lineage, head, info.step))
            _C.commit_shards(info.root, info.step, info.world_size, info.save_id)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            with self._mutex:
                self._pending.pop(info.save_id, None)
                self._mutex.notify_all()
            raise
        with self._mutex:
            self._pending.pop(info.save_id, None)
            self._mutex.notify_all()
        self.last_step = info.step
        try:
            if self.keep > 0:
                roots.apply_retention(info.root, list(_C.committed_steps(info.root)), self.keep)
            with self._mutex:
                live = {roots.tmp_dir(info.root, s) for s in self._in_flight(info.root)}
            for path in set(roots.stale_saves(info.root, time.time() + 1e9)) - live:
                trash = f".trash-{os.path.basename(path)[5:]}-{uuid.uuid4().hex[:8]}"
                os.rename(path, os.path.join(info.root, trash))
            # Freeing the space (unlinking large files) is off the save's path, as the
            # Checkpointer's purge thread does it; a .trash- directory is never read.
            threading.Thread(target=roots.purge_trash, args=(info.root,),
                             name="resilient-dcp-purge", daemon=True).start()
        finally:
            with self._mutex:
                if not self._in_flight(info.root):
                    self._release()

    # -- staging (ResilientStager) -------------------------------------------------------
    def stage_tensors(self, tensors: list[torch.Tensor], placeholders: list[torch.Tensor],
                      anchors: list[torch.Tensor]) -> None:
        """Copies `tensors` into the pool of this writer's engines (returns once every copy is
        complete); write_data writes them where it meets their `placeholders` (or views of
        them). The staging is dropped, its slabs back in the pool, if the staged state (whose
        tensors are `anchors`) is garbage-collected before a write_data took it."""
        keep: list[torch.Tensor] = []
        descs = [tensor_descriptor(str(i), t, keep) for i, t in enumerate(tensors)]
        state = self._pool_engine().stage(descs)
        del keep
        record = _Staged(state, {_storage_key(p): i for i, p in enumerate(placeholders)},
                         [p.untyped_storage() for p in placeholders],
                         [(tuple(t.shape), t.dtype) for t in tensors])
        with self._mutex:
            for key in record.index:
                self._staged[key] = record
        if anchors:
            weakref.finalize(anchors[0], self._drop_staged, record)

    def _forget(self, record: _Staged) -> None:
        with self._mutex:
            for key in record.index:
                if self._staged.get(key) is record:
                    del self._staged[key]

    def _drop_staged(self, record: _Staged) -> None:
        self._forget(record)
        record.state.release()  # no-op once save_staged took it

    def _pool_engine(self) -> Any:
        """An engine of this writer (all share one host pool), made for the current path."""
        with self._mutex:
            if self._engines:
                return next(iter(self._engines.values()))
        import torch.distributed as dist

        live = dist.is_available() and dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if live else (0, 1)
        return self._engine(locate(self.path)[0], rank, world)

    @property
    def pool_allocated_bytes(self) -> int:
        """Host bytes the engines' shared pool holds (0 before the first save or stage)."""
        engines = list(self._engines.values())
        return engines[0].pool_allocated_bytes if engines else 0

    # -- resources ------------------------------------------------------------------------
    def _engine(self, root: str, rank: int, world_size: int) -> Any:
        key = (root, rank, world_size)
        with self._mutex:
            engine = self._engines.get(key)
            if engine is None:  # one engine at a time; each shares the first one's host pool
                shared = next(iter(self._engines.values()), None)
                options = {"timeout_s": self.timeout, **self.options}
                engine = _engine(root, rank, world_size, options, shared)
                for old in self._engines.values():
                    old.close(self.timeout)
                self._engines = {key: engine}
        return engine

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()

    def close(self) -> None:
        """Releases the engine (its host memory) and the root's writer lock."""
        for engine in self._engines.values():
            engine.close(self.timeout)
        self._engines = {}
        self._release()

    def __enter__(self) -> ResilientStorageWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class ResilientStorageReader(StorageReader):
    """A DCP StorageReader of a step written by ResilientStorageWriter.

    Args:
        path: the root (its newest step of the current lineage), or ``<root>/step-<N>``
            (dcp.load's checkpoint_id replaces it).
    """

    def __init__(self, path: str | os.PathLike):
        super().__init__()
        self.path = os.fspath(path)
        self.step: int | None = None  # the step read, once read_metadata ran
        self._engine: Any = None
        self._manifest: Any = None
        self._entries: dict[str, dict] = {}
        self._metadata: Metadata | None = None
        self._root: str | None = None
        self._error: Exception | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self._metadata, self._manifest, self._error = None, None, None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        root, _ = locate(checkpoint_id)
        return roots.is_root(root)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's Metadata of the step. A failure (no such step, a corrupt or hostile record)
        is returned as an empty Metadata and raised by set_up_storage_reader() and
        read_data(): torch's loader swallows read_metadata's exceptions and would report only
        "metadata is None"; this way dcp.load's CheckpointException carries the real error."""
        if self._metadata is not None:
            return self._metadata
        try:
            return self._read_metadata()
        except Exception as e:
            self._error = e
            return Metadata(state_dict_metadata={})

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def _read_metadata(self) -> Metadata:
        self._error = None
        root, step = locate(self.path)
        if not roots.is_root(root):
            raise CheckpointNotFoundError(roots.why_not_root(root), root)
        steps = list(_C.committed_steps(root))
        if step is None:
            chain, _ = roots.history(root, steps)
            if not chain:
                raise CheckpointNotFoundError(f"no committed checkpoint in {root}", root)
            step = chain[0]
        elif step not in steps:
            raise CheckpointNotFoundError(
                f"no committed checkpoint for step {step} in {root} (it has {steps})", root)
        if self._engine is None or self._root != root:
            self._engine, self._root = _engine(root), root
        self._manifest = self._engine.manifest(step)
        self._entries = {e["name"]: e for e in self._manifest.tensors()}
        path = os.path.join(roots.step_dir(root, step), dcp_metadata.FILE)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"step {step} of {root} was not written through DCP (it has no "
                f"{dcp_metadata.FILE}); load it with resilient.Checkpointer", path) from None
        with os.fdopen(fd, "rb") as f:
            raw = f.read(dcp_metadata._MAX_BYTES + 1)
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            raise CorruptCheckpointError(f"{path}: not UTF-8", path=path) from None
        self._metadata = dcp_metadata.decode(text, path)
        self.step = step
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self._check()
        self._metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return replace(plan, storage_data=self.step)  # rank 0 checks every rank read one step

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Rank 0: every rank planned against the same step (a save that committed a newer
        one while the ranks listed the root would otherwise mix two checkpoints)."""
        steps = sorted({p.storage_data for p in plans}, key=str)
        if len(steps) > 1:
            raise ValueError(f"the ranks found different newest steps of {self.path} ({steps}: "
                             "a save committed while they looked); load an explicit step with "
                             "checkpoint_id=<root>/step-<N>")
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Reads the saved chunks the plan's items need (checksums verified) into the
        planner's targets; bytes items go to planner.load_bytes as they were saved."""
        self._check()
        if self._manifest is None:
            self._read_metadata()
        reader = Reader(self._engine, self._manifest, self._entries)
        pending = []
        for item in plan.items:
            name = dcp_metadata.entry_name(item.storage_index)
            e = self._entries.get(name)
            if e is None:
                raise CorruptCheckpointError(
                    f"step {self.step}: DCP item {item.storage_index.fqn!r} (entry {name!r}) has "
                    "no data in the manifest")
            shape = tuple(e["shape"])
            saved = [Saved(name, e["dtype"], shape, shape, tuple(0 for _ in shape))]
            if item.type == LoadItemType.BYTE_IO:
                pending.append((item, reader.want(name, None, e["dtype"], shape, None, saved),
                                None))
                continue
            target = planner.resolve_tensor(item).detach()
            lengths = tuple(int(x) for x in item.lengths)
            if tuple(target.shape) != lengths:
                raise ValueError(f"DCP item {item.dest_index.fqn!r}: the planner resolved a "
                                 f"{list(target.shape)} target for {list(lengths)} elements")
            spec = ShardSpec(shape, tuple(int(x) for x in item.storage_offsets), lengths)
            same = (e["dtype"] == str(target.dtype).removeprefix("torch.")
                    and target.device.type in ("cpu", "cuda"))
            w = reader.want(name, target if same else None, e["dtype"], lengths, spec, saved)
            pending.append((item, w, target))
        reader.run()
        for item, w, target in pending:
            if target is None:
                planner.load_bytes(item, io.BytesIO(w.out.numpy().tobytes()))
                continue
            if w.out is not target:
                with torch.no_grad():
                    target.copy_(w.out)
            planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close(None)
            self._engine = None
