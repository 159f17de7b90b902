"""EPD in the router: the encoder pick (affinity, load, exclusion, release) and the
servicer's image items (checks, the images' block keys in every hash). No network."""

from __future__ import annotations

import random

import grpc
import pytest

from protos import discovery_pb2, router_pb2
from services.common.block_hash import MmSpan, block_hashes, mm_block_keys
from services.indexer.core import KvEvent, KvIndex
from services.router.core import RouterCore
from services.router.encoders import EncoderPicker, EncoderRecord
from services.router.overlaps import EmbeddedSource, HistorySource
from services.router.policy_setup import default_registry
from services.router.service import InflightExpiry, RouterServicer

E1, E2, E3 = (EncoderRecord(f"e{i}", f"addr-{i}", "m") for i in (1, 2, 3))


def test_text_only_and_no_encoder_get_none() -> None:
    p = EncoderPicker()
    assert p.pick("r", "m", []) is None
    assert p.pick("r", "m", ["h"]) is None  # none registered
    p.set_encoders([EncoderRecord("x", "a", "other-model")])
    assert p.pick("r", "m", ["h"]) is None and p.in_flight() == {"x": 0}


def test_affinity_first_then_load_then_id() -> None:
    p = EncoderPicker()
    p.set_encoders([E2, E1])
    first = p.pick("r1", "m", ["a", "b"])
    assert first is not None and first.encoder == E1 and first.affinity_items == 0  # by id
    # r2 has new images: e1 has one in flight, so e2 (load)
    second = p.pick("r2", "m", ["c"])
    assert second is not None and second.encoder == E2
    # r3 repeats r1's images: affinity beats e1's load
    third = p.pick("r3", "m", ["b", "a", "c"])
    assert third is not None and third.encoder == E1 and third.affinity_items == 2
    assert p.in_flight() == {"e1": 2, "e2": 1}
    assert p.release("r1") and p.release("r3") and not p.release("r3")
    assert p.in_flight() == {"e1": 0, "e2": 1}
    # every image of r3 now points at e1, "c" included
    again = p.pick("r4", "m", ["c"])
    assert again is not None and again.encoder == E1 and again.affinity_items == 1


def test_exclude_and_gone_encoders() -> None:
    p = EncoderPicker()
    p.set_encoders([E1, E2])
    assert (pick := p.pick("r1", "m", ["a"])) is not None and pick.encoder == E1
    other = p.pick("r2", "m", ["a"], exclude=["e1"])
    assert other is not None and other.encoder == E2
    p.set_encoders([E2, E3])  # e1 went away: its requests and affinity go with it
    assert p.in_flight() == {"e2": 1, "e3": 0}
    assert not p.release("r1")
    # "a" was last sent to e2
    assert (again := p.pick("r3", "m", ["a"])) is not None and again.encoder == E2


def test_affinity_memory_is_bounded() -> None:
    p = EncoderPicker(max_entries=2)
    p.set_encoders([E1])
    for i, key in enumerate("abc"):
        p.pick(f"r{i}", "m", [key])
    assert p.affinity_size() == 2
    with pytest.raises(ValueError):
        EncoderPicker(max_entries=0)


class Aborted(Exception):
    pass


class FakeContext:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


def _worker(i: str, *caps: str) -> discovery_pb2.InstanceRecord:
    return discovery_pb2.InstanceRecord(instance_id=i, component="worker", address=f"a-{i}",
                                        model="m", role=discovery_pb2.WORKER_ROLE_AGG,
                                        block_size=4, max_model_len=4096,
                                        capabilities=["images", *caps])


def _servicer(source: object | None = None) -> RouterServicer:
    core = RouterCore(policy=default_registry().create("kv", random.Random(0)),
                      clock=lambda: 0.0)
    s = RouterServicer(core, {}, source or HistorySource())  # type: ignore[arg-type]
    s.set_records({"w1": _worker("w1", "ec_consumer")})
    s.set_encoders({"e1": discovery_pb2.InstanceRecord(
        instance_id="e1", component="encoder", address="enc:1", model="m",
        role=discovery_pb2.WORKER_ROLE_ENCODE)})
    return s


IMG = 9
PROMPT = list(range(100, 105)) + [IMG] * 4 + list(range(200, 207))  # 16 tokens, bs 4


def _route(rid: str, mm: str | None, **kw: object) -> router_pb2.RouteRequest:
    items = [router_pb2.MmItem(mm_hash=mm, offset=5, length=4)] if mm else []
    return router_pb2.RouteRequest(request_id=rid, model="m", token_ids=PROMPT,
                                   mm_items=items, **kw)  # type: ignore[arg-type]


