"""Real SGLang workers in the mesh (``--engine sglang``: a child SGLang 0.5.23 server from
``.sglvenv``, on CPU through helper shims; see workers/engines/sglang/).

- agg fleet (namespace ``sglagg``): one SGLang and one vLLM worker, both publishing KV
  events to Redis, the indexer, a ``kv``-policy router: greedy tokens of SGLang equal
  vLLM's, a repeated prefix goes to the SGLang worker that holds it, and after SGLang
  evicted from its small cache the index holds exactly what SGLang's events say it holds
  (and SGLang's own cache hits confirm it).
- P/D (namespace ``sglpd``): SGLang P and D through SGLang's bootstrap handshake (handoff
  mode ``sglang``): greedy tokens equal the SGLang aggregated worker's; a mixed model
  (vLLM P + SGLang D records) is refused with "engines differ"; cancel mid-stream and
  killing P leave D running nothing.

Skipped when ``.sglvenv`` is missing (``make sglang``).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from protos import common_pb2, discovery_pb2, indexer_pb2, indexer_pb2_grpc
from services.common.block_hash import block_hashes
from services.common.config import load_config
from services.common.discovery import Registration
from services.common.procs import Child
from services.frontend.main import FrontendApp, FrontendConfig, start_frontend
from services.indexer.core import KvIndex
from services.indexer.feed import IndexFeed
from services.indexer.main import IndexerApp, IndexerConfig, start_indexer
from services.router.main import RouterApp, RouterConfig, start_router
from tests.integration.conftest import base_args, wait_routable
from tests.integration.pd_support import prompt
from tests.integration.test_kv_routing import cached, complete
from tests.integration.test_pd_mesh import load, plan_run, worker_run
from tests.waiting import wait_for
from workers.config import WorkerConfig
from workers.main import WorkerApp, start_worker


def _sglang_python() -> object:
    try:
        from workers.engines.sglang.server import sglang_python
    except ImportError:
        return None
    return sglang_python()


pytestmark = [
    pytest.mark.vllm, pytest.mark.slow,
    pytest.mark.skipif(_sglang_python() is None,
                       reason="no SGLang venv (.sglvenv with a working `import sglang`): "
                              "run `make sglang`"),
]
BLOCK = 32
# ~2k tokens of KV (1 KiB per token of the tiny model in float32): evictions come soon
SMALL_KV_GIB = "0.002"
MAX_TOKENS = 12


def greedy(max_tokens: int = MAX_TOKENS) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def ids_of(resps: list) -> list[int]:  # type: ignore[type-arg]
    return [t for r in resps for t in r.token_ids]


def worker_args(etcd: str, ns: str, tiny_model: str, *extra: str) -> list[str]:
    # a 10 s lease: in-process workers on 2 shared cores must not drop out of etcd
    return [*base_args(etcd, ns), "--model-path", tiny_model, "--model-name", "tiny",
            "--max-model-len", "512", "--lease-ttl", "10", *extra]


async def wait_quiet(address: str, within_s: float = 60.0) -> None:
    """Until the worker at ``address`` runs and queues nothing (SGLang's /v1/loads)."""
    last: list[object] = [None]

    async def quiet() -> bool:
        rep = await load(address)
        last[0] = rep
        return (rep.num_running, rep.num_waiting) == (0, 0)

    await wait_for(quiet, within_s, lambda: f"worker {address} to run nothing "
                                            f"(last: {last[0]})", interval_s=0.2)


# -- aggregated fleet: SGLang + vLLM, KV events, kv routing ---------------------------

@dataclass
class AggFleet:
    sgl: WorkerApp
    vllm: WorkerApp
    indexer: IndexerApp
    feed: IndexFeed
    router: RouterApp
    frontend: FrontendApp


@pytest.fixture(scope="module")
async def agg(etcd: Child, redis_server: Child, tiny_model: str,
              spans: InMemorySpanExporter) -> AsyncIterator[AggFleet]:
    ns = "sglagg"
    redis = ["--redis-url", f"redis://{redis_server.address}"]
    sgl = await start_worker(load_config(WorkerConfig, worker_args(
        etcd.address, ns, tiny_model, *redis, "--engine", "sglang",
        "--kv-cache-gib", SMALL_KV_GIB), {}))
    try:
        vllm = await start_worker(load_config(WorkerConfig, worker_args(
            etcd.address, ns, tiny_model, *redis, "--kv-cache-gib", "0.05"), {}))
    except BaseException:
        await sgl.stop()
        raise
    args = [*base_args(etcd.address, ns), *redis]
    indexer = await start_indexer(load_config(IndexerConfig, [*args, "--group", "ix-sgl"], {}))
    feed = IndexFeed(KvIndex(), f"redis://{redis_server.address}", etcd.address, ns,
                     "sgl-emb", clock=time.monotonic)
    await feed.start()
    router = await start_router(load_config(RouterConfig, [
        *args, "--load-poll-s", "0.2", "--seed", "1", "--policy", "kv",
        "--indexer", "remote"], {}))
    frontend = await start_frontend(load_config(FrontendConfig, [
        *args, "--http-port", "0", "--router-address", router.server.address], {}))
    try:
        await wait_routable(router, 2, "the SGLang and the vLLM worker")
        await wait_for(lambda: frontend.pipeline.catalog.get("tiny") is not None, 30,
                       "the frontend to list the model")
        yield AggFleet(sgl, vllm, indexer, feed, router, frontend)
    finally:
        await frontend.server.stop()
        await router.server.stop()
        await feed.close()
        await indexer.server.stop()
        await vllm.stop()
        await sgl.stop()


async def test_sglang_greedy_tokens_equal_vllms(agg: AggFleet) -> None:
    for seed, n in ((1, 20), (2, 70), (3, 130)):
        tokens = prompt(seed, n)
        got = await worker_run(agg.sgl.server.address, f"sgl-eq-{seed}", tokens, greedy())
        ref = await worker_run(agg.vllm.server.address, f"vllm-eq-{seed}", tokens, greedy())
        assert ids_of(got) == ids_of(ref), f"prompt {seed}: SGLang and vLLM disagree"
        assert got[-1].usage.completion_tokens == MAX_TOKENS
        assert got[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


async def sgl_overlap(fleet: AggFleet, tokens: list[int]) -> int:
    """The indexer's leading blocks of ``tokens`` on the SGLang worker."""
    assert fleet.sgl.relay is not None
    async with grpc.aio.insecure_channel(fleet.indexer.server.address) as ch:
        resp = await indexer_pb2_grpc.IndexerStub(ch).FindMatches(
            indexer_pb2.FindMatchesRequest(token_ids=tokens, block_size=BLOCK))
    return next((o.blocks for o in resp.overlaps
                 if o.worker_id == fleet.sgl.relay.worker_id), 0)


async def test_repeated_prefix_goes_to_the_sglang_holder(
        agg: AggFleet, spans: InMemorySpanExporter) -> None:
    for seed in (11, 12):
        spans.clear()
        head = prompt(seed, 4 * BLOCK)
        await worker_run(agg.sgl.server.address, f"hold-{seed}", [*head, 7, 8, 9], greedy(2))

        async def indexed(h: list[int] = head) -> bool:
            return await sgl_overlap(agg, h) == 4

        await wait_for(indexed, 15, "the indexer to hold SGLang's blocks of the first request")
        body = await complete(agg.frontend.base_url, [*head, 21, 22, 23])
        routes = [dict(r.attributes or {}) for r in spans.get_finished_spans()
                  if r.name == "router.route"]
        # only the SGLang worker holds the prefix
        assert cached(body) == 4 * BLOCK, (body.get("usage"), routes, agg.sgl.engine.load())


def index_view(fleet: AggFleet) -> dict[str, frozenset[int]]:
    wid = fleet.sgl.relay.worker_id  # type: ignore[union-attr]
    return fleet.feed.index.dump().get(wid, {})


def relay_view(fleet: AggFleet) -> dict[str, frozenset[int]]:
    state = fleet.sgl.relay.state()  # type: ignore[union-attr]
    return {t.tier: frozenset(t.block_hashes) for t in state.tiers if t.block_hashes}


async def test_index_follows_sglang_evictions(agg: AggFleet) -> None:
    prompts = [prompt(100 + i, 8 * BLOCK) for i in range(12)]  # 12 x 256 tokens > ~2k
    for i, tokens in enumerate(prompts):
        await worker_run(agg.sgl.server.address, f"evict-{i}", tokens, greedy(4))
    assert agg.sgl.relay is not None
    await wait_for(lambda: index_view(agg) == relay_view(agg), 15,
                   lambda: "the index to equal the SGLang worker's event state "
                           f"({len(index_view(agg).get('device', ()))} vs "
                           f"{len(relay_view(agg).get('device', ()))} blocks)")
    device = index_view(agg).get("device", frozenset())
    first, last = (block_hashes(p, BLOCK) for p in (prompts[0], prompts[-1]))
    assert not device & set(first), "the oldest prompt must have been evicted"
    assert set(last) <= device
    assert len(device) * BLOCK <= 2200  # never more than SGLang's pool
    # SGLang's own cache agrees: the last prompt hits in full, the first not at all.
    hit = await worker_run(agg.sgl.server.address, "evict-again-last", prompts[-1], greedy(1))
    assert hit[-1].usage.cached_tokens >= 7 * BLOCK
    miss = await worker_run(agg.sgl.server.address, "evict-again-0", prompts[0], greedy(1))
    assert miss[-1].usage.cached_tokens == 0


# -- P/D through SGLang's bootstrap ---------------------------------------------------

@dataclass
class PdFleet:
    p: WorkerApp
    d: WorkerApp
    router: RouterApp
    frontend: FrontendApp


@pytest.fixture(scope="module")
async def pd(etcd: Child, tiny_model: str, spans: InMemorySpanExporter
             ) -> AsyncIterator[PdFleet]:
    ns = "sglpd"
    apps: list[WorkerApp] = []
    try:
        for role in ("prefill", "decode"):
            apps.append(await start_worker(load_config(WorkerConfig, worker_args(
                etcd.address, ns, tiny_model, "--engine", "sglang", "--role", role,
                "--kv-cache-gib", "0.05", "--kv-handoff-timeout-s", "60"), {})))
        router = await start_router(load_config(RouterConfig, [
            *base_args(etcd.address, ns), "--load-poll-s", "0.2",
            "--conditional-disagg", "false"], {}))
        frontend = await start_frontend(load_config(FrontendConfig, [
            *base_args(etcd.address, ns), "--http-port", "0",
            "--router-address", router.server.address], {}))
    except BaseException:
        for app in reversed(apps):
            await app.stop()
        raise
    try:
        await wait_routable(router, 2, "SGLang P and D")
        await wait_for(lambda: frontend.pipeline.catalog.get("tiny") is not None, 30,
                       "the frontend to list the model")
        yield PdFleet(apps[0], apps[1], router, frontend)
    finally:
        await frontend.server.stop()
        await router.server.stop()
        for app in reversed(apps):
            await app.stop()


async def test_pd_handoff_equals_sglang_aggregated(pd: PdFleet, agg: AggFleet) -> None:
    assert pd.p.engine.info.handoff["mode"] == "sglang"
    for seed, n in ((21, 40), (22, 100)):
        tokens = prompt(seed, n)
        ref = await worker_run(agg.sgl.server.address, f"pd-ref-{seed}", tokens, greedy())
        got = await plan_run(pd.router.server.address, f"pd-{seed}", tokens, greedy())
        assert ids_of(got) == ids_of(ref)
        assert got[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    await wait_quiet(pd.d.server.address)
    await wait_quiet(pd.p.server.address)


async def test_mixed_engines_are_refused_for_pd(pd: PdFleet, etcd: Child,
                                                tiny_model: str) -> None:
    """A vLLM P and an SGLang D of one model: the router refuses to pair them."""
    sgl_layout = pd.d.engine.info.kv_layout
    regs = []
    for iid, role, mode, layout in (
            ("vllm-p", discovery_pb2.WORKER_ROLE_PREFILL, "pull",
             sgl_layout.removeprefix("sglang|")),
            ("sgl-d", discovery_pb2.WORKER_ROLE_DECODE, "sglang", sgl_layout)):
        rec = discovery_pb2.InstanceRecord(
            instance_id=iid, component="worker", address="127.0.0.1:9", role=role,
            model="tiny-mixed", model_path=tiny_model, block_size=BLOCK, max_model_len=512,
            engine="vllm" if mode == "pull" else "sglang", kv_layout=layout,
            handoff=discovery_pb2.KvHandoff(mode=mode, engine_id=iid))
        reg = Registration(etcd.address, "sglpd", rec, ttl=5)
        await reg.start()
        regs.append(reg)
    try:
        await wait_for(lambda: pd.frontend.pipeline.catalog.get("tiny-mixed") is not None,
                       10, "the frontend's catalog to list tiny-mixed")
        await wait_for(lambda: {"vllm-p", "sgl-d"} <= set(pd.router.watcher.instances()), 10,
                       "the router's watch to list both records")
        async with httpx.AsyncClient(base_url=pd.frontend.base_url, timeout=30) as client:
            resp = await client.post("/v1/completions", json={
                "model": "tiny-mixed", "prompt": "hello there", "max_tokens": 2})
            assert resp.status_code == 503
            err = resp.json()["error"]
            assert "engines differ" in err["message"], err
            assert "vllm-p is vLLM" in err["message"] and "sgl-d is SGLang" in err["message"]
            # the real SGLang P/D of the same frontend keeps serving
            ok = await client.post("/v1/completions", json={
                "model": "tiny", "prompt": "hello there", "max_tokens": 2,
                "temperature": 0})
            assert ok.status_code == 200, ok.text
    finally:
        for reg in regs:
            await reg.close()


async def test_cancel_mid_stream_leaves_p_and_d_quiet(pd: PdFleet) -> None:
    async with httpx.AsyncClient(base_url=pd.frontend.base_url, timeout=120) as client:
        async with client.stream("POST", "/v1/completions", json={
                "model": "tiny", "prompt": prompt(31, 90), "max_tokens": 300,
                "ignore_eos": True, "temperature": 0, "stream": True}) as resp:
            assert resp.status_code == 200
            n = 0
            async for line in resp.aiter_lines():
                n += line.startswith("data: ")
                if n == 3:
                    break
    await wait_quiet(pd.d.server.address)
    await wait_quiet(pd.p.server.address)


async def test_killing_p_fails_cleanly_and_leaves_d_quiet(pd: PdFleet) -> None:
    """Runs last (it kills P): P's SGLang server is SIGKILLed once D streams; the
    stream completes on D (it holds the KV) or ends with an error, never hangs; a request
    after that is a clear error; D runs nothing."""
    child = pd.p.engine._child  # type: ignore[attr-defined]
    assert child is not None
    async with httpx.AsyncClient(base_url=pd.frontend.base_url, timeout=120) as client:
        async with client.stream("POST", "/v1/completions", json={
                "model": "tiny", "prompt": prompt(41, 90), "max_tokens": 120,
                "ignore_eos": True, "temperature": 0, "stream": True}) as resp:
            assert resp.status_code == 200
            lines = []
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if len(lines) == 1:
                        os.killpg(child.pid, signal.SIGKILL)  # a crash of P's server
        assert lines[-1] == "data: [DONE]" or "error" in lines[-1], lines[-1]
        await wait_for(lambda: child.proc.poll() is not None, 10, "P's server to be gone")
        after = await client.post("/v1/completions", json={
            "model": "tiny", "prompt": prompt(42, 60), "max_tokens": 4, "temperature": 0})
        assert after.status_code in (502, 503), after.text
        assert after.json()["error"]["message"], after.text
    await wait_quiet(pd.d.server.address)
    await wait_for(lambda: not live_members(child.pid), 30, "P's process group to be gone")
    # SGLang's load-snapshot file of P, seen while it ran, goes with P's engine
    shm = set(pd.p.engine._shm_files)  # type: ignore[attr-defined]
    assert shm and all(p.startswith("/dev/shm/sglang_loads_") for p in shm), shm
    await pd.p.engine.shutdown()
    assert not existing(shm)


def existing(paths: set[str]) -> list[str]:
    return [p for p in paths if os.path.exists(p)]


def live_members(pgid: int) -> list[int]:
    """The pids of process group ``pgid`` that still run (zombies, which a container's
    init may leave unreaped, do not count: they hold no memory, ports or KV)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # pid (comm) state ppid pgrp ...: comm may hold spaces, split after ')'
                state, _ppid, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
        except OSError:
            continue
        if int(pgrp) == pgid and state != "Z":
            pids.append(int(entry))
    return pids
