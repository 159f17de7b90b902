"""Running one request on the worker(s) the router chose: aggregated, or P → D.

Contract of :func:`run_plan` (an async iterator of ``worker_pb2.GenerateResponse``):

- Aggregated plan: one ``Generate`` call on the chosen worker, streamed through.
- Disaggregated plan, ``pull`` handoff (vLLM NixlConnector): P runs the prompt with
  ``max_tokens=1`` and ``do_remote_decode``; its last chunk carries the handoff parameters
  (engine id, block ids, side channel); D is then called with them (``do_remote_prefill``)
  and READs the blocks it does not hold, and its tokens are streamed through. P keeps its
  blocks until D has read them (or its lease expires).
- Disaggregated plan, ``push`` handoff (vLLM NixlPushConnector): D is called first with P's
  coordinates from discovery and the same request id, P at the same time; D registers its
  receive blocks and P WRITEs into them when its prefill is done. Either may be ready first.
- A failure of P, or P finishing without handoff parameters, raises :class:`HandoffError`
  (never a silent half result). Cancelling the iterator cancels every call in flight,
  which aborts the request on those workers.
- ``usage.cached_tokens`` of a disaggregated request are P's prefix hits (what was not
  computed); D's own count, which includes the KV it received, goes to the spans.
- Spans: ``prefill`` (P call), ``kv_transfer`` (D call until its first token: the READ or
  WRITE plus D's first step) and ``decode`` (the rest), with mode, P-hit and D-hit tokens
  and the number of blocks P held for D, next to the router's predictions
  (``kvmesh.predicted_cached_tokens`` on ``prefill`` for P, ``kvmesh.predicted_d_cached_tokens``
  on ``kv_transfer`` for D; 0 when the router does not send its block size).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from protos import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc
from services.common.grpc_client import ChannelPool
from services.common.kv_params import held_blocks, is_set
from services.common.telemetry import tracer
from services.frontend.metrics import FrontendMetrics

WORKER_TIMEOUT_S = 600.0
# How long D may wait for P's push before the orchestrator gives up and aborts D.
PUSH_TIMEOUT_S = 120.0


class HandoffError(Exception):
    """The prefill side or the handoff failed; maps to 502."""


@dataclass
class Request:
    """What to run: ids, prompt and sampling."""

    request_id: str
    model: str
    token_ids: list[int]
    sampling: common_pb2.SamplingParams


def _finished(resp: worker_pb2.GenerateResponse) -> bool:
    return resp.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED


async def _stream_agg(pool: ChannelPool, req: Request,
                      choice: router_pb2.WorkerChoice) -> AsyncIterator[
                          worker_pb2.GenerateResponse]:
    call = worker_pb2_grpc.WorkerStub(pool.get(choice.address)).Generate(
        worker_pb2.GenerateRequest(request_id=req.request_id, token_ids=req.token_ids,
                                   sampling=req.sampling, model=req.model),
        timeout=WORKER_TIMEOUT_S)
    try:
        async for resp in call:
            yield resp
    finally:
        call.cancel()


async def _prefill(pool: ChannelPool, req: Request, choice: router_pb2.WorkerChoice,
                   mode: str) -> worker_pb2.GenerateResponse:
    """Runs the prompt on P with max_tokens=1 and returns P's last chunk. Pull mode needs
    handoff parameters in it; push mode only needs P to finish."""
    sampling = common_pb2.SamplingParams()
    sampling.CopyFrom(req.sampling)
    sampling.max_tokens = 1
    sampling.ignore_eos = True
    p_req = worker_pb2.GenerateRequest(request_id=req.request_id, token_ids=req.token_ids,
                                       sampling=sampling, model=req.model)
    p_req.kv_transfer.do_remote_decode = True
    if mode == "push":
        p_req.kv_transfer.transfer_mode = "push"
    call = worker_pb2_grpc.WorkerStub(pool.get(choice.address)).Generate(
        p_req, timeout=WORKER_TIMEOUT_S)
    last: worker_pb2.GenerateResponse | None = None
    try:
        async for resp in call:
            last = resp
    except grpc.aio.AioRpcError as exc:
        raise HandoffError(f"prefill worker {choice.instance_id} failed: "
                           f"{exc.code().name}: {exc.details()}") from exc
    finally:
        call.cancel()
    if last is None or not _finished(last):
        raise HandoffError(f"prefill worker {choice.instance_id} ended without finishing")
    if mode == "pull" and not is_set(last.kv_transfer):
        raise HandoffError(f"prefill worker {choice.instance_id} returned no KV handoff "
                           "parameters")
    return last


def _report_prefill_hits(resp: worker_pb2.GenerateResponse,
                         p_last: worker_pb2.GenerateResponse) -> None:
    """The client's ``cached_tokens`` are the prompt tokens nobody had to compute: P's
    prefix hits. D counts the KV it received over NIXL as cached too; that number stays
    in the frontend's ``decode`` span as ``kvmesh.d_hit_tokens``."""
    resp.usage.cached_tokens = p_last.usage.cached_tokens


