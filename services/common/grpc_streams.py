"""A server-streaming call's response generators, closed in the call's own task.

grpc.aio iterates an async-generator handler and does not close it: a call cancelled
while the handler is suspended at ``yield`` (grpc writing that message: a client gone
mid-stream) leaves each generator of the interceptor chain to the event loop's asyncgen
finalizer, which closes it later in a new task, that is in another ``contextvars``
Context. OpenTelemetry's server stream wrapper then fails to reset the context it
attached ("Failed to detach context", logged with a traceback), and the servicer's own
cleanup runs outside the call, in no particular order.

Contract:

- :func:`writing` turns the outermost response-streaming behavior (an async-generator
  function) into a coroutine handler that writes each message with ``context.write``
  and, however the call ends (finished, aborted, cancelled), closes every generator the
  call registered, innermost first, in the call's task, then returns or re-raises. A
  generator whose cleanup raises is logged with its traceback and the others are still
  closed. A write that fails in grpc (the call is over: the client went away, or the
  message broke a limit and grpc sent the client that status) is logged as a warning
  and ends the call as a cancel: grpc would log it as an error with a traceback, or not
  at all, depending on which of the write's failure and the client's close it sees
  first.
- :func:`opened` registers what a layer got from calling its inner behavior (an async
  generator, or anything else, returned unchanged and not registered) with the call in
  progress: every layer that calls an inner behavior calls it (outside :func:`writing`,
  e.g. a server without :class:`services.common.server.TracingInterceptor`, it does
  nothing). :func:`registering` does so for a layer whose code is not ours.
"""

from __future__ import annotations

import asyncio
import logging
from contextvars import ContextVar
from typing import Any

from grpc._cython.cygrpc import ExecuteBatchError

log = logging.getLogger(__name__)

# The call in progress's generators, outermost first (None: no writing() call here)
_OPENED: ContextVar[list[Any] | None] = ContextVar("kvmesh_opened_streams", default=None)


def opened(result: Any) -> Any:
    """``result`` (what an inner behavior returned), registered with the call in
    progress when it is an async generator."""
    streams = _OPENED.get()
    if streams is not None and hasattr(result, "aclose"):
        streams.append(result)
    return result


def registering(behavior: Any) -> Any:
    """``behavior`` whose result :func:`opened` registers: for a wrapper that calls it
    and iterates the result itself (OpenTelemetry's)."""
    def call(request: Any, context: Any) -> Any:
        return opened(behavior(request, context))
    return call


def writing(behavior: Any, method: str) -> Any:
    """The coroutine handler described in the module docstring (``method``: for the log)."""
    async def write_all(request: Any, context: Any) -> None:
        streams: list[Any] = []
        token = _OPENED.set(streams)
        try:
            responses = opened(behavior(request, context))
            async for message in responses:
                try:
                    await context.write(message)
                except ExecuteBatchError as exc:
                    log.warning("%s: writing a response failed in grpc (the client went "
                                "away, or the message broke a limit: the client got that "
                                "status); the call ends", method)
                    raise asyncio.CancelledError from exc
        finally:
            for stream in reversed(streams):
                try:
                    await stream.aclose()
                except Exception:
                    log.exception("%s: closing its response stream failed", method)
            _OPENED.reset(token)
    return write_all
