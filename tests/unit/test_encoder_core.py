"""The encoder's pure parts: the embedding cache (LRU by bytes, TTL, validity, counters),
content hashing and salted keys, and the image checks (services.encoder.core / .images)."""

from __future__ import annotations

import base64
import hashlib
import io

import numpy as np
import pytest

from services.encoder.core import EmbeddingCache, cache_key, content_hash
from services.encoder.images import (
    ImageLimits,
    InputError,
    check_count,
    data_url_bytes,
    open_image,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lru_by_bytes_and_counters() -> None:
    cache: EmbeddingCache[str] = EmbeddingCache(1000, Clock())
    assert cache.put("a", "A", 400) == [] and cache.put("b", "B", 400) == []
    assert cache.lookup("a") == "A"  # "a" is now the most recent
    assert cache.put("c", "C", 400) == ["b"]  # the least recently used goes first
    assert cache.lookup("b") is None and "a" in cache and "c" in cache
    assert cache.put("d", "D", 900) == ["a", "c"]  # as many as needed
    s = cache.stats()
    assert (s.hits, s.misses, s.evictions, s.entries, s.bytes, s.budget_bytes) == (
        1, 1, 3, 1, 900, 1000)


def test_replacing_a_key_and_too_big_entries() -> None:
    cache: EmbeddingCache[str] = EmbeddingCache(100, Clock())
    cache.put("a", "A1", 60)
    assert cache.put("a", "A2", 70) == [] and cache.peek("a") == "A2"  # replaced, no evict
    assert cache.stats().bytes == 70 and cache.stats().evictions == 0
    assert cache.put("huge", "H", 101) == ["huge"]  # over the whole budget: not kept
    assert "huge" not in cache and cache.stats().too_big == 1 and "a" in cache
    assert cache.discard("a") and not cache.discard("a") and len(cache) == 0
    assert cache.stats().bytes == 0
    with pytest.raises(ValueError, match="nbytes"):
        cache.put("x", "X", -1)
    with pytest.raises(ValueError, match="budget_bytes"):
        EmbeddingCache(-1, Clock())


def test_ttl_and_validity_turn_hits_into_misses() -> None:
    clock = Clock()
    cache: EmbeddingCache[str] = EmbeddingCache(1000, clock, ttl_s=10)
    cache.put("a", "A", 10)
    cache.put("b", "B", 10)
    clock.now += 9.9
    assert cache.lookup("a") == "A"
    clock.now += 0.1  # "a" is 10 s old now
    assert cache.lookup("a") is None and "a" not in cache
    cache.put("c", "C", 10)
    assert cache.lookup("c", valid=lambda v: False) is None and "c" not in cache
    assert cache.lookup("missing", valid=lambda v: True) is None
    s = cache.stats()
    assert (s.hits, s.misses, s.expired, s.stale, s.entries) == (1, 3, 1, 1, 1)
    assert cache.peek("b") == "B" and cache.stats().hits == 1  # peek counts nothing


def test_content_hash_and_salted_keys() -> None:
    data = b"\x89PNG fake bytes"
    digest = content_hash(data)
    assert digest == hashlib.sha256(data).hexdigest()
    assert cache_key(digest) == digest  # no salt: the content hash is vLLM's mm_hash
    a, b = cache_key(digest, "tenant-a"), cache_key(digest, "tenant-b")
    assert a != b and a != digest and len(a) == 64
    assert cache_key(digest, "tenant-a") == a


def _png(w: int = 8, h: int = 8, fmt: str = "PNG") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    pixels = np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def test_image_checks_name_the_field() -> None:
    limits = ImageLimits(max_images=2, max_bytes=1 << 16, max_pixels=64 * 64)
    assert open_image(_png(), "images[0].data", limits).size == (8, 8)
    assert open_image(_png(fmt="JPEG"), "f", limits).mode == "RGB"
    cases = [
        (lambda: open_image(b"", "images[0].data", limits), "images[0].data", "empty"),
        (lambda: open_image(b"not an image", "images[1].data", limits), "images[1].data",
         "not an image"),
        (lambda: open_image(_png(fmt="GIF"), "f", limits), "f", "format GIF"),
        (lambda: open_image(_png(65, 64), "f", limits), "f", "4160 pixels"),
        (lambda: open_image(_png(32, 32)[:-200], "f", limits), "f", "not a valid PNG"),
        (lambda: open_image(b"x" * (limits.max_bytes + 1), "f", limits), "f", "bytes"),
        (lambda: check_count(0, limits), "images", "at least one"),
        (lambda: check_count(3, limits), "images", "at most 2"),
    ]
    for call, field, words in cases:
        with pytest.raises(InputError, match=words) as info:
            call()
        assert info.value.field == field and str(info.value).startswith(f"{field}: ")


def test_data_urls() -> None:
    limits = ImageLimits(max_bytes=1 << 12)
    png = _png()
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    assert data_url_bytes(url, "u", limits) == png
    for bad, words in [
        ("http://example.com/a.png", "not a data: URL"),
        ("data:image/gif;base64,AAAA", "media type 'image/gif'"),
        ("data:image/png,AAAA", "must be base64"),
        ("data:image/png;base64,@@not base64@@", "not base64"),
        ("data:image/png;base64," + "A" * 8000, "over 4096 bytes"),
    ]:
        with pytest.raises(InputError, match=words) as info:
            data_url_bytes(bad, "images[0].data_url", limits)
        assert info.value.field == "images[0].data_url"
    with pytest.raises(ValueError, match="max_pixels"):
        ImageLimits(max_pixels=0).validate()


def test_descriptor_protobuf_round_trip() -> None:
    from workers.ec.core import PARAMS_KEY, Descriptor
    from workers.ec.proto import ec_transfer_params, to_pb

    d = Descriptor("kvmesh-ec-producer-e1", b"\x00meta\xff", 4096, 2048, "float32", (4, 128),
                   "7", "/dev/shm/kvmesh-ec-e1-producer-1", 192)
    entry = {PARAMS_KEY: d.to_params(), "metadata": {"image_grid": [1, 2, 3]},
             "item_indices": [0]}
    pb = to_pb("h1", entry, cache_hit=True, content_hash="c1")
    assert (pb.mm_hash, pb.num_tokens, pb.cache_hit, pb.content_hash) == ("h1", 4, True, "c1")
    params = ec_transfer_params([type(pb).FromString(pb.SerializeToString())])
    assert Descriptor.from_params(params["h1"][PARAMS_KEY]) == d
    assert params["h1"]["metadata"] == {"image_grid": [1, 2, 3]}
    with pytest.raises(ValueError, match="'nbytes'"):
        to_pb("h2", {PARAMS_KEY: {**d.to_params(), "nbytes": 3}})
