"""The express path of ``POST /v1/completions``: a plain completion served by one
coroutine, from the decoded body to the answer's JSON object, doing what the general path
(:mod:`.openai_schema` → :mod:`.fanout` → :class:`~.pipeline.Pipeline` →
:func:`~.handoff.run_plan` → :mod:`.shapes`) does for such a request and nothing else.

Why: one request every 10 ms (100 req/s without overlap) runs the frontend's code cold
on this machine, and each Python step and object on a request's path costs several µs
there. The general path serves every option through a dozen layers (the parser's field
readers, the fan-out, the pipeline's attempt loop, the plan's state machine, the shapes);
a plain request needs a few of their steps. Measured through the mesh, one request at a
time (``bench.frontend_vs_dynamo.added``): the frontend's added latency ~0.3 ms lower.

Contract:

- :meth:`Express.accept` ``(body)``: the :class:`Plain` request the decoded JSON
  ``body`` holds, else None (nothing done or raised: the general path runs the body and
  answers its 4xx). Plain: an object with no field outside :data:`FIELDS`; ``model`` a
  non-empty string; ``prompt`` a non-empty list of token ids (ints in [0, INT32_MAX]) or
  a non-empty string of at most :data:`~.pipeline.INLINE_PROMPT_CHARS` characters;
  ``stream`` absent, null or false; ``n`` absent, null or 1; ``max_tokens`` absent, null
  or an int in [1, INT32_MAX]; ``temperature`` in [0, 2], ``top_p`` in [0, 1] (ints or
  floats), ``seed`` an int64, ``ignore_eos`` a boolean, each also absent or null. Every
  plain body is one the general parser takes, meaning the same.
- :meth:`Express.run` ``(plain, salt)`` (``salt``: the tenant's cache salt) returns the
  answer's JSON object, exactly what the general path answers (an id of its own); or a
  :class:`Handover` (the general path's consumer reads its chunks: the answer, or the
  error, is then the general path's); or None when it did nothing (the general path
  runs the body from the start): the model has no live worker, a span could record
  (tracing samples: :func:`~services.common.telemetry.records_nothing`), there is no
  router, the prompt is text and the model's tokenizer is not loaded yet, or the prompt
  and ``max_tokens`` overflow the context.
  It raises the ApiError the general path raises for a Route refusal (counted alike).
- What it does is the general path's, step for step: the prompt tokenized as
  ``Pipeline.prepare`` tokenizes it (inline when no other request is being prepared or
  streamed, else on the encode thread), the model's EOS ids loaded before the Route (a
  request waits while the tokenizer loads, as there: the loading thread would otherwise
  slow it, and those after it, for as long as it runs), the Route
  (:mod:`.router_calls`), the worker's GenerateRequest and its call
  (``Pipeline.worker_call``: :func:`~.handoff.generate`), ``PrefillDone``
  at the first tokens of an unfinished answer, the TTFT and ITL samples, the finished
  request's teardown one loop turn after the answer went out (the call ended, the entry
  released, the cache-prediction, usage and outcome metrics: as ``close_later``); a
  cancelled request (the client gone) ends its call, releases its entry (a gRPC
  Release awaited, shielded, as there) and counts ``outcome="cancelled"``.
  ``tests/unit/test_express.py`` holds the answers, worker requests, router calls and
  metrics equal to the general path's.
- Hand-overs, where the general path goes on (:class:`~.jobs.Prior`): a route that is
  not aggregated (attempt 0 runs as routed), and a failed worker call (stopped without
  finishing, or an error; its entry released first): the general stream goes on as after
  that failure (a migration, or the failure's error), after the chunks that came before.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, NamedTuple

from protos import common_pb2, router_pb2, worker_pb2
from services.common.telemetry import records_nothing
from services.frontend.context_window import check_context
from services.frontend.failures import worker_failure
from services.frontend.fanout import FanJob
from services.frontend.handoff import plan_error, rpc_reason
from services.frontend.jobs import (
    FINISH_NAMES,
    Chunk,
    Job,
    Prior,
    predicted_cached_tokens,
    sampling_proto,
)
from services.frontend.models import ModelInfo
from services.frontend.openai_schema import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    parse_completion,
    with_tenant,
)
from services.frontend.pipeline import INLINE_PROMPT_CHARS, UNFINISHED, Pipeline

log = logging.getLogger(__name__)

# The fields of a plain completion body (the general parser's common ones).
FIELDS = frozenset({"model", "prompt", "max_tokens", "temperature", "top_p", "seed",
                    "ignore_eos", "stream", "n"})


class Plain(NamedTuple):
    """A plain completion (see the module docstring); ``prompt``: token ids or text."""

    model: str
    prompt: list[int] | str
    max_tokens: int
    temperature: float | None
    top_p: float | None
    seed: int | None
    ignore_eos: bool
    body: dict[str, Any]  # for a hand-over: the general parser's request


class Handover(NamedTuple):
    """What the general path's consumer reads: the request (one job, one choice) and its
    chunks, tagged with their choice's index (0), as :func:`.fanout.run` gives them."""

    fan: FanJob
    chunks: AsyncIterator[tuple[int, Chunk]]


