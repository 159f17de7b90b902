"""Issue 15's fan-out (``n`` > 1, batches of prompts) with the official ``openai`` client
through a live mock mesh: real etcd and Redis, two in-process mock workers (the fleet),
a ``kv`` router, frontends (one with ``--migration-limit 0``).

The mock's tokens are a function of the sampling seed and the prompt, so choice c of a
request with seed s equals a single request with seed s + c (vLLM's parallel-sampling
seeds), and the usage can be checked exactly.

- completions, a batch of 2 prompts x n=3: indexes 0..5 in prompt-major order, each equal
  to its single request, usage = each prompt once + every choice's tokens, and
  cached_tokens = each prompt's first choice's hits (every worker holds both prompts,
  so every choice hits: counting them all would count each prompt three times);
- chat streaming n=2: chunks of both choices interleaved (each choice's content starts
  before the other's finish), per choice its role delta first and its finish last, one
  usage chunk after both; the texts equal the non-streamed ones;
- a non-streamed n=4 request whose client closes its connection mid-generation: every
  choice is aborted on its worker and its router entry released;
- gRPC ``n``: chunks carry their index, the last one the request's usage;
- a choice's worker stopped mid-stream: the client gets an error naming the choice, the
  other choices are cancelled on their workers and every router entry is released;
- a choice the worker refuses (the mock computes no log-probabilities): a 400 naming the
  field, nothing left in flight.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from protos import common_pb2, frontend_pb2, frontend_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.common.config import load_config
from services.common.procs import Child
from services.frontend.main import FrontendApp, FrontendConfig, start_frontend
from services.router.main import RouterApp, RouterConfig, start_router
from tests.integration.conftest import base_args, wait_routable
from tests.waiting import wait_for
from workers.fleet import Fleet, FleetConfig, start_fleet

NS = "fanout"
MODEL = "mock"
BLOCK = 16


@dataclass
class FanMesh:
    fleet: Fleet
    router: RouterApp
    frontend: FrontendApp
    strict: FrontendApp  # --migration-limit 0

    def client(self, front: FrontendApp | None = None) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=(front or self.frontend).base_url + "/v1",
                                  api_key="none", max_retries=0, timeout=60)

    def in_flight(self) -> int:
        return self.router.servicer._core.in_flight_count()  # noqa: SLF001

    def running(self) -> int:
        return sum(w.engine.load().num_running for w in self.fleet.workers)


@pytest.fixture(scope="module")
async def mesh(etcd: Child, redis_server: Child, tiny_model: str) -> AsyncIterator[FanMesh]:
    args = [*base_args(etcd.address, NS), "--redis-url", f"redis://{redis_server.address}"]
    fleet = await start_fleet(load_config(FleetConfig, [
        *args, "--workers", "2", "--block-size", str(BLOCK), "--num-blocks", "1024",
        "--max-model-len", "4096", "--worker-id", "fan-", "--model-path", tiny_model,
        "--model-name", MODEL], {}))
    router = await start_router(load_config(RouterConfig, [
        *args, "--policy", "kv", "--load-poll-s", "0.2"], {}))
    front = [*args, "--http-port", "0", "--router-address", router.server.address]
    frontend = await start_frontend(load_config(FrontendConfig, front, {}))
    strict = await start_frontend(load_config(FrontendConfig,
                                              [*front, "--migration-limit", "0"], {}))
    try:
        await wait_routable(router, 2, "the mock workers")
        await wait_for(lambda: all(f.pipeline.catalog.get(MODEL) is not None
                                   for f in (frontend, strict)), 30, "the frontends' models")
        yield FanMesh(fleet, router, frontend, strict)
    finally:
        for f in (frontend, strict):
            await f.server.stop()
        await router.server.stop()
        await fleet.stop()


async def released(mesh: FanMesh) -> None:
    await wait_for(lambda: mesh.in_flight() == 0 and mesh.running() == 0, 10,
                   lambda: f"every entry released (router {mesh.in_flight()}, "
                           f"workers running {mesh.running()})")


async def warm(mesh: FanMesh, prompt: list[int]) -> None:
    """Every worker computes ``prompt`` once (unsalted, as the frontend sends it)."""
    for w in mesh.fleet.workers:
        async with grpc.aio.insecure_channel(w.address) as ch:
            async for _ in worker_pb2_grpc.WorkerStub(ch).Generate(worker_pb2.GenerateRequest(
                    request_id=f"warm-{w.address}-{prompt[0]}", token_ids=prompt, model=MODEL,
                    sampling=common_pb2.SamplingParams(max_tokens=1))):
                pass


async def test_batch_times_n_is_indexed_seeded_and_counted_once(mesh: FanMesh) -> None:
    client = mesh.client()
    prompts = [list(range(100, 140)), list(range(300, 323))]
    for prompt in prompts:  # so every choice, wherever it runs, hits the prompt's blocks
        await warm(mesh, prompt)
    resp = await client.completions.create(model=MODEL, prompt=prompts, n=3, max_tokens=5,
                                           seed=11)
    assert [c.index for c in resp.choices] == list(range(6))
    singles = []
    for p, prompt in enumerate(prompts):
        for c in range(3):
            one = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                                  seed=11 + c)
            singles.append(one)
            assert resp.choices[p * 3 + c].text == one.choices[0].text, (p, c)
    assert len({c.text for c in resp.choices[:3]}) == 3  # other seeds, other samples
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(prompts[0]) + len(prompts[1])
    assert resp.usage.completion_tokens == 6 * 5
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 30
    assert resp.usage.prompt_tokens_details is not None
    # each prompt's first choice hit its full blocks (never its last token), once per
    # prompt: the other choices hit them too, and are not counted
    hits = [(len(p) - 1) // BLOCK * BLOCK for p in prompts]
    assert resp.usage.prompt_tokens_details.cached_tokens == sum(hits) == 48
    await released(mesh)


async def test_chat_stream_with_n_interleaves_choices(mesh: FanMesh) -> None:
    client = mesh.client()
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "tell me two stories"}]
    full = await client.chat.completions.create(model=MODEL, messages=messages, n=2,
                                                max_tokens=32, seed=3)
    assert [c.index for c in full.choices] == [0, 1]
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, n=2, max_tokens=32, seed=3, stream=True,
        stream_options={"include_usage": True})
    texts, roles, finishes, usage = ["", ""], [0, 0], [0, 0], []
    events: list[tuple[int, str]] = []  # (index, role | content | finish | usage)
    async for chunk in stream:
        if chunk.usage is not None:
            usage.append(chunk.usage)
            events.append((-1, "usage"))
        for c in chunk.choices:
            roles[c.index] += c.delta.role == "assistant"
            texts[c.index] += c.delta.content or ""
            finishes[c.index] += c.finish_reason is not None
            kind = ("finish" if c.finish_reason is not None else
                    "role" if c.delta.role == "assistant" else "content")
            events.append((c.index, kind))
    assert roles == [1, 1] and finishes == [1, 1] and len(usage) == 1
    assert texts == [c.message.content for c in full.choices]
    assert usage[0].completion_tokens == 64
    assert full.usage is not None and usage[0].prompt_tokens == full.usage.prompt_tokens
    assert events[-1] == (-1, "usage")  # after both finishes
    for i in (0, 1):
        mine = [k for j, k in events if j == i]
        assert mine[0] == "role" and mine[-1] == "finish" and "content" in mine, (i, mine)
    # interleaved as they come: each choice's content starts before the other finished
    for i, other in ((0, 1), (1, 0)):
        assert events.index((i, "content")) < events.index((other, "finish")), events
    await released(mesh)


async def test_continuous_usage_counts_each_choice_as_it_grows(mesh: FanMesh) -> None:
    """vLLM's ``continuous_usage_stats``: every chunk's usage is its choice's prompt and
    the tokens that choice produced so far; the last usage chunk is the request's."""
    client = mesh.client()
    for make in ("chat", "completion"):
        opts: Any = {"include_usage": True, "continuous_usage_stats": True}
        if make == "chat":
            stream: Any = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "count up"}], n=2,
                max_tokens=6, seed=5, stream=True, stream_options=opts)
        else:
            stream = await client.completions.create(
                model=MODEL, prompt=[list(range(40, 60)), list(range(70, 81))], max_tokens=6,
                seed=5, stream=True, stream_options=opts)
        seen: dict[int, list[int]] = {0: [], 1: []}
        prompts: dict[int, int] = {}
        last = None
        async for chunk in stream:
            assert chunk.usage is not None, chunk  # every chunk carries usage
            if not chunk.choices:
                last = chunk.usage
                continue
            (c,) = chunk.choices
            u = chunk.usage
            assert u.total_tokens == u.prompt_tokens + u.completion_tokens
            prompts.setdefault(c.index, u.prompt_tokens)
            assert u.prompt_tokens == prompts[c.index]
            seen[c.index].append(u.completion_tokens)
        assert last is not None
        for i in (0, 1):  # grows one token per chunk, from 0 (chat's role chunk) or 1
            assert seen[i] == sorted(seen[i]) and seen[i][-1] == 6, (make, i, seen[i])
            assert seen[i][0] == (0 if make == "chat" else 1), (make, i, seen[i])
        assert last.completion_tokens == 12
        n_prompts = 1 if make == "chat" else 2
        assert last.prompt_tokens == (prompts[0] if n_prompts == 1 else prompts[0] + prompts[1])
        if make == "completion":
            assert (prompts[0], prompts[1]) == (20, 11)
    await released(mesh)


