"""Pure planning for sharded saves and loads: which rank writes which piece, and which saved
pieces cover a tensor a rank wants back. No I/O and no communication, so every rank computes the
same answer from the same inputs, and tests call these functions directly.

A *piece* is a box of a global tensor: ``global_shape`` plus ``offset`` plus ``shape``. A tensor
that is not sharded is one piece that covers its whole global tensor.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_PIECE_SUFFIX = re.compile(r"#@([0-9_]*)$")


@dataclass(frozen=True)
class ShardSpec:
    """Where a rank's local tensor sits in its global tensor (Megatron-style sharding)."""

    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @staticmethod
    def split(global_shape: tuple[int, ...], dim: int, index: int, parts: int) -> ShardSpec:
        """Part `index` of `parts` equal parts of a global tensor split along `dim`."""
        g = tuple(int(x) for x in global_shape)
        if g[dim] % parts:
            raise ValueError(
                f"dimension {dim} of {list(g)} does not split into {parts} equal parts"
            )
        size = g[dim] // parts
        offset = tuple(index * size if d == dim else 0 for d in range(len(g)))
        shape = tuple(size if d == dim else n for d, n in enumerate(g))
        return ShardSpec(g, offset, shape)

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        """Raises ValueError (naming the tensor) when `shape` does not fit at `offset`."""
        if tuple(shape) != tuple(self.shape):
            raise ValueError(
                f"tensor {name!r}: shape {list(shape)} differs from its shard spec "
                f"{list(self.shape)}"
            )
        if len(self.global_shape) != len(shape) or len(self.offset) != len(shape):
            raise ValueError(
                f"tensor {name!r}: shard spec rank differs from the tensor's {list(shape)}"
            )
        for g, o, s in zip(self.global_shape, self.offset, shape):
            if o < 0 or o + s > g:
                raise ValueError(
                    f"tensor {name!r}: a {list(shape)} slice at {list(self.offset)} does not fit "
                    f"in "
                    f"global shape {list(self.global_shape)}"
                )


@dataclass(frozen=True)
class Held:
    """A replicated tensor as one rank holds it: logical name, dtype, bytes and placement."""

    name: str
    dtype: str
    itemsize: int
    shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        return (self.name, self.offset)

    @property
    def nbytes_estimate(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class Piece:
    """One piece a rank writes: rows [row_begin, row_end) of its local tensor `name` (None: all)."""

    name: str
    rows: tuple[int, int] | None


def piece_name(name: str, offset: tuple[int, ...]) -> str:
    """The stored entry name of a piece: "<name>#@<o0>_<o1>..." (unique per global box origin)."""
    return f"{name}#@{'_'.join(str(o) for o in offset)}"


def split_piece_name(entry: str) -> tuple[str, tuple[int, ...]] | None:
    """Inverse of piece_name; None for names that are not pieces."""
    m = _PIECE_SUFFIX.search(entry)
    if m is None:
        return None
    digits = m.group(1)
    offset = tuple(int(x) for x in digits.split("_")) if digits else ()
    return entry[: m.start()], offset


def plan_writes(
    held_by_rank: list[list[Held]], rank: int, split_bytes: int = 1 << 20
) -> list[Piece]:
    """The pieces `rank` writes so that every distinct replicated piece is written once in total
    and the bytes are spread evenly over the ranks that hold it.

    Args:
        held_by_rank: for every rank, the replicated tensors it holds (same order on every rank).
        rank: the rank to plan for.
        split_bytes: a tensor at least this large, with dim 0 >= holders, is split along dim 0
            across all its holders; smaller tensors go whole to the least-loaded holder.
    Returns:
        This rank's pieces. Deterministic: a pure function of the arguments. The bytes written
        by any two holders differ by less than split_bytes (plus a row per split tensor).
    """
    holders: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    info: dict[tuple[str, tuple[int, ...]], Held] = {}
    for r, held in enumerate(held_by_rank):
        for h in held:
            holders.setdefault(h.key, []).append(r)
            info.setdefault(h.key, h)
    load = [0] * len(held_by_rank)
    mine: list[Piece] = []
    order = sorted(info, key=lambda k: (-info[k].nbytes_estimate, k))
    for key in order:
        h, owners = info[key], holders[key]
        if (
            len(owners) > 1
            and h.nbytes_estimate >= split_bytes
            and h.shape
            and h.shape[0] >= len(owners)
        ):
            rows = h.shape[0]
            for i, r in enumerate(owners):
                begin, end = rows * i // len(owners), rows * (i + 1) // len(owners)
                load[r] += h.nbytes_estimate * (end - begin) // rows
                if r == rank:
                    mine.append(Piece(h.name, (begin, end)))
            continue
        r = min(owners, key=lambda o: (load[o], o))
        load[r] += h.nbytes_estimate
        if r == rank:
            mine.append(Piece(h.name, None))
    return mine


@dataclass(frozen=True)
class Saved:
    """A stored piece of a global tensor, as the manifest lists it."""

    entry: str
    dtype: str
    shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]


