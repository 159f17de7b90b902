"""Running one request on the worker(s) the router chose: aggregated, or P → D.

Contract of :func:`run_plan` (an async iterator of ``worker_pb2.GenerateResponse``):

- Aggregated plan: one ``Generate`` call on the chosen worker, streamed through.
- Disaggregated plan, ``pull`` handoff (vLLM NixlConnector): P runs the prompt with
  ``max_tokens=1`` and ``do_remote_decode``; its last chunk carries the handoff parameters
  (engine id, block ids, side channel) and is acted on when it comes (P's call is then
  cancelled, not waited on for its trailers); D is then called with them (``do_remote_prefill``)
  and READs the blocks it does not hold, and its tokens are streamed through. P keeps its
  blocks until D has read them (or its lease expires).
- Disaggregated plan, ``push`` handoff (vLLM NixlPushConnector): D is called first with P's
  coordinates from discovery and the same request id, P at the same time; D registers its
  receive blocks and P WRITEs into them when its prefill is done. Either may be ready first.
  Until D's first output a P failure ends the request, and D waits for P's push at most
  ``PUSH_TIMEOUT_S``; after it a P failure is only logged (warning). D's finish chunk is
  passed on once P has reported (so it carries P's hits), at most ``PUSH_TIMEOUT_S`` later.
- Disaggregated plan, ``sglang`` handoff (SGLang's bootstrap handshake): run as ``push``
  (D and P at the same time, the same request id, P's bootstrap host/port from discovery
  as D's ``remote_host``/``remote_port``, ``transfer_mode`` "push" on the wire); both
  engines derive the same ``bootstrap_room`` from the request id. P gets the same
  sampling as D (but :data:`D_DROPPED`) and keeps its ``max_tokens``: SGLang's D
  continues from the first token P sampled, which P sends with the KV.
- **P's token first** (pull; :func:`p_token_first`): when the request's sampling does not
  depend on anything P does not see (no grammar, logprobs, biases, penalties on the output,
  ``min_tokens``, bad or allowed words, stop strings or images, no seed with a temperature,
  ``max_tokens`` ≥ 2) and the model's EOS ids are known (``Request.first_token_stops``),
  the one token P sampled goes out at once as the first chunk (text as P's detokenizer
  spelled it), and D is called with prompt + that token and ``max_tokens`` − 1: D loads
  the prompt's KV (capped at P's ``remote_num_tokens``, :mod:`workers.kv.nixl_quiet`)
  and its first step computes the second token instead of recomputing the first. The
  client's TTFT is then P's. Not when P's token is an EOS (unless ``ignore_eos``) or a
  stop token id, spells no text or an incomplete character, P held KV for another count
  of tokens than the prompt, or P sent more than one token: then D recomputes as below.
  D's finish chunk is counted as the client sees it (prompt − 1, completion + 1), as
  after a migration. Push-like modes never do this (D is called before P's token exists).
- Sampling (P/D): P's request drops :data:`P_DROPPED` (``structured``, ``logprobs``,
  ``logit_bias``, ``min_tokens``, ``bad_words``, ``allowed_token_ids``, ``stop``,
  ``stop_token_ids``): P's one token
  is discarded and D generates every output token from the prompt's KV (recomputing
  the last prompt token), so grammar state, logprobs, biases and penalties all start
  on D and equal the aggregated run's.
  P keeps the rest (its prefix hashes and block keys do not depend on sampling). D gets
  the full sampling but ``prompt_logprobs`` (:data:`D_DROPPED`: D computes no prompt
  position); P computes them and they go out on the first chunk of the stream, as from
  an aggregated worker (push: D's first chunk waits until P has settled, so a P that
  fails, even after its WRITE, fails the request at P's stage before any chunk went
  out). A P that settled without them (none came on its stream) is a
  :class:`HandoffError` of stage ``prefill`` (no code) when D's first chunk is due: the
  pipeline treats it as any P failure (migration), never a chunk without them.
- Every failure of a worker call raises :class:`HandoffError` (never a raw gRPC error, never
  a silent half result): a gRPC error, a stream that ends without output or without a
  finish chunk, P without handoff parameters (pull) or without the prompt logprobs asked
  for, no first output from D within ``PUSH_TIMEOUT_S`` (push; stage ``timeout``, named
  after D). See its attributes.
- Cancelling or closing the iterator cancels every call in flight, which aborts the request
  on those workers; when the iterator is over (finished, failed or closed) no task of it is
  left running.
- ``usage.cached_tokens`` of a disaggregated request are P's prefix hits (what was not
  computed; 0 when P never reported, push only); D's own count, which includes the KV it
  received, goes to the spans.
- Spans: ``prefill`` (P call), ``kv_transfer`` (D call until its first token: the READ or
  WRITE plus D's first step) and ``decode`` (the rest), with mode, P-hit and D-hit tokens
  and the number of blocks P held for D, next to the router's predictions
  (``kvmesh.predicted_cached_tokens`` on ``prefill`` for P, ``kvmesh.predicted_d_cached_tokens``
  on ``kv_transfer`` for D; 0 when the router does not send its block size).

EPD: a request's ``images`` (data and mm_hash) go on every GenerateRequest (agg, P and
D), E's ``embeddings`` only to the worker that computes the prompt (agg, or P: E/PD,
E/P/D). D gets the prompt's KV from P and recomputes only its last token, which is text,
so it never runs the vision encoder and needs no embedding; it still needs each image,
for vLLM's processor (its prompt update expands the image marker into the placeholder
tokens), and its mm_hash, which vLLM puts into D's block hashes: D's prefix-cache keys
then equal P's and the router's, and another image behind the same text is no false hit
on D (:mod:`workers.main`; tested in ``tests/integration/test_epd_mesh.py``).

The order of events is decided by the pure :class:`~services.frontend.handoff_machine.
HandoffMachine`; this module is its driver: one task per call (and one for the push timer)
feeds the call's outcomes into one queue of events, and the machine's effects are executed
here. D's chunks are queued as they come (at most ``max_tokens`` of them). An aggregated
plan has one call and no timer: it is read in the consumer's task and each outcome is fed
to the machine directly, without a task or a queue.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from protos import common_pb2, encoder_pb2, router_pb2, worker_pb2, worker_pb2_grpc
from services.common.grpc_client import ChannelPool
from services.common.kv_params import held_blocks, is_set
from services.common.telemetry import tracer
from services.frontend import handoff_machine as hm
from services.frontend.metrics import FrontendMetrics
from services.frontend.worker_stream import WorkerStreams

log = logging.getLogger(__name__)

WORKER_TIMEOUT_S = 600.0
# How long D may wait for P's push before the orchestrator gives up and aborts D.
PUSH_TIMEOUT_S = 120.0
# Handoff modes run as push: D and P called at the same time (see the module docstring).
PUSH_LIKE = ("push", "sglang")


class HandoffError(Exception):
    """A worker call of the plan failed; maps to 502 unless ``code`` says otherwise.

    ``stage``: "agg", "prefill", "decode" or "timeout" (push: no first output from D in
    time; ``instance_id``/``address`` are D's). ``code``: the gRPC status when a call
    failed, else None; the call's AioRpcError, if any, is ``__cause__``.
    """

    def __init__(self, message: str, *, stage: str, instance_id: str, address: str,
                 code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.stage = stage
        self.instance_id = instance_id
        self.address = address
        self.code = code


@dataclass
class Request:
    """What to run: ids, prompt and sampling."""

    request_id: str
    model: str
    token_ids: list[int]
    sampling: common_pb2.SamplingParams
    cache_salt: str = ""  # the tenant's prefix-cache salt, sent on every GenerateRequest
    # EPD: the images (every worker that runs the prompt gets them: vLLM's prompt update
    # needs them) and E's embeddings (only the worker that prefills reads them).
    images: Sequence[worker_pb2.ImageItem] = ()
    embeddings: Sequence[encoder_pb2.EmbeddingDescriptor] = ()
    # The model's EOS ids (the tokenizer's and generation_config's); None: unknown, and
    # P's token is never sent as the first token (see p_token_first).
    first_token_stops: frozenset[int] | None = None
    # The client reads the answer whole (GenerateRequest.whole): workers send the first
    # tokens at once and hold the rest for their last message.
    whole: bool = False
    stream_interval: int = 0  # GenerateRequest.stream_interval (vLLM's); 0: the worker's

    def generate_request(self, *, embeddings: bool = True,
                         sampling: common_pb2.SamplingParams | None = None
                         ) -> worker_pb2.GenerateRequest:
        """The worker's GenerateRequest of this request (``embeddings``: with E's)."""
        return worker_pb2.GenerateRequest(
            request_id=self.request_id, token_ids=self.token_ids,
            sampling=sampling if sampling is not None else self.sampling, model=self.model,
            cache_salt=self.cache_salt, images=list(self.images),
            embeddings=list(self.embeddings) if embeddings else [], whole=self.whole,
            stream_interval=self.stream_interval)


def _finished(resp: worker_pb2.GenerateResponse) -> bool:
    return resp.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED


# Sampling fields P never gets: its one token is discarded (D generates every output token
# from the prompt's KV, so grammar state, logprobs and biases start on D) or checked by the
# frontend (p_token_first), min_tokens would exceed P's max_tokens=1, and a stop token or
# string would end P "stopped", not length-capped, so that vLLM's P would hand no KV over.
P_DROPPED = ("structured", "logprobs", "logit_bias", "min_tokens", "bad_words",
             "allowed_token_ids", "stop", "stop_token_ids")
# ... and D never gets: D loads the prompt's KV and computes no prompt position (P does).
D_DROPPED = ("prompt_logprobs",)


def p_token_first(req: Request) -> bool:
    """Whether P's sampled token may be the request's first token (pull), as far as the
    request says; see the module docstring. The token itself is checked when it comes."""
    s = req.sampling
    if req.first_token_stops is None or req.images or s.max_tokens < 2:
        return False
    if (s.HasField("structured") or s.HasField("logprobs") or s.logit_bias or s.min_tokens
            or s.bad_words or s.allowed_token_ids or s.stop
            or s.presence_penalty or s.frequency_penalty):
        return False
    # a seeded sampler's state after one draw cannot be carried from P to D
    return not (s.HasField("seed") and (not s.HasField("temperature") or s.temperature > 0))


def _first_chunk(req: Request, tokens: Sequence[int], text: str,
                 last: worker_pb2.GenerateResponse) -> worker_pb2.GenerateResponse | None:
    """The chunk of P's token when it goes out first (``p_token_first`` holds), else None."""
    stops = set(req.sampling.stop_token_ids)
    if not req.sampling.ignore_eos:
        stops |= req.first_token_stops or frozenset()
    held = last.kv_transfer
    if (len(tokens) != 1 or tokens[0] in stops or not text or text.endswith("\ufffd")
            or (held.HasField("remote_num_tokens")
                and held.remote_num_tokens != len(req.token_ids))):
        return None
    return worker_pb2.GenerateResponse(token_ids=tokens, text=text,
                                       worker_id=last.worker_id)


