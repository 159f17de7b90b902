"""The compatibility rows of vLLM's extensions of the OpenAI API (see :mod:`.cases`, whose
registry these join: ``cases`` imports this module last)."""

from __future__ import annotations

from typing import Any

from tests.compat.cases import IGNORE_EOS, PROMPT, USER, Target, case, usage


@case("structured_outputs")
async def structured_outputs(t: Target) -> Any:
    """vLLM's ``structured_outputs``: a regex, a choice and a grammar constrain greedy
    completions (each answer matches its constraint)."""
    import re

    out = []
    for so, ok in (({"regex": "[a-c]{3}x"}, lambda s: re.fullmatch("[a-c]{3}x", s)),
                   ({"choice": ["sunny day", "rain"]}, lambda s: s in ("sunny day", "rain")),
                   ({"grammar": 'root ::= "ab" | "cd"'}, lambda s: s in ("ab", "cd"))):
        resp = await t.client().completions.create(
            model=t.model, prompt="weather:", max_tokens=12, temperature=0,
            extra_body={"structured_outputs": so})
        text = resp.choices[0].text
        assert resp.choices[0].finish_reason == "stop" and ok(text), (so, resp.choices[0])
        out.append(text)
    return out


@case("continuous_usage")
async def continuous_usage(t: Target) -> Any:
    """``stream_options.continuous_usage_stats``: every chunk carries usage, the prompt's
    tokens and the tokens so far, growing to ``max_tokens``; the last chunk the total.

    Which counts appear in between is timing, not contract: a server whose client reads
    slower than the engine steps sends two tokens in one chunk (vLLM's output collector
    merges deltas the same way), so the compared result is the prompt and the total."""
    seen: list[tuple[int, int]] = []
    last = None
    opts: Any = {"include_usage": True, "continuous_usage_stats": True}
    async for chunk in await t.client().chat.completions.create(
            model=t.model, messages=USER, max_tokens=5, temperature=0, stream=True,
            stream_options=opts, extra_body=IGNORE_EOS):
        assert chunk.usage is not None, chunk
        u = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
        if chunk.choices:
            seen.append(u)
        else:
            last = u
    assert last is not None and last[1] == 5, (seen, last)
    assert [c for _, c in seen] == sorted(c for _, c in seen) and seen[-1][1] == 5, seen
    assert {p for p, _ in seen} == {last[0]}, seen
    return {"prompt": last[0], "completion": last[1]}


@case("render_options")
async def render_options(t: Target) -> Any:
    """``continue_final_message`` (with ``add_generation_prompt`` false) continues the
    assistant's message; ``add_special_tokens`` on a completion; each prompt as
    /tokenize renders it."""
    c = t.client()
    messages: Any = [*USER, {"role": "assistant", "content": "one, two,"}]
    opts = {"add_generation_prompt": False, "continue_final_message": True}
    resp = await c.chat.completions.create(model=t.model, messages=messages, max_tokens=4,
                                           temperature=0, extra_body={**opts, **IGNORE_EOS})
    status, tok = await t.post("/tokenize", {"model": t.model, "messages": messages, **opts})
    assert status == 200 and usage(resp.usage)[0] == tok["count"], (resp.usage, tok)
    comp = await c.completions.create(model=t.model, prompt=PROMPT, max_tokens=3,
                                      temperature=0,
                                      extra_body={"add_special_tokens": False, **IGNORE_EOS})
    return {"chat": [resp.choices[0].message.content, usage(resp.usage)],
            "completion": [comp.choices[0].text, usage(comp.usage)]}


@case("return_token_ids")
async def return_token_ids(t: Target) -> Any:
    """``return_token_ids``: the prompt's ids and each choice's generated ids, on
    completions (per choice) and chat (the prompt's at the top level)."""
    c = t.client()
    comp = (await c.completions.create(
        model=t.model, prompt=PROMPT, max_tokens=4, temperature=0,
        extra_body={"return_token_ids": True, **IGNORE_EOS})).model_dump()
    ch = comp["choices"][0]
    assert ch["prompt_token_ids"] == t.tok.encode(PROMPT) and len(ch["token_ids"]) == 4, ch
    chat = (await c.chat.completions.create(
        model=t.model, messages=USER, max_tokens=4, temperature=0,
        extra_body={"return_token_ids": True, **IGNORE_EOS})).model_dump()
    assert len(chat["choices"][0]["token_ids"]) == 4 and chat["prompt_token_ids"], chat
    return {"completion": [ch["prompt_token_ids"], ch["token_ids"]],
            "chat": [chat["prompt_token_ids"], chat["choices"][0]["token_ids"]]}


