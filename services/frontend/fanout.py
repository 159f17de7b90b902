"""Fan-out: ``n`` choices per prompt and batches of prompts, as independent mesh requests.

Shared by the HTTP and gRPC APIs. Contract of :func:`run(pipeline, req)`, which returns
``(FanJob, AsyncIterator[(index, Chunk)])``:

- **One prompt, n = 1** is exactly :meth:`Pipeline.run` (same ids, spans, everything);
  every chunk comes as ``(0, chunk)``.
- **Otherwise** every prompt of the batch is prepared (tokenized, context-checked) before
  anything is routed (a bad prompt is a 400 and no choice starts), then every choice
  becomes its own mesh request, streamed by :meth:`Pipeline.stream` under one
  ``frontend.request`` span: request id ``<id>-<index>`` (``<id>`` the client's
  ``request_id`` or 32 fresh random hex digits; the response's id is ``<id>``), routed
  by the router like any request. Choices are started together, so the router decides
  where each goes: the KV-aware policy, which counts the prefixes it routed recently, tends to put
  the choices of one prompt on the worker that holds (or is computing) that prompt, and
  a batch's different prompts spread over workers by load. Nothing is pinned.
- **Index** as OpenAI's: ``prompt_index * n + choice``. **Seeds**: a given ``seed``
  becomes ``seed + choice`` for each choice (wrapped into int64), as vLLM's parallel
  sampling seeds its child requests; without a seed each choice samples freshly. The
  seed -1 means "no seed" to vLLM, so it is skipped: when ``seed < -1 <= seed + choice``
  the choice gets ``seed + choice + 1`` (every choice's seed stays distinct and set); a
  client's ``seed: -1`` is no seed for every choice (vLLM reads it so before fanning out).
- **Prompt log-probabilities** (echo with logprobs): only choice 0 of each prompt asks
  for them (one prefill that computes every prompt position, not n); its entries go on
  the first chunk with tokens of each of the prompt's other choices too, whose chunks
  are held back (in order) until choice 0's first chunk came.
- **Chunks** of all choices are interleaved as they arrive, each tagged with its index;
  every choice ends with its own finishing chunk (``finish_reason`` and that choice's
  usage). The consumer asks :class:`Tally` for the request's usage.
- **Failure**: the first choice that fails (an ApiError, before or after its first
  chunk) fails the request: the iterator raises that error (its message prefixed with
  ``choice <index>``), after cancelling every other choice and waiting for them (each
  releases its router entry and aborts its worker calls: the pipeline's exactly-once
  release). The consumer closing or cancelling the iterator does the same.
- **Usage** (:meth:`Tally.usage`): ``prompt_tokens`` counts each prompt once (its first
  choice's count), ``completion_tokens`` sums every choice, and ``cached_tokens`` is the
  sum over prompts of the **least** cached tokens of the prompt's (finished) choices:
  the prompt's cache hit as the request first saw it. Its choices run concurrently, and
  those that reach a worker after another one computed the prompt hit its blocks;
  whichever choice was scheduled first (not necessarily choice 0: a P/D handoff, or a
  worker's scheduler, may take choice 1 first) hit only what was cached before the
  request, the least of them. Counting the others would count the same prompt twice.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context

from services.frontend.jobs import Chunk, Job
from services.frontend.openai_schema import (
    INT64_MIN,
    ApiError,
    ParsedRequest,
    split_batch,
)
from services.frontend.pipeline import Pipeline

QUEUE_PER_CHOICE = 8  # chunks buffered per choice before a slow consumer holds them back


@dataclass
class FanJob:
    """A request's prompts (one prepared Job each) and its choices (one Job each)."""

    request_id: str
    req: ParsedRequest
    prompts: list[Job]
    choices: list[Job]  # by index: prompt_index * n + choice
    created: int

    @property
    def n(self) -> int:
        return self.req.n

    def prompt_of(self, index: int) -> Job:
        return self.prompts[index // self.n]


def _seed(seed: int | None, choice: int) -> int | None:
    """``seed + choice`` wrapped into int64, skipping -1 (module docstring)."""
    if seed is None or seed == -1 or choice == 0:
        return seed
    raw = seed + choice
    if seed < -1 <= raw:
        raw += 1
    return (raw - INT64_MIN) % 2**64 + INT64_MIN


def choice_job(job: Job, base_id: str, index: int, choice: int) -> Job:
    """The Job of choice ``choice`` (overall ``index``) of the prompt ``job``."""
    s = job.req.sampling
    req = replace(job.req, n=1, batch=(), sampling=replace(
        s, seed=_seed(s.seed, choice),
        prompt_logprobs=s.prompt_logprobs if choice == 0 else None))  # choice 0's are shared
    return replace(job, request_id=f"{base_id}-{index}", req=req)


@dataclass
class Tally:
    """The finishing chunk of each choice, and the request's usage (module docstring)."""

    fan: FanJob
    finals: dict[int, Chunk] = field(default_factory=dict)
    generated: dict[int, int] = field(default_factory=dict)  # tokens so far per choice

    def see(self, index: int, chunk: Chunk) -> None:
        self.generated[index] = self.generated.get(index, 0) + len(chunk.token_ids)
        if chunk.finish_reason is not None:
            self.finals[index] = chunk

    def running(self, index: int) -> dict[str, int]:
        """vLLM's continuous usage of choice ``index``: its prompt's tokens and the
        tokens it generated so far (``stream_options.continuous_usage_stats``)."""
        final = self.finals.get(index)
        prompt = (final.prompt_tokens if final is not None
                  else len(self.fan.prompt_of(index).token_ids))
        done = final.completion_tokens if final is not None else self.generated.get(index, 0)
        return {"prompt_tokens": prompt, "completion_tokens": done,
                "total_tokens": prompt + done}

    @property
    def done(self) -> bool:
        return len(self.finals) == len(self.fan.choices)

    def usage(self) -> tuple[int, int, int]:
        """(prompt_tokens, completion_tokens, cached_tokens) of what finished."""
        if len(self.fan.choices) == 1:  # one prompt, one choice: its finishing chunk
            only = self.finals.get(0)
            return ((only.prompt_tokens, only.completion_tokens, only.cached_tokens)
                    if only is not None else (0, 0, 0))
        n = self.fan.n
        firsts = [self.finals[i] for i in range(0, len(self.fan.choices), n)
                  if i in self.finals]
        prompt = sum(c.prompt_tokens for c in firsts)
        cached = sum(min(self.finals[i].cached_tokens for i in range(p, p + n)
                         if i in self.finals)
                     for p in range(0, len(self.fan.choices), n) if p in self.finals)
        return prompt, sum(c.completion_tokens for c in self.finals.values()), cached


async def run(pipeline: Pipeline, req: ParsedRequest) -> tuple[FanJob, AsyncIterator[
        tuple[int, Chunk]]]:
    """Prepares ``req``'s prompts and streams its choices (module docstring)."""
    if req.n == 1 and not req.batch:
        job, chunks = await pipeline.run(req)
        fan = FanJob(job.request_id, req, [job], [job], job.created)
        return fan, _tagged(chunks)
    span = pipeline.tracer.start_span("frontend.request", attributes={
        "kvmesh.model": req.model, "kvmesh.kind": req.kind, "kvmesh.stream": req.stream,
        "kvmesh.n": req.n, "kvmesh.prompts": max(len(req.batch), 1)})
    ctx = trace.set_span_in_context(span)
    try:
        with trace.use_span(span, end_on_exit=False):
            prompts = [await pipeline.prepare(r) for r in split_batch(req)]
    except BaseException as exc:
        span.record_exception(exc)
        span.end()
        raise
    base = req.request_id or os.urandom(16).hex()
    span.set_attribute("kvmesh.request_id", base)
    choices = [choice_job(job, base, p * req.n + c, c)
               for p, job in enumerate(prompts) for c in range(req.n)]
    fan = FanJob(base, replace(req, sampling=prompts[0].req.sampling), prompts, choices,
                 prompts[0].created)
    return fan, _merged(pipeline, fan, ctx, span)


async def _tagged(chunks: AsyncIterator[Chunk]) -> AsyncIterator[tuple[int, Chunk]]:
    try:
        async for chunk in chunks:
            yield 0, chunk
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


def _choice_error(index: int, err: ApiError) -> ApiError:
    return replace(err, message=f"choice {index}: {err.message}")


async def _merged(pipeline: Pipeline, fan: FanJob, ctx: Context,
                  span: trace.Span) -> AsyncIterator[tuple[int, Chunk]]:
    """Every choice's chunks, interleaved; the first failure cancels the rest."""
    queue: asyncio.Queue[tuple[int, Chunk | BaseException | None]] = asyncio.Queue(
        QUEUE_PER_CHOICE * len(fan.choices))

    async def pump(index: int, job: Job) -> None:
        chunks = pipeline.stream(job, ctx)
        try:
            async for chunk in chunks:
                await queue.put((index, chunk))
            await queue.put((index, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, who raises it
            await queue.put((index, exc))
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]

    tasks = [asyncio.ensure_future(pump(i, job)) for i, job in enumerate(fan.choices)]
    live = len(tasks)
    share = _PromptShare(fan)
    try:
        while live:
            index, item = await queue.get()
            if item is None:
                live -= 1
                for out in share.ended(index):
                    yield out
            elif isinstance(item, ApiError):
                raise _choice_error(index, item) from item
            elif isinstance(item, BaseException):
                raise ApiError(500, f"choice {index}: internal error: {item}",
                               type="internal_error") from item
            else:
                for out in share.see(index, item):
                    yield out
    except BaseException as exc:
        if not isinstance(exc, GeneratorExit | asyncio.CancelledError):
            span.record_exception(exc)
        raise
    finally:
        try:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:  # a re-cancelled gather must not skip it
            span.end()


class _PromptShare:
    """Choice 0's prompt log-probabilities for the prompt's other choices (module
    docstring); a pass-through when no prompt log-probabilities were asked (or n = 1)."""

    def __init__(self, fan: FanJob) -> None:
        self.n = fan.n
        self.on = fan.n > 1 and fan.req.sampling.prompt_logprobs is not None
        self.entries: dict[int, list[Any]] = {}  # prompt index -> choice 0's entries
        self.held: dict[int, list[tuple[int, Chunk]]] = {}  # prompt index -> held chunks
        self.started: set[int] = set()  # choices whose first chunk with tokens went out

    def _out(self, index: int, chunk: Chunk) -> tuple[int, Chunk]:
        if index % self.n and chunk.token_ids and index not in self.started:
            chunk.prompt_logprobs = list(self.entries[index // self.n])
        if chunk.token_ids:
            self.started.add(index)
        return index, chunk

    def _release(self, prompt: int, entries: list[Any]) -> list[tuple[int, Chunk]]:
        self.entries[prompt] = entries
        return [self._out(i, c) for i, c in self.held.pop(prompt, [])]

    def see(self, index: int, chunk: Chunk) -> list[tuple[int, Chunk]]:
        """What goes out now that choice ``index`` sent ``chunk``."""
        if not self.on:
            return [(index, chunk)]
        prompt = index // self.n
        if index % self.n == 0:
            out = [(index, chunk)]
            if chunk.token_ids and prompt not in self.entries:
                out += self._release(prompt, list(chunk.prompt_logprobs))
            return out
        if prompt not in self.entries:
            self.held.setdefault(prompt, []).append((index, chunk))
            return []
        return [self._out(index, chunk)]

    def ended(self, index: int) -> list[tuple[int, Chunk]]:
        """Choice ``index`` ended: choice 0 without a token releases what it held (their
        echo then lacks the prompt's entries; the shapes' check fails loudly)."""
        if not self.on or index % self.n or index // self.n in self.entries:
            return []
        return self._release(index // self.n, [])
