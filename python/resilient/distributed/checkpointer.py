"""Sharded, fully parallel checkpoints of a torch.distributed job.

Saving. Every rank calls ``save(step, state, rank_state)`` together. ``state`` is what data-parallel
replicas hold in common (model, optimizer, scheduler); tensors may be slices of global tensors
(Megatron tensor parallelism, described by ShardSpec). ``rank_state`` is private to the rank (RNG
streams, sampler position). A tiny all-gather over a CPU (gloo) group lets every rank compute the
same write plan (plan.plan_writes): each distinct piece of replicated state is written once in
total, spread evenly over the ranks that hold it. Each rank snapshots its pieces and returns;
its native engine writes its own shard in parallel with the others into root/.tmp-step-N/
(commit=False).

Committing (background thread, per rank, in save order): wait for the local shard to be durable,
report "ok" or the error under a key of the job's torch.distributed store. Rank 0 waits for every
rank's report, then calls the native commit_shards(), which validates the rank manifests (all from
this save: the save id) and commits one global manifest with the crash-consistent protocol of
commit.cpp. Rank 0 publishes the outcome; every rank's handle.wait() returns or raises it. Any
failure or timeout on any rank means no commit: the previous checkpoint is untouched.

Loading. Each rank reads, directly from the shared checkpoint directory and in parallel, exactly
the saved pieces that overlap the tensors it holds (plan.plan_reads), and copies the overlaps into
place. Reading what you need from the shared files (rather than reading 1/N and redistributing
over the process group) needs no collective per tensor, works for any change of data- or
tensor-parallel layout, and on one host is served by the page cache; it is the right choice on a
shared file system, which checkpoints of multi-host jobs live on anyway.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import uuid
from datetime import timedelta
from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.distributed as dist

from resilient import _C
from resilient.checkpoint import Checkpointer, _is_ndarray, _merge, tensor_descriptor
from resilient.distributed.plan import (
    Held,
    Saved,
    ShardSpec,
    piece_name,
    plan_writes,
    split_piece_name,
)
from resilient.distributed.restore import _Reader
from resilient.errors import CorruptCheckpointError, ResilientError, VersionMismatchError
from resilient.state import decode, dtype_name, encode, tensor_paths

log = logging.getLogger("resilient.distributed")

FORMAT = "resilient.sharded/1"
_RANK_FORMAT = "resilient.sharded-rank/1"


class CheckpointCommitError(ResilientError):
    """A distributed save was not committed: a rank failed or did not report in time."""


class DistSaveHandle:
    """A distributed save in flight. ``wait()`` returns once the global manifest is committed."""

    def __init__(self, step: int, native: Any, save_id: str):
        self.step = step
        self.save_id = save_id
        self._native = native
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._observed = False  # the error was raised to the caller

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until committed; raises CheckpointCommitError (the same on every rank)."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"save of step {self.step} not committed within {timeout} s")
        if self._error is not None:
            self._observed = True
            raise self._error

    def local_stats(self) -> dict[str, float]:
        """This rank's snapshot/write timings (see SaveHandle.stats)."""
        return self._native.stats()

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._event.set()


