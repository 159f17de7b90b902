"""The Encoder gRPC servicer: protobuf in, cache lookups and engine encodes, protobuf out.

Contract:

- ``Encode``: refuses, INVALID_ARGUMENT naming the field, before any encode: no image or
  more than ``max_images``; a ``model`` E does not serve; per image, a ``data_url`` that
  is not a base64 PNG/JPEG data: URL, bytes that are not an accepted image, over the
  byte or pixel limits (:mod:`services.encoder.images`), a ``content_hash`` that does
  not match, or a bare ``content_hash`` (no source) not in the cache. Then each image's
  key (:func:`services.encoder.core.cache_key` of its content hash and ``cache_salt``)
  is looked up: a hit is an entry whose slot in E's region still holds the embedding
  (:meth:`EncoderEngine.slot_valid`); it costs no decode and no engine call. The misses
  are encoded concurrently, one engine request each; concurrent misses of one key share
  one encode. Answers one :class:`EmbeddingDescriptor` per image, in order.
  UNAVAILABLE when the engine is dead, RESOURCE_EXHAUSTED when E could not publish an
  embedding (region full). Each refusal and failure is counted (``refused``,
  ``failures``); unexpected errors are logged once per kind.
- ``Stats``: the cache's and the engine's counters (:meth:`EncoderServicer.stats`).

Why a hit is safe to hand out (the delayed-free rule): E's connector keeps a slot while
a request or an unexpired lease pins it, and afterwards retains it within its own byte
budget (``retain_mib``); a retained slot may be evicted at any time, and a consumer
whose READ overlaps an eviction sees the header change and encodes the image itself
(see :mod:`workers.ec.scheduler`). So a hit may cost the consumer a local encode, never
wrong embeddings. The cache's budget is the connector's ``retain_mib``, so both keep
roughly the same set; an entry the connector evicted first is found ``stale`` here.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from protos import encoder_pb2, encoder_pb2_grpc
from services.encoder.core import EmbeddingCache, cache_key, content_hash
from services.encoder.engine import Encoded, NotPublished
from services.encoder.images import ImageLimits, InputError, check_count, data_url_bytes, open_image
from services.encoder.metrics import EncoderMetrics
from workers.ec.proto import to_pb
from workers.engines.base import EngineDeadError, EngineError

log = logging.getLogger(__name__)


class Backend(Protocol):
    """What the servicer needs of E's engine (:class:`EncoderEngine`)."""

    async def encode(self, image: Any, mm_hash: str, request_id: str) -> Encoded: ...
    def slot_valid(self, mm_hash: str, entry: dict[str, Any]) -> bool: ...
    def stats(self) -> dict[str, int]: ...


@dataclass(frozen=True)
class Cached:
    """One cache entry: E's ``ec_transfer_params[mm_hash]`` and the image's hash."""

    mm_hash: str
    digest: str
    entry: dict[str, Any]


@dataclass
class _Image:
    index: int
    key: str
    digest: str
    hit: Cached | None
    image: Any = None  # decoded, for a miss


