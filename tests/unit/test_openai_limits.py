"""Issue 15's review findings, pure and in-process parts: the size caps of the OpenAI and
gRPC parsers (sub-requests, schema bytes, logit_bias entries), strict ``stream_options``,
the seeds of choices (never -1), one prompt-logprobs prefill per prompt shared by its
choices, the fan-out span ended even when its cleanup is cancelled again, and SSE
streams that end with ``[DONE]`` after an error event (an unexpected exception too).

Fakes stand in only for the pipeline (no router, no worker: what is tested is the
frontend's own logic on top of it)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from opentelemetry import trace

from protos import common_pb2, frontend_pb2
from services.frontend import fanout, openai_schema
from services.frontend.fanout import choice_job
from services.frontend.http_api import create_app
from services.frontend.jobs import Chunk, Job
from services.frontend.metrics import FrontendMetrics
from services.frontend.models import ModelInfo
from services.frontend.openai_schema import (
    INT64_MAX,
    INT64_MIN,
    MAX_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_STRUCTURED_BYTES,
    ApiError,
    ParsedRequest,
    parse_chat,
    parse_completion,
)
from services.frontend.service import parse_proto
from tests.waiting import wait_for

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
INFO = ModelInfo("m", "", 512, 16, 1, 0)


def refused(parse: Any, body: Any) -> ApiError:
    with pytest.raises(ApiError) as err:
        parse(body)
    assert err.value.status == 400
    return err.value


# -- 2. sub-requests: n x prompts <= MAX_CHOICES -------------------------------------


def test_n_times_prompts_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    half = MAX_CHOICES // 2
    ok = parse_completion({"model": "m", "prompt": [[1]] * half, "n": 2})
    assert (len(ok.batch), ok.n) == (half, 2)
    err = refused(parse_completion, {"model": "m", "prompt": [[1]] * (half + 1), "n": 2})
    assert err.param == "n" and str(MAX_CHOICES) in err.message
    # n alone is at most MAX_N (<= MAX_CHOICES): a lower cap shows chat and gRPC check too
    monkeypatch.setattr(openai_schema, "MAX_CHOICES", 3)
    assert parse_chat({**CHAT, "n": 3}).n == 3
    assert refused(parse_chat, {**CHAT, "n": 4}).param == "n"
    assert refused(parse_completion, {"model": "m", "prompt": ["a", "b"], "n": 2}).param == "n"
    assert refused(parse_proto, frontend_pb2.CompletionRequest(
        model="m", prompt="x", n=4, sampling=common_pb2.SamplingParams(max_tokens=2))
    ).param == "n"


# -- 3. json_schema size -------------------------------------------------------------


def _schema(size: int) -> dict[str, Any]:
    """A schema whose compact JSON is exactly ``size`` bytes."""
    base = json.dumps({"description": ""}, separators=(",", ":"))
    return {"description": "x" * (size - len(base))}


def test_a_json_schema_over_the_cap_is_refused() -> None:
    def fmt(schema: dict[str, Any]) -> dict[str, Any]:
        return {**CHAT, "response_format": {"type": "json_schema",
                                            "json_schema": {"name": "s", "schema": schema}}}

    at = parse_chat(fmt(_schema(MAX_STRUCTURED_BYTES))).sampling.structured
    assert at is not None and len(at.value) == MAX_STRUCTURED_BYTES
    err = refused(parse_chat, fmt(_schema(MAX_STRUCTURED_BYTES + 1)))
    assert err.param == "response_format" and str(MAX_STRUCTURED_BYTES) in err.message
    text = json.dumps(_schema(MAX_STRUCTURED_BYTES + 1))
    assert refused(parse_proto, frontend_pb2.CompletionRequest(
        model="m", prompt="x", sampling=common_pb2.SamplingParams(
            max_tokens=2, structured=common_pb2.StructuredOutputs(json_schema=text)))
    ).param == "structured.json_schema"


# -- 4. logit_bias entries -----------------------------------------------------------


def test_logit_bias_entries_are_capped() -> None:
    many = {str(i): 1.0 for i in range(MAX_LOGIT_BIAS)}
    assert len(parse_chat({**CHAT, "logit_bias": many}).sampling.logit_bias) == MAX_LOGIT_BIAS
    err = refused(parse_chat, {**CHAT, "logit_bias": {**many, str(MAX_LOGIT_BIAS): 1.0}})
    assert err.param == "logit_bias" and str(MAX_LOGIT_BIAS) in err.message
    assert refused(parse_proto, frontend_pb2.CompletionRequest(
        model="m", prompt="x", sampling=common_pb2.SamplingParams(
            max_tokens=2, logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}))
    ).param == "logit_bias"


# -- 5. stream_options ---------------------------------------------------------------


@pytest.mark.parametrize(("opts", "param"), [
    ({"include_usage": "yes"}, "stream_options.include_usage"),
    ({"include_usage": 1}, "stream_options.include_usage"),
    ({"continuous_usage_stats": True}, "stream_options.continuous_usage_stats"),
    ({"continuous_usage_stats": "no"}, "stream_options.continuous_usage_stats"),
    ({"include_usage": True, "include_obfuscation": False}, "stream_options.include_obfuscation"),
    ([], "stream_options"),
])
def test_stream_options_are_strict(opts: Any, param: str) -> None:
    for parse, body in ((parse_chat, CHAT), (parse_completion, {"model": "m", "prompt": "x"})):
        err = refused(parse, {**body, "stream": True, "stream_options": opts})
        assert err.param == param, err
    if param.endswith("continuous_usage_stats") and opts["continuous_usage_stats"] is True:
        assert "include_usage" in err.message  # vLLM would ignore it without include_usage


def test_stream_options_that_are_served() -> None:
    def usage(opts: Any, stream: bool = True) -> bool:
        return parse_chat({**CHAT, "stream": stream, "stream_options": opts}).include_usage

    assert usage({"include_usage": True}) is True
    assert usage({"include_usage": False, "continuous_usage_stats": False}) is False
    assert usage({"include_usage": None, "continuous_usage_stats": None}) is False
    assert usage({}) is False and usage(None, stream=False) is False
    assert usage({}, stream=False) is False
    both = {"include_usage": True, "continuous_usage_stats": True}
    for parse, body in ((parse_chat, CHAT), (parse_completion, {"model": "m", "prompt": "x"})):
        req = parse({**body, "stream": True, "stream_options": both})
        assert req.include_usage and req.continuous_usage
        assert not parse({**body, "stream": True,
                          "stream_options": {"include_usage": True}}).continuous_usage
    # as vLLM: options without a stream are a mistake
    err = refused(parse_chat, {**CHAT, "stream_options": {"include_usage": True}})
    assert err.param == "stream_options"


# -- 10. seeds: seed + i, never -1 ----------------------------------------------------


def _job(req: ParsedRequest, ids: tuple[int, ...] = (1, 2, 3)) -> Job:
    return Job("rid", req, INFO, list(ids), 0)


def _seeds(seed: int, n: int) -> list[int | None]:
    job = _job(parse_completion({"model": "m", "prompt": "x", "seed": seed, "n": n}))
    return [choice_job(job, "b", c, c).req.sampling.seed for c in range(n)]


def test_choice_seeds_skip_minus_one() -> None:
    assert _seeds(-3, 4) == [-3, -2, 0, 1]  # -1 (vLLM: no seed) skipped
    assert _seeds(-2, 2) == [-2, 0]
    assert _seeds(-1, 3) == [-1, -1, -1]  # the client asked for no seed: every choice
    assert _seeds(0, 3) == [0, 1, 2]
    assert _seeds(INT64_MAX, 3) == [INT64_MAX, INT64_MIN, INT64_MIN + 1]
    seeds = _seeds(-5, 128)
    assert -1 not in seeds and len(set(seeds)) == 128


# -- 7 and 9. fan-out: one prompt-logprobs prefill per prompt; the span always ends ------


class _Span(trace.NonRecordingSpan):
    def __init__(self) -> None:
        super().__init__(trace.INVALID_SPAN_CONTEXT)
        self.ended = 0

    def end(self, end_time: int | None = None) -> None:
        self.ended += 1


class _Tracer:
    def __init__(self) -> None:
        self.spans: list[_Span] = []

    def start_span(self, name: str, **_: Any) -> _Span:
        self.spans.append(_Span())
        return self.spans[-1]


def _pos(token: int, lp: float) -> common_pb2.PositionLogprobs:
    return common_pb2.PositionLogprobs(token=common_pb2.TokenLogprob(token_id=token,
                                                                     logprob=lp))


PROMPT_LPS = [_pos(1, 0.0), _pos(2, -1.0), _pos(3, -2.0)]


class _FanPipeline:
    """``prepare`` and ``stream`` of a pipeline: each choice's chunks are scripted;
    choice 0 of the prompt starts only once choice 1 has sent everything (so choice 1's
    chunks come first and must be held)."""

    def __init__(self) -> None:
        self.tracer = _Tracer()
        self.asked: dict[str, int | None] = {}  # request id -> prompt_logprobs asked
        self.one_done = asyncio.Event()

    async def prepare(self, req: ParsedRequest) -> Job:
        return _job(req)

    async def stream(self, job: Job, ctx: Any = None) -> AsyncIterator[Chunk]:
        self.asked[job.request_id] = job.req.sampling.prompt_logprobs
        choice = int(job.request_id.rsplit("-", 1)[1])
        if choice == 0:
            await self.one_done.wait()
        lps = [_pos(9, -0.5)]
        first = Chunk("a", [9], logprobs=lps,
                      prompt_logprobs=list(PROMPT_LPS) if choice == 0 else [])
        for chunk in (Chunk("", []), first, Chunk("b", [9], logprobs=lps),
                      Chunk("", [], "length", 3, 2, 0)):
            yield chunk
        if choice == 1:
            self.one_done.set()


async def test_prompt_logprobs_are_asked_once_per_prompt_and_shared() -> None:
    pipe = _FanPipeline()
    req = parse_completion({"model": "m", "prompt": "x", "n": 2, "echo": True,
                            "logprobs": 1, "request_id": "r"})
    fan, chunks = await fanout.run(pipe, req)  # type: ignore[arg-type]
    out = [(i, c) async for i, c in chunks]
    assert pipe.asked == {"r-0": 1, "r-1": None}  # one prefill computes the prompt's
    assert [c.text for i, c in out if i == 1] == ["", "a", "b", ""]  # held, in order
    with_prompt = [(i, c.text) for i, c in out if c.prompt_logprobs]
    assert with_prompt == [(0, "a"), (1, "a")]  # each choice's first chunk with tokens
    assert all(c.prompt_logprobs == PROMPT_LPS for _, c in out if c.prompt_logprobs)
    assert pipe.tracer.spans[0].ended == 1


async def test_without_prompt_logprobs_nothing_is_held() -> None:
    pipe = _FanPipeline()
    pipe.one_done.set()
    fan, chunks = await fanout.run(pipe, parse_completion(  # type: ignore[arg-type]
        {"model": "m", "prompt": "x", "n": 2, "request_id": "q"}))
    out = [(i, c) async for i, c in chunks]
    assert pipe.asked == {"q-0": None, "q-1": None}
    assert not any(c.prompt_logprobs for i, c in out if i == 1)


class _StubbornPipeline(_FanPipeline):
    """Each choice sends one chunk, then its cleanup outlives a cancellation until
    ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.cleaning = 0

    async def stream(self, job: Job, ctx: Any = None) -> AsyncIterator[Chunk]:
        yield Chunk("a", [9])
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cleaning += 1
            await self.release.wait()
            raise


