"""The frontend's request pipeline: tokenize → route → stream from the worker → release.

Shared by the HTTP (OpenAI) and gRPC APIs. Contract:

- ``prepare(req)`` resolves the model (ApiError 404 ``model_not_found`` when no worker
  serves it), tokenizes the prompt or renders the chat template, and enforces the context
  length (ApiError 400). It never contacts a worker.
- ``stream(job)`` asks the router for a worker, calls its ``Generate`` and yields
  :class:`Chunk` deltas; the last has ``finish_reason`` and ``usage``. Errors before the
  first chunk raise ApiError (404/503 from routing, 400 from the worker's validation, 502
  when the worker fails). A worker that dies mid-stream raises ApiError 502, never hangs.
  When the consumer stops early, the worker call is cancelled (which aborts the request on
  the worker). When the first token arrives the router is told ``PrefillDone``
  (fire-and-forget: the stream never waits for it, and its failures, e.g. an older
  router without the RPC, are ignored). The router is always told to release the
  request.
- Each request records a root span ``frontend.request`` with children ``frontend.tokenize``
  and the gRPC client spans of the router and worker calls (which carry the context on).
  When it finishes, the span gets ``kvmesh.predicted_cached_tokens`` (the router's
  prediction, see :func:`predicted_cached_tokens`) and ``kvmesh.actual_cached_tokens`` (the
  engine's ``cached_tokens``: P's prefix hits when disaggregated), and the metrics record
  both and their absolute error. Finished requests add their usage to the token counters;
  every chunk after the first that carries tokens records ITL samples (its gap / its
  tokens); a rejection counts ``outcome="rejected"`` and the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context

from protos import common_pb2, router_pb2, router_pb2_grpc, worker_pb2
from services.common.grpc_client import ChannelPool
from services.common.telemetry import tracer
from services.frontend.handoff import HandoffError, Request, run_plan
from services.frontend.metrics import FrontendMetrics
from services.frontend.models import ModelCatalog, ModelInfo
from services.frontend.openai_schema import ApiError, ParsedRequest, check_context

FINISH_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}


@dataclass
class Job:
    """A validated, tokenized request ready to route."""

    request_id: str
    req: ParsedRequest
    model: ModelInfo
    token_ids: list[int]
    created: int


@dataclass
class Chunk:
    """One delta of output."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    predicted_cached_tokens: int = 0


def predicted_cached_tokens(route: router_pb2.RouteResponse, default_block_size: int) -> int:
    """The router's predicted cached prompt tokens for the tokens the client's
    ``cached_tokens`` counts: P's overlap when disaggregated, else the worker's; in blocks
    of ``route.block_size`` (``default_block_size`` for a router that does not send it)."""
    bs = route.block_size or default_block_size
    blocks = (route.predicted_prefill_overlap_blocks if route.disaggregated
              else route.predicted_overlap_blocks)
    return blocks * bs


RETRY_AFTER_KEY = "retry-after"
REASON_KEY = "kvmesh-admission-reason"


def _trailer(exc: grpc.aio.AioRpcError, key: str) -> str | None:
    for k, v in exc.trailing_metadata() or ():
        if k == key:
            return v.decode() if isinstance(v, bytes) else str(v)
    return None


def rejection_error(exc: grpc.aio.AioRpcError) -> ApiError:
    """A router RESOURCE_EXHAUSTED (admission rejection) as an overloaded ApiError 503."""
    reason = _trailer(exc, REASON_KEY) or "overloaded"
    try:
        retry = float(_trailer(exc, RETRY_AFTER_KEY) or 1.0)
    except ValueError:
        retry = 1.0
    return ApiError(503, exc.details() or "the mesh is overloaded", type="overloaded_error",
                    code=reason, retry_after_s=max(retry, 0.0))


