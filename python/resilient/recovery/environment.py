"""Where a rank runs: which launcher started it, the job's store, and Slurm's variables.

``Recovery.adopt`` takes an ordinary ``torch.distributed`` job as it finds it: the default group
the user created with ``init_process_group`` and the store behind it. This module answers the
questions that depend on the launcher:

* **Which launcher** (:func:`launcher`): ``resilient run`` sets ``RESILIENT_LAUNCHER`` in its
  workers; torchrun's agent sets ``TORCHELASTIC_RUN_ID`` but not that marker. Under plain torchrun
  the agent SIGTERMs every survivor within one monitor interval of a rank's death, so in-process
  recovery never gets to run: :func:`warn_about_launcher` says so, once per process.
* **The store** (:func:`default_group_store`, :func:`job_store`): the default group's store is
  ``PrefixStore("default_pg", <rendezvous store>)``; the rendezvous store is the agent's TCPStore
  under torchrun/``resilient run`` (``TORCHELASTIC_USE_AGENT_STORE=True``), which outlives any rank.
  Recovery's keys go under ``resilient/run/<run id>/`` so that a later attempt of the same job
  (``--max-restarts``), which reuses the agent's store, never reads an earlier attempt's keys.
* **Telling the launcher** (:func:`tell_launcher`, :func:`busy`): ``resilient run``'s agent
  gives each launch a directory (``RESILIENT_RUN_STATE``) where a worker keeps one small record,
  ``<pid>.json``: ``recovers`` once a Recovery started in it (the agent then keeps the survivors
  of a lost rank; without one it stops the group at once, as torchrun does), ``busy_until`` and
  ``busy`` while it does work the job's end must wait for (the tiers' drain in ``close()``: the
  agent's finish grace counts from its end, see resilient.recovery.agent).
* **Slurm** (:func:`slurm_env`, :func:`init_env`): under ``srun`` (one task per rank) nothing
  sets ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``; they are derived from ``SLURM_PROCID``,
  ``SLURM_NTASKS``, ``SLURM_LOCALID`` and the first host of ``SLURM_NODELIST``. With
  ``RESILIENT_STORE=host:port`` (a store hosted outside the ranks) every rank is a client of it;
  otherwise rank 0 hosts the store and rank 0's loss ends the job (warned).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

log = logging.getLogger("resilient.recovery")

#: set by ``resilient run`` in its workers (value: the launcher's name)
LAUNCHER_ENV = "RESILIENT_LAUNCHER"
#: "0" turns in-process recovery off in ``resilient run`` (its workers are then restarted as a
#: group, as torchrun does)
IN_PROCESS_ENV = "RESILIENT_IN_PROCESS_RECOVERY"
#: "1" in a worker that ``resilient run`` started to replace a lost one: Recovery.adopt joins
JOIN_ENV = "RESILIENT_JOIN"
#: the job's store outside the ranks: ``host:port`` of a TCPStore (Slurm without ``resilient
#: run``), or ``etcd://h1:2379,h2:2379/prefix`` (``resilient run --store``: env:// rendezvous
#: on etcd, resilient.etcd)
STORE_ENV = "RESILIENT_STORE"
#: host:port of the job's TCPStore for a spare whose own one-rank group has a private store
JOIN_STORE_ENV = "RESILIENT_JOIN_STORE"
#: set by ``resilient run`` in its workers: a nonce its agents agreed at the rendezvous, unique
#: to the launch (part of :func:`run_id`, so a later launch of the same ``--rdzv-id`` on the
#: same etcd prefix never reads this one's keys)
LAUNCH_ENV = "RESILIENT_LAUNCH_ID"
#: set by ``resilient run --store etcd://...``: the etcd lease the workers attach their keys
#: to (kept alive by the agents; resilient.etcd.LeaseKeeper)
STORE_LEASE_ENV = "RESILIENT_STORE_LEASE"
#: the directory where ``resilient run``'s workers tell the agent about themselves
#: (:func:`tell_launcher`)
RUN_STATE_ENV = "RESILIENT_RUN_STATE"
DEFAULT_SLURM_PORT = 29500

_warned: set[str] = set()
_record: dict[str, Any] = {}
_record_lock = threading.Lock()


def tell_launcher(**fields: Any) -> bool:
    """Merges ``fields`` into this worker's record for ``resilient run``'s agent
    (``$RESILIENT_RUN_STATE/<pid>.json``, replaced atomically); a no-op (False) under any other
    launcher or when the directory cannot be written. Times are ``time.monotonic()`` values
    (CLOCK_MONOTONIC, shared by the processes of a host). Thread-safe."""
    where = os.environ.get(RUN_STATE_ENV, "")
    if not where:
        return False
    with _record_lock:
        _record.update(fields)
        path = os.path.join(where, f"{os.getpid()}.json")
        tmp = f"{path}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(_record, f)
            os.replace(tmp, path)
        except OSError as e:  # the agent then treats this worker as it would any other
            log.debug("cannot tell the launcher %s: %s", fields, e)
            return False
    return True


@contextlib.contextmanager
def busy(what: str, seconds: float) -> Iterator[None]:
    """Tells ``resilient run`` that this worker does ``what`` for at most ``seconds`` (e.g.
    copying the newest checkpoint to its tiers in ``close()``): the agent does not count the
    time until then, or until the block ends, against the worker's finish grace."""
    now = time.monotonic()
    tell_launcher(busy=what, busy_since=now, busy_until=now + max(0.0, seconds))
    try:
        yield
    finally:
        tell_launcher(busy="", busy_until=time.monotonic())


