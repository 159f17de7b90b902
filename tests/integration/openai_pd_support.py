"""The OpenAI surface through a disaggregated mesh, with the official ``openai`` client,
against an aggregated vLLM worker of the same weights (issue 15's "Prove" for P/D).

:func:`assert_matches_aggregated` runs one of :data:`CASES` twice (cold, then warm: the
same request, the same ``cache_salt``) on the aggregated mesh and on the frontend over
P and D, and asserts that the P/D answers equal the aggregated ones token for token
(text, finish reasons, logprobs to 3 decimals (:func:`assert_same`), tool call names and
arguments), that usage (prompt, completion, cached tokens) is exact on both, and that
every request was disaggregated (one ``router.route`` span per choice, each
disaggregated, and ``kv_transfer`` spans of the given handoff mode).

The salt is the test's own (``<mode>-<case>``): the cold run hits no block another test
left in a cache, the warm run hits every full block of its prompt but the last token
(vLLM never reuses the last prompt token), on P for a disaggregated request (what
nobody computed), on the one worker for the aggregated one. Completions with ``echo`` and
``logprobs`` ask for prompt logprobs, with which vLLM skips reading the prefix cache:
their cached tokens are 0 warm too. ``n`` = 2: its choices run concurrently, and either
may reach P first (and compute the prompt for the other): usage counts the least hit of
a prompt's choices, 0 cold, whichever came first (services.frontend.fanout).

The tiny model's weights are random: JSON and tool calls ban whitespace-only tokens
(logit_bias), as test_openai_vllm.py does, or it fills JSON's optional whitespace. The
Responses API cases (``client.responses.create``, text and ``text.format`` json_schema)
compare status, output item types, text and usage; it has no logit_bias, so their schema
is an enum of strings (no optional whitespace).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import jsonschema
import openai
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.frontend.models import Tokenizer

MODEL = "tiny"
BLOCK = 32
# ~60 prompt tokens with the chat template: the warm run hits a full block.
QUESTION = ("count the colours of the rainbow from red to violet, one per line, and then "
            "say which of them is your favourite and why")
JSON_QUESTION = "a person as JSON: " + QUESTION
SCHEMA: dict[str, Any] = {
    "type": "object", "properties": {"ok": {"type": "boolean"},
                                     "name": {"enum": ["ann", "bob"]}},
    "required": ["ok", "name"], "additionalProperties": False}
CITY_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}}}
TIME_TOOL: dict[str, Any] = {"type": "function", "function": {"name": "get_time"}}
PROMPTS = ["the capital of france is a city whose name has five letters, it is called",
           "one two three four five six seven eight nine ten eleven twelve thirteen"]


@dataclass(frozen=True)
class Run:
    """What one request's answer must share with aggregated, and its usage."""

    answer: Any
    usage: tuple[int, int, int]  # prompt, completion, cached tokens


@dataclass(frozen=True)
class Case:
    run: Callable[[openai.AsyncOpenAI, str, Tokenizer], Awaitable[Run]]
    requests: int  # mesh requests (choices) per run
    check: Callable[[Run, Run, Tokenizer], None]  # (cold, warm): what aggregated must be


def assert_same(got: Any, ref: Any, path: str = "") -> None:
    """``got`` equals ``ref`` (runs, tuples, lists, strings, ints exactly; floats, the
    logprobs, to 3 decimals: within 5e-4), else an assertion naming the first difference."""
    if isinstance(ref, Run):
        assert isinstance(got, Run), (path, got)
        assert got.usage == ref.usage, f"{path}.usage: {got.usage} != {ref.usage}"
        assert_same(got.answer, ref.answer, path + ".answer")
    elif isinstance(ref, float) and not isinstance(got, bool):
        assert isinstance(got, float) and abs(got - ref) <= 5e-4, f"{path}: {got} != {ref}"
    elif isinstance(ref, list | tuple):
        assert type(got) is type(ref) and len(got) == len(ref), f"{path}: {got} != {ref}"
        for i, (g, r) in enumerate(zip(got, ref, strict=True)):
            assert_same(g, r, f"{path}[{i}]")
    else:
        assert got == ref, f"{path}: {got!r} != {ref!r}"


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                              timeout=120)


