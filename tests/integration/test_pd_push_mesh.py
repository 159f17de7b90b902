"""P/D through the mesh with vLLM's NixlPushConnector: D registers, P WRITEs. The
official ``openai`` client's requests (tests.integration.openai_pd_support) equal the
aggregated session mesh's."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from protos import common_pb2
from services.common.config import load_config
from services.common.procs import Child
from services.frontend.main import FrontendApp, FrontendConfig, start_frontend
from services.router.main import RouterConfig, start_router
from tests.integration.conftest import Mesh, base_args, wait_routable
from tests.integration.openai_pd_support import CASES, assert_matches_aggregated
from tests.integration.test_pd_mesh import (
    assert_same_sampling,
    generate,
    ids,
    last_spans,
    plan_run,
    so_sampling,
    wait_idle,
    words,
    worker_run,
)
from workers.config import WorkerConfig
from workers.main import build_engine, build_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
NS = "pdpush"


@pytest.fixture(scope="module")
async def push_front(etcd: Child, spans: InMemorySpanExporter,
                     tiny_model: str) -> AsyncIterator[tuple[FrontendApp, list[str]]]:
    servers = []
    for role in ("prefill", "decode"):
        cfg = load_config(WorkerConfig, [*base_args(etcd.address, NS), "--model-path",
                                         tiny_model, "--model-name", "tiny", "--role", role,
                                         "--handoff", "push", "--kv-cache-gib", "0.25",
                                         "--max-model-len", "512"], {})
        engine = build_engine(cfg)
        await engine.start()
        server = build_server(cfg, engine)
        await server.start()
        servers.append(server)
    router = await start_router(load_config(RouterConfig, [
        *base_args(etcd.address, NS), "--conditional-disagg", "false"], {}))
    front = await start_frontend(load_config(FrontendConfig, [
        *base_args(etcd.address, NS), "--http-port", "0", "--router-address",
        router.server.address], {}))
    try:
        await wait_routable(router, 2, "P and D")
        yield front, [*(s.address for s in servers), router.server.address]
    finally:
        await front.server.stop()
        await router.server.stop()
        for s in reversed(servers):
            await s.stop()


async def test_push_handoff_matches_aggregated_tokens(
    push_front: tuple[FrontendApp, list[str]], mesh: Mesh, spans: InMemorySpanExporter
) -> None:
    front, (p_addr, d_addr, _) = push_front
    for seed, n in ((61, 25), (62, 60)):
        text = words(seed, n)
        ref = ids(await generate(mesh.frontend.server.address, "tiny", text))
        spans.clear()
        assert ids(await generate(front.server.address, "tiny", text)) == ref
        xfer = last_spans(spans, "kv_transfer")[-1]
        assert xfer.attributes["kvmesh.handoff_mode"] == "push"
        assert last_spans(spans, "router.route")[-1].attributes["kvmesh.disaggregated"]
    # D with the prefix already cached still completes, and both sides end idle.
    text = words(62, 60) + " " + words(63, 10)
    ref = ids(await generate(mesh.frontend.server.address, "tiny", text))
    got = await generate(front.server.address, "tiny", text)
    assert ids(got) == ref and got[-1].usage.cached_tokens > 0
    await wait_idle(p_addr)
    await wait_idle(d_addr)


async def test_push_structured_output_and_logprobs_match_aggregated(
    push_front: tuple[FrontendApp, list[str]], mesh: Mesh, tiny_model: str
) -> None:
    """As test_pd_mesh's pull test: D's grammar-constrained tokens, logprobs and P's
    prompt logprobs (on the first chunk, D's held until P answered) equal aggregated."""
    _, (p_addr, d_addr, router_addr) = push_front
    tokens = [1, *range(340, 380)]
    ref = await worker_run(mesh.worker_address, "so-agg-push", tokens, so_sampling(tiny_model))
    assert ref[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    got = await plan_run(router_addr, "so-push", tokens, so_sampling(tiny_model))
    assert_same_sampling(got, ref)
    await wait_idle(p_addr)
    await wait_idle(d_addr)


@pytest.mark.parametrize("case", sorted(CASES))
async def test_openai_client_matches_aggregated(
        push_front: tuple[FrontendApp, list[str]], mesh: Mesh, tiny_model: str,
        spans: InMemorySpanExporter, case: str) -> None:
    """As test_pd_mesh's, with the push handoff."""
    front, (p_addr, d_addr, _) = push_front
    await assert_matches_aggregated(case, "push", front.base_url, mesh.url, tiny_model, spans)
    await wait_idle(p_addr)
    await wait_idle(d_addr)
