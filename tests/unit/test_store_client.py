"""StoreClient's protocol against the real store master (core and gRPC servicer, in
process, fake clock) behind the client's ``stub`` seam, with a fake NIXL agent (no
network): both from :mod:`tests.store_inproc`.

"Remote" segments are numpy buffers mounted in the master as other store clients would
mount them; the fake agent copies bytes with memmove and fails transfers to agents marked
dead. Only the transport is skipped: each stub call runs the servicer's RPC method, which
calls the core, so codes, placement and batching are the master's own.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.store_inproc import CoreMaster, FakeAgent
from workers.kv.store_client import StoreClient, decode_endpoint, encode_endpoint


@pytest.fixture
def world() -> tuple[CoreMaster, FakeAgent, StoreClient]:
    master, agent = CoreMaster(), FakeAgent()
    master.add_segment("s0", 1 << 16, "node0")
    master.add_segment("s1", 1 << 16, "node1")
    client = StoreClient("127.0.0.1:1", stub=master.stub(), agent=agent)
    return master, agent, client


def test_endpoint_roundtrip() -> None:
    md = bytes(range(256))
    assert decode_endpoint(encode_endpoint(md)) == md
    with pytest.raises(ValueError):
        decode_endpoint("host:1234")


def test_gather_put_scatter_get_with_replicas(
        world: tuple[CoreMaster, FakeAgent, StoreClient]) -> None:
    master, agent, client = world
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    s, d = int(src.ctypes.data), int(dst.ctypes.data)
    res = client.put_many([("a", [(s, 100), (s + 1000, 50)]), ("b", [(s + 2000, 30)])],
                          replicas=2)
    assert res == ["ok", "ok"]
    # One WRITE per remote agent for all keys, between one BatchPutStart and one BatchPutEnd.
    assert sorted(x[1] for x in agent.xfers) == ["node0", "node1"]
    assert all(x[2] == 3 for x in agent.xfers)
    assert master.calls == [("BatchPutStart", ["a", "b"]), ("BatchPutEnd", ["a", "b"])]
    assert master.complete("a") and master.complete("b")
    assert sorted(r.segment_id for r in master.core.get_object("a").replicas) == ["s0", "s1"]  # type: ignore[union-attr]
    assert client.put("a", [(s, 150)]) == "exists"
    got = client.get_many([("a", [(d, 120), (d + 500, 30)]), ("zz", [(d, 1)]),
                           ("b", [(d + 900, 30)])])
    assert got == ["ok", "missing", "ok"]
    assert (dst[:100] == src[:100]).all() and (dst[100:120] == src[1000:1020]).all()
    assert (dst[500:530] == src[1020:1050]).all() and (dst[900:930] == src[2000:2030]).all()
    assert client.get("a", [(d, 10)]) == "failed"  # wrong size is not a miss
    assert client.exists_prefix(["a", "b", "zz", "a"]) == 2
    assert client.counters.gets == 2 and client.counters.get_misses == 1


def test_failed_write_is_revoked_and_read_falls_back(
        world: tuple[CoreMaster, FakeAgent, StoreClient]) -> None:
    master, agent, client = world
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(256, dtype=np.uint8)
    s, d = int(src.ctypes.data), int(dst.ctypes.data)
    agent.dead.add("node1")
    assert client.put("x", [(s, 64)], replicas=2) == "failed"
    assert master.calls == [("BatchPutStart", ["x"]), ("BatchPutRevoke", ["x"])]
    assert master.core.get_object("x") is None and master.core.used() == 0
    agent.dead.clear()
    assert client.put("x", [(s, 64)], replicas=2) == "ok"
    agent.dead.add("node0")  # the first replica's owner is gone: read the second
    agent.xfers.clear()
    assert client.get("x", [(d, 64)]) == "ok" and (dst[:64] == src[:64]).all()
    assert agent.xfers == [("READ", "node0", 1), ("READ", "node1", 1)]
    agent.dead.add("node1")
    assert client.get("x", [(d, 64)]) == "failed"
    # A put that finds no room fails cleanly (nothing to revoke).
    del master.calls[:]
    assert client.put("big", [(s, 1)] * 1 + [(s, (1 << 16) + 1)]) == "failed"
    assert master.calls == [("BatchPutStart", ["big"])]
    assert master.core.get_object("big") is None


def test_incomplete_object_is_a_miss(
        world: tuple[CoreMaster, FakeAgent, StoreClient]) -> None:
    master, _, client = world
    master.core.put_start("w", 8)
    dst = np.zeros(8, dtype=np.uint8)
    assert client.get("w", [(int(dst.ctypes.data), 8)]) == "missing"
    assert client.exists_prefix(["w"]) == 0
