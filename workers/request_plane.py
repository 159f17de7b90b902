"""The worker's TCP request plane: ``GenerateMux``'s protocol on a plain TCP (or mTLS)
connection instead of a gRPC stream (the frontend's half:
:mod:`services.frontend.request_plane`; the framing: :mod:`services.common.frames`).

A Generate call through it costs a fraction of its CPU through gRPC (see
:mod:`services.common.frames`); everything else is the gRPC stream's, because both feed
the same :class:`~workers.generate_stream.GenerateStreams`: the same calls, validation,
engine, replies, errors, cancels and stop.

Contract of :class:`RequestPlane`:

- ``start()`` listens on ``host:port`` (0: a free port) and returns the address to
  publish (``public_host:port``); the worker's record carries it as
  ``request_plane_address``. ``close()`` stops listening and ends the connections still
  open, their last replies sent first (each connection is dropped if that takes over
  ``FLUSH_TIMEOUT_S``); the worker's stop runs it after :meth:`GenerateStreams.close`,
  which has ended their calls with UNAVAILABLE "worker is stopping".
- A connection is served once its :data:`~services.common.frames.PREAMBLE` came (within
  ``handshake_timeout_s``, else it is closed): its messages are ``GenerateFrames`` and the
  worker's are ``GenerateReplies``, with exactly ``GenerateMux``'s contract
  (:mod:`workers.generate_stream`: the opening reply with ``call_id`` 0, frames, replies,
  cancels, timeouts, one ``end`` per call). The caller's end of messages is a
  ``done_writing``. Where ``GenerateMux`` would end with a status (a broken caller:
  INVALID_ARGUMENT naming the problem, a message that is not a ``GenerateFrames``
  included), the worker sends one last message holding a single reply with ``call_id``
  0 and that status as ``end``, then closes the connection. A connection that breaks
  (a framing error, a reset) ends as a gRPC stream that breaks: its calls are cancelled.
- **mTLS** (``tls``): the connection is TLS with the worker's certificate and needs a
  client certificate signed by the mesh CA (no certificate, or one of another CA, fails
  the handshake) naming a role that may call ``Worker/GenerateMux``
  (:data:`services.common.authz.POLICY`: the frontend); another role, or a certificate
  naming none, gets that one last status message at once (PERMISSION_DENIED /
  UNAUTHENTICATED, as the gRPC server's authorization answers): nothing it sends is
  read and no call runs. Refusals are logged once per role and reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import DecodeError

from protos import worker_pb2
from services.common import authz
from services.common.frames import FramedProtocol
from services.common.tls import CertError, MeshTls, identity_of
from workers.generate_stream import GenerateStreams

log = logging.getLogger(__name__)

MUX_METHOD = "/kvmesh.worker.Worker/GenerateMux"
HANDSHAKE_TIMEOUT_S = 10.0
# what a closing connection may take to send its last replies before it is dropped
FLUSH_TIMEOUT_S = 5.0


class _Ended(Exception):
    """The connection's last status was sent (see :meth:`_PlaneContext.abort`)."""


class _PlaneContext:
    """What :meth:`GenerateStreams.handle` uses of a gRPC servicer context, on a
    connection."""

    def __init__(self, proto: FramedProtocol) -> None:
        self._proto = proto

    async def write(self, message: worker_pb2.GenerateReplies) -> None:
        self._proto.write(message.SerializeToString())
        await self._proto.drain()

    def write_nowait(self, message: worker_pb2.GenerateReplies) -> bool:
        """Sends ``message`` now and True unless the connection is closing or under
        back-pressure (then False, nothing sent: ``await write``)."""
        proto = self._proto
        if proto.closing or proto.write_paused:
            return False
        proto.write(message.SerializeToString())
        return True

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        send_status(self._proto, code, details)
        raise _Ended(details)


def send_status(proto: FramedProtocol, code: grpc.StatusCode, details: str) -> None:
    """The connection's last message: ``code`` and ``details`` on ``call_id`` 0; then
    it closes (dropped after FLUSH_TIMEOUT_S if the caller does not read)."""
    with contextlib.suppress(ConnectionError):
        proto.write(worker_pb2.GenerateReplies(replies=[worker_pb2.GenerateReply(
            call_id=0, end=worker_pb2.CallStatus(code=code.value[0],
                                                 details=details[:1000]))])
                    .SerializeToString())
    proto.close(FLUSH_TIMEOUT_S)


