"""Restoring sharded state (FSDP2, tensor parallel) from memory after a rank is lost: the
survivors' own snapshots plus the lost ranks' replicas on their buddies (resilient.recovery.
replica), moved into a model and optimizer built on the new group, whatever its size.

The survivors (and any spares) call :func:`restore_sharded` together on the new group, with a
model and optimizer sharded over it (the user's model factory ran again) and their old
:class:`PeerReplicas` (a spare passes None). Every process offers the verified snapshots it
holds; the newest step at which every old rank's shard is held somewhere is chosen (a lost
rank's replica may be a step behind: then every rank goes back to that step). Each new rank's
local shards are assembled from the overlapping boxes of the old ranks' shards
(``resilient.checkpoint.plan.plan_reads``, the planner of resharded checkpoint loads), moved in
one all-to-all, each destination's bytes checked with XXH3, and loaded with
``set_state_dict``. When no step is complete in memory, :class:`ReplicaUnavailable` is raised on
every rank: load from storage instead.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from resilient.checkpoint.plan import Copy, Saved, ShardSpec, plan_reads
from resilient.errors import ReplicaUnavailable  # noqa: F401 -- re-exported
from resilient.recovery.replica import (
    Entry,
    PeerReplicas,
    Snapshot,
    _digest,
    entry_tensor,
    flatten,
    gather_objects,
    layout,
    state_of,
)


@dataclass(frozen=True)
class Move:
    """Copy box `src` of old rank `old`'s entry `key` (held by new rank `holder`) into box `dst`
    of new rank `needer`'s entry `key`."""

    holder: int
    needer: int
    key: str
    old: int
    src: tuple[tuple[int, int], ...]
    dst: tuple[tuple[int, int], ...]
    nbytes: int


@dataclass
class Restored:
    """What restore_sharded did: the step restored, bytes received from other ranks and kept
    locally, the old world size, and seconds per phase."""

    step: int
    old_world: int
    bytes_received: int
    bytes_local: int
    seconds: dict[str, float] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  #: what ``replicate(step, extra=...)`` carried


def choose_step(offers: list[dict[tuple[int, int], list[int]]],
                own: list[int]) -> tuple[int, int, dict[int, int]]:
    """(step, old world, holder of each old rank) from each new rank's offer {(old rank, old
    world): [steps held]}: the newest step at which every old rank is held. An old rank's holder
    is the new rank that was that old rank (`own[j]`: new rank j's old rank, -1 for a spare)
    when it holds that step, else the lowest new rank that does. Pure; raises
    ReplicaUnavailable."""
    old_world, candidates = candidate_steps(offers, own)
    for step, holders in candidates:
        if len(holders) == old_world:
            return step, old_world, holders
    raise ReplicaUnavailable(_incomplete(offers, old_world))


def candidate_steps(offers: list[dict[tuple[int, int], list[int]]],
                    own: list[int]) -> tuple[int, list[tuple[int, dict[int, int]]]]:
    """(old world, [(step, holders)] newest step first): every step at which some old rank's
    snapshot is held, with the holder of each old rank held at it (as :func:`choose_step`).
    A step that lacks an old rank can still be complete when others hold the same boxes (HSDP:
    the other replica group); the restore plans each in turn. Pure."""
    worlds = {w for o in offers for (_, w) in o}
    if len(worlds) != 1:
        raise ReplicaUnavailable(
            "no replicated state to restore from" if not worlds else
            f"the snapshots held come from groups of different sizes {sorted(worlds)}")
    old_world = worlds.pop()
    steps = sorted({s for o in offers for held in o.values() for s in held}, reverse=True)
    out = []
    for step in steps:
        holders: dict[int, int] = {}
        for old in range(old_world):
            cands = [j for j, o in enumerate(offers) if step in o.get((old, old_world), ())]
            mine = [j for j in cands if own[j] == old]
            if cands:
                holders[old] = (mine or cands)[0]
        out.append((step, holders))
    return old_world, out


def _incomplete(offers: list[dict[tuple[int, int], list[int]]], old_world: int) -> str:
    have: dict[int, set[int]] = {r: set() for r in range(old_world)}
    for o in offers:
        for (old, _), held in o.items():
            have.setdefault(old, set()).update(held)
    return (f"no step of all {old_world} old ranks' shards is held in memory (steps held per old "
            f"rank: { {r: sorted(v) for r, v in have.items()} }); load the checkpoint from "
            "storage")


