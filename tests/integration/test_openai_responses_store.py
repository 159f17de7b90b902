"""Issue 15's stored Responses API with the official ``openai`` client through a live mock
mesh (real etcd and Redis, an in-process mock worker, a router) and two frontends: one
storing responses behind API keys of two tenants, one with ``--responses-store-size 0``.

- ``store`` absent (OpenAI's default): ``client.responses.retrieve(id)`` gives the same
  object, whole and streamed (the ``response.completed`` object);
- ``previous_response_id`` continues the conversation: the second prompt is the first
  turn, its output and the new input (its input tokens equal those of the same
  conversation sent as chat messages), the id is echoed, an earlier instruction does
  not carry over; ``store: false`` is not stored;
- ``client.responses.delete(id)``, then retrieving it or continuing from it is a 404;
- another tenant's id is a 404 for retrieve, delete and ``previous_response_id``, the
  same as an unknown one, and its delete leaves the owner's response in place;
- storage off: ``store: true`` is a 400 naming ``store``, ``previous_response_id`` a 400
  naming it, retrieve a 404; ``background: true`` is a 400 naming ``background``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import openai
import pytest

from services.common.config import load_config
from services.common.procs import Child
from services.frontend.main import FrontendApp, FrontendConfig, start_frontend
from services.router.main import RouterApp, RouterConfig, start_router
from tests.integration.conftest import base_args, wait_routable
from tests.waiting import wait_for
from workers.fleet import Fleet, FleetConfig, start_fleet

NS = "respstore"
MODEL = "mock"
KEYS = "key-alice alice\nkey-bob bob\n"


@dataclass
class StoreMesh:
    fleet: Fleet
    router: RouterApp
    storing: FrontendApp
    stateless: FrontendApp

    def client(self, key: str = "key-alice", front: FrontendApp | None = None
               ) -> openai.AsyncOpenAI:
        f = front or self.storing
        return openai.AsyncOpenAI(base_url=f.base_url + "/v1", api_key=key, max_retries=0,
                                  timeout=60)

    def in_flight(self) -> int:
        return self.router.servicer._core.in_flight_count()  # noqa: SLF001


@pytest.fixture(scope="module")
async def mesh(etcd: Child, redis_server: Child, tiny_model: str,
               tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[StoreMesh]:
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(KEYS)
    args = [*base_args(etcd.address, NS), "--redis-url", f"redis://{redis_server.address}"]
    fleet = await start_fleet(load_config(FleetConfig, [
        *args, "--workers", "1", "--block-size", "16", "--num-blocks", "1024",
        "--max-model-len", "4096", "--timing", "zero", "--worker-id", "respstore-",
        "--model-path", tiny_model, "--model-name", MODEL], {}))
    router = await start_router(load_config(RouterConfig, [*args, "--load-poll-s", "0.2"],
                                            {}))
    front = [*args, "--http-port", "0", "--router-address", router.server.address,
             "--api-key-file", str(keys)]
    storing = await start_frontend(load_config(FrontendConfig, front, {}))
    stateless = await start_frontend(load_config(
        FrontendConfig, [*front, "--responses-store-size", "0"], {}))
    try:
        await wait_routable(router, 1, "the mock worker")
        await wait_for(lambda: all(f.pipeline.catalog.get(MODEL) is not None
                                   for f in (storing, stateless)), 30,
                       "both frontends to learn the model")
        yield StoreMesh(fleet, router, storing, stateless)
    finally:
        for f in (storing, stateless):
            await f.server.stop()
        await router.server.stop()
        await fleet.stop()


async def released(mesh: StoreMesh) -> None:
    await wait_for(lambda: mesh.in_flight() == 0, 10,
                   lambda: f"every router entry released ({mesh.in_flight()} left)")


async def test_stored_by_default_and_retrieved_whole_and_streamed(mesh: StoreMesh) -> None:
    client = mesh.client()
    resp = await client.responses.create(model=MODEL, input="hello there",
                                         max_output_tokens=6, metadata={"k": "v"})
    got = await client.responses.retrieve(resp.id)
    assert got.model_dump() == resp.model_dump() and got.output_text == resp.output_text
    done = None
    stream = await client.responses.create(model=MODEL, input="hello there",
                                           max_output_tokens=6, stream=True)
    async for event in stream:
        if event.type == "response.completed":
            done = event.response
    assert done is not None and done.output_text
    again = await client.responses.retrieve(done.id)
    assert again.model_dump() == done.model_dump()
    await released(mesh)


async def test_previous_response_id_continues_the_conversation(mesh: StoreMesh) -> None:
    client = mesh.client()
    first = await client.responses.create(model=MODEL, input="name a colour",
                                          instructions="Answer in French.",
                                          max_output_tokens=8)
    assert first.output_text and first.usage is not None
    second = await client.responses.create(model=MODEL, input="and another one",
                                           previous_response_id=first.id,
                                           max_output_tokens=4, store=False)
    assert second.previous_response_id == first.id and second.usage is not None
    # the same conversation sent whole, without the first turn's instructions (they do
    # not carry over, as OpenAI and vLLM): the very same prompt
    chat = await client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
        {"role": "user", "content": "name a colour"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "and another one"}])
    assert chat.usage is not None
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.usage.input_tokens > first.usage.input_tokens
    with pytest.raises(openai.NotFoundError):  # store: false
        await client.responses.retrieve(second.id)
    await released(mesh)


async def test_delete_then_404(mesh: StoreMesh) -> None:
    client = mesh.client()
    resp = await client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    await client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError) as err:
        await client.responses.retrieve(resp.id)
    assert isinstance(err.value.body, dict) and err.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        await client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError) as err:
        await client.responses.create(model=MODEL, input="more", previous_response_id=resp.id)
    e = err.value.body
    assert isinstance(e, dict) and e["param"] == "previous_response_id", e
    assert e["code"] == "previous_response_not_found"
    await released(mesh)


async def test_another_tenants_response_is_a_404(mesh: StoreMesh) -> None:
    alice, bob = mesh.client("key-alice"), mesh.client("key-bob")
    resp = await alice.responses.create(model=MODEL, input="secret", max_output_tokens=2)
    for call in (bob.responses.retrieve(resp.id), bob.responses.delete(resp.id),
                 bob.responses.create(model=MODEL, input="x", previous_response_id=resp.id),
                 bob.responses.retrieve("resp_never_stored")):
        with pytest.raises(openai.NotFoundError):
            await call
    assert (await alice.responses.retrieve(resp.id)).id == resp.id  # still there
    await released(mesh)


async def test_storage_off_refuses_store_and_previous(mesh: StoreMesh) -> None:
    client = mesh.client(front=mesh.stateless)
    for extra, param in (({"store": True}, "store"),
                         ({"previous_response_id": "resp_1"}, "previous_response_id"),
                         ({"background": True}, "background")):
        with pytest.raises(openai.BadRequestError) as err:
            await client.post("/responses", body={"model": MODEL, "input": "hi", **extra},
                              cast_to=dict)
        e = err.value.body
        assert isinstance(e, dict) and e["param"] == param, e
    resp = await client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):  # store absent: served, not stored
        await client.responses.retrieve(resp.id)
    await released(mesh)