@dataclass(frozen=True)
class Copy:
    """Copy the box `src` (begin, end per dim) of saved piece `entry` into the box `dst` of the
    target tensor (both relative to their own tensors)."""

    entry: str
    src: tuple[tuple[int, int], ...]
    dst: tuple[tuple[int, int], ...]


def plan_reads(
    name: str, dtype: str, shape: tuple[int, ...], spec: ShardSpec | None, saved: list[Saved]
) -> list[Copy]:
    """The copies that assemble a target tensor from the saved pieces of its global tensor.

    Raises ValueError naming the tensor when the checkpoint has no such tensor, its dtype or global
    shape differs, or the pieces do not cover the target box (a resharding that cannot be resolved).
    """
    if not saved:
        raise ValueError(f"tensor {name!r} is not in the checkpoint")
    gshape = spec.global_shape if spec else shape
    offset = spec.offset if spec else tuple(0 for _ in shape)
    for s in saved:
        if s.dtype != dtype:
            raise ValueError(f"tensor {name!r}: checkpoint has {s.dtype}, the target is {dtype}")
        if s.global_shape != tuple(gshape):
            raise ValueError(
                f"tensor {name!r}: checkpoint global shape {list(s.global_shape)} differs from the "
                f"target's {list(gshape)} (a different model, or an unsupported resharding)"
            )
    copies: list[Copy] = []
    covered = 0
    boxes: list[tuple[tuple[int, int], ...]] = []
    for s in saved:
        src, dst, vol = [], [], 1
        for d in range(len(shape)):
            lo = max(offset[d], s.offset[d])
            hi = min(offset[d] + shape[d], s.offset[d] + s.shape[d])
            if hi <= lo:
                vol = 0
                break
            src.append((lo - s.offset[d], hi - s.offset[d]))
            dst.append((lo - offset[d], hi - offset[d]))
            vol *= hi - lo
        if vol == 0 and shape:
            continue
        box = tuple(dst)
        if any(_overlap(box, other) for other in boxes):
            raise ValueError(f"tensor {name!r}: two saved pieces overlap (a damaged manifest or "
                             "inconsistent shard specs)")
        boxes.append(box)
        copies.append(Copy(s.entry, tuple(src), box))
        covered += vol
    want = math.prod(shape)
    if covered != want:
        raise ValueError(
            f"tensor {name!r}: the checkpoint's pieces cover {covered} of the {want} elements this "
            f"rank needs at offset {list(offset)} (pieces overlap or are missing)"
        )
    return copies


def _overlap(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> bool:
    """True when two boxes (begin, end per dim) share an element; 0-d boxes always do."""
    return all(max(x0, y0) < min(x1, y1) for (x0, x1), (y0, y1) in zip(a, b))
