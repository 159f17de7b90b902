"""etcd discovery: register under a lease with keepalive, and watch a prefix.

Keys: ``/<namespace>/instances/<component>/<instance_id>`` → serialized
``discovery_pb2.InstanceRecord``.

Contract:

- :class:`Registration` grants a lease of ``ttl`` seconds, puts the record under it and
  refreshes the lease every ``ttl/3`` seconds (aetcd does not refresh by itself). If the
  lease was lost (etcd restarted, long pause), it grants a new one and puts the record
  again. After each successful refresh it reads its key back (one GET): when the key is
  gone (someone deleted it while the lease lives), holds another value or sits under
  another lease, it puts the record again under its lease, so a deleted key is back
  within one keepalive period. ``close()`` revokes the lease so watchers see the key
  vanish at once.
- :class:`InstanceWatcher` loads the current records under a component prefix, then follows
  etcd's watch from the next revision. ``instances()`` is the live set. A record whose lease
  expires disappears from it within the watch delay. After a watch error it reconnects and
  resyncs from a fresh snapshot. When that snapshot is older than a revision already
  seen (etcd lost its data), a record it lacks stays listed for ``resync_grace_s``
  (default 10 s) unless its key is put or deleted meanwhile, so a wiped etcd does not
  empty the set until the owners re-register.
  Listeners registered with ``on_change`` are called after every applied change.
- :func:`read_instance_records` reads a component's records once (tools, tests).
- Security (:mod:`services.common.etcd_auth`): both take ``tls`` (the process's
  :class:`MeshTls`, or None). An ``https://host:port`` endpoint is dialled over mTLS with
  it (None there is a ValueError naming ``etcd_endpoint``); with etcd's auth on, the
  certificate's CN is the etcd user, so a process may write only the keys its identity
  was granted. A ``host:port`` endpoint stays plaintext (``tls`` then only logs one
  warning per process: discovery is unprotected). A registration that etcd refuses
  (PERMISSION_DENIED) raises :class:`EtcdPermissionError` naming the key and the identity
  at once, without retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import aetcd
import grpc

from protos import discovery_pb2
from services.common.etcd_auth import SecureEtcdClient, parse_endpoint, permission_denied
from services.common.grpc_client import RECONNECT_OPTIONS
from services.common.periodic import Periodic
from services.common.tls import MeshTls
from services.common.worker_ids import has_sub_ids

log = logging.getLogger(__name__)

# AFD worker capabilities (workers.engines.afd): an attention worker serves requests (its
# role is agg); an FFN worker serves only its attention workers' layers, never a request.
AFD_ATTENTION = "afd_attention"
AFD_FFN = "afd_ffn"
# A prefill worker that also serves a request whole (prefill and decode) when given one
# without handoff parameters: vLLM's P (its NIXL connector only adds the handoff), the
# mock engine's P; never SGLang's prefill server. The router's "P serves whole" reads it.
DECODE_ALONE = "decode_alone"


def routable(record: discovery_pb2.InstanceRecord) -> bool:
    """Whether a worker record may be sent requests: not an AFD FFN worker."""
    return AFD_FFN not in record.capabilities


def instances_prefix(namespace: str, component: str = "") -> str:
    """Key prefix of one component's records (or of all components when empty)."""
    base = f"/{namespace}/instances/"
    return base + (f"{component}/" if component else "")


def instance_key(namespace: str, record: discovery_pb2.InstanceRecord) -> str:
    """The etcd key of ``record``."""
    return instances_prefix(namespace, record.component) + record.instance_id


class EtcdPermissionError(PermissionError):
    """etcd refused a write: this identity may not write that key."""


_warned_plain = False


def etcd_client(endpoint: str, tls: MeshTls | None = None) -> aetcd.Client:
    """An (unconnected) aetcd client for ``[https://]host:port`` (module docstring: mTLS
    with ``tls`` for https), which redials a restarted etcd within a second (gRPC's
    default backoff grows to two minutes)."""
    global _warned_plain
    host, port, secure = parse_endpoint(endpoint)
    opts = dict(RECONNECT_OPTIONS)
    if secure:
        if tls is None:
            raise ValueError(f"etcd_endpoint {endpoint!r} is https: it needs --tls-dir "
                             f"(a client certificate), not --insecure")
        return SecureEtcdClient(host, port, tls, timeout=5, options=opts)
    if tls is not None and not _warned_plain:
        _warned_plain = True
        log.warning("etcd at %s is plaintext (no https:// endpoint): any process that reaches "
                    "it can read and write discovery records", endpoint)
    return aetcd.Client(host=host, port=port, timeout=5, options=opts)


