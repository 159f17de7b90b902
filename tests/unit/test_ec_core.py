"""The EC connector's pure parts (workers.ec.core) and its config builders."""

from __future__ import annotations

import json

import pytest

from workers.ec import configs
from workers.ec.core import (
    HEADER_BYTES,
    STATS_BYTES,
    WORKER_STATS_FIELDS,
    WORKER_STATS_OFFSET,
    Descriptor,
    EcSettings,
    LeaseBook,
    RetainLru,
    SlotAllocator,
    check_header,
    pack_header,
    pack_stats,
    payload_bytes,
    unpack_stats,
)


def _desc(**over: object) -> Descriptor:
    fields: dict[str, object] = {
        "agent": "kvmesh-ec-producer-e1", "agent_metadata": b"\x00\x01meta\xff",
        "addr": 0x7F0000001000, "nbytes": 2048, "dtype": "float32", "shape": (4, 128),
        "handle": "7", "region": "/dev/shm/kvmesh-ec-e1-producer-1", "offset": 64,
    }
    fields.update(over)
    return Descriptor(**fields)  # type: ignore[arg-type]


def test_descriptor_round_trips_through_json() -> None:
    d = _desc()
    params = json.loads(json.dumps(d.to_params()))  # what crosses the orchestrator
    assert Descriptor.from_params(params) == d
    assert d.slot_bytes == HEADER_BYTES + 2048


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("version", 2, "version"),
    ("agent", 5, "'agent'"),
    ("addr", "12", "'addr'"),
    ("addr", True, "'addr'"),
    ("addr", 0, "'addr'"),
    ("nbytes", 100, "'nbytes'"),
    ("shape", [4, "x"], "'shape'"),
    ("dtype", "int3", "dtype"),
    ("agent_metadata", "not base64!", "'agent_metadata'"),
])
def test_bad_descriptor_names_the_field(field: str, value: object, needle: str) -> None:
    params = _desc().to_params()
    params[field] = value
    with pytest.raises(ValueError, match=needle):
        Descriptor.from_params(params)


def test_descriptor_must_be_a_mapping() -> None:
    with pytest.raises(ValueError, match="mapping"):
        Descriptor.from_params(["x"])


def test_payload_bytes() -> None:
    assert payload_bytes("float32", (4, 128)) == 2048
    assert payload_bytes("bfloat16", [3, 5]) == 30
    with pytest.raises(ValueError, match="negative"):
        payload_bytes("float32", (-1, 2))


def test_header_detects_unwritten_freed_and_reused_slots() -> None:
    header = pack_header("img-a", 2048)
    assert len(header) == HEADER_BYTES
    assert check_header(header, "img-a", 2048) is None
    assert "never written" in (check_header(bytes(HEADER_BYTES), "img-a", 2048) or "")
    assert "another embedding" in (check_header(header, "img-b", 2048) or "")
    assert "2048 B" in (check_header(header, "img-a", 1024) or "")
    assert "too short" in (check_header(header[:8], "img-a", 2048) or "")


def test_stats_block_round_trip() -> None:
    block = pack_stats({"published": 3, "released": 2, "expired": 1, "other": 9})
    worker = pack_stats({"encodes": 4, "saves": 1}, WORKER_STATS_FIELDS)
    assert len(block) == len(worker) == WORKER_STATS_OFFSET == STATS_BYTES // 2
    assert unpack_stats(block) == {"published": 3, "released": 2, "expired": 1, "freed": 0,
                                   "held": 0, "publish_failures": 0, "retained": 0,
                                   "evicted": 0}
    both = unpack_stats(block + worker)
    assert both["published"] == 3 and both["encodes"] == 4 and both["saves"] == 1
    assert both["save_mismatches"] == 0


def test_retain_lru_by_bytes() -> None:
    lru = RetainLru(budget=300)
    assert lru.add("a", 100) == [] and lru.add("b", 100) == [] and lru.add("c", 100) == []
    assert lru.bytes == 300 and len(lru) == 3
    assert lru.take("a") and lru.add("a", 100) == []  # "a" is the most recent now
    assert lru.add("d", 150) == ["b", "c"]  # oldest first, until within the budget
    assert "b" not in lru and "a" in lru and lru.bytes == 250 and lru.evicted == 2
    assert lru.add("huge", 400) == ["a", "d", "huge"]  # over the budget on its own
    assert lru.bytes == 0 and lru.pop_oldest() is None and not lru.take("zz")


