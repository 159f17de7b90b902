"""An in-process mesh on real etcd: router, one real vLLM-CPU worker (tiny model), frontend.

All three share this process's event loop and the in-memory span exporter, so tests can
read whole traces.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common.config import load_config
from services.common.procs import Child
from services.common.telemetry import setup_in_memory_tracing
from services.frontend.main import FrontendApp, FrontendConfig, start_frontend
from services.router.main import RouterApp, RouterConfig, start_router
from tests.waiting import wait_for
from workers.config import WorkerConfig
from workers.fleet import Fleet, FleetConfig, start_fleet
from workers.main import build_engine, build_server
from workers.model.tiny import ensure_tiny_model


@pytest.fixture(scope="session")
def spans() -> InMemorySpanExporter:
    return setup_in_memory_tracing()


@pytest.fixture(scope="session")
def tiny_model() -> str:
    return str(ensure_tiny_model())


@dataclass
class Mesh:
    etcd: str
    router: RouterApp
    frontend: FrontendApp
    worker_address: str
    worker_id: str
    model: str

    @property
    def url(self) -> str:
        return self.frontend.base_url


@contextlib.asynccontextmanager
async def mock_pd_fleet(etcd: str, ns: str, model_path: str, *, block_size: int,
                        num_blocks: int, max_num_seqs: int, speedup: float,
                        worker_id: str) -> AsyncIterator[Fleet]:
    """One mock P and one mock D (``workers.fleet``, Dynamo mocker ``poly`` timing at
    ``speedup``, model name ``mock``, context 4096) registered in ``ns``; stopped after."""
    cfg = load_config(FleetConfig, [
        *base_args(etcd, ns), "--workers", "0", "--prefill-workers", "1",
        "--decode-workers", "1", "--block-size", str(block_size), "--num-blocks",
        str(num_blocks), "--max-num-seqs", str(max_num_seqs), "--max-model-len", "4096",
        "--timing", "poly", "--speedup-ratio", str(speedup), "--worker-id", worker_id,
        "--model-path", model_path, "--model-name", "mock"], {})
    f = await start_fleet(cfg)
    try:
        yield f
    finally:
        await f.stop()


@contextlib.asynccontextmanager
async def router_and_frontend(etcd: str, ns: str,
                              router_flags: list[str]) -> AsyncIterator[tuple[RouterApp,
                                                                              FrontendApp]]:
    """An in-process router (``router_flags``) and a frontend on it (any free HTTP port)
    in ``ns``; both stopped after."""
    args = base_args(etcd, ns)
    router = await start_router(load_config(RouterConfig, [*args, *router_flags], {}))
    try:
        frontend = await start_frontend(load_config(FrontendConfig, [
            *args, "--http-port", "0", "--router-address", router.server.address], {}))
        try:
            yield router, frontend
        finally:
            await frontend.server.stop()
    finally:
        await router.server.stop()


async def wait_routable(router: RouterApp, n: int, what: str, timeout_s: float = 30) -> None:
    """Until ``router``'s etcd watch lists at least ``n`` workers (``what`` names them)."""
    await wait_for(lambda: len(router.watcher.instances()) >= n, timeout_s,
                   lambda: f"the router to learn {what} from etcd "
                           f"(has {sorted(router.watcher.instances())})")


def base_args(etcd: str, namespace: str) -> list[str]:
    return ["--etcd-endpoint", etcd, "--namespace", namespace, "--lease-ttl", "2",
            "--grace-s", "0.5"]


@pytest.fixture(scope="session")
async def mesh(etcd: Child, spans: InMemorySpanExporter, tiny_model: str) -> AsyncIterator[Mesh]:
    ns = "itest"
    args = base_args(etcd.address, ns)
    router = await start_router(load_config(RouterConfig, [*args, "--load-poll-s", "0.2"], {}))
    wcfg = load_config(WorkerConfig, [*args, "--model-path", tiny_model, "--model-name", "tiny",
                                      "--kv-cache-gib", "0.25", "--max-model-len", "512"], {})
    engine = build_engine(wcfg)
    await engine.start()
    wserver = build_server(wcfg, engine)
    await wserver.start()
    frontend = await start_frontend(load_config(FrontendConfig, [*args, "--http-port", "0"], {}))
    m = Mesh(etcd.address, router, frontend, wserver.address, wcfg.resolved_worker_id(), "tiny")
    try:
        await wait_routable(router, 1, "the worker")
        yield m
    finally:
        await frontend.server.stop()
        await wserver.stop()
        await router.server.stop()