async def test_rendering_options_prompt_what_tokenize_counts(mesh: FanMesh) -> None:
    """``continue_final_message`` / ``add_generation_prompt`` / ``add_special_tokens``:
    the prompt a chat or completion is served with is the one /tokenize renders with
    the same options (and the options change it)."""
    import httpx

    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, I"}]
    variants: list[dict[str, Any]] = [
        {}, {"add_generation_prompt": False},
        {"add_generation_prompt": False, "continue_final_message": True},
        {"add_special_tokens": True}]
    counts = []
    async with httpx.AsyncClient(base_url=mesh.frontend.base_url, timeout=30) as http:
        for opts in variants:
            tok = (await http.post("/tokenize", json={"model": MODEL, "messages": msgs,
                                                      **opts})).json()["count"]
            resp = await mesh.client().chat.completions.create(
                model=MODEL, messages=msgs, max_tokens=1, extra_body=opts)  # type: ignore[arg-type]
            assert resp.usage is not None and resp.usage.prompt_tokens == tok, (opts, tok)
            counts.append(tok)
        for opts in ({}, {"add_special_tokens": False}):
            tok = (await http.post("/tokenize", json={"model": MODEL, "prompt": "one two",
                                                      **opts})).json()["count"]
            one = await mesh.client().completions.create(model=MODEL, prompt="one two",
                                                         max_tokens=1, extra_body=opts)
            assert one.usage is not None and one.usage.prompt_tokens == tok, (opts, tok)
    assert len(set(counts[:3])) == 3, counts  # each template option renders another prompt
    ids = list(range(100, 130))
    cut = (await mesh.client().completions.create(
        model=MODEL, prompt=ids, max_tokens=1, echo=True,
        extra_body={"truncate_prompt_tokens": 7, "return_token_ids": True})).model_dump()
    assert cut["usage"]["prompt_tokens"] == 7
    assert cut["choices"][0]["prompt_token_ids"] == ids[-7:]
    await released(mesh)