def _decode_request(req: Request, params: worker_pb2.KvTransferParams) -> (
        worker_pb2.GenerateRequest):
    d_req = worker_pb2.GenerateRequest(request_id=req.request_id, token_ids=req.token_ids,
                                       sampling=req.sampling, model=req.model)
    d_req.kv_transfer.CopyFrom(params)
    d_req.kv_transfer.do_remote_prefill = True
    d_req.kv_transfer.do_remote_decode = False
    # P's own prefix hit would otherwise be reported as D's cached tokens.
    d_req.kv_transfer.ClearField("remote_prefill_cached_tokens")
    return d_req


def _predicted_tokens(route: router_pb2.RouteResponse, prefill: bool) -> int:
    """The router's predicted cached tokens on P (``prefill``) or D."""
    blocks = (route.predicted_prefill_overlap_blocks if prefill
              else route.predicted_overlap_blocks)
    return blocks * route.block_size


async def _stream_decode(pool: ChannelPool, d_req: worker_pb2.GenerateRequest,
                         choice: router_pb2.WorkerChoice, mode: str, p_cached: int,
                         blocks: int, metrics: FrontendMetrics,
                         predicted_d: int = 0) -> AsyncIterator[worker_pb2.GenerateResponse]:
    tr = tracer("frontend")
    xfer = tr.start_span("kv_transfer", attributes={
        "kvmesh.handoff_mode": mode, "kvmesh.decode_worker_id": choice.instance_id,
        "kvmesh.p_hit_tokens": p_cached, "kvmesh.p_held_blocks": blocks,
        "kvmesh.predicted_d_cached_tokens": predicted_d})
    with trace.use_span(xfer, end_on_exit=False):
        call = worker_pb2_grpc.WorkerStub(pool.get(choice.address)).Generate(
            d_req, timeout=WORKER_TIMEOUT_S)
    decode: trace.Span | None = None
    start = time.monotonic()
    try:
        async for resp in call:
            if decode is None and resp.token_ids:
                metrics.transfer.labels(mode).observe(time.monotonic() - start)
                xfer.end()
                decode = tr.start_span("decode", attributes={
                    "kvmesh.decode_worker_id": choice.instance_id})
            if _finished(resp):
                metrics.d_hit.inc(resp.usage.cached_tokens)
                for span in (xfer, decode):
                    if span is not None:
                        span.set_attribute("kvmesh.d_hit_tokens", resp.usage.cached_tokens)
            yield resp
    finally:
        call.cancel()
        if decode is None:
            xfer.end()
        else:
            decode.end()


