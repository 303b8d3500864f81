"""The job's store on an etcd v3 cluster: no single process whose loss ends the job.

:class:`EtcdStore` is a ``torch.distributed.Store`` (so it serves ``init_process_group(store=)``,
the checkpointer's agreement, the failure detector and recovery through the one native adapter,
resilient.store) that talks to etcd's v3 JSON gateway (``POST /v3/kv/...``, keys and values
base64) with the standard library's HTTP client: no gRPC stack in the training process, and etcd
3.4 (Debian's ``etcd-server``) serves the gateway on its client port. Importing this module
also makes ``init_process_group(init_method="etcd://h1:2379,h2:2379/job42", rank=r,
world_size=n)`` rendezvous through etcd, so the default group's store, which Recovery.adopt,
the Checkpointer and the detector use, is etcd. Why etcd and how to run it: docs/store.md.

- Every request goes to one member; a member that refuses, resets or does not answer within a
  quarter of ``timeout`` (0.5 to 1 s: a member holds a request through a leader election)
  is left for the next one, round the list, until the call's deadline
  (``timeout``): then ``TimeoutError`` (some member was reached but did not answer) or
  ``ConnectionError`` (none could be reached). etcd answers only with a quorum, so a member cut
  off with a minority times out instead of answering: the minority side cannot decide.
- Waiting for a key may take up to ``timeout`` (the process group's 30 min under
  ``init_process_group``), but no single request waits longer than ``reach_timeout`` (15 s)
  for the cluster to answer: a cluster without a quorum (a majority of its members down, or
  this host cut off from them) fails every call within that bound, as
  :class:`StoreUnreachableError` (a ``TimeoutError`` or ``ConnectionError`` as above, and a
  ``torch.distributed.DistError``, so Recovery treats it as the store's failure and stops with
  "the job's store is unreachable" instead of hanging in a checkpoint's store call).
- Reads are linearizable (etcd's default); ``compare_set`` is one transaction; ``add`` is a
  compare-and-swap loop on the key's revision; ``wait`` polls (10 ms, then backing off to 100 ms).
- Keys live under ``prefix`` (one run's keys apart from another's); TLS (``ca``, ``cert``,
  ``key``) and etcd's user/password authentication (a token in each request's Authorization
  header, renewed when etcd rejects it) are options; the password is never logged or put in an
  error message.
- With ``lease`` every key written is attached to that etcd lease, and goes when it expires or
  is revoked: ``resilient run`` grants one per launch and keeps it alive from its agents
  (:class:`LeaseKeeper`), so a launch's keys do not outlive it (docs/store.md).
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import torch.distributed as dist
from torch.distributed.rendezvous import register_rendezvous_handler

from resilient import settings

_AUTH_ERRORS = ("invalid auth token", "user name is empty", "permission denied",
                "authentication failed", "auth: ")
_RETRYABLE = (ConnectionError, TimeoutError, OSError, http.client.HTTPException)


#: how long one request may wait for the cluster to answer at all (no quorum, no member)
DEFAULT_REACH_TIMEOUT = timedelta(seconds=15)
_RETRY_WHILE_DOWN_S = 2.0  # a request's bound after one found the cluster unreachable


class StoreUnreachableError(dist.DistError):
    """The etcd cluster did not answer a request within the store's ``reach_timeout`` (or the
    call's own deadline). One of the two below, which torch and Recovery take as the store's
    failure (``torch.distributed.DistError``)."""


class StoreTimeoutError(StoreUnreachableError, dist.DistStoreError, TimeoutError):
    """A member was reached but no answer came in time: no quorum, an election, overload (the
    native adapter's kTimeout)."""


class StoreConnectionError(StoreUnreachableError, dist.DistNetworkError, ConnectionError):
    """No member of the cluster could be reached: all refused or reset the connection (the
    native adapter's kUnavailable)."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class EtcdStore(dist.Store):
    """A torch.distributed.Store on etcd v3 (module docstring).

    Args:
        endpoints: ``"host:port"`` of the cluster's members (their client URLs), tried in turn.
        prefix: every key is stored as ``prefix + key``.
        timeout: bound of every call (and the default of ``wait``).
        ca, cert, key: TLS: the CA file that signed the members' certificates, and this
            client's certificate and key (https when ``ca`` is given).
        user, password: etcd authentication.
        reach_timeout: bound of each request, however long the call may wait for a key: a
            cluster that does not answer for this long (no quorum) fails the call with
            :class:`StoreUnreachableError` (at most ``timeout``).
        lease: the etcd lease id every written key is attached to (or a function returning
            the current one); None: keys stay until deleted.
    """

    def __init__(self, endpoints: list[str], prefix: str = "", *,
                 timeout: timedelta = timedelta(seconds=30), ca: str | None = None,
                 cert: str | None = None, key: str | None = None, user: str | None = None,
                 password: str | None = None,
                 reach_timeout: timedelta = DEFAULT_REACH_TIMEOUT,
                 lease: str | Callable[[], str] | None = None) -> None:
        super().__init__()
        if not endpoints:
            raise ValueError("EtcdStore needs at least one endpoint (host:port)")
        self.endpoints = [self._split(e) for e in endpoints]
        self.prefix = prefix.encode()
        self._timeout = timeout.total_seconds()
        self._reach = reach_timeout.total_seconds()
        if self._reach <= 0:
            raise ValueError(f"reach_timeout must be > 0 s, not {self._reach:g}")
        self._ssl = None
        if ca or cert:
            self._ssl = ssl.create_default_context(cafile=ca)
            if cert:
                self._ssl.load_cert_chain(cert, key)
        self._user, self._password = user, password
        self._token: str | None = None
        self._next = 0  # the member that answered last
        self._down = False  # the last request found the cluster unreachable
        self.lease = lease
        self._lock = threading.Lock()
        self._clones: list[EtcdStore] = []

    @staticmethod
    def _split(endpoint: str) -> tuple[str, int]:
        host, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise ValueError(f"etcd endpoint {endpoint!r} is not host:port")
        return host.strip("[]"), int(port)

    # -- transport --------------------------------------------------------------------------
    def _post(self, path: str, body: dict, deadline: float | None = None) -> dict:
        """One request to the first member that answers before `deadline` (default: the
        store's timeout), and within the store's reach timeout."""
        now = time.monotonic()
        # Once a request found the cluster unreachable, the next ones try for a short while
        # only (what the job does next is stop: its exit's store calls must not each take
        # the reach timeout); the first answer restores the full bound.
        reach = min(self._reach, _RETRY_WHILE_DOWN_S) if self._down else self._reach
        deadline = now + self._timeout if deadline is None else deadline
        reach_bound = now + reach <= deadline  # a failure then is the cluster's, not the call's
        deadline = min(deadline, now + reach)
        bound = max(0.0, deadline - now)
        errors: list[str] = []
        answered = False
        with self._lock:
            start = self._next
        n = len(self.endpoints)
        attempt = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            i = (start + attempt) % n
            attempt += 1
            host, port = self.endpoints[i]
            try:  # one member may hold a request through an election: try others in time
                reply = self._request(host, port, path, body,
                                      min(left, max(0.5, min(1.0, self._timeout / 4))))
            except PermissionError:
                raise
            except _RETRYABLE as e:
                answered = answered or isinstance(e, (TimeoutError, http.client.HTTPException))
                errors.append(f"{host}:{port}: {type(e).__name__}: {e}")
                if attempt % n == 0:  # every member failed once: pause before the next round
                    time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
                continue
            with self._lock:
                self._next = i
            self._down = False
            return reply
        self._down = reach_bound
        why = "; ".join(errors[-len(self.endpoints):]) or "no time left"
        members = ",".join(f"{h}:{p}" for h, p in self.endpoints)
        if answered or not errors:
            raise StoreTimeoutError(f"etcd ({members}) did not answer {path} within {bound:.3g} s "
                                    f"(no quorum?): {why}")
        raise StoreConnectionError(f"no etcd member ({members}) reachable for {path}: {why}")

    def _request(self, host: str, port: int, path: str, body: dict, left: float) -> dict:
        if self._ssl is not None:
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                host, port, timeout=left, context=self._ssl)
        else:
            conn = http.client.HTTPConnection(host, port, timeout=left)
        try:
            for retry in (False, True):
                headers = {"Content-Type": "application/json"}
                if self._user is not None and path != "/v3/auth/authenticate":
                    if self._token is None or retry:
                        self._token = self._authenticate(conn)
                    headers["Authorization"] = self._token
                conn.request("POST", path, json.dumps(body), headers)
                resp = conn.getresponse()
                data = resp.read()
                if resp.status == 200:
                    return json.loads(data or b"{}")
                text = data.decode(errors="replace")[:300]
                if resp.status in (401, 403) or any(m in text for m in _AUTH_ERRORS):
                    if retry or self._user is None or "invalid auth token" not in text:
                        raise PermissionError(f"etcd refused {path}: {resp.status} {text}")
                    continue  # an expired token: authenticate again, once
                if resp.status >= 500:  # no leader, or the member lost its quorum
                    raise http.client.HTTPException(f"{resp.status} {text}")
                raise ValueError(f"etcd rejected {path}: {resp.status} {text}")
            raise AssertionError("unreachable")
        finally:
            conn.close()

    def _authenticate(self, conn: http.client.HTTPConnection) -> str:
        conn.request("POST", "/v3/auth/authenticate",
                     json.dumps({"name": self._user, "password": self._password}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise PermissionError(f"etcd authentication of user {self._user!r} failed: "
                                  f"{resp.status}")  # never the password
        return json.loads(data)["token"]

    def probe(self, within_s: float) -> str | None:
        """Why the cluster did not answer one linearizable read within ``within_s`` seconds;
        None when it answered. On the caller's thread (each request is bounded), so no thread
        is left waiting on an unreachable cluster (resilient.store.unreachable)."""
        try:
            self._post("/v3/kv/range", {"key": self._key("__resilient_probe"),
                                        "count_only": True}, time.monotonic() + within_s)
        except StoreUnreachableError as e:
            return f"{type(e).__name__}: {e}"
        return None

    # -- key/value ----------------------------------------------------------------------------
    def _key(self, key: str) -> str:
        return _b64(self.prefix + key.encode())

    def _put(self, key: str, value: bytes) -> dict:
        """A put request's body: `key` (already encoded) = `value`, on the store's lease."""
        body = {"key": key, "value": _b64(value)}
        lease = self.lease() if callable(self.lease) else self.lease
        if lease:
            body["lease"] = lease
        return body

    def _range(self, key: str, deadline: float | None = None) -> dict | None:
        kvs = self._post("/v3/kv/range", {"key": self._key(key)}, deadline).get("kvs")
        return kvs[0] if kvs else None

    def set(self, key: str, value: bytes | str) -> None:
        self._post("/v3/kv/put", self._put(self._key(key), _bytes(value)))

    def get(self, key: str) -> bytes:
        """The value; waits for the key up to the store's timeout, as torch's stores do."""
        self.wait([key])
        kv = self._range(key)
        if kv is None:
            raise KeyError(key)
        return base64.b64decode(kv.get("value", ""))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """Sets `desired` when the key holds `expected` (or is absent and `expected` is empty);
        returns the value after the call (torch's semantics: `expected` for an absent key and a
        non-empty `expected`)."""
        expected_b, desired_b = _bytes(expected), _bytes(desired)
        k = self._key(key)
        if expected_b:
            cmp = {"key": k, "target": "VALUE", "result": "EQUAL", "value": _b64(expected_b)}
        else:
            cmp = {"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        reply = self._post("/v3/kv/txn", {
            "compare": [cmp],
            "success": [{"request_put": self._put(k, desired_b)}],
            "failure": [{"request_range": {"key": k}}],
        })
        if reply.get("succeeded"):
            return desired_b
        kvs = reply["responses"][0].get("response_range", {}).get("kvs")
        return base64.b64decode(kvs[0].get("value", "")) if kvs else expected_b

    def add(self, key: str, amount: int) -> int:
        """Atomically adds `amount` to the integer in `key` (absent: 0); returns the sum.

        A compare-and-swap on the key's revision that also writes a receipt key: a request
        that timed out may still have been applied by etcd, and a retry of it (on another
        member) then finds the revision changed; the receipt tells "my earlier try was applied"
        from "another rank's add came first", so no add counts twice."""
        deadline = time.monotonic() + self._timeout
        k = self._key(key)
        receipt = self._key(f"__resilient_add/{os.urandom(12).hex()}")
        while True:
            kv = self._range(key, deadline)
            if kv is None:
                current, cmp = 0, {"key": k, "target": "CREATE", "result": "EQUAL",
                                   "create_revision": "0"}
            else:
                current = int(base64.b64decode(kv.get("value", "")) or b"0")
                cmp = {"key": k, "target": "MOD", "result": "EQUAL",
                       "mod_revision": kv["mod_revision"]}
            total = str(current + int(amount)).encode()
            reply = self._post("/v3/kv/txn", {
                "compare": [cmp],
                "success": [{"request_put": self._put(k, total)},
                            {"request_put": self._put(receipt, total)}],
                "failure": [{"request_range": {"key": receipt}}],
            }, deadline)
            done = reply.get("succeeded")
            if not done:
                kvs = reply["responses"][0].get("response_range", {}).get("kvs")
                done = bool(kvs)  # an earlier try of this request was applied
            if done:
                try:
                    self._post("/v3/kv/deleterange", {"key": receipt}, deadline)
                except _RETRYABLE:
                    pass  # a leftover receipt is harmless
                return int(total)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"etcd add to {key!r} kept conflicting for "
                                   f"{self._timeout:g} s")

    def check(self, keys: list[str]) -> bool:
        return all(self._range(k) is not None for k in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = self._timeout if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + limit
        delay = 0.01
        while True:
            if self.check(keys):
                return
            if time.monotonic() + delay > deadline:
                raise TimeoutError(f"etcd keys {keys} not set within {limit:g} s")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.1)

    def delete_key(self, key: str) -> bool:
        reply = self._post("/v3/kv/deleterange", {"key": self._key(key)})
        return int(reply.get("deleted", 0)) > 0

    def num_keys(self) -> int:
        end = self.prefix[:-1] + bytes([self.prefix[-1] + 1]) if self.prefix else b"\0"
        reply = self._post("/v3/kv/range", {"key": _b64(self.prefix or b"\0"),
                                            "range_end": _b64(end), "count_only": True})
        return int(reply.get("count", 0))

    def clone(self) -> EtcdStore:
        """A store on the same cluster and prefix (torch's gloo asks for one per connection)."""
        other = EtcdStore.__new__(EtcdStore)
        dist.Store.__init__(other)
        other.__dict__.update({k: v for k, v in self.__dict__.items() if k != "_lock"})
        other._lock = threading.Lock()
        self._clones.append(other)  # torch holds only its C++ half (see _rendezvous)
        return other

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        for k, v in zip(keys, values):
            self.set(k, v)

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout.total_seconds()

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self._timeout)


class LeaseKeeper:
    """An etcd lease kept alive from a thread (every third of its TTL) until :meth:`stop`.

    ``resilient run``'s agents share one per launch: the keys the launch's workers write are
    attached to it, so they go ``ttl_s`` after the last agent stopped renewing it (a killed
    launch), or at once when a finished launch revokes it. A renewal that fails (the cluster
    has no quorum) is retried; etcd extends every lease's TTL when a new leader is elected."""

    def __init__(self, store: EtcdStore, lease: str, ttl_s: float) -> None:
        self.store, self.lease, self.ttl_s = store, lease, ttl_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="resilient-etcd-lease",
                                        daemon=True)
        self._thread.start()

    @staticmethod
    def grant(store: EtcdStore, ttl_s: float) -> str:
        """A new lease of ``ttl_s`` seconds (at least 1) on the store's cluster: its id."""
        return str(store._post("/v3/lease/grant", {"TTL": max(1, round(ttl_s))})["ID"])

    @staticmethod
    def revoke(store: EtcdStore, lease: str) -> bool:
        """Revokes ``lease`` (its keys are deleted); False when it was gone already."""
        try:
            store._post("/v3/lease/revoke", {"ID": lease})
        except ValueError as e:  # "requested lease not found": revoked or expired already
            if "lease not found" not in str(e):
                raise
            return False
        return True

    def _run(self) -> None:
        while not self._stop.wait(max(0.5, self.ttl_s / 3)):
            try:
                reply = self.store._post("/v3/lease/keepalive", {"ID": self.lease})
                if int(reply.get("result", {}).get("TTL", 0) or 0) <= 0:
                    return  # revoked or expired: nothing left to keep
            except (_RETRYABLE, ValueError):
                continue  # no quorum now: the next renewal may get through

    def stop(self, revoke: bool = False) -> None:
        """Stops renewing; with ``revoke`` also deletes the lease and every key on it."""
        self._stop.set()
        self._thread.join(5.0)
        if revoke:
            try:
                self.revoke(self.store, self.lease)
            except (_RETRYABLE, ValueError):
                pass  # it expires on its own


def from_url(url: str, *, timeout: timedelta = timedelta(seconds=30)) -> EtcdStore:
    """``etcd://h1:2379,h2:2379/prefix`` (``etcds://`` for TLS) with options in the query
    (``ca``, ``cert``, ``key``, ``reach_timeout`` in seconds) and the user from the URL
    (``etcd://user@h1:2379``); the password comes from ``RESILIENT_ETCD_PASSWORD`` (never from
    the URL, which gets logged)."""
    parts = urlsplit(url)
    if parts.scheme not in ("etcd", "etcds"):
        raise ValueError(f"not an etcd URL: {url!r} (etcd://host:port,host:port/prefix)")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    if ":" in userinfo:
        raise ValueError("put the etcd password in RESILIENT_ETCD_PASSWORD, not in the URL")
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    unknown = set(query) - {"ca", "cert", "key", "reach_timeout"}
    if unknown:
        raise ValueError(f"unknown etcd URL options {sorted(unknown)} (ca, cert, key, "
                         "reach_timeout)")
    reach = DEFAULT_REACH_TIMEOUT
    if "reach_timeout" in query:
        try:
            reach = timedelta(seconds=float(query["reach_timeout"]))
        except ValueError:
            raise ValueError(f"etcd URL option reach_timeout={query['reach_timeout']!r} is "
                             "not a number of seconds") from None
        if not reach.total_seconds() > 0:
            raise ValueError("etcd URL option reach_timeout must be > 0 seconds")
    if parts.scheme == "etcds" and "ca" not in query:
        raise ValueError("etcds:// needs ?ca=<CA file>")
    return EtcdStore([h for h in hosts.split(",") if h], parts.path.lstrip("/"), timeout=timeout,
                     ca=query.get("ca"), cert=query.get("cert"), key=query.get("key"),
                     user=userinfo or None, reach_timeout=reach,
                     password=settings.get("RESILIENT_ETCD_PASSWORD") or None if userinfo else None)


_RENDEZVOUS_STORES: list[EtcdStore] = []  # one per init_process_group(init_method="etcd://")


def _rendezvous(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs: Any) -> Any:
    """torch's rendezvous handler for ``init_process_group(init_method="etcd://...")``."""
    parts = urlsplit(url)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    if "rank" not in query or "world_size" not in query:
        raise ValueError("etcd:// rendezvous needs rank and world_size (init_process_group's "
                         "arguments)")
    rank, world = int(query.pop("rank")), int(query.pop("world_size"))
    query.pop("use_libuv", None)
    clean = urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(query), ""))
    store = from_url(clean, timeout=timeout)
    # torch keeps only the C++ half of a Python store: without a Python reference the object's
    # methods are gone ("Not implemented" from c10d's trampoline) once it is collected
    _RENDEZVOUS_STORES.append(store)
    yield store, rank, world
    raise RuntimeError("etcd:// rendezvous cannot re-rendezvous")


