"""The frontend's door: without an API key, with an unknown one or with another scheme,
``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` and (``--metrics-auth``)
``/metrics`` answer 401 with an OpenAI error body and ``WWW-Authenticate: Bearer``; no
request reached the router or a worker. ``/health`` stays open. The gRPC Frontend API (TLS,
no client certificate required: users bring API keys): without a valid key in the
``authorization`` metadata, UNAUTHENTICATED, whatever certificate the caller holds;
plaintext does not get through the handshake."""

from __future__ import annotations

import grpc
import httpx
import pytest

from protos import common_pb2, frontend_pb2, frontend_pb2_grpc
from services.common.grpc_client import channel
from tests.security.conftest import (
    ALICE,
    MODEL,
    TIMEOUT_S,
    SecureMesh,
    assert_handshake_refused,
    drain,
    outsider_channels,
    refused,
)

BAD_KEYS = {
    "no key": {},
    "an unknown key": {"Authorization": "Bearer sk-mallory"},
    "a key under another scheme": {"Authorization": "Basic sk-alice"},
    "a bearer without a key": {"Authorization": "Bearer"},
}
ALICE_METADATA = (("authorization", ALICE["Authorization"]),)
REQUESTS = [
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "one two", "max_tokens": 4}),
    ("POST", "/v1/chat/completions", {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": "hello"}]}),
    ("GET", "/v1/models", None),
    ("GET", "/metrics", None),
]


@pytest.mark.parametrize("what", sorted(BAD_KEYS))
async def test_http_without_a_valid_key_is_401(secure: SecureMesh, what: str) -> None:
    before = await secure.settled()
    async with httpx.AsyncClient(base_url=secure.url, timeout=30) as client:
        for method, path, body in REQUESTS:
            resp = await client.request(method, path, json=body, headers=BAD_KEYS[what])
            assert resp.status_code == 401, (path, resp.text)
            assert resp.headers["www-authenticate"] == "Bearer", path
            error = resp.json()["error"]
            assert error["code"] == "invalid_api_key", (path, error)
            assert error["type"] and error["message"], (path, error)
            assert "sk-" not in error["message"], error  # a key is never echoed
    assert await secure.snapshot() == before


async def test_health_is_open_and_a_valid_key_gets_in(secure: SecureMesh) -> None:
    async with httpx.AsyncClient(base_url=secure.url, timeout=30) as client:
        health = await client.get("/health")
        assert health.status_code == 200 and health.json()["workers"] == 2, health.text
        assert (await client.get("/metrics", headers=ALICE)).status_code == 200
        models = await client.get("/v1/models", headers=ALICE)
        assert [m["id"] for m in models.json()["data"]] == [MODEL]


async def test_grpc_frontend_api_needs_a_key(secure: SecureMesh) -> None:
    """A TLS channel trusting the mesh CA, with no certificate, another CA's or a mesh
    one: no key or a bad one is UNAUTHENTICATED (no request ran), a valid key lists the
    models. Plaintext does not get through the handshake."""
    before = await secure.settled()
    address = secure.address("frontend")
    request = frontend_pb2.CompletionRequest(
        model=MODEL, prompt="one two", sampling=common_pb2.SamplingParams(max_tokens=2))
    plaintext = outsider_channels(address, secure.tls("admin").ca)["plaintext"]
    async with plaintext as ch:
        err = await refused(frontend_pb2_grpc.FrontendStub(ch).ListModels(
            frontend_pb2.ListModelsRequest(), metadata=ALICE_METADATA, timeout=TIMEOUT_S))
        assert_handshake_refused(err, "plaintext")
    users = {"no certificate": outsider_channels(address, secure.tls("admin").ca)[
        "TLS without a client certificate"], "another CA": channel(
        address, secure.foreign("frontend")), "a mesh certificate": channel(
        address, secure.tls("planner"))}
    for what, user in users.items():
        async with user as ch:
            stub = frontend_pb2_grpc.FrontendStub(ch)
            for metadata in ((), (("authorization", "Bearer sk-mallory"),),
                             (("authorization", "sk-alice"),)):
                err = await refused(drain(stub.Generate(request, metadata=metadata,
                                                        timeout=TIMEOUT_S)))
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED, (what, metadata, err)
                err = await refused(stub.ListModels(frontend_pb2.ListModelsRequest(),
                                                    metadata=metadata, timeout=TIMEOUT_S))
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED, (what, metadata, err)
            models = await stub.ListModels(frontend_pb2.ListModelsRequest(),
                                           metadata=ALICE_METADATA, timeout=TIMEOUT_S)
            assert [m.id for m in models.models] == [MODEL], what
    assert await secure.snapshot() == before
