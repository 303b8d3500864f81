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
"""

from __future__ import annotations

import base64
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    create_handler,
)

from resilient.etcd import EtcdStore, from_url

BACKEND = "etcd-v3"


class EtcdRendezvousBackend(RendezvousBackend):
    """The dynamic rendezvous's state as one etcd key; the token is the key's revision."""

    def __init__(self, store: EtcdStore, run_id: str) -> None:
        self._store = store
        self._key = f"rdzv/{run_id}/state"

    @property
    def name(self) -> str:
        return BACKEND

    def get_state(self) -> tuple[bytes, Any] | None:
        kv = self._store._range(self._key)  # linearizable: the newest committed state
        if kv is None:
            return None
        return base64.b64decode(kv.get("value", "")), kv["mod_revision"]

    def set_state(self, state: bytes, token: Any | None = None) -> tuple[bytes, Any, bool] | None:
        """Writes `state` if the key is still at revision `token` (None: absent); returns the
        state now stored, its token and whether it is this call's."""
        key = self._store._key(self._key)
        if token is None:
            cmp = {"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        else:
            cmp = {"key": key, "target": "MOD", "result": "EQUAL", "mod_revision": str(token)}
        reply = self._store._post("/v3/kv/txn", {
            "compare": [cmp],
            "success": [{"request_put": {"key": key,
                                         "value": base64.b64encode(state).decode()}}],
            "failure": [{"request_range": {"key": key}}],
        })
        if reply.get("succeeded"):
            return state, reply["header"]["revision"], True  # the put's revision
        kvs = reply["responses"][0].get("response_range", {}).get("kvs")
        if not kvs:  # deleted meanwhile: no state to report
            return None
        return base64.b64decode(kvs[0].get("value", "")), kvs[0]["mod_revision"], False


def _store(params: RendezvousParameters) -> EtcdStore:
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
    return create_handler(store, EtcdRendezvousBackend(store, params.run_id), params)


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
