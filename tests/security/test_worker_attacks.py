"""Sabotaging other users and bypassing the frontend on the workers:

- ``Worker.Abort`` with the id seen on a victim's live stream (the response id is
  ``cmpl-<mesh id>`` when the client chose none; the control test shows that a frontend's
  Abort with it does find the victim's request) is refused on both workers, for every
  attacker, and the victim's stream completes;
- ``Worker.Generate`` sent straight to a worker (no API key, no limit, no tenant salt) is
  refused; nothing changed: the workers ran nothing, the index got no block.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from protos import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.grpc_client import channel
from tests.security.conftest import (
    ALICE,
    MODEL,
    TIMEOUT_S,
    WHO,
    SecureMesh,
    attack,
    drain,
    roles_except,
)
from tests.waiting import wait_for

ABORT = "/kvmesh.worker.Worker/Abort"
GENERATE = "/kvmesh.worker.Worker/Generate"
LONG = 500  # tokens (~3 s on mock workers, the attacks ~0.4 s): checked, not assumed


@asynccontextmanager
async def victim_stream(mesh: SecureMesh, prompt: list[int],
                        max_tokens: int) -> AsyncIterator[tuple[str, AsyncIterator[Any]]]:
    """A streamed completion of alice's, open: yields (the id the worker knows it by, the
    rest of its SSE events) once its first event arrived."""
    async with httpx.AsyncClient(base_url=mesh.url, timeout=60) as client, client.stream(
            "POST", "/v1/completions", headers=ALICE, json={
                "model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}) as resp:
        assert resp.status_code == 200, await resp.aread()

        async def events() -> AsyncIterator[Any]:
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield json.loads(line[len("data: "):])
        stream = events()
        first = await anext(stream)
        assert first["id"].startswith("cmpl-"), first
        yield first["id"][len("cmpl-"):], stream


async def active(mesh: SecureMesh, address: str) -> int:
    """Requests a worker serves now (GetLoad as the router)."""
    async with channel(address, mesh.tls("router")) as ch:
        load = await worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(),
                                                            timeout=TIMEOUT_S)
    return load.active_requests


async def decoding(mesh: SecureMesh) -> None:
    """Waits until D serves the victim's request (its only one)."""
    n = 0

    async def one_active() -> bool:
        nonlocal n
        n = await active(mesh, mesh.decode.address)
        return n == 1
    await wait_for(one_active, 30, lambda: f"D to decode the victim's request ({n} active)")


async def test_the_id_on_a_victims_stream_is_the_one_its_worker_knows(
        secure: SecureMesh) -> None:
    """Control: with the frontend's certificate the Abort finds the victim's request, so
    the refusals below are refusals of a working attack."""
    await secure.settled()
    async with victim_stream(secure, list(range(7000, 7040)), LONG) as (mesh_id, rest):
        await decoding(secure)  # the first chunk is P's token, sent before D takes over
        async with channel(secure.decode.address, secure.tls("frontend")) as ch:
            found = await worker_pb2_grpc.WorkerStub(ch).Abort(
                worker_pb2.AbortRequest(request_id=mesh_id), timeout=TIMEOUT_S)
        assert found.found, mesh_id
        events = [e async for e in rest]
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if
                c["finish_reason"]]
    assert finishes == ["abort"], events[-3:]


async def test_abort_of_another_users_stream_is_refused(secure: SecureMesh) -> None:
    await secure.settled()
    async with victim_stream(secure, list(range(7100, 7140)), LONG) as (mesh_id, rest):
        # the victim's, decoding: the first chunk is P's token (first token from prefill),
        # sent before D has taken the request over
        await decoding(secure)
        request = worker_pb2.AbortRequest(request_id=mesh_id)
        for who in WHO:
            for worker in (secure.prefill, secure.decode):
                await attack(secure, who, worker.address, ABORT,
                             lambda ch: worker_pb2_grpc.WorkerStub(ch).Abort(
                                 request, timeout=TIMEOUT_S),
                             allowed="frontend", wrong_roles=roles_except("frontend"))
        # still decoding after every attempt: each was made while the stream was live
        assert await active(secure, secure.decode.address) == 1, \
            f"the victim's stream ended before the attacks did: make LONG (now {LONG}) longer"
        events = [e async for e in rest]
    assert events[-1]["usage"]["completion_tokens"] == LONG, events[-1]
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if
                c["finish_reason"]]
    assert finishes == ["length"], events[-3:]


async def test_generate_straight_to_a_worker_is_refused(secure: SecureMesh, who: str) -> None:
    before = await secure.settled()
    request = worker_pb2.GenerateRequest(
        request_id="bypass", token_ids=list(range(7200, 7300)), model=MODEL,
        sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0.0))
    for worker in (secure.prefill, secure.decode):
        await attack(secure, who, worker.address, GENERATE,
                     lambda ch: drain(worker_pb2_grpc.WorkerStub(ch).Generate(
                         request, timeout=TIMEOUT_S)),
                     allowed="frontend", wrong_roles=roles_except("frontend"))
    assert await secure.snapshot() == before
