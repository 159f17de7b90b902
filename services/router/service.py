"""The Router gRPC servicer, plus the glue that feeds discovery and load into the core.

Contract:

- ``Route``: INVALID_ARGUMENT, naming the field, for a missing ``request_id`` or
  ``model``, either over :data:`MAX_ID_CHARS` characters, empty ``token_ids``, a
  negative token id (or, in an in-process list, one past u32: "is not a token id"; the
  first of either is named), ``max_tokens`` < 0, more than :data:`MAX_EXCLUDE`
  ``exclude_instance_ids``, or a prompt (+ ``max_tokens``) beyond the model's context
  (``core.check_request``, before hashing); ALREADY_EXISTS "request_id <id> is already
  in flight"; NOT_FOUND for a model no worker ever served, UNAVAILABLE when it has no
  live worker now (none left after ``exclude_instance_ids``, which the core never
  picks); otherwise the chosen worker with the policy
  name and reason, the predicted overlaps (blocks, per tier, block size, source). The
  prompt is hashed once per distinct block size of the model's workers (with the
  request's ``cache_salt``: no overlap across tenants), and the overlap
  source (``overlaps.py``: none / remote indexer / embedded index) is asked before the
  core decides; no answer means the core's history. Records a ``router.route`` span:
  policy, worker id, reason, overlap source (and whether the indexer failed), predicted
  overlap blocks in total and per tier for D and P, the chosen workers' score and cost.
  With admission control on (``core.admission``), the chosen plan is judged before it
  is counted: a rejection aborts with RESOURCE_EXHAUSTED, the decision's detail as the
  message and trailing metadata ``retry-after`` (seconds, decimal) and
  ``kvmesh-admission-reason``; the span gets ``kvmesh.admission`` (admit / reject /
  off), ``kvmesh.admission_reason``, ``kvmesh.predicted_itl_ms``,
  ``kvmesh.predicted_ttft_ms`` and ``kvmesh.retry_after_s``.
- **Images** (EPD): ``mm_items`` (each image's ``mm_hash`` and placeholder range in
  ``token_ids``) are checked (:func:`check_mm_items`, INVALID_ARGUMENT naming
  ``mm_items[i]``), every hash of the prompt includes their keys (vLLM's
  ``("mm", identifier, offset)``, :mod:`services.common.block_hash`), and once the
  worker is chosen the :class:`~services.router.encoders.EncoderPicker` picks the
  encoder (cache affinity, then load; not one in ``exclude_instance_ids``):
  ``RouteResponse.encoder``, unset when none serves the model
  (``encoder_skipped = "no_encoder"``) or when the worker that computes the prompt (P, or
  the aggregated worker) does not list the capability ``ec_consumer``
  (``"not_ec_consumer"``: it encodes the images itself, e.g. D served alone in E/P/D,
  so no encoder is asked for embeddings nobody would read). A text-only request
  never gets one, and its routing is unchanged. ``set_encoders`` applies the etcd
  snapshot of component ``encoder``.
- ``Release``: ends the request's load accounting (pending prefill included) and its
  encoder pick; idempotent, ``found`` false when it was not in flight.
- ``PrefillDone``: the request's prefill is over (the frontend saw its first token):
  ``core.release_prefill``, and its encoder pick ends (E's part was over before the
  prefill); ``found`` is false when nothing was pending for it.
- ``ReportFailure``: ``core.report_failure``: the worker is unroutable until it
  re-registers or ``failure_hold_s`` passes; ``found`` false for an unknown worker. A new
  mark is logged (one warning line, not one per report) and every report on a known
  worker counted.
- Release, PrefillDone and ReportFailure answer INVALID_ARGUMENT without their id (or
  one over :data:`MAX_ID_CHARS`). No method answers UNKNOWN: an unexpected error is
  logged with its traceback, counted (``kvmesh_router_errors_total{method}``) and answered
  INTERNAL.
- ``ListWorkers``: the live worker records from etcd.
- :class:`LoadPoller` asks every live worker for ``GetLoad`` every ``period_s`` and feeds
  the core; a worker that does not answer keeps its last report until discovery drops it.
  A round that raises is logged and retried with the Periodic's backoff.
- :class:`Evictor` calls ``core.evict(clock())`` every ``period_s`` (the approx trees),
  with the injected (required) ``clock``. :class:`InflightExpiry` calls
  ``core.expire_in_flight()`` every ``period_s`` and logs a warning with the count (and
  counts them) when it dropped any: a drop means a caller never released; each dropped
  id also goes to ``on_drop`` (the encoder picker's release). The loops are
  :class:`~services.common.periodic.Periodic` tasks, stopped by ``close()``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import grpc
from opentelemetry import trace

from protos import discovery_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.common.block_hash import MmSpan, block_hashes, mm_block_keys, packed_tokens
from services.common.discovery import DECODE_ALONE, routable
from services.common.grpc_client import ChannelPool
from services.common.injected import Clock
from services.common.periodic import Periodic
from services.common.telemetry import leaf_span, may_record, tracer
from services.common.tls import MeshTls
from services.router.admission.core import AdmissionDecision
from services.router.core import RouterCore
from services.router.encoders import EncoderPicker, EncoderRecord
from services.router.metrics import RouterMetrics
from services.router.overlaps import HistorySource, OverlapSource
from services.router.plain import plain_candidates, route_plain
from services.router.plan import (
    AlreadyInFlight,
    InvalidRequest,
    NoWorkers,
    Rejected,
    RoutePlan,
    RoutingError,
    UnknownModel,
    WorkerRecord,
)
from services.router.policies.base import RouteContext, WorkerOverlap

log = logging.getLogger(__name__)

ROLE_NAMES = {
    discovery_pb2.WORKER_ROLE_AGG: "agg",
    discovery_pb2.WORKER_ROLE_PREFILL: "prefill",
    discovery_pb2.WORKER_ROLE_DECODE: "decode",
}
ROLE_ENUM = {v: k for k, v in ROLE_NAMES.items()}


def record_from_proto(rec: discovery_pb2.InstanceRecord) -> WorkerRecord:
    """Discovery record → the core's WorkerRecord."""
    return WorkerRecord(
        instance_id=rec.instance_id, address=rec.address, model=rec.model,
        role=ROLE_NAMES.get(rec.role, "agg"), block_size=rec.block_size,
        max_model_len=rec.max_model_len, handoff_mode=rec.handoff.mode,
        kv_layout=rec.kv_layout, pid=rec.pid, started_at_ms=rec.started_at_ms,
        can_decode_alone=DECODE_ALONE in rec.capabilities,
    )


