"""Reading checkpoints: assembling each tensor a rank holds from the saved pieces that overlap
it (plan.plan_reads), either reading those pieces directly from the shared checkpoint directory
(Reader.run) or reading each shard once and broadcasting it over a gloo group
(Reader.run_redistributed). A piece that lands whole on a contiguous target (CPU or CUDA) is read
straight into it; others go through a host buffer."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from resilient.checkpoint.codec import dtype_from_name, dtype_name
from resilient.checkpoint.plan import Saved, ShardSpec, plan_reads
from resilient.errors import CorruptCheckpointError, VersionMismatchError


class Wanted:
    """A tensor being assembled: `result()` after the reader ran."""

    def __init__(self, name: str, target: Any, dtype: str, shape: tuple[int, ...], copies: list):
        self.name, self.target, self.copies = name, target, copies
        if isinstance(target, torch.Tensor):
            self.out = target  # assembled in place
        elif isinstance(target, np.ndarray):
            self.out = torch.from_numpy(target)
        else:
            self.out = torch.empty(shape, dtype=dtype_from_name(dtype))

    def result(self) -> Any:
        if isinstance(self.target, torch.Tensor):
            return self.target
        return self.out


class Reader:
    """Collects the saved pieces a rank needs, reads them in one parallel native call, copies."""

    def __init__(self, engine: Any, manifest: Any, entries: dict[str, dict]):
        self._engine, self._manifest, self._entries = engine, manifest, entries
        self._wanted: list[Wanted] = []

    def want(
        self,
        name: str,
        target: Any,
        dtype: str,
        shape: tuple[int, ...],
        spec: ShardSpec | None,
        pieces: list[Saved],
    ) -> Wanted:
        w = Wanted(name, target, dtype, shape, plan_reads(name, dtype, shape, spec, pieces))
        self._wanted.append(w)
        return w

    def run(self) -> None:
        ptrs: dict[str, int] = {}  # entry -> where it is read to
        devices: dict[str, int] = {}  # entry -> CUDA device of a direct read
        direct: set[tuple[int, int]] = set()  # (wanted, copy) read straight into the target
        for i, w in enumerate(self._wanted):
            t = w.out
            if t.device.type not in ("cpu", "cuda") or not t.is_contiguous() or t.is_conj():
                continue
            for j, c in enumerate(w.copies):
                if c.entry not in ptrs and self._lands_whole(c, t):
                    offset = c.dst[0][0] * t.stride(0) * t.element_size() if c.dst else 0
                    ptrs[c.entry] = t.data_ptr() + offset
                    if t.device.type == "cuda":
                        devices[c.entry] = t.device.index
                    direct.add((i, j))
        buffers: dict[str, torch.Tensor] = {}
        for w in self._wanted:
            for c in w.copies:
                if c.entry not in ptrs and c.entry not in buffers:
                    e = self._entries[c.entry]
                    shape, dtype = tuple(e["shape"]), dtype_from_name(e["dtype"])
                    buffers[c.entry] = torch.empty(shape, dtype=dtype)
                    ptrs[c.entry] = buffers[c.entry].data_ptr()
        # In the manifest's order, which is the files' order: the engine reads runs of
        # consecutive extents in one request.
        order = {name: i for i, name in enumerate(self._entries)}
        targets = [
            {"name": n, "ptr": p, "nbytes": self._entries[n]["nbytes"],
             "device": devices.get(n, -1)}
            for n, p in sorted(ptrs.items(), key=lambda item: order[item[0]])
        ]
        if devices and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # no kernel may still use a tensor the engine overwrites
        self._engine.read(self._manifest, targets)
        with torch.no_grad():
            for i, w in enumerate(self._wanted):
                for j, c in enumerate(w.copies):
                    if (i, j) in direct:
                        continue
                    # Each saved piece belongs to one tensor, so it is read once, here.
                    src = buffers[c.entry][tuple(slice(a, b) for a, b in c.src)]
                    w.out[tuple(slice(a, b) for a, b in c.dst)] = src

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
            self._engine.read(self._manifest, mine)
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

    def _lands_whole(self, c: Any, t: torch.Tensor) -> bool:
        """True when copy `c` moves a whole saved piece onto whole rows of `t` (contiguous)."""
        e = self._entries[c.entry]
        if e["dtype"] != dtype_name(t.dtype):
            return False
        whole_src = all(a == 0 and b == n for (a, b), n in zip(c.src, e["shape"]))
        full_rows = all(a == 0 and b == n for (a, b), n in zip(c.dst[1:], t.shape[1:]))
        return whole_src and full_rows
