"""Failure detection for training ranks: heartbeats, agreed membership and a hang watchdog.

The work happens in the native agent (``resilient._C.detect.Agent``) on its own threads: UDP
heartbeats authenticated with HMAC-SHA256, phi-accrual suspicion, membership generations decided by
compare-and-set on the job's store. This module wires it to a ``torch.distributed`` store, runs the
user's callbacks from one dispatcher thread, and writes a JSON event log. See docs/detector.md.

Example::

    store = torch.distributed.TCPStore(host, port, world_size, is_master=False)
    det = FailureDetector(store, rank, world_size, on_failure=lambda ranks, gen: ...)
    det.start()
    for step in range(n):
        train_step()
        det.step(step + 1)
        if step % 100 == 0:
            with det.section("checkpoint"):
                save()
    det.stop()
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, Callable

from resilient._C import detect as _native
from resilient.store import StoreLike

FailureCallback = Callable[[list, int], None]
HangCallback = Callable[[int, str], None]


def launcher_run_id() -> str | None:
    """The run id the environment names: ``RESILIENT_DETECT_RUN_ID``, else torchrun's
    ``TORCHELASTIC_RUN_ID`` with its restart count (each restart is a run of its own), else None.
    torchrun's default id "none" does not count (it is the same for every job)."""
    explicit = os.environ.get("RESILIENT_DETECT_RUN_ID")
    if explicit:
        return explicit
    elastic = os.environ.get("TORCHELASTIC_RUN_ID")
    if elastic and elastic != "none":
        return f"{elastic}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return None


def agree_run_id(store: StoreLike, job: str, rank: int, world_size: int,
                 timeout: float) -> str:
    """A fresh run id agreed by the ranks through the store, even one reused across runs.

    Every rank publishes a fresh random token under ``hello/<rank>``. Rank 0 draws the run id and
    writes it under ``for/<token>`` for each token it reads, again whenever a rank's token
    changes (it may first read a token left by an earlier run), until each rank acknowledged its
    own token under ``got/<run id>/<token>``. A rank accepts only the value stored under its own
    token, a key no earlier run can have written, so no rank ever takes an earlier run's id.
    Start-up only:
    rank 0 polls O(world) keys every 20 ms while ranks are missing; pass a launcher run id
    (``RESILIENT_DETECT_RUN_ID``, torchrun) to skip this.

    Raises TimeoutError when the ranks do not all take part within ``timeout`` seconds.
    """
    import datetime

    base = f"resilient/detect/{job}/start"
    token = secrets.token_hex(16)
    store.set(f"{base}/hello/{rank}", token)
    if rank != 0:
        try:
            store.wait([f"{base}/for/{token}"], datetime.timedelta(seconds=timeout))
        except RuntimeError as e:  # torch raises DistStoreError (a RuntimeError) on timeout
            raise TimeoutError(f"detector start: no run id from rank 0: {e}") from e
        run_id = bytes(store.get(f"{base}/for/{token}")).decode()
        store.set(f"{base}/got/{run_id}/{token}", "1")
        return run_id
    run_id = secrets.token_hex(16)
    pending = {r: "" for r in range(1, world_size)}
    deadline = time.monotonic() + timeout
    while pending:
        for r, seen in list(pending.items()):
            if seen and store.check([f"{base}/got/{run_id}/{seen}"]):
                del pending[r]
                continue
            if not store.check([f"{base}/hello/{r}"]):
                continue
            current = bytes(store.get(f"{base}/hello/{r}")).decode()
            if current != seen:
                store.set(f"{base}/for/{current}", run_id)
                pending[r] = current
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"detector start: ranks {sorted(pending)} did not take part")
        if pending:
            time.sleep(0.02)
    return run_id


