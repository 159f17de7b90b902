"""The one gRPC server bootstrap every kvmesh service uses.

Contract of :class:`MeshServer`:

- ``start()``: creates a ``grpc.aio`` server with the OpenTelemetry server interceptor
  (:class:`TracingInterceptor`: in lean tracing mode only for calls whose propagated
  context is sampled),
  adds the service's servicers, the standard health service (every service starts
  NOT_SERVING) and reflection, binds ``host:port`` (port 0 picks a free one; ``address``
  tells which; with ``cfg.tls_dir`` set the port is TLS with the ``component`` role's
  certificate, client certificates are required (unless ``client_auth`` is False: a
  user-facing port, the frontend's, where users present API keys instead) and
  :class:`AuthzInterceptor` checks every call's role, see :mod:`services.common.authz`;
  without it the port is plaintext and open), then registers the instance record in
  etcd under a lease with keepalive, and only then marks every service SERVING. With
  ``cfg.health_port`` >= 0 a second, plaintext server on ``host:health_port`` serves only
  grpc.health.v1 with the same statuses (``health_port`` tells which port: the kubelet's
  native ``grpc`` probe, which cannot present a client certificate; nothing else is
  reachable there, so it needs no authorization).
- ``stop()``: marks every service NOT_SERVING, revokes the etcd lease (watchers drop the
  instance at once), runs the ``on_stop`` hooks and stops the server (then the health
  port's) with the configured grace period, then runs the ``after_stop`` hooks (what
  must outlive the calls in flight). Idempotent.
- :func:`serve_main` is every kvmesh process's ``main(argv)``: it loads the config class
  from flags and ``KVMESH_*`` env (a bad config prints the problems and returns 2),
  sets up logging and tracing, then runs ``start(cfg)`` (which returns anything with an
  ``async stop()``: a MeshServer, an app, a fleet) until SIGTERM or SIGINT, stops it and
  returns 0. A ``start`` that raises propagates (non-zero exit). The event loop is
  uvloop's when uvloop is installed, unless ``KVMESH_UVLOOP=0`` (:func:`event_loop_factory`);
  else asyncio's. It arms :mod:`services.common.gc_heap` (a ``KVMESH_GC_FREEZE`` other
  than 0 or 1 is refused like a bad config) and the heap is frozen for the garbage
  collector (:func:`~services.common.gc_heap.freeze_heap`, unless
  ``KVMESH_GC_FREEZE=0``) before ``start`` (the imports) and again once it returns (what
  it built).
  The started app may also expose ``fatal``: an awaitable (future or task) that
  resolves to a reason when the app can no longer serve (a worker's engine died). When
  it resolves (or raises) before a signal, serve_main logs one error line with the
  reason, stops the app as on SIGTERM (so a MeshServer turns NOT_SERVING and revokes its
  lease first) and returns :data:`FATAL_EXIT` (3), so a supervisor restarts the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import grpc
from grpc._cython.cygrpc import ExecuteBatchError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry import context as otel_context
from opentelemetry.instrumentation.grpc import aio_server_interceptor

from protos import discovery_pb2
from services.common import gc_heap, grpc_streams, telemetry
from services.common.authz import AuthzInterceptor
from services.common.config import BaseConfig, ConfigError, load_config
from services.common.discovery import Registration
from services.common.telemetry import setup_tracing
from services.common.tls import tls_for

log = logging.getLogger(__name__)

AddFn = Callable[[Any, grpc.aio.Server], None]


class _Malformed:
    """Stands in for a request whose bytes did not parse."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


async def _internal(context: Any, details: Any, exc: Exception) -> None:
    """An exception a servicer let escape: logged once with its traceback and answered
    INTERNAL naming it (grpc's default is UNKNOWN)."""
    log.exception("%s failed", details.method)
    await context.abort(grpc.StatusCode.INTERNAL,
                        f"{details.method} failed: {type(exc).__name__}: {exc}"[:512])


# Long-lived streams whose messages carry their own trace context (and whose handler
# writes with context.write, which OpenTelemetry's interceptor cannot wrap): no span.
UNTRACED_METHODS = frozenset({"/kvmesh.worker.Worker/GenerateMux"})


class TracingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """OpenTelemetry's server interceptor, except in lean tracing mode
    (:func:`services.common.telemetry.lean`) for a call whose propagated context is not
    sampled: its server span could not record, so the handler just runs in the caller's
    context (attached in the call's own task, which grpc.aio runs the handler in: ids
    and the sampled flag propagate on as before). :data:`UNTRACED_METHODS` are never
    wrapped (their handlers write with ``context.write`` themselves). Every other
    response-streaming handler's generators (OpenTelemetry's, the other interceptors',
    the servicer's) are closed in the call's own task (:mod:`services.common.grpc_streams`,
    its contract): a client gone mid-stream neither leaves OpenTelemetry's context to be
    detached from another task nor the servicer's cleanup to the event loop's finalizer."""

    def __init__(self) -> None:
        self._otel = aio_server_interceptor()

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        if details.method in UNTRACED_METHODS:
            return await continuation(details)
        if telemetry.lean():
            ctx = telemetry.remote_context(details.invocation_metadata)
            if not telemetry.is_sampled(ctx):
                otel_context.attach(ctx)  # the call's task ends with the call
                return _closing(await continuation(details), details.method)

        async def registered(d: Any) -> Any:  # OpenTelemetry's inner generator too
            return _streaming(await continuation(d), grpc_streams.Registering)
        return _closing(await self._otel.intercept_service(registered, details),
                        details.method)


def _streaming(handler: Any, wrap: Callable[[Any], Any]) -> Any:
    """``handler`` with its response-streaming behavior replaced by ``wrap(behavior)``;
    None or a handler with one response unchanged."""
    if handler is None or not handler.response_streaming:
        return handler
    if handler.request_streaming:
        return grpc.stream_stream_rpc_method_handler(
            wrap(handler.stream_stream), handler.request_deserializer,
            handler.response_serializer)
    return grpc.unary_stream_rpc_method_handler(
        wrap(handler.unary_stream), handler.request_deserializer,
        handler.response_serializer)


def _closing(handler: Any, method: str) -> Any:
    """A response-streaming ``handler`` whose generators close in the call's own task
    (:func:`services.common.grpc_streams.writing`); a behavior that is no async-generator
    function (one that writes with ``context.write`` itself) is left as it is, and a
    :class:`~services.common.grpc_streams.Registering` no wrapper took is unwrapped."""
    def wrap(behavior: Any) -> Any:
        inner = grpc_streams.unwrapped(behavior)
        if not inspect.isasyncgenfunction(inner):
            return inner
        return grpc_streams.writing(inner, method)
    return _streaming(handler, wrap)


