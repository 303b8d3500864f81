"""Spare or restarted ranks joining a running job and receiving its state from a live peer.

Protocol (keys under ``resilient/recovery/<job>/join/`` in the job's store):

1. A joiner takes a ticket: ``t = add("tickets", 1) - 1``, then waits for ``ticket/<t>``.
2. Every ``join_check_every`` steps each member reads ``tickets`` and proposes it with
   ``compare_set("admit/<step>", "", n)``: the first member to reach the step decides for all, so
   every member admits the same joiners at the same step whatever it read itself.
3. Members and joiners create the group of generation ``1000 * g + epoch`` (``g``: the detector
   generation, ``epoch``: how many admissions so far, so it never collides with a failure
   rebuild's ``1000 * g``); the new rank 0 publishes ``ticket/<t>`` (generation, rank, size,
   members) before joining, joiners take the ranks after the members.
4. Group rank 0 broadcasts model, optimizer, extra state and step (``Recovery.broadcast_state``);
   everyone re-wraps DDP and applies the policy for the larger world.
   With ``max_world`` set (hot spares), during a recovery (a rank lost) the survivors decide
   with ``compare_set("admit/recovery<g>")`` and build the rebuilt group of ``1000 * g`` with
   the joiners in it (:func:`admit_in_recovery`): the joiners then take part in the survivors'
   restore instead of step 4.
5. When the members finish their last step, group rank 0 sets ``finished`` (the step): a joiner
   still waiting stops, with nothing to do (``join_too_late`` in its timeline).

Joiners are not in the failure detector's world (it has a fixed size): they follow its decided
generations through the store (:class:`JoinerDetector`), but nobody watches them, so a joiner
that dies is found only through a collective error, and then no verdict comes: the survivors
stop when ``agree_timeout_s`` passes. Their ids are ``JOIN_BASE + ticket``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from resilient.comm.process_group import abort_process_group, join_process_group
from resilient.recovery import sharded
from resilient.recovery.environment import JOIN_ENV
from resilient.recovery.warmup import warm_compute

log = logging.getLogger("resilient.recovery")

JOIN_BASE = 1 << 20


def parse_generation_record(text: str) -> tuple[int, list[int]]:
    """(number, live ranks) of a detector generation record
    ``g=<n>;live=<a-b,c,...>;removed=...`` (format of resilient::detect::Generation)."""
    parts = dict(p.split("=", 1) for p in text.split(";"))
    live: list[int] = []
    for item in filter(None, parts["live"].split(",")):
        lo, _, hi = item.partition("-")
        live += range(int(lo), int(hi or lo) + 1)
    return int(parts["g"]), live


class JoinerDetector:
    """Stands in for the detector on a joiner, which is outside the detector's fixed world: it
    follows the decided generations in the store (``<prefix>/gen/<g>``, at most every
    ``interval_s``), so a joiner sees the same verdicts as the members, a little later.
    ``store_prefix`` is the members' detector prefix (it names their run)."""

    def __init__(self, store: Any, job: str, generation: int, live: list[int],
                 interval_s: float = 0.05, store_prefix: str | None = None) -> None:
        self.store_prefix = store_prefix or f"resilient/detect/{job}"
        self._store, self._prefix = store, f"{self.store_prefix}/gen/"
        self._generation, self._live = generation, list(live)
        self._interval, self._next = interval_s, 0.0

    @property
    def generation(self) -> tuple:
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self._interval
            while self._store.check([self._prefix + str(self._generation + 1)]):
                text = bytes(self._store.get(self._prefix + str(self._generation + 1))).decode()
                self._generation, self._live = parse_generation_record(text)
        return (self._generation, self._live)

    def step(self, n: int) -> None:
        """No hang watchdog on a joiner."""

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """No hang watchdog on a joiner."""
        yield

    def stop(self) -> None:
        """Nothing to stop."""


def _key(rec: Any, name: str) -> str:
    return f"resilient/recovery/{rec.job}/join/{name}"


def tickets_taken(rec: Any) -> int:
    """How many joiners have asked to join so far (admitted or waiting)."""
    return int(rec.store.add(_key(rec, "tickets"), 0))


