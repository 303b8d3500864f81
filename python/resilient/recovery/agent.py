"""``resilient run``: torchrun's elastic agent, except that a dead worker does not kill the others.

torchrun (``torch.distributed.run``) builds a ``LocalElasticAgent`` over a rendezvous handler from
the registry. The agent hosts the job's TCPStore (node rank 0's agent, ``TORCHELASTIC_USE_AGENT_
STORE=True`` in the workers) and its run loop (``SimpleElasticAgent._invoke_run``) calls
``_monitor_workers`` every ``monitor_interval``; ``LocalElasticAgent._monitor_workers`` asks the
process context (``PContext.wait(0)`` -> ``SubprocessContext._poll``), which **closes every
process as soon as one fails** (SIGTERM, then SIGKILL): within one interval of a rank's death the
survivors are gone, before in-process recovery can do anything.

:class:`ResilientAgent` is a ``LocalElasticAgent`` with a few overrides; everything else (argument
parsing, rendezvous, rank assignment, store hosting, worker env, logs, signals, exit barrier,
``--max-restarts``) is torch's:

* ``_monitor_workers`` polls each worker's ``Popen`` itself instead of ``PContext.wait``, so
  nothing is closed; :func:`judge` (pure) turns the exit codes into the group's state. A worker
  that dies while others still run is **lost** (logged, counted, the group stays ``HEALTHY``): the
  survivors' ``Recovery`` notices through its detector and rebuilds the group. The group
  ``SUCCEEDED`` when every worker has exited and the workers that finished did so with 0; it
  ``FAILED`` when all died (none exited 0) or a worker exited non-zero after another finished
  cleanly (a survivor failed, e.g. ``RecoveryStopped`` below ``min_world``): only then does torch's
  loop restart the group (``--max-restarts``) or fail the job.
* With ``--replacements N`` a lost worker is replaced, up to N times per agent: a new process for
  the same local rank, started with ``RESILIENT_JOIN=1`` and a one-rank ``WORLD_SIZE``/``RANK`` (so
  the script's own ``init_process_group`` does not wait for the job's old group); its
  ``Recovery.adopt`` then takes a ticket and is admitted by the running members at a step boundary
  (resilient.recovery.join: the members check every ``RESILIENT_RECOVERY_JOIN_CHECK_EVERY`` steps,
  which the agent sets to 1 when replacements, spares or restarts are on, along with
  ``RESILIENT_RECOVERY_MAX_WORLD=-1``: joiners only fill lost ranks' places, and a whole job
  asks the store nothing per step), receiving the state from a live peer.
* With ``--spares N`` the agent starts N more workers at launch, on the join path like a
  replacement (``LOCAL_RANK`` ``nproc_per_node + i``), that wait, already initialized, until a
  rank is lost: the members admit joiners only up to the job's initial world size
  (``RESILIENT_RECOVERY_MAX_WORLD=-1``), so a spare is taken into the group the survivors
  rebuild when a rank is lost (resilient.recovery.join.admit_in_recovery). The lost worker's
  slot is then the spare's. Spares are used before replacements;
  a spare still waiting when the job finishes exits 0 (it finds the members' ``finished`` key).
* A worker that exits with 75 (``EXIT_DEVICE_LOST``: Recovery found its CUDA context poisoned,
  resilient.recovery.device) is restarted alone, on the same join path, paid from
  ``--max-restarts`` when no ``--replacements`` are left (torchrun would restart every worker
  for it).
* A worker that exits with 76 (``EXIT_EVICTED``, resilient.recovery.policy: the other ranks
  removed it, e.g. a frozen rank woken after the survivors went on) is a removal, not a
  failure: the job goes on (a spare or replacement may take its place), and after the others
  finished it fails nothing.
* A worker tells the agent about itself through a file in the launch's directory
  (``RESILIENT_RUN_STATE``, resilient.recovery.environment.tell_launcher). Survivors are kept
  only when some worker of the node started a Recovery (``recovers``): when a worker is lost
  and none did, the script cannot recover in process and the agent stops the group at once,
  as torchrun does (SIGTERM, then SIGKILL), instead of letting the survivors fail on their own
  (their exit waits for checkpoints that need the lost rank: minutes).
* Workers still running ``--finish-grace-s`` (30) after the first clean exit are killed: ranks
  finish together, so these are ranks the survivors removed (a frozen, SIGSTOPped rank stays a
  live process) or ranks stuck on the way out. A worker that told the agent it is busy (the
  tiers' drain in ``close()``, resilient.recovery.environment.busy) gets its grace from the end
  of that work instead, however long it said it takes (capped by
  ``RESILIENT_TIER_CLOSE_TIMEOUT_S``). Killing a busy worker cuts its work short: the launcher
  then exits with :data:`EXIT_WORKER_KILLED` (4) even though the job finished; killing the
  others is not a failure (exit 0).
* ``_restart_workers`` does not restart a healthy group because new nodes wait at the rendezvous
  (torch's elastic scale-up would kill the survivors); they wait for the next real restart.
* ``_rendezvous``: after torch's, the agents agree on a nonce for this launch through the
  rendezvous's store (the first agent's proposal wins a compare-and-set), given to the workers
  as ``RESILIENT_LAUNCH_ID``: part of their run id, and so of the etcd prefix of ``--store``
  (resilient.etcd), so the same command launched again never reads this launch's keys (a dead
  rank's gloo address). With ``--store etcd://...`` the proposal carries an etcd lease that
  every agent keeps alive (``RESILIENT_STORE_LEASE``: the workers attach every key to it): the
  launch's keys expire ``--store-ttl-s`` after its last agent stopped, and go at once when the
  job succeeded (after torch's exit barrier every node's workers are done).

``--no-in-process-recovery`` (or ``RESILIENT_IN_PROCESS_RECOVERY=0``) gives torchrun's behaviour.

Limits: one agent sees only its own node's workers. When every worker of a node dies, that agent
reports its group failed (its node's part of the job ends; with ``--max-restarts`` it tries a new
rendezvous, which the healthy agents do not join), while the other nodes' ranks recover in
process; the job's exit status is then that of the healthy nodes' agents. Workers must be
commands (scripts), not Python functions (``elastic_launch`` with a callable uses
``MultiprocessContext``, whose processes this agent does not poll). A replacement rank is outside
the failure detector's fixed world (see resilient.recovery.join).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.agent.server.api import (
    RunResult,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.multiprocessing.subprocess_handler import get_subprocess_handler

from resilient.ports import free_port
from resilient.recovery.device import EXIT_DEVICE_LOST
from resilient.recovery.environment import (
    IN_PROCESS_ENV,
    JOIN_ENV,
    JOIN_STORE_ENV,
    LAUNCH_ENV,
    LAUNCHER_ENV,
    RUN_STATE_ENV,
    STORE_ENV,
    STORE_LEASE_ENV,
    read_launcher_record,
)
from resilient.recovery.policy import EXIT_EVICTED

log = logging.getLogger("resilient.recovery")

#: ``resilient run``'s exit code when the job finished but the agent killed a worker that was
#: still busy with the job's work (e.g. copying the newest checkpoint to its tiers) after its
#: finish grace: that work may be incomplete. 1 is a failed job, as with torchrun.
EXIT_WORKER_KILLED = 4


class WorkerKilledError(RuntimeError):
    """The job finished, but the agent killed workers that were still busy (:data:`EXIT_WORKER_
    KILLED`); ``killed`` lists (global rank, what it was doing)."""

    def __init__(self, killed: list[tuple[int, str]]) -> None:
        self.killed = killed
        what = "; ".join(f"rank {r} while {b}" for r, b in killed)
        super().__init__(f"the job finished, but the launcher killed {len(killed)} worker(s) "
                         f"still busy after the finish grace ({what}): that work may be "
                         "incomplete")


@dataclass
class Verdict:
    """What the agent does with its group after one poll (see :func:`judge`)."""

    state: str  #: "healthy", "succeeded", "failed" or "reap" (kill the workers still running)
    reason: str = ""


@dataclass
class Exit:
    """A worker's exit as the agent saw it."""

    local_rank: int
    code: int
    reaped: bool = False  #: killed by the agent after the others finished (see judge)


