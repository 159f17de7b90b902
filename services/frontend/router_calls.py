"""The frontend's calls to the router, for the pipeline (:mod:`.pipeline`) and the
express path (:mod:`.express`): one request's Route, PrefillDone, ReportFailure and
Release, to the router embedded in this process or over gRPC.

Contract of :class:`RouterCalls` (``pool``: the pipeline's channel pool; ``spawn``: runs
a coroutine as a task that outlives the request's cancellation and that the pipeline's
``close`` waits for):

- ``stub()``: the in-process stub (:mod:`services.router.embedded`) when given, else one
  on the pooled channel to the router at ``router_address()``; None when there is none.
- ``route(router, req, tokens, ctx)``: the RouteResponse for ``req`` (its token ids not
  filled in: ``tokens``), computed in this call when the router is embedded and answers
  without waiting (``route_now``, given the list itself), else by a Route call made in
  the trace context ``ctx``. A caller cancelled meanwhile does not cancel that call (the
  router may have routed it already): its answer is awaited in the background and
  released. A failure is an ApiError: RESOURCE_EXHAUSTED the rejection's 503 (counted in
  ``metrics``), others the router's status; after a :data:`MAYBE_ROUTED` code (the
  router may hold the entry) a best-effort Release follows.
- ``release(router, request_id)``: Release, awaited (an embedded router: in this call);
  a failed call is logged, never raised. ``release_soon``: the same without waiting
  (an embedded router's in this call: None; else the task doing it, returned).
- ``prefill_done(router, request_id)`` and ``report_failure(router, request_id,
  failure)``: fire-and-forget (an embedded router's PrefillDone in this call); their
  failures are logged. ``report_failure`` also forgets the pooled channel to a worker
  that was unreachable (a restart on the same port is dialled afresh).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
from opentelemetry.context import Context

from protos import router_pb2, router_pb2_grpc
from services.common.grpc_client import ChannelPool
from services.common.telemetry import Attached
from services.frontend.failures import WorkerFailure, rejection_error, status_error
from services.frontend.metrics import FrontendMetrics

log = logging.getLogger(__name__)

# Route errors after which the router may have committed the entry (the failure was on
# our side of the call): a best-effort Release follows.
MAYBE_ROUTED = frozenset({
    grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
})

Spawn = Callable[[Coroutine[Any, Any, None]], "asyncio.Future[None]"]


class RouterCalls:
    """See the module docstring."""

    def __init__(self, pool: ChannelPool, router_address: Callable[[], str | None],
                 router_stub: Any, metrics: FrontendMetrics, spawn: Spawn) -> None:
        self._pool = pool
        self._router_address = router_address
        self._router_stub = router_stub
        self._metrics = metrics
        self._spawn = spawn

    def stub(self) -> Any:
        """See the module docstring."""
        if self._router_stub is not None:
            return self._router_stub
        address = self._router_address()
        return router_pb2_grpc.RouterStub(self._pool.get(address, "router")) if address \
            else None

    async def route(self, router: Any, req: router_pb2.RouteRequest, tokens: list[int],
                    ctx: Context | None) -> router_pb2.RouteResponse:
        """See the module docstring."""
        try:
            now = getattr(router, "route_now", None)
            if now is not None:
                with Attached(ctx):
                    resp: router_pb2.RouteResponse | None = now(req, tokens)
                if resp is not None:
                    return resp
            req.token_ids.extend(tokens)
            with Attached(ctx):
                call: asyncio.Future[router_pb2.RouteResponse] = asyncio.ensure_future(
                    router.Route(req, timeout=10))
            try:
                return await asyncio.shield(call)
            except asyncio.CancelledError:
                self._spawn(self._release_when_routed(router, req.request_id, call))
                raise
        except grpc.aio.AioRpcError as exc:
            if exc.code() in MAYBE_ROUTED:  # the router may hold the entry: free it
                self._spawn(self.release(router, req.request_id))
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                err = rejection_error(exc)
                self._metrics.observe_rejection(err.code or "")
                raise err from exc
            raise status_error(exc.code(), exc.details() or "", "router") from exc

    async def _release_when_routed(self, router: Any, request_id: str,
                                   call: asyncio.Future[router_pb2.RouteResponse]) -> None:
        """Releases ``request_id`` once its abandoned Route ``call`` succeeded."""
        await asyncio.wait([call])
        if call.cancelled() or call.exception() is not None:
            return  # not routed: nothing to release
        await self.release(router, request_id)

    async def release(self, router: Any, request_id: str) -> None:
        """See the module docstring."""
        nowait = getattr(router, "release_nowait", None)
        if nowait is not None:  # an embedded router: in this call
            nowait(request_id)
            return
        try:
            await router.Release(router_pb2.ReleaseRequest(request_id=request_id), timeout=5)
        except grpc.aio.AioRpcError as exc:
            log.warning("router Release(%s) failed: %s", request_id, exc.code().name)

    def release_soon(self, router: Any, request_id: str) -> asyncio.Future[None] | None:
        """See the module docstring."""
        nowait = getattr(router, "release_nowait", None)
        if nowait is not None:
            nowait(request_id)
            return None
        return self._spawn(self.release(router, request_id))

    def prefill_done(self, router: Any, request_id: str) -> None:
        """See the module docstring."""
        nowait = getattr(router, "prefill_done_nowait", None)
        if nowait is not None:
            nowait(request_id)
            return

        async def call() -> None:
            try:
                await router.PrefillDone(router_pb2.PrefillDoneRequest(request_id=request_id),
                                         timeout=5)
            except Exception as exc:  # noqa: BLE001 - said; its prefill counts until Release
                log.warning("router PrefillDone(%s) failed: %s", request_id,
                            exc.code().name if isinstance(exc, grpc.aio.AioRpcError)
                            else f"{type(exc).__name__}: {exc}")

        self._spawn(call())

    def report_failure(self, router: Any, request_id: str, failure: WorkerFailure) -> None:
        """See the module docstring."""
        if failure.code == grpc.StatusCode.UNAVAILABLE and failure.address:
            self._pool.invalidate(failure.address)
        reason = f"{failure.stage}: {failure.code.name if failure.code else 'no status'}: " \
                 f"{failure.detail}"

        async def call() -> None:
            try:
                await router.ReportFailure(router_pb2.ReportFailureRequest(
                    instance_id=failure.instance_id, reason=reason[:1000],
                    request_id=request_id), timeout=5)
            except grpc.aio.AioRpcError as exc:
                log.warning("router ReportFailure(%s) failed: %s", failure.instance_id,
                            exc.code().name)

        self._spawn(call())