async def test_return_token_ids_whole_and_streamed(mesh: FanMesh) -> None:
    """vLLM's ``return_token_ids``: the prompt's ids (what /tokenize gives) and each
    choice's generated ids, which decode to its text; streamed, the chunks' ids add up
    to the whole response's."""
    import httpx

    async with httpx.AsyncClient(base_url=mesh.frontend.base_url, timeout=30) as http:
        prompt_ids = (await http.post("/tokenize", json={"model": MODEL, "prompt": "a b c"})
                      ).json()["tokens"]
        chat_ids = (await http.post("/tokenize", json={
            "model": MODEL, "messages": [{"role": "user", "content": "a b c"}]})
        ).json()["tokens"]
    extra = {"return_token_ids": True}
    whole = (await mesh.client().completions.create(
        model=MODEL, prompt="a b c", max_tokens=5, n=2, seed=1, extra_body=extra)).model_dump()
    for c in whole["choices"]:
        assert c["prompt_token_ids"] == prompt_ids and len(c["token_ids"]) == 5, c
    stream = await mesh.client().completions.create(
        model=MODEL, prompt="a b c", max_tokens=5, n=2, seed=1, stream=True, extra_body=extra)
    got: dict[int, list[int]] = {0: [], 1: []}
    prompts: dict[int, list[list[int]]] = {0: [], 1: []}
    async for chunk in stream:
        for c in chunk.model_dump()["choices"]:
            got[c["index"]] += c["token_ids"]
            if c.get("prompt_token_ids") is not None:
                prompts[c["index"]].append(c["prompt_token_ids"])
    assert [got[0], got[1]] == [c["token_ids"] for c in whole["choices"]]
    assert prompts == {0: [prompt_ids], 1: [prompt_ids]}  # once per choice
    messages: Any = [{"role": "user", "content": "a b c"}]
    chat = (await mesh.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, seed=2, extra_body=extra)).model_dump()
    assert chat["prompt_token_ids"] == chat_ids and len(chat["choices"][0]["token_ids"]) == 4
    plain = (await mesh.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, seed=2)).model_dump()
    assert "prompt_token_ids" not in plain or plain["prompt_token_ids"] is None
    ids: list[int] = []
    first = None
    async for piece in await mesh.client().chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, seed=2, stream=True,
            extra_body=extra):
        d = piece.model_dump()
        first = d.get("prompt_token_ids") if first is None else first
        for c in d["choices"]:
            ids += c.get("token_ids") or []
    assert first == chat_ids and ids == chat["choices"][0]["token_ids"]
    await released(mesh)