def _sampling_without(req: Request, names: Sequence[str]) -> common_pb2.SamplingParams:
    sampling = common_pb2.SamplingParams()
    sampling.CopyFrom(req.sampling)
    for name in names:
        sampling.ClearField(name)
    return sampling


def _prefill_request(req: Request, mode: str) -> worker_pb2.GenerateRequest:
    """P runs the prompt with max_tokens=1 and answers with handoff parameters; see
    :data:`P_DROPPED` (sglang: the D request's sampling, see the module docstring)."""
    if mode == "sglang":
        p_req = req.generate_request(sampling=_sampling_without(req, D_DROPPED))
        p_req.kv_transfer.do_remote_decode = True
        p_req.kv_transfer.transfer_mode = "push"
        return p_req
    sampling = _sampling_without(req, P_DROPPED)
    sampling.max_tokens = 1
    sampling.ignore_eos = True
    p_req = req.generate_request(sampling=sampling)
    p_req.kv_transfer.do_remote_decode = True
    if mode == "push":
        p_req.kv_transfer.transfer_mode = "push"
    return p_req


def _decode_request(req: Request, params: worker_pb2.KvTransferParams,
                    p_token: int | None = None) -> worker_pb2.GenerateRequest:
    # D gets the prompt's KV from P, and the full sampling but D_DROPPED; with p_token
    # (P's token went out first) it continues from prompt + p_token
    d_req = req.generate_request(embeddings=False,
                                 sampling=_sampling_without(req, D_DROPPED))
    if p_token is not None:
        d_req.token_ids.append(p_token)
        d_req.sampling.max_tokens -= 1
    d_req.kv_transfer.CopyFrom(params)
    d_req.kv_transfer.do_remote_prefill = True
    d_req.kv_transfer.do_remote_decode = False
    # P's own prefix hit would otherwise be reported as D's cached tokens.
    d_req.kv_transfer.ClearField("remote_prefill_cached_tokens")
    return d_req