_ALONE_KIND = {"decode": "decode_alone", "prefill": "prefill_whole"}


def plan_kind(plan: RoutePlan) -> str:
    """``disagg`` (P then D), ``agg`` (an aggregated worker), ``decode_alone`` (D prefills
    itself: conditional disaggregation), or ``prefill_whole`` (P serves it whole)."""
    if plan.prefill is not None:
        return "disagg"
    return _ALONE_KIND.get(plan.worker.role, "agg")


def _set_plan_attributes(span: Any, plan: RoutePlan) -> None:
    """The plan's decision numbers as ``router.route`` span attributes (none on a span
    that does not record)."""
    if not span.is_recording():
        return
    span.set_attribute("kvmesh.worker_id", plan.worker.instance_id)
    span.set_attribute("kvmesh.route_reason", plan.reason)
    span.set_attribute("kvmesh.disaggregated", plan.disaggregated)
    span.set_attribute("kvmesh.overlap_source", plan.overlap_source)
    span.set_attribute("kvmesh.block_size", plan.block_size)
    span.set_attribute("kvmesh.prompt_blocks", plan.prompt_blocks)
    span.set_attribute("kvmesh.predicted_overlap_blocks", plan.overlap_blocks)
    for tier, n in plan.overlap_by_tier.items():
        span.set_attribute(f"kvmesh.predicted_overlap_blocks.{tier}", n)
    if plan.score is not None:
        span.set_attribute("kvmesh.worker_score", plan.score)
    if plan.cost is not None:
        span.set_attribute("kvmesh.worker_cost", plan.cost)
    if plan.prefill is not None:
        span.set_attribute("kvmesh.prefill_worker_id", plan.prefill.instance_id)
        span.set_attribute("kvmesh.predicted_prefill_overlap_blocks",
                           plan.prefill_overlap_blocks)
        for tier, n in plan.prefill_overlap_by_tier.items():
            span.set_attribute(f"kvmesh.predicted_prefill_overlap_blocks.{tier}", n)
        if plan.prefill_score is not None:
            span.set_attribute("kvmesh.prefill_worker_score", plan.prefill_score)
        if plan.prefill_cost is not None:
            span.set_attribute("kvmesh.prefill_worker_cost", plan.prefill_cost)