async def test_route_picks_an_encoder_for_images_only() -> None:
    s = _servicer()
    text = await s.Route(_route("t", None), FakeContext())  # type: ignore[arg-type]
    assert not text.HasField("encoder")
    img = await s.Route(_route("i", "img-a"), FakeContext())  # type: ignore[arg-type]
    assert img.encoder.instance_id == "e1" and img.encoder.address == "enc:1"
    assert s.encoders.in_flight() == {"e1": 1}
    await s.Release(router_pb2.ReleaseRequest(request_id="i"), FakeContext())  # type: ignore[arg-type]
    assert s.encoders.in_flight() == {"e1": 0}
    await s.Route(_route("j", "img-b"), FakeContext())  # type: ignore[arg-type]
    await s.PrefillDone(router_pb2.PrefillDoneRequest(request_id="j"),
                        FakeContext())  # type: ignore[arg-type]
    assert s.encoders.in_flight() == {"e1": 0}  # E's part ended before the first token
    excluded = await s.Route(_route("x", "img-a", exclude_instance_ids=["e1"]),
                             FakeContext())  # type: ignore[arg-type]
    assert not excluded.HasField("encoder") and excluded.encoder_skipped == "no_encoder"
    assert text.encoder_skipped == ""


async def test_no_encoder_is_asked_when_the_computing_worker_reads_no_embeddings() -> None:
    """E.g. D served alone in E/P/D: it encodes the images itself, so E is left alone."""
    s = _servicer()
    s.set_records({"w1": _worker("w1")})  # images, but no ec_consumer
    resp = await s.Route(_route("i", "img-a"), FakeContext())  # type: ignore[arg-type]
    assert not resp.HasField("encoder") and resp.encoder_skipped == "not_ec_consumer"
    assert s.encoders.in_flight() == {"e1": 0} and s.encoders.affinity_size() == 0


@pytest.mark.parametrize(("items", "words"), [
    ([router_pb2.MmItem(mm_hash="", offset=0, length=1)], "mm_items[0].mm_hash"),
    ([router_pb2.MmItem(mm_hash="a", offset=14, length=4)], "mm_items[0]: range [14, 18)"),
    ([router_pb2.MmItem(mm_hash="a", offset=3, length=0)], "mm_items[0]: range"),
    ([router_pb2.MmItem(mm_hash="a", offset=2, length=4),
      router_pb2.MmItem(mm_hash="b", offset=4, length=2)], "mm_items[1]: range [4, 6)"),
])
async def test_bad_mm_items_are_invalid_argument(items: list[router_pb2.MmItem],
                                                 words: str) -> None:
    s = _servicer()
    req = router_pb2.RouteRequest(request_id="r", model="m", token_ids=PROMPT,
                                  mm_items=items)
    with pytest.raises(Aborted) as info:
        await s.Route(req, FakeContext())  # type: ignore[arg-type]
    assert info.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert words in info.value.args[1]
    assert s.encoders.in_flight() == {"e1": 0}


async def test_a_different_image_behind_the_same_text_overlaps_only_before_it() -> None:
    """The worker cached the prompt with image a (its events hash with a's keys): the
    same prompt with image b matches the first block only (the text before the image)."""
    index = KvIndex()
    keys = mm_block_keys([MmSpan("img-a", 5, 4)], len(PROMPT), 4)
    index.apply(KvEvent("w1", 0, "stored", tuple(block_hashes(PROMPT, 4, mm_keys=keys)),
                        "device"))
    s = _servicer(EmbeddedSource(index))
    same = await s.Route(_route("r1", "img-a"), FakeContext())  # type: ignore[arg-type]
    assert same.predicted_overlap_blocks == 4
    other = await s.Route(_route("r2", "img-b"), FakeContext())  # type: ignore[arg-type]
    assert other.predicted_overlap_blocks == 1  # block 0: text only; block 1 holds the image
    text = await s.Route(_route("r3", None), FakeContext())  # type: ignore[arg-type]
    assert text.predicted_overlap_blocks == 1  # without keys the image blocks never match


async def test_expiry_drops_encoder_picks_too() -> None:
    s = _servicer()
    await s.Route(_route("i", "img-a"), FakeContext())  # type: ignore[arg-type]
    core = s._core  # noqa: SLF001
    core.clock = lambda: 10.0  # routed at 0: now older than the TTL
    core.inflight_ttl_s = 1.0
    expiry = InflightExpiry(core, 60.0, s.metrics, on_drop=s.encoders.release)
    await expiry._expire()  # noqa: SLF001 - one tick, no task
    assert s.encoders.in_flight() == {"e1": 0} and core.in_flight_count() == 0