def plan_moves(targets: list[list[tuple[str, str, ShardSpec, bool]]],
               sources: dict[int, list[Entry]], holders: dict[int, int]) -> list[Move]:
    """The moves that fill every new rank's targets (per new rank: key, dtype, place,
    replicated) from the old ranks' entries. Pure; ValueError naming a tensor that cannot be
    assembled."""
    by_key: dict[str, list[tuple[int, Entry]]] = {}
    for old in sorted(sources):
        for e in sources[old]:
            by_key.setdefault(e.key, []).append((old, e))
    moves: list[Move] = []
    for j, mine in enumerate(targets):
        for key, dtype, place, _replicated in mine:
            have = by_key.get(key, [])
            saved, seen = [], {}
            for old, e in have:
                box = (e.offset, e.shape)
                if box in seen:  # a replicated chunk: take it once, from this rank if it can
                    if holders[old] == j and holders[seen[box][0]] != j:
                        seen[box] = (old, e)
                    continue
                seen[box] = (old, e)
            for old, e in seen.values():
                saved.append(Saved(f"{old}", e.dtype, e.shape, e.global_shape, e.offset))
            name = json.loads(key)
            copies: list[Copy] = plan_reads(".".join(map(str, name)), dtype, place.shape, place,
                                            saved)
            for c in copies:
                old = int(c.entry)
                size = _element_size(dtype)
                for lo, hi in c.src:
                    size *= hi - lo
                moves.append(Move(holders[old], j, key, old, c.src, c.dst, size))
    return moves


def _element_size(dtype: str) -> int:
    from resilient.recovery.replica import dtype_of

    return torch.empty((), dtype=dtype_of(dtype)).element_size()


def _box(t: torch.Tensor, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
    return t[tuple(slice(lo, hi) for lo, hi in box)] if box else t


def restore_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    replicas: PeerReplicas | None, *, group: Any = None,
                    wait: Callable[[Any], None] | None = None) -> Restored:
    """Fills `model` and `optimizer` (sharded over the current default group) with the newest
    step of the old group's state held in memory; returns what it did. Collective over the
    default group (`group`: a gloo group over the same ranks, created if the default group is
    not gloo). Raises ReplicaUnavailable (every rank) when memory holds no complete step.

    `wait(work)` waits for each of its collectives, issued asynchronously (Recovery's: polled
    while it watches the detector, so a peer lost during the restore raises PeerFailure
    instead of blocking until the group's timeout); default: ``work.wait()``."""
    t0 = time.monotonic()
    seconds: dict[str, float] = {}
    if group is None and dist.get_backend() != "gloo":
        group = dist.new_group(backend="gloo")
    wait = wait or (lambda work: work.wait())
    me, world = dist.get_rank(group), dist.get_world_size(group)
    state = state_of(model, optimizer)
    tensors, _ = flatten(state)
    entries, locals_, _ = layout(tensors)
    targets = [(e.key, e.dtype, ShardSpec(e.global_shape, e.offset, e.shape), e.replicated)
               for e in entries]
    held = replicas.holdings() if replicas is not None else []
    mine: dict[tuple[int, int], dict[int, Snapshot]] = {}
    for s in held:
        mine.setdefault((s.rank, s.world), {}).setdefault(s.step, s)
    own_rank = replicas.rank if replicas is not None else -1
    # what this rank holds, with each snapshot's entries and plain values (metadata only), so
    # that one gather tells every rank everything the plan needs
    offer = {k: {step: ([_entry_row(e) for e in snap.entries], snap.leaves, snap.extra)
                 for step, snap in v.items()} for k, v in mine.items()}
    gathered = gather_objects((own_rank, offer, targets), group, wait)
    seconds["gather"] = time.monotonic() - t0
    offers = [{k: sorted(v) for k, v in o.items()} for _, o, _ in gathered]
    old_world, candidates = candidate_steps(offers, [r for r, _, _ in gathered])
    # the newest step whose held snapshots fill every new target (every rank plans the same)
    why = _incomplete(offers, old_world)
    for step, holders in candidates:
        chosen = {old: gathered[j][1][(old, old_world)][step] for old, j in holders.items()}
        sources = {old: [Entry(*_row_entry(r)) for r in rows]
                   for old, (rows, _, _) in chosen.items()}
        try:
            moves = plan_moves([t for _, _, t in gathered], sources, holders)
            break
        except ValueError as e:
            if len(holders) == old_world:  # every old rank held: the model does not match,
                raise ReplicaUnavailable(  # and an older step would not either
                    f"the state in memory does not fit the new model: {e}") from e
    else:
        raise ReplicaUnavailable(why)
    _, leaves, extra = chosen[min(chosen)]
    seconds["plan"] = time.monotonic() - t0 - seconds["gather"]
    try:
        received, local = _exchange(moves, me, world, group, mine, old_world, step, entries,
                                    locals_, wait)
        problem = None
    except ReplicaUnavailable as e:
        problem, received, local = str(e), 0, 0
    problems = gather_objects(problem, group, wait)  # one rank's bad bytes fail all
    bad = [f"rank {j}: {p}" for j, p in enumerate(problems) if p]
    if bad:
        raise ReplicaUnavailable("; ".join(bad))
    seconds["exchange"] = time.monotonic() - t0 - seconds["gather"] - seconds["plan"]
    _apply_leaves(state, leaves)
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    seconds["total"] = time.monotonic() - t0
    return Restored(step, old_world, received, local, seconds, extra)