def _number(body: dict[str, Any], name: str, hi: float) -> float | None | bool:
    """``body[name]`` as a float in [0, ``hi``], None when absent or null; False when it
    is not such a number."""
    v = body.get(name)
    if v is None:
        return None
    t = type(v)
    if (t is not float and t is not int) or not 0.0 <= v <= hi:
        return False
    return float(v)


class Express:
    """The express path of one pipeline's completions (see the module docstring)."""

    def __init__(self, pipeline: Pipeline) -> None:
        self._p = pipeline
        # the worker's sampling parameters of a body with only model and prompt: the
        # general path's own (every field a plain body does not set)
        self._template = _template()

    def accept(self, body: Any) -> Plain | None:
        """See the module docstring."""
        if type(body) is not dict or not body.keys() <= FIELDS:
            return None
        model, prompt = body.get("model"), body.get("prompt")
        if type(model) is not str or not model:
            return None
        if type(prompt) is list:
            if not prompt or set(map(type, prompt)) != {int} or min(prompt) < 0 \
                    or max(prompt) > INT32_MAX:
                return None
        elif type(prompt) is not str or not prompt or len(prompt) > INLINE_PROMPT_CHARS:
            return None
        stream, n, max_tokens = body.get("stream"), body.get("n"), body.get("max_tokens")
        if (stream is not None and stream is not False) or (n is not None and (
                type(n) is not int or n != 1)):
            return None
        if max_tokens is None:
            max_tokens = self._template.max_tokens  # the general parser's default
        elif type(max_tokens) is not int or not 0 < max_tokens <= INT32_MAX:
            return None
        temperature, top_p = _number(body, "temperature", 2.0), _number(body, "top_p", 1.0)
        seed, ignore_eos = body.get("seed"), body.get("ignore_eos")
        if (temperature is False or top_p is False
                or (seed is not None and (type(seed) is not int
                                          or not INT64_MIN <= seed <= INT64_MAX))
                or (ignore_eos is not None and type(ignore_eos) is not bool)):
            return None
        return Plain(model, prompt, max_tokens, temperature, top_p,  # type: ignore[arg-type]
                     seed, bool(ignore_eos), body)

    def sampling(self, plain: Plain) -> common_pb2.SamplingParams:
        """The worker's sampling parameters of ``plain`` (the general path's)."""
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(self._template)
        sampling.max_tokens = plain.max_tokens
        if plain.temperature is not None:
            sampling.temperature = plain.temperature
        if plain.top_p is not None:
            sampling.top_p = plain.top_p
        if plain.seed is not None:
            sampling.seed = plain.seed
        if plain.ignore_eos:
            sampling.ignore_eos = True
        return sampling

    async def run(self, plain: Plain, salt: str) -> dict[str, Any] | Handover | None:
        """See the module docstring."""
        p = self._p
        info = p.catalog.get(plain.model)
        if info is None or not records_nothing():
            return None
        router = p.routing.stub()
        if router is None:
            return None
        prompt = plain.prompt
        if type(prompt) is str:
            tok = p.catalog.loaded_tokenizer(info)
            if tok is None:
                return None
            if p.busy:  # others wait on this loop: encode on the encode thread
                p.busy += 1
                try:
                    ids = await tok.encode_off_loop(prompt, True)
                finally:
                    p.busy -= 1
            else:
                ids = tok.encode(prompt, True)
        else:
            ids = prompt  # type: ignore[assignment]
        n, limit, max_tokens = len(ids), info.max_model_len, plain.max_tokens
        if n >= limit or n + max_tokens > limit:
            return None  # the general path's 400
        rid = os.urandom(16).hex()
        created = int(time.time())
        p.busy += 1  # as the general path's stream
        started = time.monotonic()
        try:
            if p.first_token_from_prefill and p.catalog.loaded_tokenizer(info) is None:
                await p.catalog.eos_token_ids(info)  # as the general path's stream
            route = await p.routing.route(router, router_pb2.RouteRequest(
                request_id=rid, model=plain.model, max_tokens=max_tokens, cache_salt=salt),
                ids, None)
        except BaseException as exc:
            p.busy -= 1
            if getattr(exc, "type", None) != "overloaded_error":  # else counted a rejection
                self._count("none", exc)
            raise
        if route.disaggregated:  # P/D: the general path runs attempt 0 as routed
            p.busy -= 1
            job = self._job(plain, info, salt, rid, ids, created)
            return _handover(job, [], p.stream(job, None, Prior(
                rid, route, router=router, started=started, last_at=started)))
        texts: list[str] = []
        tokens: list[int] = []
        done: list[Chunk] = []  # the chunks before a failure (a hand-over's first)
        last_at = started
        chunked = False
        call = None
        try:
            call = p.worker_call(route.worker, worker_pb2.GenerateRequest(
                request_id=rid, token_ids=ids, sampling=self.sampling(plain),
                model=plain.model, cache_salt=salt, whole=True))
            it = call.__aiter__()
            while True:
                try:
                    resp = await it.__anext__()
                except StopAsyncIteration:
                    reason = ("ended the stream without finishing" if chunked
                              else "ended the stream without output")
                    failed = plan_error(route, "agg", reason)
                    break
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # every failure of the call: the general path's
                    failed = plan_error(route, "agg", rpc_reason(exc), exc)
                    break
                chunked = True
                if resp.token_ids:
                    now = time.monotonic()
                    if not tokens:
                        if resp.finish_reason == UNFINISHED:  # else the Release frees it
                            p.routing.prefill_done(router, rid)
                        p.metrics.child(p.metrics.ttft, "agg").observe(now - started)
                    else:
                        p.metrics.observe_chunk_gap(now - last_at, len(resp.token_ids))
                    last_at = now
                    tokens.extend(resp.token_ids)
                texts.append(resp.text)
                if resp.finish_reason != UNFINISHED:
                    answer = self._answer(plain.model, rid, created, texts, resp)
                    p.later(self._teardown, router, rid, call, route, resp, info.block_size)
                    return answer
                done.append(Chunk(resp.text, list(resp.token_ids)))
        except BaseException as exc:  # cancelled (the client went): ended and released
            await self._ended(router, rid, call, exc)
            raise
        ending = self._end(router, rid, call)
        if ending is not None:  # released before the next attempt or the error, as there
            try:
                await asyncio.shield(ending)
            except BaseException as exc:
                p.busy -= 1
                self._count("agg", exc)
                raise
        p.busy -= 1
        job = self._job(plain, info, salt, rid, ids, created)
        prior = Prior(rid, route, worker_failure(failed, route), failed, tuple(tokens),
                      started, last_at, router)
        return _handover(job, done, p.stream(job, None, prior))

    @staticmethod
    def _job(plain: Plain, info: ModelInfo, salt: str, rid: str, ids: list[int],
             created: int) -> Job:
        """The job ``Pipeline.prepare`` makes of the body (the express path's id, the
        model as it was when the request began)."""
        req = with_tenant(parse_completion(plain.body), salt)
        req = check_context(req, len(ids), info.max_model_len)
        return Job(rid, req, info, list(ids), created, req.cache_salt)

    def _count(self, path: str, exc: BaseException) -> None:
        """A request that ended in ``exc`` on ``path``: its outcome counted."""
        m = self._p.metrics
        m.child(m.requests, path, "error" if isinstance(exc, Exception)
                else "cancelled").inc()

    async def _ended(self, router: Any, rid: str, call: Any, exc: BaseException) -> None:
        """An attempt ``exc`` ended (a cancel: the client went): its call ended, its entry
        released (awaited, shielded, as the general path's), counted, not busy."""
        try:
            ending = self._end(router, rid, call)
            if ending is not None:
                await asyncio.shield(ending)
        finally:
            self._p.busy -= 1
            self._count("agg", exc)

    def _end(self, router: Any, rid: str, call: Any) -> asyncio.Future[None] | None:
        """The attempt's call ended (``call``: None when it was never made) and its entry
        released (:meth:`~.router_calls.RouterCalls.release_soon`: the task, if any)."""
        if call is not None:
            call.cancel()  # a no-op once the call has ended
        return self._p.routing.release_soon(router, rid)

    def _teardown(self, router: Any, rid: str, call: Any, route: router_pb2.RouteResponse,
                  last: worker_pb2.GenerateResponse, block_size: int) -> None:
        """A finished request's teardown (after its answer went out)."""
        try:
            self._p.busy -= 1
            self._end(router, rid, call)
            m = self._p.metrics
            prompt = last.usage.prompt_tokens
            m.observe_cache_prediction("agg", route.overlap_source or "history",
                                       predicted_cached_tokens(route, block_size),
                                       min(last.usage.cached_tokens, prompt))
            m.observe_usage(prompt, last.usage.completion_tokens)
            m.child(m.requests, "agg", FINISH_NAMES.get(last.finish_reason, "stop")).inc()
        except Exception:
            log.exception("the teardown of request %s failed", rid)

    @staticmethod
    def _answer(model: str, rid: str, created: int, texts: Sequence[str],
                last: worker_pb2.GenerateResponse) -> dict[str, Any]:
        """The answer's JSON object, as :meth:`.shapes.Shapes.full` shapes it."""
        usage = last.usage
        prompt, completion = usage.prompt_tokens, usage.completion_tokens
        return {"id": "cmpl-" + rid, "object": "text_completion", "created": created,
                "model": model, "choices": [{
                    "index": 0, "text": texts[0] if len(texts) == 1 else "".join(texts),
                    "logprobs": None,
                    "finish_reason": FINISH_NAMES.get(last.finish_reason, "stop")}],
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion, "prompt_tokens_details": {
                              "cached_tokens": min(usage.cached_tokens, prompt)}}}


def _template() -> common_pb2.SamplingParams:
    """The general path's sampling parameters of a body with only model and prompt."""
    req = parse_completion({"model": "m", "prompt": [1]})
    return sampling_proto(Job("t", req, None, [1], 0))  # type: ignore[arg-type]


def _handover(job: Job, first: list[Chunk], then: AsyncIterator[Chunk]) -> Handover:
    """The hand-over of ``job``: ``first``'s chunks, then ``then``'s."""
    return Handover(FanJob(job.request_id, job.req, [job], [job], job.created),
                    _chained(first, then))


async def _chained(first: list[Chunk], then: AsyncIterator[Chunk]
                   ) -> AsyncIterator[tuple[int, Chunk]]:
    """``first``'s chunks, then ``then``'s (closed with it), as choice 0's."""
    try:
        for chunk in first:
            yield 0, chunk
        async for chunk in then:
            yield 0, chunk
    finally:
        await then.aclose()  # type: ignore[attr-defined]
