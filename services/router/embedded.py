"""The router as a library inside another process (the frontend's ``--router embedded``).

Dynamo's frontend routes in-process; so can ours. :func:`start_embedded_router` starts a
whole router (:func:`services.router.main.start_router`: core, policies, discovery
watchers, load poller, admission, metrics, and its gRPC server on a free port,
registered in etcd like any router) in the calling process's event loop, with
``--indexer embedded`` also the KV event feed and index the router process would run.
The caller then talks to it through :class:`InProcessRouterStub` instead of a channel.

Contract of :class:`InProcessRouterStub` (the call shape of ``RouterStub``):

- ``await stub.Route(req, timeout=...)``, and the same for ``Release``, ``PrefillDone``,
  ``ReportFailure`` and ``ListWorkers``, call the :class:`RouterServicer`'s method
  directly in this event loop: no serialization, no HTTP/2, no gRPC interceptors (so no
  gRPC client or server span: the router's own ``router.route`` span is a child of the
  caller's current span). ``metadata``, ``wait_for_ready`` and ``compression`` are
  accepted and have no effect (the servicer reads no metadata); any other keyword is a
  TypeError.
- Errors surface exactly as over a channel: a ``context.abort(code, details,
  trailing_metadata=...)`` in the servicer raises :class:`grpc.aio.AioRpcError` with that
  code, details and trailing metadata (a ``grpc.aio.Metadata``, as a real call's); past
  ``timeout`` seconds the servicer's call is cancelled and DEADLINE_EXCEEDED ("Deadline
  Exceeded") is raised; an exception escaping the servicer is logged and raised as
  INTERNAL naming it (as :mod:`services.common.server` answers it). Cancelling the
  caller cancels the servicer's call, as a cancelled RPC cancels its handler.
- ``route_now(request, token_ids=None)``: Route's answer computed in this call, raising
  what Route raises, when the router's overlap source answers without waiting (an
  embedded index, or none: ``RouterServicer.route_now``); None otherwise (then call
  ``Route``, with ``token_ids`` in the request). ``token_ids``: the prompt as a list
  when the caller holds one; the request's own ``token_ids`` are then not read (the
  caller may leave them empty: no copy into the message and back).
- ``release_nowait(request_id)`` and ``prefill_done_nowait(request_id)``: what a
  fire-and-forget ``Release`` / ``PrefillDone`` call would do, done in this call (the
  router's state is this process's: no task, no await); a refusal (a bad id) is logged
  as a warning, any other failure logged and counted in the router's errors metric,
  never raised.
- Requests and responses are the caller's and the servicer's objects, not copies: the
  caller must not change a request while its call runs (the pipeline builds one per
  call), and owns the response.

:class:`EmbeddedRouter` is what :func:`start_embedded_router` returns: ``stub``, the
router app (``app``: its servicer, metrics, gRPC address) and ``index`` (the embedded
:class:`~services.indexer.core.KvIndex`, None without ``--indexer embedded``);
``stop()`` stops the router and the feed. Idempotent.
"""

# ruff: noqa: ASYNC109  (``timeout=`` is the call shape of a grpc.aio stub, on purpose)
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from protos import router_pb2
from services.router.main import RouterApp, RouterConfig, start_router_with_index
from services.router.service import Refused, RouterServicer

log = logging.getLogger(__name__)

Resp = TypeVar("Resp")
# keywords of a grpc.aio unary call that mean nothing in-process
_IGNORED = frozenset({"metadata", "wait_for_ready", "compression", "credentials"})


class _Context:
    """The part of ``grpc.aio.ServicerContext`` the router's servicer uses: ``abort``."""

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: Any = ()) -> None:
        raise rpc_error(code, details, trailing_metadata)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