def _usage(u: Any) -> tuple[int, int, int]:
    assert u is not None and u.prompt_tokens_details is not None
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    return u.prompt_tokens, u.completion_tokens, u.prompt_tokens_details.cached_tokens


def _warm_hit(prompt_tokens: int) -> int:
    return (prompt_tokens - 1) // BLOCK * BLOCK


def _no_whitespace(tok: Tokenizer) -> dict[str, int]:
    return {str(i): -100 for i in range(tok.vocab_size)
            if (t := tok.decode([i], skip_special_tokens=False)) and not t.strip()}


def _chat_logprobs(choice: Any) -> list[Any]:
    content = choice.logprobs.content if choice.logprobs is not None else None
    assert content, choice
    return [(i.token, i.logprob, [(t.token, t.logprob) for t in i.top_logprobs])
            for i in content]


def _chat_answer(resp: Any) -> Run:
    return Run([(c.index, c.finish_reason, c.message.content, _chat_logprobs(c))
                for c in resp.choices], _usage(resp.usage))


async def _greedy_chat(client: openai.AsyncOpenAI, salt: str, tok: Tokenizer) -> Run:
    return _chat_answer(await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=8,
        temperature=0, logprobs=True, top_logprobs=3,
        extra_body={"ignore_eos": True, "cache_salt": salt}))


def _check_greedy_chat(cold: Run, warm: Run, tok: Tokenizer) -> None:
    prompt = len(tok.apply_chat([("user", QUESTION)]))
    assert prompt > BLOCK
    assert cold.usage == (prompt, 8, 0) and warm.usage == (prompt, 8, _warm_hit(prompt))
    [(_, finish, text, lps)] = warm.answer
    assert finish == "length" and len(lps) == 8 and all(len(t) == 3 for *_, t in lps)
    assert "".join(t for t, *_ in lps) == text


async def _json_schema(client: openai.AsyncOpenAI, salt: str, tok: Tokenizer) -> Run:
    return _chat_answer(await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": JSON_QUESTION}],
        max_tokens=40, temperature=0, logprobs=True, top_logprobs=2,
        logit_bias=_no_whitespace(tok), extra_body={"cache_salt": salt},
        response_format={"type": "json_schema", "json_schema": {"name": "p",
                                                                "schema": SCHEMA}}))


def _check_json_schema(cold: Run, warm: Run, tok: Tokenizer) -> None:
    [(_, finish, text, lps)] = warm.answer
    assert finish == "stop", warm
    jsonschema.validate(json.loads(text), SCHEMA)
    prompt, completion, _ = warm.usage
    assert len(lps) == completion and cold.usage == (prompt, completion, 0)
    assert warm.usage[2] == _warm_hit(prompt) > 0


async def _n2_seeded(client: openai.AsyncOpenAI, salt: str, tok: Tokenizer) -> Run:
    return _chat_answer(await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=8, n=2,
        seed=7, temperature=1.0, logprobs=True, top_logprobs=1,
        extra_body={"ignore_eos": True, "cache_salt": salt}))


def _check_n2_seeded(cold: Run, warm: Run, tok: Tokenizer) -> None:
    prompt = len(tok.apply_chat([("user", QUESTION)]))
    assert cold.usage == (prompt, 16, 0)
    assert warm.usage == (prompt, 16, _warm_hit(prompt))
    assert [c[0] for c in warm.answer] == [0, 1]
    assert_same(warm.answer, cold.answer, "warm vs cold")  # seeded: the same samples
    assert warm.answer[0][2] != warm.answer[1][2]  # seed + index: other samples


