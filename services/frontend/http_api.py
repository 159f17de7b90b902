"""The OpenAI-compatible HTTP API (FastAPI): models, completions, chat, SSE, health.

Contract:

- ``GET /health``: 200 with the number of live workers when at least one model is served,
  503 otherwise.
- ``GET /v1/models``: the models live workers serve (OpenAI list format).
- ``POST /tokenize`` and ``POST /detokenize``: vLLM's, see :mod:`.tokenize_api`.
- ``POST /v1/completions`` and ``POST /v1/chat/completions``: OpenAI request and response
  shapes, ``stream: true`` as server-sent events ending with ``data: [DONE]``,
  ``stream_options.include_usage`` honoured, ``usage.prompt_tokens_details.cached_tokens``
  always reported. ``n`` > 1 and batches of prompts fan out (:mod:`.fanout`: choices
  interleaved in streams, each with its index and finish, one usage); log-probabilities
  and echo are shaped as vLLM's server shapes them (:mod:`.shapes`). Chat ``tools``:
  the model's tool calls are parsed with vLLM's hermes parser, whole and streamed
  (``tool_calls`` deltas), see :mod:`.tools`, :mod:`.tool_chat` and :mod:`.shapes`.
  A plain completion (not streamed, one choice, the common sampling fields, no span to
  record) takes the express path (:mod:`.express`): the same answer, routing, worker
  calls and metrics in a fraction of the general path's Python steps.
- ``POST /v1/responses``: OpenAI's Responses API, run by the chat path (tools, structured
  outputs and tenants included), and ``GET`` / ``DELETE /v1/responses/{id}`` over the
  per-tenant ``responses_store`` (None: nothing stored), see :mod:`.responses_api`.
- Every error is ``{"error": {message, type, param, code}}`` with a 4xx for client mistakes
  (malformed JSON, wrong types, unknown model, context overflow) and 5xx for upstream
  failures. An admission rejection is 503 ``overloaded_error`` (``code`` = the reason)
  with a ``Retry-After`` header (whole seconds, rounded up). An error after streaming
  began is sent as a final ``data: {"error": ...}`` event followed by ``data: [DONE]``
  (as vLLM), an unexpected exception as such an event of type ``internal_error`` (never
  a silently truncated stream). A client that disconnects cancels the request on the
  workers, streamed or not: a non-streamed request (and a stream before its first chunk)
  races the ASGI ``http.disconnect``, and on it the request's chunks are closed (every
  choice's worker calls aborted, its router entry released).
- **API keys** (:mod:`.auth`): with keys configured, ``/v1/*`` (and ``/metrics`` when
  ``metrics_auth``) need ``Authorization: Bearer <key>``, checked before the body is
  read; a missing or unknown key is 401 ``{"error": {message, "type":
  "invalid_request_error", "param": null, "code": "invalid_api_key"}}`` with
  ``WWW-Authenticate: Bearer``. ``/health`` is always open. The key's tenant's cache
  salt goes with the request (:meth:`Pipeline.run`). No keys: everything is open.
- Limits (:class:`HttpLimits`): a body over ``max_body_bytes`` is refused with 413 as
  soon as that is known (a larger ``Content-Length`` is refused before reading; a
  chunked body once the limit is passed), and a body not received within
  ``body_timeout_s`` is answered 408 (a ``Content-Length`` larger than what arrives no
  longer waits forever).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from services.frontend import fanout, json_codec, tool_chat
from services.frontend.auth import ApiKeys, Tenant, Unauthorized
from services.frontend.direct_posts import DISCONNECT_WATCH, DisconnectWatch
from services.frontend.express import Express, Handover
from services.frontend.fanout import FanJob, Tally
from services.frontend.jobs import Chunk
from services.frontend.json_checks import check_json
from services.frontend.json_codec import JsonAnswer
from services.frontend.models import Tokenizer
from services.frontend.openai_schema import (
    ApiError,
    ParsedRequest,
    error_body,
    parse_chat,
    parse_completion,
    with_tenant,
)
from services.frontend.pipeline import Pipeline
from services.frontend.responses_api import add_routes as add_responses_routes
from services.frontend.responses_store import ResponseStore
from services.frontend.shapes import Shapes
from services.frontend.tokenize_api import add_routes as add_tokenize_routes

log = logging.getLogger(__name__)


def _error_response(err: ApiError) -> JSONResponse:
    headers = ({"Retry-After": str(max(math.ceil(err.retry_after_s), 1))}
               if err.retry_after_s is not None else {})
    if err.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(error_body(err), status_code=err.status, headers=headers)


def authenticate(keys: ApiKeys, header: str | None) -> Tenant:
    """The tenant of an ``Authorization`` header; ApiError 401 ``invalid_api_key``."""
    try:
        return keys.check(header)
    except Unauthorized as exc:
        raise ApiError(401, str(exc), code="invalid_api_key") from None


def _accepts(keys: ApiKeys, header: str | None) -> bool:
    try:
        keys.check(header)
    except Unauthorized:
        return False
    return True


def _sse(obj: dict[str, Any] | str) -> bytes:
    data = obj.encode() if isinstance(obj, str) else json_codec.encode(obj)
    return b"data: " + data + b"\n\n"


async def _chunk_objects(shapes: Shapes, fan: FanJob,
                         chunks: AsyncIterator[tuple[int, Chunk]]) -> AsyncIterator[
                             dict[str, Any]]:
    """A stream's payloads: the role deltas (chat), each choice object's chunk, the usage
    chunk (``include_usage``; with ``continuous_usage_stats`` every chunk also carries its
    choice's usage so far, as vLLM's); a failure part-way ends it with ``{"error": ...}``."""
    tally = Tally(fan)
    continuous = fan.req.continuous_usage
    try:
        if shapes.chat:
            for i, role in enumerate(shapes.role_chunks()):
                yield {**role, "usage": tally.running(i)} if continuous else role
        async for index, chunk in chunks:
            tally.see(index, chunk)
            choice = shapes.add(index, chunk)
            if choice is not None:
                obj = shapes.chunk_object(choice)
                yield {**obj, "usage": tally.running(index)} if continuous else obj
        if fan.req.include_usage:
            yield shapes.usage_chunk(tally.usage())
    except ApiError as err:
        yield error_body(err)
    except Exception as exc:  # never a silently truncated stream
        log.exception("request %s: the stream failed", fan.request_id)
        yield error_body(ApiError(500, f"internal error: {exc}", type="internal_error"))
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


async def _sse_stream(objects: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """The objects as server-sent events; after an error event the stream ends with
    ``[DONE]``, as vLLM's does."""
    try:
        async for obj in objects:
            yield _sse(obj)
            if "error" in obj:
                break
        yield _sse("[DONE]")
    finally:
        await objects.aclose()  # type: ignore[attr-defined]


