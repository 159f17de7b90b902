"""The frontend's request pipeline: tokenize → route → stream from the worker → release.

Shared by the HTTP (OpenAI) and gRPC APIs. Contract:

- ``prepare(req)`` resolves the model (ApiError 404 ``model_not_found`` when no worker
  serves it), tokenizes the prompt or renders the chat template, and enforces the context
  length (ApiError 400). It never contacts a worker. A prompt of at most
  :data:`INLINE_PROMPT_CHARS` characters (text only, no tools) is tokenized on the event
  loop when no other request is being prepared or streamed, else on the tokenizer's
  encode thread, which hands each prompt back as soon as it is encoded (a chat's template is
  rendered on the loop first); a longer one goes to a thread of its own.
- ``stream(job)`` asks the router for a worker (over gRPC, or the in-process
  ``router_stub`` of :mod:`services.router.embedded`), calls its ``Generate`` (through
  :func:`~services.frontend.handoff.run_plan`) and yields
  :class:`~services.frontend.jobs.Chunk` deltas; the last
  has ``finish_reason`` and ``usage``. Errors raise ApiError (404/503 from routing, 400
  from a worker's validation, naming the worker, P included; 502 when the worker fails):
  before the first chunk, and also after chunks were sent when a failure is not migrated
  or a migration's re-Route fails (e.g. 503: no worker left). A worker that dies
  mid-stream never hangs the stream.
- **Migration** (Dynamo's ``migration_limit``): when a worker call fails in a way that
  is not the request's fault (:data:`MIGRATABLE` codes, a stream that ends without a
  finish, a handoff fault or timeout) the request moves on, up to ``migration_limit``
  times: the attempt's entry is released and the request is routed again with
  ``exclude_instance_ids`` = every worker that failed it, ``token_ids`` = prompt + the
  tokens generated so far and ``max_tokens`` reduced by them (the router decides where,
  e.g. another P, or D prefilling itself). Only a worker that may be down (UNAVAILABLE,
  or no status: a broken stream, a push timeout) is reported to the router
  (``ReportFailure``, fire-and-forget), and a channel that answered UNAVAILABLE is
  dropped (so a worker restarted on the same port is dialled afresh); a worker that
  answered another status (INTERNAL, UNKNOWN, ...) is alive, so one poison request never
  marks workers unroutable. A handoff failure is P's, not D's: D's UNAVAILABLE with
  trailing metadata ``kvmesh-failed-role: prefill`` (P's KV never came) and a push
  timeout exclude and report P (stages "prefill" and "timeout"). The client's stream
  continues without an error, a repeated or a missing token (exact for greedy decoding,
  except with presence/frequency/repetition penalties, as the carried tokens become
  prompt tokens, and for a stop string straddling the migration boundary, which neither
  attempt sees whole; a sampled request continues from a fresh sampler state).
  ``min_tokens`` shrinks by the carried tokens and ``prompt_logprobs`` are not asked
  again (the first chunk had them); a structured-output request migrates only before
  its first token (its grammar state would restart on the carried tokens): after one,
  the client gets the failure's error. The
  finishing chunk's usage counts the
  original prompt and every generated token; "length" means ``max_tokens`` across
  attempts. ``kvmesh_frontend_migrations_total{stage}`` counts migrations; once the
  limit is spent (0: at once) the client gets the failure's error (502/503).
- **Tenants**: ``req.cache_salt`` (the tenant's, set by the API from the key, see
  :mod:`.auth`) goes on every RouteRequest and GenerateRequest of the job (P and D
  included), so the router's overlaps and the engines' prefix caches are per tenant.
- **Ids**: ``job.request_id`` (the client's ``request_id``, else 32 fresh random hex
  digits, as long as a uuid's) names the response; each attempt has its own mesh id
  (:meth:`Pipeline.mesh_request_id`), so two clients choosing the same id never collide
  in the router or on a worker.
- **Release exactly once**: every attempt's routing entry is released exactly once,
  whatever ends it (finish, error, migration, the consumer closing the iterator or being
  cancelled at any point): its worker calls are cancelled (which aborts the request on
  the workers) and ``Release`` is sent by a task that the consumer's cancellation cannot
  interrupt; :meth:`Pipeline.close` waits for those tasks. The stream waits for that task
  only when the attempt did not finish (before a migration's next Route, or before the
  error): a finished request's last chunk never waits for its Release. A Route that
  failed on the client's side after the router may have committed it
  (:data:`~.router_calls.MAYBE_ROUTED` codes, or the consumer's cancellation) gets a
  best-effort ``Release`` (idempotent; :mod:`.router_calls` makes the router's calls). When an
  attempt's first token arrives the router is told ``PrefillDone`` (fire-and-forget: the
  stream never waits for it, and its failures, e.g. an older router without the RPC, are
  ignored), unless that chunk also finishes the attempt (a one-token answer, or one that
  stops at its first token): then the attempt's Release, which frees everything
  PrefillDone frees, is the router's only call after Route.
- **Images** (EPD): ``prepare`` refuses images for a model no worker lists ``images``
  for (400), fetches remote ones when allowed (``--allow-remote-images``:
  :func:`services.frontend.remote_images.fetch_parts`, on the event loop, a failed fetch
  a 400 naming its field), then checks and expands them
  (:func:`services.frontend.images.mm_prompt`: a bad image is a 400 naming its field);
  ``job.token_ids`` is then the prompt as the model sees it (context length, usage,
  routing) and ``job.mm`` holds the engine's prompt (one marker per image) and each
  image's bytes, content hash, mm_hash and placeholder range. Each attempt's
  RouteRequest carries ``mm_items`` (the router hashes the prompt with the images' keys
  and picks an encoder); then the frontend
  calls ``Encoder.Encode`` on the chosen E (as role frontend, E's server role
  ``encoder``; ``encode_timeout_s``) and sends the worker the images and E's
  EmbeddingDescriptors. A text-only request never touches an encoder.
  **Failure policy** when E is missing or fails: the request still runs, and the LM
  worker encodes the images itself (it holds the vision tower; vLLM encodes any item
  without a usable embedding, as the EC consumer does when a READ fails), counted in
  ``kvmesh_frontend_encode_fallbacks_total{reason}`` (``no_encoder`` when the router
  found none, ``not_ec_consumer`` when the worker computing the prompt is no EC
  consumer, e.g. D served alone in E/P/D, else E's status code name, e.g.
  ``UNAVAILABLE`` for an E killed mid-request, ``DEADLINE_EXCEEDED``) and logged once
  per reason. Only E's
  INVALID_ARGUMENT (the image itself is bad) reaches the client, as a 400. The attempt's
  routing entry (and the router's encoder pick with it) is released exactly once
  whatever happens during the Encode call.
- **Log-probabilities** (issue 15): ``sampling_proto`` sends the job's ``logprobs`` /
  ``prompt_logprobs`` top-k counts, ``structured``, ``logit_bias`` (ids checked against
  the vocabulary in ``prepare``: 400), ``min_tokens`` and ``min_p``; each Chunk carries
  the worker's per-token ``logprobs`` and the first token's chunk the prompt's
  (:func:`check_logprobs`: a worker answering other counts is a 502, never a short
  answer). After a migration the continuation's log-probabilities are the new
  worker's (the prompt's were sent with the first token and are not repeated).
- **Tools** (chat): ``prepare`` checks them against the model's template, waits for
  vLLM's tool parser and constrains ``required`` / named calls (:mod:`.tool_chat`).
- **Several choices / prompts** (``n`` > 1, batches) are :mod:`.fanout`'s: each choice is
  one job streamed by :meth:`Pipeline.stream`, so everything above holds per choice.
- Outcomes: a request the consumer abandoned before its finish counts
  ``outcome="cancelled"`` (not an error, no traceback); see :mod:`.metrics`.
- Each request records a root span ``frontend.request`` with children ``frontend.tokenize``
  and the gRPC client spans of the router and worker calls (which carry the context on).
  When it finishes, the span gets ``kvmesh.predicted_cached_tokens`` (the router's
  prediction, see :func:`predicted_cached_tokens`) and ``kvmesh.actual_cached_tokens`` (the
  engine's ``cached_tokens``: P's prefix hits when disaggregated), and the metrics record
  both and their absolute error (recorded with the finished request's usage on the token
  counters once the consumer has taken the last chunk: it resumed or closed the stream, so
  an answer built from that chunk goes out first);
  every chunk after the first that carries tokens records ITL samples (its gap / its
  tokens); a rejection counts ``outcome="rejected"`` and the reason.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.context import Context

from protos import (
    common_pb2,
    encoder_pb2,
    encoder_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
)
from services.common.grpc_client import ChannelPool
from services.common.telemetry import Attached, leaf_span, span_in_context, tracer
from services.common.tls import MeshTls
from services.encoder.images import ImageLimits, InputError
from services.frontend import tool_chat, vllm_extras
from services.frontend.context_window import check_context, truncated
from services.frontend.failures import (
    WorkerFailure,
    worker_failure,
)
from services.frontend.handoff import HandoffError, Request, generate, run_plan
from services.frontend.images import MmPrompt, mm_prompt
from services.frontend.jobs import (
    FINISH_NAMES,
    Chunk,
    Job,
    Prior,
    check_logprobs,
    predicted_cached_tokens,
    sampling_proto,
)
from services.frontend.metrics import FrontendMetrics
from services.frontend.models import ModelCatalog, ModelInfo, Tokenizer
from services.frontend.openai_schema import ApiError, ParsedRequest
from services.frontend.remote_images import RemoteImageFetcher, RemoteImageLimits, fetch_parts
from services.frontend.router_calls import RouterCalls
from services.frontend.worker_stream import WorkerStreams

log = logging.getLogger(__name__)
DEFAULT_MIGRATION_LIMIT = 3
DEFAULT_ENCODE_TIMEOUT_S = 30.0

# The longest part of a client's request id kept in the mesh's per-attempt ids.
CLIENT_ID_CHARS = 200


# A prompt of at most this many characters is tokenized (or its chat template rendered)
# on the event loop when it is the only request there (no latency added), else on the
# tokenizer's encode thread (the loop's other requests go on meanwhile; a hop
# through asyncio.to_thread would cost ~90 µs of CPU a prompt). A longer one (or one with
# tools or images) goes to a thread of its own, so no request holds the loop for long.
INLINE_PROMPT_CHARS = 4096
UNFINISHED = common_pb2.FINISH_REASON_UNSPECIFIED  # a worker response that is not the last


def _prompt_chars(req: ParsedRequest) -> int:
    """The characters ``prepare`` tokenizes for ``req``: the prompt's, or the chat
    messages' text (a request with tools or a non-text part counts as too long to run
    inline; so does one with tool messages)."""
    if req.kind != "chat":
        return len(req.prompt or "")
    if req.tools is not None or req.message_extras:
        return INLINE_PROMPT_CHARS + 1
    n = 0
    for _role, content in req.messages:
        if isinstance(content, str):
            n += len(content)
        else:
            for kind, text in content:
                if kind != "text":
                    return INLINE_PROMPT_CHARS + 1
                n += len(text)
    return n


class Pipeline:
    """Tokenize, route, stream; see the module docstring."""

    def __init__(self, catalog: ModelCatalog, router_address: Callable[[], str | None],
                 migration_limit: int = DEFAULT_MIGRATION_LIMIT,
                 tls: MeshTls | None = None, image_limits: ImageLimits | None = None,
                 encode_timeout_s: float = DEFAULT_ENCODE_TIMEOUT_S,
                 remote_images: RemoteImageLimits | None = None,
                 router_stub: Any = None, first_token_from_prefill: bool = True,
                 worker_streams: bool = False, request_planes: bool = False) -> None:
        if migration_limit < 0:
            raise ValueError(f"migration_limit must be >= 0, got {migration_limit}")
        if not encode_timeout_s > 0:
            raise ValueError(f"encode_timeout_s must be positive, got {encode_timeout_s}")
        self.image_limits = image_limits or ImageLimits()
        self.encode_timeout_s = encode_timeout_s
        self._warned: set[str] = set()
        self._catalog = catalog
        self._pool = ChannelPool(tls, "worker")
        # worker calls multiplexed per worker (--worker-transport stream: on a GenerateMux;
        # tcp: on the worker's TCP request plane where it has one, else its GenerateMux)
        self._streams = (WorkerStreams(self._pool, planes=request_planes)
                         if worker_streams or request_planes else None)
        self._tracer = tracer("frontend")
        self.metrics = FrontendMetrics()
        # remote image URLs (parse_chat lets them through only with image_limits.remote_urls)
        self.remote_images = (RemoteImageFetcher(remote_images or RemoteImageLimits(),
                                                 self.metrics.observe_remote_fetch)
                              if self.image_limits.remote_urls else None)
        self.migration_limit = migration_limit
        # pull P/D: P's sampled token is the first token when it may be (handoff)
        self.first_token_from_prefill = first_token_from_prefill
        self._background: set[asyncio.Future[None]] = set()
        # prepare and stream calls running, the express path's too: see _tokenize
        self.busy = 0
        # the router: in this process (router_stub, services.router.embedded: RouterStub's
        # call shape and errors), else the one at router_address(), over gRPC
        self.routing = RouterCalls(self._pool, router_address, router_stub, self.metrics,
                                   self._spawn)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Future[None]:
        """Runs ``coro`` as a task that outlives the request's cancellation; ``close``
        waits for it."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def worker_call(self, choice: router_pb2.WorkerChoice,
                    request: worker_pb2.GenerateRequest) -> Any:
        """``request``'s Generate call to ``choice`` as a plan makes it
        (:func:`~.handoff.generate`, on this pipeline's transports)."""
        return generate(self._pool, self._streams, choice, request)

    def later(self, callback: Callable[..., None], *args: Any) -> None:
        """Calls ``callback(*args)`` from the event loop soon (a finished request's
        teardown after its answer went out); ``close`` lets it run first."""
        asyncio.get_running_loop().call_soon(callback, *args)

    def close_later(self, chunks: AsyncIterator[Any]) -> None:
        """Closes ``chunks`` (an iterator :meth:`stream` or :func:`.fanout.run` gave) in a
        task of its own, as ``close`` would await it: for a consumer that has the last
        chunk and answers before the request's teardown runs. A failing close is
        logged."""
        async def close() -> None:
            try:
                await chunks.aclose()  # type: ignore[attr-defined]
            except Exception:
                log.exception("closing a finished request's stream failed")
        self._spawn(close())

    async def _end_attempt(self, router: router_pb2_grpc.RouterStub, request_id: str,
                           responses: AsyncIterator[worker_pb2.GenerateResponse]) -> None:
        """Closes the attempt's worker calls (cancelling what still runs on its workers;
        a consumer cancelled mid-step has closed them already, the cancellation having
        gone through ``responses``), then releases its routing entry (exactly once per
        attempt: the attempt's ``finally`` runs this once)."""
        try:
            await responses.aclose()  # type: ignore[attr-defined]
        except Exception:
            log.exception("closing the worker stream of %s failed", request_id)
        await self.routing.release(router, request_id)

    @property
    def catalog(self) -> ModelCatalog:
        return self._catalog

    @property
    def tracer(self) -> trace.Tracer:
        """The frontend's tracer (:mod:`.fanout` opens its request spans with it)."""
        return self._tracer

    async def prepare(self, req: ParsedRequest) -> Job:
        """Resolves the model, tokenizes and checks the context length; the job carries
        ``req.cache_salt`` (the tenant's) to the router and the workers."""
        self.busy += 1
        try:
            return await self._prepare(req)
        finally:
            self.busy -= 1

    async def _prepare(self, req: ParsedRequest) -> Job:
        info = self._catalog.get(req.model)
        if info is None:
            raise ApiError(404, f"The model '{req.model}' does not exist or has no live worker",
                           param="model", code="model_not_found")
        with leaf_span(self._tracer, "frontend.tokenize") as span:
            if req.prompt_token_ids is not None:
                ids = list(req.prompt_token_ids)
            else:
                tok = self._catalog.loaded_tokenizer(info)  # no thread hop once loaded
                if tok is None:
                    tok = await asyncio.to_thread(self._catalog.tokenizer, info)
                ids, req = await self._tokenize(tok, req)
            if req.truncate is not None:
                ids, req = truncated(req, ids, info.max_model_len)
            mm = await self._images(req, info, ids) if req.images else None
            if mm is not None:
                ids = mm.token_ids
                span.set_attribute("kvmesh.images", len(mm.images))
            span.set_attribute("kvmesh.prompt_tokens", len(ids))
            if req.sampling.logit_bias or req.sampling.allowed_token_ids:
                tok = await asyncio.to_thread(self._catalog.tokenizer, info)
                err = vllm_extras.vocab_problem(req.sampling, tok.vocab_size)
                if err is not None:
                    raise err
        req = check_context(req, len(ids), info.max_model_len)
        rid = req.request_id or os.urandom(16).hex()
        return Job(rid, req, info, ids, int(time.time()), req.cache_salt, mm)

    async def _tokenize(self, tok: Tokenizer, req: ParsedRequest
                        ) -> tuple[list[int], ParsedRequest]:
        """The prompt's ids, or the chat template's, and the request as tool calling left
        it (see the module docstring)."""
        too_long = _prompt_chars(req) > INLINE_PROMPT_CHARS  # for the loop: a thread
        if req.kind == "chat":  # tool calling: :mod:`.tool_chat`
            req = await tool_chat.prepare(req, tok)
            kwargs = dict(tool_chat.chat_kwargs(req),
                          add_generation_prompt=req.add_generation_prompt,
                          continue_final_message=req.continue_final_message)
            add = bool(req.add_special_tokens)
            if too_long:
                return await asyncio.to_thread(tok.apply_chat, req.messages,
                                               add_special_tokens=add, **kwargs), req
            text = tok.render_chat(req.messages, **kwargs)
        else:
            add = req.add_special_tokens is None or req.add_special_tokens
            text = req.prompt or ""
            if too_long:
                return await asyncio.to_thread(tok.encode, text, add), req
        if self.busy > 1:  # others wait on this loop: encode on the encode thread
            return await tok.encode_off_loop(text, add), req
        return tok.encode(text, add), req

    async def _images(self, req: ParsedRequest, info: ModelInfo, ids: list[int]) -> MmPrompt:
        """The request's images checked and expanded (see the module docstring)."""
        if not info.accepts_images:
            raise ApiError(400, f"the model {req.model!r} takes no images", param="messages")
        try:
            expander = await asyncio.to_thread(self._catalog.expander, info)
        except Exception as exc:  # noqa: BLE001 - a model folder without a processor
            raise ApiError(400, f"the model {req.model!r} has no image processor: "
                           f"{type(exc).__name__}: {exc}", param="messages") from exc
        try:
            parts = await fetch_parts(self.remote_images, req.images)  # remote URLs: fetched
            return await asyncio.to_thread(mm_prompt, ids, parts, req.cache_salt,
                                           self.image_limits, expander)
        except InputError as exc:
            raise ApiError(400, str(exc), param=exc.field) from exc
        except ValueError as exc:  # markers and images do not pair up
            raise ApiError(400, str(exc), param="messages") from exc

    def _fallback(self, reason: str, job: Job, detail: str) -> None:
        """The worker encodes the job's images itself (see the module docstring)."""
        self.metrics.encode_fallbacks.labels(reason).inc()
        if reason not in self._warned:
            self._warned.add(reason)
            log.warning("request %s: no encoder embeddings (%s: %s); the worker encodes its "
                        "images itself (logged once per reason)", job.request_id, reason,
                        detail)

    async def _encode(self, job: Job, route: router_pb2.RouteResponse, mesh_id: str,
                      ctx: Context | None) -> list[encoder_pb2.EmbeddingDescriptor]:
        """E's embeddings of the job's images, or [] when the worker must encode them
        (the failure policy of the module docstring)."""
        assert job.mm is not None
        if not route.HasField("encoder"):
            reason = route.encoder_skipped or "no_encoder"
            self._fallback(reason, job, "the router picked no encoder" if
                           reason == "no_encoder" else "the worker computing the prompt "
                           "reads no embeddings")
            return []
        enc = route.encoder
        stub = encoder_pb2_grpc.EncoderStub(self._pool.get(enc.address, "encoder"))
        request = encoder_pb2.EncodeRequest(
            request_id=mesh_id, model=job.req.model, cache_salt=job.cache_salt,
            images=[encoder_pb2.ImageInput(data=i.data, content_hash=i.digest)
                    for i in job.mm.images])
        started = time.monotonic()
        with Attached(ctx), self._tracer.start_as_current_span("encode", attributes={
                "kvmesh.encoder_id": enc.instance_id, "kvmesh.images": len(job.mm.images),
                "kvmesh.affinity_items": enc.affinity_items}) as span:
            try:
                resp = await stub.Encode(request, timeout=self.encode_timeout_s)
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                span.set_attribute("kvmesh.encode_fallback", code.name)
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise ApiError(400, f"the encoder refused the image: {exc.details()}",
                                   param="messages") from exc
                if code == grpc.StatusCode.UNAVAILABLE:
                    self._pool.invalidate(enc.address)
                self._fallback(code.name, job, f"encoder {enc.instance_id}: {exc.details()}")
                return []
            self.metrics.encode_seconds.observe(time.monotonic() - started)
            want = [i.mm_hash for i in job.mm.images]
            if [e.mm_hash for e in resp.embeddings] != want:
                self._fallback("bad_answer", job, f"encoder {enc.instance_id} answered "
                               f"{len(resp.embeddings)} embeddings for other images")
                return []
            hits = sum(e.cache_hit for e in resp.embeddings)
            span.set_attribute("kvmesh.encode_cache_hits", hits)
            self.metrics.encodes.labels("hit").inc(hits)
            self.metrics.encodes.labels("miss").inc(len(want) - hits)
            return list(resp.embeddings)

    @staticmethod
    def mesh_request_id(job: Job, attempt: int) -> str:
        """The id the router and workers see for ``attempt`` (0, 1, ...) of ``job``: unique
        per attempt even when clients choose equal ids (the response keeps the client's)."""
        if job.req.request_id is None:  # job.request_id is fresh (random)
            return job.request_id if attempt == 0 else f"{job.request_id}-{attempt}"
        return f"{job.request_id[:CLIENT_ID_CHARS]}-{os.urandom(16).hex()}"

    async def stream(self, job: Job, ctx: Context | None = None,
                     prior: Prior | None = None) -> AsyncIterator[Chunk]:
        """Routes and streams the job, migrating it when a worker fails; see the module
        docstring. ``ctx`` is the trace context the router and worker calls are made in
        (default: the current one). ``prior``: the job's first attempt as the express
        path (:mod:`.express`) left it: routed, not run (its route is attempt 0's), or
        failed (then this goes on as after that failure: the error, or attempt 1)."""
        router = prior.router if prior is not None and prior.router is not None \
            else self.routing.stub()
        if router is None:
            raise ApiError(503, "no router is available", type="service_unavailable")
        sampling = sampling_proto(job)
        max_tokens = sampling.max_tokens
        generated: list[int] = []  # every token the client got, across attempts
        failed: list[str] = []  # instance ids that failed this request
        path, outcome, finished = "none", "error", False
        started = last_at = time.monotonic()
        # the finishing chunk, its route and path: its metrics are recorded once the
        # consumer took it (the stream resumed or closed), so an answer built from it
        # need not wait for them
        final: tuple[Chunk, router_pb2.RouteResponse] | None = None
        first_token = True
        prompt_sent = False  # the prompt's log-probabilities went out (first token)
        attempts = range(self.migration_limit + 1)
        self.busy += 1
        try:
            if prior is not None:  # the express path's attempt 0: from its start
                started, last_at = prior.started, prior.last_at
            if prior is not None and prior.failure is not None:  # ... which failed
                path = "disagg" if prior.route.disaggregated else "agg"
                generated.extend(prior.generated)
                first_token = not generated
                prompt_sent = bool(generated)
                self._after_failure(router, job, prior.mesh_id, prior.failure, prior.cause,
                                    0, generated, sampling, failed)
                attempts = range(1, self.migration_limit + 1)
            # before any router state exists: a cancel while it loads leaks nothing
            stops = (await self._catalog.eos_token_ids(job.model)
                     if self.first_token_from_prefill else None)
            for attempt in attempts:
                carried = len(generated)
                if carried >= max_tokens:  # died after its last token, before the finish
                    finished, outcome = True, "length"
                    self.metrics.observe_usage(len(job.token_ids), carried)
                    yield Chunk("", [], "length", len(job.token_ids), carried)
                    return
                mesh_id = self.mesh_request_id(job, attempt)
                mm_items = [router_pb2.MmItem(mm_hash=i.mm_hash, offset=i.offset,
                                              length=i.length)
                            for i in (job.mm.images if job.mm is not None else ())]
                try:
                    if attempt == 0 and prior is not None:  # routed by the express path
                        route = prior.route
                    else:
                        route = await self.routing.route(router, router_pb2.RouteRequest(
                            request_id=mesh_id, model=job.req.model,
                            max_tokens=max_tokens - carried,
                            exclude_instance_ids=failed, cache_salt=job.cache_salt,
                            mm_items=mm_items), job.token_ids + generated, ctx)
                except ApiError as err:
                    if err.type == "overloaded_error":
                        outcome = "rejected"  # counted by observe_rejection
                    raise
                path = "disagg" if route.disaggregated else "agg"
                attempt_sampling = common_pb2.SamplingParams()
                attempt_sampling.CopyFrom(sampling)
                attempt_sampling.max_tokens = max_tokens - carried
                if carried:  # the carried tokens are prompt now (min_tokens counts them;
                    # the prompt logprobs went out with the first attempt's first chunk)
                    attempt_sampling.min_tokens = max(0, sampling.min_tokens - carried)
                    attempt_sampling.ClearField("prompt_logprobs")
                images: list[worker_pb2.ImageItem] = []
                embeddings: list[encoder_pb2.EmbeddingDescriptor] = []
                if job.mm is not None:
                    try:
                        embeddings = await self._encode(job, route, mesh_id, ctx)
                    except BaseException:  # incl. cancellation: the entry is released
                        await asyncio.shield(self._spawn(self.routing.release(router, mesh_id)))
                        raise
                    images = [worker_pb2.ImageItem(data=i.data, mm_hash=i.mm_hash)
                              for i in job.mm.images]
                prompt = job.mm.engine_ids if job.mm is not None else job.token_ids
                plan = Request(mesh_id, job.req.model, prompt + generated,
                               attempt_sampling, job.cache_salt, images, embeddings, stops,
                               whole=not job.req.stream,
                               stream_interval=job.req.stream_interval or 0)
                with Attached(ctx):
                    responses = run_plan(self._pool, plan, route, self.metrics,
                                         self._streams)
                failure: WorkerFailure | None = None
                cause: BaseException | None = None
                attempt_first = True
                try:
                    while True:
                        try:  # each step in this task, its worker calls made in ctx
                            with Attached(ctx):
                                resp = await responses.__anext__()
                        except StopAsyncIteration:
                            w = route.worker
                            failure = WorkerFailure(
                                "decode" if route.disaggregated else "agg", w.instance_id,
                                w.address, None, "worker ended the stream without finishing")
                            break
                        first_tokens = bool(resp.token_ids) and not prompt_sent
                        check_logprobs(job, resp, first_tokens)
                        chunk = Chunk(resp.text, list(resp.token_ids),
                                      logprobs=list(resp.logprobs))
                        if first_tokens:
                            prompt_sent = True
                            if job.req.sampling.prompt_logprobs is not None:
                                chunk.prompt_logprobs = list(resp.prompt_logprobs)
                        if resp.token_ids:
                            now = time.monotonic()
                            if attempt_first:
                                attempt_first = False
                                if resp.finish_reason == UNFINISHED:  # else the Release
                                    with Attached(ctx):  # ending the attempt frees it
                                        self.routing.prefill_done(router, mesh_id)
                            if first_token:
                                first_token = False
                                self.metrics.child(self.metrics.ttft, path).observe(
                                    now - started)
                            else:
                                self.metrics.observe_chunk_gap(now - last_at,
                                                               len(resp.token_ids))
                            last_at = now
                            generated.extend(resp.token_ids)
                        if resp.finish_reason != UNFINISHED:
                            finished = True
                            outcome = FINISH_NAMES.get(resp.finish_reason, "stop")
                            self._finish(chunk, resp, route, job, carried)
                            final = (chunk, route)
                            yield chunk
                            return
                        yield chunk
                except HandoffError as exc:
                    failure, cause = worker_failure(exc, route), exc
                finally:
                    ending = self._spawn(self._end_attempt(router, mesh_id, responses))
                    if not finished:  # a failed attempt is released before the next one
                        await asyncio.shield(ending)
                assert failure is not None
                self._after_failure(router, job, mesh_id, failure, cause, attempt, generated,
                                    sampling, failed)
        except (GeneratorExit, asyncio.CancelledError):
            if not finished:
                outcome = "cancelled"
            raise
        finally:
            self.busy -= 1
            if final is not None:  # after the consumer took the last chunk (see stream)
                last, last_route = final
                self.metrics.observe_cache_prediction(
                    path, last_route.overlap_source or "history",
                    last.predicted_cached_tokens, last.cached_tokens)
                self.metrics.observe_usage(last.prompt_tokens, last.completion_tokens)
            if outcome != "rejected":
                self.metrics.child(self.metrics.requests, path, outcome).inc()

    def _after_failure(self, router: router_pb2_grpc.RouterStub, job: Job, mesh_id: str,
                       failure: WorkerFailure, cause: BaseException | None, attempt: int,
                       generated: list[int], sampling: common_pb2.SamplingParams,
                       failed: list[str]) -> None:
        """After ``attempt`` failed (its entry released): raises the failure's error when
        it may not migrate, else counts the migration, reports a worker that may be down
        and adds the failed worker to ``failed``."""
        # A grammar's state would restart on the carried tokens: a structured
        # request migrates only before its first token.
        if (not failure.migratable or attempt >= self.migration_limit
                or (generated and sampling.HasField("structured"))):
            raise failure.error() from cause
        log.info("request %s: %s worker %s failed (%s); migrating with %d tokens "
                 "generated", job.request_id, failure.stage, failure.instance_id,
                 failure.detail, len(generated))
        self.metrics.migrations.labels(failure.stage).inc()
        if failure.worker_down:
            self.routing.report_failure(router, mesh_id, failure)
        if failure.instance_id and failure.instance_id not in failed:
            failed.append(failure.instance_id)

    def _finish(self, chunk: Chunk, resp: worker_pb2.GenerateResponse,
                route: router_pb2.RouteResponse, job: Job, carried: int) -> None:
        """Fills the finishing ``chunk`` from the worker's last response; after a migration
        (``carried`` tokens came from earlier attempts) the usage is the client's: the
        original prompt and every generated token."""
        prompt = len(job.token_ids) if carried else resp.usage.prompt_tokens
        chunk.predicted_cached_tokens = predicted_cached_tokens(route, job.model.block_size)
        chunk.finish_reason = FINISH_NAMES.get(resp.finish_reason, "stop")
        chunk.prompt_tokens = prompt
        chunk.completion_tokens = carried + resp.usage.completion_tokens
        chunk.cached_tokens = min(resp.usage.cached_tokens, prompt)

    async def run(self, req: ParsedRequest) -> tuple[Job, AsyncIterator[Chunk]]:
        """``prepare`` + ``stream`` under one ``frontend.request`` root span.

        The span ends when the returned iterator is exhausted or closed (a span that
        does not record, unsampled, has nothing to end: the iterator is ``stream``'s).
        """
        span = self._tracer.start_span("frontend.request", attributes={
            "kvmesh.model": req.model, "kvmesh.kind": req.kind, "kvmesh.stream": req.stream,
        })
        ctx = span_in_context(span)
        try:
            with Attached(ctx):
                job = await self.prepare(req)
        except BaseException as exc:
            span.record_exception(exc)
            span.end()
            raise
        if not span.is_recording():  # its end and exceptions would go nowhere: no
            return job, self.stream(job, ctx)  # wrapper, one generator less per chunk
        span.set_attribute("kvmesh.request_id", job.request_id)
        span.set_attribute("kvmesh.prompt_tokens", len(job.token_ids))

        async def traced() -> AsyncIterator[Chunk]:
            chunks = self.stream(job, ctx)
            finished = False  # the finishing chunk went out: a close then is no failure
            try:
                async for chunk in chunks:
                    if chunk.finish_reason is not None:
                        finished = True
                        span.set_attribute("kvmesh.cached_tokens", chunk.cached_tokens)
                        span.set_attribute("kvmesh.actual_cached_tokens", chunk.cached_tokens)
                        span.set_attribute("kvmesh.predicted_cached_tokens",
                                           chunk.predicted_cached_tokens)
                        span.set_attribute("kvmesh.completion_tokens", chunk.completion_tokens)
                        span.set_attribute("kvmesh.finish_reason", chunk.finish_reason)
                    yield chunk
            except BaseException as exc:
                if not (finished and isinstance(exc, GeneratorExit)):
                    span.record_exception(exc)
                raise
            finally:
                try:  # closed with it, as the stream itself would be without the span
                    await chunks.aclose()  # type: ignore[attr-defined]
                finally:
                    span.end()

        return job, traced()

    async def close(self) -> None:
        """Closes the gRPC channels, once every background task (a finished request's
        teardown, its Release, the pending ``PrefillDone`` calls, and the tasks those
        start) has ended; the callbacks ``later`` scheduled run before."""
        await asyncio.sleep(0)  # a loop turn: those callbacks run (in order)
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)
        if self._streams is not None:
            await self._streams.close()
        await self._pool.close()