def own_connection(store: Any) -> Any:
    """A client of the same store over a connection of its own (``Store.clone()``), else
    ``store``. A TCPStore client runs one request at a time: a blocking ``get``/``wait`` of
    another thread (a gloo group connecting lazily to a peer that never published its address)
    would hold every other call on that connection until its timeout, the detector's
    compare-and-set of a verdict included."""
    try:
        return store.clone()
    except (AttributeError, NotImplementedError, RuntimeError):
        return store


def local_address_towards(host: str, port: int) -> str:
    """The local address this machine uses to reach ``host`` (no packet is sent): where a
    detector should listen when its store sits on another host."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((socket.gethostbyname(host), port or 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


class FailureDetector:
    """One rank's failure detector.

    Args:
        store: the job's store (``torch.distributed.TCPStore``); must live outside the ranks.
        rank, world_size: this rank and the job size.
        job: job name; packets of other jobs are dropped. Default ``RESILIENT_JOB`` or "default".
        run_id: one id per launch of the job, so a store or job name reused by a later run never
            mixes the runs (store keys and MACs are scoped to it). Default: see launcher_run_id(),
            else one agreed by the ranks through the store at start() (agree_run_id()).
        host: address to bind and publish (default: ``RESILIENT_DETECT_HOST`` or the local address
            facing the store). port: UDP port, 0 for any.
        key: HMAC key (bytes). Default ``RESILIENT_DETECT_KEY``, else one agreed through the store.
        on_failure: ``(ranks, generation)`` when a generation removes ranks (every reason).
        on_hang: ``(rank, section)`` for each rank removed because its training stopped.
        on_evicted: ``(generation)`` when this rank itself was removed.
        event_log: path of a JSON-lines event log (default ``RESILIENT_DETECT_EVENT_LOG``).
        hang_watchdog: watch this rank's step counter (see step()).
        options: attribute overrides for the native CoreOptions, e.g. ``{"heartbeat_interval_s":
            0.05}``; watchdog_options likewise for WatchdogOptions (``{"startup_limit_s": 60}``).
        start_timeout: seconds start() waits for every rank to publish its address.
    """

    def __init__(
        self,
        store: StoreLike,
        rank: int,
        world_size: int,
        *,
        job: str | None = None,
        run_id: str | None = None,
        host: str | None = None,
        port: int = 0,
        key: bytes | None = None,
        on_failure: FailureCallback | None = None,
        on_hang: HangCallback | None = None,
        on_evicted: Callable[[int], None] | None = None,
        event_log: str | None = None,
        hang_watchdog: bool = True,
        options: dict | None = None,
        watchdog_options: dict | None = None,
        start_timeout: float = 60.0,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of {world_size}")
        self._store = store
        self.rank = rank
        self.world_size = world_size
        self.job = job or os.environ.get("RESILIENT_JOB", "default")
        self.run_id: str | None = run_id or launcher_run_id()
        self._prefix = ""
        self._host = host or os.environ.get("RESILIENT_DETECT_HOST") or local_address_towards(
            getattr(store, "host", "127.0.0.1"), getattr(store, "port", 0))
        self._port = port
        self._key = key
        self.on_failure = on_failure
        self.on_hang = on_hang
        self.on_evicted = on_evicted
        self._log_path = event_log or os.environ.get("RESILIENT_DETECT_EVENT_LOG")
        self._log_file: Any = None
        self._start_timeout = start_timeout
        self._opts = _native.AgentOptions()
        self._opts.core = _native.CoreOptions.from_env(rank, world_size)
        self._opts.watchdog = _native.WatchdogOptions.from_env()
        self._opts.hang_watchdog = hang_watchdog
        self._opts.job = self.job
        for name, value in (options or {}).items():
            self.set_option(name, value)
        for name, value in (watchdog_options or {}).items():
            self.set_watchdog_option(name, value)
        self._agent: Any = None
        self._thread: threading.Thread | None = None
        self._running = False
        self._detections = 0
        #: rank -> why the detector removed it ("crash", "unresponsive" or "hang"), so far
        self.removed_reasons: dict[int, str] = {}
        self._last_generation = 0
        self._lock = threading.Lock()

    # ---- settings ----
    def set_option(self, name: str, value: Any) -> None:
        """Sets a CoreOptions field (before start()), e.g. ``heartbeat_interval_s``."""
        if not hasattr(self._opts.core, name):
            raise ValueError(f"unknown detector option {name!r}")
        core = self._opts.core
        setattr(core, name, value)
        self._opts.core = core

    def set_watchdog_option(self, name: str, value: Any) -> None:
        """Sets a WatchdogOptions field, or ``<section>_limit_s`` for a named section."""
        wd = self._opts.watchdog
        if name.endswith("_section_limit_s"):
            wd.set_section_limit(name[: -len("_section_limit_s")], float(value))
        elif hasattr(wd, name):
            setattr(wd, name, value)
        else:
            raise ValueError(f"unknown watchdog option {name!r}")
        self._opts.watchdog = wd

    # ---- lifecycle ----
    def start(self) -> None:
        """Binds, exchanges addresses (and the key) through the store, starts the agent.

        Raises TimeoutError if some rank does not publish its address within start_timeout.
        """
        if self._agent is not None:
            raise RuntimeError("already started")
        self._store = own_connection(self._store)
        if self.run_id is None:
            self.run_id = agree_run_id(self._store, self.job, self.rank, self.world_size,
                                       self._start_timeout)
        # Every key of this run lives under its own prefix: an earlier run's addresses, key and
        # generation records (a store that outlived its workers) are never read.
        self._prefix = f"resilient/detect/{self.job}/run/{self.run_id}"
        self._opts.store_prefix = self._prefix
        self._opts.run_id = self.run_id
        key = self._key or os.environ.get("RESILIENT_DETECT_KEY", "").encode() or None
        if key is None:
            key = bytes(self._store.compare_set(f"{self._prefix}/key", "",
                                                secrets.token_hex(32)))
        self._opts.key = key
        self._opts.addresses = [f"{self._host}:{self._port}"] * self.world_size
        self._agent = _native.Agent(self._opts, self._store)
        self._store.set(f"{self._prefix}/addr/{self.rank}", f"{self._host}:{self._agent.port}")
        keys = [f"{self._prefix}/addr/{r}" for r in range(self.world_size)]
        try:
            import datetime

            self._store.wait(keys, datetime.timedelta(seconds=self._start_timeout))
        except RuntimeError as e:  # torch raises DistStoreError (a RuntimeError) on timeout
            self._agent = None
            raise TimeoutError(f"detector start: ranks did not publish addresses: {e}") from e
        self._agent.set_addresses([bytes(self._store.get(k)).decode() for k in keys])
        if self._log_path:
            self._log_file = open(self._log_path, "a", buffering=1)  # noqa: SIM115
        self._agent.start()
        self._running = True
        self._log({"kind": "start", "world_size": self.world_size, "port": self._agent.port,
                   "run_id": self.run_id})
        self._thread = threading.Thread(target=self._dispatch, name="resilient-detect", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops the agent and the dispatcher (idempotent)."""
        if self._agent is None:
            return
        self._running = False
        self._agent.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._log({"kind": "stop"})
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> FailureDetector:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- training loop hooks ----
    def step(self, n: int) -> None:
        """Reports training progress (a cheap store into an atomic counter)."""
        if self._agent is not None:
            self._agent.set_step(int(n))

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Runs the body under the named section's hang limit (e.g. "checkpoint")."""
        if self._agent is not None:
            self._agent.enter_section(name)
        try:
            yield
        finally:
            if self._agent is not None:
                self._agent.leave_section()

    # ---- state ----
    @property
    def store_prefix(self) -> str:
        """Where this run's detector keys live: ``resilient/detect/<job>/run/<run id>`` (set by
        start()); generation g's record is ``<store_prefix>/gen/<g>``."""
        return self._prefix

    @property
    def generation(self) -> tuple:
        """(generation number, sorted live ranks)."""
        if self._agent is None:
            return (0, list(range(self.world_size)))
        return tuple(self._agent.generation())

    def metrics(self) -> dict:
        """Counters, per-peer phi and RTT, generation: a dict ready for Prometheus export."""
        m = self._agent.metrics() if self._agent is not None else {}
        m["detections"] = self._detections
        m["rank"] = self.rank
        return m

    def prometheus_collector(self) -> Any:
        """A prometheus_client collector exposing metrics() as resilient_detect_* series."""
        return DetectorCollector(self)

    # ---- internals ----
    def _log(self, record: dict) -> None:
        if self._log_file is None:
            return
        record = dict(record)
        if "rank" in record:  # the event's subject; "rank" below is the reporting rank
            record["subject"] = record.pop("rank")
        now_wall = time.time()
        mono = record.pop("time", None)  # native events carry CLOCK_MONOTONIC seconds
        if mono is not None:
            record["time_mono"] = mono
            now_wall -= max(0.0, time.monotonic() - mono)
        record = {"time_wall": now_wall, "rank": self.rank, "job": self.job, **record}
        with self._lock:
            self._log_file.write(json.dumps(record) + "\n")

    def _dispatch(self) -> None:
        while self._running:
            for ev in self._agent.poll_events(0.2):
                self._log(ev)
                self._handle(ev)
        for ev in self._agent.poll_events(0.0):  # flush what stop() left
            self._log(ev)

    def _handle(self, ev: dict) -> None:
        kind = ev["kind"]
        try:
            if kind == "generation" and ev["removed"]:
                self._detections += len(ev["removed"])
                self.removed_reasons.update({r["rank"]: r["reason"] for r in ev["removed"]})
                if self.on_failure:
                    self.on_failure([r["rank"] for r in ev["removed"]], ev["generation"])
                for r in ev["removed"]:
                    if r["reason"] == "hang" and self.on_hang:
                        self.on_hang(r["rank"], r["section"])
            elif kind == "evicted" and self.on_evicted:
                self.on_evicted(ev["generation"])
        except Exception as e:  # a failing callback must not kill detection
            self._log({"kind": "callback_error", "error": repr(e)})


