"""gRPC client channels with OpenTelemetry propagation.

Contract:

- :func:`channel` returns a ``grpc.aio`` channel to ``address`` (mTLS presenting the
  given :class:`~services.common.tls.MeshTls` certificate and trusting only the mesh CA,
  and, with ``server_role``, only a server whose certificate holds that role
  (:func:`services.common.tls.channel_options`); or plaintext when it is None) whose
  calls create
  client spans and carry the current trace context (opentelemetry-instrumentation-grpc
  interceptors; in lean tracing mode, :func:`services.common.telemetry.lean`, a call
  whose context is not sampled skips the interceptors and carries the context as
  metadata: :class:`LeanChannel`). Its reconnect backoff is short
  (:data:`RECONNECT_BACKOFF_MS` up to :data:`MAX_RECONNECT_BACKOFF_MS`), so a peer
  restarted on the same port is reached within about a second instead of gRPC's default
  backoff of up to two minutes.
- :class:`ChannelPool` (``tls`` as for :func:`channel`) caches one channel per address;
  ``get(address, server_role)`` (the pool's ``server_role`` by default) dials a new one
  when the role expected at that address changed.
  ``invalidate(address)`` forgets the channel after a call through it failed with
  UNAVAILABLE: the next ``get`` dials afresh (no backoff left over from the dead peer),
  while calls still running on the old channel may finish within :data:`RETIRE_GRACE_S`
  (then they are cancelled). ``close()`` closes every cached channel and waits up to
  :data:`CLOSE_WAIT_S` for the retired ones' calls (their owners normally cancel them
  first), then abandons them to garbage collection.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import grpc
from opentelemetry.instrumentation.grpc import aio_client_interceptors

from services.common import telemetry
from services.common.tls import MeshTls, channel_options

RECONNECT_BACKOFF_MS = 100
MAX_RECONNECT_BACKOFF_MS = 1000
RETIRE_GRACE_S = 600.0
CLOSE_WAIT_S = 5.0

# Reconnect at once to a peer that comes back (also used for etcd's channel).
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
    # Not grpc.min_reconnect_backoff_ms: gRPC core uses it as the connect timeout, and
    # at 100 ms a loaded host's handshakes timed out ("before receiving SETTINGS frame").
    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    # Own subchannels: with gRPC's process-wide pool a fresh channel would share the old
    # one's connection, backoff included, and invalidate() could not dial afresh.
    ("grpc.use_local_subchannel_pool", 1),
]
_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.enable_retries", 0),
    *RECONNECT_OPTIONS,
]


class _LeanCall:
    """One method of a :class:`LeanChannel`: the instrumented multicallable for a call
    whose context is sampled (or outside lean mode), else the same method without the
    interceptors, with the context injected into its metadata."""

    def __init__(self, traced: Any) -> None:
        self._traced = traced
        self._bare = copy.copy(traced)
        self._bare._interceptors = None  # grpc.aio's multicallables: None = direct call

    def __call__(self, request: Any, *, timeout: float | None = None,
                 metadata: Any = None, **kwargs: Any) -> Any:
        if not telemetry.lean() or telemetry.is_sampled(None):
            return self._traced(request, timeout=timeout, metadata=metadata, **kwargs)
        md = [*tuple(metadata or ()), *telemetry.propagation_metadata()]
        return self._bare(request, timeout=timeout, metadata=md, **kwargs)


class LeanChannel:
    """A ``grpc.aio.Channel`` (everything delegated) whose methods are :class:`_LeanCall`
    (see the module docstring), made once per method and channel: a stub built per call
    (``WorkerStub(channel)``) reuses them instead of registering every method again."""

    def __init__(self, inner: grpc.aio.Channel) -> None:
        self._inner = inner
        self._calls: dict[tuple[Any, ...], _LeanCall] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _call(self, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _LeanCall:
        key = (kind, args, tuple(sorted(kwargs.items())))
        call = self._calls.get(key)
        if call is None:
            call = self._calls[key] = _LeanCall(getattr(self._inner, kind)(*args, **kwargs))
        return call

    def unary_unary(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("unary_unary", args, kwargs)

    def unary_stream(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("unary_stream", args, kwargs)

    def stream_unary(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("stream_unary", args, kwargs)

    def stream_stream(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("stream_stream", args, kwargs)

    def untraced_stream_stream(self, method: str, **kwargs: Any) -> Any:
        """``stream_stream(method, **kwargs)`` without the tracing interceptors: for a
        long-lived stream whose messages carry their own trace context (one span for the
        whole stream would say nothing)."""
        bare = copy.copy(self._inner.stream_stream(method, **kwargs))
        bare._interceptors = None  # as _LeanCall's bare call
        return bare

    async def __aenter__(self) -> LeanChannel:
        await self._inner.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._inner.__aexit__(*exc)


def channel(address: str, tls: MeshTls | None = None,
            server_role: str = "") -> grpc.aio.Channel:
    """An instrumented channel to ``host:port``: mTLS with ``tls`` (to a ``server_role``
    server when given), else plaintext; a :class:`LeanChannel` around it."""
    if tls is None:
        inner = grpc.aio.insecure_channel(
            address, options=_OPTIONS, interceptors=aio_client_interceptors()
        )
    else:
        inner = grpc.aio.secure_channel(
            address, tls.channel_credentials(),
            options=[*_OPTIONS, *channel_options(server_role)],
            interceptors=aio_client_interceptors(),
        )
    return LeanChannel(inner)  # type: ignore[return-value]


def sync_channel(address: str, tls: MeshTls | None = None,
                 server_role: str = "") -> grpc.Channel:
    """A blocking channel to ``host:port`` (threads, e.g. the store client): mTLS with
    ``tls`` (to a ``server_role`` server when given), else plaintext."""
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, tls.channel_credentials(),
                               options=channel_options(server_role))


class ChannelPool:
    """One channel per address, closed together; see the module docstring."""

    def __init__(self, tls: MeshTls | None = None, server_role: str = "") -> None:
        self.tls = tls
        self.server_role = server_role
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._roles: dict[str, str] = {}  # address -> the server role its channel expects
        self._retired: dict[grpc.aio.Channel, asyncio.Task[None]] = {}

    def get(self, address: str, server_role: str | None = None) -> grpc.aio.Channel:
        """The cached channel to ``address`` (created on first use, and again when the
        server role expected there changed)."""
        role = self.server_role if server_role is None else server_role
        ch = self._channels.get(address)
        if ch is not None and self._roles.get(address) != role:
            self.invalidate(address)
            ch = None
        if ch is None:
            ch = self._channels[address] = channel(address, self.tls, role)
            self._roles[address] = role
        return ch

    def invalidate(self, address: str) -> bool:
        """Forgets the channel to ``address`` (closing it gracefully in the background);
        False when there was none."""
        ch = self._channels.pop(address, None)
        self._roles.pop(address, None)
        if ch is None:
            return False
        task = asyncio.ensure_future(ch.close(grace=RETIRE_GRACE_S))
        self._retired[ch] = task
        task.add_done_callback(lambda _: self._retired.pop(ch, None))
        return True

    async def drop(self, address: str) -> None:
        """Closes and forgets the channel to ``address`` if any."""
        ch = self._channels.pop(address, None)
        self._roles.pop(address, None)
        if ch is not None:
            await ch.close()

    async def keep_only(self, addresses: set[str]) -> None:
        """Closes and forgets every channel whose address is not in ``addresses``."""
        for address in [a for a in self._channels if a not in addresses]:
            await self.drop(address)

    async def close(self) -> None:
        """Closes all channels; see the module docstring."""
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        self._roles.clear()
        tasks = list(self._retired.values())
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=CLOSE_WAIT_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        self._retired.clear()
