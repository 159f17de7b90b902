"""Multimodal keys in kvmesh block hashes: vLLM's rule, the router's and the events' side.

The keys per block are checked against vLLM 0.32's own ``_gen_mm_extra_hash_keys`` and
``to_event_extra_keys`` (the published, untagged form, through a msgpack round trip), so
the router's hashes (from placeholder spans) equal the event translator's (from
``BlockStored.extra_keys``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from services.common.block_hash import MmSpan, block_hashes, mm_block_keys
from workers.kv.event_translate import EventTranslator, event_mm_keys, event_salt

BS = 4
IMG = 9  # every image token has the same id


def _prompt(n_text: int, n_img: int, n_tail: int) -> list[int]:
    return list(range(100, 100 + n_text)) + [IMG] * n_img + list(range(200, 200 + n_tail))


def _vllm_keys(spans: list[MmSpan], n_tokens: int) -> list[tuple[Any, ...] | None]:
    from vllm.v1.core.kv_cache_utils import _gen_mm_extra_hash_keys

    feats = [SimpleNamespace(identifier=s.identifier,
                             mm_position=SimpleNamespace(offset=s.offset, length=s.length))
             for s in spans]
    req = SimpleNamespace(mm_features=feats)
    out: list[tuple[Any, ...] | None] = []
    idx = 0
    for b in range(n_tokens // BS):
        keys, idx = _gen_mm_extra_hash_keys(req, b * BS, (b + 1) * BS, idx)  # type: ignore[arg-type]
        out.append(tuple(keys) or None)
    return out


@pytest.mark.parametrize("spans", [
    [MmSpan("a", 3, 7)],  # starts mid-block, spans three blocks
    [MmSpan("a", 4, 4)],  # exactly one block
    [MmSpan("a", 1, 2), MmSpan("b", 3, 6)],  # two images in one block, then one more
])
def test_keys_follow_vllms_rule(spans: list[MmSpan]) -> None:
    n = 16
    ours = mm_block_keys(spans, n, BS)
    theirs = _vllm_keys(spans, n)
    assert [tuple(("mm", i, o) for i, o in k) or None for k in ours] == theirs


def _event(tokens: list[int], spans: list[MmSpan], salt: str = "") -> dict[str, Any]:
    """A BlockStored as vLLM publishes it (untagged extra keys), after msgpack."""
    from vllm.v1.core.kv_cache_utils import to_event_extra_keys

    tagged = _vllm_keys(spans, len(tokens))
    if salt:
        tagged[0] = (*(tagged[0] or ()), ("cache_salt", salt))
    n = len(tokens) // BS
    raw = {"type": "BlockStored", "block_hashes": [f"e{i}".encode() for i in range(n)],
           "parent_block_hash": None, "token_ids": tokens, "block_size": BS,
           "medium": "GPU", "lora_id": None, "lora_name": None,
           "extra_keys": to_event_extra_keys(tagged)}
    return dict(msgspec.msgpack.decode(msgspec.msgpack.encode(raw)))


@pytest.mark.parametrize("salt", ["", "tenant-a"])
def test_router_and_event_hashes_agree(salt: str) -> None:
    tokens = _prompt(3, 7, 6)  # 16 tokens, image in blocks 0-2
    spans = [MmSpan("img-a", 3, 7)]
    router = block_hashes(tokens, BS, salt=salt, mm_keys=mm_block_keys(spans, 16, BS))
    raw = _event(tokens, spans, salt)
    assert event_salt(raw) == salt
    assert event_mm_keys(raw)[1] == (("img-a", -1),)
    (ev,) = EventTranslator(BS).translate(raw)
    assert list(ev.block_hashes) == router


def test_different_images_behind_the_same_text_differ_from_the_image_block() -> None:
    tokens = _prompt(5, 4, 7)  # image in block 1 (offset 5) and block 2 (offset -3)
    a = block_hashes(tokens, BS, mm_keys=mm_block_keys([MmSpan("a", 5, 4)], 16, BS))
    b = block_hashes(tokens, BS, mm_keys=mm_block_keys([MmSpan("b", 5, 4)], 16, BS))
    plain = block_hashes(tokens, BS)
    assert a[0] == b[0] == plain[0]  # the text before the image is shared
    assert a[1] != b[1] and a[2] != b[2] and a[3] != b[3]  # then nothing is
    assert a[1] != plain[1]  # and an image block never equals the text-only hash
    # The same image at another position is another prefix too.
    moved = block_hashes(tokens, BS, mm_keys=mm_block_keys([MmSpan("a", 4, 4)], 16, BS))
    assert moved[1] != a[1]


def test_text_only_hashes_unchanged() -> None:
    tokens = list(range(30))
    assert block_hashes(tokens, BS, mm_keys=mm_block_keys([], 30, BS)) == \
        block_hashes(tokens, BS)
    assert event_mm_keys({"extra_keys": None}) == []
    assert event_mm_keys({"extra_keys": [None, ["salt"], [b"digest"]]}) == [(), (), ()]