def rpc_error(code: grpc.StatusCode, details: str, trailing: Any = ()) -> grpc.aio.AioRpcError:
    """The AioRpcError a channel raises for a call ending with ``code``."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(),
                                grpc.aio.Metadata(*tuple(trailing or ())), details)


class InProcessRouterStub:
    """A ``RouterStub`` that calls a servicer in this process; see the module docstring."""

    def __init__(self, servicer: RouterServicer) -> None:
        self._servicer = servicer

    async def _call(self, name: str, method: Callable[[Any, Any], Awaitable[Resp]],
                    request: Any, timeout: float | None, kwargs: dict[str, Any]) -> Resp:
        unknown = set(kwargs) - _IGNORED
        if unknown:
            raise TypeError(f"{name}() got unexpected keyword arguments {sorted(unknown)}")
        try:
            # awaited in the caller's task (asyncio.timeout, unlike wait_for, starts none)
            async with asyncio.timeout(timeout):
                return await method(request, _Context())
        except grpc.aio.AioRpcError:
            raise
        except TimeoutError:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except Exception as exc:
            log.exception("router %s failed", name)
            raise rpc_error(grpc.StatusCode.INTERNAL,
                            f"/kvmesh.router.Router/{name} failed: "
                            f"{type(exc).__name__}: {exc}"[:512]) from exc

    async def Route(self, request: router_pb2.RouteRequest,  # noqa: N802
                    timeout: float | None = None, **kw: Any) -> router_pb2.RouteResponse:
        return await self._call("Route", self._servicer.Route, request, timeout, kw)

    async def Release(self, request: router_pb2.ReleaseRequest,  # noqa: N802
                      timeout: float | None = None, **kw: Any) -> router_pb2.ReleaseResponse:
        return await self._call("Release", self._servicer.Release, request, timeout, kw)

    async def PrefillDone(self, request: router_pb2.PrefillDoneRequest,  # noqa: N802
                          timeout: float | None = None,
                          **kw: Any) -> router_pb2.PrefillDoneResponse:
        return await self._call("PrefillDone", self._servicer.PrefillDone, request, timeout,
                                kw)

    async def ReportFailure(self, request: router_pb2.ReportFailureRequest,  # noqa: N802
                            timeout: float | None = None,
                            **kw: Any) -> router_pb2.ReportFailureResponse:
        return await self._call("ReportFailure", self._servicer.ReportFailure, request,
                                timeout, kw)

    def route_now(self, request: router_pb2.RouteRequest, token_ids: list[int] | None = None
                  ) -> router_pb2.RouteResponse | None:
        """Route's answer computed in this call (no task, no await) when the router's
        overlap source answers without waiting, else None: then call :meth:`Route`.
        Raises what Route raises (AioRpcError with the same code, details and trailing
        metadata). ``token_ids``: see the module docstring."""
        try:
            return self._servicer.route_now(request, token_ids)
        except Refused as exc:
            raise rpc_error(exc.code, exc.message, exc.trailing) from None

    def release_nowait(self, request_id: str) -> None:
        """Release's effect now, in this call (no task, no await): the caller's
        fire-and-forget Release. A refusal or failure is logged, never raised."""
        self._nowait("Release", self._servicer.release_now, request_id)

    def prefill_done_nowait(self, request_id: str) -> None:
        """PrefillDone's effect now (as :meth:`release_nowait`)."""
        self._nowait("PrefillDone", self._servicer.prefill_done_now, request_id)

    def _nowait(self, name: str, method: Callable[[str], bool], request_id: str) -> None:
        try:
            method(request_id)
        except Refused as exc:
            log.warning("router %s(%s) refused: %s: %s", name, request_id[:64],
                        exc.code.name, exc.message)
        except Exception as exc:
            self._servicer.failure(name, exc)

    async def ListWorkers(self, request: router_pb2.ListWorkersRequest,  # noqa: N802
                          timeout: float | None = None,
                          **kw: Any) -> router_pb2.ListWorkersResponse:
        return await self._call("ListWorkers", self._servicer.ListWorkers, request, timeout,
                                kw)


@dataclass
class EmbeddedRouter:
    """A router started in this process; see the module docstring."""

    app: RouterApp
    stub: InProcessRouterStub
    index: Any = None  # services.indexer.core.KvIndex with --indexer embedded
    _stopped: bool = False

    async def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            await self.app.server.stop()


async def start_embedded_router(cfg: RouterConfig) -> EmbeddedRouter:
    """Starts the router of ``cfg`` in this event loop (with ``--indexer embedded`` its
    stream feed and index first, stopped with it) and its in-process stub."""
    app, index = await start_router_with_index(cfg, f"router-{os.getpid()}-{id(cfg):x}")
    return EmbeddedRouter(app, InProcessRouterStub(app.servicer), index)
