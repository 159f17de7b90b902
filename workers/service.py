"""The Worker gRPC servicer: protobuf in, engine calls, protobuf out. Nothing more.

Contract:

- ``Generate`` validates the whole request before the engine sees it: INVALID_ARGUMENT
  naming the field for an empty prompt or a negative token id, a ``cache_salt`` over
  :data:`MAX_CACHE_SALT_CHARS` characters or with ``@ / \\`` or NUL (vLLM's rules), a
  bad sampling field
  (:func:`workers.engines.base.validate_sampling`), an optional sampling feature
  (``logprobs``, ``prompt_logprobs``, ``structured``, ``logit_bias``, ``min_tokens``,
  ``min_p``) the engine does not serve (:attr:`Engine.serves`; ``sampling.<feature> is not
  served``: never ignored), malformed ``kv_transfer`` params or
  ones the engine's handoff mode must not get
  (:func:`services.common.kv_params.validate_request`), or anything the engine refuses
  with EngineError. ``cache_salt`` (the tenant's) goes to the engine unchanged: its
  prefix cache never shares blocks across salts. **Images** (EPD): ``images`` are
  refused (INVALID_ARGUMENT naming ``images``) by an engine that does not accept them
  (``Engine.accepts_images``); each is checked and decoded by
  :mod:`services.encoder.images` with the worker's :class:`ImageLimits` (INVALID_ARGUMENT
  naming ``images[i].data``: not a PNG/JPEG, too many bytes or pixels; ``images``: too
  many; ``images[i].mm_hash`` empty), off the event loop; ``embeddings`` must each name
  an image's ``mm_hash`` and be a valid descriptor (``embeddings[i]``), and become the
  engine's ``ec_transfer_params`` (:func:`workers.ec.proto.ec_transfer_params`); an
  image without one is encoded by the engine. It streams one GenerateResponse per
  engine delta (with its ``logprobs``, one per token, and, on the first chunk, the
  ``prompt_logprobs``); with ``whole`` set, the deltas after the first one with tokens
  are merged and sent with the finish (or per :data:`WHOLE_FLUSH_TOKENS` tokens); with
  a ``stream_interval`` over 1 (the request's, at least the servicer's, at most
  :data:`WHOLE_FLUSH_TOKENS`), likewise per that many tokens (vLLM's stream_interval). It
  fills ``finish_reason`` and ``usage`` on the last one (INTERNAL
  when the engine's
  ``kv_transfer_params`` cannot be carried). Once the engine is dead (``mark_dead``, or
  the engine raised EngineDeadError) every in-flight and later call ends UNAVAILABLE
  ``engine dead: <reason>``. A remote prefill whose KV never came (KvHandoffError,
  policy ``fail``: the load failed, or, pull mode, ``--kv-handoff-timeout-s`` passed) is
  UNAVAILABLE naming the handoff, with trailing metadata ``kvmesh-failed-role: prefill``
  (:data:`FAILED_ROLE_KEY`): the fault is P's, this worker is alive. An engine that
  lives but cannot serve the request now (EngineUnavailableError, e.g. its AFD FFN peer
  is gone) is UNAVAILABLE ``engine unavailable: <cause>``, logged as one warning line (no
  traceback); the worker is not marked dead and serves later requests. Any other engine
  failure is logged once and answered INTERNAL (never UNKNOWN). When the client cancels,
  the engine generator is closed, which aborts the request in the engine.
- ``mark_dead(reason)``: from now on Generate answers UNAVAILABLE (the worker calls it
  when :meth:`Engine.wait_dead` returns).
  Records the spans ``worker.queue`` (arrival → first engine output of any kind),
  ``prefill`` (→ first token) and ``decode`` (first token → finish) under the gRPC
  server span, with worker id, prompt and cached token counts as attributes, and
  observes the engine's queue time (``queue_s`` of the first token) in
  ``kvmesh_worker_queue_seconds`` (:class:`workers.metrics.WorkerMetrics`).
  **EPD**: a request that came with ``embeddings`` gets, from the engine's final
  ``ec_transfer_params`` (the EC consumer's :class:`~workers.ec.core.TransferReport`
  list, :func:`~workers.ec.core.transfer_reports`), one ``embedding_transfer`` span
  under the server span, from the first READ's start to the last one's end (wall
  clock, measured inside EngineCore), with attributes ``kvmesh.images`` (embeddings
  reported), ``kvmesh.embedding_bytes`` (bytes READ, shared READs included),
  ``kvmesh.outcome`` (``read``: every embedding came from E; ``fallback``: none did;
  ``partial``), ``kvmesh.fallback_reasons``, ``kvmesh.encoder_agents`` (E's NIXL
  agents) and ``kvmesh.unreported``; and the ``kvmesh_worker_embedding_*`` metrics.
  Embeddings with no report (the prefix cache held the image, or vLLM ended the
  request without a final EngineCore output) are counted as ``unreported``; no span
  when nothing was reported. A malformed report is logged and counted ``unreported``
  (the request itself is fine).
- ``Abort`` aborts by request id; ``found`` tells whether it was running.
- ``GetLoad`` returns the engine's load, its cumulative counters and the number of active
  API requests.
- ``GetKvState`` returns the KV event relay's full state (UNIMPLEMENTED without a relay).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any

import grpc

from protos import common_pb2, kv_events_pb2, worker_pb2, worker_pb2_grpc
from services.common import kv_params
from services.common.telemetry import may_record, tracer
from services.encoder.images import ImageLimits, InputError, check_count, open_image
from workers.ec.core import TransferReport, transfer_reports
from workers.ec.proto import ec_transfer_params
from workers.engines.base import (
    Engine,
    EngineDeadError,
    EngineError,
    EngineRequest,
    EngineUnavailableError,
    KvHandoffError,
    PositionLogprobs,
    Sampling,
    StructuredOutputs,
    TokenLogprob,
    validate_sampling,
)
from workers.generate_stream import GenerateStreams
from workers.kv.event_relay import KvEventRelay
from workers.metrics import WorkerMetrics, worker_metrics
from workers.request_plane import RequestPlane

log = logging.getLogger(__name__)
# vLLM's own bounds on a cache salt (validate_cache_salt).
MAX_CACHE_SALT_CHARS = 128
CACHE_SALT_FORBIDDEN = frozenset("@/\\\0")
# Trailing metadata naming the role whose fault a failure is (the frontend reads it).
FAILED_ROLE_KEY = "kvmesh-failed-role"

FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


def structured_from_proto(p: common_pb2.StructuredOutputs) -> StructuredOutputs:
    """The oneof ``kind`` as :class:`StructuredOutputs` (no kind: none set, which
    :func:`validate_sampling` refuses; ``json_object=false`` counts as no kind)."""
    kind = p.WhichOneof("kind")
    return StructuredOutputs(
        json_schema=p.json_schema if kind == "json_schema" else None,
        json_object=kind == "json_object" and p.json_object,
        regex=p.regex if kind == "regex" else None,
        choice=tuple(p.choice.choices) if kind == "choice" else None,
        grammar=p.grammar if kind == "grammar" else None,
        compact_json=p.compact_json,
    )


# SamplingParams fields whose wire value is not the engine's (every other field is taken
# as it is; the message's fields are Sampling's, by name: tests/unit/test_worker_validation)
_FROM_WIRE: dict[str, Callable[[Any], Any]] = {
    "stop": tuple, "stop_token_ids": tuple, "bad_words": tuple, "allowed_token_ids": tuple,
    "logit_bias": lambda m: tuple(sorted(m.items())), "structured": structured_from_proto,
}


def sampling_from_proto(p: common_pb2.SamplingParams) -> Sampling:
    """Converts protobuf sampling params to the engine's dataclass: the fields the message
    sets (an optional one set to its default included), the dataclass's defaults for the
    rest (unset optional fields None; nothing is checked here: see
    :func:`validate_sampling`)."""
    kw: dict[str, Any] = {"max_tokens": 0}
    for field, value in p.ListFields():
        convert = _FROM_WIRE.get(field.name)
        kw[field.name] = value if convert is None else convert(value)
    return Sampling(**kw)


def check_served(sampling: Sampling, engine: Engine) -> None:
    """EngineError naming the first optional feature ``sampling`` sets that ``engine``
    does not serve (:attr:`Engine.serves`): refused, never ignored."""
    for name in sampling.features():
        if name not in engine.serves:
            info = engine.info
            raise EngineError(f"sampling.{name} is not served by engine {info.engine} "
                              f"(model {info.model})")


def position_logprobs_to_proto(p: PositionLogprobs) -> common_pb2.PositionLogprobs:
    def tok(t: TokenLogprob) -> common_pb2.TokenLogprob:
        return common_pb2.TokenLogprob(token_id=t.token_id, logprob=t.logprob, rank=t.rank)

    return common_pb2.PositionLogprobs(token=tok(p.token), top=[tok(t) for t in p.top])


WHOLE_FLUSH_TOKENS = 512  # GenerateRequest.whole: the most tokens held in one message


class WholeAnswer:
    """The messages of one ``whole`` request (GenerateRequest.whole), or of one with a
    ``stream_interval`` over 1 (``flush_tokens``: the interval): the first message
    with tokens, and any before it, pass; the later ones are merged into one held
    message (protobuf's merge: repeated fields appended, set fields taken; the text
    concatenated), sent with the finish or once it holds ``flush_tokens`` (default
    :data:`WHOLE_FLUSH_TOKENS`) tokens: vLLM's stream_interval rule. ``take_plain``
    holds an output that is tokens and text only without making a message of it (the
    usual decode step): the same answer, built once."""

    def __init__(self, worker_id: str = "", flush_tokens: int = WHOLE_FLUSH_TOKENS) -> None:
        self._worker_id = worker_id
        self._flush = flush_tokens
        self._passed = False  # a message with tokens went out
        self._held: worker_pb2.GenerateResponse | None = None
        self._ids: list[int] = []  # take_plain's tokens and texts, after _held's
        self._texts: list[str] = []

    @property
    def passed(self) -> bool:
        """A message with tokens went out: later outputs are held."""
        return self._passed

    def take_plain(self, token_ids: Sequence[int], text: str
                   ) -> worker_pb2.GenerateResponse | None:
        """``take`` of a message with only these tokens and text (and the worker id), once
        :attr:`passed`: what to send now (None: held)."""
        self._ids.extend(token_ids)
        self._texts.append(text)
        held = len(self._ids) + (len(self._held.token_ids) if self._held is not None else 0)
        if held < self._flush:
            return None
        self._fold()
        out, self._held = self._held, None
        return out

    def _fold(self) -> None:
        """Moves take_plain's tokens into the held message."""
        if not self._ids and not self._texts:
            return
        plain = worker_pb2.GenerateResponse(token_ids=self._ids, text="".join(self._texts),
                                            worker_id=self._worker_id)
        self._ids, self._texts = [], []
        self._merge(plain)

    def _merge(self, resp: worker_pb2.GenerateResponse) -> worker_pb2.GenerateResponse:
        held = self._held
        if held is None:
            held = self._held = resp
        else:
            text = held.text + resp.text
            held.MergeFrom(resp)
            held.text = text
        return held

    def take(self, resp: worker_pb2.GenerateResponse) -> worker_pb2.GenerateResponse | None:
        """What to send now for ``resp`` (None: it is held)."""
        if not self._passed:
            self._passed = bool(resp.token_ids)
            return resp
        self._fold()
        held = self._merge(resp)
        if held.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED \
                or len(held.token_ids) >= self._flush:
            self._held = None
            return held
        return None


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Serves one engine. ``stream_interval``: the worker's least stream interval
    (vLLM's ``--stream-interval``; a request's GenerateRequest.stream_interval may raise
    it, see :class:`WholeAnswer`)."""

    def __init__(self, engine: Engine, worker_id: str,
                 relay: KvEventRelay | None = None,
                 image_limits: ImageLimits | None = None,
                 metrics: WorkerMetrics | None = None, stream_interval: int = 1) -> None:
        self._engine = engine
        self._stream_interval = stream_interval
        self.metrics = metrics or worker_metrics(worker_id)
        self._image_limits = image_limits or ImageLimits()
        self._relay = relay
        self._worker_id = worker_id
        self._active = 0
        self._dead: str | None = None
        self._tracer = tracer("worker")
        self.streams = GenerateStreams(self.Generate)
        # the TCP request plane serving ``streams`` (workers.request_plane), when it has one
        self.request_plane: RequestPlane | None = None

    def mark_dead(self, reason: str) -> None:
        """From now on Generate answers UNAVAILABLE ``engine dead: <reason>``."""
        if self._dead is None:
            self._dead = reason

    async def _abort_dead(self, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine dead: {self._dead}")

    def _engine_request(self, request: worker_pb2.GenerateRequest) -> EngineRequest:
        """The validated engine request; raises EngineError or KvParamsError naming the
        bad field."""
        tokens: list[int] = request.token_ids[:]  # read once: each read converts them all
        if not tokens:
            raise EngineError("token_ids must not be empty")
        if min(tokens) < 0:  # one C pass; the message names the first
            first = next(t for t in tokens if t < 0)
            raise EngineError(f"token_ids must be >= 0, got {first}")
        salt = request.cache_salt
        if len(salt) > MAX_CACHE_SALT_CHARS or CACHE_SALT_FORBIDDEN.intersection(salt):
            raise EngineError(f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters "
                              f"without '@', '/', '\\' or NUL (got {len(salt)} characters)")
        sampling = sampling_from_proto(request.sampling)
        check_served(sampling, self._engine)
        validate_sampling(sampling)
        kv_transfer = None
        if request.HasField("kv_transfer"):
            kv_transfer = kv_params.to_dict(request.kv_transfer)
            mode = str(self._engine.info.handoff.get("mode", ""))
            kv_params.validate_request(kv_transfer, mode)
        return EngineRequest(
            request_id=request.request_id or f"req-{time.monotonic_ns()}",
            prompt_token_ids=tokens,
            sampling=sampling,
            kv_transfer_params=kv_transfer,
            cache_salt=request.cache_salt,
            output_interval=self._hold_tokens(request),
        )

    def _hold_tokens(self, request: worker_pb2.GenerateRequest) -> int:
        """How many tokens Generate's holder gathers per message after the first (1: it
        sends each output): WHOLE_FLUSH_TOKENS for a whole answer, else the larger of the
        request's and the worker's stream_interval, capped at WHOLE_FLUSH_TOKENS."""
        if request.whole:
            return WHOLE_FLUSH_TOKENS
        return min(max(request.stream_interval, self._stream_interval), WHOLE_FLUSH_TOKENS)

    def _images(self, request: worker_pb2.GenerateRequest,
                ereq: EngineRequest) -> EngineRequest:
        """``ereq`` with the request's images and embeddings, decoded and checked (see the
        module docstring); raises InputError or EngineError naming the field."""
        if not self._engine.accepts_images:
            raise EngineError(f"images: engine {self._engine.info.engine} of model "
                              f"{self._engine.info.model} takes no images")
        check_count(len(request.images), self._image_limits)
        uuids: list[str] = []
        images: list[Any] = []
        for i, item in enumerate(request.images):
            if not item.mm_hash:
                raise InputError(f"images[{i}].mm_hash", "must not be empty")
            images.append(open_image(item.data, f"images[{i}].data", self._image_limits))
            uuids.append(item.mm_hash)
        params: dict[str, Any] = {}
        for i, pb in enumerate(request.embeddings):
            if pb.mm_hash not in uuids:
                raise InputError(f"embeddings[{i}].mm_hash",
                                 f"{pb.mm_hash!r} names none of the request's images")
            try:
                params.update(ec_transfer_params([pb]))
            except ValueError as exc:
                raise InputError(f"embeddings[{i}]", str(exc)) from exc
        return dataclasses.replace(ereq, images=images, image_uuids=uuids,
                                   ec_transfer_params=params or None)

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[worker_pb2.GenerateResponse, None]:
        if self._dead is not None:
            await self._abort_dead(context)
        try:
            ereq = self._engine_request(request)
            if request.images or request.embeddings:  # decoding is CPU work: off the loop
                ereq = await asyncio.to_thread(self._images, request, ereq)
        except (EngineError, kv_params.KvParamsError, InputError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        attrs: dict[str, str | int] = {
            "kvmesh.worker_id": self._worker_id,
            "kvmesh.remote_prefill": bool(request.kv_transfer.do_remote_prefill),
            "kvmesh.remote_decode": bool(request.kv_transfer.do_remote_decode),
            "kvmesh.request_id": ereq.request_id,
            "kvmesh.prompt_tokens": len(ereq.prompt_token_ids),
        }
        t_arrive = time.time_ns()
        t_first_tok: int | None = None
        prefill_ns: int | None = None
        cached = 0
        ec_params: dict[str, Any] | None = None
        hold = ereq.output_interval
        holder = WholeAnswer(self._worker_id, hold) if hold > 1 else None
        self._active += 1
        outs = self._engine.generate(ereq)
        try:
            try:
                async for out in outs:
                    if out.token_ids and t_first_tok is None:
                        t_first_tok = time.time_ns()
                        if out.prefill_s is not None:
                            prefill_ns = int(out.prefill_s * 1e9)
                        if out.queue_s is not None:
                            self.metrics.observe_queue(out.queue_s)
                    cached = out.cached_tokens
                    if out.ec_transfer_params:
                        ec_params = out.ec_transfer_params
                    if (holder is not None and holder.passed and not out.finished
                            and not out.logprobs and not out.prompt_logprobs
                            and not out.kv_transfer_params):
                        held = holder.take_plain(out.token_ids, out.text)
                        if held is not None:
                            yield held
                        continue
                    resp = worker_pb2.GenerateResponse(
                        token_ids=out.token_ids, text=out.text, worker_id=self._worker_id
                    )
                    if out.logprobs:
                        resp.logprobs.extend(position_logprobs_to_proto(p)
                                             for p in out.logprobs)
                    if out.prompt_logprobs:
                        resp.prompt_logprobs.extend(position_logprobs_to_proto(p)
                                                    for p in out.prompt_logprobs)
                    if out.kv_transfer_params:
                        resp.kv_transfer.CopyFrom(kv_params.from_dict(out.kv_transfer_params))
                    if out.finished:
                        resp.finish_reason = FINISH.get(
                            out.finish_reason or "stop", common_pb2.FINISH_REASON_STOP
                        )
                        resp.usage.CopyFrom(
                            common_pb2.Usage(
                                prompt_tokens=out.prompt_tokens or len(ereq.prompt_token_ids),
                                completion_tokens=out.completion_tokens,
                                cached_tokens=out.cached_tokens,
                            )
                        )
                    if holder is not None:
                        held = holder.take(resp)
                        if held is None:
                            continue
                        resp = held
                    yield resp
            except EngineError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except EngineDeadError as exc:
                self.mark_dead(str(exc))
                await self._abort_dead(context)
            except EngineUnavailableError as exc:  # alive, but a peer it needs is gone
                log.warning("request %s: engine unavailable: %s", ereq.request_id, exc)
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine unavailable: {exc}")
            except KvHandoffError as exc:  # the remote prefill never came (P gone?)
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc),
                                    ((FAILED_ROLE_KEY, "prefill"),))
            except kv_params.KvParamsError as exc:  # the engine's answer cannot travel
                await context.abort(grpc.StatusCode.INTERNAL, f"engine output: {exc}")
            except Exception as exc:  # an engine bug: say so once, never UNKNOWN
                log.exception("engine failed on request %s", ereq.request_id)
                await context.abort(grpc.StatusCode.INTERNAL, f"engine failed: {exc!r}")
        finally:
            self._active -= 1
            self._record_spans(attrs, t_arrive, t_first_tok, prefill_ns, cached)
            if request.embeddings:
                self._record_transfers(attrs, ec_params,
                                       {e.mm_hash for e in request.embeddings})
            # closed here, in the call's task, when this generator is closed at a yield
            # (the client gone mid-answer): the engine stops the request now, not when the
            # event loop's finalizer gets to it (last: a failing close skips nothing)
            await _closed(outs)

    def _record_spans(
        self,
        attrs: dict[str, str | int],
        t_arrive: int,
        t_first_tok: int | None,
        prefill_ns: int | None,
        cached: int,
    ) -> None:
        """Splits arrival → first token into queue and prefill by the engine's own timing
        (the whole interval is prefill when the engine does not report it). Nothing when
        they could not be recorded (:func:`services.common.telemetry.may_record`)."""
        if not may_record():
            return
        end = time.time_ns()
        attrs = {**attrs, "kvmesh.cached_tokens": cached}
        first_tok = t_first_tok or end
        queue_end = t_arrive if prefill_ns is None else max(t_arrive, first_tok - prefill_ns)
        spans = (("worker.queue", t_arrive, queue_end), ("prefill", queue_end, first_tok),
                 ("decode", first_tok, end))
        for name, start, stop in spans:
            span = self._tracer.start_span(name, start_time=start, attributes=attrs)
            span.end(end_time=max(stop, start))

    def _record_transfers(self, attrs: dict[str, str | int],
                          ec_params: dict[str, Any] | None, embeddings: set[str]) -> None:
        """The ``embedding_transfer`` span and metrics (see the module docstring);
        ``embeddings``: the mm_hashes E sent (the connector reports once per distinct
        image, so an image twice in a prompt is one report)."""
        try:
            reports = transfer_reports(ec_params)
        except ValueError as exc:
            log.warning("request %s: bad EC transfer report from the engine: %s",
                        attrs.get("kvmesh.request_id"), exc)
            reports = []
        unreported = len(embeddings - {r.mm_hash for r in reports})
        self.metrics.observe_transfers(reports, unreported)
        if not reports:
            return
        span_attrs = {**attrs, **transfer_span_attributes(reports),
                      "kvmesh.unreported": unreported}
        start = min(r.start_ns for r in reports)
        span = self._tracer.start_span("embedding_transfer", start_time=start,
                                       attributes=span_attrs)
        span.end(end_time=max(start, *(r.end_ns for r in reports)))

    async def GenerateMux(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[worker_pb2.GenerateFrames],
        context: grpc.aio.ServicerContext,
    ) -> None:
        """Generate calls multiplexed on one stream (:mod:`workers.generate_stream`)."""
        await self.streams.handle(request_iterator, context)

    async def Abort(  # noqa: N802
        self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AbortResponse:
        return worker_pb2.AbortResponse(found=await self._engine.abort(request.request_id))

    async def GetLoad(  # noqa: N802
        self, request: worker_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.LoadReport:
        load = self._engine.load()
        return worker_pb2.LoadReport(
            worker_id=self._worker_id,
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            kv_usage=load.kv_usage,
            kv_total_blocks=load.kv_total_blocks,
            active_requests=self._active,
            counters=self._engine.counters(),
        )


    async def GetKvState(  # noqa: N802
        self, request: kv_events_pb2.KvStateRequest, context: grpc.aio.ServicerContext
    ) -> kv_events_pb2.KvState:
        if self._relay is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                "this worker publishes no KV events")
        assert self._relay is not None
        return self._relay.state()


async def _closed(outs: AsyncIterator[Any]) -> None:
    """Closes an engine's output stream (an async generator; a plain iterator has
    nothing to close). Closing a finished one does nothing."""
    aclose = getattr(outs, "aclose", None)
    if aclose is not None:
        await aclose()


def transfer_span_attributes(reports: list[TransferReport]) -> dict[str, str | int]:
    """The ``embedding_transfer`` span's attributes of one request's reports."""
    fallbacks = [r for r in reports if r.outcome == "fallback"]
    outcome = ("fallback" if len(fallbacks) == len(reports)
               else "partial" if fallbacks else "read")
    return {
        "kvmesh.images": len(reports),
        "kvmesh.embedding_bytes": sum(r.nbytes for r in reports),
        "kvmesh.outcome": outcome,
        "kvmesh.fallback_reasons": ",".join(sorted({r.reason for r in fallbacks})),
        "kvmesh.encoder_agents": ",".join(sorted({r.agent for r in reports if r.agent})),
    }


__all__ = ["WorkerServicer", "check_served", "position_logprobs_to_proto",
           "sampling_from_proto", "structured_from_proto", "transfer_span_attributes"]
