"""Restoring sharded checkpoints: assembling each tensor a rank holds from the saved pieces
that overlap it (plan.plan_reads), either reading those pieces directly from the shared
checkpoint directory (_Reader.run) or reading each shard once and broadcasting it over a gloo
group (_Reader.run_redistributed). read_global() assembles whole global tensors in one process.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from resilient.checkpoint import Checkpointer, _is_ndarray
from resilient.distributed.plan import Saved, ShardSpec, plan_reads, split_piece_name
from resilient.errors import CorruptCheckpointError, VersionMismatchError
from resilient.state import dtype_from_name, dtype_name


class _Wanted:
    """A tensor being assembled: `result()` after the reader ran."""

    def __init__(self, name: str, target: Any, dtype: str, shape: tuple[int, ...], copies: list):
        self.name, self.target, self.copies = name, target, copies
        if isinstance(target, torch.Tensor):
            self.out = target  # assembled in place
        else:
            self.out = torch.empty(shape, dtype=dtype_from_name(dtype))

    def result(self) -> Any:
        if isinstance(self.target, torch.Tensor):
            return self.target
        return torch.from_numpy(self.target) if _is_ndarray(self.target) else self.out


class _Reader:
    """Collects the saved pieces a rank needs, reads them in one parallel native call, copies."""

    def __init__(self, local: Checkpointer, manifest: Any, entries: dict[str, dict]):
        self._local, self._manifest, self._entries = local, manifest, entries
        self._wanted: list[_Wanted] = []

    def want(
        self,
        name: str,
        target: Any,
        dtype: str,
        shape: tuple[int, ...],
        spec: ShardSpec | None,
        pieces: list[Saved],
    ) -> _Wanted:
        w = _Wanted(name, target, dtype, shape, plan_reads(name, dtype, shape, spec, pieces))
        self._wanted.append(w)
        return w

    def run(self) -> None:
        ptrs: dict[str, int] = {}  # entry -> where it is read to
        direct: set[tuple[int, int]] = set()  # (wanted, copy) read straight into the target
        for i, w in enumerate(self._wanted):
            t = w.out
            if t.device.type != "cpu" or not t.is_contiguous():
                continue
            for j, c in enumerate(w.copies):
                if c.entry not in ptrs and self._lands_whole(c, t):
                    offset = c.dst[0][0] * t.stride(0) * t.element_size() if c.dst else 0
                    ptrs[c.entry] = t.data_ptr() + offset
                    direct.add((i, j))
        buffers: dict[str, torch.Tensor] = {}
        for w in self._wanted:
            for c in w.copies:
                if c.entry not in ptrs and c.entry not in buffers:
                    e = self._entries[c.entry]
                    shape, dtype = tuple(e["shape"]), dtype_from_name(e["dtype"])
                    buffers[c.entry] = torch.empty(shape, dtype=dtype)
                    ptrs[c.entry] = buffers[c.entry].data_ptr()
        targets = [
            {"name": n, "ptr": p, "nbytes": self._entries[n]["nbytes"], "device": -1}
            for n, p in ptrs.items()
        ]
        self._local._native.read(self._manifest, targets)
        with torch.no_grad():
            for i, w in enumerate(self._wanted):
                for j, c in enumerate(w.copies):
                    if (i, j) in direct:
                        continue
                    # Each saved piece belongs to one tensor, so it is read once, here.
                    src = buffers[c.entry][tuple(slice(a, b) for a, b in c.src)]
                    w.out[tuple(slice(a, b) for a, b in c.dst)] = src
                if _is_ndarray(w.target):
                    w.target[...] = w.out.numpy()

    def run_redistributed(
        self, group: Any, rank: int, world: int, failure: BaseException | None
    ) -> None:
        """Collective: the shards of saved rank s are read by rank s % world into one flat
        buffer, broadcast over `group`, and every rank copies what it needs from them."""
        skippable = (CorruptCheckpointError, VersionMismatchError, FileNotFoundError, OSError)
        report: Any = sorted({c.entry for w in self._wanted for c in w.copies})
        if failure is not None:
            report = (isinstance(failure, skippable), f"rank {rank}: {failure}")
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, report, group=group)
        if failure is not None:
            raise failure
        bad = [g for g in gathered if isinstance(g, tuple)]
        if bad:
            error_type = CorruptCheckpointError if bad[0][0] else ValueError
            raise error_type(f"loading failed on another rank: {bad[0][1]}")
        union = sorted(set().union(*gathered))
        where: dict[str, tuple[int, int]] = {}
        sizes = [0] * world
        for name in union:
            owner = self._entries[name]["rank"] % world
            where[name] = (owner, sizes[owner])
            sizes[owner] += (self._entries[name]["nbytes"] + 63) // 64 * 64
        flats = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        mine = [
            {"name": n, "ptr": flats[rank].data_ptr() + off, "nbytes": self._entries[n]["nbytes"]}
            for n, (owner, off) in where.items()
            if owner == rank
        ]
        error = None
        try:
            self._local._native.read(self._manifest, mine)
        except Exception as e:
            error = e
        status: list[Any] = [None] * world
        mine_status = None if error is None else f"rank {rank}: {type(error).__name__}: {error}"
        dist.all_gather_object(status, mine_status, group=group)
        if error is not None:
            raise error
        failed = [x for x in status if x is not None]
        if failed:
            raise CorruptCheckpointError(f"reading the checkpoint failed on {failed[0]}")
        for owner, flat in enumerate(flats):
            if flat.numel():
                dist.broadcast(flat, src=owner, group=group)
        buffers = {}
        for name, (owner, off) in where.items():
            e = self._entries[name]
            raw = flats[owner][off : off + e["nbytes"]]
            buffers[name] = raw.view(dtype_from_name(e["dtype"])).reshape(tuple(e["shape"]))
        with torch.no_grad():
            for w in self._wanted:
                for c in w.copies:
                    src = buffers[c.entry][tuple(slice(a, b) for a, b in c.src)]
                    w.out[tuple(slice(a, b) for a, b in c.dst)] = src
                if _is_ndarray(w.target):
                    w.target[...] = w.out.numpy()

    def _lands_whole(self, c: Any, t: torch.Tensor) -> bool:
        """True when copy `c` moves a whole saved piece onto whole rows of `t` (contiguous)."""
        e = self._entries[c.entry]
        if e["dtype"] != dtype_name(t.dtype):
            return False
        whole_src = all(a == 0 and b == n for (a, b), n in zip(c.src, e["shape"]))
        full_rows = all(a == 0 and b == n for (a, b), n in zip(c.dst[1:], t.shape[1:]))
        return whole_src and full_rows


def read_global(root: str | os.PathLike, step: int | None = None) -> dict[str, torch.Tensor]:
    """Single process: every replicated tensor of a sharded checkpoint, assembled to its global
    shape, by logical name ("model/fc1.weight"); per-rank tensors as "R<rank>/<name>". For tools,
    tests and converting to a single-file format."""
    local = Checkpointer(root, keep=0)
    try:
        step = local.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no committed checkpoint in {root}")
        manifest = local._native.manifest(step)
        entries = {e["name"]: e for e in manifest.tensors()}
        reader = _Reader(local, manifest, entries)
        saved: dict[str, list[Saved]] = {}
        out: dict[str, _Wanted] = {}
        for e in entries.values():
            shape = tuple(e["shape"])
            split = split_piece_name(e["name"][2:]) if e["name"].startswith("S/") else None
            if split is None:
                s = Saved(e["name"], e["dtype"], shape, shape, tuple(0 for _ in shape))
                out[e["name"]] = reader.want(e["name"], None, e["dtype"], shape, None, [s])
                continue
            saved.setdefault(split[0], []).append(
                Saved(e["name"], e["dtype"], shape, tuple(e.get("global_shape", shape)), split[1])
            )
        for name, pieces in saved.items():
            g = pieces[0].global_shape
            out[name] = reader.want(name, None, pieces[0].dtype, g, None, pieces)
        reader.run()
        return {n: w.out for n, w in out.items()}
    finally:
        local.close()
