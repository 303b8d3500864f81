"""restore="shared" in an NCCL job (checkpoint.reader.Reader.run_shared): each saved piece that
every rank needs (replicated state) is read from storage once in all, by one rank, straight into
GPU memory (its own target where the piece fills whole rows of it), and broadcast over NCCL into
every other rank's target. No host buffer and no copy through host memory: the engine's reads to
the GPU are pipelined through its pinned slabs, and NVLink or the network carries the rest.

The readers split the pieces in contiguous runs of the files (sequential reads). What crossed is
checked: every rank computes, on its GPU, a position-weighted sum over 64-byte blocks of each
piece it received (two int64 per piece; it catches flipped bits and misplaced blocks, not a
reordering within 64 bytes; the readers verified the chunks' XXH3 when reading from storage) and
compares it with the reader's; any mismatch makes every rank read directly instead."""

from __future__ import annotations

from typing import Any

import torch

#: CPU targets up to this size may take part (e.g. optimizers' `step` scalars): they are copied
#: from the GPU. A rank with a larger CPU target makes the load use the host buffer instead.
CPU_TARGET_LIMIT = 1 << 20
#: Bytes summed at once: the sum casts them to int64 first (8x), so this bounds the scratch.
_DIGEST_CHUNK = 8 << 20


def eligible(wanted: list[Any], device: torch.device) -> bool:
    """This rank's part of the decision: its targets are on its GPU (`device`), but for small
    CPU ones."""
    return all(w.out.device == device or (
        w.out.device.type == "cpu" and w.out.numel() * w.out.element_size() <= CPU_TARGET_LIMIT)
        for w in wanted)


def digest(x: torch.Tensor) -> torch.Tensor:
    """Two int64 on x's device: the sum of x's 64-byte block sums, and of the block sums each
    times its block's position (x: flat uint8)."""
    total = torch.zeros(2, dtype=torch.int64, device=x.device)
    n = x.numel()
    for lo in range(0, n, _DIGEST_CHUNK):
        part = x[lo:min(n, lo + _DIGEST_CHUNK)]
        k = part.numel() // 64
        blocks = part[:k * 64].view(k, 64).sum(1, dtype=torch.int64)
        tail = part[k * 64:].sum(dtype=torch.int64)
        first = lo // 64 + 1
        pos = torch.arange(first, first + k + 1, dtype=torch.int64, device=x.device)
        total[0] += blocks.sum() + tail
        total[1] += (blocks * pos[:k]).sum() + tail * pos[k]
    return total


def byte_view(t: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """Bytes [offset, offset + nbytes) of contiguous tensor t, as a flat uint8 view."""
    return t.reshape(-1).view(torch.uint8)[offset:offset + nbytes]


def rounds(shared: list[str], share: dict[str, int], entries: dict[str, dict], world: int,
           round_bytes: int) -> list[list[str]]:
    """The broadcast order of Reader._run_device: each reader's run (the pieces `share` gives
    it, in `shared`'s order) cut into parts of about `round_bytes` (a part ends at the first
    piece that reaches it; a larger piece is a part of its own); round k holds every reader's
    k-th part, reader after reader. The same on every rank."""
    parts = [_parts([n for n in shared if share[n] == r], entries, round_bytes)
             for r in range(world)]
    return [[n for r in range(world) if k < len(parts[r]) for n in parts[r][k]]
            for k in range(max((len(p) for p in parts), default=0))]


def _parts(run: list[str], entries: dict[str, dict], part_bytes: int) -> list[list[str]]:
    """`run` (piece names, in order) cut into parts of about `part_bytes`."""
    out: list[list[str]] = []
    filled = part_bytes
    for n in run:
        if filled >= part_bytes:
            out.append([])
            filled = 0
        out[-1].append(n)
        filled += entries[n]["nbytes"]
    return out
