"""The EC connector's worker half and shared region, without engines or NIXL."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from workers.ec.core import HEADER_BYTES, STATS_BYTES, check_header, unpack_stats
from workers.ec.metadata import EcMeta, SlotItem
from workers.ec.transport import Region, region_path, sweep_stale
from workers.ec.worker import EcWorker

SIZE = 1 << 16
B = STATS_BYTES  # a producer region's slots follow its stats block


@pytest.fixture
def region(tmp_path: Path) -> Iterator[Region]:
    r = Region.create(region_path(str(tmp_path), "e1", "producer"), SIZE)
    yield r
    r.close(unlink=True)


def _meta(region: Region, **kw: Any) -> EcMeta:
    return EcMeta(region.path, region.nbytes, **kw)


def _slot(mm_hash: str, offset: int, shape: tuple[int, ...] = (4, 8)) -> SlotItem:
    return SlotItem(mm_hash, offset, 4 * shape[0] * shape[1], "float32", shape)


def test_producer_writes_payload_then_header_and_consumer_loads_it(region: Region) -> None:
    emb = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    slot = _slot("img", B + 64)
    producer = EcWorker()
    cache: dict[str, torch.Tensor] = {}
    producer.start_save_caches(_meta(region, saves=[slot]), cache)  # not encoded yet
    assert check_header(region.read(B + 64, HEADER_BYTES), "img", slot.nbytes) is not None
    cache["img"] = emb
    producer.save_caches(cache, "img")  # vLLM just encoded it
    assert check_header(region.read(B + 64, HEADER_BYTES), "img", slot.nbytes) is None
    assert producer.counters() == {"encodes": 1, "saves": 1, "save_bytes": 128}
    stats = unpack_stats(region.read(0, STATS_BYTES))  # for the encoder service
    assert stats["encodes"] == 1 and stats["saves"] == 1 and stats["save_bytes"] == 128

    consumer = EcWorker()  # maps the same file, as a worker in another process would
    loaded: dict[str, torch.Tensor] = {}
    consumer.start_load_caches(_meta(region, loads=[slot]), loaded)
    assert torch.equal(loaded["img"], emb) and loaded["img"].dtype == torch.float32
    region.write(B + 64 + HEADER_BYTES, bytes(128))  # the copy does not alias the region
    assert torch.equal(loaded["img"], emb)
    producer.shutdown()
    consumer.shutdown()


def test_producer_publishes_an_item_already_in_the_encoder_cache(region: Region) -> None:
    worker = EcWorker()
    cache = {"img": torch.ones(4, 8)}
    worker.start_save_caches(_meta(region, saves=[_slot("img", B + 128)]), cache)
    assert check_header(region.read(B + 128, HEADER_BYTES), "img", 128) is None
    worker.shutdown()


def test_shape_mismatch_is_not_published(region: Region) -> None:
    worker = EcWorker()
    cache = {"img": torch.ones(5, 8)}
    worker.start_save_caches(_meta(region, saves=[_slot("img", B)]), cache)
    assert "never written" in (check_header(region.read(B, HEADER_BYTES), "img", 128) or "")
    assert worker.counters() == {"save_mismatches": 1}
    worker.shutdown()


def test_dropped_pending_save_is_forgotten(region: Region) -> None:
    worker = EcWorker()
    cache: dict[str, torch.Tensor] = {}
    worker.start_save_caches(_meta(region, saves=[_slot("img", 0)]), cache)
    worker.start_save_caches(_meta(region, drops=["img"]), cache)  # slot freed meanwhile
    cache["img"] = torch.ones(4, 8)
    worker.save_caches(cache, "img")
    assert worker.counters() == {"encodes": 1}  # encoded, not saved
    worker.shutdown()


def test_consumer_keeps_what_the_encoder_cache_has(region: Region) -> None:
    worker = EcWorker()
    mine = torch.full((4, 8), 7.0)
    cache = {"img": mine}
    worker.start_load_caches(_meta(region, loads=[_slot("img", 0)]), cache)
    assert cache["img"] is mine


def test_stale_region_files_are_swept(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    stale = Path(region_path(str(tmp_path), "old", "consumer", int(dead.stdout)))
    stale.write_bytes(b"x")
    live = Path(region_path(str(tmp_path), "new", "consumer", os.getpid()))
    live.write_bytes(b"x")
    assert sweep_stale(str(tmp_path)) == [str(stale)]
    assert live.exists() and not stale.exists()


def test_open_refuses_a_smaller_file(tmp_path: Path) -> None:
    path = region_path(str(tmp_path), "e2", "producer")
    Region.create(path, 4096).close()
    with pytest.raises(ValueError, match="smaller"):
        Region.open(path, 8192)