def read_launcher_record(directory: str, pid: int) -> dict[str, Any]:
    """The record worker ``pid`` keeps in ``directory`` (:func:`tell_launcher`); empty when it
    wrote none (or it cannot be read)."""
    try:
        with open(os.path.join(directory, f"{pid}.json")) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def joining() -> bool:
    """Whether this process is a spare or a replacement that ``resilient run`` started to join
    the running job (``RESILIENT_JOIN=1``), and has not joined yet.

    Such a process gets its state from the job's members when it is admitted; the model its
    script builds first, in a one-rank group, is replaced then. With a sharded model
    (``Recovery.adopt(..., build=...)``) build that first model on the meta device, so that a
    spare never holds the whole model::

        model = build("meta" if resilient.joining() else "cuda")
    """
    return os.environ.get(JOIN_ENV) == "1"


def launcher(environ: Mapping[str, str] | None = None) -> str:
    """``"resilient"`` (``resilient run``), ``"torchrun"`` (torch's elastic agent without our
    marker), ``"slurm"`` (srun, no agent) or ``"env"`` (anything else)."""
    env = os.environ if environ is None else environ
    if env.get(LAUNCHER_ENV):
        return "resilient"
    if env.get("TORCHELASTIC_RUN_ID"):
        return "torchrun"
    if env.get("SLURM_PROCID") is not None and env.get("SLURM_NTASKS"):
        return "slurm"
    return "env"


def store_outside_ranks(environ: Mapping[str, str] | None = None) -> bool:
    """Whether every rank is a client of a store hosted elsewhere (an agent's, or
    ``RESILIENT_STORE``), as opposed to a store served by rank 0's process."""
    env = os.environ if environ is None else environ
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def launcher_warnings(environ: Mapping[str, str] | None = None, *,
                      adopted: bool = False) -> list[str]:
    """What is wrong with this launcher for in-process recovery (pure; empty when nothing).
    ``adopted``: the store is the default group's (Recovery.adopt), so where it lives is known."""
    env = os.environ if environ is None else environ
    kind = launcher(env)
    out = []
    if kind == "torchrun":
        out.append(
            "resilient: this job runs under torchrun, whose agent SIGTERMs every surviving rank "
            "as soon as one rank dies, so in-process recovery cannot keep the job running. "
            "Launch it with `resilient run` (same arguments as torchrun, e.g. `resilient run "
            "--standalone --nproc-per-node 4 train.py`), or `python -m resilient.run`.")
    elif kind == "resilient" and env.get(IN_PROCESS_ENV, "1") == "0":
        out.append("resilient: `resilient run --no-in-process-recovery`: a rank's death "
                   "restarts the whole group, as torchrun does")
    if adopted and kind in ("slurm", "env") and not store_outside_ranks(env):
        out.append(
            "resilient: the job's store is served by rank 0's process, so losing rank 0 ends "
            "the job; host it outside the ranks (`resilient run`, or RESILIENT_STORE=host:port "
            "under srun)")
    return out


def warn_about_launcher(environ: Mapping[str, str] | None = None, *,
                        adopted: bool = False) -> list[str]:
    """Called as a Recovery starts: tells ``resilient run`` that this worker recovers in process
    (:func:`tell_launcher`), and logs :func:`launcher_warnings` as warnings, once per node (on
    local rank 0) and once per process; returns those logged now."""
    env = os.environ if environ is None else environ
    if environ is None:
        tell_launcher(recovers=True)
    if env.get("LOCAL_RANK", "0") != "0":
        return []
    said = []
    for message in launcher_warnings(environ, adopted=adopted):
        if message not in _warned:
            _warned.add(message)
            log.warning("%s", message)
            said.append(message)
    return said


