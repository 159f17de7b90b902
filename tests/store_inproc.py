"""The store master in process, for tests: its real core and gRPC servicer behind a stub
seam (no transport), a fake NIXL agent, and a wait for the ticker of a started master.

- :class:`CoreMaster`: a real :class:`StoreMaster` (fake clock, free-ratio-first placement)
  served by the real :class:`StoreMasterServicer`; ``stub()`` is what a
  :class:`~workers.kv.store_client.StoreClient` takes as ``stub``: each call runs the
  servicer's RPC method (with persistence off it never suspends, see :func:`run_now`) and
  is logged in ``calls`` as ``(rpc, keys)``; an abort raises :class:`AbortError`, an
  ``RpcError`` with the code a real channel would report.
- :class:`FakeAgent`: NIXL agent stand-in; memmove transfers, ``dead`` agents fail.
- :func:`ticks`: waits until a started master's ticker ran ``n`` more ticks without error.
"""

from __future__ import annotations

import ctypes
import random
import threading
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from services.store_master.core import FreeRatioFirstStrategy, MasterParams, StoreMaster
from services.store_master.persist import Persister
from services.store_master.service import StoreMasterServicer
from tests.manual_clock import Clock
from tests.waiting import wait_for
from workers.kv.store_client import encode_endpoint

if TYPE_CHECKING:
    from services.store_master.main import StoreMasterApp


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


async def ticks(app: StoreMasterApp, n: int = 2) -> None:
    """Waits until the ticker finished ``n`` more ticks without error (with n=2, one whole
    tick ran after the caller's last change to the clock)."""
    want = app.ticker.calls + n
    await wait_for(lambda: app.ticker.calls >= want, 10,
                   lambda: f"{n} store master ticks (the ticker is at {app.ticker.calls})",
                   interval_s=0.01)
    assert app.ticker.failures == 0
