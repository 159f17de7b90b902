"""The worker's images and embeddings (EPD): checked and decoded before the engine sees
them, INVALID_ARGUMENT naming the field, the worker serving on; a mock engine that
records what it got (in-process gRPC server on port 0)."""

from __future__ import annotations

import base64
import io
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from PIL import Image

from protos import common_pb2, encoder_pb2, worker_pb2, worker_pb2_grpc
from services.encoder.images import ImageLimits
from tests.unit.test_frontend_release import serve
from workers.ec.core import PARAMS_KEY
from workers.engines.base import EngineOutput, EngineRequest
from workers.engines.mock import MockEngine, MockEngineConfig
from workers.service import WorkerServicer


class ImageEngine(MockEngine):
    """The mock engine, accepting images and keeping each request it got."""

    got: list[EngineRequest]

    @property
    def accepts_images(self) -> bool:
        return True

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        self.got.append(request)
        async for out in super().generate(request):
            yield out


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(buf, format="PNG")
    return buf.getvalue()


def _descriptor(mm_hash: str) -> encoder_pb2.EmbeddingDescriptor:
    return encoder_pb2.EmbeddingDescriptor(
        mm_hash=mm_hash, agent="e", agent_metadata=b"meta", addr=4096, nbytes=4 * 2 * 4,
        dtype="float32", shape=[4, 2], handle="h1", region="/dev/shm/x", offset=64,
        num_tokens=4)


async def _stub(engine: MockEngine) -> tuple[Any, worker_pb2_grpc.WorkerStub]:
    await engine.start()
    server, address = await serve(worker_pb2_grpc.add_WorkerServicer_to_server,
                                  WorkerServicer(engine, "w", None, ImageLimits(max_images=2)))
    return server, worker_pb2_grpc.WorkerStub(grpc.aio.insecure_channel(address))


def _req(rid: str, images: list[worker_pb2.ImageItem],
         embeddings: list[encoder_pb2.EmbeddingDescriptor] = ()) -> worker_pb2.GenerateRequest:  # type: ignore[assignment]
    return worker_pb2.GenerateRequest(
        request_id=rid, model="mock", token_ids=[1, 2, 3],
        sampling=common_pb2.SamplingParams(max_tokens=2), images=images,
        embeddings=list(embeddings))


async def _run(stub: worker_pb2_grpc.WorkerStub, req: worker_pb2.GenerateRequest) -> int:
    return len([r async for r in stub.Generate(req)])


async def test_text_engine_refuses_images() -> None:
    server, stub = await _stub(MockEngine(MockEngineConfig(model_name="mock")))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _run(stub, _req("r", [worker_pb2.ImageItem(data=_png(), mm_hash="a")]))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "images: engine mock of model mock takes no images" in info.value.details()
    finally:
        await server.stop(None)


async def test_images_and_embeddings_reach_the_engine_and_bad_ones_are_refused() -> None:
    engine = ImageEngine(MockEngineConfig(model_name="mock"))
    engine.got = []
    server, stub = await _stub(engine)
    png = _png()
    try:
        ok = _req("ok", [worker_pb2.ImageItem(data=png, mm_hash="a"),
                         worker_pb2.ImageItem(data=png, mm_hash="b")], [_descriptor("b")])
        assert await _run(stub, ok) >= 1
        (got,) = engine.got
        assert got.image_uuids == ["a", "b"] and [i.size for i in got.images] == [(8, 8)] * 2
        assert got.ec_transfer_params is not None and set(got.ec_transfer_params) == {"b"}
        assert got.ec_transfer_params["b"][PARAMS_KEY]["agent_metadata"] == \
            base64.b64encode(b"meta").decode()
        item = worker_pb2.ImageItem(data=png, mm_hash="a")
        bad_desc = _descriptor("a")
        bad_desc.nbytes = 3
        cases = [
            (_req("1", [worker_pb2.ImageItem(data=b"nope", mm_hash="a")]),
             "images[0].data: not an image"),
            (_req("2", [worker_pb2.ImageItem(data=png)]), "images[0].mm_hash: must not be"),
            (_req("3", [item, item, item]), "images: at most 2 images per request, got 3"),
            (_req("4", [item], [_descriptor("zzz")]),
             "embeddings[0].mm_hash: 'zzz' names none of the request's images"),
            (_req("5", [item], [bad_desc]), "embeddings[0]: descriptor field 'nbytes'"),
            (_req("6", [], [_descriptor("a")]), "images: at least one image"),
        ]
        for req, words in cases:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _run(stub, req)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, words
            assert words in (info.value.details() or ""), (words, info.value.details())
        assert len(engine.got) == 1  # none of them reached the engine
        assert await _run(stub, _req("again", [item])) >= 1  # and it still serves
    finally:
        await server.stop(None)