def maybe_admit(rec: Any) -> bool:
    """Member side, at a step boundary: admits waiting joiners (see the module docstring).
    Returns True if the group grew."""
    every = rec.config.join_check_every
    if every <= 0 or rec.step % every:
        return False
    tickets = _decide_admission(rec, f"admit/{rec.step}", rec.world_size)
    if not tickets:
        return False
    rec.timeline.add("join_admitted", joiners=[JOIN_BASE + t for t in tickets], step=rec.step)
    rec.join_epoch += 1
    members = rec.members + [JOIN_BASE + t for t in tickets]
    group_gen = 1000 * rec.generation + rec.join_epoch
    if rec.rank == 0:
        _publish_tickets(rec, tickets, group_gen, rec.generation, members, recovery=False)
    _regroup(rec, group_gen, rec.rank, members)
    return True


def admit_in_recovery(rec: Any, generation: int, survivors: list[int]) -> list[int]:
    """Member side, during a recovery: the joiners (tickets) that the rebuilt group of
    ``generation`` takes in directly, after the survivors (a hot spare replaces a lost rank
    without a group of the survivors alone first: one communicator and one state transfer
    fewer). Their tickets name the group and ``recovery``: they take part in the survivors'
    restore (resilient.recovery.core, ``_restore``). Only with ``max_world`` set (hot spares,
    which wait for a lost rank; without a limit joiners grow the job at the step boundaries
    ``join_check_every`` names). Empty when joining is off or none waits."""
    if rec.config.join_check_every <= 0 or rec.config.max_world == 0 or rec.store is None:
        return []
    tickets = _decide_admission(rec, f"admit/recovery{generation}", len(survivors))
    if not tickets:
        return []
    members = list(survivors) + [JOIN_BASE + t for t in tickets]
    rec.timeline.add("join_admitted", joiners=members[len(survivors):], step=rec.step,
                     during="recovery")
    if survivors[0] == rec.initial_rank:
        _publish_tickets(rec, tickets, 1000 * generation, generation, members, recovery=True)
    return members[len(survivors):]


def _decide_admission(rec: Any, key: str, world: int) -> list[int]:
    """The tickets admitted now into a group of ``world`` members (the first member to reach
    ``key`` decides for all; at most up to ``max_world``); advances ``rec.admitted``."""
    cap = rec.initial_world if rec.config.max_world == -1 else rec.config.max_world
    if cap > 0 and world >= cap:  # hot spares wait until a rank is lost; every member
        return []  # computes the same room, so none asks the store while the job is whole
    pending = int(rec.store.add(_key(rec, "tickets"), 0))
    if cap > 0:
        pending = min(pending, rec.admitted + cap - world)
    upto = int(bytes(rec.store.compare_set(_key(rec, key), "", str(pending))).decode())
    if upto <= rec.admitted:
        return []
    tickets = list(range(rec.admitted, upto))
    rec.admitted = upto
    return tickets


def _publish_tickets(rec: Any, tickets: list[int], group_gen: int, generation: int,
                     members: list[int], *, recovery: bool) -> None:
    det_generation, live = rec.detector.generation
    first = len(members) - len(tickets)
    for i, t in enumerate(tickets):
        rec.store.set(_key(rec, f"ticket/{t}"), json.dumps({
            "group_generation": group_gen, "rank": first + i, "world_size": len(members),
            "members": members, "generation": generation,
            "detector": [det_generation, sorted(live)],
            "detector_prefix": rec.detector.store_prefix, "join_epoch": rec.join_epoch,
            "admitted": rec.admitted, "recovery": recovery,
            "initial_world": rec.initial_world}))


# A waiting joiner asks the store for its ticket every TICKET_POLL_S (its admission waits for
# this poll: 100 requests a second per spare) and for the members' ``finished`` key every
# FINISHED_POLL_S (a spare still waiting at the job's end exits that much later).
TICKET_POLL_S = 0.01
FINISHED_POLL_S = 0.5