async def _hang_up_on_disconnect(request: Request, hang_up: Callable[[], None]) -> None:
    """Calls ``hang_up`` once the client has gone. The body is read by now, so the next
    ASGI message is ``http.disconnect``, which the server sends when the connection
    closes (Starlette's TestClient: only after the response). A ``receive`` that fails
    says nothing about the client: then this waits until cancelled."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - see the docstring
        log.debug("receive() failed while waiting for a disconnect", exc_info=True)
        await asyncio.Event().wait()
    hang_up()


async def _unless_disconnected(request: Request,
                               work: Coroutine[Any, Any, Response]) -> Response:
    """``work``'s response, ``work`` being awaited in the handler's own task; when the
    client disconnects first, that task is cancelled, so ``work`` is cancelled (which
    closes the request's chunks: its choices' worker calls are aborted and their router
    entries released) and a 499 nobody reads is answered. A cancel from anywhere else
    (the server's) still propagates. The frontend's server says when the client is gone
    (:class:`~.direct_posts.DisconnectWatch`); under another server a watcher task waits
    for ``http.disconnect``."""
    return await _unless_gone(request.scope.get("extensions", {}).get(DISCONNECT_WATCH),
                              request, work)


async def _unless_gone(watch: DisconnectWatch | None, request: Request | None,
                       work: Coroutine[Any, Any, Response]) -> Response:
    """:func:`_unless_disconnected` with the request's watch (None: ``request``'s
    ``http.disconnect`` is watched)."""
    me = asyncio.current_task()
    assert me is not None
    gone = False

    def hang_up() -> None:
        nonlocal gone
        gone = True
        me.cancel()

    watcher: asyncio.Future[None] | None = None
    if watch is None:
        assert request is not None
        watcher = asyncio.ensure_future(_hang_up_on_disconnect(request, hang_up))
    elif watch.gone:  # gone before any work started: none starts
        work.close()
        return Response(status_code=499)
    else:
        watch.callback = hang_up
    try:
        resp = await work
    except BaseException:  # the cancel, or what work made of it: nobody reads it
        if gone and me.uncancel() == 0:  # our own cancel, and no other one
            return Response(status_code=499)
        raise
    finally:
        if watcher is not None:
            watcher.cancel()
        elif watch is not None:
            watch.callback = None
    if gone:  # work answered despite the cancel: the answer stands, nobody reads it
        me.uncancel()
    return resp


@dataclass(frozen=True)
class HttpLimits:
    """Per-request limits of the HTTP API; see the module docstring."""

    max_body_bytes: int = 4 << 20
    body_timeout_s: float = 30.0


def _too_large(limits: HttpLimits) -> ApiError:
    return ApiError(413, f"request body exceeds {limits.max_body_bytes} bytes",
                    code="request_too_large")


def _declared_length(request: Request) -> str | None:
    for name, value in request.scope["headers"]:
        if name == b"content-length":
            return value.decode("latin-1")
    return None


async def _read_body(request: Request, limits: HttpLimits) -> bytes:
    """The request's body, read from ASGI ``receive`` as Starlette's ``stream()`` reads it
    (an ``http.disconnect`` first raises ClientDisconnect), under the limits."""
    declared = _declared_length(request)
    if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise _too_large(limits)
    receive = request.receive
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    if message["type"] == "http.disconnect":
                        raise ClientDisconnect()
                    continue  # as Starlette: other messages carry no body
                part = message.get("body", b"")
                size += len(part)
                if size > limits.max_body_bytes:
                    raise _too_large(limits)
                parts.append(part)
                if not message.get("more_body", False):
                    break
    except TimeoutError:
        raise _late_body(limits) from None
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _late_body(limits: HttpLimits) -> ApiError:
    return ApiError(408, f"request body not received within {limits.body_timeout_s} s",
                    code="request_timeout")


async def _json_body(request: Request, limits: HttpLimits) -> Any:
    return _decode_json(await _read_body(request, limits))


def _decode_json(raw: bytes) -> Any:
    """The body's JSON value (ApiError 400 naming the problem)."""
    try:
        body = json_codec.decode(raw)
    except RecursionError:
        raise ApiError(400, "Invalid JSON body: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, over-long integers
        raise ApiError(400, f"Invalid JSON body: {exc}") from None
    check_json(body, raw)
    return body


async def _answered(path: str, work: Callable[[], Awaitable[Response]]) -> Response:
    """``work()``'s response, as the FastAPI stack would answer a failure of it: an
    ApiError its error response, any other exception a logged 500 ``internal_error``."""
    try:
        return await work()
    except ApiError as err:
        return _error_response(err)
    except Exception as exc:
        log.exception("%s failed", path)
        return _error_response(ApiError(500, f"internal error: {exc}", type="internal_error"))


class DirectRoute:
    """A completion route as the frontend's HTTP protocol serves it itself
    (:class:`~.direct_posts.DirectPost`), answering exactly as its ASGI handler does: the
    API key checked at the end of the headers (401), the body under ``limits`` (413,
    408), decoded and checked as :func:`_json_body` does (400), then ``run(body,
    tenant)``'s response, its work cancelled when the client goes (a 499 nobody reads);
    an ApiError is its error response, any other exception a logged 500
    ``internal_error``."""

    __slots__ = ("max_body_bytes", "body_timeout_s", "_limits", "_tenant", "_run", "_path")

    def __init__(self, path: str, limits: HttpLimits, tenant: Callable[[str | None], Tenant],
                 run: Callable[[Any, Tenant], Coroutine[Any, Any, Response]]) -> None:
        self.max_body_bytes, self.body_timeout_s = limits.max_body_bytes, limits.body_timeout_s
        self._limits, self._tenant, self._run, self._path = limits, tenant, run, path

    def admit(self, headers: list[tuple[bytes, bytes]]) -> tuple[Any, Response | None]:
        header = None
        for name, value in headers:
            if name == b"authorization":
                header = value.decode("latin-1")
                break
        try:
            return self._tenant(header), None
        except ApiError as err:
            return None, _error_response(err)

    def answer(self, admitted: Any, body: bytes, watch: DisconnectWatch
               ) -> Coroutine[Any, Any, Response]:
        # _answered awaits the request's own coroutine: no layer of this method's
        return _answered(self._path, lambda: _unless_gone(
            watch, None, self._run(_decode_json(body), admitted)))

    def refusal(self, status: int) -> Response:
        return _error_response(_too_large(self._limits) if status == 413
                               else _late_body(self._limits))


class DirectPostsApp(FastAPI):
    """FastAPI, but a ``POST`` to a path of ``direct_posts`` calls its handler straight
    from the ASGI entry: no middleware stack, routing or dependency solving (~35 µs of
    Python per request). The answers are the stack's: an ApiError is its error response,
    any other exception a logged 500 ``internal_error``. ``direct_routes``: the same
    routes for the frontend's HTTP protocol to serve without ASGI
    (:func:`~.http_server.http_config`'s ``direct``), by raw path."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.direct_posts: dict[str, Callable[[Request], Coroutine[Any, Any, Response]]] = {}
        self.direct_routes: dict[bytes, DirectRoute] = {}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        handler = (self.direct_posts.get(scope["path"])
                   if scope["type"] == "http" and scope["method"] == "POST" else None)
        if handler is None:
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self
        response = await _answered(scope["path"], lambda: handler(Request(scope, receive, send)))
        await response(scope, receive, send)


def create_app(pipeline: Pipeline, limits: HttpLimits | None = None,
               keys: ApiKeys | None = None, metrics_auth: bool = False,
               metrics_keys: ApiKeys | None = None,
               responses_store: ResponseStore | None = None,
               express: bool = True) -> DirectPostsApp:
    """The FastAPI application serving ``pipeline`` under ``limits`` (defaults if None),
    behind ``keys`` (None or none configured: open; ``metrics_auth``: ``/metrics`` too,
    where ``metrics_keys`` are accepted as well: keys that read metrics and nothing else,
    e.g. a planner's, so a scraper needs no user's key), storing Responses API objects in
    ``responses_store`` (None: ``store: true`` is a 400); ``express``: plain completions
    take :mod:`.express`'s path (False: every request the general path)."""
    lim = limits or HttpLimits()
    auth = keys or ApiKeys(())
    scrapers = metrics_keys or ApiKeys(())

    def tenant_of(header: str | None) -> Tenant:
        try:
            return authenticate(auth, header)
        except ApiError:
            pipeline.metrics.auth_failures.labels("http").inc()
            raise

    def tenant(request: Request) -> Tenant:
        return tenant_of(request.headers.get("authorization"))
    app = DirectPostsApp(title="kvmesh", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, err: ApiError) -> JSONResponse:
        return _error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error_response(ApiError(exc.status_code, str(exc.detail),
                                        type="invalid_request_error"))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        return _error_response(ApiError(500, f"internal error: {exc}", type="internal_error"))

    @app.get("/health")
    async def health() -> JSONResponse:
        models = pipeline.catalog.all()
        workers = sum(m.num_workers for m in models)
        body = {"status": "healthy" if models else "no workers", "workers": workers,
                "models": [m.name for m in models]}
        return JSONResponse(body, status_code=200 if models else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        header = request.headers.get("authorization")
        if metrics_auth and not (scrapers.enabled and _accepts(scrapers, header)):
            tenant(request)
        return Response(pipeline.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        tenant(request)
        return {"object": "list", "data": [
            {"id": m.name, "object": "model", "created": m.created, "owned_by": "kvmesh",
             "max_model_len": m.max_model_len, "root": m.model_path}
            for m in pipeline.catalog.all()
        ]}

    async def _objects(req: ParsedRequest, who: Tenant) -> dict[str, Any] | AsyncIterator[
            dict[str, Any]]:
        """Runs ``req``: the response dict, or (``stream``) the iterator of chunk dicts
        (see :func:`_chunk_objects`); an error before the first chunk is raised."""
        fan, chunks = await fanout.run(pipeline, with_tenant(req, who.cache_salt))
        return await _consume(fan, chunks)

    async def _consume(fan: FanJob, chunks: AsyncIterator[tuple[int, Chunk]]
                       ) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
        """:func:`_objects` of the request's chunks."""
        req = fan.req
        try:
            shapes = Shapes(fan, await _speller(fan))
        except BaseException:
            await chunks.aclose()  # type: ignore[attr-defined]
            raise
        if req.stream:
            # Pull the first chunk before answering so early errors get a real status code.
            try:
                first = await chunks.__anext__()
            except StopAsyncIteration:
                # The pipeline always ends with a finishing chunk or an ApiError; a stream
                # with neither is an upstream fault, never an empty 200.
                raise ApiError(502, "the worker stream ended before its first chunk",
                               type="upstream_error") from None
            except ApiError as err:
                await chunks.aclose()  # type: ignore[attr-defined]
                raise tool_chat.explain(fan.req, err) from None
            except BaseException:
                await chunks.aclose()  # type: ignore[attr-defined]
                raise

            async def replay() -> AsyncIterator[tuple[int, Chunk]]:
                try:
                    yield first
                    async for c in chunks:
                        yield c
                finally:
                    await chunks.aclose()  # type: ignore[attr-defined]

            return _chunk_objects(shapes, fan, replay())
        tally = Tally(fan)
        lone = len(fan.choices) == 1  # its finishing chunk is its last
        try:
            async for index, chunk in chunks:
                tally.see(index, chunk)
                shapes.add(index, chunk)
                if lone and tally.done:
                    break
        except ApiError as err:
            raise tool_chat.explain(fan.req, err) from None
        finally:
            if lone and tally.done:  # the answer goes out before the request's teardown
                pipeline.close_later(chunks)
            else:
                await chunks.aclose()  # type: ignore[attr-defined]
        if not tally.done:  # see the streaming case: never a 200 without a finish
            raise ApiError(502, "the worker stream ended without finishing",
                           type="upstream_error")
        return shapes.full(tally.usage())

    async def _serve(req: ParsedRequest, who: Tenant) -> Response:
        result = await _objects(req, who)
        if isinstance(result, dict):
            return JsonAnswer(result)
        return StreamingResponse(_sse_stream(result), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _speller(fan: FanJob) -> Tokenizer | None:
        """The model's tokenizer when the shapes need it (log-probabilities, echo, tools)."""
        if fan.req.sampling.logprobs is None and not fan.req.echo and fan.req.tools is None:
            return None
        return await asyncio.to_thread(pipeline.catalog.tokenizer, fan.prompts[0].model)

    # (a stand-in of the pipeline, e.g. a test's, has no express path)
    fast = Express(pipeline) if express and isinstance(pipeline, Pipeline) else None

    async def run_completion(body: Any, who: Tenant) -> Response:
        """A completion body: the express path's answer when it serves the body, else
        the general path's (see :mod:`.express`)."""
        plain = fast.accept(body) if fast is not None else None
        if plain is not None:
            assert fast is not None
            out = await fast.run(plain, who.cache_salt)
            if isinstance(out, Handover):  # handed over: the general path's consumer
                answer = await _consume(out.fan, out.chunks)
                assert isinstance(answer, dict)  # (a plain request is not streamed)
                return JsonAnswer(answer)
            if out is not None:
                return JsonAnswer(out)
        return await _serve(parse_completion(body), who)

    def run_chat_body(body: Any, who: Tenant) -> Coroutine[Any, Any, Response]:
        return _serve(parse_chat(body, pipeline.image_limits), who)

    async def completions(request: Request) -> Response:
        who = tenant(request)
        return await _unless_disconnected(request,
                                          run_completion(await _json_body(request, lim), who))

    async def chat(request: Request) -> Response:
        who = tenant(request)
        return await _unless_disconnected(request,
                                          run_chat_body(await _json_body(request, lim), who))

    # registered as routes (other methods: 405, listed in the app's routes), served ahead
    # of the FastAPI stack by DirectPostsApp, and by the frontend's protocol itself
    app.post("/v1/completions")(completions)
    app.post("/v1/chat/completions")(chat)
    app.direct_posts.update({"/v1/completions": completions, "/v1/chat/completions": chat})
    for path, run in (("/v1/completions", run_completion),
                      ("/v1/chat/completions", run_chat_body)):
        app.direct_routes[path.encode()] = DirectRoute(path, lim, tenant_of, run)

    async def run_chat(body: dict[str, Any], request: Request) -> dict[str, Any] | (
            AsyncIterator[dict[str, Any]]):
        """A chat body run as ``POST /v1/chat/completions`` runs it (for /v1/responses)."""
        return await _objects(parse_chat(body, pipeline.image_limits), tenant(request))

    add_tokenize_routes(app, pipeline.catalog, tenant, lambda r: _json_body(r, lim))
    add_responses_routes(app, run_chat, tenant, lambda r: _json_body(r, lim),
                         responses_store)
    app.state.started = time.time()
    return app
