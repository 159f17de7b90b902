"""Store client: mounts a DRAM segment at the store master and moves object bytes over NIXL.

The master (``protos/store.proto``, :mod:`services.store_master`) only hands out ranges in
segments; this client moves the bytes between local memory it registered with NIXL and
the segment holding a replica, with one-sided NIXL READ/WRITE initiated here. A segment's
owner publishes its NIXL agent metadata in the segment's ``endpoint``
(:func:`encode_endpoint`), so a reader needs nothing but the master's answer.

Contract of :class:`StoreClient` (synchronous, thread-safe for gRPC; NIXL calls are
serialised by one lock):

- ``StoreClient(master_address, segment_bytes=0, client_id=None, ..., tls=None)``: talks
  to the master over mTLS with ``tls`` (a store_client or worker certificate), else
  plaintext; creates its NIXL agent (UCX, progress thread off). With ``segment_bytes > 0``
  it allocates and registers a DRAM segment and mounts it under a fresh segment id
  (``<client_id>-<uuid>``: ids are never reused across launches, as the master requires),
  then pings every ``client_ttl_s / 3`` from a daemon thread and remounts when the master answers
  ``known=false`` (declared dead, or a master without persisted metadata). A client with
  a segment is a NIXL *target*: its owner must call :meth:`progress` regularly (the store
  node does) so peers can connect.
- ``register(addr, nbytes)``: registers local memory (e.g. vLLM's KV cache tensors) with
  NIXL; every local region passed to ``put``/``get`` must lie in registered memory.
- ``put_many([(key, regions)], replicas, pin)`` → per key ``"ok"``, ``"exists"`` (already
  stored or being written by someone else: nothing written) or ``"failed"``. Each object's
  bytes are the concatenation of its local ``regions`` (a gather). Protocol, per
  :data:`MAX_BATCH` keys: one BatchPutStart → one NIXL WRITE per remote agent covering
  every replica of every key → one BatchPutEnd; keys whose WRITE failed get one
  BatchPutRevoke. Two master round trips whatever the batch size (three on a failure).
  A put that fails to start for lack of space (RESOURCE_EXHAUSTED) is ``"failed"`` with
  nothing left behind.
- ``get_many([(key, regions)])`` → per key ``"ok"``, ``"missing"`` (unknown / not yet
  complete: a miss) or ``"failed"`` (the master had it but the bytes could not be read:
  wrong size, replica's agent unreachable, transfer error). One BatchGetReplicaList per
  :data:`MAX_BATCH` keys, then one READ per agent and round. The object is scattered into
  ``regions`` in order (sizes must add up to the object's size). Reads a COMPLETE replica
  (its own segment first, copied with memmove; then the master's order), falling back to
  the next replica when a read fails; the master's read lease covers the read.
- ``exists_prefix(keys)`` → how many leading keys exist (BatchExistKey; grants leases).
- ``stats()``: the master's Stats; ``counters``: bytes/ops moved by this client.
- ``close()``: stops the pinger, unmounts its segment (best effort), releases NIXL
  resources. NIXL 1.5.1 may crash at interpreter exit: processes that own a client should
  end with ``os._exit`` after ``close``.

Module helpers: :func:`encode_endpoint` / :func:`decode_endpoint` (``nixl:<base64>``),
:func:`make_agent`.
"""

from __future__ import annotations

import base64
import ctypes
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import grpc
import numpy as np

from protos import store_pb2, store_pb2_grpc
from services.common.grpc_client import sync_channel
from services.common.tls import MeshTls

log = logging.getLogger(__name__)

ENDPOINT_PREFIX = "nixl:"
Region = tuple[int, int]  # (address, nbytes)
PutResult = Literal["ok", "exists", "failed"]
GetResult = Literal["ok", "missing", "failed"]


MAX_BATCH = 4096  # items per Batch* RPC (the master's limit)
_OK = grpc.StatusCode.OK.value[0]
_NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
_ALREADY_EXISTS = grpc.StatusCode.ALREADY_EXISTS.value[0]
_FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]


