"""vLLM's /tokenize and /detokenize on the frontend: the model's own tokenizer, strict input.

The real frontend app over a real pipeline whose catalog serves the locally built tiny
Llama (its tokenizer and chat template; no worker is needed to tokenize). The ids are
checked against transformers' tokenizer of the same folder (what vLLM's server uses) and
against the ids the pipeline itself routes a completion with.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from protos import discovery_pb2
from services.frontend.http_api import create_app
from services.frontend.models import ModelCatalog
from services.frontend.openai_schema import parse_chat, parse_completion
from services.frontend.pipeline import INLINE_PROMPT_CHARS, Pipeline
from workers.model import tiny

MODEL = "tiny"
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello there, world."}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="module")
def pipeline(tiny_dir: Path) -> Pipeline:
    catalog = ModelCatalog()
    catalog.update([discovery_pb2.InstanceRecord(
        instance_id="w0", component="worker", address="127.0.0.1:1", model=MODEL,
        model_path=str(tiny_dir), block_size=32, max_model_len=256)])
    return Pipeline(catalog, lambda: None)


@pytest.fixture(scope="module")
def client(pipeline: Pipeline) -> TestClient:
    return TestClient(create_app(pipeline))


@pytest.fixture(scope="module")
def hf(tiny_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)


async def test_prompt_ids_are_the_tokenizers_and_the_ones_a_completion_routes_with(
    client: TestClient, pipeline: Pipeline, hf: Any,
) -> None:
    text = "The quick brown fox"
    r = client.post("/tokenize", json={"model": MODEL, "prompt": text,
                                       "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == hf.encode(text)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256
    assert body["token_strs"] == hf.convert_ids_to_tokens(body["tokens"])
    job = await pipeline.prepare(parse_completion({"model": MODEL, "prompt": text}))
    assert body["tokens"] == job.token_ids
    plain = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert plain.json()["tokens"] == hf.encode(text, add_special_tokens=False)
    assert plain.json()["token_strs"] is None  # the only model is the default


async def test_chat_ids_are_the_templates_and_the_ones_a_chat_routes_with(
    client: TestClient, pipeline: Pipeline, hf: Any,
) -> None:
    r = client.post("/tokenize", json={"model": MODEL, "messages": MESSAGES})
    assert r.status_code == 200, r.text
    rendered = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert r.json()["tokens"] == hf.encode(rendered, add_special_tokens=False)
    job = await pipeline.prepare(parse_chat({"model": MODEL, "messages": MESSAGES}))
    assert r.json()["tokens"] == job.token_ids
    bare = client.post("/tokenize", json={"messages": MESSAGES,
                                          "add_generation_prompt": False})
    assert len(bare.json()["tokens"]) < len(r.json()["tokens"])


async def test_tool_call_history_is_rendered_as_a_chat_renders_it(
    client: TestClient, pipeline: Pipeline,
) -> None:
    """An assistant's tool_calls and the tool's answer are in the ids, as in a chat."""
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {
                       "name": "weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.post("/tokenize", json={"model": MODEL, "messages": history})
    assert r.status_code == 200, r.text
    job = await pipeline.prepare(parse_chat({"model": MODEL, "messages": history}))
    assert r.json()["tokens"] == job.token_ids
    plain = client.post("/tokenize", json={"model": MODEL, "messages": [
        history[0], {"role": "assistant", "content": ""}, history[2]]})
    assert len(r.json()["tokens"]) > len(plain.json()["tokens"])  # the call is rendered


def test_detokenize_round_trips_with_special_tokens_kept(client: TestClient, hf: Any) -> None:
    ids = client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    r = client.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json()["prompt"] == hf.decode(ids)
    assert "<|im_start|>" in r.json()["prompt"]


BAD = [
    ("/tokenize", {"prompt": "x", "echo": True}, 400, "echo", "Unrecognized"),
    ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function"}]}, 400, "tools",
     "not supported"),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{{x}}"}, 400, "chat_template",
     "not supported"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400,
     "continue_final_message", "Cannot set both"),
    ("/tokenize", {"prompt": 5}, 400, "prompt", "must be a string"),
    ("/tokenize", {}, 400, "prompt", "one of 'prompt' or 'messages'"),
    ("/tokenize", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     400, "messages[0].content[0].image_url.url", ""),
    ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model", "does not exist"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens",
     "boolean"),
    ("/detokenize", {"tokens": [1, -2]}, 400, "tokens[1]", "token id"),
    ("/detokenize", {"tokens": [1, True]}, 400, "tokens[1]", "token id"),
    ("/detokenize", {"tokens": [10**6]}, 400, "tokens[0]", "not in the vocabulary"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens", "list"),
    ("/detokenize", {}, 400, "tokens", "required"),
]


@pytest.mark.parametrize("path,body,status,param,words", BAD)
def test_bad_input_is_refused_naming_the_field(client: TestClient, path: str,
                                               body: dict[str, Any], status: int,
                                               param: str, words: str) -> None:
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_keys_guard_tokenize_like_the_v1_api(pipeline: Pipeline) -> None:
    from services.frontend.auth import ApiKeys

    keyed = TestClient(create_app(pipeline, keys=ApiKeys([("sk-1", None)])))
    assert keyed.post("/tokenize", json={"prompt": "x"}).status_code == 401
    assert keyed.post("/detokenize", json={"tokens": [1]}).status_code == 401
    ok = keyed.post("/tokenize", json={"prompt": "x"},
                    headers={"Authorization": "Bearer sk-1"})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("others", [0, 1], ids=["alone", "others-in-flight"])
@pytest.mark.parametrize(("kind", "chars", "threaded"), [
    ("completion", 100, False), ("completion", INLINE_PROMPT_CHARS, False),
    ("completion", INLINE_PROMPT_CHARS + 1, True),
    ("chat", 100, False), ("chat", INLINE_PROMPT_CHARS + 1, True)])
async def test_short_prompts_are_tokenized_inline_and_long_ones_in_a_thread(
        tiny_dir: Path, hf: Any, monkeypatch: pytest.MonkeyPatch, kind: str, chars: int,
        threaded: bool, others: int) -> None:
    """A thread hop costs more than tokenizing a short prompt: only a prompt over
    INLINE_PROMPT_CHARS goes to a thread of its own. A short one is tokenized on the
    loop when it is the only request there, else on the tokenizer's encode thread (a
    chat's template rendered on the loop first). The ids are the same every way."""
    catalog = ModelCatalog()
    catalog.update([discovery_pb2.InstanceRecord(
        instance_id="w0", component="worker", address="127.0.0.1:1", model=MODEL,
        model_path=str(tiny_dir), block_size=32, max_model_len=1 << 20)])
    pipe = Pipeline(catalog, lambda: None)
    await pipe.prepare(parse_completion({"model": MODEL, "prompt": "warm"}))  # loaded
    hopped: list[str] = []
    real = asyncio.to_thread

    async def to_thread(fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        hopped.append(getattr(fn, "__name__", repr(fn)))
        return await real(fn, *args, **kwargs)

    monkeypatch.setattr(asyncio, "to_thread", to_thread)
    tok = catalog.loaded_tokenizer(catalog.get(MODEL))  # type: ignore[arg-type]
    assert tok is not None and tok._thread is not None
    off_loop: list[str] = []
    real_encode = tok._thread.encode

    def encode(text: str, add_special_tokens: bool) -> Any:
        off_loop.append(text)
        return real_encode(text, add_special_tokens)

    monkeypatch.setattr(tok._thread, "encode", encode)
    pipe.busy += others  # as if that many other requests were being streamed
    text = ("lorem ipsum " * (chars // 12 + 1))[:chars]
    if kind == "completion":
        job = await pipe.prepare(parse_completion({"model": MODEL, "prompt": text}))
        want = hf.encode(text)
    else:
        messages = [{"role": "user", "content": text}]
        job = await pipe.prepare(parse_chat({"model": MODEL, "messages": messages}))
        want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
    assert list(job.token_ids) == list(want)
    assert hopped == (["encode" if kind == "completion" else "apply_chat"]
                      if threaded else [])
    assert len(off_loop) == (1 if others and not threaded else 0)