async def test_the_span_ends_when_the_cleanup_is_cancelled_again() -> None:
    pipe = _StubbornPipeline()
    fan, chunks = await fanout.run(pipe, parse_completion(  # type: ignore[arg-type]
        {"model": "m", "prompt": "x", "n": 2}))
    seen: list[int] = []

    async def consume() -> None:
        async for index, _ in chunks:
            seen.append(index)

    task = asyncio.ensure_future(consume())
    await wait_for(lambda: len(seen) == 2, 5, "both choices' first chunk")
    task.cancel()  # the fan-out cancels its choices and waits for them ...
    await wait_for(lambda: pipe.cleaning == 2, 5, "both choices cleaning up")
    task.cancel()  # ... and is cancelled again while waiting
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pipe.tracer.spans[0].ended == 1
    pipe.release.set()


# -- 8. SSE: [DONE] after an error event; an unexpected exception is an error event ----


class _FailingStreamPipeline:
    """``run`` streams one chunk, then fails with ``exc``."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc
        self.metrics = FrontendMetrics()
        self.catalog: Any = None
        self.image_limits = None
        self.closed = False

    async def run(self, req: ParsedRequest) -> tuple[Job, AsyncIterator[Chunk]]:
        async def chunks() -> AsyncIterator[Chunk]:
            try:
                yield Chunk("a", [5])
                raise self.exc
            finally:
                self.closed = True

        return _job(req), chunks()


def _events(body: str) -> list[Any]:
    out = []
    for block in body.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.mark.parametrize(("exc", "kind"), [
    (RuntimeError("boom"), "internal_error"),
    (ApiError(502, "worker w failed: gone", type="upstream_error"), "upstream_error"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_failing_stream_ends_with_an_error_event_and_done(
        exc: Exception, kind: str, path: str) -> None:
    pipe = _FailingStreamPipeline(exc)
    body: dict[str, Any] = ({"model": "m", "prompt": "x"} if path == "/v1/completions"
                            else dict(CHAT))
    with TestClient(create_app(pipe)) as client:  # type: ignore[arg-type]
        resp = client.post(path, json={**body, "stream": True})
    assert resp.status_code == 200
    events = _events(resp.text)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    error = events[-2]["error"]
    assert error["type"] == kind and str(exc) in error["message"]
    texts = [c.get("text", c.get("delta", {}).get("content"))
             for e in events[:-2] for c in e["choices"]]
    assert "a" in texts  # the chunk before the failure went out
    assert pipe.closed


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_unexpected_failure_of_a_non_streamed_request_is_a_logged_500(
        path: str, caplog: pytest.LogCaptureFixture) -> None:
    """The completion routes are served ahead of the FastAPI stack (http_api.DirectPostsApp):
    an exception the handler lets escape is still a 500 ``internal_error`` naming it,
    logged with its traceback, and the request's chunks are closed."""
    pipe = _FailingStreamPipeline(RuntimeError("boom"))
    body: dict[str, Any] = ({"model": "m", "prompt": "x"} if path == "/v1/completions"
                            else dict(CHAT))
    with TestClient(create_app(pipe)) as client:  # type: ignore[arg-type]
        resp = client.post(path, json=body)
        assert client.get(path).status_code == 405  # still a route: other methods refused
    assert resp.status_code == 500
    assert resp.json()["error"] == {"message": "internal error: boom",
                                    "type": "internal_error", "param": None, "code": None}
    assert pipe.closed
    failed = [r for r in caplog.records if r.getMessage() == f"{path} failed"]
    assert failed and failed[0].exc_info is not None


def test_a_non_streamed_request_is_answered_under_the_testclient() -> None:
    """The disconnect watcher sees no false disconnect from the TestClient: the
    non-streamed request's failure comes back as its status."""
    pipe = _FailingStreamPipeline(ApiError(502, "worker w failed", type="upstream_error"))
    with TestClient(create_app(pipe)) as client:  # type: ignore[arg-type]
        resp = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert resp.status_code == 502 and resp.json()["error"]["message"] == "worker w failed"
    assert pipe.closed