class TransferError(RuntimeError):
    """A NIXL transfer did not complete (error state or timeout)."""


def encode_endpoint(agent_metadata: bytes) -> str:
    """A segment endpoint carrying the owner's NIXL agent metadata."""
    return ENDPOINT_PREFIX + base64.b64encode(agent_metadata).decode("ascii")


def decode_endpoint(endpoint: str) -> bytes:
    """The NIXL agent metadata in ``endpoint``; ValueError if it carries none."""
    if not endpoint.startswith(ENDPOINT_PREFIX):
        raise ValueError(f"not a NIXL endpoint: {endpoint[:40]!r}")
    return base64.b64decode(endpoint[len(ENDPOINT_PREFIX):])


def make_agent(name: str, err_mode: str = "none") -> Any:
    """A NIXL agent: progress thread off, one UCX backend (see ARCHITECTURE.md §4)."""
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", {"ucx_error_handling_mode": err_mode})
    return agent


@dataclass
class Counters:
    puts: int = 0
    put_bytes: int = 0
    put_failures: int = 0
    gets: int = 0
    get_bytes: int = 0
    get_misses: int = 0
    get_failures: int = 0
    remounts: int = 0


@dataclass
class _Op:
    """One key's share of a batched transfer: local regions and the remote base."""

    key: str
    local: list[Region]
    remote_base: int
    ok: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


def _split(local: Sequence[Region], remote_base: int) -> list[tuple[Region, Region]]:
    """Pair each local region with its slice of the contiguous remote object."""
    out, off = [], 0
    for addr, n in local:
        out.append(((addr, n), (remote_base + off, n)))
        off += n
    return out