def _status_error(exc: grpc.aio.AioRpcError, what: str) -> ApiError:
    code = exc.code()
    detail = exc.details() or code.name
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ApiError(400, detail)
    if code == grpc.StatusCode.NOT_FOUND:
        return ApiError(404, detail, code="model_not_found", param="model")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return ApiError(503, f"{what} refused the request: {detail}",
                        type="service_unavailable", code="no_compatible_workers")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
        return ApiError(503, f"{what} unavailable: {detail}", type="service_unavailable")
    return ApiError(502, f"{what} failed: {detail}", type="upstream_error")


@contextlib.contextmanager
def _attached(ctx: Context | None) -> Iterator[None]:
    """Makes ``ctx`` current for a block that does not yield (None = leave as is)."""
    if ctx is None:
        yield
        return
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)


def sampling_proto(job: Job) -> common_pb2.SamplingParams:
    """The job's sampling parameters as protobuf."""
    s = job.req.sampling
    p = common_pb2.SamplingParams(max_tokens=s.max_tokens or 16, stop=list(s.stop),
                                  ignore_eos=s.ignore_eos)
    for name in ("temperature", "top_p", "top_k", "seed", "presence_penalty",
                 "frequency_penalty"):
        value = getattr(s, name)
        if value is not None:
            setattr(p, name, value)
    return p