async def _batch_echo(client: openai.AsyncOpenAI, salt: str, tok: Tokenizer) -> Run:
    resp = await client.completions.create(
        model=MODEL, prompt=PROMPTS, max_tokens=4, temperature=0, echo=True, logprobs=2,
        extra_body={"ignore_eos": True, "cache_salt": salt})
    answer = []
    for c in resp.choices:
        lp = c.logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs
        answer.append((c.index, c.finish_reason, c.text, lp.tokens, lp.text_offset,
                       lp.token_logprobs,
                       [None if t is None else sorted(t.items()) for t in lp.top_logprobs]))
    return Run(answer, _usage(resp.usage))


def _check_batch_echo(cold: Run, warm: Run, tok: Tokenizer) -> None:
    lens = [len(tok.encode(p)) for p in PROMPTS]
    # prompt logprobs: vLLM skips reading the prefix cache, so nothing is cached warm either
    assert cold.usage == warm.usage == (sum(lens), 8, 0)
    assert [c[0] for c in warm.answer] == [0, 1]
    for (_, finish, text, tokens, _, lps, _), p, n in zip(warm.answer, PROMPTS, lens,
                                                          strict=True):
        assert finish == "length" and text.startswith(p) and len(tokens) == len(lps) == n + 4
        assert lps[0] is None and all(v is not None for v in lps[1:])


async def _tool_required(client: openai.AsyncOpenAI, salt: str, tok: Tokenizer) -> Run:
    resp = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "weather in Paris?"}],
        max_tokens=80, temperature=0, tools=[CITY_TOOL],  # type: ignore[call-overload]
        tool_choice="required", parallel_tool_calls=False, logit_bias=_no_whitespace(tok),
        extra_body={"cache_salt": salt})
    return Run([(c.index, c.finish_reason, c.message.content,
                 [(t.function.name, t.function.arguments)  # type: ignore[union-attr]
                  for t in c.message.tool_calls or []]) for c in resp.choices],
               _usage(resp.usage))


def _check_tool_required(cold: Run, warm: Run, tok: Tokenizer) -> None:
    [(_, finish, content, calls)] = warm.answer
    assert finish == "tool_calls" and not content and len(calls) == 1, warm
    name, args = calls[0]
    schemas = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"})
               for t in (CITY_TOOL, TIME_TOOL)}
    jsonschema.validate(json.loads(args), schemas[name])
    prompt, completion, _ = warm.usage
    assert cold.usage == (prompt, completion, 0)
    assert warm.usage[2] == _warm_hit(prompt) > 0


NAME_SCHEMA: dict[str, Any] = {"type": "string", "enum": ["ann", "bob"]}


def _responses_answer(resp: Any) -> Run:
    u = resp.usage
    assert u is not None and u.total_tokens == u.input_tokens + u.output_tokens
    return Run((resp.status, [o.type for o in resp.output], resp.output_text),
               (u.input_tokens, u.output_tokens, u.input_tokens_details.cached_tokens))


async def _responses_text(client: openai.AsyncOpenAI, salt: str, tok: Tokenizer) -> Run:
    return _responses_answer(await client.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=8, temperature=0,
        extra_body={"cache_salt": salt}))


def _check_responses_text(cold: Run, warm: Run, tok: Tokenizer) -> None:
    prompt = len(tok.apply_chat([("user", QUESTION)]))
    assert cold.usage == (prompt, 8, 0) and warm.usage == (prompt, 8, _warm_hit(prompt))
    assert warm.answer[:2] == ("incomplete", ["message"]) and warm.answer[2], warm


async def _responses_json(client: openai.AsyncOpenAI, salt: str, tok: Tokenizer) -> Run:
    # The Responses API has no logit_bias: a schema without optional whitespace to fill
    # (as test_openai_vllm.py's), so the random model must pick one of the names.
    return _responses_answer(await client.responses.create(
        model=MODEL, input=JSON_QUESTION, max_output_tokens=30, temperature=0,
        text={"format": {"type": "json_schema", "name": "name", "schema": NAME_SCHEMA}},
        extra_body={"cache_salt": salt}))