# At most this many guarded handlers are kept (a service has a few dozen methods).
_MAX_GUARDED = 1024


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Answers requests whose protobuf cannot be parsed with INVALID_ARGUMENT (grpc's
    default is UNKNOWN plus an error log) for unary-request methods, and an exception a
    servicer lets escape with INTERNAL (logged; never UNKNOWN). Server-streaming handlers
    may be async generators or coroutines that ``context.write`` (as the health service's
    ``Watch``). The guarded handler is built once per method (the innermost interceptor:
    its continuation answers the same handler every call)."""

    def __init__(self) -> None:
        self._guarded: dict[tuple[str, Any], Any] = {}

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        key = (details.method, handler)
        guarded = self._guarded.get(key)
        if guarded is None:
            guarded = self._guard(handler, details)
            if len(self._guarded) < _MAX_GUARDED:  # bounded, whatever handlers come
                self._guarded[key] = guarded
        return guarded

    @staticmethod
    def _guard(handler: Any, details: Any) -> Any:
        """``handler`` with the malformed-request and INTERNAL mapping (``details``: only
        its ``method``, the same for every call of the handler)."""
        parse = handler.request_deserializer

        def deserialize(raw: bytes) -> Any:
            try:
                return parse(raw)
            except Exception as exc:  # DecodeError and friends
                return _Malformed(str(exc))

        def guard(behavior: Any, streaming: bool) -> Any:
            if streaming:
                async def stream_behavior(request: Any, context: Any) -> Any:
                    if isinstance(request, _Malformed):
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                            f"malformed request: {request.reason}")
                    try:
                        result = grpc_streams.opened(behavior(request, context))
                        if hasattr(result, "__aiter__"):  # an async generator handler
                            async for item in result:
                                yield item
                        else:  # a coroutine that writes with context.write (health Watch)
                            await result
                    except (grpc.aio.AbortError, ExecuteBatchError):
                        raise  # a failed write: the call is over (grpc_streams.writing)
                    except Exception as exc:
                        await _internal(context, details, exc)
                return stream_behavior

            async def unary_behavior(request: Any, context: Any) -> Any:
                if isinstance(request, _Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        f"malformed request: {request.reason}")
                try:
                    return await behavior(request, context)
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:
                    await _internal(context, details, exc)
            return unary_behavior

        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                guard(handler.unary_stream, True), deserialize, handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(
            guard(handler.unary_unary, False), deserialize, handler.response_serializer)


@dataclass
class ServiceSpec:
    """A servicer, the generated ``add_..._to_server`` function and its full service name."""

    add_fn: AddFn
    servicer: Any
    name: str


@dataclass
class MeshServer:
    """A grpc.aio server with health, reflection, tracing and etcd registration."""

    cfg: BaseConfig
    component: str
    services: Sequence[ServiceSpec]
    # Builds the record to publish, given the bound address; None = do not register.
    record_factory: Callable[[str], discovery_pb2.InstanceRecord] | None = None
    on_stop: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    # Run once the gRPC server is started, before the record is built (e.g. more listeners
    # whose addresses the record publishes).
    before_register: list[Callable[[], Awaitable[object]]] = field(default_factory=list)
    after_stop: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    # False: TLS without a required client certificate (methods the policy marks public)
    client_auth: bool = True

    def __post_init__(self) -> None:
        self._server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self.health_port = 0
        self._health = health.aio.HealthServicer()
        self._registration: Registration | None = None
        self._stopped = False
        self.address = ""
        self.port = 0
        self.authz: AuthzInterceptor | None = None

    @property
    def registration(self) -> Registration | None:
        return self._registration

    async def _set_all(self, status: int) -> None:
        await self._health.set("", status)
        for spec in self.services:
            await self._health.set(spec.name, status)

    async def start(self) -> str:
        """Starts serving and registers; returns the bound ``host:port``."""
        tls = tls_for(self.cfg, self.component)
        interceptors = [TracingInterceptor(), MalformedRequestInterceptor()]
        if tls is not None:
            self.authz = AuthzInterceptor(user_facing=not self.client_auth)
            interceptors.insert(1, self.authz)
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                ("grpc.max_send_message_length", 64 * 1024 * 1024),
                ("grpc.so_reuseport", 0),
            ],
        )
        for spec in self.services:
            spec.add_fn(spec.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        names = [s.name for s in self.services]
        reflection.enable_server_reflection(
            [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME],
            server,
        )
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        bind = f"{self.cfg.host}:{self.cfg.port}"
        self.port = (server.add_insecure_port(bind) if tls is None
                     else server.add_secure_port(bind, tls.server_credentials(
                         self.client_auth)))
        if self.port == 0:
            raise OSError(f"cannot bind {self.cfg.host}:{self.cfg.port}")
        await server.start()
        self._server = server
        if self.cfg.health_port >= 0:
            await self._start_health_port()
        self.address = f"{self.cfg.public_host}:{self.port}"
        for hook in self.before_register:
            await hook()
        if self.record_factory is not None:
            record = self.record_factory(self.address)
            if not record.started_at_ms:
                record.started_at_ms = int(time.time() * 1000)
            self._registration = Registration(
                self.cfg.etcd_endpoint, self.cfg.namespace, record, self.cfg.lease_ttl, tls=tls
            )
            await self._registration.start()
        await self._set_all(health_pb2.HealthCheckResponse.SERVING)
        log.info("%s serving on %s (%s)", self.component, self.address,
                 "mTLS" if tls is not None else "insecure")
        return self.address

    async def _start_health_port(self) -> None:
        """The plaintext health-only server (see the module docstring)."""
        hs = grpc.aio.server(interceptors=[MalformedRequestInterceptor()],
                             options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self._health, hs)
        bind = f"{self.cfg.host}:{self.cfg.health_port}"
        self.health_port = hs.add_insecure_port(bind)
        if self.health_port == 0:
            raise OSError(f"cannot bind the health port {bind}")
        await hs.start()
        self._health_server = hs

    async def stop(self) -> None:
        """NOT_SERVING → revoke lease → on_stop hooks → server.stop(grace) → after_stop
        hooks. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        with contextlib.suppress(Exception):
            await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self._registration is not None:
            await self._registration.close()
        for hook in self.on_stop:
            try:
                await hook()
            except Exception:
                log.exception("on_stop hook failed")
        if self._server is not None:
            await self._server.stop(self.cfg.grace_s)
        if self._health_server is not None:
            await self._health_server.stop(0)
        for hook in self.after_stop:
            try:
                await hook()
            except Exception:
                log.exception("after_stop hook failed")

    async def wait(self) -> None:
        """Waits until the server terminates."""
        if self._server is not None:
            await self._server.wait_for_termination()


