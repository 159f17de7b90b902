"""A response-streaming call's generators, closed in the call's own task.

grpc.aio iterates an async-generator handler and does not close it: a call cancelled
while the handler is suspended at ``yield`` (grpc writing that message: a client gone
mid-stream) leaves each generator of the interceptor chain to the event loop's asyncgen
finalizer, which closes it later in a new task, that is in another ``contextvars``
Context. OpenTelemetry's server stream wrapper then fails to reset the context it
attached ("Failed to detach context", logged with a traceback), and the servicer's own
cleanup runs outside the call, in no particular order.

Contract:

- :func:`writing` turns the outermost response-streaming behavior (an async-generator
  function; the request a message or an iterator) into a coroutine handler that writes
  each message with ``context.write`` and, however the call ends (finished, aborted,
  failed, cancelled), closes every generator the call registered, innermost first, in
  the call's task, then returns or re-raises. A generator whose cleanup raises is
  logged with its traceback; one whose cleanup is cancelled (a second cancel of the
  task) is cut short there. Either way the others are still closed, then the cancel is
  re-raised.
- A batch that fails in grpc core (``execute_batch`` failed: the call is over, the
  client gone, or a message broke a limit and grpc sent the client that status) while
  the handler runs (our write, a handler's own ``context.write``, an abort's status)
  ends the call as a cancel. grpc itself would log it as an error with a traceback, or
  not at all, depending on whether it saw the call's end first. Where grpc will still
  cancel the call's task (its status not sent, no cancel delivered yet) it is logged as
  one warning and the handler waits for that cancel (it comes well under a millisecond
  after the failure here; after :data:`CANCEL_WAIT_S` without it, another warning), so
  that it cannot cut short the cleanup of generators still suspended (those that saw
  the error have run their cleanup already); else (an abort that found the client
  gone) it is logged at debug level only. A batch that grpc could not even start (a
  bug: a usage error) is not this case and propagates unchanged. Checked against
  grpcio 1.85.
- :func:`opened` registers what a layer got from calling its inner behavior (an async
  generator; anything else is returned unchanged and not registered) with the call in
  progress: every layer that calls an inner behavior calls it (outside :func:`writing`,
  e.g. a server without :class:`services.common.server.TracingInterceptor`, it does
  nothing). :class:`Registering` does so for a layer whose code is not ours.
"""

from __future__ import annotations

import asyncio
import logging
from contextvars import ContextVar
from typing import Any

# grpc.aio raises it for a failed batch; it does not export it (grpcio 1.85)
from grpc._cython.cygrpc import ExecuteBatchError

log = logging.getLogger(__name__)

# The call in progress's generators, outermost first (None: no writing() call here)
_OPENED: ContextVar[list[Any] | None] = ContextVar("kvmesh_opened_streams", default=None)

# How long a call whose write failed waits for grpc's cancel before it ends anyway
CANCEL_WAIT_S = 5.0

# How ExecuteBatchError's text starts when core failed the batch (the call is over), as
# opposed to "Failed grpc_call_start_batch: ..." (the batch was refused at its start)
_BATCH_FAILED = 'Failed "execute_batch"'


def opened(result: Any) -> Any:
    """``result`` (what an inner behavior returned), registered with the call in
    progress when it is an async generator."""
    streams = _OPENED.get()
    if streams is not None and hasattr(result, "aclose"):
        streams.append(result)
    return result


class Registering:
    """``behavior`` whose result :func:`opened` registers, for a wrapper that calls it
    and iterates the result itself (OpenTelemetry's). A plain callable: where no wrapper
    took it, :func:`unwrapped` gives the behavior back."""

    __slots__ = ("behavior",)

    def __init__(self, behavior: Any) -> None:
        self.behavior = behavior

    def __call__(self, request: Any, context: Any) -> Any:
        return opened(self.behavior(request, context))


def unwrapped(behavior: Any) -> Any:
    """``behavior`` without a :class:`Registering` around it."""
    return behavior.behavior if isinstance(behavior, Registering) else behavior


def writing(behavior: Any, method: str) -> Any:
    """The coroutine handler described in the module docstring (``method``: for the log)."""
    async def write_all(request: Any, context: Any) -> None:
        streams: list[Any] = []
        token = _OPENED.set(streams)
        try:
            try:
                async for message in opened(behavior(request, context)):
                    await context.write(message)
            except ExecuteBatchError as exc:
                if not str(exc).startswith(_BATCH_FAILED):
                    raise
                task = asyncio.current_task()
                if context.done() or (task is not None and task.cancelling()):
                    # no cancel is coming: the status was sent (an abort that found the
                    # client gone) or grpc's cancel came already (and was swallowed)
                    log.debug("%s: a batch failed after the call's end", method)
                    raise asyncio.CancelledError from exc
                log.warning("%s: writing a response failed in grpc (the client went away, "
                            "or the message broke a limit: the client got that status); "
                            "the call ends", method)
                await _until_cancelled(method)
        finally:
            try:
                await _close(streams, method)
            finally:
                _OPENED.reset(token)
    return write_all


async def _until_cancelled(method: str) -> None:
    """Returns only by raising CancelledError: grpc's, or its own after
    :data:`CANCEL_WAIT_S`."""
    try:
        await asyncio.wait_for(asyncio.get_running_loop().create_future(), CANCEL_WAIT_S)
    except TimeoutError:
        log.warning("%s: grpc did not cancel the call %.0f s after its failed write; it "
                    "ends as cancelled", method, CANCEL_WAIT_S)
    raise asyncio.CancelledError


async def _close(streams: list[Any], method: str) -> None:
    """Closes ``streams`` innermost first (see the module docstring)."""
    cancelled: asyncio.CancelledError | None = None
    for stream in reversed(streams):
        try:
            await stream.aclose()
        except asyncio.CancelledError as exc:
            cancelled = cancelled or exc
        except Exception:
            log.exception("%s: closing its response stream failed", method)
    if cancelled is not None:
        raise cancelled