async def test_decoding_extensions_the_mock_does_not_serve_are_a_400(mesh: FanMesh) -> None:
    """vLLM's decoding extensions reach the worker; the mock engine serves none of them,
    so each is a 400 naming it, never ignored, and nothing is left behind."""
    for extra in ({"bad_words": ["cat"]}, {"allowed_token_ids": [3]},
                  {"include_stop_str_in_output": True}, {"skip_special_tokens": False}):
        with pytest.raises(openai.BadRequestError) as err:
            await mesh.client().completions.create(model=MODEL, prompt="a b", max_tokens=2,
                                                   extra_body=extra)
        assert next(iter(extra)) in str(err.value.body), (extra, err.value.body)
    await released(mesh)


async def test_grpc_n_chunks_carry_their_index_and_the_usage_last(mesh: FanMesh) -> None:
    async with grpc.aio.insecure_channel(mesh.frontend.server.address) as ch:
        chunks = [c async for c in frontend_pb2_grpc.FrontendStub(ch).Generate(
            frontend_pb2.CompletionRequest(
                model=MODEL, prompt="grpc fan out", n=3, request_id="g1",
                sampling=common_pb2.SamplingParams(max_tokens=4, seed=5)))]
    by_index: dict[int, list[int]] = {}
    for c in chunks:
        by_index.setdefault(c.index, []).extend(c.token_ids)
        assert c.request_id == "g1"
    assert sorted(by_index) == [0, 1, 2] and all(len(v) == 4 for v in by_index.values())
    finishes = [c.index for c in chunks if c.finish_reason]
    assert sorted(finishes) == [0, 1, 2]
    assert [c.HasField("usage") for c in chunks].count(True) == 1 and chunks[-1].usage
    assert chunks[-1].usage.completion_tokens == 12
    await released(mesh)


async def test_a_refused_choice_is_a_400_and_nothing_is_left(mesh: FanMesh) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        await mesh.client().completions.create(model=MODEL, prompt="x", n=2, max_tokens=3,
                                               logprobs=2)
    assert "logprobs" in str(err.value)
    await released(mesh)


async def test_a_client_gone_ends_a_non_streamed_request(mesh: FanMesh) -> None:
    """A non-streamed n=4 request whose client closes the connection mid-generation:
    every choice is aborted on its worker and every router entry is released (the
    choices would run ~4000 mock decode steps, far longer than ``released`` waits)."""
    host, port = mesh.frontend.base_url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": MODEL, "prompt": list(range(700, 740)), "n": 4,
                       "max_tokens": 4000, "ignore_eos": True}).encode()
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: kvmesh\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                 % len(body) + body)
    await writer.drain()
    await wait_for(lambda: mesh.running() == 4 and mesh.in_flight() == 4, 20,
                   lambda: f"the 4 choices running (workers {mesh.running()}, "
                           f"router {mesh.in_flight()})")
    writer.close()
    await writer.wait_closed()
    await released(mesh)


async def test_a_choice_failing_mid_stream_cancels_the_others(mesh: FanMesh) -> None:
    """Last in the module: it stops a worker."""
    stream = await mesh.client(mesh.strict).completions.create(
        model=MODEL, prompt=list(range(500, 540)), n=4, max_tokens=2000, stream=True,
        extra_body={"ignore_eos": True})
    seen: set[int] = set()
    stopping: list[asyncio.Future[None]] = []
    with pytest.raises(openai.APIError) as err:
        async for chunk in stream:
            seen.update(c.index for c in chunk.choices)
            if len(seen) == 4 and not stopping:
                busy = [w for w in mesh.fleet.workers if w.engine.load().num_running]
                assert busy, "no worker runs the choices"
                # its gRPC server and its request plane's connections go at once (no
                # grace, no engine abort): the streams of the choices there break, and
                # with --migration-limit 0 they fail
                grpc_server = busy[0].server._server  # noqa: SLF001
                assert grpc_server is not None
                plane = busy[0].server.services[0].servicer.request_plane
                assert plane is not None
                plane.abort_connections()
                stopping.append(asyncio.ensure_future(grpc_server.stop(0)))
    assert stopping and "choice" in str(err.value), err.value
    await stopping[0]
    await released(mesh)
