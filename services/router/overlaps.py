"""Where the router's overlap predictions come from (``--indexer none|remote|embedded``).

Contract of an overlap source (``find(hashes, workers)``, async):

- ``hashes`` maps each distinct block size of the candidate workers to the prompt's
  chained block hashes at that size (the service hashes once per size); ``workers`` are
  the candidates. Returns ``{worker_id: WorkerOverlap}`` (workers absent hold nothing,
  and each worker's overlap is counted at its own block size), or None when there is no
  answer: the core then falls back to its own history.
- ``tree_blocks()`` returns the number of blocks indexed per worker when the source knows
  it (tie-break by smaller tree), else None.
- A source that answers without waiting also has ``find_now(hashes, workers)``, the
  same answer in the caller's call (:class:`HistorySource`, :class:`EmbeddedSource`):
  an embedded router then routes without a task (``RouterServicer.route_now``).
- :class:`HistorySource` (``none``) always answers None.
- :class:`EmbeddedSource` (``embedded``) asks an in-process index object with
  ``find_matches(hashes) -> {worker: obj with blocks, by_tier}`` (e.g. the indexer's
  ``KvIndex``, kept fresh by a consumer the caller runs); if it also has
  ``worker_blocks() -> {worker: int}`` that feeds ``tree_blocks``.
- :class:`RemoteSource` (``remote``) calls ``Indexer.FindMatches`` on an indexer found in
  discovery (the first live instance by id), with a short timeout. No instance, an RPC
  error or a timeout answers None and counts one fallback (``fallbacks``, by reason in
  ``fallback_reasons``). ``stub_factory(address)`` replaces the gRPC stub in tests.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import grpc

from protos import discovery_pb2, indexer_pb2, indexer_pb2_grpc
from services.common.grpc_client import ChannelPool
from services.common.tls import MeshTls
from services.router.plan import WorkerRecord
from services.router.policies.base import WorkerOverlap

log = logging.getLogger(__name__)


class OverlapSource(Protocol):
    """See the module docstring."""

    name: str

    async def find(self, hashes: Mapping[int, Sequence[int]],
                   workers: Sequence[WorkerRecord]) -> dict[str, WorkerOverlap] | None:
        """Per-worker overlap of the prompt, or None (use the history)."""
        ...

    def tree_blocks(self) -> dict[str, int] | None:
        """Indexed blocks per worker, when known."""
        ...

    async def close(self) -> None:
        """Releases connections."""
        ...


def _by_size(workers: Sequence[WorkerRecord]) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for w in workers:
        out.setdefault(w.block_size, set()).add(w.instance_id)
    return out


class HistorySource:
    """No indexer: the core uses its own request history."""

    name = "none"

    async def find(self, hashes: Mapping[int, Sequence[int]],
                   workers: Sequence[WorkerRecord]) -> dict[str, WorkerOverlap] | None:
        """Always None."""
        return None

    def find_now(self, hashes: Mapping[int, Sequence[int]],
                 workers: Sequence[WorkerRecord]) -> dict[str, WorkerOverlap] | None:
        """``find``'s answer, in this call."""
        return None

    def tree_blocks(self) -> dict[str, int] | None:
        """Unknown."""
        return None

    async def close(self) -> None:
        """Nothing to release."""


class EmbeddedSource:
    """An in-process index (see the module docstring)."""

    name = "embedded"

    def __init__(self, index: Any) -> None:
        if not callable(getattr(index, "find_matches", None)):
            raise TypeError("the embedded index needs a find_matches(hashes) method")
        self.index = index

    async def find(self, hashes: Mapping[int, Sequence[int]],
                   workers: Sequence[WorkerRecord]) -> dict[str, WorkerOverlap] | None:
        """The index's matches, each worker at its own block size."""
        return self.find_now(hashes, workers)

    def find_now(self, hashes: Mapping[int, Sequence[int]],
                 workers: Sequence[WorkerRecord]) -> dict[str, WorkerOverlap] | None:
        """``find``'s answer, in this call."""
        out: dict[str, WorkerOverlap] = {}
        for bs, ids in _by_size(workers).items():
            seq = hashes.get(bs) or ()
            if not seq:
                continue
            for wid, ov in self.index.find_matches(list(seq)).items():
                if wid in ids:
                    out[wid] = WorkerOverlap(wid, int(ov.blocks), dict(ov.by_tier))
        return out

    def tree_blocks(self) -> dict[str, int] | None:
        """``index.worker_blocks()`` when the index has it."""
        fn = getattr(self.index, "worker_blocks", None)
        return dict(fn()) if callable(fn) else None

    async def close(self) -> None:
        """The caller owns the index."""


class RemoteSource:
    """The indexer service, found in discovery (see the module docstring)."""

    name = "remote"

    def __init__(self, instances: Callable[[], Mapping[str, discovery_pb2.InstanceRecord]],
                 timeout_s: float = 0.1,
                 stub_factory: Callable[[str], Any] | None = None,
                 tls: MeshTls | None = None) -> None:
        self._instances = instances
        self._timeout = timeout_s
        self._pool = ChannelPool(tls, "indexer")
        self._stub_factory = stub_factory or (
            lambda address: indexer_pb2_grpc.IndexerStub(self._pool.get(address)))
        self.fallbacks = 0
        self.fallback_reasons: dict[str, int] = {}

    def _fallback(self, reason: str, detail: str) -> None:
        self.fallbacks += 1
        self.fallback_reasons[reason] = self.fallback_reasons.get(reason, 0) + 1
        if self.fallbacks == 1 or self.fallbacks % 100 == 0:
            log.warning("indexer unavailable (%s: %s); using the router's history "
                        "(%d fallbacks so far)", reason, detail, self.fallbacks)

    async def find(self, hashes: Mapping[int, Sequence[int]],
                   workers: Sequence[WorkerRecord]) -> dict[str, WorkerOverlap] | None:
        """FindMatches per block size; None (and a counted fallback) on failure."""
        live = self._instances()
        if not live:
            self._fallback("no_instance", "no indexer registered")
            return None
        address = live[sorted(live)[0]].address
        stub = self._stub_factory(address)
        out: dict[str, WorkerOverlap] = {}
        for bs, ids in _by_size(workers).items():
            seq = hashes.get(bs) or ()
            if not seq:
                continue
            try:
                resp = await stub.FindMatches(
                    indexer_pb2.FindMatchesRequest(block_hashes=list(seq)),
                    timeout=self._timeout)
            except grpc.RpcError as exc:
                code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
                self._fallback(code.name.lower() if code else "rpc_error", str(exc))
                return None
            for ov in resp.overlaps:
                if ov.worker_id in ids:
                    out[ov.worker_id] = WorkerOverlap(ov.worker_id, ov.blocks, dict(ov.by_tier))
        return out

    def tree_blocks(self) -> dict[str, int] | None:
        """Unknown (the API has no per-worker sizes)."""
        return None

    async def close(self) -> None:
        """Closes the channels."""
        await self._pool.close()
