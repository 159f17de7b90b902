"""StoreClient's protocol with a fake master stub and a fake NIXL agent (no network).

The fake master keeps objects in a dict and hands out ranges in "remote" numpy buffers;
the fake agent copies bytes with memmove and fails transfers to agents marked dead.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import pytest

from protos import store_pb2
from workers.kv.store_client import StoreClient, decode_endpoint, encode_endpoint


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


class Done:
    def __init__(self, value: Any = None, error: grpc.StatusCode | None = None) -> None:
        self.value, self.error = value, error

    def result(self) -> Any:
        if self.error is not None:
            raise FakeRpcError(self.error)
        return self.value


class Rpc:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, req: Any, timeout: float | None = None) -> Any:
        return self.future(req, timeout).result()

    def future(self, req: Any, timeout: float | None = None) -> Done:
        try:
            return Done(self.fn(req))
        except FakeRpcError as exc:
            return Done(error=exc.code())


@dataclass
class FakeMaster:
    """Objects → replicas on segments (numpy buffers), a bump allocator per segment."""

    segments: dict[str, tuple[np.ndarray, str]] = field(default_factory=dict)  # id → buf, ep
    objects: dict[str, dict[str, Any]] = field(default_factory=dict)
    used: dict[str, int] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)

    def add_segment(self, seg: str, nbytes: int, agent: str) -> np.ndarray:
        buf = np.zeros(nbytes, dtype=np.uint8)
        self.segments[seg] = (buf, encode_endpoint(agent.encode()))
        self.used[seg] = 0
        return buf

    def _fail(self, code: grpc.StatusCode) -> Any:
        raise FakeRpcError(code)

    def PutStart(self, req: Any) -> Any:  # noqa: N802
        self.calls.append(f"start {req.key}")
        if req.key in self.objects:
            self._fail(grpc.StatusCode.ALREADY_EXISTS)
        reps = []
        for seg, (buf, ep) in list(self.segments.items())[:max(1, req.replicas)]:
            if self.used[seg] + req.size > buf.nbytes:
                continue
            off = self.used[seg]
            self.used[seg] += req.size
            reps.append(store_pb2.Replica(segment_id=seg, endpoint=ep, offset=off,
                                          address=int(buf.ctypes.data) + off, size=req.size))
        if not reps:
            self._fail(grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.objects[req.key] = {"size": req.size, "replicas": reps, "complete": False}
        return store_pb2.PutStartResponse(replicas=reps)

    def PutEnd(self, req: Any) -> Any:  # noqa: N802
        self.calls.append(f"end {req.key}")
        self.objects[req.key]["complete"] = True
        return store_pb2.PutEndResponse()

    def PutRevoke(self, req: Any) -> Any:  # noqa: N802
        self.calls.append(f"revoke {req.key}")
        del self.objects[req.key]
        return store_pb2.PutRevokeResponse()

    def GetReplicaList(self, req: Any) -> Any:  # noqa: N802
        obj = self.objects.get(req.key)
        if obj is None:
            raise FakeRpcError(grpc.StatusCode.NOT_FOUND)
        if not obj["complete"]:
            self._fail(grpc.StatusCode.FAILED_PRECONDITION)
        return store_pb2.GetReplicaListResponse(replicas=obj["replicas"], size=obj["size"])

    def BatchExistKey(self, req: Any) -> Any:  # noqa: N802
        return store_pb2.BatchExistKeyResponse(
            exists=[k in self.objects and self.objects[k]["complete"] for k in req.keys])

    # Batch RPCs: each item as its single-key RPC, outcome as an ItemStatus (as the master)

    @staticmethod
    def _each(fn: Any, req: Any) -> tuple[store_pb2.ItemStatus, Any]:
        try:
            return store_pb2.ItemStatus(), fn(req)
        except FakeRpcError as exc:
            return store_pb2.ItemStatus(code=exc.code().value[0], message="fake"), None

    def BatchPutStart(self, req: Any) -> Any:  # noqa: N802
        out = store_pb2.BatchPutStartResponse()
        for it in req.items:
            st, resp = self._each(self.PutStart, it)
            out.results.add(status=st, replicas=resp.replicas if resp else [])
        return out

    def BatchPutEnd(self, req: Any) -> Any:  # noqa: N802
        return store_pb2.BatchStatusResponse(results=[
            self._each(self.PutEnd, store_pb2.KeyRequest(key=k))[0] for k in req.keys])

    def BatchPutRevoke(self, req: Any) -> Any:  # noqa: N802
        return store_pb2.BatchStatusResponse(results=[
            self._each(self.PutRevoke, store_pb2.KeyRequest(key=k))[0] for k in req.keys])

    def BatchGetReplicaList(self, req: Any) -> Any:  # noqa: N802
        out = store_pb2.BatchGetReplicaListResponse()
        for k in req.keys:
            st, resp = self._each(self.GetReplicaList, store_pb2.KeyRequest(key=k))
            out.results.add(status=st, list=resp)
        return out

    def stub(self) -> Any:
        class Stub:
            pass

        s = Stub()
        for name in ("BatchPutStart", "BatchPutEnd", "BatchPutRevoke", "BatchGetReplicaList",
                     "BatchExistKey"):
            setattr(s, name, Rpc(getattr(self, name)))
        return s


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
def world() -> tuple[FakeMaster, FakeAgent, StoreClient]:
    master, agent = FakeMaster(), FakeAgent()
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
        world: tuple[FakeMaster, FakeAgent, StoreClient]) -> None:
    master, agent, client = world
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    s, d = int(src.ctypes.data), int(dst.ctypes.data)
    res = client.put_many([("a", [(s, 100), (s + 1000, 50)]), ("b", [(s + 2000, 30)])],
                          replicas=2)
    assert res == ["ok", "ok"]
    # One WRITE per remote agent for all keys, then PutEnd for both.
    assert sorted(x[1] for x in agent.xfers) == ["node0", "node1"]
    assert all(x[2] == 3 for x in agent.xfers)
    assert master.calls[-2:] == ["end a", "end b"]
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
        world: tuple[FakeMaster, FakeAgent, StoreClient]) -> None:
    master, agent, client = world
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(256, dtype=np.uint8)
    s, d = int(src.ctypes.data), int(dst.ctypes.data)
    agent.dead.add("node1")
    assert client.put("x", [(s, 64)], replicas=2) == "failed"
    assert "revoke x" in master.calls and "x" not in master.objects
    agent.dead.clear()
    assert client.put("x", [(s, 64)], replicas=2) == "ok"
    agent.dead.add("node0")  # the first replica's owner is gone: read the second
    assert client.get("x", [(d, 64)]) == "ok" and (dst[:64] == src[:64]).all()
    agent.dead.add("node1")
    assert client.get("x", [(d, 64)]) == "failed"
    # A put that finds no room fails cleanly (nothing to revoke).
    assert client.put("big", [(s, 1)] * 1 + [(s, (1 << 16) + 1)]) == "failed"
    assert "big" not in master.objects


def test_incomplete_object_is_a_miss(
        world: tuple[FakeMaster, FakeAgent, StoreClient]) -> None:
    master, _, client = world
    master.PutStart(store_pb2.PutStartRequest(key="w", size=8))
    dst = np.zeros(8, dtype=np.uint8)
    assert client.get("w", [(int(dst.ctypes.data), 8)]) == "missing"
    assert client.exists_prefix(["w"]) == 0