def _env_rendezvous(url: str, timeout: timedelta = timedelta(minutes=30),
                    **kwargs: Any) -> Any:
    """``env://`` (init_process_group's default) with ``RESILIENT_STORE=etcd://...`` (set by
    ``resilient run --store``): rank and world size come from the URL or RANK/WORLD_SIZE as
    torch's env:// takes them, the store is the etcd cluster under the URL's prefix plus this
    launch attempt's id (with the nonce the agents agreed: environment.run_id), its keys on the
    launch's lease (RESILIENT_STORE_LEASE). A replacement rank's one-rank group
    (RESILIENT_JOIN=1) gets a prefix of its own inside it, so its keys stay apart from the
    job's group."""
    from resilient.recovery import environment

    target = os.environ.get(environment.STORE_ENV, "")
    if not target.startswith(("etcd://", "etcds://")):
        yield from _TORCH_ENV(url, timeout=timeout, **kwargs)
        return
    query = {k: v[-1] for k, v in parse_qs(urlsplit(url).query).items()}
    try:
        rank = int(query.get("rank", os.environ["RANK"]))
        world = int(query.get("world_size", os.environ["WORLD_SIZE"]))
    except KeyError as e:
        raise ValueError(f"env:// rendezvous on etcd needs {e.args[0]} (set by the launcher) "
                         "or init_process_group's rank and world_size") from None
    parts = urlsplit(target)
    attempt = environment.run_id() or "default"
    path = f"{parts.path.strip('/')}/{attempt}/".lstrip("/")
    store: Any = from_url(urlunsplit((parts.scheme, parts.netloc, path, parts.query, "")),
                          timeout=timeout)
    store.lease = os.environ.get(environment.STORE_LEASE_ENV) or None
    _RENDEZVOUS_STORES.append(store)  # see _rendezvous
    if os.environ.get(environment.JOIN_ENV) == "1":
        store = dist.PrefixStore(f"resilient/join/{socket.gethostname()}/{os.getpid()}", store)
    yield store, rank, world
    raise RuntimeError("env:// rendezvous on etcd cannot re-rendezvous")


def install_env_rendezvous() -> None:
    """Makes env:// follow RESILIENT_STORE (``_env_rendezvous``); ``import resilient`` calls it
    when that names an etcd cluster, so an unmodified ``init_process_group("gloo")`` uses it."""
    global _TORCH_ENV
    from torch.distributed import rendezvous as _  # noqa: F401 -- the module, not the function

    handlers = sys.modules["torch.distributed.rendezvous"]._rendezvous_handlers
    if handlers.get("env") is not _env_rendezvous:
        _TORCH_ENV = handlers["env"]
        handlers["env"] = _env_rendezvous


_TORCH_ENV: Any = None  # torch's own env:// handler, once install_env_rendezvous() replaced it

for _scheme in ("etcd", "etcds"):
    try:
        register_rendezvous_handler(_scheme, _rendezvous)
    except RuntimeError:  # registered already (a reload)
        pass

__all__ = ["DEFAULT_REACH_TIMEOUT", "EtcdStore", "LeaseKeeper", "StoreConnectionError",
           "StoreTimeoutError", "StoreUnreachableError", "from_url", "install_env_rendezvous"]