def reap_at(finished_at: float, grace_s: float, busy_until: float | None = None) -> float:
    """When a worker still running after the first clean exit (``finished_at``) is killed:
    ``grace_s`` later, or ``grace_s`` after the end of the work it said it is busy with
    (``busy_until``: its announced deadline while busy, the time it ended once done), whichever
    is later (pure)."""
    return max(finished_at, busy_until if busy_until is not None else finished_at) + grace_s


def judge(exits: list[Exit], running: int, *, now: float = 0.0,
          finished_at: float | None = None, grace_s: float = float("inf"),
          busy_until: Sequence[float] = ()) -> Verdict:
    """The group's state from its workers' exits, in the order they were seen (pure).

    A worker that dies while others run is lost, not fatal. The group succeeded when none runs
    and the workers that finished did so with 0; it failed when every worker died, or one failed
    (not reaped) after another finished. Workers still running ``grace_s`` after the first clean
    exit (``finished_at``; ``now`` on the same clock) are to be reaped: ranks finish together, so
    those are ranks the survivors removed (frozen, SIGSTOP) or stuck on the way out; a worker
    busy with the job's work (``busy_until``) gets its grace after that work (:func:`reap_at`).

    Args:
        exits: every worker that exited (replaced ones included).
        running: how many workers still run.
        busy_until: the busy deadlines of those running workers that announced one (at most
            ``running``).
    """
    finished = [i for i, e in enumerate(exits) if e.code == 0]
    if finished:
        late = [e for e in exits[finished[0]:]
                if e.code not in (0, EXIT_EVICTED) and not e.reaped]  # a removal fails nothing
        if late:
            return Verdict("failed", f"local rank {late[0].local_rank} exited with "
                                     f"{late[0].code} after another worker finished")
    if running:
        if finished and finished_at is not None:
            due = [reap_at(finished_at, grace_s, b) for b in busy_until]
            due += [reap_at(finished_at, grace_s)] * (running - len(due))
            late_ones = sum(now >= d for d in due)
            if late_ones:
                return Verdict("reap", f"{late_ones} worker(s) still running {grace_s:g}s after "
                                       "the others finished" + (
                                           " (or after the work they said they were busy with)"
                                           if busy_until else ""))
        return Verdict("healthy")
    if not finished:
        return Verdict("failed", "every worker died")
    return Verdict("succeeded")


