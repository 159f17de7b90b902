"""The store client against a real store master (in process, etcd + Redis) and real store
nodes (child processes) over NIXL.

The client side runs in a spawned child process (:func:`_scenario`) that ends with
``os._exit``: NIXL 1.5.1 may crash at interpreter exit, which must not take pytest down.
It reports what it saw as a dict over a pipe; the test checks it and the master's state.

Covered: gather put / scatter get with two replicas on two nodes, "exists" for a key
already stored, "missing" for unknown keys, BatchExistKey prefixes, a node killed without
unmounting → "failed" (not "missing") while the master still lists it, then "missing"
once the client TTL dropped it; an embedded segment (the client's own memory) serving its
own reads; remount after the master forgot the client (restart without persistence).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection
from typing import Any

import pytest

from services.common.config import load_config
from services.common.procs import Child
from services.store_master.main import StoreMasterApp, StoreMasterConfig, start_store_master
from tests.integration.conftest import base_args
from tests.manual_clock import Clock
from tests.store_inproc import ticks
from workers.store_node import StoreNodeProcess

UCX_ENV = {"UCX_TLS": "tcp,self,sm", "UCX_NET_DEVICES": "lo"}


def _scenario(master: str, conn: Connection) -> None:
    """Child process: exercise a StoreClient; send a report dict; os._exit."""
    code = 1
    try:
        os.environ.update(UCX_ENV)
        import numpy as np

        from tests.waiting import wait_for_sync
        from workers.kv.store_client import StoreClient

        out: dict[str, Any] = {}
        c = StoreClient(master, client_id="scenario")
        src = np.random.default_rng(0).integers(0, 255, 1 << 16, dtype=np.uint8)
        dst = np.zeros_like(src)
        c.register(int(src.ctypes.data), src.nbytes)
        c.register(int(dst.ctypes.data), dst.nbytes)
        s, d = int(src.ctypes.data), int(dst.ctypes.data)
        # Gather two source ranges into one object, on two replicas.
        out["put"] = c.put_many([("a", [(s, 1000), (s + 5000, 3000)]),
                                 ("b", [(s + 9000, 4096)])], replicas=2)
        out["put_again"] = c.put("a", [(s, 4000)])
        out["get"] = c.get_many([("a", [(d, 2500), (d + 10000, 1500)]),
                                 ("nope", [(d, 10)]), ("b", [(d + 20000, 4096)])])
        out["a_ok"] = bool(np.array_equal(dst[:1000], src[:1000])
                           and np.array_equal(dst[1000:2500], src[5000:6500])
                           and np.array_equal(dst[10000:11500], src[6500:8000]))
        out["b_ok"] = bool(np.array_equal(dst[20000:24096], src[9000:13096]))
        out["wrong_size"] = c.get("b", [(d, 100)])
        out["prefix"] = c.exists_prefix(["a", "b", "nope", "a"])
        conn.send(out)
        conn.recv()  # the test kills one node
        dst[:] = 0
        out = {"after_kill": c.get_many([("a", [(d, 4000)]), ("b", [(d + 8000, 4096)])])}
        out["a_ok"] = bool(np.array_equal(dst[:1000], src[:1000]))
        conn.send(out)
        conn.recv()  # the test kills the other node and waits for the TTL
        out = {"after_ttl": c.get_many([("a", [(d, 4000)])])}
        # Embedded segment: this client's own memory holds the replica.
        e = StoreClient(master, segment_bytes=1 << 20, client_id="embedded")
        e.register(int(src.ctypes.data), src.nbytes)
        e.register(int(dst.ctypes.data), dst.nbytes)
        dst[:] = 0
        out["embedded_put"] = e.put("e", [(s, 2048)])
        out["embedded_get"] = e.get("e", [(d, 2048)])
        out["embedded_ok"] = bool(np.array_equal(dst[:2048], src[:2048]))
        out["remote_get"] = c.get("e", [(d + 4096, 2048)])  # NIXL READ from e's segment
        out["remote_ok"] = bool(np.array_equal(dst[4096:6144], src[:2048]))
        out["segment_id"] = e.segment_id
        conn.send(out)
        conn.recv()  # the test restarts the master without persistence
        def remounted() -> int:
            e.progress()  # a NIXL target must progress while it waits
            return e.counters.remounts

        wait_for_sync(remounted, 10, "the embedded client's remount")
        conn.send({"remounts": e.counters.remounts})
        e.close()
        c.close()
        code = 0
    except BaseException as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        os._exit(code)


@pytest.fixture
async def master(etcd: Child) -> AsyncIterator[tuple[StoreMasterApp, Clock]]:
    """A master on a fake clock: client TTLs run out only when the test advances it."""
    cfg = load_config(StoreMasterConfig, [*base_args(etcd.address, "storeclient"),
                                          "--tick-interval-s", "0.1", "--client-ttl-s", "1.5",
                                          "--read-lease-ttl-s", "1", "--persist", "none"], {})
    clock = Clock()
    app = await start_store_master(cfg, clock=clock)
    yield app, clock
    await app.server.stop()


async def recv(conn: Connection, within: float = 60.0) -> dict[str, Any]:
    ready = await asyncio.to_thread(conn.poll, within)
    assert ready, "scenario child did not answer"
    msg: dict[str, Any] = conn.recv()
    assert "error" not in msg, msg["error"]
    return msg


async def test_store_client_over_nixl(master: tuple[StoreMasterApp, Clock],
                                      etcd: Child) -> None:
    app, clock = master
    addr = app.server.address
    nodes = [await asyncio.to_thread(StoreNodeProcess, addr, 4, env=UCX_ENV)
             for _ in range(2)]
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_scenario, args=(addr, theirs))
    child.start()
    try:
        first = await recv(ours)
        assert first["put"] == ["ok", "ok"] and first["put_again"] == "exists"
        assert first["get"] == ["ok", "missing", "ok"]
        assert first["a_ok"] and first["b_ok"]
        assert first["wrong_size"] == "failed" and first["prefix"] == 2
        obj = app.master.get_object("a")
        assert obj is not None and len({r.segment_id for r in obj.replicas}) == 2

        nodes[0].kill()  # without unmounting: one replica of each key is now unreadable
        ours.send("go")
        second = await recv(ours)
        # The dead replica fails; the read falls back to the live one.
        assert second["after_kill"] == ["ok", "ok"] and second["a_ok"]

        nodes[1].kill()
        assert app.master.stats().clients == 2  # nothing told the master yet
        clock.advance(2.0)  # past the 1.5 s client TTL: the next tick drops both nodes
        await ticks(app)
        assert app.master.stats().clients == 0
        ours.send("go")
        third = await recv(ours)
        assert third["after_ttl"] == ["missing"]
        assert third["embedded_put"] == "ok" and third["embedded_get"] == "ok"
        assert third["embedded_ok"]
        assert third["remote_get"] == "ok" and third["remote_ok"]

        # A master restarted without persistence forgets the segment: the client remounts.
        await app.server.stop()
        app2 = await start_store_master(
            load_config(StoreMasterConfig, [*base_args(etcd.address, "storeclient2"),
                                            "--port", addr.rsplit(":", 1)[1],
                                            "--tick-interval-s", "0.1",
                                            "--persist", "none"], {}))
        try:
            ours.send("go")
            fourth = await recv(ours)
            assert fourth["remounts"] >= 1
            assert app2.master.segment(third["segment_id"]) is not None
        finally:
            await app2.server.stop()
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
        for n in nodes:
            n.kill()