def setup_logging(level: str) -> None:
    """Plain process logging: time, level, logger, message."""
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


class Stoppable(Protocol):
    """What a process's ``start`` returns: something that can be stopped (and may have a
    ``fatal`` awaitable; see the module docstring)."""

    async def stop(self) -> None: ...


C = TypeVar("C", bound=BaseConfig)
# serve_main's exit code after the app's ``fatal`` fired (0: signal, 2: bad config).
FATAL_EXIT = 3


async def _fatal_reason(fatal: Awaitable[Any]) -> str:
    """What ``fatal`` resolved to, or the error it raised. Shielded: cancelling this
    wait (on a signal) leaves the app's own future to the app's ``stop()``."""
    try:
        return str(await asyncio.shield(asyncio.ensure_future(fatal)))
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


async def _serve_until_signal(start: Callable[[C], Awaitable[Stoppable]], cfg: C,
                              component: str) -> int:
    """Runs the app until a signal (→ 0) or its ``fatal`` (→ FATAL_EXIT), then stops it."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    gc_heap.freeze_heap("the imports")
    app = await start(cfg)
    gc_heap.freeze_heap(f"{component}'s start")
    signalled = asyncio.create_task(stop.wait())
    fatal = getattr(app, "fatal", None)
    died = asyncio.create_task(_fatal_reason(fatal)) if fatal is not None else None
    reason: str | None = None
    try:
        pending: set[asyncio.Task[Any]] = {signalled, *([died] if died else [])}
        while not stop.is_set() and reason is None:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if died in done and not died.cancelled():  # cancelled: the app gave it up
                reason = died.result()
    finally:
        signalled.cancel()
        if died is not None:
            died.cancel()
    code = 0
    if reason is not None and not stop.is_set():
        code = FATAL_EXIT
        log.error("%s cannot serve: %s; stopping (exit code %d)", component, reason, code)
    else:
        log.info("%s shutting down", component)
    await app.stop()
    return code


def serve_main(config_cls: type[C], argv: Sequence[str] | None, component: str,
               start: Callable[[C], Awaitable[Stoppable]]) -> int:
    """A process's ``main``: config → logging, tracing → ``start`` until a signal (or the
    app's ``fatal``) → stop.

    Returns 2 on a bad config, 0 after a clean stop, FATAL_EXIT after ``fatal``; see the
    module docstring.
    """
    try:
        cfg = load_config(config_cls, argv)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        gc_heap.arm()
    except ValueError as exc:  # KVMESH_GC_FREEZE neither 0 nor 1
        print(exc, file=sys.stderr)
        return 2
    setup_logging(cfg.log_level)
    setup_tracing(f"kvmesh-{component}")
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        return runner.run(_serve_until_signal(start, cfg, component))


# Set to "0" to run serve_main on asyncio's own event loop even where uvloop is installed.
UVLOOP_ENV = "KVMESH_UVLOOP"


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's ``new_event_loop`` when uvloop is installed (and ``KVMESH_UVLOOP`` is not
    ``0``), else None (asyncio's default loop). uvloop runs the same grpc.aio, uvicorn
    and redis code with about half the event loop's CPU per callback."""
    if os.environ.get(UVLOOP_ENV, "1") == "0":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop  # type: ignore[no-any-return]