def test_allocator_first_fit_alignment_and_merge() -> None:
    a = SlotAllocator(1000, alignment=64)  # 960 usable
    x = a.allocate(100)  # 128
    y = a.allocate(64)
    z = a.allocate(700)  # 704
    assert (x, y, z) == (0, 128, 192)
    assert a.allocate(64) == 896  # the last 64 B
    assert a.allocate(1) is None
    assert a.used_bytes == 960
    a.free(128)
    a.free(0)  # merges with 128's range: 192 B free at 0
    assert a.allocate(192) == 0
    a.free(0)
    a.free(192)
    with pytest.raises(KeyError):
        a.free(192)
    with pytest.raises(ValueError):
        a.allocate(0)


def test_allocator_returns_none_when_nothing_fits() -> None:
    a = SlotAllocator(256, alignment=64)
    assert a.allocate(257) is None
    assert a.allocate(256) == 0


def test_leases_free_after_read_not_before() -> None:
    book = LeaseBook(lease_s=30)
    book.add("img")
    book.hold("img", "r1")
    assert book.done("img", "r1", "h1", now=100.0) == []  # published: kept for the reader
    assert "img" in book and book.pending() == 1
    assert book.expire(now=129.9) == []
    assert book.release("h1") == ["img"]  # the consumer read it
    assert "img" not in book and book.released == 1 and book.expired == 0
    assert book.release("h1") == []  # a duplicate notification is ignored


def test_leases_expire_unread_handles() -> None:
    book = LeaseBook(lease_s=5)
    book.hold("img", "r1")
    book.done("img", "r1", "h1", now=0.0)
    assert book.expire(now=4.99) == []
    assert book.expire(now=5.0) == ["img"]
    assert book.expired == 1
    assert book.release("h1") == []  # a read that arrives after the lease: ignored


def test_leases_shared_slot_needs_every_holder_and_handle() -> None:
    book = LeaseBook(lease_s=10)
    book.hold("img", "r1")
    book.hold("img", "r2")  # the same image in a second live request
    assert book.done("img", "r1", "h1", now=0.0) == []
    assert book.release("h1") == []  # r2 still uses the slot
    assert book.done("img", "r2", "h2", now=1.0) == []
    assert book.expire(now=10.5) == []  # h2's lease ends at 11
    assert book.expire(now=11.0) == ["img"]


def test_unpublished_request_frees_at_once() -> None:
    book = LeaseBook(lease_s=10)
    book.hold("img", "r1")
    assert book.done("img", "r1", None, now=0.0) == ["img"]  # aborted: no handle


def test_settings_from_extra() -> None:
    s = EcSettings.from_extra({"lease_s": "12", "pool_mib": 8})
    assert s.lease_s == 12.0 and s.pool_bytes == 8 << 20
    assert EcSettings.from_extra({"shared_storage_path": "/x"}) == EcSettings()
    with pytest.raises(ValueError, match="unknown keys \\['lease'\\]"):
        EcSettings.from_extra({"lease": 3})
    with pytest.raises(ValueError, match="lease_s"):
        EcSettings.from_extra({"lease_s": 0})
    with pytest.raises(ValueError, match="ec_connector_extra_config"):
        EcSettings.from_extra({"pool_mib": "many"})


def test_nixl_config_builder() -> None:
    cfg = configs.nixl_ec_transfer_config("ec_producer", lease_s=5, pool_mib=16)
    assert cfg["ec_connector"] == "KvmeshECConnector"
    assert cfg["ec_connector_module_path"] == "workers.ec.connector"
    assert cfg["ec_role"] == "ec_producer" and cfg["ec_buffer_device"] == "cpu"
    assert cfg["ec_connector_extra_config"] == {"lease_s": 5, "pool_mib": 16}
    other = configs.nixl_ec_transfer_config("ec_producer")
    assert other["engine_id"] != cfg["engine_id"]  # fresh per launch
    with pytest.raises(ValueError, match="role"):
        configs.nixl_ec_transfer_config("ec_both")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lease_s"):
        configs.nixl_ec_transfer_config("ec_consumer", lease_s=-1)


def test_example_config_and_backend_switch() -> None:
    cfg = configs.ec_transfer_config("ec_consumer", "example", shared_storage_path="/tmp/ec")
    assert cfg["ec_connector"] == "ECExampleConnector"
    assert cfg["ec_connector_extra_config"] == {"shared_storage_path": "/tmp/ec"}
    assert configs.ec_transfer_config("ec_consumer")["ec_connector"] == "KvmeshECConnector"
    with pytest.raises(ValueError, match="shared_storage_path"):
        configs.ec_transfer_config("ec_consumer", "example")
    with pytest.raises(ValueError, match="nixl backend only"):
        configs.ec_transfer_config("ec_consumer", "example", shared_storage_path="/x",
                                   lease_s=3)
    with pytest.raises(ValueError, match="backend"):
        configs.ec_transfer_config("ec_consumer", "mooncake")  # type: ignore[arg-type]