def _entry_row(e: Entry) -> list:
    return [e.key, e.dtype, list(e.global_shape), list(e.offset), list(e.shape), e.start,
            e.nbytes, e.replicated]


def _row_entry(r: list) -> tuple:
    k, d, g, o, s, st, n, rep = r
    return k, d, tuple(g), tuple(o), tuple(s), st, n, rep


def _exchange(moves: list[Move], me: int, world: int, group: Any,
              mine: dict[tuple[int, int], dict[int, Snapshot]], old_world: int, step: int,
              entries: list[Entry], locals_: list[torch.Tensor],
              wait: Callable[[Any], None]) -> tuple[int, int]:
    """Sends this rank's boxes to their needers in one all-to-all (each destination's bytes
    followed by their XXH3) and copies the received ones into the local targets."""
    target = {e.key: t for e, t in zip(entries, locals_)}
    src_entries = {old: {e.key: e for e in snaps[step].entries}
                   for (old, w), snaps in mine.items() if w == old_world and step in snaps}

    def source_box(m: Move) -> torch.Tensor:
        snap = mine[(m.old, old_world)][step]
        return _box(entry_tensor(snap.buf, src_entries[m.old][m.key]), m.src)

    out_parts: list[list[torch.Tensor]] = [[] for _ in range(world)]
    in_sizes = [0] * world
    local = 0
    for m in moves:
        if m.holder == me and m.needer == me:
            dst = _box(target[m.key], m.dst)
            dst.copy_(source_box(m).to(dst.device))
            local += m.nbytes
        elif m.holder == me:  # each box padded to 8 bytes: every view below is aligned
            out_parts[m.needer].append(source_box(m).contiguous().view(-1).view(torch.uint8))
            if _pad(m.nbytes) > m.nbytes:
                out_parts[m.needer].append(torch.zeros(_pad(m.nbytes) - m.nbytes,
                                                       dtype=torch.uint8))
        elif m.needer == me:
            in_sizes[m.holder] += _pad(m.nbytes)
    send, out_sizes = [], []
    for j in range(world):
        body = torch.cat(out_parts[j]) if out_parts[j] else torch.empty(0, dtype=torch.uint8)
        tail = torch.tensor([_digest(body, body.numel()) - (1 << 63) if body.numel() else 0],
                            dtype=torch.int64).view(torch.uint8) if j != me else torch.empty(
                                0, dtype=torch.uint8)
        send += [body, tail]
        out_sizes.append(body.numel() + tail.numel())
    recv_sizes = [n + (8 if j != me else 0) for j, n in enumerate(in_sizes)]
    inp = torch.cat(send)
    out = torch.empty(sum(recv_sizes), dtype=torch.uint8)
    wait(dist.all_to_all_single(out, inp, recv_sizes, out_sizes, group=group, async_op=True))
    at, pos = 0, {}
    for j, n in enumerate(recv_sizes):
        if j != me:
            body = out[at:at + n - 8]
            want = int(out[at + n - 8:at + n].view(torch.int64)[0]) + (1 << 63)
            got = _digest(body, body.numel()) if body.numel() else (1 << 63)
            if body.numel() and got != want:
                raise ReplicaUnavailable(f"the bytes rank {j} sent this rank changed on the way "
                                         "(checksum mismatch)")
            pos[j] = at
        at += n
    received = 0
    for m in moves:
        if m.needer == me and m.holder != me:
            dst = _box(target[m.key], m.dst)
            src = out[pos[m.holder]:pos[m.holder] + m.nbytes]
            pos[m.holder] += _pad(m.nbytes)
            dst.copy_(src.view(dst.dtype).view(dst.shape).to(dst.device))
            received += m.nbytes
    return received, local


def _pad(n: int) -> int:
    return -(-n // 8) * 8


def _apply_leaves(state: dict, leaves: dict[str, Any]) -> None:
    """Puts the old state's plain values (learning rates, betas...) into the new state; keys
    absent in the new state (another optimizer) are ignored, tuples stay tuples."""
    for key, value in leaves.items():
        path = json.loads(key)
        node: Any = state
        try:
            for p in path[:-1]:
                node = node[p]
            old = node[path[-1]]
        except (KeyError, IndexError, TypeError):
            continue
        if isinstance(old, torch.Tensor):
            continue
        node[path[-1]] = tuple(value) if isinstance(old, tuple) else value


__all__ = ["Move", "ReplicaUnavailable", "Restored", "candidate_steps", "choose_step",
           "plan_moves", "restore_sharded"]