class StoreClient:
    """A store client: gRPC to the master, NIXL to segments (see the module docstring)."""

    def __init__(
        self,
        master_address: str,
        segment_bytes: int = 0,
        client_id: str | None = None,
        *,
        transfer_timeout_s: float = 10.0,
        rpc_timeout_s: float = 5.0,
        err_mode: str = "none",
        nixl: bool = True,
        stub: Any = None,
        agent: Any = None,
        tls: MeshTls | None = None,
    ) -> None:
        self.client_id = client_id or f"store-client-{uuid.uuid4().hex[:12]}"
        self.transfer_timeout_s = transfer_timeout_s
        self.rpc_timeout_s = rpc_timeout_s
        self.counters = Counters()
        # mTLS (as a store client, to a server holding the store_master role) with tls
        self._channel = sync_channel(master_address, tls, "store_master")
        # ``stub`` / ``agent``: injected fakes (unit tests); by default the real ones.
        self.stub = stub or store_pb2_grpc.StoreMasterStub(self._channel)
        self._lock = threading.RLock()  # NIXL agent calls
        # nixl=False: metadata only (lookups, stats), e.g. vLLM's scheduler-side connector.
        self.agent: Any = agent
        if agent is None and nixl:
            self.agent = make_agent(f"{self.client_id}-{uuid.uuid4().hex[:8]}", err_mode)
        self._regs: list[Any] = []
        self._remotes: dict[str, str] = {}  # endpoint -> remote agent name
        self._stop = threading.Event()
        self._pinger: threading.Thread | None = None
        self.segment_id = ""
        self.segment: np.ndarray | None = None
        self.client_ttl_s = 10.0
        if segment_bytes > 0:
            if self.agent is None:
                raise ValueError("a segment needs NIXL (nixl=True)")
            self.segment = np.empty(segment_bytes, dtype=np.uint8)
            self.segment.fill(0)  # fault the pages in now, not during peers' WRITEs
            self.register(int(self.segment.ctypes.data), segment_bytes)
            self.segment_id = f"{self.client_id}-{uuid.uuid4().hex[:12]}"
            self.endpoint = encode_endpoint(self.agent.get_agent_metadata())
            self._mount()
            self._pinger = threading.Thread(target=self._ping_loop, name="store-ping",
                                            daemon=True)
            self._pinger.start()

    # -- segment and liveness ---------------------------------------------------------

    def _mount(self) -> None:
        assert self.segment is not None
        resp = self.stub.MountSegment(store_pb2.MountSegmentRequest(
            client_id=self.client_id, segment_id=self.segment_id,
            base=int(self.segment.ctypes.data), size=int(self.segment.nbytes),
            endpoint=self.endpoint), timeout=self.rpc_timeout_s)
        if resp.client_ttl_s > 0:
            self.client_ttl_s = resp.client_ttl_s

    def _ping_loop(self) -> None:
        while not self._stop.wait(max(0.05, self.client_ttl_s / 3)):
            try:
                resp = self.stub.Ping(store_pb2.PingRequest(client_id=self.client_id),
                                      timeout=self.rpc_timeout_s)
                if not resp.known:
                    log.warning("store master forgot client %s: remounting", self.client_id)
                    self._mount()
                    self.counters.remounts += 1
            except grpc.RpcError as exc:
                log.warning("store ping failed: %s", exc.code())

    def progress(self) -> None:
        """Drive UCX progress once (targets must, with the progress thread off)."""
        if self.agent is not None:
            with self._lock:
                self.agent.get_new_notifs()

    # -- memory -----------------------------------------------------------------------

    def register(self, addr: int, nbytes: int) -> None:
        """Register local DRAM ``[addr, addr+nbytes)`` with NIXL."""
        if self.agent is None:
            raise ValueError("this client was created without NIXL")
        with self._lock:
            self._regs.append(self.agent.register_memory([(addr, nbytes, 0, "")], "DRAM"))

    def _remote(self, endpoint: str) -> str:
        name = self._remotes.get(endpoint)
        if name is None:
            raw = self.agent.add_remote_agent(decode_endpoint(endpoint))
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            self._remotes[endpoint] = name
        return name

    def _forget(self, endpoint: str) -> None:
        name = self._remotes.pop(endpoint, None)
        if name is not None:
            with self._lock:
                try:
                    self.agent.remove_remote_agent(name)
                except Exception as exc:  # best effort: the peer may be gone
                    log.debug("remove_remote_agent %s: %s", name, exc)

    def _is_local(self, endpoint: str) -> bool:
        return self.segment is not None and endpoint == self.endpoint

    def _xfer(self, op: str, pairs: list[tuple[Region, Region]], endpoint: str) -> None:
        """One NIXL ``op`` of every (local, remote) pair against ``endpoint``'s agent."""
        if not pairs:
            return
        if self._is_local(endpoint):  # our own segment: plain copies
            for (laddr, n), (raddr, _) in pairs:
                if op == "WRITE":
                    ctypes.memmove(raddr, laddr, n)
                else:
                    ctypes.memmove(laddr, raddr, n)
            return
        if self.agent is None:
            raise TransferError("this client was created without NIXL")
        with self._lock:
            remote = self._remote(endpoint)
            local = self.agent.get_xfer_descs([(a, n, 0) for (a, n), _ in pairs], "DRAM")
            far = self.agent.get_xfer_descs([(a, n, 0) for _, (a, n) in pairs], "DRAM")
            handle = self.agent.initialize_xfer(op, local, far, remote)
            try:
                state = self.agent.transfer(handle)
                deadline = time.monotonic() + self.transfer_timeout_s
                while state == "PROC":
                    if time.monotonic() > deadline:
                        raise TransferError(f"NIXL {op} timed out")
                    state = self.agent.check_xfer_state(handle)
                if state != "DONE":
                    raise TransferError(f"NIXL {op} ended in state {state}")
            finally:
                self.agent.release_xfer_handle(handle)

    def _run_grouped(self, op: str, groups: dict[str, list[_Op]]) -> None:
        """One transfer per endpoint; on failure every op of that group is marked failed."""
        for endpoint, ops in groups.items():
            pairs = [p for o in ops for p in _split(o.local, o.remote_base)]
            try:
                self._xfer(op, pairs, endpoint)
            except Exception as exc:  # NIXL raises its own error types
                log.warning("store %s to %s failed: %s", op, endpoint[:24], exc)
                self._forget(endpoint)  # a restarted peer has a new agent anyway
                for o in ops:
                    o.ok = False

    # -- objects ----------------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[str, Sequence[Region]]], replicas: int = 1,
                 pin: store_pb2.Pin = store_pb2.PIN_NONE) -> list[PutResult]:
        """Write each key's gathered regions as one object (see the module docstring)."""
        results: list[PutResult] = ["failed"] * len(items)
        for lo in range(0, len(items), MAX_BATCH):
            self._put_batch(items[lo:lo + MAX_BATCH], replicas, pin, results, lo)
        return results

    def _put_batch(self, items: Sequence[tuple[str, Sequence[Region]]], replicas: int,
                   pin: store_pb2.Pin, results: list[PutResult], base: int) -> None:
        """BatchPutStart, one WRITE per remote agent, BatchPutEnd (or BatchPutRevoke)."""
        req = store_pb2.BatchPutStartRequest()
        for key, regions in items:
            req.items.add(key=key, size=sum(n for _, n in regions), replicas=replicas,
                          pin=pin, preferred_segment=self.segment_id)
        try:
            resp = self.stub.BatchPutStart(req, timeout=self.rpc_timeout_s)
        except grpc.RpcError as exc:
            log.warning("BatchPutStart: %s", exc.code())
            self.counters.put_failures += len(items)
            return
        groups: dict[str, list[_Op]] = {}
        started: list[tuple[int, list[_Op]]] = []
        for i, ((key, regions), res) in enumerate(zip(items, resp.results, strict=True)):
            if res.status.code == _ALREADY_EXISTS:
                results[base + i] = "exists"
                continue
            if res.status.code != _OK:
                log.debug("PutStart %s: %s", key, res.status.message)
                self.counters.put_failures += 1
                continue
            ops = [_Op(key, list(regions), r.address) for r in res.replicas]
            for o, r in zip(ops, res.replicas, strict=True):
                groups.setdefault(r.endpoint, []).append(o)
            started.append((i, ops))
        self._run_grouped("WRITE", groups)
        written = {i for i, ops in started if ops and all(o.ok for o in ops)}
        done = [i for i, _ in started if i in written]
        lost = [items[i][0] for i, _ in started if i not in written]
        if lost:
            self._revoke(lost)
        if not done:
            return
        try:
            ends = self.stub.BatchPutEnd(
                store_pb2.BatchKeysRequest(keys=[items[i][0] for i in done]),
                timeout=self.rpc_timeout_s).results
        except grpc.RpcError as exc:
            log.warning("BatchPutEnd: %s", exc.code())
            self.counters.put_failures += len(done)
            return
        for i, st in zip(done, ends, strict=True):
            if st.code == _OK:
                results[base + i] = "ok"
                self.counters.puts += 1
                self.counters.put_bytes += sum(n for _, n in items[i][1])
            else:  # reclaimed meanwhile (zombie timeout)
                log.warning("PutEnd %s: %s", items[i][0], st.message)
                self.counters.put_failures += 1

    def _revoke(self, keys: list[str]) -> None:
        self.counters.put_failures += len(keys)
        try:
            self.stub.BatchPutRevoke(store_pb2.BatchKeysRequest(keys=keys),
                                     timeout=self.rpc_timeout_s)
        except grpc.RpcError as exc:
            log.warning("BatchPutRevoke of %d keys: %s", len(keys), exc.code())

    def put(self, key: str, regions: Sequence[Region], replicas: int = 1) -> PutResult:
        return self.put_many([(key, regions)], replicas)[0]

    def get_many(self, items: Sequence[tuple[str, Sequence[Region]]]) -> list[GetResult]:
        """Read each key into its regions (scatter); see the module docstring."""
        results: list[GetResult] = ["failed"] * len(items)
        for lo in range(0, len(items), MAX_BATCH):
            self._get_batch(items[lo:lo + MAX_BATCH], results, lo)
        return results

    def _get_batch(self, items: Sequence[tuple[str, Sequence[Region]]],
                   results: list[GetResult], base: int) -> None:
        """BatchGetReplicaList, then READ rounds with replica fallback."""
        try:
            resp = self.stub.BatchGetReplicaList(
                store_pb2.BatchKeysRequest(keys=[k for k, _ in items]),
                timeout=self.rpc_timeout_s)
        except grpc.RpcError as exc:
            log.warning("BatchGetReplicaList: %s", exc.code())
            self.counters.get_failures += len(items)
            return
        pending: list[tuple[int, _Op, list[Any]]] = []
        for i, ((key, regions), res) in enumerate(zip(items, resp.results, strict=True)):
            if res.status.code in (_NOT_FOUND, _FAILED_PRECONDITION):
                results[base + i] = "missing"
                self.counters.get_misses += 1
                continue
            if res.status.code != _OK:
                self.counters.get_failures += 1
                continue
            want = sum(n for _, n in regions)
            reps = sorted(res.list.replicas, key=lambda r: not self._is_local(r.endpoint))
            if not reps or res.list.size != want:
                log.warning("store object %s: size %d, expected %d", key, res.list.size,
                            want)
                self.counters.get_failures += 1
                continue
            pending.append((base + i, _Op(key, list(regions), 0), list(reps)))
        # Round k reads each unfinished object from its k-th replica (fallback on failure).
        while pending:
            groups: dict[str, list[_Op]] = {}
            for _, op, reps in pending:
                rep = reps.pop(0)
                op.remote_base, op.ok = rep.address, True
                groups.setdefault(rep.endpoint, []).append(op)
            self._run_grouped("READ", groups)
            retry = []
            for i, op, reps in pending:
                if op.ok:
                    results[i] = "ok"
                    self.counters.gets += 1
                    self.counters.get_bytes += sum(n for _, n in op.local)
                elif reps:
                    retry.append((i, op, reps))
                else:
                    self.counters.get_failures += 1
            pending = retry

    def get(self, key: str, regions: Sequence[Region]) -> GetResult:
        return self.get_many([(key, regions)])[0]

    def exists_prefix(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` are complete objects (0 on any master error)."""
        if not keys:
            return 0
        try:
            resp = self.stub.BatchExistKey(store_pb2.BatchExistKeyRequest(keys=list(keys)),
                                           timeout=self.rpc_timeout_s)
        except grpc.RpcError as exc:
            log.warning("BatchExistKey failed: %s", exc.code())
            return 0
        n = 0
        for present in resp.exists:
            if not present:
                break
            n += 1
        return n

    def stats(self) -> store_pb2.StatsResponse:
        return self.stub.Stats(store_pb2.StatsRequest(), timeout=self.rpc_timeout_s)

    def close(self) -> None:
        """Stop pinging, unmount the segment, release NIXL resources (best effort)."""
        self._stop.set()
        if self._pinger is not None:
            self._pinger.join(timeout=2)
        if self.segment_id:
            try:
                self.stub.UnmountSegment(store_pb2.UnmountSegmentRequest(
                    client_id=self.client_id, segment_id=self.segment_id),
                    timeout=self.rpc_timeout_s)
            except grpc.RpcError as exc:
                log.warning("UnmountSegment failed: %s", exc.code())
        if self.agent is None:
            self._channel.close()
            return
        with self._lock:
            for name in list(self._remotes.values()):
                try:
                    self.agent.remove_remote_agent(name)
                except Exception as exc:  # best effort
                    log.debug("remove_remote_agent: %s", exc)
            self._remotes.clear()
            for reg in self._regs:
                try:
                    self.agent.deregister_memory(reg)
                except Exception as exc:  # best effort
                    log.debug("deregister_memory: %s", exc)
            self._regs.clear()
        self._channel.close()
