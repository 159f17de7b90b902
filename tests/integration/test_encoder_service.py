"""The encoder service (EPD's E) in-process on the tiny VLM: real etcd, vLLM, NIXL.

- E (:func:`services.encoder.main.start_encoder`: vLLM ``ec_producer`` with the kvmesh
  EC connector, AsyncLLM) registers ``role=encode`` in etcd and serves ``Encode``.
- The same image twice: the second answer is a cache hit (same slot), and E's vision
  encoder did not run again (its ``encodes`` counter, from the connector's stats block).
- A ``vllm.LLM`` ``ec_consumer`` whose vision tower is zeroed (Z), given E's descriptor
  from the cache hit, gives the aggregated greedy tokens (reference: engine A, no
  connector); without it, other tokens (the negative control).
- Bad input is INVALID_ARGUMENT naming the field, and E keeps serving.

Engines and fixtures as in :mod:`tests.integration.test_ec_nixl`. A and Z are built
before E starts (E's start sets vLLM's multiprocessing knob for its own engine).
Runtime on 2 shared cores: ~2-3 min (three engine starts).
"""

from __future__ import annotations

import asyncio
import base64
import io
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from protos import discovery_pb2, encoder_pb2, encoder_pb2_grpc
from services.common.config import load_config
from services.common.discovery import etcd_client, instances_prefix
from services.common.procs import Child
from services.encoder.core import content_hash
from services.encoder.main import EncoderApp, EncoderConfig, start_encoder
from tests.integration.test_ec_nixl import (  # noqa: F401  (fixtures)
    Engine,
    _image,
    _request,
    engine_env,
    vlm,
    zeroed_vlm,
)
from tests.waiting import wait_for
from workers.ec.configs import nixl_ec_transfer_config
from workers.ec.proto import ec_transfer_params

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NS = "enc-it"
MAX_PIXELS = 128 * 128


def _png(seed: int, size: int = 64) -> bytes:
    buf = io.BytesIO()
    img = _image(seed)
    (img if size == 64 else img.resize((size, size))).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def reference(vlm: Path, engine_env: None) -> list[int]:  # noqa: F811
    """Aggregated greedy tokens for image "a" (engine A, closed afterwards)."""
    agg = Engine(vlm)
    try:
        return agg.tokens(_request("a", "ref-a"))
    finally:
        agg.close()


@pytest.fixture(scope="module")
def zeroed(zeroed_vlm: Path, reference: list[int]) -> Iterator[Engine]:  # noqa: F811
    z = Engine(zeroed_vlm, nixl_ec_transfer_config("ec_consumer"))
    yield z
    z.close()


@pytest.fixture(scope="module")
async def encoder(etcd: Child, vlm: Path, zeroed: Engine) -> AsyncIterator[EncoderApp]:  # noqa: F811
    args = ["--etcd-endpoint", etcd.address, "--namespace", NS, "--lease-ttl", "5",
            "--grace-s", "0.5", "--model-path", str(vlm), "--model-name", "tiny-vlm",
            "--cache-mib", "4", "--pool-mib", "8", "--lease-s", "10", "--max-images", "2",
            "--max-pixels", str(MAX_PIXELS), "--metrics-port", "0"]
    app = await start_encoder(load_config(EncoderConfig, args, {}))
    try:
        yield app
    finally:
        await app.stop()


@pytest.fixture
async def stub(encoder: EncoderApp) -> AsyncIterator[encoder_pb2_grpc.EncoderStub]:
    async with grpc.aio.insecure_channel(encoder.server.address) as ch:
        yield encoder_pb2_grpc.EncoderStub(ch)


async def _records(etcd: str) -> list[discovery_pb2.InstanceRecord]:
    client = etcd_client(etcd)
    try:
        await client.connect()
        kvs = await client.get_prefix(instances_prefix(NS, "encoder").encode())
        return [discovery_pb2.InstanceRecord.FromString(kv.value) for kv in kvs]
    finally:
        await client.close()


async def test_registers_role_encode(encoder: EncoderApp, etcd: Child) -> None:
    (rec,) = await _records(etcd.address)
    assert rec.role == discovery_pb2.WORKER_ROLE_ENCODE and rec.component == "encoder"
    assert rec.address == encoder.server.address and rec.model == "tiny-vlm"
    assert "encode" in rec.capabilities and rec.metrics_address


async def _stats(stub: encoder_pb2_grpc.EncoderStub) -> encoder_pb2.StatsResponse:
    return await stub.Stats(encoder_pb2.StatsRequest())