_PROM_COUNTERS = (
    "messages_sent", "messages_received", "pings_sent", "acks_received", "suspicions",
    "confirmations", "proposals", "generations", "store_errors", "refused", "refusals",
    "dropped_malformed", "dropped_bad_mac", "dropped_other_job", "dropped_other_run",
    "dropped_version", "dropped_unknown_source", "dropped_replay", "dropped_stale",
    "dropped_misdirected", "ignored_claims", "detections")


class DetectorCollector:
    """Collects resilient_detect_* series from one FailureDetector at scrape time."""

    def __init__(self, detector: Any) -> None:
        self._det = detector

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        m = self._det.metrics()
        rank = str(m.get("rank", -1))
        for name in _PROM_COUNTERS:
            c = CounterMetricFamily(
                f"resilient_detect_{name}", name.replace("_", " "), labels=["rank"])
            c.add_metric([rank], float(m.get(name, 0)))
            yield c
        g = GaugeMetricFamily(
            "resilient_detect_generation", "membership generation", labels=["rank"])
        g.add_metric([rank], float(m.get("generation", 0)))
        yield g
        phi = GaugeMetricFamily("resilient_detect_phi", "suspicion level", labels=["rank", "peer"])
        rtt = GaugeMetricFamily("resilient_detect_rtt_ms", "heartbeat RTT", labels=["rank", "peer"])
        for p in m.get("peers", []):
            phi.add_metric([rank, str(p["rank"])], p["phi"])
            rtt.add_metric([rank, str(p["rank"])], p["rtt_ms"])
        yield phi
        yield rtt


__all__ = ["DetectorCollector", "FailureDetector", "StoreLike", "agree_run_id",
           "launcher_run_id", "own_connection"]
