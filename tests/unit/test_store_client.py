"""StoreClient's protocol against the real store master (core and gRPC servicer, in
process, fake clock) behind the client's ``stub`` seam, with a fake NIXL agent (no network).

"Remote" segments are numpy buffers mounted in the master as other store clients would
mount them; the fake agent copies bytes with memmove and fails transfers to agents marked
dead. Only the transport is skipped: each stub call runs the servicer's RPC method, which
calls the core, so codes, placement and batching are the master's own.
"""

from __future__ import annotations

import ctypes
import random
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
import numpy as np
import pytest

from services.store_master.core import FreeRatioFirstStrategy, MasterParams, StoreMaster
from services.store_master.persist import Persister
from services.store_master.service import StoreMasterServicer
from tests.manual_clock import Clock
from workers.kv.store_client import StoreClient, decode_endpoint, encode_endpoint


class AbortError(grpc.RpcError):
    """What ``context.abort`` raises: the status a real channel would report."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class AbortingContext:
    """The part of ``grpc.aio.ServicerContext`` the servicer uses."""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise AbortError(code, details)


def run_now(coro: Coroutine[Any, Any, Any]) -> Any:
    """Runs a coroutine that never suspends (the servicer with persistence off) to its end."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise AssertionError("the servicer suspended; run it on an event loop instead")


def keys_of(req: Any) -> list[str]:
    if hasattr(req, "items"):
        return [it.key for it in req.items]
    if hasattr(req, "keys"):
        return list(req.keys)
    return [req.key] if hasattr(req, "key") else []


class CoreMaster:
    """A real :class:`StoreMaster` (free-ratio-first placement, so replica order is known)
    served by the real :class:`StoreMasterServicer`; ``calls`` logs (rpc, keys)."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.core = StoreMaster(self.clock, random.Random(0), MasterParams(client_ttl_s=1e9),
                                strategy=FreeRatioFirstStrategy())
        self.servicer = StoreMasterServicer(self.core, Persister(self.core, None))
        self.calls: list[tuple[str, list[str]]] = []
        self._buffers: list[np.ndarray] = []
        self._lock = threading.Lock()  # the client may call from several threads

    def add_segment(self, seg: str, nbytes: int, agent: str) -> np.ndarray:
        """Mounts a ``nbytes`` buffer as segment ``seg`` of the NIXL agent named ``agent``."""
        buf = np.zeros(nbytes, dtype=np.uint8)
        self._buffers.append(buf)
        self.core.mount_segment(f"owner-{agent}", seg, int(buf.ctypes.data), nbytes,
                                encode_endpoint(agent.encode()))
        return buf

    def complete(self, key: str) -> bool:
        obj = self.core.get_object(key)
        return obj is not None and obj.complete

    def rpc(self, name: str) -> Callable[..., Any]:
        method = getattr(self.servicer, name)

        def call(req: Any, timeout: float | None = None) -> Any:
            with self._lock:
                self.calls.append((name, keys_of(req)))
                return run_now(method(req, AbortingContext()))
        return call

    def stub(self) -> Any:
        class Stub:
            def __getattr__(_, name: str) -> Callable[..., Any]:  # noqa: N805
                return self.rpc(name)
        return Stub()


class FakeAgent:
    """memmove transfers; transfers to an agent in ``dead`` end in state ERR."""

    def __init__(self) -> None:
        self.dead: set[str] = set()
        self.xfers: list[tuple[str, str, int]] = []  # op, remote, descriptors

    def register_memory(self, regions: Any, kind: str) -> Any:
        return regions

    def deregister_memory(self, reg: Any) -> None:
        pass

    def add_remote_agent(self, md: bytes) -> bytes:
        return md

    def remove_remote_agent(self, name: str) -> None:
        pass

    def get_xfer_descs(self, descs: list[tuple[int, int, int]], kind: str) -> Any:
        return descs

    def initialize_xfer(self, op: str, local: Any, remote: Any, name: str) -> Any:
        return (op, local, remote, name)

    def transfer(self, handle: Any) -> str:
        op, local, remote, name = handle
        self.xfers.append((op, name, len(local)))
        if name in self.dead:
            return "ERR"
        for (la, n, _), (ra, m, _) in zip(local, remote, strict=True):
            assert n == m
            if op == "WRITE":
                ctypes.memmove(ra, la, n)
            else:
                ctypes.memmove(la, ra, n)
        return "DONE"

    def check_xfer_state(self, handle: Any) -> str:
        return "DONE"

    def release_xfer_handle(self, handle: Any) -> None:
        pass


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