class ResilientAgent(LocalElasticAgent):
    """A ``LocalElasticAgent`` that keeps the survivors of a worker's death running (module
    docstring). ``in_process``: False gives torchrun's behaviour; ``replacements``: how many lost
    workers this agent replaces."""

    def __init__(self, spec: WorkerSpec, logs_specs: Any, start_method: str = "spawn",
                 exit_barrier_timeout: float = 300, log_line_prefix_template: str | None = None,
                 *, in_process: bool = True, replacements: int = 0, spares: int = 0,
                 finish_grace_s: float = 30.0, store_ttl_s: float = 60.0) -> None:
        super().__init__(spec, logs_specs, start_method, exit_barrier_timeout,
                         log_line_prefix_template)
        self.in_process = in_process
        self.replacements_left = replacements
        self.spares = spares
        self._spares: list[Any] = []  # handlers of spares waiting to take a lost rank's place
        self.finish_grace_s = finish_grace_s
        self.exits: list[Exit] = []  #: in the order seen
        self.lost: dict[int, ProcessFailure] = {}  #: global rank -> its (first) failure
        self._seen: set[int] = set()  # pids whose exit is recorded
        self._reaped: set[int] = set()  # pids the agent killed after the others finished
        self._finished_at: float | None = None
        self._restart_refused = False
        #: where workers tell the agent about themselves (environment.tell_launcher)
        self.state_dir = tempfile.mkdtemp(prefix="resilient-run-")
        self.killed_busy: list[tuple[int, str]] = []  #: (global rank, its work) killed busy
        self._busy_seen: dict[int, float] = {}  # pid -> when it was first seen busy
        self._lost_at: tuple[float, int] | None = None  # (when, rank): the first lost worker
        self.store_ttl_s = store_ttl_s
        self.launch_id: str | None = None  #: the nonce the agents agreed (RESILIENT_LAUNCH_ID)
        self._lease: Any = None  # resilient.etcd.LeaseKeeper of the workers' etcd keys

    # ---- overrides ----
    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)
        self._agree_launch(worker_group.store)

    def _agree_launch(self, store: Any) -> None:
        """This launch's nonce (and the workers' etcd lease) from the rendezvous's store, which
        is this round's alone: the first agent's proposal wins (module docstring)."""
        from resilient.etcd import LeaseKeeper, from_url

        url = os.environ.get(STORE_ENV, "")
        etcd = from_url(url) if url.startswith(("etcd://", "etcds://")) else None
        lease = LeaseKeeper.grant(etcd, self.store_ttl_s) if etcd is not None else ""
        mine = f"{uuid.uuid4().hex[:12]}:{lease}"
        agreed = store.compare_set("resilient/launch", "", mine)
        agreed = agreed.decode() if isinstance(agreed, bytes) else str(agreed)
        if agreed != mine and lease:
            LeaseKeeper.revoke(etcd, lease)  # another agent's proposal won
        self.launch_id, _, lease = agreed.partition(":")
        os.environ[LAUNCH_ENV] = self.launch_id  # inherited by the workers
        if self._lease is not None:  # an earlier round's (a restart): its keys expire
            self._lease.stop()
            self._lease = None
        if etcd is not None and lease:
            self._lease = LeaseKeeper(etcd, lease, self.store_ttl_s)
            os.environ[STORE_LEASE_ENV] = lease
        log.info("resilient run: launch %s%s", self.launch_id,
                 f", the workers' etcd keys on lease {lease}" if lease else "")

    def release_launch(self, succeeded: bool) -> None:
        """Stops keeping the workers' etcd lease alive; revokes it (every key of the launch
        deleted) when the job succeeded, else it expires in ``store_ttl_s``."""
        if self._lease is not None:
            self._lease.stop(revoke=succeeded)
            self._lease = None

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self.exits, self._seen, self._reaped, self._finished_at = [], set(), set(), None
        self._busy_seen = {}
        self._stop_spares()
        ids = super()._start_workers(worker_group)
        if self.in_process:
            n = worker_group.spec.local_world_size
            env = self._pcontext.envs[0] if self._pcontext else {}
            job_store = f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"
            # A spare starts while the members' first group forms: its one-rank group must not
            # rendezvous on the job's store (it would take rank 0's keys), so it gets a store of
            # its own and finds the job's through RESILIENT_JOIN_STORE.
            self._spares = [self._joiner(0, f"spare{i}", {
                "LOCAL_RANK": str(n + i), "RESILIENT_JOIN_FOR_RANK": "",  # any lost rank
                "TORCHELASTIC_USE_AGENT_STORE": "False",
                "RESILIENT_RECOVERY_JOIN_TIMEOUT_S": "1e9",  # waits until used or finished
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                JOIN_STORE_ENV: job_store}) for i in range(self.spares)]
        return ids

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._stop_spares()
        super()._stop_workers(worker_group)
        if self._lost_at is not None:  # the launcher's own record of how long an end took
            when, rank = self._lost_at
            log.warning("resilient run: the workers stopped %.2f s after rank %d was lost",
                        time.monotonic() - when, rank)
            self._lost_at = None

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM) -> None:
        self._stop_spares()
        super()._shutdown(death_sig)

    def _stop_spares(self) -> None:
        for handler in self._spares:
            if handler.proc.poll() is None:
                os.killpg(handler.proc.pid, signal.SIGKILL)
        self._spares = []

    def _live_spare(self) -> Any | None:
        """A waiting spare (spares that exited are dropped, with a warning if they failed)."""
        while self._spares:
            handler = self._spares.pop(0)
            code = handler.proc.poll()
            if code is None:
                return handler
            if code != 0:
                log.warning("resilient run: spare pid %d exited with %d before it was needed",
                            handler.proc.pid, code)
        return None

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        if not self.in_process:
            return super()._monitor_workers(worker_group)
        pc = self._pcontext
        assert pc is not None
        handlers = pc.subprocess_handlers  # SubprocessContext: one Popen per local rank
        running = 0
        failures: dict[int, ProcessFailure] = {}
        for local_rank, handler in sorted(handlers.items()):
            code = handler.proc.poll()
            if code is None:
                running += 1
                continue
            worker = worker_group.workers[local_rank]
            if handler.proc.pid not in self._seen:
                self._seen.add(handler.proc.pid)
                reaped = handler.proc.pid in self._reaped
                self.exits.append(Exit(local_rank, code, reaped))
                if code == 0 and self._finished_at is None:
                    self._finished_at = time.monotonic()
                if code != 0 and not reaped:
                    failure = ProcessFailure(local_rank=local_rank, pid=handler.proc.pid,
                                             exitcode=code, error_file=pc.error_files[local_rank])
                    self.lost.setdefault(worker.global_rank, failure)
                    if self._lost_at is None:
                        self._lost_at = (time.monotonic(), worker.global_rank)
                    others = sum(h.proc.poll() is None for h in handlers.values())
                    if others and not self._recovers(handlers):
                        log.warning(
                            "resilient run: rank %d (pid %d) exited with %d and no worker "
                            "recovers in process (none started a resilient.Recovery): "
                            "stopping the other %d, as torchrun does", worker.global_rank,
                            handler.proc.pid, code, others)
                        self._stop_spares()
                        return RunResult(state=WorkerState.FAILED, failures={
                            worker.global_rank: failure})
                    log.warning("resilient run: rank %d (pid %d) %s; %d local workers keep "
                                "running (in-process recovery)", worker.global_rank,
                                handler.proc.pid, "was removed from the job by the other ranks "
                                f"(exit {code})" if code == EXIT_EVICTED else
                                f"exited with {code}", others)
                    spare = self._live_spare()  # (another node's survivors may admit it)
                    if spare is not None:
                        handlers[local_rank] = spare
                        worker.id = spare.proc.pid
                        log.warning("resilient run: spare pid %d takes rank %d's place",
                                    spare.proc.pid, worker.global_rank)
                        running += 1
                        continue
                    # a lost device is this process's alone: restarted even when it was the
                    # node's last worker (the job's other ranks are on other nodes)
                    budget = (self._restart_budget(code)
                              if others or code == EXIT_DEVICE_LOST else None)
                    if budget is not None:
                        self._replace(worker_group, local_rank, budget)
                        running += 1
                        continue
            if code != 0 and handler.proc.pid not in self._reaped:
                failures[worker.global_rank] = ProcessFailure(
                    local_rank=local_rank, pid=handler.proc.pid, exitcode=code,
                    error_file=pc.error_files[local_rank])
        if running or self._finished_at is not None:
            # Spares count while the job runs or finishes: an admitted one (this node's spare
            # may fill another node's loss) ends with the others, a waiting one exits 0 when
            # the members finish. With every worker dead and none finished they do not: this
            # node's part of the job failed.
            running += sum(h.proc.poll() is None for h in self._spares)
        busy = self._busy(handlers) if self._finished_at is not None else {}
        now = time.monotonic()
        verdict = judge(self.exits, running, now=now, finished_at=self._finished_at,
                        grace_s=self.finish_grace_s, busy_until=[b for b, _ in busy.values()])
        if verdict.state == "reap":
            assert self._finished_at is not None
            ranks = {h.proc.pid: w.global_rank for w, h in
                     ((worker_group.workers[lr], h) for lr, h in handlers.items())}
            due = [h for h in [*handlers.values(), *self._spares]
                   if h.proc.poll() is None and h.proc.pid not in self._reaped
                   and now >= reap_at(self._finished_at, self.finish_grace_s,
                                      busy.get(h.proc.pid, (None, ""))[0])]
            if due:  # (killed ones may take a moment to exit: not killed, nor logged, again)
                log.warning("resilient run: %s; killing them (removed by the survivors, or "
                            "stuck on the way out)", verdict.reason)
            for handler in due:
                pid = handler.proc.pid
                what = busy.get(pid, (None, ""))[1]
                if what:
                    log.error("resilient run: killing rank %s (pid %d) while it was %s",
                              ranks.get(pid, "?"), pid, what)
                    self.killed_busy.append((ranks.get(pid, -1), what))
                self._reaped.add(pid)
                os.killpg(pid, signal.SIGKILL)
            return RunResult(state=WorkerState.HEALTHY)  # their exits are seen next time
        if verdict.state == "healthy":
            return RunResult(state=WorkerState.HEALTHY)
        self._stop_spares()  # the group ended: a spare still waiting has nothing to join
        if verdict.state == "succeeded":
            return RunResult(state=WorkerState.SUCCEEDED, return_values={
                w.global_rank: None for w in worker_group.workers})
        log.error("resilient run: recovery impossible (%s)", verdict.reason)
        return RunResult(state=WorkerState.FAILED, failures=failures or dict(self.lost))

    def _recovers(self, handlers: dict[int, Any]) -> bool:
        """Whether a live worker (or spare) started a Recovery (environment.tell_launcher)."""
        return any(read_launcher_record(self.state_dir, h.proc.pid).get("recovers")
                   for h in [*handlers.values(), *self._spares] if h.proc.poll() is None)

    def _busy(self, handlers: dict[int, Any]) -> dict[int, tuple[float, str]]:
        """pid -> (until when, what) of the running workers that said they are busy (or were:
        then until when they ended), each deadline capped at the time such work may take
        (:meth:`_busy_cap_s` from when it began)."""
        out = {}
        for handler in handlers.values():
            pid = handler.proc.pid
            if handler.proc.poll() is not None:
                continue
            record = read_launcher_record(self.state_dir, pid)
            until = record.get("busy_until")
            if not isinstance(until, (int, float)):
                continue
            since = record.get("busy_since")
            if not isinstance(since, (int, float)):
                since = self._busy_seen.setdefault(pid, time.monotonic())
            out[pid] = (min(float(until), float(since) + self._busy_cap_s()),
                        str(record.get("busy", "")))
        return out

    def _busy_cap_s(self) -> float:
        """The longest a worker may say it is busy: the tiers' close timeout, plus 10 s for
        their threads' ends (resilient.checkpoint.tiers.Drainer.close)."""
        from resilient import settings

        try:
            return float(settings.get("RESILIENT_TIER_CLOSE_TIMEOUT_S")) + 10.0
        except ValueError:  # the workers refuse it too; the setting's default then
            return 310.0

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        if self.in_process and worker_group.state == WorkerState.HEALTHY:
            if not self._restart_refused:
                self._restart_refused = True
                log.warning("resilient run: nodes wait at the rendezvous; the running workers "
                            "are kept (in-process recovery) and the new nodes wait")
            return
        super()._restart_workers(worker_group)

    # ---- replacements ----
    def _restart_budget(self, code: int) -> str | None:
        """Which budget pays for replacing a worker that exited with ``code``: "replacements"
        (``--replacements``), or "restarts" (``--max-restarts``) for a worker whose device was
        lost (resilient.recovery.device): torchrun would restart the whole group for it, this
        agent restarts that rank alone. None: it is not replaced."""
        if self.replacements_left > 0:
            return "replacements"
        if code == EXIT_DEVICE_LOST and getattr(self, "_remaining_restarts", 0) > 0:
            return "restarts"
        return None

    def _replace(self, worker_group: WorkerGroup, local_rank: int,
                 budget: str = "replacements") -> None:
        """Starts a new process for ``local_rank`` that joins the running job (module
        docstring), paid from ``budget`` (:meth:`_restart_budget`)."""
        pc = self._pcontext
        assert pc is not None
        if budget == "restarts":
            self._remaining_restarts -= 1
            left = self._remaining_restarts
        else:
            self.replacements_left -= 1
            left = self.replacements_left
        handler = self._joiner(local_rank, f"replacement{len(self.exits)}", {})
        pc.subprocess_handlers[local_rank] = handler
        worker_group.workers[local_rank].id = handler.proc.pid
        log.warning("resilient run: started pid %d to replace rank %s (%d %s left)",
                    handler.proc.pid, pc.envs[local_rank].get("RANK", ""), left, budget)

    def _joiner(self, local_rank: int, tag: str, extra: dict[str, str]) -> Any:
        """A process on the join path, with ``local_rank``'s command and environment (a
        one-rank group, so the script's init_process_group does not wait for the job's) and
        its output next to that rank's as ``<file>.<tag>``."""
        pc = self._pcontext
        assert pc is not None
        env = dict(pc.envs[local_rank])
        env.update({JOIN_ENV: "1", "RESILIENT_JOIN_FOR_RANK": env.get("RANK", ""),
                    "RESILIENT_JOIN_WORLD": env.get("WORLD_SIZE", ""),
                    "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", **extra})
        stdout, stderr = pc.stdouts[local_rank], pc.stderrs[local_rank]
        return get_subprocess_handler(
            entrypoint=pc.entrypoint, args=pc.args[local_rank], env=env,
            stdout=f"{stdout}.{tag}" if stdout else stdout,
            stderr=f"{stderr}.{tag}" if stderr else stderr, local_rank_id=local_rank)