class EncoderServicer(encoder_pb2_grpc.EncoderServicer):
    """See the module docstring."""

    def __init__(self, engine: Backend, cache: EmbeddingCache[Cached], limits: ImageLimits,
                 model: str, metrics: EncoderMetrics | None = None) -> None:
        self._engine = engine
        self._cache = cache
        self._limits = limits
        self._model = model
        self.metrics = metrics
        self._inflight: dict[str, asyncio.Future[Cached]] = {}
        self._counts: Counter[str] = Counter()
        self.dead: str | None = None

    def mark_dead(self, reason: str) -> None:
        self.dead = reason

    def _valid(self, c: Cached) -> bool:
        return self._engine.slot_valid(c.mm_hash, c.entry)

    def _parse(self, request: encoder_pb2.EncodeRequest) -> list[_Image]:
        """Every check that needs no engine (InputError names the field)."""
        check_count(len(request.images), self._limits)
        if request.model and request.model != self._model:
            raise InputError("model", f"this encoder serves {self._model!r}, not "
                                      f"{request.model!r}")
        out = []
        for i, img in enumerate(request.images):
            field = f"images[{i}]"
            source = img.WhichOneof("source")
            data = b""
            if source == "data_url":
                data = data_url_bytes(img.data_url, f"{field}.data_url", self._limits)
            elif source == "data":
                data = img.data
            if source is None:
                if not img.content_hash:
                    raise InputError(field, "give data, data_url or content_hash")
                digest = img.content_hash
            else:
                digest = content_hash(data)
                if img.content_hash and img.content_hash != digest:
                    raise InputError(f"{field}.content_hash",
                                     f"{img.content_hash!r} is not the sha256 of the "
                                     f"image ({digest})")
            key = cache_key(digest, request.cache_salt)
            hit = self._cache.lookup(key, self._valid)
            item = _Image(i, key, digest, hit)
            if hit is None:
                if source is None:
                    raise InputError(f"{field}.content_hash",
                                     f"{digest!r} is not in the cache: send the image")
                item.image = open_image(data, f"{field}.{source}", self._limits)
            out.append(item)
        return out

    async def _encode(self, item: _Image, request_id: str) -> Cached:
        """One miss (shared by concurrent requests for the same key)."""
        running = self._inflight.get(item.key)
        if running is not None:
            return await asyncio.shield(running)
        future: asyncio.Future[Cached] = asyncio.get_running_loop().create_future()
        self._inflight[item.key] = future
        try:
            done = await self._engine.encode(item.image, item.key, request_id)
            cached = Cached(item.key, item.digest, done.entry)
            self._cache.put(item.key, cached, done.nbytes)
            self._counts["encoded"] += 1
            if self.metrics is not None:
                self.metrics.queue.observe(done.queue_s)
                self.metrics.encode.observe(done.encode_s)
            future.set_result(cached)
            return cached
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: no "never retrieved" warning without waiters
            raise
        finally:
            del self._inflight[item.key]

    async def _refuse(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode,
                      kind: str, message: str) -> None:
        self._counts[kind] += 1
        if self._counts[kind] == 1 and kind != "refused":
            log.warning("Encode: %s", message)
        await context.abort(code, message)

    async def Encode(  # noqa: N802
        self, request: encoder_pb2.EncodeRequest, context: grpc.aio.ServicerContext
    ) -> encoder_pb2.EncodeResponse:
        if self.dead is not None:
            await self._refuse(context, grpc.StatusCode.UNAVAILABLE, "unavailable",
                               f"encoder engine dead: {self.dead}")
        try:
            items = self._parse(request)
        except InputError as exc:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "refused", str(exc))
            raise  # not reached: abort raises
        rid = request.request_id or "encode"
        misses = [i for i in items if i.hit is None]
        try:
            results = await asyncio.gather(*(self._encode(i, rid) for i in misses))
        except EngineDeadError as exc:
            await self._refuse(context, grpc.StatusCode.UNAVAILABLE, "unavailable", str(exc))
            raise
        except NotPublished as exc:
            await self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "not_published",
                               str(exc))
            raise
        except EngineError as exc:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "refused",
                               f"images: {exc}")
            raise
        encoded = dict(zip((i.index for i in misses), results, strict=True))
        out = encoder_pb2.EncodeResponse()
        for item in items:
            cached = item.hit or encoded[item.index]
            pb = to_pb(cached.mm_hash, cached.entry, cache_hit=item.hit is not None,
                       content_hash=cached.digest)
            if self.metrics is not None:
                self.metrics.embedding_bytes.observe(pb.nbytes)
            out.embeddings.append(pb)
        return out

    def stats(self) -> dict[str, int]:
        """The cache's counters, the engine's (``encodes``, ``published``, ``retained``,
        ``evicted`` as ``retained_evicted``) and the servicer's (``refused``...)."""
        s = self._cache.stats()
        e = self._engine.stats()
        return {"hits": s.hits, "misses": s.misses, "evictions": s.evictions,
                "stale": s.stale, "entries": s.entries, "bytes": s.bytes,
                "budget_bytes": s.budget_bytes, "encodes": e.get("encodes", 0),
                "published": e.get("published", 0), "retained": e.get("retained", 0),
                "retained_evicted": e.get("evicted", 0), **self._counts}

    async def Stats(  # noqa: N802
        self, request: encoder_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> encoder_pb2.StatsResponse:
        s = self.stats()
        fields = encoder_pb2.StatsResponse.DESCRIPTOR.fields_by_name
        return encoder_pb2.StatsResponse(**{k: v for k, v in s.items() if k in fields})
