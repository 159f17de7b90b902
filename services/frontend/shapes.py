"""OpenAI response objects for completions and chat: choices, log-probabilities, echo.

Pure (no I/O; the tokenizer is passed in). Contract of :class:`Shapes` (one per request,
over a :class:`~services.frontend.fanout.FanJob`), matching vLLM's OpenAI server:

- ``add(index, chunk)`` records a choice's chunk and returns its streaming choice object
  (``{"index", "delta"|"text", "logprobs", "finish_reason"}``) or None when the chunk
  carries nothing to send; ``chunk_object(choice)`` wraps one in the chunk envelope.
  ``full(usage)`` is the non-streaming response: every choice by index.
  ``role_chunks()`` (chat streams): one ``{"role": "assistant", "content": ""}`` delta
  per choice, sent first. ``usage_chunk(usage)``: ``choices: []`` with the usage.
- **Token strings** are the model tokenizer's ``token_texts`` (each id decoded alone, as
  vLLM's logprobs spell them); ``bytes`` is their UTF-8 (invalid parts replaced).
  Log-probabilities are clamped at -9999.0 (JSON has no -inf), as vLLM does.
- **Top tokens** in vLLM's order: the sampled token first, then the worker's most likely
  tokens by rank without it. Chat ``top_logprobs`` takes the first ``top_logprobs`` of
  those (so a sampled token outside the top k is listed first, as vLLM lists it);
  completions' ``top_logprobs`` dict takes the first ``logprobs + 1`` (OpenAI: up to
  k + 1 entries).
- Chat ``logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
  "logprob", "bytes"}]}]}``; null when not asked. Completions ``logprobs``: ``{"tokens",
  "token_logprobs", "top_logprobs", "text_offset"}``; ``text_offset`` counts characters
  of the token strings from 0 (from the prompt's start with echo), running across
  streamed chunks.
- **echo** (completions): each choice's text starts with the prompt (the request's string,
  or the token-id prompt decoded with its special tokens); with ``logprobs`` the prompt's
  tokens lead the logprobs, the first with null ``token_logprobs`` and ``top_logprobs``.
  Streaming: both go with the choice's first chunk that has tokens.
- **Tool calls** (chat with ``tools``): each choice has its own
  :class:`~services.frontend.tools.ToolCallParser` (vLLM's hermes parser, over the
  tokenizer's ``hf`` tokenizer). Streaming, a chunk's ``delta`` is the parser's (content
  and/or ``tool_calls`` pieces; a chunk it holds back sends nothing unless it finishes or
  carries log-probabilities) and the finishing chunk's reason is
  ``stream_finish_reason``'s; the full response's ``message`` and ``finish_reason`` are
  ``finish``'s (``content`` null and ``tool_calls`` when the model called a tool).
- **return_token_ids** (vLLM's extension): each choice carries ``token_ids`` (what it
  generated; streamed, each chunk's own, and a chunk with tokens is sent even when it adds
  no text), and the prompt's ids go as ``prompt_token_ids``: on completions per choice
  (streamed: with its first chunk that has tokens), on chat at the top level (streamed:
  the role chunks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from protos import common_pb2
from services.frontend import tools
from services.frontend.fanout import FanJob
from services.frontend.jobs import Chunk

MIN_LOGPROB = -9999.0


class Spelling(Protocol):
    """What the shapes need of a tokenizer."""

    def token_texts(self, ids: Sequence[int]) -> list[str]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def ordered(entry: common_pb2.PositionLogprobs) -> list[common_pb2.TokenLogprob]:
    """The sampled token, then the top tokens by rank without it (vLLM's order)."""
    sampled = entry.token.token_id
    return [entry.token, *sorted((t for t in entry.top if t.token_id != sampled),
                                 key=lambda t: t.rank)]


def _lp(value: float) -> float:
    return max(float(value), MIN_LOGPROB)


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


class Speller:
    """Token id → token string, cached per request."""

    def __init__(self, tok: Spelling | None) -> None:
        self._tok = tok
        self._cache: dict[int, str] = {}

    def __call__(self, ids: Sequence[int]) -> list[str]:
        missing = sorted({i for i in ids if i not in self._cache})
        if missing:
            if self._tok is None:
                raise RuntimeError("log-probabilities need the model's tokenizer")
            self._cache.update(zip(missing, self._tok.token_texts(missing), strict=True))
        return [self._cache[i] for i in ids]


def chat_content(entries: Sequence[common_pb2.PositionLogprobs], spell: Speller,
                 k: int) -> list[dict[str, Any]]:
    """Chat ``logprobs.content`` items for ``entries`` (top ``k``)."""
    out = []
    for e in entries:
        tops = ordered(e)[:k]
        texts = spell([e.token.token_id, *(t.token_id for t in tops)])
        out.append({"token": texts[0], "logprob": _lp(e.token.logprob),
                    "bytes": _bytes(texts[0]),
                    "top_logprobs": [{"token": s, "logprob": _lp(t.logprob), "bytes": _bytes(s)}
                                     for s, t in zip(texts[1:], tops, strict=True)]})
    return out


def completion_logprobs(entries: Sequence[common_pb2.PositionLogprobs | None],
                        ids: Sequence[int], spell: Speller, k: int,
                        offset: int) -> tuple[dict[str, Any], int]:
    """Completions ``logprobs`` for ``ids`` (entry None: a position without one, the
    prompt's first token), text offsets from ``offset``; and the next offset."""
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, e in zip(ids, entries, strict=True):
        if e is None:
            text = spell([token_id])[0]
            token_lps.append(None)
            tops.append(None)
        else:
            top = ordered(e)[:k + 1]
            texts = spell([t.token_id for t in top])
            text = texts[0]
            token_lps.append(_lp(e.token.logprob))
            tops.append({s: _lp(t.logprob) for s, t in zip(texts, top, strict=True)})
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return ({"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
             "text_offset": offsets}, offset)


def _extend(acc: dict[str, Any] | None, part: dict[str, Any]) -> dict[str, Any]:
    if acc is None:
        return {k: list(v) for k, v in part.items()}
    for key, values in part.items():
        acc[key].extend(values)
    return acc


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    finish: str | None = None
    content: list[dict[str, Any]] = field(default_factory=list)  # chat logprobs
    logprobs: dict[str, Any] | None = None  # completions logprobs
    offset: int = 0
    started: bool = False  # its first chunk with tokens went out (echo)
    token_ids: list[int] = field(default_factory=list)  # generated (return_token_ids)


def usage_object(usage: tuple[int, int, int]) -> dict[str, Any]:
    p, c, cached = usage
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached}}