async def _frames(proto: FramedProtocol) -> AsyncIterator[worker_pb2.GenerateFrames]:
    """The caller's messages until its end of messages (DecodeError: not a frame)."""
    while (data := await proto.read()) is not None:
        yield worker_pb2.GenerateFrames.FromString(data)


class RequestPlane:
    """The worker's TCP request plane (see the module docstring)."""

    def __init__(self, streams: GenerateStreams, host: str, port: int, public_host: str,
                 tls: MeshTls | None = None,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
        self._streams = streams
        self._host, self._port, self._public = host, port, public_host
        self._tls = tls
        self._handshake_s = handshake_timeout_s
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._protos: set[FramedProtocol] = set()
        self._refused: set[tuple[str, str]] = set()
        self.address = ""

    async def start(self) -> str:
        loop = asyncio.get_running_loop()
        ctx = self._tls.ssl_context(server=True) if self._tls is not None else None
        self._server = await loop.create_server(
            lambda: FramedProtocol(expect_preamble=True, on_connect=self._accept),
            self._host, self._port, ssl=ctx)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"{self._public}:{port}"
        log.info("request plane on %s (%s)", self.address,
                 "mTLS" if ctx is not None else "insecure")
        return self.address

    def _accept(self, proto: FramedProtocol) -> None:
        """A new connection (TLS: its handshake done): refused at once when its caller
        may not call, else served."""
        refusal = self._authorize(proto)
        if refusal is not None:
            proto.stop_reading()
            send_status(proto, *refusal)
            return
        task = asyncio.ensure_future(self._serve(proto))
        self._conns.add(task)
        self._protos.add(proto)

        def done(t: asyncio.Task[None]) -> None:
            self._conns.discard(t)
            self._protos.discard(proto)
        task.add_done_callback(done)

    async def _serve(self, proto: FramedProtocol) -> None:
        try:
            async with asyncio.timeout(self._handshake_s):
                await proto.ready
        except (TimeoutError, ConnectionError) as exc:
            log.debug("request plane: a connection failed its handshake: %r", exc)
            proto.abort()
            return
        try:
            await self._streams.handle(_frames(proto), _PlaneContext(proto))
        except _Ended:
            return
        except DecodeError as exc:
            send_status(proto, grpc.StatusCode.INVALID_ARGUMENT,
                        f"a request-plane message is not a GenerateFrames: {exc}")
            return
        except ConnectionError as exc:
            log.debug("request plane: a connection broke: %r", exc)
            proto.abort()
            return
        except asyncio.CancelledError:  # close(): the replies handle flushed still go out
            proto.close(FLUSH_TIMEOUT_S)
            raise
        except Exception:  # noqa: BLE001 - one connection's fault; the worker goes on
            log.exception("request plane: serving a connection failed")
        proto.close(FLUSH_TIMEOUT_S)

    def _authorize(self, proto: FramedProtocol) -> tuple[grpc.StatusCode, str] | None:
        """None, or the status refusing the connection's caller (mTLS only)."""
        if self._tls is None:
            return None
        assert proto.transport is not None
        obj = proto.transport.get_extra_info("ssl_object")
        identity = None
        der = obj.getpeercert(binary_form=True) if obj is not None else None
        if der:
            with contextlib.suppress(CertError):
                identity = identity_of(ssl.DER_cert_to_PEM_cert(der).encode())
        refusal = authz.decide(MUX_METHOD, identity)
        if refusal is not None:
            key = (identity.role if identity is not None else "", refusal[0].name)
            if key not in self._refused:
                self._refused.add(key)
                log.warning("request plane refused a caller: %s: %s", refusal[0].name,
                            refusal[1])
        return refusal

    def abort_connections(self) -> None:
        """Drops every open connection at once, as the process's death would: nothing more
        is sent on them (their callers see the connection lost); their calls end as
        when their stream ends."""
        for proto in list(self._protos):
            proto.abort()

    async def close(self) -> None:
        """Stops listening and ends the open connections: their calls end as when their
        stream ends, their last replies are sent (within FLUSH_TIMEOUT_S, then they are
        dropped). Idempotent."""
        if self._server is not None:
            self._server.close()
        protos = list(self._protos)
        conns = list(self._conns)
        for task in conns:
            task.cancel()
        await asyncio.gather(*conns, return_exceptions=True)
        if protos:
            await asyncio.wait([p.lost for p in protos], timeout=FLUSH_TIMEOUT_S)
        for proto in protos:
            proto.abort()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