class Pipeline:
    """Tokenize, route, stream; see the module docstring."""

    def __init__(self, catalog: ModelCatalog, router_address: Callable[[], str | None]) -> None:
        self._catalog = catalog
        self._router_address = router_address
        self._pool = ChannelPool()
        self._tracer = tracer("frontend")
        self.metrics = FrontendMetrics()
        self._background: set[asyncio.Future[None]] = set()

    def _prefill_done(self, router: router_pb2_grpc.RouterStub, request_id: str) -> None:
        """Tells the router the prefill is over, without waiting (see the module doc)."""

        async def call() -> None:
            with contextlib.suppress(Exception):
                await router.PrefillDone(router_pb2.PrefillDoneRequest(request_id=request_id),
                                         timeout=5)

        task = asyncio.ensure_future(call())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @property
    def catalog(self) -> ModelCatalog:
        return self._catalog

    async def prepare(self, req: ParsedRequest) -> Job:
        """Resolves the model, tokenizes and checks the context length."""
        info = self._catalog.get(req.model)
        if info is None:
            raise ApiError(404, f"The model '{req.model}' does not exist or has no live worker",
                           param="model", code="model_not_found")
        with self._tracer.start_as_current_span("frontend.tokenize") as span:
            tok = await asyncio.to_thread(self._catalog.tokenizer, info)
            if req.prompt_token_ids is not None:
                ids = list(req.prompt_token_ids)
            elif req.kind == "chat":
                ids = await asyncio.to_thread(tok.apply_chat, req.messages)
            else:
                ids = await asyncio.to_thread(tok.encode, req.prompt or "")
            span.set_attribute("kvmesh.prompt_tokens", len(ids))
        req = check_context(req, len(ids), info.max_model_len)
        rid = req.request_id or uuid.uuid4().hex
        return Job(rid, req, info, ids, int(time.time()))

    async def stream(self, job: Job, ctx: Context | None = None) -> AsyncIterator[Chunk]:
        """Routes and streams the job; see the module docstring. ``ctx`` is the trace
        context the router and worker calls are made in (default: the current one)."""
        router_addr = self._router_address()
        if not router_addr:
            raise ApiError(503, "no router is available", type="service_unavailable")
        router = router_pb2_grpc.RouterStub(self._pool.get(router_addr))
        try:
            with _attached(ctx):
                route = await router.Route(router_pb2.RouteRequest(
                    request_id=job.request_id, model=job.req.model, token_ids=job.token_ids,
                    max_tokens=sampling_proto(job).max_tokens,
                ), timeout=10)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                err = rejection_error(exc)
                self.metrics.observe_rejection(err.code or "")
                raise err from exc
            raise _status_error(exc, "router") from exc
        try:
            plan = Request(job.request_id, job.req.model, job.token_ids, sampling_proto(job))
            with _attached(ctx):
                responses = run_plan(self._pool, plan, route, self.metrics)
                first = asyncio.ensure_future(responses.__anext__())
            pending: asyncio.Future[worker_pb2.GenerateResponse] | None = first
            path = "disagg" if route.disaggregated else "agg"
            started, outcome = time.monotonic(), "error"
            first_token = True
            last_at = started
            try:
                finished = False
                while pending is not None:
                    try:
                        resp = await pending
                    except StopAsyncIteration:
                        break
                    chunk = Chunk(resp.text, list(resp.token_ids))
                    if resp.token_ids:
                        now = time.monotonic()
                        if first_token:
                            first_token = False
                            self.metrics.ttft.labels(path).observe(now - started)
                            with _attached(ctx):
                                self._prefill_done(router, job.request_id)
                        else:
                            self.metrics.observe_chunk_gap(now - last_at, len(resp.token_ids))
                        last_at = now
                    if resp.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                        finished = True
                        outcome = FINISH_NAMES.get(resp.finish_reason, "stop")
                        predicted = predicted_cached_tokens(route, job.model.block_size)
                        self.metrics.observe_cache_prediction(
                            path, route.overlap_source or "history", predicted,
                            resp.usage.cached_tokens)
                        chunk.predicted_cached_tokens = predicted
                        chunk.finish_reason = FINISH_NAMES.get(resp.finish_reason, "stop")
                        chunk.prompt_tokens = resp.usage.prompt_tokens
                        chunk.completion_tokens = resp.usage.completion_tokens
                        chunk.cached_tokens = resp.usage.cached_tokens
                        self.metrics.observe_usage(resp.usage.prompt_tokens,
                                                   resp.usage.completion_tokens)
                    yield chunk
                    with _attached(ctx):
                        pending = asyncio.ensure_future(responses.__anext__())
                if not finished:
                    raise ApiError(502, "worker ended the stream without finishing",
                                   type="upstream_error")
            except grpc.aio.AioRpcError as exc:
                raise _status_error(exc, "worker") from exc
            except HandoffError as exc:
                raise ApiError(502, str(exc), type="upstream_error") from exc
            finally:
                self.metrics.requests.labels(path, outcome).inc()
                if pending is not None and not pending.done():
                    pending.cancel()  # client went away mid-step: cancels the worker calls
                    with contextlib.suppress(BaseException):
                        await pending
                await responses.aclose()  # type: ignore[attr-defined]
        finally:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await router.Release(router_pb2.ReleaseRequest(request_id=job.request_id),
                                     timeout=5)

    async def run(self, req: ParsedRequest) -> tuple[Job, AsyncIterator[Chunk]]:
        """``prepare`` + ``stream`` under one ``frontend.request`` root span.

        The span ends when the returned iterator is exhausted or closed.
        """
        span = self._tracer.start_span("frontend.request", attributes={
            "kvmesh.model": req.model, "kvmesh.kind": req.kind, "kvmesh.stream": req.stream,
        })
        ctx = trace.set_span_in_context(span)
        try:
            with _attached(ctx):
                job = await self.prepare(req)
        except BaseException as exc:
            span.record_exception(exc)
            span.end()
            raise
        span.set_attribute("kvmesh.request_id", job.request_id)
        span.set_attribute("kvmesh.prompt_tokens", len(job.token_ids))

        async def traced() -> AsyncIterator[Chunk]:
            try:
                async for chunk in self.stream(job, ctx):
                    if chunk.finish_reason is not None:
                        span.set_attribute("kvmesh.cached_tokens", chunk.cached_tokens)
                        span.set_attribute("kvmesh.actual_cached_tokens", chunk.cached_tokens)
                        span.set_attribute("kvmesh.predicted_cached_tokens",
                                           chunk.predicted_cached_tokens)
                        span.set_attribute("kvmesh.completion_tokens", chunk.completion_tokens)
                        span.set_attribute("kvmesh.finish_reason", chunk.finish_reason)
                    yield chunk
            except BaseException as exc:
                span.record_exception(exc)
                raise
            finally:
                span.end()

        return job, traced()

    async def close(self) -> None:
        """Closes the gRPC channels (after the pending ``PrefillDone`` calls)."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self._pool.close()
