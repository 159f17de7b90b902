"""The router inside the frontend (``--router embedded``) on a mock fleet, real etcd and
Redis: requests are served, KV-aware routing (embedded index fed by the KV event stream)
sends a repeated prompt to the worker holding its blocks, an admission rejection is
still a 503 with Retry-After, a client leaving mid-stream releases its routing entry;
and the in-process stub raises the same AioRpcError (code, details, trailing metadata)
as a gRPC channel to the same servicer.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest

from protos import router_pb2, router_pb2_grpc
from services.common.block_hash import block_hashes
from services.common.config import ConfigError, load_config
from services.common.procs import Child
from services.frontend.main import FrontendApp, FrontendConfig, start_frontend
from services.router.core import RouterCore
from services.router.embedded import InProcessRouterStub
from services.router.policy_setup import default_registry
from services.router.service import RouterServicer
from tests.integration.conftest import base_args
from tests.waiting import wait_for
from workers.fleet import Fleet, FleetConfig, start_fleet

NS = "embrouter"
BLOCK = 16
MODEL = "mock"


@pytest.fixture(scope="module")
async def fleet(etcd: Child, redis_server: Child, tiny_model: str) -> AsyncIterator[Fleet]:
    cfg = load_config(FleetConfig, [
        *base_args(etcd.address, NS), "--redis-url", f"redis://{redis_server.address}",
        "--workers", "2", "--block-size", str(BLOCK), "--num-blocks", "1024",
        "--max-model-len", "2048", "--timing", "poly", "--speedup-ratio", "1",
        "--worker-id", "emb-", "--model-path", tiny_model, "--model-name", MODEL], {})
    f = await start_fleet(cfg)
    try:
        yield f
    finally:
        await f.stop()


async def embedded_frontend(etcd: Child, redis_server: Child, router_args: str
                            ) -> FrontendApp:
    app = await start_frontend(load_config(FrontendConfig, [
        *base_args(etcd.address, NS), "--redis-url", f"redis://{redis_server.address}",
        "--http-port", "0", "--router", "embedded", "--router-args", router_args], {}))
    router = app.router
    assert router is not None

    async def serving() -> bool:
        async with httpx.AsyncClient(timeout=2) as c:
            r = await c.get(f"{app.base_url}/health")
        return r.status_code == 200 and r.json()["workers"] == 2

    await wait_for(lambda: len(router.app.watcher.instances()) == 2, 30,
                   "the embedded router to see both workers")
    await wait_for(serving, 30, "the frontend to serve both workers")
    return app


@pytest.fixture(scope="module")
async def kv_frontend(fleet: Fleet, etcd: Child, redis_server: Child
                      ) -> AsyncIterator[FrontendApp]:
    app = await embedded_frontend(etcd, redis_server,
                                  "--policy kv --indexer embedded --load-poll-s 0.1")
    try:
        yield app
    finally:
        await app.server.stop()


def inflight(app: FrontendApp) -> float:
    assert app.router is not None
    value = app.router.app.servicer.metrics.registry.get_sample_value(
        "kvmesh_router_inflight_requests")
    assert value is not None
    return value


def prompt(i: int, n: int = 160) -> list[int]:
    return [3 + (i * 7919 + j * 31) % 600 for j in range(n)]


async def test_serves_and_repeated_prompt_hits_the_holder(kv_frontend: FrontendApp) -> None:
    app = kv_frontend
    assert app.router is not None and app.router.index is not None
    async with httpx.AsyncClient(base_url=app.base_url, timeout=60) as client:
        for i in range(4):
            body = {"model": MODEL, "prompt": prompt(i), "max_tokens": 4, "ignore_eos": True}
            first = await client.post("/v1/completions", json=body)
            assert first.status_code == 200, first.text
            assert first.json()["usage"]["completion_tokens"] == 4
            hashes = block_hashes(prompt(i), BLOCK)

            def indexed(hashes: list[int] = hashes, index: Any = app.router.index) -> bool:
                return any(o.blocks >= len(hashes) - 1
                           for o in index.find_matches(hashes).values())
            await wait_for(indexed, 30, f"prompt {i}'s blocks in the embedded index")
            again = (await client.post("/v1/completions", json=body)).json()
            # only the worker that served it holds its blocks: a hit means the holder
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= (
                (len(hashes) - 1) * BLOCK), again["usage"]
    await wait_for(lambda: inflight(app) == 0, 10, "every request released")


async def test_client_leaving_mid_stream_releases(kv_frontend: FrontendApp) -> None:
    app = kv_frontend
    body = {"model": MODEL, "prompt": prompt(99), "max_tokens": 1500, "ignore_eos": True,
            "stream": True}
    async with httpx.AsyncClient(base_url=app.base_url, timeout=60) as client:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    assert json.loads(line[6:])["choices"][0]["finish_reason"] is None
                    break
            assert inflight(app) == 1  # routed, still generating
    await wait_for(lambda: inflight(app) == 0, 10,
                   lambda: f"the router's entry released (in flight {inflight(app)})")


async def test_admission_rejection_is_503_with_retry_after(
        fleet: Fleet, etcd: Child, redis_server: Child) -> None:
    app = await embedded_frontend(etcd, redis_server,
                                  "--policy least_loaded --admission early "
                                  "--admission-itl-slo-ms 0.001 --load-poll-s 0.1")
    try:
        async with httpx.AsyncClient(base_url=app.base_url, timeout=60) as client:
            resp = await client.post("/v1/completions", json={
                "model": MODEL, "prompt": prompt(7), "max_tokens": 64})
        assert resp.status_code == 503, resp.text
        assert int(resp.headers["retry-after"]) >= 1
        err = resp.json()["error"]
        assert err["type"] == "overloaded_error" and err["code"], err
        assert inflight(app) == 0
    finally:
        await app.server.stop()


class _Refusing(RouterServicer):
    """Route always aborts with RESOURCE_EXHAUSTED and admission trailers."""

    async def Route(self, request: router_pb2.RouteRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> router_pb2.RouteResponse:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded (itl): busy",
                            trailing_metadata=(("retry-after", "2.500"),
                                               ("kvmesh-admission-reason", "itl")))
        raise AssertionError("abort returned")


async def test_in_process_errors_equal_a_channels() -> None:
    core = RouterCore(policy=default_registry().create("round_robin", random.Random(0)),
                      clock=time.monotonic)
    plain, refusing = RouterServicer(core, {}), _Refusing(core, {})
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(refusing, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            remote = router_pb2_grpc.RouterStub(ch)
            local = InProcessRouterStub(refusing)
            errors = []
            for stub in (remote, local):
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await stub.Route(router_pb2.RouteRequest(request_id="r", model="m",
                                                             token_ids=[1]), timeout=5)
                errors.append(exc.value)
            (r, lo) = errors
            assert lo.code() == r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert lo.details() == r.details() == "overloaded (itl): busy"
            assert list(lo.trailing_metadata()) == list(r.trailing_metadata())
            for stub in (remote, local):  # Release without an id: INVALID_ARGUMENT too
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await stub.Release(router_pb2.ReleaseRequest(), timeout=5)
                errors.append(exc.value)
            assert errors[2].code() == errors[3].code() == grpc.StatusCode.INVALID_ARGUMENT
            assert errors[2].details() == errors[3].details()
    finally:
        await server.stop(0)
    # found=false for an unknown id, no error, as over a channel
    assert not (await InProcessRouterStub(plain).Release(
        router_pb2.ReleaseRequest(request_id="x"), timeout=5)).found
    with pytest.raises(TypeError, match="bogus"):
        await InProcessRouterStub(plain).Release(router_pb2.ReleaseRequest(request_id="x"),
                                                 bogus=1)


def test_embedded_flags_are_checked() -> None:
    with pytest.raises(ConfigError, match="unknown policy 'nope'"):
        load_config(FrontendConfig, ["--router", "embedded", "--router-args",
                                     "--policy nope"], {})
    with pytest.raises(ConfigError, match="router_args needs --router embedded"):
        load_config(FrontendConfig, ["--router-args", "--policy kv"], {})
    with pytest.raises(ConfigError, match="router_address is for --router standalone"):
        load_config(FrontendConfig, ["--router", "embedded", "--router-address", "h:1"], {})
    with pytest.raises(ConfigError, match="bad command line"):  # argparse names --router
        load_config(FrontendConfig, ["--router", "sideways"], {})
