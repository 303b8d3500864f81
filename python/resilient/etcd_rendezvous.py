"""torch elastic's rendezvous on etcd v3: ``--rdzv-backend etcd-v3``.

The agents of ``resilient run`` (and of plain ``torchrun``, through the ``torchrun.handlers``
entry point) meet with torch's dynamic rendezvous, whose whole state is one value that agents
replace by compare-and-swap. With ``c10d`` that value lives in a TCPStore served by the
``--rdzv-endpoint`` host, whose loss stops every later rendezvous (a restart, a node joining).
Here it is one etcd key, swapped in a transaction on its revision, on a cluster that survives
the loss of a minority of its members; the rendezvous's other keys (its barriers, the keep-alive
of each node, the workers' master address) go to the same cluster through
:class:`resilient.etcd.EtcdStore`.

    resilient run --nnodes 2 --nproc-per-node 8 --rdzv-backend etcd-v3 \\
        --rdzv-endpoint h1:2379,h2:2379,h3:2379 --rdzv-id job42 train.py

``--rdzv-endpoint`` takes the members (``host:port,...``) or an ``etcd://``/``etcds://`` URL
with its TLS options and user (docs/store.md). torch's ``etcd`` and ``etcd-v2`` backends speak
etcd's v2 API, which etcd 3.4 serves only with ``--enable-v2`` and 3.6 no longer has.

**Launched again with the same ``--rdzv-id``.** The state and every key the rendezvous writes
are attached to an etcd lease that each agent keeps alive while it runs; they expire ``ttl``
seconds (``--rdzv-conf ttl=...``, default two hours) after the last agent stopped. A new launch
does not wait for that: an agent that finds the rendezvous closed by a finished launch (it was
none of its nodes) starts a new one over it, and a rendezvous that is absent (never used, or
expired) starts at a round numbered by etcd's revision, which no earlier round of this
``--rdzv-id`` can have had. torch names every key of a round by its number, so a new launch never
reads an earlier one's keys (its ``MASTER_ADDR``, barriers, assigned ranks). A launch whose
agents were all killed leaves its round complete; torch removes the dead nodes once their
keep-alives are ``keep_alive_interval x keep_alive_max_attempt`` (15 s) old and the next launch
meets in the next round then. (A node of the same launch that arrives after the others finished
now waits for a new rendezvous instead of failing at once.) Errors reaching etcd surface as
torch's ``RendezvousConnectionError``.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import os
import pickle
import threading
import time
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    create_handler,
)

BACKEND = "etcd-v3"
DEFAULT_TTL_S = 7200  # torch's etcd-v2 backend's default
_UNREACHABLE = (OSError, ValueError, http.client.HTTPException)  # what EtcdStore raises


class EtcdRendezvousBackend(RendezvousBackend):
    """The dynamic rendezvous's state as one etcd key; the token is the key's revision. The key
    is attached to this agent's lease on every write, so it expires `ttl_s` after the last
    write of any agent (each agent writes its keep-alive into it every few seconds)."""

    def __init__(self, store: Any, run_id: str, ttl_s: int = DEFAULT_TTL_S) -> None:
        self._store = store  # a resilient.etcd.EtcdStore
        self._key = f"rdzv/{run_id}/state"
        self._ttl_s = int(ttl_s)
        self._lease: str | None = None
        self._lease_refreshed = 0.0
        self._lock = threading.RLock()
        #: this agent's node (torch's _NodeDesc), set by create_etcd_v3_handler: a closed
        #: rendezvous it took part in is its own launch's, not an earlier one's
        self.node: Any = None

    @property
    def name(self) -> str:
        return BACKEND

    def get_state(self) -> tuple[bytes, Any] | None:
        try:  # linearizable: the newest committed state
            reply = self._store._post("/v3/kv/range", {"key": self._store._key(self._key)})
        except _UNREACHABLE as e:
            raise RendezvousConnectionError(f"etcd rendezvous: reading the state: {e}") from e
        kvs = reply.get("kvs")
        if not kvs:
            return self._new_rendezvous(reply, None)
        return self._current(_decode(kvs[0].get("value", "")), kvs[0]["mod_revision"], reply)

    def _current(self, state: bytes, token: Any, reply: dict) -> tuple[bytes, Any] | None:
        """`state` as torch should see it: a new rendezvous instead of one closed by an
        earlier launch (module docstring)."""
        if self._closed_by_another_launch(state):
            return self._new_rendezvous(reply, token)
        return state, token

    def _closed_by_another_launch(self, state: bytes) -> bool:
        try:
            st = pickle.loads(state)  # torch's _RendezvousState, as its state holder reads it
        except Exception:  # noqa: BLE001 -- not torch's: leave it to torch
            return False
        if not getattr(st, "closed", False):
            return False
        nodes = [*getattr(st, "participants", {}), *getattr(st, "wait_list", ()),
                 *getattr(st, "redundancy_list", ())]
        if self.node is not None:
            return self.node not in nodes
        return all(getattr(n, "pid", None) != os.getpid() for n in nodes)

    def _new_rendezvous(self, reply: dict, token: Any) -> tuple[bytes, Any] | None:
        """An empty rendezvous whose round is the cluster's revision now (never the number of
        an earlier round of this run id), to be written over `token` (None: absent)."""
        try:
            from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
                _RendezvousState,
            )
        except ImportError:  # torch without it: its own fresh state (round 0)
            return None
        state = _RendezvousState()
        state.round = int(reply.get("header", {}).get("revision", 0))
        return pickle.dumps(state), token

    def set_state(self, state: bytes, token: Any | None = None) -> tuple[bytes, Any, bool] | None:
        """Writes `state` if the key is still at revision `token` (None: absent); returns the
        state now stored, its token and whether it is `state` (as torch's c10d backend: a
        transaction retried after it was applied finds its own state)."""
        key = self._store._key(self._key)
        if token is None:
            cmp = {"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        else:
            cmp = {"key": key, "target": "MOD", "result": "EQUAL", "mod_revision": str(token)}
        try:
            for retry in (False, True):
                put = {"key": key, "value": base64.b64encode(state).decode(),
                       "lease": self._current_lease(renew=retry)}
                try:
                    reply = self._store._post("/v3/kv/txn", {
                        "compare": [cmp], "success": [{"request_put": put}],
                        "failure": [{"request_range": {"key": key}}]})
                    break
                except ValueError as e:  # the lease expired meanwhile: a new one, once
                    if retry or "lease not found" not in str(e):
                        raise
        except _UNREACHABLE as e:
            raise RendezvousConnectionError(f"etcd rendezvous: writing the state: {e}") from e
        if reply.get("succeeded"):
            return state, reply["header"]["revision"], True  # the put's revision
        kvs = reply["responses"][0].get("response_range", {}).get("kvs")
        if not kvs:  # deleted meanwhile (expired): no state to report
            return None
        stored = _decode(kvs[0].get("value", ""))
        if stored == state:
            return stored, kvs[0]["mod_revision"], True
        now = self._current(stored, kvs[0]["mod_revision"], reply)
        return None if now is None else (*now, False)

    def lease(self) -> str:
        """This agent's lease (granted on first use, kept alive): the rendezvous's keys go
        with it (the store's ``lease``)."""
        return self._current_lease()

    def _current_lease(self, renew: bool = False) -> str:
        """This agent's lease, granted on first use and kept alive at a quarter of its TTL."""
        with self._lock:
            now = time.monotonic()
            if self._lease is not None and not renew:
                if now - self._lease_refreshed < self._ttl_s / 4:
                    return self._lease
                reply = self._store._post("/v3/lease/keepalive", {"ID": self._lease})
                if int(reply.get("result", {}).get("TTL", 0)) > 0:
                    self._lease_refreshed = now
                    return self._lease
            reply = self._store._post("/v3/lease/grant", {"TTL": self._ttl_s})
            self._lease, self._lease_refreshed = reply["ID"], now
            return self._lease


def _decode(value: str) -> bytes:
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RendezvousStateError(f"etcd rendezvous: the state is not valid base64: {e}") from e


def _store(params: RendezvousParameters) -> Any:
    from resilient.etcd import EtcdStore, from_url  # here: torchrun loads this module at start

    endpoint = params.endpoint or ""
    timeout = timedelta(seconds=params.get_as_int("read_timeout", 60) or 60)
    prefix = f"torchelastic/{params.run_id}/"
    if endpoint.startswith(("etcd://", "etcds://")):
        store = from_url(endpoint, timeout=timeout)
        if store.prefix and not store.prefix.endswith(b"/"):
            store.prefix += b"/"
        store.prefix += prefix.encode()
        return store
    hosts = [h.strip() for h in endpoint.split(",") if h.strip()]
    if not hosts:
        raise ValueError("--rdzv-backend etcd-v3 needs --rdzv-endpoint host:port[,host:port...] "
                         "(the etcd members) or an etcd:// URL")
    return EtcdStore(hosts, prefix, timeout=timeout)


def create_etcd_v3_handler(params: RendezvousParameters) -> Any:
    """torch elastic's handler creator for ``etcd-v3`` (its registry calls it)."""
    store = _store(params)
    ttl = params.get_as_int("ttl", DEFAULT_TTL_S) or DEFAULT_TTL_S
    backend = EtcdRendezvousBackend(store, params.run_id, ttl)
    store.lease = backend.lease  # every key of the rendezvous expires with its state
    handler = create_handler(store, backend, params)
    backend.node = getattr(handler, "_this_node", None)  # (torch's own, kept since 1.9)
    return handler


def handler_creator() -> Any:
    """The ``torchrun.handlers`` entry point: returns the creator torchrun registers."""
    return create_etcd_v3_handler


def register() -> None:
    """Registers ``etcd-v3`` with torch elastic's rendezvous registry (once)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

    try:
        registry.register(BACKEND, create_etcd_v3_handler)
    except ValueError:  # registered already (by the entry point, or an earlier call)
        pass


__all__ = ["BACKEND", "EtcdRendezvousBackend", "create_etcd_v3_handler", "register"]