RETRY_AFTER_KEY = "retry-after"
REASON_KEY = "kvmesh-admission-reason"
# Longest request_id / model / instance_id accepted, and most exclude_instance_ids.
MAX_ID_CHARS = 256
MAX_EXCLUDE = 1024

T = TypeVar("T")


class Refused(Exception):
    """A request answered with a status code (aborted by the servicer in one place)."""

    def __init__(self, code: grpc.StatusCode, message: str,
                 trailing: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.trailing = tuple(trailing)


def _invalid(message: str) -> Refused:
    return Refused(grpc.StatusCode.INVALID_ARGUMENT, message)


def check_id(name: str, value: str) -> None:
    """Raises INVALID_ARGUMENT when the id field ``name`` is empty or too long."""
    if not value:
        raise _invalid(f"{name} is required")
    if len(value) > MAX_ID_CHARS:
        raise _invalid(f"{name} has {len(value)} characters, more than {MAX_ID_CHARS}")


def check_route_request(request: router_pb2.RouteRequest,
                        token_ids: list[int] | None = None) -> tuple[list[int], array[int]]:
    """The checks of a RouteRequest that need no worker (see the module docstring); its
    token ids, as a list (read from the message once: each read of a repeated field
    converts every element) and packed for hashing (:func:`packed_tokens`: the packing is
    the check that no id is negative). ``token_ids``: the prompt, when the caller holds it
    as a list (``request.token_ids`` is then not read)."""
    check_id("request_id", request.request_id)
    check_id("model", request.model)
    if request.max_tokens < 0:
        raise _invalid(f"max_tokens must be >= 0, got {request.max_tokens}")
    tokens: list[int] = request.token_ids[:] if token_ids is None else token_ids
    if not tokens:
        raise _invalid("token_ids must not be empty")
    try:
        packed = packed_tokens(tokens)
    except OverflowError:
        i, bad = next((i, t) for i, t in enumerate(tokens) if not 0 <= t < 1 << 32)
        raise _invalid(f"token_ids must be >= 0, got token_ids[{i}] = {bad}" if bad < 0
                       else f"token_ids[{i}] = {bad} is not a token id") from None
    if len(request.exclude_instance_ids) > MAX_EXCLUDE:
        raise _invalid(f"exclude_instance_ids has {len(request.exclude_instance_ids)} "
                       f"entries, more than {MAX_EXCLUDE}")
    return tokens, packed


def check_mm_items(request: router_pb2.RouteRequest, n_tokens: int) -> list[MmSpan]:
    """The request's images as spans: each names a non-empty mm_hash (at most
    :data:`MAX_ID_CHARS`) and a non-empty range inside the ``n_tokens`` token ids, in
    order, without overlap (INVALID_ARGUMENT naming ``mm_items[i]``)."""
    spans: list[MmSpan] = []
    end = 0
    for i, item in enumerate(request.mm_items):
        field = f"mm_items[{i}]"
        if not item.mm_hash or len(item.mm_hash) > MAX_ID_CHARS:
            raise _invalid(f"{field}.mm_hash must have 1 to {MAX_ID_CHARS} characters")
        if item.length < 1 or item.offset < end or \
                item.offset + item.length > n_tokens:
            raise _invalid(f"{field}: range [{item.offset}, {item.offset + item.length}) "
                           f"must be non-empty, after the previous item (from {end}) and "
                           f"within the {n_tokens} token_ids")
        end = item.offset + item.length
        spans.append(MmSpan(item.mm_hash, item.offset, item.length))
    return spans


def encoder_record(rec: discovery_pb2.InstanceRecord) -> EncoderRecord:
    """Discovery record (component ``encoder``) → the picker's EncoderRecord."""
    return EncoderRecord(rec.instance_id, rec.address, rec.model)


def _no_trees() -> None:
    """No cached-tree sizes (the core falls back to its history's)."""
    return None


def _set_admission_attributes(span: Any, decision: AdmissionDecision | None) -> None:
    if not span.is_recording():
        return
    if decision is None:
        span.set_attribute("kvmesh.admission", "off")
        return
    span.set_attribute("kvmesh.admission", "admit" if decision.admit else "reject")
    span.set_attribute("kvmesh.admission_policy", decision.policy)
    span.set_attribute("kvmesh.admission_reason", decision.reason)
    span.set_attribute("kvmesh.predicted_itl_ms", decision.predicted_itl_ms)
    span.set_attribute("kvmesh.predicted_ttft_ms", decision.predicted_ttft_ms)
    if not decision.admit:
        span.set_attribute("kvmesh.retry_after_s", decision.retry_after_s)


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Serves routing decisions from a RouterCore."""

    def __init__(self, core: RouterCore, records: dict[str, discovery_pb2.InstanceRecord],
                 overlaps: OverlapSource | None = None,
                 metrics: RouterMetrics | None = None,
                 encoders: EncoderPicker | None = None):
        self._core = core
        self._records = records
        self.encoders = encoders or EncoderPicker()
        self._overlaps: OverlapSource = overlaps or HistorySource()
        self._tracer = tracer("router")
        self.metrics = metrics or RouterMetrics(core)
        # instance id → (the WorkerRecord, its WorkerChoice): built once per record
        self._choices: dict[str, tuple[WorkerRecord, router_pb2.WorkerChoice]] = {}

    @property
    def core(self) -> RouterCore:
        """The router's core (tools and tests read it; the servicer owns it)."""
        return self._core

    async def _answer(self, method: str, context: grpc.aio.ServicerContext,
                      fn: Callable[[], Awaitable[T]]) -> T:
        """``await fn()``; a :class:`Refused` aborts with its code, anything else is
        logged, counted and answered INTERNAL (never UNKNOWN)."""
        try:
            return await fn()
        except Refused as exc:
            if exc.trailing:
                await context.abort(exc.code, exc.message, trailing_metadata=exc.trailing)
            await context.abort(exc.code, exc.message)
        except Exception as exc:
            failed = self.failure(method, exc)
            await context.abort(failed.code, failed.message)
        raise AssertionError("context.abort returned")  # pragma: no cover

    def failure(self, method: str, exc: Exception) -> Refused:
        """An exception escaping ``method`` (call from its ``except``): logged with its
        traceback, counted in the errors metric, answered INTERNAL naming it."""
        log.exception("router %s failed", method)
        self.metrics.errors.labels(method).inc()
        return Refused(grpc.StatusCode.INTERNAL,
                       f"router {method} failed: {type(exc).__name__}: {exc}"[:512])

    @property
    def overlap_source(self) -> OverlapSource:
        return self._overlaps

    def set_records(self, records: dict[str, discovery_pb2.InstanceRecord]) -> None:
        """Applies a discovery snapshot."""
        self._records = records
        self._choices.clear()
        # an AFD FFN worker registers as a worker but serves no request: never routed
        self._core.set_workers(record_from_proto(r) for r in records.values() if routable(r))

    def set_encoders(self, records: dict[str, discovery_pb2.InstanceRecord]) -> None:
        """Applies a discovery snapshot of the encoders."""
        self.encoders.set_encoders(encoder_record(r) for r in records.values())

    async def Route(  # noqa: N802
        self, request: router_pb2.RouteRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RouteResponse:
        return await self._answer("Route", context, lambda: self._route(request))

    async def _route(self, request: router_pb2.RouteRequest) -> router_pb2.RouteResponse:
        tokens, packed, spans = self._check_route(request)
        with self._tracer.start_as_current_span("router.route") as span:
            workers, hashes = self._start(span, request, packed, spans)
            overlaps = await self._overlaps.find(hashes, workers) if workers else None
            return self._decide(request, spans, span, tokens, hashes, overlaps)

    def route_now(self, request: router_pb2.RouteRequest, token_ids: list[int] | None = None
                  ) -> router_pb2.RouteResponse | None:
        """Route's answer, computed in this call, when the overlap source answers without
        waiting (``find_now``: an embedded index, or none); else None (call Route).
        Raises :class:`Refused` where Route would abort (an unexpected exception: as
        :meth:`failure` makes it). ``token_ids``: the prompt as a list, when the caller
        holds one (then ``request.token_ids`` is not read and may be left empty; nothing
        changes the list)."""
        find_now = getattr(self._overlaps, "find_now", None)
        if find_now is None:
            return None
        try:
            tokens, packed, spans = self._check_route(request, token_ids)
            if not spans and not request.exclude_instance_ids and not may_record():
                resp = self._route_plain(request, len(tokens), packed, find_now)
                if resp is not None:
                    return resp
            with leaf_span(self._tracer, "router.route") as span:
                workers, hashes = self._start(span, request, packed, spans)
                overlaps = find_now(hashes, workers) if workers else None
                return self._decide(request, spans, span, tokens, hashes, overlaps)
        except Refused:
            raise
        except Exception as exc:
            raise self.failure("Route", exc) from exc

    def _route_plain(self, request: router_pb2.RouteRequest, n: int, tokens: array[int],
                     find_now: Callable[..., dict[str, WorkerOverlap] | None]
                     ) -> router_pb2.RouteResponse | None:
        """The answer of the compact decision (:mod:`services.router.plain`) for a text
        prompt with nothing excluded and no span to record, where it applies; else None
        (nothing done)."""
        plain = plain_candidates(self._core, request.model, n, request.max_tokens)
        if plain is None:
            return None
        workers, block_size = plain
        hashes = block_hashes(tokens, block_size, salt=request.cache_salt)
        overlaps = find_now({block_size: hashes}, workers)
        plan = route_plain(
            self._core, request.request_id, workers, n, request.max_tokens, hashes, overlaps,
            self._overlaps.tree_blocks if overlaps is not None else _no_trees)
        if plan is None:
            return None
        self.metrics.routed(plan_kind(plan))
        return self._response(request, plan, ())

    def _start(self, span: trace.Span, request: router_pb2.RouteRequest,
               tokens: array[int], spans: Sequence[MmSpan]
               ) -> tuple[list[WorkerRecord], dict[int, list[int]]]:
        """Names the ``router.route`` span (what is known before routing); the candidate
        workers with a block size, and the prompt (``tokens``: its packed token ids)
        hashed once per block size (with its images' keys)."""
        if span.is_recording():
            span.set_attribute("kvmesh.request_id", request.request_id)
            span.set_attribute("kvmesh.policy", self._core.policy.name)
            if self._core.prefill_policy is not None:
                span.set_attribute("kvmesh.prefill_policy", self._core.prefill_policy.name)
            span.set_attribute("kvmesh.indexer", self._overlaps.name)
        workers = [w for w in self._core.workers(request.model) if w.block_size > 0]
        hashes = {bs: block_hashes(tokens, bs, salt=request.cache_salt,
                                   mm_keys=mm_block_keys(spans, len(tokens), bs)
                                   if spans else None)
                  for bs in sorted({w.block_size for w in workers})}
        return workers, hashes

    def _check_route(self, request: router_pb2.RouteRequest,
                     token_ids: list[int] | None = None
                     ) -> tuple[list[int], array[int], list[MmSpan]]:
        """The request's checks (Refused naming the field); its token ids (``token_ids``
        when given), packed (see :func:`check_route_request`), and its images' spans."""
        tokens, packed = check_route_request(request, token_ids)
        spans = check_mm_items(request, len(tokens))
        try:
            self._core.check_request(request.model, len(tokens), request.max_tokens)
        except InvalidRequest as exc:
            raise _invalid(str(exc)) from exc
        return tokens, packed, spans

    def _decide(self, request: router_pb2.RouteRequest, spans: Sequence[MmSpan],
                span: trace.Span, tokens: Sequence[int], hashes: Mapping[int, list[int]],
                overlaps: dict[str, WorkerOverlap] | None) -> router_pb2.RouteResponse:
        """The core's plan for the prompt's hashes and the source's overlaps (None → the
        core's history) as a RouteResponse (the ``router.route`` span's attributes set;
        Refused when admission or routing refuses)."""
        if self._overlaps.name != "none" and span.is_recording():
            span.set_attribute("kvmesh.indexer_fallback", overlaps is None)
        ctx = RouteContext(request.request_id, request.model, tokens, overlaps=overlaps,
                           block_hashes=hashes, cache_salt=request.cache_salt,
                           mm_spans=tuple(spans),
                           tree_blocks=self._overlaps.tree_blocks() if overlaps is not None
                           else None)
        try:
            plan = self._core.route(ctx, max_tokens=request.max_tokens,
                                    exclude=request.exclude_instance_ids)
        except Rejected as exc:
            _set_plan_attributes(span, exc.plan)
            _set_admission_attributes(span, exc.decision)
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"overloaded ({exc.decision.reason}): {exc}",
                ((RETRY_AFTER_KEY, f"{exc.decision.retry_after_s:.3f}"),
                 (REASON_KEY, exc.decision.reason))) from exc
        except RoutingError as exc:
            raise Refused(_routing_code(exc), str(exc)) from exc
        _set_plan_attributes(span, plan)
        _set_admission_attributes(span, plan.admission)
        self.metrics.routed(plan_kind(plan))
        return self._response(request, plan, spans)

    def _response(self, request: router_pb2.RouteRequest, plan: RoutePlan,
                  spans: Sequence[MmSpan]) -> router_pb2.RouteResponse:
        """``plan`` as the request's RouteResponse (with its encoder for images)."""
        resp = router_pb2.RouteResponse(
            worker=self._choice(plan.worker), policy=plan.policy, reason=plan.reason,
            disaggregated=plan.disaggregated, predicted_overlap_blocks=plan.overlap_blocks,
            predicted_prefill_overlap_blocks=plan.prefill_overlap_blocks,
            block_size=plan.block_size, overlap_source=plan.overlap_source,
            prompt_blocks=plan.prompt_blocks,
        )
        # item by item: a mapping given to the constructor goes through the Python
        # MutableMapping.update of the map field
        by_tier = resp.predicted_overlap_by_tier
        for tier, blocks in plan.overlap_by_tier.items():
            by_tier[tier] = blocks
        by_tier = resp.predicted_prefill_overlap_by_tier
        for tier, blocks in plan.prefill_overlap_by_tier.items():
            by_tier[tier] = blocks
        if plan.prefill is not None:
            resp.prefill.CopyFrom(self._choice(plan.prefill))
        if spans:
            self._pick_encoder(request, plan.prefill or plan.worker, spans, resp)
        return resp

    def _pick_encoder(self, request: router_pb2.RouteRequest, computes: WorkerRecord,
                      spans: Sequence[MmSpan], resp: router_pb2.RouteResponse) -> None:
        """Sets ``resp.encoder``, or ``resp.encoder_skipped`` (see the module docstring)."""
        rec = self._records.get(computes.instance_id)
        if rec is None or "ec_consumer" not in rec.capabilities:
            resp.encoder_skipped = "not_ec_consumer"
            return
        pick = self.encoders.pick(request.request_id, request.model,
                                  [s.identifier for s in spans], request.exclude_instance_ids)
        if pick is None:
            resp.encoder_skipped = "no_encoder"
            return
        resp.encoder.CopyFrom(router_pb2.EncoderChoice(
            instance_id=pick.encoder.instance_id, address=pick.encoder.address,
            affinity_items=pick.affinity_items))

    def _choice(self, worker: WorkerRecord) -> router_pb2.WorkerChoice:
        """``worker`` as a response names it (with its discovery record's request plane
        and handoff); built once per record (the caller copies it into its response)."""
        hit = self._choices.get(worker.instance_id)
        if hit is not None and hit[0] is worker:
            return hit[1]
        choice = router_pb2.WorkerChoice(
            instance_id=worker.instance_id, address=worker.address,
            role=ROLE_ENUM.get(worker.role, discovery_pb2.WORKER_ROLE_AGG),
        )
        rec = self._records.get(worker.instance_id)
        if rec is not None:
            choice.request_plane_address = rec.request_plane_address
            if rec.HasField("handoff"):
                choice.handoff.CopyFrom(rec.handoff)
        self._choices[worker.instance_id] = (worker, choice)
        return choice

    async def Release(  # noqa: N802
        self, request: router_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ReleaseResponse:
        async def release() -> router_pb2.ReleaseResponse:
            return router_pb2.ReleaseResponse(found=self.release_now(request.request_id))
        return await self._answer("Release", context, release)

    def release_now(self, request_id: str) -> bool:
        """Release's effect, in this call: False for an id the router does not hold;
        raises :class:`Refused` (INVALID_ARGUMENT) for an empty or too long id."""
        check_id("request_id", request_id)
        self.encoders.release(request_id)
        return self._core.release(request_id)

    def prefill_done_now(self, request_id: str) -> bool:
        """PrefillDone's effect, in this call (as :meth:`release_now`)."""
        check_id("request_id", request_id)
        self.encoders.release(request_id)  # its images were encoded by now
        return self._core.release_prefill(request_id)

    async def PrefillDone(  # noqa: N802
        self, request: router_pb2.PrefillDoneRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.PrefillDoneResponse:
        async def done() -> router_pb2.PrefillDoneResponse:
            return router_pb2.PrefillDoneResponse(
                found=self.prefill_done_now(request.request_id))
        return await self._answer("PrefillDone", context, done)

    async def ReportFailure(  # noqa: N802
        self, request: router_pb2.ReportFailureRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ReportFailureResponse:
        async def report() -> router_pb2.ReportFailureResponse:
            check_id("instance_id", request.instance_id)
            wid = request.instance_id
            new = wid not in self._core.unroutable()
            found = self._core.report_failure(wid, request.reason)
            if found:
                self.metrics.failure_reports.inc()
                if new:
                    log.warning("worker %s marked unroutable for up to %.1fs (request %s: %s)",
                                wid, self._core.failure_hold_s, request.request_id or "-",
                                request.reason[:200] or "no reason given")
            return router_pb2.ReportFailureResponse(found=found)
        return await self._answer("ReportFailure", context, report)

    async def ListWorkers(  # noqa: N802
        self, request: router_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListWorkersResponse:
        recs = [r for _, r in sorted(self._records.items())
                if (not request.model or r.model == request.model) and routable(r)]
        return router_pb2.ListWorkersResponse(workers=recs)


def _routing_code(exc: RoutingError) -> grpc.StatusCode:
    """The status code of a core routing error."""
    if isinstance(exc, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, AlreadyInFlight):
        return grpc.StatusCode.ALREADY_EXISTS
    if isinstance(exc, UnknownModel):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, NoWorkers):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.FAILED_PRECONDITION  # incl. Incompatible P/D layouts


# A worker whose GetLoad keeps failing is logged at most this often (seconds).
LOAD_WARN_EVERY_S = 60.0


class LoadPoller:
    """Polls GetLoad on every live worker every ``period_s`` (each call's deadline) and
    feeds the core. A poll that fails (any RPC error, the deadline included) leaves the
    worker's last report in use and is counted in ``metrics.load_poll_failures`` (when
    given); per worker, at most one warning per :data:`LOAD_WARN_EVERY_S` names it, the
    status and the failed polls not logged since the previous one, and after a warning
    the worker's next answer is one info line: never silent, and a worker that fails
    now and then (a deadline missed under load) writes at most two lines a minute."""

    def __init__(self, core: RouterCore, period_s: float, tls: MeshTls | None = None,
                 metrics: RouterMetrics | None = None, clock: Clock = time.monotonic
                 ) -> None:
        self._core = core
        self._period = period_s
        self._metrics = metrics
        self._clock = clock
        self._warned_at: dict[str, float] = {}  # worker id -> its last failure warning
        self._unsaid: dict[str, int] = {}  # worker id -> failed polls since that warning
        self._failing: set[str] = set()  # warned about, and no answer since
        self._pool = ChannelPool(tls, "worker")
        self._loop = Periodic("load-poller", self._poll_all, period_s)

    def start(self) -> None:
        """Starts the polling task (first poll at once)."""
        self._loop.start()

    async def _poll_one(self, worker: WorkerRecord) -> None:
        stub = worker_pb2_grpc.WorkerStub(self._pool.get(worker.address))
        wid = worker.instance_id
        try:
            rep = await stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=self._period)
        except grpc.RpcError as exc:
            if self._metrics is not None:
                self._metrics.load_poll_failures.inc()
            self._failed(worker, exc)
            return
        if wid in self._failing:
            self._failing.discard(wid)
            log.info("worker %s answers GetLoad again", wid)
        self._core.update_load(wid, rep.num_running, rep.num_waiting, rep.kv_usage,
                               rep.kv_total_blocks)

    def _failed(self, worker: WorkerRecord, exc: grpc.RpcError) -> None:
        """Logs a failed poll, at most once per LOAD_WARN_EVERY_S per worker."""
        wid, now = worker.instance_id, self._clock()
        last = self._warned_at.get(wid)
        if last is not None and now - last < LOAD_WARN_EVERY_S:
            self._unsaid[wid] = self._unsaid.get(wid, 0) + 1
            return
        more = self._unsaid.pop(wid, 0)
        self._warned_at[wid] = now
        self._failing.add(wid)
        why = (f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError)
               else f"{type(exc).__name__}: {exc}")
        log.warning("GetLoad on worker %s (%s) failed: %s%s; routing keeps its last load "
                    "report until it answers", wid, worker.address, why,
                    f" ({more} more failed polls since the last warning)" if more else "")

    async def _poll_all(self) -> None:
        workers = self._core.workers()
        live = {w.instance_id for w in workers}
        self._failing &= live
        for gone in set(self._warned_at) - live:
            self._warned_at.pop(gone)
            self._unsaid.pop(gone, None)
        await asyncio.gather(*(self._poll_one(w) for w in workers))
        await self._pool.keep_only({w.address for w in workers})

    async def close(self) -> None:
        """Stops polling and closes channels."""
        await self._loop.stop()
        await self._pool.close()


class Evictor:
    """Calls ``core.evict(clock())`` every ``period_s`` (SGLang evicts every 60 s); the
    first call one period after ``start()``. A failed eviction is logged; the next one
    still comes one period later."""

    def __init__(self, core: RouterCore, period_s: float, clock: Clock) -> None:
        self._core = core
        self._clock = clock
        self._loop = Periodic("router-evictor", self._evict, period_s, delay_first=True,
                              max_backoff_s=period_s)

    def start(self) -> None:
        """Starts the eviction task."""
        self._loop.start()

    async def _evict(self) -> None:
        n = self._core.evict(self._clock())
        if n:
            log.debug("router evicted %d entries", n)

    async def close(self) -> None:
        """Stops the task."""
        await self._loop.stop()


class InflightExpiry:
    """Calls ``core.expire_in_flight()`` every ``period_s`` (first call one period after
    ``start()``); a drop is logged as a warning with the count and counted in
    ``metrics.expired``."""

    def __init__(self, core: RouterCore, period_s: float, metrics: RouterMetrics,
                 on_drop: Callable[[str], object] | None = None) -> None:
        self._core = core
        self._metrics = metrics
        self._on_drop = on_drop  # e.g. the encoder picker's release
        self._loop = Periodic("router-inflight-expiry", self._expire, period_s,
                              delay_first=True, max_backoff_s=period_s)

    def start(self) -> None:
        """Starts the expiry task."""
        self._loop.start()

    async def _expire(self) -> None:
        dropped = self._core.expire_in_flight()
        if self._on_drop is not None:
            for rid in dropped:
                self._on_drop(rid)
        if dropped:
            self._metrics.expired.inc(len(dropped))
            log.warning("router dropped %d in-flight request(s) never released within "
                        "%.0fs (a caller did not call Release), e.g. %s", len(dropped),
                        self._core.inflight_ttl_s, dropped[0][:MAX_ID_CHARS])

    async def close(self) -> None:
        """Stops the task."""
        await self._loop.stop()