def default_group_store() -> Any:
    """The store behind the default process group, without torch's ``default_pg`` prefix (the
    rendezvous store: under an elastic agent, the agent's TCPStore).

    Raises:
        RuntimeError: no default group.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not dist.is_initialized():
        raise RuntimeError("no default process group: call torch.distributed.init_process_group "
                           "first, or pass Recovery a store, rank and world size")
    joining = os.environ.get(JOIN_STORE_ENV, "")
    if joining:  # a spare of `resilient run`: its one-rank group's store is its own
        from datetime import timedelta

        host, _, port = joining.rpartition(":")
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
    return _unprefixed(distributed_c10d._get_default_store())


def _unprefixed(store: Any) -> Any:
    """The store under any PrefixStores around `store`."""
    import torch.distributed as dist

    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def may_be_served_by_a_rank(store: Any) -> bool:
    """Whether `store` can be one that a rank's process serves: a torch TCPStore (its server
    runs in whichever process created it, rank 0's under a bare init_process_group). An etcd
    cluster, or any other store, is not."""
    import torch.distributed as dist

    return isinstance(_unprefixed(store), dist.TCPStore)


def run_id(environ: Mapping[str, str] | None = None) -> str | None:
    """The launch attempt's id: ``<TORCHELASTIC_RUN_ID>.<TORCHELASTIC_RESTART_COUNT>`` under an
    elastic agent (``.<launch nonce>`` added under ``resilient run``: the same ``--rdzv-id``
    launched again is another launch), ``SLURM_JOB_ID.SLURM_STEP_ID`` under srun, else None."""
    env = os.environ if environ is None else environ
    if env.get("TORCHELASTIC_RUN_ID"):
        rid = f"{env['TORCHELASTIC_RUN_ID']}.{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        return f"{rid}.{env[LAUNCH_ENV]}" if env.get(LAUNCH_ENV) else rid
    if env.get("SLURM_JOB_ID"):
        return f"{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '0')}"
    return None


def job_store(store: Any, environ: Mapping[str, str] | None = None) -> Any:
    """``store`` scoped to this launch attempt (``resilient/run/<run id>/``), or ``store`` itself
    when the environment names no attempt (a store created for this run alone)."""
    import torch.distributed as dist

    rid = run_id(environ)
    return store if rid is None else dist.PrefixStore(f"resilient/run/{rid}", store)


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``"node[03-05,9],gpu1"`` -> ``"node03"``
    (what ``scontrol show hostnames | head -1`` prints)."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot parse SLURM_NODELIST {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def slurm_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The torch.distributed variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, and TORCHELASTIC_USE_AGENT_STORE with ``RESILIENT_STORE``) that srun
    does not set, derived from SLURM_*; variables already set are kept (pure; empty outside
    srun or under an agent)."""
    env = os.environ if environ is None else environ
    if launcher(env) != "slurm":
        return {}
    out = {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"],
           "LOCAL_RANK": env.get("SLURM_LOCALID", "0")}
    per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    if per_node.isdigit():
        out["LOCAL_WORLD_SIZE"] = per_node
    if env.get(STORE_ENV) and "://" not in env[STORE_ENV]:  # etcd:// needs no MASTER_*
        host, _, port = env[STORE_ENV].rpartition(":")
        out.update(MASTER_ADDR=host, MASTER_PORT=port, TORCHELASTIC_USE_AGENT_STORE="True")
    else:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
        out.update(MASTER_ADDR=first_host(nodes), MASTER_PORT=str(DEFAULT_SLURM_PORT))
    return {k: v for k, v in out.items() if not env.get(k)}


def init_env() -> dict[str, str]:
    """Sets :func:`slurm_env`'s variables in ``os.environ`` (call before
    ``init_process_group``; a no-op under torchrun or ``resilient run``). Returns what it set."""
    values = slurm_env()
    os.environ.update(values)
    return values


__all__ = ["IN_PROCESS_ENV", "JOIN_ENV", "JOIN_STORE_ENV", "LAUNCHER_ENV", "LAUNCH_ENV",
           "RUN_STATE_ENV", "STORE_ENV", "STORE_LEASE_ENV", "busy", "default_group_store",
           "first_host", "init_env", "job_store", "joining", "launcher", "launcher_warnings",
           "read_launcher_record", "run_id", "slurm_env", "store_outside_ranks",
           "tell_launcher", "warn_about_launcher"]
