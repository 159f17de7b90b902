"""The floor of a Python frontend hop on this machine: the least Python that can stand
between an HTTP client and a worker's TCP request plane.

``python -m bench.mesh_profile.proxy_floor PORT WORKER_PLANE_ADDRESS [--tasks]`` (a
process of its own, on uvloop, as the frontend runs), or :func:`serve` in a running loop
(tests).

Contract:

- One asyncio protocol with httptools' parser (the frontend's): each request's JSON body
  (msgspec, the frontend's codec) gives ``model``, ``prompt`` (token ids), ``max_tokens``
  and ``temperature``; they go as one ``GenerateFrame`` to the one worker given, over one
  long-lived connection of :mod:`services.common.frames` (the frontend's carrier to a
  worker); when the call's end arrives the client gets a completion object (the
  responses' text, ``finish_reason`` "length" or "stop", ``usage``) with a
  ``Content-Length``, on its keep-alive connection. A body that is not that is a 400, a
  call the worker ends with a status a 502 naming it, and when the worker's connection
  is lost every call on it is a 502 at once (nothing waits forever); then the process
  exits (run as a process) or :func:`serve`'s server answers 502 from then on.
- The worker's replies are read by one reader task. With ``--tasks`` (``tasks=True``)
  each request is also served by a task of its own, as the frontend serves one: started
  when its body is in, woken by the reader when its call ends (two event-loop hops more
  per request); without, the parser's callback sends the frame and the reader's writes
  the answer.
- No routing, no checks of the OpenAI surface, no metrics, tracing, disconnect handling
  or migration: what kvmesh's frontend does on top of this is its own cost. A measuring
  stick (:mod:`bench.frontend_vs_dynamo.added`), not a server. Loopback only.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any, Protocol

import httptools
import msgspec

from protos import common_pb2, worker_pb2
from services.common.frames import PREAMBLE, FramedProtocol

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode
_REASONS = {200: b"OK", 400: b"Bad Request", 502: b"Bad Gateway"}


class _Plane:
    """One connection to the worker's request plane; calls by number."""

    def __init__(self) -> None:
        self.proto: FramedProtocol | None = None
        self.gone: str | None = None  # why the connection is gone
        self.calls: dict[int, tuple[_Answer, list[str], list[worker_pb2.GenerateResponse]]] = {}
        self.next = 0
        self.reader: asyncio.Task[None] | None = None

    async def connect(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        _, proto = await asyncio.get_running_loop().create_connection(
            FramedProtocol, host, int(port))
        proto.write_raw(PREAMBLE)
        self.proto = proto
        self.reader = asyncio.ensure_future(self._read(proto))

    def call(self, http: _Answer, body: Any) -> None:
        """Sends ``body``'s request (a 400 to ``http`` when it is not one)."""
        try:
            req = worker_pb2.GenerateRequest(
                request_id=f"floor-{self.next + 1}", token_ids=body["prompt"],
                model=body["model"], sampling=common_pb2.SamplingParams(
                    max_tokens=body["max_tokens"], temperature=body.get("temperature", 1.0)))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            http.answer(400, {"error": f"not a floor request: {exc!r}"})
            return
        if self.gone is not None or self.proto is None:
            http.answer(502, {"error": f"the worker's connection is gone: {self.gone}"})
            return
        self.next += 1
        try:
            self.proto.write(worker_pb2.GenerateFrames(frames=[worker_pb2.GenerateFrame(
                call_id=self.next, request=req)]).SerializeToString())
        except ConnectionError as exc:  # lost, the reader not told yet
            http.answer(502, {"error": f"the worker's connection is gone: {exc}"})
            return
        self.calls[self.next] = (http, [], [])

    async def _read(self, proto: FramedProtocol) -> None:
        why = "the worker closed it"
        try:
            while (data := await proto.read()) is not None:
                for reply in worker_pb2.GenerateReplies.FromString(data).replies:
                    self._reply(reply)
        except Exception as exc:  # noqa: BLE001 - every open call is told, below
            why = f"{type(exc).__name__}: {exc}"
        self.gone = why
        calls, self.calls = self.calls, {}
        for http, _, _ in calls.values():
            http.answer(502, {"error": f"the worker's connection is gone: {why}"})

    def _reply(self, reply: worker_pb2.GenerateReply) -> None:
        got = self.calls.get(reply.call_id)
        if got is None:
            return
        http, texts, last = got
        if reply.HasField("response"):
            texts.append(reply.response.text)
            if reply.response.finish_reason:
                last.append(reply.response)
            return
        del self.calls[reply.call_id]
        if reply.end.code or not last:
            http.answer(502, {"error": f"the call ended with status {reply.end.code}: "
                                       f"{reply.end.details or 'no finishing response'}"})
            return
        usage = last[0].usage
        http.answer(200, {
            "id": f"cmpl-floor-{reply.call_id}", "object": "text_completion",
            "created": int(time.time()), "model": "floor",
            "choices": [{"index": 0, "text": "".join(texts), "logprobs": None,
                         "finish_reason": "length" if last[0].finish_reason
                         == common_pb2.FINISH_REASON_LENGTH else "stop"}],
            "usage": {"prompt_tokens": usage.prompt_tokens,
                      "completion_tokens": usage.completion_tokens,
                      "total_tokens": usage.prompt_tokens + usage.completion_tokens}})


class _Answer(Protocol):
    def answer(self, status: int, obj: Any) -> None: ...


class _Waiter:
    """A call's answer handed to the task that waits for it (``--tasks``)."""

    def __init__(self) -> None:
        self.done: asyncio.Future[tuple[int, Any]] = \
            asyncio.get_running_loop().create_future()

    def answer(self, status: int, obj: Any) -> None:
        if not self.done.done():
            self.done.set_result((status, obj))


class _Http(asyncio.Protocol):
    """One client connection: requests parsed as they come, answered in order of their
    calls' ends (the bench sends one at a time per connection)."""

    def __init__(self, plane: _Plane, tasks: bool = False) -> None:
        self.plane, self.tasks = plane, tasks
        self.parts: list[bytes] = []
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.answer(400, {"error": "not HTTP/1.1"})
            if self.transport is not None:
                self.transport.close()

    def on_body(self, body: bytes) -> None:
        self.parts.append(body)

    def on_message_complete(self) -> None:
        body, self.parts = b"".join(self.parts), []
        try:
            obj = _decode(body)
        except msgspec.DecodeError as exc:
            self.answer(400, {"error": f"not JSON: {exc}"})
            return
        if self.tasks:
            asyncio.get_running_loop().create_task(self._served(obj))
        else:
            self.plane.call(self, obj)

    async def _served(self, obj: Any) -> None:
        waiter = _Waiter()
        self.plane.call(waiter, obj)
        self.answer(*await waiter.done)

    def answer(self, status: int, obj: Any) -> None:
        if self.transport is None:
            return  # the client went
        data = _encode(obj)
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s"
                             % (status, _REASONS[status], len(data), data))


async def serve(port: int, plane_address: str, tasks: bool = False
                ) -> tuple[asyncio.Server, _Plane]:
    """Serves on 127.0.0.1:``port`` (0: any) in this loop; its server and plane."""
    plane = _Plane()
    await plane.connect(plane_address)
    server = await asyncio.get_running_loop().create_server(
        lambda: _Http(plane, tasks), "127.0.0.1", port)
    return server, plane


async def _main(port: int, plane_address: str, tasks: bool) -> None:
    server, plane = await serve(port, plane_address, tasks)
    assert plane.reader is not None
    async with server:
        await plane.reader  # the worker's connection lost: nothing left to measure
    raise SystemExit(f"proxy_floor: the worker's connection is gone: {plane.gone}")


def main() -> None:
    import uvloop

    uvloop.install()
    asyncio.run(_main(int(sys.argv[1]), sys.argv[2], "--tasks" in sys.argv[3:]))


if __name__ == "__main__":
    main()