def _push_params(req: Request, route: router_pb2.RouteResponse) -> worker_pb2.KvTransferParams:
    """Push: D gets P's coordinates from discovery and the request id P will push under."""
    hand = route.prefill.handoff
    return worker_pb2.KvTransferParams(
        remote_engine_id=hand.engine_id, remote_request_id=req.request_id,
        remote_host=hand.side_channel_host, remote_port=hand.side_channel_port,
        tp_size=hand.tp_size or 1, transfer_mode="push")


def _predicted_tokens(route: router_pb2.RouteResponse, prefill: bool) -> int:
    """The router's predicted cached tokens on P (``prefill``) or D."""
    blocks = (route.predicted_prefill_overlap_blocks if prefill
              else route.predicted_overlap_blocks)
    return blocks * route.block_size


def rpc_reason(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"failed: {exc.code().name}: {exc.details()}"
    return f"failed: {type(exc).__name__}: {exc}"


class _Run:
    """One :func:`run_plan`: the machine, the tasks it started and (P/D) its event
    queue."""

    # P/D only (an aggregated run reads its one call in the consumer's task: neither)
    events: asyncio.Queue[hm.Event]
    p_settled: asyncio.Event

    def __init__(self, pool: ChannelPool, req: Request, route: router_pb2.RouteResponse,
                 metrics: FrontendMetrics, streams: WorkerStreams | None = None) -> None:
        self.pool, self.req, self.route, self.metrics = pool, req, route, metrics
        self.streams = streams
        # The mode as the spans and metrics label it (a mock P says "mock": pull-like).
        self.mode = (route.prefill.handoff.mode or "pull") if route.disaggregated else "agg"
        self.machine = hm.HandoffMachine(
            "push" if self.mode in PUSH_LIKE else "agg" if self.mode == "agg" else "pull")
        if self.mode != "agg":
            self.events = asyncio.Queue()
            self.p_settled = asyncio.Event()
        # Prompt logprobs: P computes them (D loads the prompt's KV), the client gets them
        # on the first chunk; push holds D's first chunk until P has settled.
        self.want_prompt_logprobs = (route.disaggregated
                                     and req.sampling.HasField("prompt_logprobs"))
        self.p_prompt_logprobs: list[common_pb2.PositionLogprobs] = []
        self.p_token: int | None = None  # P's token went out first: D continues after it
        self.first_out = True
        self.tasks: dict[str, asyncio.Task[None]] = {}  # the latest of each name
        self.started: list[asyncio.Task[None]] = []  # all, re-armed timers included

    def responses(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        """The run's responses: an async generator (closing it ends the run's calls)."""
        return self._agg_responses() if self.mode == "agg" else self._pd_responses()

    async def _pd_responses(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        """P/D: the machine's effects, its events from the call tasks' queue."""
        effects = self.machine.start()
        try:
            while True:
                for effect in effects:
                    if isinstance(effect, hm.EmitChunk):
                        yield self._outgoing(effect)
                    else:
                        self._execute(effect)
                if self.machine.terminal is not None:
                    break
                effects = self.machine.handle(await self.events.get())
        finally:
            if self.machine.terminal is None:  # closed or cancelled by the consumer
                for effect in self.machine.handle(hm.Cancel()):
                    self._execute(effect)
            await self._settle()
        if isinstance(self.machine.terminal, hm.Fail):
            raise self._error(self.machine.terminal)

    async def _agg_responses(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        """Aggregated: the one call is read in the consumer's own task, each outcome fed
        to the machine as it comes (no call task, no event queue: the same effects and
        errors, one hop less per chunk)."""
        machine = self.machine
        machine.start()  # StartDecode(None): the call below
        call = self._generate(self.route.worker, self.req.generate_request())
        try:
            it = call.__aiter__()
            while machine.terminal is None:
                event: hm.Event
                try:
                    resp = await it.__anext__()
                except StopAsyncIteration:
                    event = hm.DecodeEnded()
                except Exception as exc:  # every failure becomes an event
                    event = hm.DecodeFailed(rpc_reason(exc), exc)
                else:
                    event = hm.DecodeChunk(resp, _finished(resp))
                for effect in machine.handle(event):
                    if isinstance(effect, hm.EmitChunk):
                        yield effect.chunk  # type: ignore[misc]
                    elif isinstance(effect, hm.Warn):
                        self._execute(effect)
                    # CancelDecode: the finally below; Done and Fail end the loop
        finally:
            call.cancel()  # a no-op once the call has ended
            if machine.terminal is None:  # closed or cancelled by the consumer
                machine.handle(hm.Cancel())
        if isinstance(machine.terminal, hm.Fail):
            raise self._error(machine.terminal)

    # effects ------------------------------------------------------------------------

    def _spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro, name=f"{name}:{self.req.request_id}")
        self.tasks[name] = task
        self.started.append(task)

    def _cancel(self, name: str) -> None:
        task = self.tasks.get(name)
        if task is not None:
            task.cancel()

    def _execute(self, effect: hm.Effect) -> None:
        if isinstance(effect, hm.StartPrefill):
            self._spawn("prefill", self._prefill())
        elif isinstance(effect, hm.StartDecode):
            self._spawn("decode", self._decode(effect.prefill))
        elif isinstance(effect, hm.CancelPrefill):
            self._cancel("prefill")
        elif isinstance(effect, hm.CancelDecode):
            self._cancel("decode")
        elif isinstance(effect, hm.ArmTimeout):
            self._cancel("timer")
            self._spawn("timer", self._timer(effect.generation))
        elif isinstance(effect, hm.DisarmTimeout):
            self._cancel("timer")
        elif isinstance(effect, hm.Warn):
            p = self.route.prefill
            log.warning("request %s: %s (prefill worker %s at %s, decode worker %s)",
                        self.req.request_id, effect.message, p.instance_id, p.address,
                        self.route.worker.instance_id)
        # EmitChunk is yielded by responses(); Done, Cancelled and Fail end its loop.

    async def _settle(self) -> None:
        """Waits for every task (all are ended or cancelled by now); logs any that failed,
        which would be a bug here: the call tasks turn every outcome into an event."""
        for task in self.started:
            if not task.done():
                task.cancel()
        results = await asyncio.gather(*self.started, return_exceptions=True)
        for task, result in zip(self.started, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(
                    result, asyncio.CancelledError):
                log.error("task %s failed", task.get_name(), exc_info=result)

    def _outgoing(self, effect: hm.EmitChunk) -> worker_pb2.GenerateResponse:
        resp: worker_pb2.GenerateResponse = effect.chunk  # type: ignore[assignment]
        if self.first_out and self.want_prompt_logprobs:
            if not self.p_prompt_logprobs:  # P settled without them: P's failure
                p = self.route.prefill
                raise HandoffError(f"prefill worker {p.instance_id} ({p.address}) returned "
                                   "no prompt logprobs", stage="prefill",
                                   instance_id=p.instance_id, address=p.address)
            resp.prompt_logprobs.extend(self.p_prompt_logprobs)
        self.first_out = False
        if self.p_token is not None and _finished(resp):  # D's prompt held P's token
            resp.usage.prompt_tokens -= 1
            resp.usage.completion_tokens += 1
        if self.mode != "agg" and _finished(resp):
            # The client's cached_tokens are the prompt tokens nobody had to compute: P's
            # prefix hits. D's count (with the KV it received) stays in the decode span.
            p_last = effect.prefill
            resp.usage.cached_tokens = (p_last.usage.cached_tokens  # type: ignore[attr-defined]
                                        if p_last is not None else 0)
        return resp

    def _error(self, fail: hm.Fail) -> HandoffError:
        return plan_error(self.route, fail.stage, fail.reason, fail.error)

    # tasks: each turns one call's outcome into events ---------------------------------

    async def _timer(self, generation: int) -> None:
        await asyncio.sleep(PUSH_TIMEOUT_S)  # a timer, not synchronisation
        self.events.put_nowait(hm.Timeout(generation))

    def _generate(self, choice: router_pb2.WorkerChoice,
                  request: worker_pb2.GenerateRequest) -> Any:
        return generate(self.pool, self.streams, choice, request)

    async def _prefill(self) -> None:
        choice, mode = self.route.prefill, self.mode
        start = time.monotonic()
        event: hm.Event
        try:
            with tracer("frontend").start_as_current_span("prefill", attributes={
                    "kvmesh.prefill_worker_id": choice.instance_id,
                    "kvmesh.handoff_mode": mode,
                    "kvmesh.predicted_cached_tokens": _predicted_tokens(self.route, True),
            }) as span:
                call = self._generate(choice, _prefill_request(self.req, mode))
                last: worker_pb2.GenerateResponse | None = None
                tokens: list[int] = []
                text: list[str] = []
                try:
                    async for resp in call:
                        last = resp
                        tokens += resp.token_ids
                        text.append(resp.text)
                        if resp.prompt_logprobs and not self.p_prompt_logprobs:
                            self.p_prompt_logprobs = list(resp.prompt_logprobs)
                        if _finished(resp):
                            break  # P's answer is whole: its trailers are not waited for
                finally:
                    call.cancel()  # a no-op once the call has ended
                if last is None or not _finished(last):
                    event = hm.PrefillFailed("ended without finishing")
                elif mode not in PUSH_LIKE and not is_set(last.kv_transfer):
                    event = hm.PrefillFailed("returned no KV handoff parameters")
                else:
                    span.set_attribute("kvmesh.p_hit_tokens", last.usage.cached_tokens)
                    first = (_first_chunk(self.req, tokens, "".join(text), last)
                             if mode not in PUSH_LIKE and p_token_first(self.req) else None)
                    span.set_attribute("kvmesh.first_token_from_prefill", first is not None)
                    if first is not None:
                        self.p_token = tokens[0]
                    if mode not in PUSH_LIKE:
                        self.metrics.first_token.labels(
                            "decode" if first is None else "prefill").inc()
                    event = hm.PrefillDone(last, first)
                if isinstance(event, hm.PrefillFailed):
                    span.set_status(Status(StatusCode.ERROR, event.reason))
        except Exception as exc:  # every failure becomes an event
            event = hm.PrefillFailed(rpc_reason(exc), exc)
        self.p_settled.set()
        if isinstance(event, hm.PrefillDone) and mode not in PUSH_LIKE:
            last = event.result  # type: ignore[assignment]
            assert last is not None
            self.metrics.prefill.labels(mode).observe(time.monotonic() - start)
            self.metrics.p_hit.inc(last.usage.cached_tokens)
            self.metrics.blocks.labels(mode).inc(held_blocks(last.kv_transfer))
        self.events.put_nowait(event)

    async def _decode(self, prefill: object) -> None:
        """D's call; ``prefill`` is P's last response (pull) or None (push)."""
        choice, req = self.route.worker, self.req
        p_last: worker_pb2.GenerateResponse | None = prefill  # type: ignore[assignment]
        params = p_last.kv_transfer if p_last is not None else _push_params(req, self.route)
        p_cached = p_last.usage.cached_tokens if p_last is not None else 0
        xfer = tracer("frontend").start_span("kv_transfer", attributes={
            "kvmesh.handoff_mode": self.mode, "kvmesh.decode_worker_id": choice.instance_id,
            "kvmesh.p_hit_tokens": p_cached,
            "kvmesh.p_held_blocks": held_blocks(params) if p_last is not None else 0,
            "kvmesh.predicted_d_cached_tokens": _predicted_tokens(self.route, False)})
        await self._stream(choice, _decode_request(req, params, self.p_token), xfer)

    async def _stream(self, choice: router_pb2.WorkerChoice,
                      d_req: worker_pb2.GenerateRequest, xfer: trace.Span) -> None:
        """D's call; ``xfer`` is the kv_transfer span, ended at D's first token, when the
        decode span starts."""
        decode: trace.Span | None = None
        event: hm.Event = hm.DecodeEnded()
        try:
            with trace.use_span(xfer, end_on_exit=False):
                call = self._generate(choice, d_req)
            start = time.monotonic()
            hold = self.mode in PUSH_LIKE and self.want_prompt_logprobs
            try:
                async for resp in call:
                    if hold:  # the first chunk carries P's prompt logprobs (_outgoing)
                        await self.p_settled.wait()
                        hold = False
                    decode = self._observe_decode(resp, choice, xfer, decode, start)
                    self.events.put_nowait(hm.DecodeChunk(resp, _finished(resp)))
            finally:
                call.cancel()
        except Exception as exc:  # every failure becomes an event
            event = hm.DecodeFailed(rpc_reason(exc), exc)
        finally:
            (xfer if decode is None else decode).end()
        self.events.put_nowait(event)

    def _observe_decode(self, resp: worker_pb2.GenerateResponse,
                        choice: router_pb2.WorkerChoice, xfer: trace.Span,
                        decode: trace.Span | None, start: float) -> trace.Span | None:
        """Spans and metrics of one of D's chunks; returns the decode span once started."""
        if decode is None and resp.token_ids:
            self.metrics.transfer.labels(self.mode).observe(time.monotonic() - start)
            xfer.end()
            decode = tracer("frontend").start_span("decode", attributes={
                "kvmesh.decode_worker_id": choice.instance_id})
        if _finished(resp):
            self.metrics.d_hit.inc(resp.usage.cached_tokens)
            for span in (xfer, decode):
                if span is not None:
                    span.set_attribute("kvmesh.d_hit_tokens", resp.usage.cached_tokens)
        return decode


def plan_error(route: router_pb2.RouteResponse, stage: str, reason: str,
               error: object = None) -> HandoffError:
    """The HandoffError of ``route``'s ``stage`` ("agg", "prefill", "decode" or
    "timeout") failing for ``reason``; ``error``: the call's exception, if any (its
    ``__cause__``; an AioRpcError gives its code)."""
    choice = route.prefill if stage == "prefill" else route.worker
    if stage == "timeout":
        message = (f"decode worker {choice.instance_id} ({choice.address}) got no pushed "
                   f"KV from prefill worker {route.prefill.instance_id} within "
                   f"{PUSH_TIMEOUT_S}s")
    else:
        role = {"agg": "worker", "prefill": "prefill worker",
                "decode": "decode worker"}[stage]
        message = f"{role} {choice.instance_id} ({choice.address}) {reason}"
    code = error.code() if isinstance(error, grpc.aio.AioRpcError) else None
    out = HandoffError(message, stage=stage, instance_id=choice.instance_id,
                       address=choice.address, code=code)
    if isinstance(error, BaseException):
        out.__cause__ = error
    return out


def generate(pool: ChannelPool, streams: WorkerStreams | None,
             choice: router_pb2.WorkerChoice, request: worker_pb2.GenerateRequest) -> Any:
    """The worker's Generate call: with ``streams``, on its request plane (when it has one
    and the streams use them) or its GenerateMux, else a gRPC call of its own (the same
    responses and errors; :mod:`.worker_stream`)."""
    if streams is not None:
        return streams.generate(choice.address, request, WORKER_TIMEOUT_S,
                                choice.request_plane_address)
    return worker_pb2_grpc.WorkerStub(pool.get(choice.address)).Generate(
        request, timeout=WORKER_TIMEOUT_S)


def run_plan(pool: ChannelPool, req: Request, route: router_pb2.RouteResponse,
             metrics: FrontendMetrics, streams: WorkerStreams | None = None
             ) -> AsyncIterator[worker_pb2.GenerateResponse]:
    """Runs ``req`` as ``route`` says, recording into ``metrics``, its worker calls on
    ``streams`` when given; see the module docstring. An async generator: nothing starts
    before its first step, and closing it ends the run's calls."""
    return _Run(pool, req, route, metrics, streams).responses()