def default_store() -> Any:
    """The store of the default process group (torchrun's or init_process_group's)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


class DistributedCheckpointer:
    """Sharded checkpoints under a shared directory; one instance per rank, created collectively.

    Args:
        root: checkpoint directory, the same path (on a shared file system) on every rank.
        keep: committed checkpoints kept (rank 0 applies retention after each commit).
        specs: ShardSpec per tensor name of `state` ("model/fc1.weight"); a key ending in "/*"
            applies to tensors below it whose shape matches (optimizer state of a sharded param).
        group: a gloo process group over all ranks for planning; default: a new one.
        store: a torch.distributed Store shared by all ranks; default: the default group's.
        timeout: seconds a save may take from snapshot to commit, and the planning group's
            collectives (default 600, RESILIENT_DIST_TIMEOUT_S).
        split_bytes: replicated tensors at least this large are split by rows across replicas
            (default 1 MiB, RESILIENT_DIST_SPLIT_BYTES).
        restore: "direct" (default, RESILIENT_DIST_RESTORE): every rank reads the pieces it needs
            from the shared directory; "redistribute": rank r reads the shards of saved ranks
            s with s % world == r and broadcasts them over the gloo group (storage read once).
        options: Checkpointer options (zstd_level, io_uring, pool_bytes ...).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        keep: int = 3,
        specs: dict[str, ShardSpec] | None = None,
        group: Any = None,
        store: Any = None,
        timeout: float | None = None,
        split_bytes: int | None = None,
        restore: str | None = None,
        **options: Any,
    ):
        if not dist.is_initialized():
            raise RuntimeError(
                "DistributedCheckpointer needs torch.distributed.init_process_group() first"
            )
        self.root = os.fspath(root)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.keep = keep
        self.specs = dict(specs or {})
        if timeout is None:
            timeout = float(os.environ.get("RESILIENT_DIST_TIMEOUT_S", "600"))
        if split_bytes is None:
            split_bytes = _C.parse_bytes(os.environ.get("RESILIENT_DIST_SPLIT_BYTES", "1MiB"))
        self.timeout = float(timeout)
        self.split_bytes = int(split_bytes)
        self.restore = restore or os.environ.get("RESILIENT_DIST_RESTORE", "direct")
        if self.restore not in ("direct", "redistribute"):
            raise ValueError(f"restore must be 'direct' or 'redistribute', not {self.restore!r}")
        self._group = (
            group
            if group is not None
            else dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout))
        )
        self._store = store if store is not None else default_store()
        self._local = Checkpointer(
            self.root,
            keep=0,
            rank=self.rank,
            world_size=self.world_size,
            timeout=timeout,
            **options,
        )
        run = [uuid.uuid4().hex[:12] if self.rank == 0 else None]
        dist.broadcast_object_list(run, src=0, group=self._group)
        self._run_id: str = run[0]
        self._seq = 0
        self._plan_key: Any = None
        self._plan: list = []
        self._failed: list[DistSaveHandle] = []
        self._queue: queue.Queue[DistSaveHandle | None] = queue.Queue()
        self._thread = threading.Thread(
            target=self._commit_loop, name="resilient-commit", daemon=True
        )
        self._thread.start()
        self._closed = False

    # -- saving ---------------------------------------------------------------------------
    def save(self, step: int, state: Any, rank_state: Any = None) -> DistSaveHandle:
        """Collective. Snapshots this rank's pieces and returns; the commit runs in background."""
        step = int(step)
        enc = encode(state)
        held = [self._held(name, t) for name, t in enc.tensors.items()]
        key = (step >= 0, tuple(held))
        keys = [None] * self.world_size
        dist.all_gather_object(keys, hash(key), group=self._group)
        if keys != self._plan_key:
            everyone: list[Any] = [None] * self.world_size
            dist.all_gather_object(everyone, held, group=self._group)
            self._plan = plan_writes(everyone, self.rank, self.split_bytes)
            self._plan_key = keys
        keep: list[torch.Tensor] = []
        descs: list[dict[str, Any]] = []
        by_name = {h.name: h for h in held}
        for piece in self._plan:
            t, h = enc.tensors[piece.name], by_name[piece.name]
            offset = h.offset
            if piece.rows is not None:
                t = t.detach()[piece.rows[0] : piece.rows[1]]
                offset = (h.offset[0] + piece.rows[0], *h.offset[1:])
            d = tensor_descriptor("S/" + piece_name(piece.name, offset), t, keep)
            d["global_shape"], d["global_offset"] = list(h.global_shape), list(offset)
            descs.append(d)
        rank_doc = None
        if rank_state is not None:
            renc = encode(rank_state)
            rank_doc = renc.doc
            descs += [
                tensor_descriptor(f"R{self.rank}/{n}", t, keep) for n, t in renc.tensors.items()
            ]
        self._seq += 1
        save_id = f"{self._run_id}-{self._seq}"
        values = {
            "format": _RANK_FORMAT,
            "save_id": save_id,
            "rank": self.rank,
            "state": enc.doc,
            "rank_state": rank_doc,
        }
        native = self._local._native.save(step, descs, json.dumps(values, allow_nan=False), False)
        del keep
        handle = DistSaveHandle(step, native, save_id)
        self._queue.put(handle)
        return handle

    def _held(self, name: str, t: torch.Tensor) -> Held:
        shape = tuple(t.shape)
        spec = self.spec_for(name, shape, None)
        if spec is not None:
            spec.check(name, shape)
        gshape, offset = (
            (spec.global_shape, spec.offset) if spec else (shape, tuple(0 for _ in shape))
        )
        return Held(
            name, dtype_name(t.dtype), t.element_size(), shape, tuple(gshape), tuple(offset)
        )

    def spec_for(
        self, name: str, shape: tuple[int, ...] | None, saved_gshape: tuple | None
    ) -> ShardSpec | None:
        """The ShardSpec of tensor `name`: an exact key, else the longest matching "prefix/*" key
        whose spec fits (same local shape, or, with no live tensor, the saved global shape)."""
        spec = self.specs.get(name)
        if spec is not None:
            return spec
        best = None
        for pattern, s in self.specs.items():
            if pattern.endswith("*") and fnmatchcase(name, pattern):
                fits = (
                    tuple(s.shape) == shape
                    if shape is not None
                    else tuple(s.global_shape) == saved_gshape
                )
                if fits and (best is None or len(pattern) > len(best[0])):
                    best = (pattern, s)
        return best[1] if best else None

    def _commit_loop(self) -> None:
        while True:
            handle = self._queue.get()
            if handle is None:
                return
            if isinstance(handle, _Marker):
                handle.event.set()
                continue
            try:
                error = self._commit(handle)
            except Exception as e:  # the store itself failed (a peer or rank 0 is gone)
                error = f"coordination failed: {type(e).__name__}: {e}"
            exc = (
                None
                if error is None
                else CheckpointCommitError(
                    f"checkpoint of step {handle.step} was not committed: {error}"
                )
            )
            if exc is not None:
                self._failed.append(handle)
            handle._finish(exc)

    def _commit(self, handle: DistSaveHandle) -> str | None:
        prefix = f"resilient/ckpt/{handle.save_id}"
        timeout = timedelta(seconds=self.timeout)
        try:
            handle._native.wait(self.timeout)
            report = "ok"
        except Exception as e:
            report = f"error: rank {self.rank}: {type(e).__name__}: {e}"
        self._store.set(f"{prefix}/rank{self.rank}", report)
        if self.rank == 0:
            result = self._coordinate(handle, prefix, timeout)
            self._store.set(f"{prefix}/result", result)
        else:
            self._store.wait([f"{prefix}/result"], timeout)
            result = self._store.get(f"{prefix}/result").decode()
        return None if result == "ok" else result.removeprefix("error: ")

    def _coordinate(self, handle: DistSaveHandle, prefix: str, timeout: timedelta) -> str:
        errors = []
        for r in range(self.world_size):
            try:
                self._store.wait([f"{prefix}/rank{r}"], timeout)
                report = self._store.get(f"{prefix}/rank{r}").decode()
            except Exception as e:
                report = (
                    f"error: rank {r} did not report within {self.timeout} s ({type(e).__name__})"
                )
            if report != "ok":
                errors.append(report.removeprefix("error: "))
            try:  # keep the job's store small over thousands of saves
                self._store.delete_key(f"{prefix}/rank{r}")
            except Exception:
                pass
        if errors:
            return "error: " + "; ".join(errors)
        try:
            _C.commit_shards(self.root, handle.step, self.world_size, handle.save_id)
        except Exception as e:
            return f"error: commit failed: {type(e).__name__}: {e}"
        try:
            _C.apply_retention(self.root, self.keep)
        except Exception as e:  # a failed cleanup does not undo the commit
            log.warning("checkpoint retention failed: %s", e)
        return "ok"

    def wait(self, timeout: float | None = None) -> None:
        """Waits for this rank's saves in flight to be committed; raises the first failure not
        already raised by its handle's wait()."""
        done = threading.Event()
        self._queue.put(_Marker(done))  # type: ignore[arg-type]
        if not done.wait(timeout):
            raise TimeoutError(f"checkpoint saves still in flight after {timeout} s")
        failed, self._failed = [h for h in self._failed if not h._observed], []
        if failed:
            failed[0]._observed = True
            raise failed[0]._error

    # -- loading --------------------------------------------------------------------------
    def steps(self) -> list[int]:
        return self._local.steps()

    def load(self, state: Any, rank_state: Any = None, step: int | None = None) -> int | None:
        """Collective. Restores `state` (and `rank_state`) in place from `step`, or from the newest
        committed step that every rank loads successfully. Returns the step, or None if there is
        none. Raises ValueError naming a tensor whose saved global shape or coverage does not
        fit."""
        cand = [self.steps() if self.rank == 0 else None]
        dist.broadcast_object_list(cand, src=0, group=self._group)
        steps: list[int] = cand[0]
        if step is not None:
            if step not in steps:
                raise FileNotFoundError(f"no committed checkpoint for step {step} in {self.root}")
            steps = [step]
        skipped = []
        for s in reversed(steps):
            outcome: tuple[str, str] | None = None
            error: BaseException | None = None
            try:
                self._load_step(state, rank_state, s)
            except (CorruptCheckpointError, VersionMismatchError, FileNotFoundError, OSError) as e:
                outcome = ("skip", f"rank {self.rank}: {type(e).__name__}: {e}")
            except Exception as e:  # a real mismatch: agree, then raise it on every rank
                outcome, error = ("fatal", f"rank {self.rank}: {e}"), e
            outcomes: list[Any] = [None] * self.world_size
            dist.all_gather_object(outcomes, outcome, group=self._group)
            failed = [o for o in outcomes if o is not None]
            if not failed:
                return s
            if error is not None:
                raise error
            fatal = [msg for kind, msg in failed if kind == "fatal"]
            if fatal:
                raise ValueError(f"loading step {s} failed on another rank: {fatal[0]}")
            detail = "; ".join(msg for _, msg in failed)
            if step is not None:
                raise CorruptCheckpointError(f"step {s} failed to load: {detail}")
            log.warning("skipping checkpoint step %d: %s", s, detail)
            skipped.append(s)
        if skipped:
            raise CorruptCheckpointError(
                f"no checkpoint in {self.root} loads; tried steps {skipped}"
            )
        return None

    def _load_step(self, state: Any, rank_state: Any, step: int) -> None:
        manifest = self._local._native.manifest(step)
        values = json.loads(manifest.values_json)
        if not isinstance(values, dict) or values.get("format") != FORMAT:
            raise VersionMismatchError(
                f"step {step}: not a sharded checkpoint ({values.get('format')!r})"
            )
        ranks = values["ranks"]
        mine = ranks[self.rank] if self.rank < len(ranks) else ranks[0]
        saved: dict[str, list[Saved]] = {}
        entries = {e["name"]: e for e in manifest.tensors()}
        for e in entries.values():
            if e["name"].startswith("S/"):
                split = split_piece_name(e["name"][2:])
                if split is None:
                    raise CorruptCheckpointError(f"step {step}: bad piece name {e['name']!r}")
                shape = tuple(e["shape"])
                saved.setdefault(split[0], []).append(
                    Saved(
                        e["name"], e["dtype"], shape, tuple(e.get("global_shape", shape)), split[1]
                    )
                )
        reader = _Reader(self._local, manifest, entries)
        failure: BaseException | None = None
        try:
            resolved = self._plan_state(mine["state"], state, saved, reader)
            if rank_state is not None:
                src = self.rank
                if src >= len(ranks) or ranks[src].get("rank_state") is None:
                    raise ValueError(
                        f"rank {self.rank}: step {step} (world size {len(ranks)}) has no "
                        "per-rank state for this rank"
                    )
                rdoc = ranks[src]["rank_state"]
                rlive = tensor_paths(rdoc, rank_state)
                rresolved = {}
                for name in rlive:
                    e = entries.get(f"R{src}/{name}")
                    if e is None:
                        raise CorruptCheckpointError(
                            f"step {step}: per-rank tensor {name!r} of rank {src} missing"
                        )
                    shape = tuple(e["shape"])
                    s = Saved(e["name"], e["dtype"], shape, shape, tuple(0 for _ in shape))
                    rresolved[name] = reader.want(name, rlive[name], e["dtype"], shape, None, [s])
        except Exception as e:
            if self.restore != "redistribute":
                raise
            failure = e  # the other ranks must hear it before the collective read
        if self.restore == "redistribute":
            reader.run_redistributed(self._group, self.rank, self.world_size, failure)
        else:
            reader.run()
        restored = decode(mine["state"], lambda kind, name: resolved[name].result())
        _merge(state, restored)
        if rank_state is not None:
            _merge(rank_state, decode(rdoc, lambda kind, name: rresolved[name].result()))

    def _plan_state(
        self, doc: Any, state: Any, saved: dict[str, list[Saved]], reader: _Reader
    ) -> dict:
        live = tensor_paths(doc, state)
        out = {}
        for name, target in live.items():
            pieces = saved.get(name, [])
            if isinstance(target, torch.Tensor) or _is_ndarray(target):
                t = target if isinstance(target, torch.Tensor) else torch.from_numpy(target)
                shape, dtype = tuple(t.shape), dtype_name(t.dtype)
                spec = self.spec_for(name, shape, None)
            else:
                if not pieces:
                    raise ValueError(f"tensor {name!r} is not in the checkpoint")
                spec = self.spec_for(name, None, pieces[0].global_shape)
                shape = tuple(spec.shape) if spec else pieces[0].global_shape
                dtype = pieces[0].dtype
            if spec is not None:
                spec.check(name, shape)
            out[name] = reader.want(name, target, dtype, shape, spec, pieces)
        return out

    def close(self, timeout: float | None = None) -> None:
        """Waits for saves in flight (raising the first failure) and stops the commit thread."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait(timeout)
        finally:
            self._queue.put(None)
            self._thread.join(timeout)
            self._local.close(timeout)

    def __enter__(self) -> DistributedCheckpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Marker:
    def __init__(self, event: threading.Event):
        self.event = event
