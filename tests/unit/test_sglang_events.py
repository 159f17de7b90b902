"""SGLang KV events → kvmesh events (workers.kv.sglang_events + the relay's translation).

The wire sample is a batch encoded by SGLang 0.5.23's own ``KVEventBatch`` /
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` (``.sglvenv``, page size 4):
a salted two-page store, its child page, a short page (block_size 2), a CPU_PINNED
store, a removal and a clear. It is decoded as the relay decodes ZMQ payloads.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import msgspec
import pytest

from services.common.block_hash import block_hashes
from workers.kv.event_relay import EventEndpoints, KvEventRelay
from workers.kv.event_translate import EventTranslator, TranslatedEvent
from workers.kv.sglang_events import SglangEventConverter, medium_of

SAMPLE = (
    "k8s/+AAAAAAAAJaJpHR5cGWrQmxvY2tTdG9yZWSsYmxvY2tfaGFzaGVzkvsHsXBhcmVudF9ibG9ja19oYXNo"
    "wKl0b2tlbl9pZHOYCgsMDQ4PEBGqYmxvY2tfc2l6ZQSnbG9yYV9pZMCmbWVkaXVto0dQVapjYWNoZV9zYWx0"
    "qHRlbmFudC1hqnNlc3Npb25faWSiczGHpHR5cGWrQmxvY2tTdG9yZWSsYmxvY2tfaGFzaGVzkQmxcGFyZW50"
    "X2Jsb2NrX2hhc2gHqXRva2VuX2lkc5QeHyAhqmJsb2NrX3NpemUEp2xvcmFfaWTApm1lZGl1baNHUFWHpHR5"
    "cGWrQmxvY2tTdG9yZWSsYmxvY2tfaGFzaGVzkQuxcGFyZW50X2Jsb2NrX2hhc2gJqXRva2VuX2lkc5IoKapi"
    "bG9ja19zaXplAqdsb3JhX2lkwKZtZWRpdW2jR1BVh6R0eXBlq0Jsb2NrU3RvcmVkrGJsb2NrX2hhc2hlc5EM"
    "sXBhcmVudF9ibG9ja19oYXNowKl0b2tlbl9pZHOUAQIDBKpibG9ja19zaXplBKdsb3JhX2lkwKZtZWRpdW2q"
    "Q1BVX1BJTk5FRIOkdHlwZaxCbG9ja1JlbW92ZWSsYmxvY2tfaGFzaGVzkQmmbWVkaXVto0dQVYGkdHlwZbBB"
    "bGxCbG9ja3NDbGVhcmVkAA=="
)
PAGE = 4


def sample_events() -> list[dict]:  # type: ignore[type-arg]
    batch = msgspec.msgpack.Decoder().decode(base64.b64decode(SAMPLE))
    assert batch[0] == 1.5 and batch[2] == 0  # [ts, events, attn_dp_rank], positional
    return list(batch[1])


def test_the_sample_has_sglangs_shape() -> None:
    events = sample_events()
    assert [e["type"] for e in events] == ["BlockStored"] * 4 + ["BlockRemoved",
                                                               "AllBlocksCleared"]
    first = events[0]
    assert first["cache_salt"] == "tenant-a" and first["session_id"] == "s1"
    assert "extra_keys" not in first and "group_idx" not in first
    assert "cache_salt" not in events[1]  # None fields are omitted
    assert events[3]["medium"] == "CPU_PINNED"


def translate_all(events: list[dict]) -> tuple[list[TranslatedEvent], EventTranslator,  # type: ignore[type-arg]
                                              SglangEventConverter]:
    conv = SglangEventConverter(PAGE)
    tr = EventTranslator(PAGE)
    out: list[TranslatedEvent] = []
    for raw in events:
        converted = conv.convert(raw)
        if converted is not None:
            out.extend(tr.translate(converted))
    return out, tr, conv


def test_stored_blocks_get_kvmesh_hashes_from_their_tokens_and_salt() -> None:
    out, _, conv = translate_all(sample_events()[:4])
    salted = block_hashes(list(range(10, 18)), PAGE, salt="tenant-a")
    child = block_hashes([30, 31, 32, 33], PAGE, parent=salted[-1])
    assert out[0] == TranslatedEvent("stored", tuple(salted), "device")
    assert out[1] == TranslatedEvent("stored", tuple(child), "device")
    # the short page (block_size 2) is not a kvmesh block; CPU_PINNED is the host tier
    assert out[2] == TranslatedEvent("stored", tuple(block_hashes([1, 2, 3, 4], PAGE)),
                                     "host")
    assert len(out) == 3 and conv.skipped == {"block_size": 1}
    # the salted chain equals the router's hash of the same salted prompt
    assert (*salted, *child) == tuple(block_hashes([*range(10, 18), 30, 31, 32, 33], PAGE,
                                                   salt="tenant-a"))


def test_removal_and_clear() -> None:
    out, tr, _ = translate_all(sample_events())
    child = block_hashes([30, 31, 32, 33], PAGE,
                         parent=block_hashes(list(range(10, 18)), PAGE, salt="tenant-a")[-1])
    assert out[3] == TranslatedEvent("removed", tuple(child), "device")
    assert out[4] == TranslatedEvent("cleared")
    assert tr.state() == {}


def test_sglang_and_vllm_events_give_the_same_kvmesh_events() -> None:
    """The same cached tokens announced by either engine: the index cannot tell them
    apart (vLLM carries the salt in extra_keys, hashes are bytes-like, no cache_salt)."""
    sgl = sample_events()[:2]
    vllm: list[dict[str, Any]] = [
        {"type": "BlockStored", "block_hashes": [b"a", b"b"], "parent_block_hash": None,
         "token_ids": list(range(10, 18)), "block_size": PAGE, "lora_id": None,
         "medium": "GPU", "extra_keys": [["tenant-a"], None]},
        {"type": "BlockStored", "block_hashes": [b"c"], "parent_block_hash": b"b",
         "token_ids": [30, 31, 32, 33], "block_size": PAGE, "lora_id": None,
         "medium": "GPU"},
    ]
    tr = EventTranslator(PAGE)
    from_vllm = [e for raw in vllm for e in tr.translate(raw)]
    assert translate_all(sgl)[0] == from_vllm


def test_lora_and_bigram_stores_are_dropped_and_counted() -> None:
    conv = SglangEventConverter(PAGE)
    base = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
            "token_ids": [1, 2, 3, 4], "block_size": PAGE, "lora_id": None}
    assert conv.convert({**base, "lora_name": "adapter"}) is None
    assert conv.convert({**base, "token_ids": [[1, 2], [2, 3], [3, 4], [4, 5]]}) is None
    assert conv.skipped == {"lora": 1, "tokens": 1}
    assert conv.convert({"type": "Other"}) == {"type": "Other"}  # the translator refuses it


@pytest.mark.parametrize(("medium", "tier"), [("GPU", "GPU"), ("CPU_PINNED", "CPU"),
                                              ("DISK", "DISK"), ("EXTERNAL", "STORAGE"),
                                              (None, None)])
def test_media(medium: str | None, tier: str | None) -> None:
    assert medium_of(medium) == tier


async def test_the_relay_converts_an_sglang_payload(tmp_path: Path) -> None:
    """A ZMQ payload as SGLang sends it, through the relay's decode + convert +
    translate (no sockets: the relay is not started)."""
    relay = KvEventRelay("w-sgl", PAGE, "redis://127.0.0.1:9", "s",
                         EventEndpoints(tmp_path, "", ""), convert=SglangEventConverter(PAGE))
    try:
        relay._apply_payload(base64.b64decode(SAMPLE))
        state = relay.state()
        # everything was cleared at the end of the batch; the events are numbered 0..4
        assert list(state.tiers) == [] and state.event_id == 4
        assert relay.stats.bad_payloads == 0
    finally:
        await relay.close()