def launch(config: Any, entrypoint: str, args: list[str], *, in_process: bool = True,
           replacements: int = 0, spares: int = 0, finish_grace_s: float = 30.0,
           store_ttl_s: float = 60.0) -> dict[int, Any]:
    """``torch.distributed.launcher.api.launch_agent`` with a :class:`ResilientAgent`: the same
    rendezvous handler (from the registry), WorkerSpec and error handling.

    Raises:
        ChildFailedError: the job failed (recovery impossible and no restart left).
    """
    from torch.distributed.elastic import events, metrics
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry
    from torch.distributed.launcher.api import _get_addr_and_port

    if not config.run_id:
        config.run_id = str(uuid.uuid4().int)
    if config.rdzv_backend == "etcd-v3":  # not installed as a package: no entry point then
        from resilient.etcd_rendezvous import register

        register()
    params = RendezvousParameters(
        backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
        min_nodes=config.min_nodes, max_nodes=config.max_nodes, local_addr=config.local_addr,
        **config.rdzv_configs)
    master_addr, master_port = _get_addr_and_port(params)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    # Inherited by the workers (the subprocess handler starts from os.environ).
    os.environ[LAUNCHER_ENV] = "resilient run"
    os.environ[IN_PROCESS_ENV] = "1" if in_process else "0"
    if in_process and (replacements or spares or config.max_restarts):
        # joiners take a lost rank's place, never grow the job past its launch size (a mesh's
        # shape is the script's); a whole job asks the store nothing at its step boundaries
        os.environ.setdefault("RESILIENT_RECOVERY_JOIN_CHECK_EVERY", "1")
        os.environ.setdefault("RESILIENT_RECOVERY_MAX_WORLD", "-1")
    if not in_process:
        # torchrun's restart path: the workers' default group rendezvouses on the agent's store,
        # which outlives the attempt, so a restarted rank may read a dead rank's address left by
        # the previous attempt (gloo: "connectFullMesh failed ... Connection refused"; seen with
        # plain torchrun too). torch's own switch makes rank 0 serve a fresh store per attempt.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if in_process:
        # NCCL: torch's watchdog must not kill a survivor that sees the dead peer's error
        # before Recovery aborts the group, and NCCL's RAS thread can crash while groups are
        # replaced (resilient.comm.nccl_env). The script's own init_process_group creates the
        # first communicator, so the workers get these from the environment.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
        os.environ.setdefault("NCCL_RAS_ENABLE", "0")
    spec = WorkerSpec(
        role=config.role, local_world_size=config.nproc_per_node, entrypoint=entrypoint,
        args=tuple(args), rdzv_handler=rdzv_registry.get_rendezvous_handler(params),
        max_restarts=config.max_restarts, monitor_interval=config.monitor_interval,
        master_addr=master_addr, master_port=master_port, local_addr=config.local_addr,
        event_log_handler=config.event_log_handler, numa_options=config.numa_options,
        duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters,
        virtual_local_rank=config.virtual_local_rank)
    agent = ResilientAgent(spec, config.logs_specs, config.start_method,
                           log_line_prefix_template=config.log_line_prefix_template,
                           in_process=in_process, replacements=replacements, spares=spares,
                           finish_grace_s=finish_grace_s, store_ttl_s=store_ttl_s)
    os.environ[RUN_STATE_ENV] = agent.state_dir
    shutdown_rdzv = True
    succeeded = False
    try:
        metrics.initialize_metrics(metrics.MetricsConfig(config.metrics_cfg))
        result = agent.run()
        succeeded = not result.is_failed()
        events.record(agent.get_event_succeeded(), config.event_log_handler)
        if result.is_failed():
            raise ChildFailedError(name=entrypoint_name(entrypoint, args),
                                   failures=result.failures)
        if agent.killed_busy:
            raise WorkerKilledError(agent.killed_busy)
        return result.return_values
    except (ChildFailedError, WorkerKilledError):
        raise
    except Exception as exc:
        if type(exc).__name__ == "SignalException":
            shutdown_rdzv = False  # torch's launcher leaves the rendezvous open then, too
        events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    finally:
        agent.release_launch(succeeded)
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()
        shutil.rmtree(agent.state_dir, ignore_errors=True)


def entrypoint_name(entrypoint: str, args: Sequence[str]) -> str:
    """The name torchrun's failure banner gives the job: the script (the first argument that
    is not an option when the entrypoint is the Python interpreter: ``python -u train.py``),
    else the entrypoint (``--no-python``)."""
    import sys

    if entrypoint == sys.executable:
        return next((str(a) for a in args if not str(a).startswith("-")), entrypoint)
    return entrypoint


__all__ = ["EXIT_WORKER_KILLED", "JOIN_ENV", "ResilientAgent", "Verdict", "WorkerKilledError",
           "entrypoint_name", "judge", "launch", "reap_at"]