async def read_instance_records(endpoint: str, namespace: str, component: str,
                                tls: MeshTls | None = None
                                ) -> list[discovery_pb2.InstanceRecord]:
    """Every ``component`` record under ``namespace`` in etcd now, in key order (one
    connection, closed again; for tools and tests: services watch instead)."""
    client = etcd_client(endpoint, tls)
    try:
        await client.connect()
        kvs = await client.get_prefix(instances_prefix(namespace, component).encode())
    finally:
        await client.close()
    return [discovery_pb2.InstanceRecord.FromString(kv.value) for kv in kvs]


class Registration:
    """Keeps one instance record alive in etcd under a lease."""

    def __init__(
        self, endpoint: str, namespace: str, record: discovery_pb2.InstanceRecord, ttl: int,
        tls: MeshTls | None = None,
    ) -> None:
        self._endpoint = endpoint
        self._tls = tls
        self._client = etcd_client(endpoint, tls)
        self._key = instance_key(namespace, record).encode()
        self._record = record
        self._ttl = ttl
        self._lease: aetcd.leases.Lease | None = None
        period = max(ttl / 3.0, 0.2)
        # Fixed period, no backoff: a lease must be refreshed well within its TTL.
        self._keepalive = Periodic("etcd-keepalive", self._refresh, period,
                                   delay_first=True, max_backoff_s=period)

    @property
    def key(self) -> str:
        return self._key.decode()

    @property
    def lease_id(self) -> int | None:
        return self._lease.id if self._lease else None

    @property
    def keepalives(self) -> tuple[int, int]:
        """(keepalive rounds run, rounds that failed) so far."""
        return self._keepalive.calls, self._keepalive.failures_total

    STARTUP_TIMEOUT_S = 30.0

    async def start(self, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Grants the lease, writes the record and starts the keepalive task. While etcd
        is unreachable (e.g. restarting) it retries on a fresh channel, 0.2 s apart
        doubling to 2 s and logging each failure, for ``startup_timeout_s``; then it
        raises the last error. A refusal by etcd's auth raises EtcdPermissionError at
        once."""
        await self._client.connect()
        loop = asyncio.get_running_loop()
        deadline, delay, attempt = loop.time() + startup_timeout_s, 0.2, 0
        while True:
            attempt += 1
            try:
                await self._grant_and_put()
                break
            except (aetcd.exceptions.ConnectionFailedError,
                    aetcd.exceptions.ConnectionTimeoutError) as exc:  # down, or not ready
                if loop.time() + delay > deadline:
                    raise
                log.warning("etcd registration of %s failed (try %d): %s; retrying in %.1fs",
                            self.key, attempt, exc, delay)
                await asyncio.sleep(delay)
                await self._new_client()  # a channel that failed may stay stuck
                delay = min(delay * 2, 2.0)
            except aetcd.exceptions.ClientError as exc:
                if not permission_denied(exc):
                    raise
                who = self._tls.identity if self._tls is not None else "no certificate"
                head, dot, _ = self._record.instance_id.partition(".")  # a sub-id's owner
                need = (f"the instance certificate worker:{head}"
                        if not dot or has_sub_ids(head) else
                        "a fleet certificate worker:fleet-<x> for a sub-id: no other "
                        "certificate has any")
                hint = (f" (with etcd auth on, a worker needs {need})"
                        if self._record.component == "worker" else "")
                raise EtcdPermissionError(
                    f"etcd refused to register {self.key} for {who}: permission denied"
                    f"{hint}; see services.common.etcd_auth") from exc
        self._keepalive.start()

    async def _new_client(self) -> None:
        with contextlib.suppress(Exception):
            await self._client.close()
        self._client = etcd_client(self._endpoint, self._tls)
        await self._client.connect()

    async def update(self, record: discovery_pb2.InstanceRecord) -> None:
        """Replaces the published record (same key, same lease)."""
        self._record = record
        if self._lease is not None:
            await self._client.put(self._key, record.SerializeToString(), lease=self._lease)

    async def _grant_and_put(self) -> None:
        self._lease = await self._client.lease(self._ttl)
        await self._client.put(self._key, self._record.SerializeToString(), lease=self._lease)

    async def _refresh(self) -> None:
        """One keepalive: refresh the lease; re-register when it is gone or the refresh
        failed. A failed re-registration raises (the Periodic logs it; next try in one
        period)."""
        assert self._lease is not None
        try:
            resp = await self._lease.refresh()
        except Exception as exc:  # etcd unreachable: try a fresh lease
            log.warning("etcd keepalive failed: %s", exc)
            await self._grant_and_put()
            return
        if (resp.TTL if resp is not None else 0) <= 0:  # lease gone on the server
            log.warning("etcd lease %s expired; re-registering", self._lease.id)
            await self._grant_and_put()
            return
        await self._restore_key()

    async def _restore_key(self) -> None:
        """Puts the record again when its key is gone or no longer ours (value, lease)."""
        assert self._lease is not None
        kv = await self._client.get(self._key)
        value = self._record.SerializeToString()  # after the GET: update() may have run
        if kv is not None and kv.value == value and kv.lease == self._lease.id:
            return
        log.warning("etcd key %s was %s while its lease %s lives; putting it back",
                    self.key, "deleted" if kv is None else "overwritten", self._lease.id)
        await self._client.put(self._key, value, lease=self._lease)

    async def close(self) -> None:
        """Stops the keepalive and revokes the lease (deleting the record). Idempotent. A
        revoke that fails (etcd gone) is one warning: the record then lasts until etcd
        expires the lease, ``ttl`` seconds after it last saw a keepalive while it served
        (a restarted etcd counts the TTL again from its start)."""
        await self._keepalive.stop()
        if self._lease is not None:
            try:
                await self._lease.revoke()
            except Exception as exc:  # noqa: BLE001 - said, and the lease still expires
                log.warning("could not revoke the lease of %s (%s: %s): watchers drop it "
                            "when etcd expires the lease (TTL %d s, counted while etcd "
                            "serves)", self.key, type(exc).__name__, exc, self._ttl)
            self._lease = None
        with contextlib.suppress(Exception):
            await self._client.close()


Listener = Callable[[dict[str, discovery_pb2.InstanceRecord]], None]


class InstanceWatcher:
    """Follows all records under one component prefix.

    The watch runs in a :class:`Periodic`: each run loads a snapshot of the prefix, then
    follows its changes until the watch ends or fails; a failure is logged and retried
    with backoff (0.2 s doubling to 5 s; a loaded snapshot resets it), and every retry
    reloads the whole snapshot, so nothing missed in between is lost. ``start()`` returns
    once the first snapshot is loaded, or raises the error when the first
    ``STARTUP_TRIES`` tries failed (or one failed for another reason than etcd being
    unreachable).
    """

    STARTUP_TRIES = 5
    RESYNC_GRACE_S = 10.0

    def __init__(self, endpoint: str, namespace: str, component: str,
                 resync_grace_s: float = RESYNC_GRACE_S, tls: MeshTls | None = None) -> None:
        self._endpoint = endpoint
        self._tls = tls
        etcd_client(endpoint, tls)  # a bad endpoint fails here, not in the first watch
        self._grace = resync_grace_s
        self._stale: dict[str, float] = {}  # kept after a resync missed them: id → deadline
        self._revision = 0  # the newest etcd revision seen (snapshot or event)
        self._expiry: asyncio.TimerHandle | None = None
        self._prefix = instances_prefix(namespace, component).encode()
        self._instances: dict[str, discovery_pb2.InstanceRecord] = {}
        self._listeners: list[Listener] = []
        self._watch = Periodic(f"etcd-watch-{component}", self._watch_once, 0.1,
                               max_backoff_s=5.0)
        self._ready = asyncio.Event()
        self._settled = asyncio.Event()  # ready, or start-up gave up
        self._startup_error: BaseException | None = None

    def instances(self) -> dict[str, discovery_pb2.InstanceRecord]:
        """A copy of the live records, keyed by instance id."""
        return dict(self._instances)

    def on_change(self, listener: Listener) -> None:
        """Calls ``listener(instances)`` after every change."""
        self._listeners.append(listener)

    async def start(self) -> None:
        """Starts watching; returns once the first snapshot is loaded."""
        self._watch.start()
        await self._settled.wait()
        if self._startup_error is not None:
            await self._watch.stop()
            raise self._startup_error

    def _apply(self, key: bytes, value: bytes | None) -> None:
        instance_id = key[len(self._prefix):].decode()
        self._stale.pop(instance_id, None)
        if value is None:
            self._instances.pop(instance_id, None)
        else:
            rec = discovery_pb2.InstanceRecord()
            try:
                rec.ParseFromString(value)
            except Exception:
                log.warning("ignoring malformed record at %r", key)
                return
            self._instances[instance_id] = rec

    def _notify(self) -> None:
        snapshot = self.instances()
        for listener in self._listeners:
            try:
                listener(snapshot)
            except Exception:
                log.exception("discovery listener failed")

    async def _watch_once(self) -> None:
        """One snapshot, then the changes after it until the watch ends or fails."""
        client = etcd_client(self._endpoint, self._tls)
        try:
            await client.connect()
            snap = await client.get_prefix(self._prefix)
            previous = dict(self._instances)
            self._instances.clear()
            for kv in snap:
                self._apply(kv.key, kv.value)
            if snap.header.revision < self._revision:  # etcd lost its data
                self._keep_missing(previous)
            self._revision = snap.header.revision
            self._notify()
            self._ready.set()
            self._settled.set()
            self._watch.note_progress()
            watch = await client.watch_prefix(
                self._prefix, start_revision=snap.header.revision + 1
            )
            async for event in watch:
                self._apply(event.kv.key, event.kv.value if event.kind == "PUT" else None)
                self._revision = max(self._revision, event.kv.mod_revision)
                self._notify()
        except Exception as exc:
            unreachable = isinstance(exc, grpc.RpcError | aetcd.exceptions.ClientError | OSError)
            if not self._ready.is_set() and (
                    not unreachable or self._watch.failures + 1 >= self.STARTUP_TRIES):
                self._startup_error = exc
                self._settled.set()
            raise
        finally:
            with contextlib.suppress(Exception):
                await client.close()

    def _keep_missing(self, previous: dict[str, discovery_pb2.InstanceRecord]) -> None:
        """After a resync from an etcd that lost its data (the snapshot's revision is
        older than one already seen), records the snapshot lacks stay listed for
        ``resync_grace_s`` (from when they first went missing) unless a watch event puts
        or deletes them first: their owners put them back within one keepalive, and a
        routing gap of a whole lease is worse than a few calls to a dead worker, which
        callers report and skip. A resync from an etcd that kept its data applies the
        snapshot as it is."""
        missing = {k: v for k, v in previous.items() if k not in self._instances}
        if not missing or self._grace <= 0:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        fresh = [k for k in missing if k not in self._stale]
        if fresh:
            log.warning("etcd snapshot of %s lacks %d known record(s) (%s); keeping them "
                        "%.0fs for their owners to re-register", self._prefix.decode(),
                        len(fresh), ", ".join(sorted(fresh)[:5]), self._grace)
        for k, rec in missing.items():
            self._instances[k] = rec
            self._stale.setdefault(k, now + self._grace)
        self._arm_expiry(now)

    def _arm_expiry(self, now: float) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry = asyncio.get_running_loop().call_later(
            max(min(self._stale.values()) - now, 0.0), self._expire_stale)

    def _expire_stale(self) -> None:
        now = asyncio.get_running_loop().time()
        gone = [k for k, deadline in self._stale.items() if deadline <= now]
        for k in gone:
            del self._stale[k]
            self._instances.pop(k, None)
        if gone:
            log.warning("%d record(s) under %s did not come back after the resync: %s",
                        len(gone), self._prefix.decode(), ", ".join(sorted(gone)[:5]))
            self._notify()
        self._expiry = None
        if self._stale:
            self._arm_expiry(now)

    async def close(self) -> None:
        """Stops watching (no listener is called after it). Idempotent."""
        await self._watch.stop()
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