async def test_second_encode_is_a_cache_hit_and_feeds_a_zeroed_consumer(
    stub: encoder_pb2_grpc.EncoderStub, encoder: EncoderApp, zeroed: Engine,
    reference: list[int],
) -> None:
    png = _png(1)  # image "a" of test_ec_nixl
    first = await stub.Encode(encoder_pb2.EncodeRequest(
        request_id="r1", images=[encoder_pb2.ImageInput(data=png)]))
    (e1,) = first.embeddings
    assert not e1.cache_hit and e1.mm_hash == content_hash(png) == e1.content_hash
    assert e1.num_tokens == 4 and list(e1.shape) == [4, 128] and e1.dtype == "float32"
    s1 = await _stats(stub)
    assert s1.encodes == 1 and s1.misses == 1 and s1.hits == 0 and s1.entries == 1

    url = "data:image/png;base64," + base64.b64encode(png).decode()
    second = await stub.Encode(encoder_pb2.EncodeRequest(
        request_id="r2", images=[encoder_pb2.ImageInput(data_url=url)]))
    (e2,) = second.embeddings
    assert e2.cache_hit and (e2.mm_hash, e2.addr, e2.handle) == (e1.mm_hash, e1.addr, e1.handle)
    s2 = await _stats(stub)
    assert s2.encodes == 1 and s2.hits == 1, s2  # E's encoder did not run again

    # The zeroed consumer can only give the aggregated tokens with E's embedding.
    params = ec_transfer_params(second.embeddings)
    req = _request("a", e2.mm_hash)  # the consumer still gets the image (its prompt)
    assert await asyncio.to_thread(zeroed.tokens, req, params) == reference
    local = await asyncio.to_thread(zeroed.tokens, _request("a", "z-local"))
    assert local != reference, "zeroing the vision tower did not change the output"

    async def released() -> bool:
        return encoder.engine.stats().get("released", 0) >= 1
    await wait_for(released, 10, "E got the consumer's read notification")
    # Read and unpinned, the slot stays in E's cache: still a hit, still no encode.
    third = await stub.Encode(encoder_pb2.EncodeRequest(
        request_id="r3", images=[encoder_pb2.ImageInput(data=png, content_hash=e1.mm_hash)]))
    assert third.embeddings[0].cache_hit
    assert (await _stats(stub)).encodes == 1

    assert encoder.metrics_endpoint is not None
    url = f"http://127.0.0.1:{encoder.metrics_endpoint.port}/metrics"
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
    text = body.decode()
    assert "kvmesh_encoder_cache_hits_total 2.0" in text, text
    assert "kvmesh_encoder_encodes_total 1.0" in text
    assert "kvmesh_encoder_encode_seconds_count 1.0" in text


def _bad(**kw: Any) -> encoder_pb2.EncodeRequest:
    return encoder_pb2.EncodeRequest(request_id="bad", **kw)


async def test_bad_input_is_invalid_argument_naming_the_field(
    stub: encoder_pb2_grpc.EncoderStub,
) -> None:
    ok = encoder_pb2.ImageInput(data=_png(2))
    cases = [
        (_bad(images=[ok, encoder_pb2.ImageInput(data_url="data:image/png;base64,%%%")]),
         "images[1].data_url: not base64"),
        (_bad(images=[encoder_pb2.ImageInput(data=b"GIF89a not really")]),
         "images[0].data: not an image"),
        (_bad(images=[encoder_pb2.ImageInput(data=_png(3, size=129))]),
         f"images[0].data: 129x129 = 16641 pixels, over {MAX_PIXELS}"),
        (_bad(images=[ok, ok, ok]), "images: at most 2 images per request, got 3"),
        (_bad(images=[]), "images: at least one image"),
        (_bad(images=[encoder_pb2.ImageInput(data=_png(2), content_hash="ab")]),
         "images[0].content_hash: 'ab' is not the sha256"),
        (_bad(images=[encoder_pb2.ImageInput(content_hash="00" * 32)]),
         "images[0].content_hash: '" + "00" * 32 + "' is not in the cache"),
        (_bad(model="other", images=[ok]), "model: this encoder serves 'tiny-vlm'"),
    ]
    for request, words in cases:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Encode(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
        assert words in (info.value.details() or ""), (words, info.value.details())
    refused = (await _stats(stub)).refused
    assert refused >= len(cases), refused
    # E keeps serving: a good image still encodes.
    good = await stub.Encode(_bad(images=[ok]))
    assert len(good.embeddings) == 1 and good.embeddings[0].num_tokens == 4
