"""The express path of ``POST /v1/completions`` (:mod:`services.frontend.express`) serves
a plain completion as the general path does.

- ``accept``: over thousands of random bodies (valid and invalid values of the plain
  fields and others), every body it takes is one the general parser takes, with the same
  prompt and the same worker sampling parameters; it takes most valid plain bodies.
- Twin meshes (the same router seed, real RouterServicer, embedded or over gRPC, and
  mock-engine workers over in-process gRPC and TCP request planes), one app with the
  express path and one without, get the same random plain requests (shared prefixes,
  so the KV overlaps steer the picks): the same answers (but the id), the same routes,
  the same GenerateRequests to the same workers, the same PrefillDone and Release calls
  to the router, the same frontend metrics (seconds histograms: their counts), and
  nothing left in flight or counted busy; the express app took the express path.
- Hand-overs: a P/D model's request (routed by the express path, run by the general
  one), a worker's engine bug (INTERNAL: migrated until no worker is left, then the
  Route's 503; embedded router or over gRPC), a worker stopped after the first tokens
  (migrated: the answer whole, as without a failure), a Route whose answer is lost (the
  general path's error and Release): the express app answers as the general one, and
  releases everything.
- A client gone mid-request: the worker call cancelled, the entry released, counted
  ``outcome="cancelled"``.
- Where a span could record, the general path serves the request (it records them).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest

from protos import discovery_pb2, worker_pb2
from services.frontend import express as express_module
from services.frontend import handoff
from services.frontend import pipeline as pipeline_module
from services.frontend.express import FIELDS, Express
from services.frontend.http_api import create_app
from services.frontend.jobs import Job, sampling_proto
from services.frontend.openai_schema import ApiError, parse_completion
from services.frontend.pipeline import Pipeline
from services.frontend.router_calls import RouterCalls
from services.router.core import RouterCore
from tests.unit.test_frontend_release import (
    POISON,
    PROMPT,
    LostAnswerRouter,
    Setup,
    counter,
    mesh,
    node,
)
from tests.waiting import wait_for

AGG = discovery_pb2.WORKER_ROLE_AGG

# per field: values the general parser takes and values it refuses
VALUES: dict[str, list[Any]] = {
    "model": ["m", "other", "", 3, None, ["m"]],
    "prompt": [[1, 2, 3], [0], [2**31 - 1], "hi there", [], "", [1, True], [-1], [2**31],
               ["a"], [[1, 2]], "x" * 5000, 3.5, [1, 2.0], None, ["a", "b"]],
    "max_tokens": [None, 1, 16, 200, 0, -1, 2**31 - 1, 2**31, 1.0, True, "5"],
    "temperature": [None, 0, 0.0, 1, 1.5, 2, 2.0001, -0.1, True, "1", float("nan")],
    "top_p": [None, 0, 0.5, 1, 1.0, 1.01, -0.0, True, [0.5]],
    "seed": [None, 0, -1, 2**63 - 1, 2**63, -2**63, -2**63 - 1, 1.5, True],
    "ignore_eos": [None, True, False, 1, "true"],
    "stream": [None, False, True, 0, "false"],
    "n": [None, 1, 2, 0, True, 1.0],
}
OTHERS: dict[str, list[Any]] = {  # fields of the general path only
    "stop": ["\n", None], "echo": [True, False], "logprobs": [1, None], "user": ["u"],
    "best_of": [1], "stream_options": [None], "suffix": ["s"], "cache_salt": ["s"],
}


def random_body(rng: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {}
    for name, values in VALUES.items():
        if name in ("model", "prompt") and rng.random() < 0.9:  # mostly good, present
            body[name] = values[rng.randrange(4)]
        elif rng.random() < 0.4:
            body[name] = rng.choice(values)
    if rng.random() < 0.1:
        name = rng.choice(list(OTHERS))
        body[name] = rng.choice(OTHERS[name])
    return body


def test_accept_takes_only_what_the_general_parser_takes_alike() -> None:
    fast = Express(None)  # type: ignore[arg-type]  # (accept and sampling read no pipeline)
    rng = random.Random(5)
    taken = valid_not_taken = 0
    for _ in range(6000):
        body = random_body(rng)
        plain = fast.accept(body)
        try:
            req = parse_completion(body)
        except ApiError:
            assert plain is None, body
            continue
        if plain is None:
            valid_not_taken += 1
            continue
        taken += 1
        assert set(body) <= FIELDS
        assert req.n == 1 and not req.stream and not req.batch, body
        assert plain.model == req.model
        if isinstance(plain.prompt, str):
            assert req.prompt == plain.prompt and req.prompt_token_ids is None
        else:
            assert req.prompt_token_ids == tuple(plain.prompt) and req.prompt is None
        want = sampling_proto(Job("j", req, None, [1], 0))  # type: ignore[arg-type]
        got = fast.sampling(plain)
        assert got.SerializeToString(deterministic=True) == want.SerializeToString(
            deterministic=True), body
    assert taken > 300 and valid_not_taken > 100, (taken, valid_not_taken)


class Recorder:
    """The GenerateRequests each pipeline sends (by the pipeline's channel pool) and the
    routes it gets (by pipeline), and what each express run returned. Spans are taken as
    unrecorded (``records``: what ``records_nothing`` says), whatever provider another
    test installed in this process."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, records: bool = False) -> None:
        monkeypatch.setattr(express_module, "records_nothing", lambda: not records)
        self.frames: dict[int, list[tuple[str, worker_pb2.GenerateRequest]]] = {}
        self.routes: dict[int, list[Any]] = {}
        self.express: list[Any] = []
        self.told: dict[int, list[str]] = {}  # the router core's releases, by core
        real_generate, real_route = handoff.generate, RouterCalls.route
        real_run = Express.run

        def generate(pool: Any, streams: Any, choice: Any, request: Any) -> Any:
            copy = worker_pb2.GenerateRequest()
            copy.CopyFrom(request)
            copy.request_id = ""
            if copy.HasField("kv_transfer"):  # each mesh's P: its own engine and ids
                for name in ("remote_engine_id", "remote_request_id", "remote_host",
                             "remote_port"):
                    copy.kv_transfer.ClearField(name)
            self.frames.setdefault(id(pool), []).append((choice.instance_id, copy))
            return real_generate(pool, streams, choice, request)

        async def route(calls: RouterCalls, *args: Any) -> Any:
            resp = await real_route(calls, *args)
            self.routes.setdefault(id(calls), []).append(resp)
            return resp

        async def run(fast: Express, *args: Any) -> Any:
            out = await real_run(fast, *args)
            self.express.append(type(out).__name__)
            return out

        for name in ("release_prefill", "release"):  # PrefillDone's and Release's effect
            real = getattr(RouterCore, name)

            def told(core: RouterCore, rid: str, real: Any = real, name: str = name) -> Any:
                self.told.setdefault(id(core), []).append(name)
                return real(core, rid)
            monkeypatch.setattr(RouterCore, name, told)
        monkeypatch.setattr(handoff, "generate", generate)
        monkeypatch.setattr(pipeline_module, "generate", generate)
        monkeypatch.setattr(RouterCalls, "route", route)
        monkeypatch.setattr(Express, "run", run)

    def of(self, s: Setup) -> tuple[list[Any], list[Any], list[str]]:
        """``s``'s frames, routes (the workers' addresses, each mesh's own ports, and
        mock engine ids left out) and its router core's PrefillDone and Release
        effects (sorted: over gRPC a PrefillDone and the Release may cross)."""
        routes = []
        for route in self.routes.get(id(s.pipeline.routing), []):
            copy = type(route)()
            copy.CopyFrom(route)
            for choice in (copy.worker, copy.prefill):
                choice.address = choice.request_plane_address = ""
                choice.handoff.ClearField("engine_id")  # (random per mock engine)
            routes.append(copy)
        return (self.frames.get(id(s.pipeline._pool), []), routes,
                sorted(self.told.get(id(s.core), [])))


def metrics(p: Pipeline) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The frontend's samples; of a seconds histogram only its count."""
    out = {}
    for metric in p.metrics.registry.collect():
        timed = metric.type == "histogram" and metric.unit == "seconds" or \
            metric.name.endswith("_seconds")
        for s in metric.samples:
            if not s.name.startswith("kvmesh_") or (timed and not s.name.endswith("_count")):
                continue
            if s.name.endswith("_created"):
                continue
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@contextlib.asynccontextmanager
async def clients(a: Setup, b: Setup) -> AsyncIterator[tuple[httpx.AsyncClient,
                                                             httpx.AsyncClient]]:
    """HTTP clients of an app over ``a`` with the express path and one over ``b``
    without."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(a.pipeline)),
                                 base_url="http://a") as ca, \
            httpx.AsyncClient(transport=httpx.ASGITransport(
                app=create_app(b.pipeline, express=False)), base_url="http://b") as cb:
        yield ca, cb


async def twin_nodes(model: str, fault: str = "") -> list[Any]:
    return [await node(f"{model}-1", AGG, model, fault=fault),
            await node(f"{model}-2", AGG, model, fault=fault)]


def same_answer(a: httpx.Response, b: httpx.Response) -> dict[str, Any]:
    assert a.status_code == b.status_code, (a.text, b.text)
    ja, jb = a.json(), b.json()
    if a.status_code == 200:
        assert ja.pop("id").startswith("cmpl-") and jb.pop("id").startswith("cmpl-")
        assert abs(ja.pop("created") - jb.pop("created")) <= 60  # (each its own clock read)
    assert ja == jb
    return dict(ja)


@pytest.mark.parametrize("planes", [True, False], ids=["tcp", "call"])
@pytest.mark.parametrize("embedded", [True, False], ids=["embedded", "grpc"])
async def test_twin_meshes_answer_route_and_count_alike(planes: bool, embedded: bool,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    rec = Recorder(monkeypatch)
    rng = random.Random(11)
    heads = [list(range(100 + 40 * h, 140 + 40 * h)) for h in range(3)]
    async with mesh(await twin_nodes("m"), planes=planes, embedded=embedded) as a, \
            mesh(await twin_nodes("m"), planes=planes, embedded=embedded) as b, \
            clients(a, b) as (ca, cb):
        for i in range(40):
            body: dict[str, Any] = {
                "model": "m", "max_tokens": rng.choice([1, 2, 5, 17]),
                "prompt": rng.choice(heads) + [rng.randrange(3, 900) for _ in range(
                    rng.randrange(1, 30))]}
            for name, good in (("temperature", [0, 0.0, 1, 1.5]), ("top_p", [0.5, 1]),
                               ("seed", [0, -1, 2**63 - 1]), ("ignore_eos", [True, False])):
                if rng.random() < 0.4:
                    body[name] = rng.choice(good)
            if i % 7 == 3:
                body["stream"] = False
            ra = await ca.post("/v1/completions", json=body)
            rb = await cb.post("/v1/completions", json=body)
            answer = same_answer(ra, rb)
            assert answer["choices"][0]["finish_reason"] in ("length", "stop"), answer
            await a.settled()
            await b.settled()
            assert rec.of(a) == rec.of(b), i
            assert metrics(a.pipeline) == metrics(b.pipeline), i
            assert a.pipeline.busy == b.pipeline.busy == 0
        assert rec.express == ["dict"] * 40  # every one the express path's own
        frames, routes, told = rec.of(a)
        assert len(frames) == len(routes) == told.count("release") == 40
        assert "release_prefill" in told
        assert len({wid for wid, _ in frames}) == 2  # the picks were not all one worker


async def test_a_pd_request_is_handed_over_as_routed(monkeypatch: pytest.MonkeyPatch
                                                     ) -> None:
    rec = Recorder(monkeypatch)
    pd = [discovery_pb2.WORKER_ROLE_PREFILL, discovery_pb2.WORKER_ROLE_DECODE]
    async with mesh([await node(f"pd{r}", r, "pd") for r in pd], planes=True,
                    embedded=True) as a, \
            mesh([await node(f"pd{r}", r, "pd") for r in pd], planes=True,
                 embedded=True) as b, clients(a, b) as (ca, cb):
        for max_tokens in (1, 9):
            body = {"model": "pd", "prompt": list(PROMPT), "max_tokens": max_tokens}
            answer = same_answer(await ca.post("/v1/completions", json=body),
                                 await cb.post("/v1/completions", json=body))
            assert answer["usage"]["completion_tokens"] == max_tokens
            await a.settled()
            await b.settled()
            assert rec.of(a) == rec.of(b)
            assert metrics(a.pipeline) == metrics(b.pipeline)
        assert rec.express == ["Handover"] * 2
        assert a.pipeline.busy == b.pipeline.busy == 0


@pytest.mark.parametrize("embedded", [True, False], ids=["embedded", "grpc"])
async def test_an_engine_bug_migrates_then_answers_the_general_error(
        embedded: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(monkeypatch)
    async with mesh(await twin_nodes("px", "poison"), planes=True,
                    embedded=embedded) as a, \
            mesh(await twin_nodes("px", "poison"), planes=True, embedded=embedded) as b, \
            clients(a, b) as (ca, cb):
        body = {"model": "px", "prompt": [POISON, *PROMPT], "max_tokens": 8}
        answer = same_answer(await ca.post("/v1/completions", json=body),
                             await cb.post("/v1/completions", json=body))
        # migrated twice (to the other worker, then to none left): the Route's 503
        assert "no live worker left" in answer["error"]["message"], answer
        await a.settled()
        await b.settled()
        await a.pipeline.close()  # every fire-and-forget call has run (the last Route's
        await b.pipeline.close()  # best-effort Release)
        assert counter(a.pipeline, "kvmesh_frontend_migrations_total", stage="agg") == 2
        assert rec.of(a) == rec.of(b)
        assert metrics(a.pipeline) == metrics(b.pipeline)
        assert rec.express == ["Handover"]
        assert a.pipeline.busy == b.pipeline.busy == 0


async def test_a_worker_stopped_after_the_first_tokens_is_migrated_whole(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(monkeypatch)
    async with mesh(await twin_nodes("mig"), planes=True, embedded=True) as s:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(
                app=create_app(s.pipeline)), base_url="http://a") as client:
            body = {"model": "mig", "prompt": list(PROMPT), "max_tokens": 400,
                    "ignore_eos": True}  # (long enough to stop its worker mid-answer)
            reference = (await client.post("/v1/completions", json=body)).json()
            await s.settled()
            ttft = counter(s.pipeline, "kvmesh_ttft_seconds_count")
            call = asyncio.ensure_future(client.post("/v1/completions", json=body))
            # the first tokens came (the TTFT sample), the rest are being generated
            await wait_for(lambda: counter(s.pipeline, "kvmesh_ttft_seconds_count")
                           > ttft, 20, "the second request's first tokens")
            busy = [n for n in s.nodes if n.engine.load().num_running]
            assert len(busy) == 1, busy
            await busy[0].stop()
            answer = (await call).json()
        assert answer["choices"] == reference["choices"], (answer, reference)
        assert answer["usage"] == reference["usage"]
        assert counter(s.pipeline, "kvmesh_frontend_migrations_total", stage="agg") == 1
        assert rec.express == ["dict", "Handover"]
        await s.settled()
        assert s.pipeline.busy == 0


async def test_a_route_lost_after_the_commit_answers_as_the_general_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(monkeypatch)
    async with mesh([await node("l1", AGG, "lost")], LostAnswerRouter) as a, \
            mesh([await node("l1", AGG, "lost")], LostAnswerRouter) as b, \
            clients(a, b) as (ca, cb):
        body = {"model": "lost", "prompt": list(PROMPT), "max_tokens": 4}
        answer = same_answer(await ca.post("/v1/completions", json=body),
                             await cb.post("/v1/completions", json=body))
        assert answer["error"]["code"] == grpc.StatusCode.UNAVAILABLE.name.lower() or \
            "answer was lost" in answer["error"]["message"], answer
        await a.settled()
        await b.settled()
        await a.pipeline.close()
        await b.pipeline.close()
        assert metrics(a.pipeline) == metrics(b.pipeline)
        assert rec.express == []  # raised: no answer of its own
        assert a.pipeline.busy == b.pipeline.busy == 0


@pytest.mark.parametrize("embedded", [True, False], ids=["embedded", "grpc"])
async def test_a_client_gone_mid_request_cancels_and_releases(
        embedded: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(monkeypatch)
    async with mesh(await twin_nodes("gone"), planes=True, embedded=embedded) as s:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(
                app=create_app(s.pipeline)), base_url="http://a") as client:
            body = {"model": "gone", "prompt": list(PROMPT), "max_tokens": 400,
                    "ignore_eos": True}
            call = asyncio.ensure_future(client.post("/v1/completions", json=body))
            await wait_for(lambda: any(n.engine.load().num_running for n in s.nodes), 20,
                           "the request running on a worker")
            assert s.in_flight() == 1
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
        await s.settled()  # the worker runs nothing, the router holds nothing
        assert rec.of(s)[2].count("release") == 1  # released once
        assert counter(s.pipeline, "kvmesh_requests_total", outcome="cancelled") == 1
        assert counter(s.pipeline, "kvmesh_requests_total") == 1
        assert s.pipeline.busy == 0


async def test_a_span_that_could_record_leaves_the_request_to_the_general_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(monkeypatch, records=True)
    async with mesh(await twin_nodes("t"), planes=True, embedded=True) as s:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(
                app=create_app(s.pipeline)), base_url="http://a") as client:
            resp = await client.post("/v1/completions", json={
                "model": "t", "prompt": list(PROMPT), "max_tokens": 3})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
        assert rec.express == ["NoneType"]
        await s.settled()