async def run_plan(pool: ChannelPool, req: Request, route: router_pb2.RouteResponse,
                   metrics: FrontendMetrics) -> AsyncIterator[worker_pb2.GenerateResponse]:
    """Runs ``req`` as ``route`` says, recording into ``metrics``; see the module
    docstring."""
    if not route.disaggregated:
        async for resp in _stream_agg(pool, req, route.worker):
            yield resp
        return
    mode = route.prefill.handoff.mode or "pull"
    tr = tracer("frontend")
    if mode == "push":
        async for resp in _run_push(pool, req, route, metrics):
            yield resp
        return
    start = time.monotonic()
    with tr.start_as_current_span("prefill", attributes={
            "kvmesh.prefill_worker_id": route.prefill.instance_id,
            "kvmesh.handoff_mode": mode,
            "kvmesh.predicted_cached_tokens": _predicted_tokens(route, True)}) as span:
        p_last = await _prefill(pool, req, route.prefill, mode)
        span.set_attribute("kvmesh.p_hit_tokens", p_last.usage.cached_tokens)
    metrics.prefill.labels(mode).observe(time.monotonic() - start)
    metrics.p_hit.inc(p_last.usage.cached_tokens)
    blocks = held_blocks(p_last.kv_transfer)
    metrics.blocks.labels(mode).inc(blocks)
    d_req = _decode_request(req, p_last.kv_transfer)
    async for resp in _stream_decode(pool, d_req, route.worker, mode,
                                     p_last.usage.cached_tokens, blocks, metrics,
                                     _predicted_tokens(route, False)):
        if _finished(resp):
            _report_prefill_hits(resp, p_last)
        yield resp


async def _run_push(pool: ChannelPool, req: Request, route: router_pb2.RouteResponse,
                    metrics: FrontendMetrics) -> AsyncIterator[worker_pb2.GenerateResponse]:
    """Push: D first (with P's coordinates), P concurrently; either may be ready first."""
    hand = route.prefill.handoff
    params = worker_pb2.KvTransferParams(
        remote_engine_id=hand.engine_id, remote_request_id=req.request_id,
        remote_host=hand.side_channel_host, remote_port=hand.side_channel_port,
        tp_size=hand.tp_size or 1, transfer_mode="push")
    d_req = _decode_request(req, params)
    tr = tracer("frontend")
    p_span = tr.start_span("prefill", attributes={
        "kvmesh.prefill_worker_id": route.prefill.instance_id, "kvmesh.handoff_mode": "push",
        "kvmesh.predicted_cached_tokens": _predicted_tokens(route, True)})

    async def prefill() -> worker_pb2.GenerateResponse:
        with trace.use_span(p_span, end_on_exit=True):
            return await _prefill(pool, req, route.prefill, "push")

    p_task = asyncio.create_task(prefill())
    d_iter = _stream_decode(pool, d_req, route.worker, "push", 0, 0, metrics,
                            _predicted_tokens(route, False)).__aiter__()
    try:
        # Until D's first token, a failing P must end the request (D would wait forever).
        first = asyncio.ensure_future(d_iter.__anext__())
        done, _ = await asyncio.wait({first, p_task}, timeout=PUSH_TIMEOUT_S,
                                     return_when=asyncio.FIRST_COMPLETED)
        if p_task in done and p_task.exception() is not None and first not in done:
            first.cancel()
            raise p_task.exception()  # type: ignore[misc]
        if first not in done:
            done, _ = await asyncio.wait({first}, timeout=PUSH_TIMEOUT_S)
            if first not in done:
                first.cancel()
                raise HandoffError(f"decode worker got no pushed KV within {PUSH_TIMEOUT_S}s")
        yield first.result()
        async for resp in d_iter:
            if _finished(resp) and p_task.done() and not p_task.cancelled() and (
                    p_task.exception() is None):
                _report_prefill_hits(resp, p_task.result())
            yield resp
        await asyncio.wait_for(p_task, PUSH_TIMEOUT_S)
    except StopAsyncIteration:
        raise HandoffError("decode worker ended the stream without output") from None
    finally:
        await d_iter.aclose()  # type: ignore[attr-defined]
        if not p_task.done():
            p_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, HandoffError):
            await p_task