def _check_responses_json(cold: Run, warm: Run, tok: Tokenizer) -> None:
    status, kinds, text = warm.answer
    assert (status, kinds) == ("completed", ["message"]), warm
    jsonschema.validate(json.loads(text), NAME_SCHEMA)
    prompt, completion, _ = warm.usage
    assert cold.usage == (prompt, completion, 0)
    assert warm.usage[2] == _warm_hit(prompt) > 0


ANIMALS = "(cat|dog|cow) (cat|dog|cow) (cat|dog|cow)"


async def _vllm_extensions(client: openai.AsyncOpenAI, salt: str, tok: Tokenizer) -> Run:
    """vLLM's structured_outputs (a regex) with a stop string kept in the output
    (include_stop_str_in_output) and return_token_ids: the grammar starts on D, as on
    an aggregated worker."""
    resp = (await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=12,
        temperature=0, stop=[" "], extra_body={
            "cache_salt": salt, "return_token_ids": True, "include_stop_str_in_output": True,
            "structured_outputs": {"regex": ANIMALS}})).model_dump()
    return Run([(c["index"], c["finish_reason"], c["message"]["content"], c["token_ids"])
                for c in resp["choices"]] + [resp["prompt_token_ids"]],
               _usage(openai.types.CompletionUsage.model_validate(resp["usage"])))


def _check_vllm_extensions(cold: Run, warm: Run, tok: Tokenizer) -> None:
    import re

    [(_, finish, text, ids), prompt_ids] = warm.answer
    # the regex's first word, then the stop string, kept
    assert finish == "stop" and re.fullmatch("(cat|dog|cow) ", text), warm
    assert prompt_ids == tok.apply_chat([("user", QUESTION)]) and ids, warm
    prompt, completion, _ = warm.usage
    assert cold.usage == (prompt, completion, 0) and warm.usage[2] == _warm_hit(prompt) > 0


CASES: dict[str, Case] = {
    "vllm_extensions": Case(_vllm_extensions, 1, _check_vllm_extensions),
    "greedy_chat_logprobs": Case(_greedy_chat, 1, _check_greedy_chat),
    "json_schema_logprobs": Case(_json_schema, 1, _check_json_schema),
    "chat_n2_seeded": Case(_n2_seeded, 2, _check_n2_seeded),
    "completions_batch_echo_logprobs": Case(_batch_echo, 2, _check_batch_echo),
    "tool_choice_required": Case(_tool_required, 1, _check_tool_required),
    "responses_text": Case(_responses_text, 1, _check_responses_text),
    "responses_json_schema": Case(_responses_json, 1, _check_responses_json),
}


async def assert_matches_aggregated(case: str, mode: str, url: str, agg_url: str,
                                    tiny_model: str, spans: InMemorySpanExporter) -> None:
    """``CASES[case]`` through the frontend at ``url`` (over P/D, handoff ``mode``)
    equals the same on the aggregated mesh at ``agg_url`` (see the module docstring)."""
    c, tok, salt = CASES[case], Tokenizer(tiny_model), f"{mode}-{case}"
    ref = [await c.run(client(agg_url), salt, tok) for _ in range(2)]
    c.check(ref[0], ref[1], tok)
    spans.clear()
    got = [await c.run(client(url), salt, tok) for _ in range(2)]
    assert_same(got[0], ref[0], "cold")
    assert_same(got[1], ref[1], "warm")
    routes = [s.attributes or {} for s in spans.get_finished_spans()
              if s.name == "router.route"]
    assert len(routes) == 2 * c.requests, routes
    assert all(r["kvmesh.disaggregated"] is True for r in routes), routes
    modes = [(s.attributes or {}).get("kvmesh.handoff_mode")
             for s in spans.get_finished_spans() if s.name == "kv_transfer"]
    assert modes == [mode] * len(routes), modes