def join_as_spare(rec: Any, timeout_s: float) -> bool:
    """Joiner side: takes a ticket, waits to be admitted, joins and receives the state.
    Returns False, with ``rec.step`` the members' last step, when they finished first (see
    :func:`mark_finished`)."""
    if rec.config.warm_spare and rec.device.type == "cuda":  # before the ticket: members do
        dtypes = {p.dtype for p in rec.module.parameters() if p.is_floating_point()}  # not wait
        try:
            rec.timeline.add("compute_warmed",
                             seconds=round(warm_compute(rec.device, dtypes), 4))
        except Exception as exc:  # noqa: BLE001 -- a speed-up only: the join goes on
            log.warning("resilient recovery: no compute warm-up (%s)", exc)
    ticket = int(rec.store.add(_key(rec, "tickets"), 1)) - 1
    rec.initial_rank = JOIN_BASE + ticket
    rec.timeline.add("join_requested", ticket=ticket)
    key, finished = _key(rec, f"ticket/{ticket}"), _key(rec, "finished")
    deadline = time.monotonic() + timeout_s
    next_finished = 0.0
    while not rec.store.check([key]):  # one request per poll; the end of the job is rarer news
        now = time.monotonic()
        if now >= next_finished:
            next_finished = now + FINISHED_POLL_S
            if rec.store.check([finished]):  # the members reached their last step first
                rec.step = int(bytes(rec.store.get(finished)).decode())
                rec.timeline.add("join_too_late", ticket=ticket, step=rec.step)
                return False
        if now > deadline:
            raise TimeoutError(f"not admitted to the job within {timeout_s}s")
        time.sleep(TICKET_POLL_S)  # a hot spare's admission waits for this poll
    info = json.loads(bytes(rec.store.get(key)).decode())
    # Admitted: a member from now on. Its build() makes the real model on the grown group
    # (resilient.joining() is False), and its CheckpointManager reads storage again when this
    # restore or a later one falls back to it, as the members' do (RESILIENT_JOIN only spares
    # the read before admission).
    os.environ.pop(JOIN_ENV, None)
    rec.generation, rec.join_epoch, rec.admitted = (
        info["generation"], info["join_epoch"], info["admitted"])
    # the job's launch size, as the members count it (their admission caps and batch policy
    # must agree with this rank's once it is a member)
    launched = int(info.get("initial_world", rec.initial_world))
    if launched != rec.initial_world:
        if getattr(rec, "loader_batches", False):  # one batch per rank of the launched job
            rec.global_batch = launched
        rec.initial_world = launched
    det_generation, live = info["detector"]
    rec.detector = JoinerDetector(rec.store, rec.job, det_generation, live,
                                  store_prefix=info.get("detector_prefix"))
    _regroup(rec, info["group_generation"], info["rank"], info["members"],
             recovery=bool(info.get("recovery")))
    return True


def mark_finished(rec: Any) -> None:
    """Member side, after the last step: joiners still waiting stop waiting (a replacement
    started near the end of the job would otherwise wait ``join_timeout_s``)."""
    if rec.rank == 0:
        rec.store.set(_key(rec, "finished"), str(rec.step))


def _regroup(rec: Any, group_gen: int, rank: int, members: list[int], *,
             recovery: bool = False) -> None:
    t0 = time.monotonic()
    if rec.replicas is not None:
        if not recovery:  # a member at a step boundary: its state now, not the last replica's
            sharded.snapshot_now(rec)
        rec.replicas.stop()  # before their group ends with the old ones (quietly)
    if dist.is_initialized():
        # healthy, but a joiner forces a fresh group (reinit path)
        abort_process_group(background=rec.config.revoke_nccl)
    group = join_process_group(
        rec.store, generation=group_gen, rank=rank, world_size=len(members),
        backend=rec.backend, timeout=timedelta(seconds=rec.config.group_timeout_s),
        device_id=rec.device if rec.device.type == "cuda" else None, lazy=True)
    rec.adopt_group(group, members, rank)
    rec.timeline.add("rebuilt", method="join", generation=rec.generation, rank=rank,
                     world_size=len(members), seconds=time.monotonic() - t0)
    rec.follow_group(lost_rank=False)
    if recovery:  # the survivors' restore, in which this rank holds no state
        rec.restore_as_joiner()
    elif rec.build is not None:  # a sharded model: resharded from the members' snapshots
        rec._restore(holds_state=rec.replicas is not None)
    else:
        rec.broadcast_state(0)
        rec.rewrap()
        rec.timeline.add("restored", source="peer", step=rec.step)
    rec.apply_world(len(members))


__all__ = ["JOIN_BASE", "JoinerDetector", "admit_in_recovery", "join_as_spare", "mark_finished",
           "maybe_admit",
           "parse_generation_record", "tickets_taken"]