class Shapes:
    """The OpenAI objects of one request (module docstring)."""

    def __init__(self, fan: FanJob, tok: Spelling | None) -> None:
        self.fan = fan
        self.chat = fan.req.kind == "chat"
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        self.id = prefix + fan.request_id
        self.object = "chat.completion" if self.chat else "text_completion"
        self.chunk_object_name = "chat.completion.chunk" if self.chat else "text_completion"
        self._tok = tok
        self._spell = Speller(tok)
        self.k = fan.req.sampling.logprobs
        self._choices = [_Choice() for _ in fan.choices]
        tool_req = fan.req.tools if self.chat else None
        self._parsers = ([tools.ToolCallParser(getattr(tok, "hf", tok), tool_req)
                          for _ in fan.choices] if tool_req is not None else None)
        self.ids = fan.req.return_token_ids

    def head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.fan.created,
                "model": self.fan.req.model}

    def _prompt_text(self, index: int) -> str:
        job = self.fan.prompt_of(index)
        if job.req.prompt is not None:
            return job.req.prompt
        assert self._tok is not None
        return self._tok.decode(job.token_ids, skip_special_tokens=False)

    def add(self, index: int, chunk: Chunk) -> dict[str, Any] | None:
        """Records ``chunk`` of choice ``index``; its streaming choice object or None."""
        st = self._choices[index]
        text, lp = chunk.text, None
        ids: list[int] = list(chunk.token_ids)
        entries: list[common_pb2.PositionLogprobs | None] = list(chunk.logprobs)
        first = not st.started and bool(chunk.token_ids)
        st.token_ids.extend(chunk.token_ids)
        if self.fan.req.echo and first:
            prompt = self.fan.prompt_of(index)
            text = self._prompt_text(index) + text
            if self.k is not None:
                ids = prompt.token_ids + ids
                entries = [None, *chunk.prompt_logprobs[1:], *entries]
        if chunk.token_ids:
            st.started = True
        if self.k is not None and ids:
            if self.chat:
                part = chat_content([e for e in entries if e is not None], self._spell, self.k)
                st.content.extend(part)
                lp = {"content": part}
            else:
                lp, st.offset = completion_logprobs(entries, ids, self._spell, self.k,
                                                    st.offset)
                st.logprobs = _extend(st.logprobs, lp)
        st.text.append(text)
        if chunk.finish_reason is not None:
            st.finish = chunk.finish_reason
        if self._parsers is not None:
            out = self._tool_delta(index, text, chunk.finish_reason, lp, chunk.token_ids)
        elif not (text or chunk.finish_reason or lp or (self.ids and chunk.token_ids)):
            return None
        elif self.chat:
            delta = {"content": text} if text or chunk.finish_reason is None else {}
            out = {"index": index, "delta": delta, "logprobs": lp,
                   "finish_reason": chunk.finish_reason}
        else:
            out = {"index": index, "text": text, "logprobs": lp,
                   "finish_reason": chunk.finish_reason}
        if out is not None and self.ids:
            out["token_ids"] = list(chunk.token_ids)
            if first and not self.chat:
                out["prompt_token_ids"] = self.fan.prompt_of(index).token_ids
        return out

    def _tool_delta(self, index: int, text: str, finish: str | None,
                    lp: dict[str, Any] | None, ids: Sequence[int]) -> dict[str, Any] | None:
        """A chat stream's choice object through the choice's tool parser."""
        if not self.fan.req.stream:
            return None  # the full response parses the whole text once (``full``)
        assert self._parsers is not None
        parser = self._parsers[index]
        delta = parser.delta(text, finished=finish is not None)
        if delta is None and finish is None and lp is None and not (self.ids and ids):
            return None
        return {"index": index, "delta": delta or {}, "logprobs": lp,
                "finish_reason": None if finish is None
                else parser.stream_finish_reason(finish)}

    def chunk_object(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {**self.head(self.chunk_object_name), "choices": [choice]}

    def role_chunks(self) -> list[dict[str, Any]]:
        prompt = ({"prompt_token_ids": self.fan.prompt_of(0).token_ids} if self.ids else {})
        return [{**self.chunk_object({"index": i, "delta": {"role": "assistant",
                                                            "content": ""},
                                      "logprobs": None, "finish_reason": None}), **prompt}
                for i in range(len(self._choices))]

    def full(self, usage: tuple[int, int, int]) -> dict[str, Any]:
        choices = []
        for i, st in enumerate(self._choices):
            text = "".join(st.text)
            if self.chat:
                lp = {"content": st.content} if self.k is not None else None
                message: dict[str, Any] = {"role": "assistant", "content": text}
                finish = st.finish
                if self._parsers is not None:
                    out = self._parsers[i].finish(text, st.finish)
                    message, finish = out.message(), out.finish_reason
                choices.append({"index": i, "message": message, "logprobs": lp,
                                "finish_reason": finish})
            else:
                lp = (st.logprobs or completion_logprobs([], [], self._spell, 0, 0)[0]
                      ) if self.k is not None else None
                choices.append({"index": i, "text": text, "logprobs": lp,
                                "finish_reason": st.finish})
                if self.ids:
                    choices[-1]["prompt_token_ids"] = self.fan.prompt_of(i).token_ids
            if self.ids:
                choices[-1]["token_ids"] = st.token_ids
        response = {**self.head(self.object), "choices": choices,
                    "usage": usage_object(usage)}
        if self.ids and self.chat:
            response["prompt_token_ids"] = self.fan.prompt_of(0).token_ids
        return response

    def usage_chunk(self, usage: tuple[int, int, int]) -> dict[str, Any]:
        return {**self.head(self.chunk_object_name), "choices": [],
                "usage": usage_object(usage)}
