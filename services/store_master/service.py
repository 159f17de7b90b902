"""The StoreMaster gRPC servicer: protobuf in, :class:`StoreMaster` calls, protobuf out.

Contract (``protos/store.proto`` documents each RPC):

- Every RPC validates what protobuf cannot (unknown enum values → INVALID_ARGUMENT), calls
  the core, and maps a :class:`StoreError` to a status by its ``kind`` (:data:`STATUS`,
  the only place the core's error kinds meet gRPC): NOT_FOUND, ALREADY_EXISTS,
  FAILED_PRECONDITION (leased, incomplete, wrong state), RESOURCE_EXHAUSTED (no space),
  INVALID_ARGUMENT; INTERNAL for a kindless StoreError.
- Every RPC that can change durable metadata flushes the persister before it answers
  (write-through); a failed flush is logged and retried later, the answer is unaffected.
  Reads (GetReplicaList, ExistKey, BatchExistKey, Ping, Stats) write nothing.
- The ``Batch*`` RPCs run each item as its single-key RPC would, in order, and answer
  OK with one ``ItemStatus`` per item (the code that RPC would have answered with); a
  batch over :data:`MAX_BATCH` (4096) items, or with an unknown pin, is INVALID_ARGUMENT
  as a whole. ``BatchExistKey`` (one bool per key) is INVALID_ARGUMENT as a whole for an
  invalid key (naming its index). A mutating batch flushes the persister once, after its
  last item.
- Keys (and client ids, segment ids, endpoints) are at most ``max_key_bytes`` (4096)
  bytes of UTF-8 and not empty; segment geometry is checked against 64-bit addresses
  (see the core's ``mount_segment``). No request answers UNKNOWN.
- With mTLS (:func:`services.common.authz.caller` known), a segment belongs to the
  certificate identity that mounted it (the core's ``principal``, persisted with the
  segment, so a restarted master keeps it): Mount/UnmountSegment of it by another identity
  is PERMISSION_DENIED naming the owner.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NoReturn, TypeVar

import grpc

from protos import store_pb2, store_pb2_grpc
from services.common.authz import caller
from services.store_master.core import (
    ErrorKind,
    Pin,
    ReplicaDescriptor,
    ReplicaState,
    StoreError,
    StoreMaster,
)
from services.store_master.persist import Persister

T = TypeVar("T")
MAX_BATCH = 4096
_OK = store_pb2.ItemStatus()

_PINS = {store_pb2.PIN_NONE: Pin.NONE, store_pb2.PIN_SOFT: Pin.SOFT,
         store_pb2.PIN_HARD: Pin.HARD}
_STATES = {s: getattr(store_pb2, f"REPLICA_STATE_{s.name}") for s in ReplicaState}
# The status each kind of refusal answers with (single RPCs and batch items alike).
STATUS: dict[ErrorKind, grpc.StatusCode] = {
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorKind.LEASED: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.NOT_READY: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.WRONG_STATE: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.NO_SPACE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.FORBIDDEN: grpc.StatusCode.PERMISSION_DENIED,
}


def replica_pb(d: ReplicaDescriptor) -> store_pb2.Replica:
    return store_pb2.Replica(segment_id=d.segment_id, client_id=d.client_id,
                             endpoint=d.endpoint, offset=d.offset, address=d.address,
                             size=d.size, state=_STATES[d.state])


def status_of(exc: StoreError) -> grpc.StatusCode:
    """The gRPC status a refusal answers with (:data:`STATUS`)."""
    return STATUS[exc.kind]


async def _abort(context: grpc.aio.ServicerContext, exc: StoreError) -> NoReturn:
    await context.abort(status_of(exc), str(exc))
    raise AssertionError("unreachable")  # context.abort raises


async def _batch_size(context: grpc.aio.ServicerContext, field: str, n: int) -> None:
    """INVALID_ARGUMENT for a batch over :data:`MAX_BATCH` items."""
    if n > MAX_BATCH:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"{field}: a batch holds at most {MAX_BATCH} items, got {n}")


def _item(fn: Callable[[], T]) -> tuple[store_pb2.ItemStatus, T | None]:
    """Runs one batch item: (OK, value) or (its StoreError's status, None)."""
    try:
        return _OK, fn()
    except StoreError as exc:
        return store_pb2.ItemStatus(code=status_of(exc).value[0], message=str(exc)), None


class StoreMasterServicer(store_pb2_grpc.StoreMasterServicer):
    """Serves one :class:`StoreMaster`; flushes ``persister`` after every mutation."""

    def __init__(self, master: StoreMaster, persister: Persister) -> None:
        self._m = master
        self._p = persister

    async def _call(self, context: grpc.aio.ServicerContext, fn: Callable[[], T],
                    mutates: bool = True) -> T:
        try:
            out = fn()
        except StoreError as exc:
            await _abort(context, exc)
        finally:
            if mutates:  # even a refusal may have evicted (PutStart)
                await self._p.flush()
        return out

    async def _pin(self, context: grpc.aio.ServicerContext, value: int) -> Pin:
        pin = _PINS.get(value)  # type: ignore[call-overload]
        if pin is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown pin {value}")
        return pin  # type: ignore[no-any-return]

    async def PutStart(  # noqa: N802
        self, request: store_pb2.PutStartRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.PutStartResponse:
        pin = await self._pin(context, request.pin)
        descs = await self._call(context, lambda: self._m.put_start(
            request.key, request.size, replicas=request.replicas or 1, pin=pin,
            preferred_segment=request.preferred_segment))
        return store_pb2.PutStartResponse(replicas=[replica_pb(d) for d in descs])

    async def PutEnd(  # noqa: N802
        self, request: store_pb2.KeyRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.PutEndResponse:
        descs = await self._call(context, lambda: self._m.put_end(request.key))
        return store_pb2.PutEndResponse(replicas=[replica_pb(d) for d in descs])

    async def PutRevoke(  # noqa: N802
        self, request: store_pb2.KeyRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.PutRevokeResponse:
        await self._call(context, lambda: self._m.put_revoke(request.key))
        return store_pb2.PutRevokeResponse()

    async def GetReplicaList(  # noqa: N802
        self, request: store_pb2.KeyRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.GetReplicaListResponse:
        return await self._call(context, partial(self._replica_list, request.key),
                                mutates=False)

    def _replica_list(self, key: str) -> store_pb2.GetReplicaListResponse:
        """The COMPLETE replicas of ``key`` with its size and lease (grants the lease)."""
        descs = self._m.get_replica_list(key)
        return store_pb2.GetReplicaListResponse(
            replicas=[replica_pb(d) for d in descs], size=descs[0].size if descs else 0,
            lease_until=self._m.lease_until(key))

    async def ExistKey(  # noqa: N802
        self, request: store_pb2.KeyRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.ExistKeyResponse:
        exists = await self._call(context, lambda: self._m.exist_key(request.key),
                                  mutates=False)
        return store_pb2.ExistKeyResponse(exists=exists)

    async def BatchExistKey(  # noqa: N802
        self, request: store_pb2.BatchExistKeyRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.BatchExistKeyResponse:
        await _batch_size(context, "keys", len(request.keys))
        found = await self._call(context, lambda: self._m.batch_exist_key(list(request.keys)),
                                 mutates=False)
        return store_pb2.BatchExistKeyResponse(exists=found)

    async def Remove(  # noqa: N802
        self, request: store_pb2.KeyRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.RemoveResponse:
        await self._call(context, lambda: self._m.remove(request.key))
        return store_pb2.RemoveResponse()

    async def RemoveAll(  # noqa: N802
        self, request: store_pb2.RemoveAllRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.RemoveAllResponse:
        n = await self._call(context, self._m.remove_all)
        return store_pb2.RemoveAllResponse(removed=n)

    async def SetPin(  # noqa: N802
        self, request: store_pb2.SetPinRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.SetPinResponse:
        pin = await self._pin(context, request.pin)
        await self._call(context, lambda: self._m.set_pin(request.key, pin))
        return store_pb2.SetPinResponse()

    async def MountSegment(  # noqa: N802
        self, request: store_pb2.MountSegmentRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.MountSegmentResponse:
        who = str(caller() or "")
        mounted = await self._call(context, lambda: self._m.mount_segment(
            request.client_id, request.segment_id, request.base, request.size,
            request.endpoint, who))
        return store_pb2.MountSegmentResponse(mounted=mounted,
                                              client_ttl_s=self._m.params.client_ttl_s)

    async def UnmountSegment(  # noqa: N802
        self, request: store_pb2.UnmountSegmentRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.UnmountSegmentResponse:
        who = str(caller() or "")
        rep = await self._call(context, lambda: self._m.unmount_segment(
            request.client_id, request.segment_id, who))
        return store_pb2.UnmountSegmentResponse(replicas_lost=rep.replicas_lost,
                                                objects_lost=rep.objects_lost)

    async def Ping(  # noqa: N802
        self, request: store_pb2.PingRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.PingResponse:
        known = await self._call(context, lambda: self._m.ping(request.client_id),
                                 mutates=False)
        return store_pb2.PingResponse(known=known, client_ttl_s=self._m.params.client_ttl_s)


    async def BatchPutStart(  # noqa: N802
        self, request: store_pb2.BatchPutStartRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.BatchPutStartResponse:
        await _batch_size(context, "items", len(request.items))
        pins = [await self._pin(context, it.pin) for it in request.items]
        out = store_pb2.BatchPutStartResponse()
        try:
            for it, pin in zip(request.items, pins, strict=True):
                status, descs = _item(partial(
                    self._m.put_start, it.key, it.size, replicas=it.replicas or 1, pin=pin,
                    preferred_segment=it.preferred_segment))
                out.results.add(status=status, replicas=[replica_pb(d) for d in descs or ()])
        finally:
            await self._p.flush()
        return out

    async def _batch_keys(self, context: grpc.aio.ServicerContext,
                          request: store_pb2.BatchKeysRequest,
                          fn: Callable[[str], object]) -> store_pb2.BatchStatusResponse:
        await _batch_size(context, "keys", len(request.keys))
        out = store_pb2.BatchStatusResponse()
        try:
            for key in request.keys:
                out.results.append(_item(partial(fn, key))[0])
        finally:
            await self._p.flush()
        return out

    async def BatchPutEnd(  # noqa: N802
        self, request: store_pb2.BatchKeysRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.BatchStatusResponse:
        return await self._batch_keys(context, request, self._m.put_end)

    async def BatchPutRevoke(  # noqa: N802
        self, request: store_pb2.BatchKeysRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.BatchStatusResponse:
        return await self._batch_keys(context, request, self._m.put_revoke)

    async def BatchGetReplicaList(  # noqa: N802
        self, request: store_pb2.BatchKeysRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.BatchGetReplicaListResponse:
        await _batch_size(context, "keys", len(request.keys))
        out = store_pb2.BatchGetReplicaListResponse()
        for key in request.keys:
            status, found = _item(partial(self._replica_list, key))
            out.results.add(status=status, list=found)
        return out

    async def Stats(  # noqa: N802
        self, request: store_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.StatsResponse:
        s = self._m.stats()
        c = s.counters
        return store_pb2.StatsResponse(
            capacity=s.capacity, used=s.used, objects=s.objects,
            complete_objects=s.complete_objects, segments=s.segments, clients=s.clients,
            puts_started=c.puts_started, puts_completed=c.puts_completed,
            puts_revoked=c.puts_revoked, zombies_reclaimed=c.zombies_reclaimed,
            objects_removed=c.objects_removed, objects_evicted=c.objects_evicted,
            bytes_evicted=c.bytes_evicted, eviction_runs=c.eviction_runs,
            allocation_failures=c.allocation_failures, clients_lost=c.clients_lost,
            replicas_lost=c.replicas_lost, objects_lost=c.objects_lost,
            leases_granted=c.leases_granted, records_persisted=self._p.records_written,
            persist_failures=self._p.failures)