@case("truncate_prompt_tokens")
async def truncate_prompt_tokens(t: Target) -> Any:
    """``truncate_prompt_tokens`` = 3 keeps the prompt's last three tokens (usage counts
    3; the answer is the one to those three tokens)."""
    c = t.client()
    ids = t.tok.encode(PROMPT)
    cut = await c.completions.create(model=t.model, prompt=PROMPT, max_tokens=4,
                                     temperature=0,
                                     extra_body={"truncate_prompt_tokens": 3, **IGNORE_EOS})
    tail = await c.completions.create(model=t.model, prompt=ids[-3:], max_tokens=4,
                                      temperature=0, extra_body=IGNORE_EOS)
    assert usage(cut.usage)[0] == 3 and cut.choices[0].text == tail.choices[0].text, cut
    return [cut.choices[0].text, usage(cut.usage)]


@case("decoding_extensions")
async def decoding_extensions(t: Target) -> Any:
    """vLLM's ``allowed_token_ids``, ``bad_words``, ``include_stop_str_in_output`` and
    ``skip_special_tokens``, each changing greedy output as vLLM defines."""
    async def greedy(n: int = 6, **extra: Any) -> Any:
        resp = await t.client().completions.create(
            model=t.model, prompt="hello", max_tokens=n, temperature=0,
            extra_body={**IGNORE_EOS, "return_token_ids": True, **extra})
        return resp.choices[0].model_dump()

    allowed = t.tok.encode(" banana apple", add_special_tokens=False)
    only = await greedy(allowed_token_ids=allowed)
    assert set(only["token_ids"]) <= set(allowed), only
    free = await greedy()
    word = next(i for i in free["token_ids"] if (w := t.tok.decode([i])).strip().isalpha()
                and t.tok.encode(w, add_special_tokens=False) == [i])
    banned = await greedy(bad_words=[t.tok.decode([word])])
    assert word not in banned["token_ids"], (word, banned)
    stop = free["text"][2:4]
    cut = await greedy(stop=[stop])
    kept = await greedy(stop=[stop], include_stop_str_in_output=True)
    assert kept["text"] == cut["text"] + stop, (cut, kept)
    eos = {"logit_bias": {"2": 100}, "allowed_token_ids": [2, 5]}
    special = await greedy(n=2, skip_special_tokens=False, **eos)
    plain = await greedy(n=2, **eos)
    assert plain["text"] == "" and special["text"] == t.tok.decode([2, 2],
                                                                   skip_special_tokens=False)
    return [only["text"], banned["text"], cut["text"], kept["text"], special["text"]]


@case("stream_interval")
async def stream_interval(t: Target) -> Any:
    """vLLM's ``stream_interval`` = 4 on a streamed completion: the first tokens come at
    once, then every chunk but the last carries at least 4 tokens; the tokens and the
    text are the unstreamed answer's. (How many chunks is timing: a slow reader gets
    more tokens per chunk, so the chunk sizes are not compared.)"""
    sizes: list[int] = []
    ids: list[int] = []
    text = ""
    async for chunk in await t.client().completions.create(
            model=t.model, prompt=PROMPT, max_tokens=13, temperature=0, stream=True,
            extra_body={"stream_interval": 4, "return_token_ids": True, **IGNORE_EOS}):
        for ch in chunk.model_dump()["choices"]:
            got = ch.get("token_ids") or []
            if got:
                sizes.append(len(got))
            ids += got
            text += ch["text"]
    assert sum(sizes) == 13 and all(s >= 4 for s in sizes[1:-1]), sizes
    whole = (await t.client().completions.create(
        model=t.model, prompt=PROMPT, max_tokens=13, temperature=0,
        extra_body={"return_token_ids": True, **IGNORE_EOS})).choices[0].model_dump()
    assert (whole["text"], whole["token_ids"]) == (text, ids), (whole, text, ids)
    return {"text": text, "token_ids": ids}
